"""The soak's background step on the virtual iPhone: Settings launched through process control during prefill and
during decode, the app brought back, and what came of it: the test app pauses its GPU work and resumes; an app
that ignores its scene is aborted by Metal's GPU-from-background rule (crash report and device log); on iOS
27.2, where a continued-processing task holds the GPU, it goes on in the background and, when the task expires,
ends the run cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrig.device import apps
from kvrig.schemas import load_model_file
from kvrig.schemas.results import ResultsFile
from kvrig.soaking.driver import SoakOptions, run_soak, soak
from kvrig.soaking.plan import make_plan
from tests.soak.conftest import BUNDLE_ID, Emulator, installed, on_device, run

__all__ = ["installed"]
# Each phase of the test app lasts at least PHASE_S, so the step can aim at it; the app stays away AWAY_S.
PHASE_S, AWAY_S = 1.2, 1.0
# Metal's error as MLX users on iPhones report it (Blaizzy/mlx-audio#235): independent of the emulator's text.
METAL_ERROR = "Insufficient Permission (to submit GPU work from background)"


def options(*phases: str, **extra: object) -> SoakOptions:
    return SoakOptions(
        poll_interval_s=0.1,
        hang_after_s=30,
        report_wait_s=5,
        battery_interval_s=None,
        background=phases,  # type: ignore[arg-type]
        background_s=AWAY_S,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture()
def phone(installed: Emulator) -> Iterator[Emulator]:
    yield installed
    installed.host.run(installed.device.apps.kill_all())


def test_paused_in_prefill_and_in_decode_then_resumed(phone: Emulator, tmp_path: Path) -> None:
    # Prefill is sent away in step 2 and decode in step 3 (step 4 if the return ran late): 4 steps hold both, each
    # at least 2 * PHASE_S long; the 5 more steps of a 9-step run proved nothing more.
    plan = make_plan(max_tokens=64 * 4, step_tokens=64, decode_tokens=1, scheme="fp16")
    opts = options("prefill", "decode", extra_arguments=("--phase-s", str(PHASE_S)))
    result = run(on_device(phone.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, opts)))

    assert result.outcome == "completed", result.outcome_detail
    prefill, decode = result.background
    assert (prefill.requested, prefill.during, prefill.gpu, prefill.result) == (
        "prefill",
        "prefill",
        "paused",
        "resumed",
    )
    assert (decode.requested, decode.during, decode.gpu, decode.result) == ("decode", "decode", "paused", "resumed")
    assert all(
        b.sent is not None and b.returned is not None and b.returned - b.sent >= AWAY_S for b in (prefill, decode)
    )
    # Straight from the app's telemetry: it wrote no step while it was away, and its scene records say so.
    records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    scenes = [(r["phase"], r["gpu"]) for r in records if r["event"] == "scene"]
    assert scenes == [("background", "paused"), ("active", "resumed")] * 2
    for b in (prefill, decode):
        assert not [r for r in records if r["event"] == "step" and b.sent + 0.2 < r["t"] < b.returned]  # type: ignore[operator]
    saved = load_model_file(ResultsFile, tmp_path / "results.json").runs[0]
    assert [b.result for b in saved.background] == ["resumed", "resumed"]


def test_an_app_that_ignores_its_scene_is_aborted_for_gpu_work_from_the_background(
    phone: Emulator, tmp_path: Path
) -> None:
    plan = make_plan(max_tokens=1_000_000, step_tokens=64, decode_tokens=1, scheme="fp16")
    # This app never looks at its phase, so nothing aims at one: short phases (steps of ~0.6 s, not 2.4 s) only
    # bring the measurement past the one in flight, which gets it aborted, sooner; the steps stay paced so the
    # app cannot grow into its limit before it is sent away.
    opts = options("prefill", extra_arguments=("--phase-s", str(PHASE_S / 4), "--ignore-scene"))
    opts.background_s = 6.0  # long enough for the app to submit GPU work past the step in flight
    result = run(on_device(phone.udid, lambda d: run_soak(d, BUNDLE_ID, plan, tmp_path, opts)))

    (away,) = result.background
    assert away.result == "killed_gpu_background", away.evidence
    assert away.during is None  # the app never said it stopped: it did not look
    (report,) = (tmp_path / "reports").glob("KVSoak-*.ips")
    header, body = report.read_text().split("\n", 1)
    assert json.loads(header)["bug_type"] == "309"
    crash = json.loads(body)
    assert crash["exception"]["signal"] == "SIGABRT" and METAL_ERROR in json.dumps(crash["asi"])
    assert any(METAL_ERROR in line.message for line in phone.device.syslog.history)
    # a crash with its report, which the log names as GPU work from the background: an outcome of its own
    assert result.outcome == "gpu_background", result.outcome_detail


def test_ios_27_continued_processing_keeps_the_gpu_then_ends_cleanly(
    installed: Emulator, ipa: Path, tmp_path: Path
) -> None:
    phone = installed.host.add_device(tmp_path / "ios27", ios="27.2", continued_task_s=1.5)
    run(on_device(phone.identity.udid, lambda d: apps.install(d, ipa)))
    plan = make_plan(max_tokens=1_000_000, step_tokens=64, decode_tokens=1, scheme="fp16")
    opts = options("decode", extra_arguments=("--phase-s", str(PHASE_S)))
    opts.background_s = 4.0  # longer than the task may run in the background
    try:
        result = run(soak(BUNDLE_ID, plan, tmp_path / "out", udid=phone.identity.udid, options=opts))
    finally:
        installed.host.run(phone.apps.kill_all())

    (away,) = result.background
    assert (away.during, away.gpu, away.result) == ("decode", "continued", "ended_cleanly"), away.evidence
    assert result.outcome == "completed" and "background_task_expired" in (result.outcome_detail or "")
    records = [json.loads(line) for line in (tmp_path / "out" / "telemetry.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "background_task_expired"
    assert any(r["event"] == "step" and r["t"] > away.sent for r in records)  # GPU work went on in the background


def test_cli_refuses_a_phase_it_does_not_know(tmp_path: Path) -> None:
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrig",
            "soak",
            "--app-id",
            BUNDLE_ID,
            "--background",
            "prefill,sideways",
            "-o",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "sideways" in refused.stderr and "prefill or decode" in refused.stderr
