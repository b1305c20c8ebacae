"""Soak runs end to end on the virtual iPhone: jetsam at the limit (checked against the raw report), completed,
hang, crash, a lost device, and partial results when a step fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrig.device.processes import pid_for
from kvrig.exceptions import AppError, SoakOutputExistsError
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.faults import FaultPlan
from tests.raw_telemetry import raw_steps
from tests.soak.conftest import BUNDLE_ID, Emulator, installed, on_device, run
from tests.virtual.conftest import LIMIT_BYTES

__all__ = ["installed"]
ROOT = Path(__file__).resolve().parents[2]
FAST = SoakOptions(poll_interval_s=0.2, hang_after_s=30, report_wait_s=5)


@pytest.fixture()
def faults_cleared(installed: Emulator) -> Iterator[Emulator]:
    yield installed
    installed.device.faults = FaultPlan()
    installed.host.run(installed.device.replug())
    installed.host.run(installed.device.apps.kill_all())


def _raw_report(path: Path) -> dict:
    """The report body straight from the .ips text: a JSON header line, then the JSON body."""
    header, body = path.read_text().split("\n", 1)
    assert json.loads(header)["bug_type"] == "298"
    return json.loads(body)


def test_soak_until_jetsam(installed: Emulator, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan = make_plan(max_tokens=1_000_000, step_tokens=512, decode_tokens=1, scheme="fp16")
    result = run(on_device(installed.udid, lambda d: run_soak(d, BUNDLE_ID, plan, out, FAST)))

    assert result.outcome == "jetsam", result.outcome_detail
    assert result.error is None and result.steps_done[-1] == "classify"
    saved = load_model_file(ResultsFile, out / "results.json")
    assert saved.runs == [result]

    (report_path,) = (out / "reports").glob("JetsamEvent-*.ips")
    assert report_path.read_bytes() == (installed.device.state.crash / report_path.name).read_bytes()
    body = _raw_report(report_path)
    (victim,) = [p for p in body["processes"] if p.get("reason")]
    assert victim["name"] == "KVSoak" == result.process
    at_kill = victim["rpages"] * body["memoryStatus"]["pageSize"]
    assert result.footprint_at_kill_bytes == at_kill
    assert result.limit_bytes == at_kill  # a per-process-limit kill happens at the limit
    assert at_kill >= LIMIT_BYTES  # the emulator was told 160 MiB

    steps = raw_steps(out / "telemetry.jsonl")
    assert steps and all(s["run_id"] == plan.run_id for s in steps)
    assert result.max_context_reached == max(s["context_tokens"] for s in steps)
    assert result.max_safe_context == steps[-1]["context_tokens"]
    assert result.last_footprint_bytes == steps[-1]["phys_footprint_bytes"] < LIMIT_BYTES
    assert [p.context_tokens for p in result.tps_curve] == [s["context_tokens"] for s in steps]
    assert [p.decode_tps for p in result.tps_curve] == [s["decode_tps"] for s in steps]
    assert all(p.decode_tps for p in result.tps_curve)
    assert result.app_limit_bytes == LIMIT_BYTES
    # the plan the app ran is the plan we wrote
    assert [s["context_tokens"] for s in steps] == [512 * (i + 1) for i in range(len(steps))]
    assert json.loads((out / "soakplan.json").read_text())["run_id"] == plan.run_id

    # `kvrig telemetry --report` finds the process in results.json: the report's victim, no --process needed
    told = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrig",
            "telemetry",
            str(out / "telemetry.jsonl"),
            "--report",
            str(report_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert told.returncode == 0, told.stderr
    (corr,) = [r["correlation"] for r in json.loads(told.stdout)]
    assert corr["process"] == victim["name"] and corr["killed"] and corr["report_footprint_bytes"] == at_kill


def test_soak_that_completes_kills_the_finished_app(installed: Emulator, tmp_path: Path) -> None:
    # 512: the step to 768 peaks above the 160 MiB limit while the cache grows (old and new buffers at once)
    plan = make_plan(max_tokens=512, step_tokens=256, decode_tokens=1)
    result = run(on_device(installed.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, FAST)))
    assert result.outcome == "completed"
    assert result.max_context_reached == 512
    assert result.files.jetsam_reports == [] and result.footprint_at_kill_bytes is None
    ends = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines() if '"end"' in x]
    assert [e["reason"] for e in ends] == ["completed"]
    assert run(on_device(installed.udid, lambda d: pid_for(d, BUNDLE_ID))) == 0


def test_hang_is_detected_and_killed(faults_cleared: Emulator, tmp_path: Path) -> None:
    emulator = faults_cleared
    emulator.device.faults = FaultPlan(hang_at_tokens=512)
    plan = make_plan(max_tokens=100_000, step_tokens=256, decode_tokens=1)
    options = SoakOptions(poll_interval_s=0.2, hang_after_s=2.0, report_wait_s=2)
    result = run(on_device(emulator.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, options)))
    assert result.outcome == "hang"
    assert result.max_context_reached == 256  # the step at 512 never came back
    assert emulator.device.apps.pid_for_bundle(BUNDLE_ID) == 0  # we killed it


def test_unplugged_phone_is_device_lost(faults_cleared: Emulator, tmp_path: Path) -> None:
    emulator = faults_cleared
    (emulator.device.state.container(BUNDLE_ID) / "Documents" / "telemetry.jsonl").unlink(missing_ok=True)
    # The cable goes once the driver has pulled two steps (its local copy), not when the app wrote them: the app
    # can write both between two polls, and then nothing was pulled before the loss.
    pulled = tmp_path / "telemetry.jsonl"

    def pull_the_cable_after_two_steps() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pulled.exists() and pulled.read_text().count('"event":"step"') >= 2:
                emulator.host.run(emulator.device.unplug())
                return
            time.sleep(0.05)

    cable = threading.Thread(target=pull_the_cable_after_two_steps)
    cable.start()
    plan = make_plan(max_tokens=100_000, step_tokens=256, decode_tokens=1)
    options = SoakOptions(poll_interval_s=0.2, hang_after_s=30, reconnect_s=1.0)
    result = run(on_device(emulator.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, options)))
    cable.join()
    assert result.outcome == "device_lost"
    assert not emulator.device.plugged
    saved = load_model_file(ResultsFile, tmp_path / "results.json").runs[0]
    assert saved.outcome == "device_lost" and saved.files.telemetry == "telemetry.jsonl"
    assert saved.max_context_reached is not None  # what was pulled before the loss is kept


def test_phone_gone_before_the_reports_is_device_lost(faults_cleared: Emulator, tmp_path: Path) -> None:
    """The app crashes and the cable goes as the driver asks for the crash reports (once the run is under way:
    the driver flushes them at its start too): the run ends device_lost with its telemetry, not an exception."""
    emulator = faults_cleared
    emulator.device.faults = FaultPlan(crash_at_tokens=512)
    pulled = tmp_path / "telemetry.jsonl"

    def cut_at_the_reports_once_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pulled.exists() and '"event":"step"' in pulled.read_text()):
            time.sleep(0.05)
        emulator.device.faults.unplug_on_service = "com.apple.crashreportmover"

    arm = threading.Thread(target=cut_at_the_reports_once_running)
    arm.start()
    plan = make_plan(max_tokens=4096, step_tokens=256, decode_tokens=1)
    result = run(on_device(emulator.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, FAST)))
    arm.join()
    assert not emulator.device.plugged  # the fault fired: the cable went at the reports
    assert result.outcome == "device_lost" and result.lost == "device"
    assert result.outcome_detail is not None and "the app is gone" in result.outcome_detail
    saved = load_model_file(ResultsFile, tmp_path / "results.json").runs[0]
    assert saved.outcome == "device_lost" and saved.error is None
    assert "pull reports" not in saved.steps_done and saved.files.crash_reports == []
    assert saved.max_context_reached is not None  # the telemetry pulled before is kept


def test_missing_app_leaves_partial_results(installed: Emulator, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=512)
    with pytest.raises(AppError):
        run(on_device(installed.udid, lambda d: run_soak(d, "com.example.absent", plan, tmp_path, FAST)))
    saved = load_model_file(ResultsFile, tmp_path / "results.json").runs[0]
    assert saved.outcome is None and saved.error.startswith("find app: ")
    assert saved.device.udid == installed.udid and saved.steps_done == []
    assert saved.device.virtual is True  # the results say so: calibrate keeps its limit out of the registry


def test_a_soak_that_never_started_does_not_block_its_retry(installed: Emulator, tmp_path: Path) -> None:
    """A misspelt --app-id left results.json behind, and the same command with the right id was refused (53):
    the record of a soak that stopped before its first step is replaced; one with a step done never is."""
    out = tmp_path / "soak"
    common = ["--udid", installed.udid, "--max-tokens", "512", "--decode-tokens", "1", "-o", str(out)]
    for _ in range(2):  # the second run reaches the phone again: the first one's record did not stop it
        proc = _cli(installed, "soak", "--app-id", "com.example.absent", *common)
        assert proc.returncode == AppError.exit_code, proc.stderr
    saved = load_model_file(ResultsFile, out / "results.json").runs[0]
    assert saved.error is not None and saved.error.startswith("find app: ") and saved.steps_done == []
    # A run with a step done is a measurement: never replaced.
    started = saved.model_copy(update={"steps_done": ["find app"]})
    (out / "results.json").write_text(ResultsFile(tool_version="x", runs=[started]).model_dump_json(by_alias=True))
    proc = _cli(installed, "soak", "--app-id", "com.example.absent", *common)
    assert proc.returncode == SoakOutputExistsError.exit_code, proc.stderr
    # Nor is a folder holding anything else beside them.
    (out / "results.json").write_text(ResultsFile(tool_version="x", runs=[saved]).model_dump_json(by_alias=True))
    (out / "notes.txt").write_text("mine\n")
    proc = _cli(installed, "soak", "--app-id", "com.example.absent", *common)
    assert proc.returncode == SoakOutputExistsError.exit_code, proc.stderr


def _cli(emulator: Emulator, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_cli_soak_json_and_crash_exit_code(faults_cleared: Emulator, tmp_path: Path) -> None:
    emulator = faults_cleared
    common = ["soak", "--app-id", BUNDLE_ID, "--udid", emulator.udid, "--step-tokens", "256", "--decode-tokens", "1"]
    ok = _cli(emulator, *common, "--max-tokens", "512", "-o", str(tmp_path / "ok"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["outcome"] == "completed"

    emulator.device.faults = FaultPlan(crash_at_tokens=512)
    crashed = _cli(emulator, *common, "--max-tokens", "4096", "-o", str(tmp_path / "crash"))
    assert crashed.returncode == 63, crashed.stderr  # AppCrashError: a crash with its report
    assert "crash" in crashed.stderr and "Traceback" not in crashed.stderr
    assert "evidence (crash_report): the app's crash report: reports/KVSoak-" in crashed.stdout
    assert "the phone stated a limit of 160.0 MiB (iPhone16,1" in crashed.stdout  # the emulator's 160 MiB
    saved = load_model_file(ResultsFile, tmp_path / "crash" / "results.json").runs[0]
    assert saved.outcome == "crash" and saved.files.crash_reports
    (report,) = [tmp_path / "crash" / p for p in saved.files.crash_reports]
    assert json.loads(report.read_text().split("\n", 1)[0])["bug_type"] == "309"
