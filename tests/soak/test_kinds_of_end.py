"""Every kind of end told apart, with its evidence, and the limit the phone states in its log: soaks on the
virtual iPhone, read through the real pymobiledevice3 client (syslog_relay, installation_proxy, crash reports).

Expected values come from what the emulator was told (a 160 MiB limit, the fault set) and from the real log
lines quoted in issue 26 (an iPadOS 26 phone, getdictus/dictus-ios#202), never from the reader under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from examples.make_test_ipa import make_ipa
from kvrig.cli import cli as main_cli
from kvrig.device import apps
from kvrig.profiles import INCREASED_MEMORY_LIMIT, load_profile
from kvrig.reports.devicelog import AppLog
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.faults import FaultPlan
from tests.soak.conftest import BUNDLE_ID, Emulator, installed, on_device, run
from tests.virtual.conftest import LIMIT_BYTES, lockdown_values

__all__ = ["installed"]
ROOT = Path(__file__).resolve().parents[2]
FAST = SoakOptions(poll_interval_s=0.2, hang_after_s=30, report_wait_s=3)
MIB = 1024 * 1024
ENTITLED_ID, ENTITLED_EXE = "dev.kvrig.entitled", "KVEntitled"

# A real iPadOS 26 log (issue 26), as syslog_relay sends it: "<date> <name> <process>[<pid>] <<Level>>: <message>"
REAL_LINES = [
    "Nov 12 10:01:02 iPad runningboardd(RunningBoard)[33] <Notice>: [DictusKeyboard:6637] Memory Limits: active 90 "
    "inactive 90",
    "Nov 12 10:01:09 iPad kernel[0] <Notice>: memorystatus: DictusKeyboard [6637] exceeded mem limit: ActiveHard 90 MB "
    "(fatal)",
    "Nov 12 10:01:09 iPad kernel[0] <Notice>: memorystatus: killing_specific_process pid 6637 [DictusKeyboard] "
    "(per-process-limit 100 4s) 92161KB",
    "Nov 12 10:01:09 iPad ReportSystemMemory[187] <Notice>: Process DictusKeyboard [6637] killed by jetsam reason "
    "per-process-limit",
]


def test_the_real_lines_read_as_a_90_mb_limit_and_a_jetsam_kill() -> None:
    log = AppLog("DictusKeyboard")
    log.pid = 6637
    for line in ["Nov 12 10:01:00 iPad SpringBoard[34] <Notice>: idle timer tick", *REAL_LINES]:
        log.feed(line)
    assert (log.active_mb, log.inactive_mb) == (90, 90)
    assert log.active_bytes == 90 * MIB  # xnu's memlimit MB are MiB
    assert (log.exceeded_kind, log.exceeded_mb) == ("ActiveHard", 90)
    assert [kind for kind, _ in log.ends] == ["jetsam", "jetsam", "jetsam"]
    assert log.lines == REAL_LINES

    other = AppLog("DictusKeyboard")
    other.pid = 1  # another launch of the same app: its lines are not this run's
    for line in REAL_LINES:
        other.feed(line)
    assert other.active_mb is None and other.ends == []


def test_a_phone_that_repeats_itself_is_kept_within_bounds() -> None:
    log = AppLog("DictusKeyboard")
    for _ in range(5000):
        log.feed(REAL_LINES[1] + " " + "x" * 100_000)
    assert len(log.lines) == len(log.ends) == 200 and max(map(len, log.lines)) == 2000


@pytest.fixture(scope="module")
def entitled(installed: Emulator, tmp_path_factory: pytest.TempPathFactory) -> Emulator:
    """A second app whose signature carries the increased-memory-limit entitlement."""
    ipa = make_ipa(
        tmp_path_factory.mktemp("ipa") / "entitled.ipa",
        ENTITLED_ID,
        ENTITLED_EXE,
        entitlements={INCREASED_MEMORY_LIMIT: True, "get-task-allow": True},
    )
    run(on_device(installed.udid, lambda d: apps.install(d, ipa)))
    return installed


def test_a_soak_records_the_limit_the_phone_stated(entitled: Emulator, tmp_path: Path) -> None:
    emulator = entitled
    profile = load_profile("iPhone16,1")
    assert LIMIT_BYTES not in (profile.limit_default, profile.limit_entitled)  # the log must beat the profile
    values = lockdown_values(emulator.udid)  # what lockdownd tells the real client, not what kvrig says

    plan = make_plan(max_tokens=1_000_000, step_tokens=512, decode_tokens=1, scheme="fp16")
    result = run(on_device(emulator.udid, lambda d: run_soak(d, ENTITLED_ID, plan, tmp_path, FAST)))

    assert result.outcome == "jetsam", result.outcome_detail
    stated = result.stated_limit
    assert stated is not None
    assert stated.active_bytes == stated.inactive_bytes == LIMIT_BYTES  # the emulator was told 160 MiB
    assert stated.exceeded_bytes == LIMIT_BYTES and stated.exceeded_kind == "ActiveHard"
    assert stated.limit_bytes == LIMIT_BYTES
    assert (stated.product_type, stated.build_version) == (values["ProductType"], values["BuildVersion"])
    assert stated.entitled is True
    assert f"[{ENTITLED_EXE}:" in stated.lines[0] and "Memory Limits: active 160 inactive 160" in stated.lines[0]
    assert [e.kind for e in result.evidence] == ["jetsam_report", "log"]
    assert result.evidence[0].file == result.files.jetsam_reports[0]
    assert "exceeded mem limit: ActiveHard 160 MB (fatal)" in (result.evidence[1].line or "")

    saved = load_model_file(ResultsFile, tmp_path / "results.json")
    assert saved.schema_version == 5 and saved.runs[0].stated_limit == stated
    assert saved.runs[0].device.build_version == values["BuildVersion"]

    # The registry a team commits, and a plan made with it: the phone's 160 MiB, not the profile's limit.
    # A virtual phone's limit is the one it was started with: kept only when asked for.
    registry = tmp_path / "limits.json"
    cli = CliRunner()
    args = ["calibrate", str(tmp_path / "results.json"), "--limits", str(registry), "--limits-only", "--json"]
    left_out = json.loads(cli.invoke(main_cli, args).output)
    assert left_out["added"] == 0 and "a virtual iPhone's limit" in left_out["skipped"][0]
    registry.unlink()
    done = cli.invoke(main_cli, [*args, "--include-virtual"])
    assert done.exit_code == 0, done.output
    said = json.loads(done.output)
    assert said["added"] == 1 and said["skipped"] == [] and said["file"] == str(registry)
    assert said["registry"] == json.loads(registry.read_text())  # what it wrote, as it wrote it
    (entry,) = json.loads(registry.read_text())["limits"]
    assert (entry["product_type"], entry["build_version"], entry["entitled"]) == (
        values["ProductType"],
        values["BuildVersion"],
        True,
    )
    assert entry["limit_bytes"] == LIMIT_BYTES and entry["runs"] == 1
    plan_args = ["plan", "--device", values["ProductType"], "--schemes", "k8v4", "--weights", "q4", "--recipes", "q4"]
    plan_args += ["--contexts", "1024", "--json"]
    measured = json.loads(_ok(cli.invoke(main_cli, [*plan_args, "--limits", str(registry)])))
    assert measured["limit_bytes"] == LIMIT_BYTES and measured["limit_kind"] == "entitled"
    said = measured["limit_measured_from"]
    assert str(registry) in said and values["BuildVersion"] in said and "entitled" in said
    assert "1 of 1 from a virtual iPhone" in said  # kept by --include-virtual: no phone's limit, and it says so
    # An app without the entitlement has no measured limit here: the plan falls back to the profile's, and says so.
    default = json.loads(_ok(cli.invoke(main_cli, [*plan_args, "--limits", str(registry), "--limit", "default"])))
    assert default["limit_bytes"] == profile.limit_default and default["limit_measured_from"] is None
    assert measured["max_context"]["k8v4"] < default["max_context"]["k8v4"]  # 160 MiB holds far less

    # `kvrig devices` shows it beside the phone it was measured on, and none beside a phone on another build.
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    listed = subprocess.run(
        [sys.executable, "-m", "kvrig", "devices", "--limits", str(registry), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    phones = {d["udid"]: d for d in json.loads(listed.stdout)}
    here = phones[emulator.udid]["measured_limits"]
    assert here["entitled"]["limit_bytes"] == LIMIT_BYTES and here["default"] is None
    assert len(here["entitled"]["virtual_sources"]) == 1
    table = subprocess.run(
        [sys.executable, "-m", "kvrig", "devices", "--limits", str(registry)],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "250"},
        cwd=ROOT,
        timeout=120,
    )
    assert table.returncode == 0 and "(virtual)" in table.stdout, table.stdout + table.stderr
    other = phones[emulator.ios17.identity.udid]
    assert other["build_version"] != values["BuildVersion"]
    assert other["measured_limits"] == {"entitled": None, "default": None}


def _ok(done) -> str:  # type: ignore[no-untyped-def]
    assert done.exit_code == 0, done.output
    return done.stdout


def test_an_app_without_the_entitlement_says_so(installed: Emulator, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=512, step_tokens=256, decode_tokens=1)
    result = run(on_device(installed.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, FAST)))
    assert result.outcome == "completed"
    assert result.stated_limit is not None and result.stated_limit.active_bytes == LIMIT_BYTES
    assert result.stated_limit.exceeded_bytes is None
    assert result.stated_limit.entitled is None  # its installation_proxy record lists no entitlements


@pytest.fixture()
def faults_cleared(installed: Emulator) -> Iterator[Emulator]:
    yield installed
    installed.device.faults = FaultPlan()
    installed.host.run(installed.device.apps.kill_all())


# kind of end -> (the fault that causes it, exit code of `kvrig soak`, the evidence kinds it leaves)
KINDS = {
    "jetsam_log": (FaultPlan(jetsam_without_report=True), 60, ["log"]),
    "gpu_background": (FaultPlan(gpu_background_at_tokens=512), 61, ["log", "crash_report"]),
    "watchdog": (FaultPlan(watchdog_at_tokens=512), 62, ["log", "crash_report"]),
    "crash": (FaultPlan(crash_at_tokens=512), 63, ["crash_report"]),
    "vanished": (FaultPlan(vanish_at_tokens=512), 64, ["none"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_end_is_told_apart(faults_cleared: Emulator, tmp_path: Path, kind: str) -> None:
    emulator = faults_cleared
    fault, exit_code, evidence = KINDS[kind]
    emulator.device.faults = fault
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    args = ["soak", "--app-id", BUNDLE_ID, "--udid", emulator.udid, "--step-tokens", "256", "--decode-tokens", "1"]
    args += ["--max-tokens", "1000000", "--battery-interval", "60", "--report-wait", "2", "-o", str(tmp_path), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )

    assert done.returncode == exit_code, done.stderr
    assert kind in done.stderr and "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == kind, result["outcome_detail"]
    assert [e["kind"] for e in result["evidence"]] == evidence
    saved = load_model_file(ResultsFile, tmp_path / "results.json").runs[0]
    assert saved.outcome == kind and saved.files.jetsam_reports == []
    lines = [e.line for e in saved.evidence if e.line]
    if kind == "jetsam_log":
        assert "exceeded mem limit: ActiveHard 160 MB (fatal)" in lines[0]
        assert saved.max_safe_context is not None  # the context it survived still stands
    if kind == "gpu_background":
        assert "Insufficient Permission (to submit GPU work from background)" in lines[0]
    if kind == "watchdog":
        assert "0x8BADF00D" in lines[0] and BUNDLE_ID in lines[0]
    for e in saved.evidence:
        if e.file is not None:
            header = json.loads((tmp_path / e.file).read_text().split("\n", 1)[0])
            assert header["bug_type"] == "309"  # an app crash report, not a JetsamEvent (298)
