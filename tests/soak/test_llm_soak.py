"""The real thing on the virtual iPhone: SmolLM2 packaged (q4, k8v4), its app rendered and built with
`kvrig build --virtual`, deployed with the bundle, and soaked by the LLM app runtime with real MLX.

Expected numbers come from elsewhere: the planner's KV bytes (kvrig.planner, its own replay of MLX's cache
growth) against the app's real cache buffers, and the JetsamEvent report's raw JSON against the limit the
virtual iPhone was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.device.deploy import deploy
from kvrig.exceptions import SoakFailedError
from kvrig.lab.gates import failures
from kvrig.planner import plan as make_memory_plan
from kvrig.runtime.blas import find_openblas
from kvrig.schemas.results import SoakResult
from kvrig.schemas.telemetry import TelemetryEvent
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.host import EmulatorHost
from tests.bundle_fixtures import smollm2_q4_k8v4
from tests.device.conftest import on_device, run
from tests.virtual.conftest import emulator_host

APP_ID = "dev.kvrig.llmsoak"
EMPTY_APP_ID = "dev.kvrig.nobundle"
PROFILE = "iPhone16,1"
KILL_CONTEXT = 768  # the small limit leaves room for KV allocated up to this context ...
TRANSIENT_ROOM = 10 * 1024 * 1024  # ... and about this much for what a prefill step holds for a moment
OPTIONS = SoakOptions(poll_interval_s=0.2, hang_after_s=90, report_wait_s=10)
EVENT = TypeAdapter(TelemetryEvent)


@dataclass
class Phones:
    host: EmulatorHost
    small: VirtualDevice
    large: VirtualDevice
    roomy: VirtualDevice
    small_limit: int
    bundle: Path


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_q4_k8v4(tmp_path_factory)


def _ipa(bundle: Path, out: Path, bundle_id: str) -> Path:
    project = render_app(bundle, out / "project", AppOptions(name="SmolLM2 Soak", bundle_id=bundle_id)).project
    return build_virtual_ipa(project, out)


@pytest.fixture(scope="module")
def phones(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phones]:
    root = tmp_path_factory.mktemp("llmsoak")
    memory = make_memory_plan(bundle, PROFILE, schemes=["k8v4"], weights="q4", contexts=[KILL_CONTEXT, 256])
    model_bytes = memory.weights_bytes + memory.runtime.buffer_cache_bytes
    kill_kv = memory.kv_bytes["k8v4"][str(KILL_CONTEXT)]
    small_limit = memory.runtime.baseline_bytes + model_bytes + kill_kv + TRANSIENT_ROOM
    # No baseline, and the warning level (80% of the limit) reached by the footprint after a prefill chunk
    # (MLX's buffer cache full) once the KV has grown past 256 tokens, the first step MLX grows it by (a page
    # and the kept tokens fit below it: room to evict).
    roomy_limit = int((model_bytes + memory.kv_bytes["k8v4"]["256"] + 2**20) / 0.8)
    with emulator_host(root, "llm") as host:
        small = host.add_device(root / "small", profile=PROFILE, limit_bytes=small_limit)
        large = host.add_device(root / "large", profile=PROFILE)
        roomy = host.add_device(root / "roomy", profile=PROFILE, limit_bytes=roomy_limit, baseline_bytes=0)
        ipa = _ipa(bundle, root / "app", APP_ID)
        for device in (small, large, roomy):
            run(deploy(bundle, ipa=ipa, udid=device.identity.udid))
        yield Phones(host, small, large, roomy, small_limit, bundle)


def _events(path: Path) -> list[dict]:
    """Every complete record, each validated against the telemetry schema (a torn last line is skipped)."""
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"torn record in the middle of the file: {line!r}"
            continue
        EVENT.validate_python(record)
        records.append(record)
    return records


def _raw_report(path: Path) -> dict:
    header, body = path.read_text().split("\n", 1)
    assert json.loads(header)["bug_type"] == "298"
    return json.loads(body)


def _soak(phones: Phones, device: VirtualDevice, plan, out: Path, app_id: str = APP_ID):  # type: ignore[no-untyped-def]
    return run(on_device(device.identity.udid, lambda d: run_soak(d, app_id, plan, out, OPTIONS)))


def test_real_bundle_soaks_into_jetsam(phones: Phones, tmp_path: Path) -> None:
    """`kvrig soak --on-critical continue` as a user runs it: the app grows past critical pressure (where its
    bundle's policy would stop it: test_critical_pressure_stops_and_saves) into the kernel's limit."""
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=phones.host.address)
    args = [
        "soak",
        "--app-id",
        APP_ID,
        "--udid",
        phones.small.identity.udid,
        "--max-tokens",
        "4096",
        "--step-tokens",
        "256",
    ]
    args += ["--decode-tokens", "2", "--on-critical", "continue", "-o", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    result = SoakResult.model_validate(json.loads((tmp_path / "results.json").read_text())["runs"][0])

    assert result.outcome == "jetsam", result.outcome_detail
    assert result.on_critical == "continue"  # what the soak plan told the app, recorded with the run
    assert result.scheme == "k8v4"  # no --scheme: the one the app said its bundle runs (calibrate reads it)
    # The app computed with Debian's OpenBLAS (preloaded before MLX loads), not the wheel's reference BLAS.
    ready = [line.message for line in phones.small.syslog.history if line.message.startswith("ready: ")]
    assert ready and all(f"OpenBLAS {'on' if find_openblas() else 'off'};" in m for m in ready), ready
    events = _events(tmp_path / "telemetry.jsonl")
    start = events[0]
    assert start["event"] == "start" and start["model"] == phones.bundle.name and start["scheme"] == "k8v4"
    assert "kv_bytes" in start["converted"]  # the host's float32 scales are counted as the phone's float16
    assert not any(e["event"] == "end" for e in events)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) >= 2
    assert all(s["decode_tps"] > 0 and s["prefill_tps"] > 0 for s in steps)

    # Real cache buffers (phone format) against the planner, at every step before any eviction.
    first_evict = next((e["seq"] for e in events if e["event"] == "evict"), None)
    unevicted = [s for s in steps if first_evict is None or s["seq"] < first_evict]
    assert unevicted
    contexts = sorted({s["context_tokens"] for s in unevicted})
    memory = make_memory_plan(phones.bundle, PROFILE, schemes=["k8v4"], weights="q4", contexts=contexts)
    for s in unevicted:
        assert s["kv_bytes"] == memory.kv_bytes["k8v4"][str(s["context_tokens"])], s

    (report_path,) = (tmp_path / "reports").glob("JetsamEvent-*.ips")
    body = _raw_report(report_path)
    (victim,) = [p for p in body["processes"] if p.get("reason")]
    assert victim["name"] == result.process == "SmolLM2Soak"
    page = body["memoryStatus"]["pageSize"]
    at_kill = victim["rpages"] * page
    # Killed at the page that crossed the limit (the kernel charges each step's peak as it happens).
    assert phones.small_limit < at_kill <= phones.small_limit + page
    assert result.footprint_at_kill_bytes == at_kill
    assert steps[-1]["phys_footprint_bytes"] < phones.small_limit
    # The kill came by the time the KV reached the room the limit left (the app evicts a page at critical
    # pressure, so it can come back to a shorter context first; tests/outcomes/test_planned_vs_killed.py
    # soaks an app that does not evict, against the plan).
    assert result.max_context_reached <= KILL_CONTEXT + 256


def test_large_limit_completes(phones: Phones, tmp_path: Path) -> None:
    # Two targets show each one reached; 128-token steps prove it as 256-token ones did, at half the prefill.
    plan = make_plan(max_tokens=256, step_tokens=128, decode_tokens=2, scheme="k8v4")
    result = _soak(phones, phones.large, plan, tmp_path)
    assert result.outcome == "completed", result.outcome_detail
    assert result.files.jetsam_reports == []
    events = _events(tmp_path / "telemetry.jsonl")
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "completed"
    steps = [e for e in events if e["event"] == "step"]
    # Each target is reached, then decode_tokens more are generated.
    assert [s["context_tokens"] for s in steps] == [130, 258]
    assert events[-1]["context_tokens"] == 258


def test_warning_evicts_the_oldest_page(phones: Phones, tmp_path: Path) -> None:
    # A first target below the warning (a step to compare the eviction with), then one past 256 tokens where the
    # warning comes with a page to evict: 384 tokens prefilled where 256-token steps to 768 took twice that.
    plan = make_plan(max_tokens=384, start_tokens=128, step_tokens=256, decode_tokens=2, scheme="k8v4")
    result = _soak(phones, phones.roomy, plan, tmp_path)
    assert result.outcome == "completed", result.outcome_detail
    events = _events(tmp_path / "telemetry.jsonl")
    warning = next(e for e in events if e["event"] == "memory_pressure" and e["level"] == "warning")
    evict = next(e for e in events if e["event"] == "evict")
    assert evict["seq"] == warning["seq"] + 1
    # One page (kvcache.json page_tokens) after the kept tokens; the context shrinks by exactly that.
    assert evict["tokens_evicted"] == 256
    assert evict["context_tokens"] == warning["context_tokens"] - 256
    before = [e for e in events if e["event"] == "step" and e["seq"] < evict["seq"]]
    assert before and evict["kv_bytes"] < before[-1]["kv_bytes"]
    # Every warning that finds a page to drop drops one (the level goes back to normal, then rises again);
    # as in the Swift app, a target is fed once, so the context ends short of the last target by what went.
    for e in events:
        if e["event"] == "evict":
            pressure = events[e["seq"] - 1]
            assert pressure["level"] in ("warning", "critical") and e["tokens_evicted"] == 256
            assert e["context_tokens"] == pressure["context_tokens"] - 256
    steps = [e for e in events if e["event"] == "step"]
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "completed"
    assert events[-1]["context_tokens"] == steps[-1]["context_tokens"] < 384


def test_critical_pressure_stops_and_saves(phones: Phones, tmp_path: Path) -> None:
    plan = make_plan(max_tokens=4096, step_tokens=256, decode_tokens=2, scheme="k8v4")  # on_critical: stop
    result = _soak(phones, phones.small, plan, tmp_path)
    assert result.outcome == "completed" and result.files.jetsam_reports == []
    assert result.on_critical == "stop_and_save"
    events = _events(tmp_path / "telemetry.jsonl")
    critical = [e for e in events if e["event"] == "memory_pressure" and e["level"] == "critical"]
    assert critical
    end = events[-1]
    assert end["event"] == "end" and end["reason"] == "memory_critical"
    assert end["context_tokens"] >= critical[0]["context_tokens"]
    checkpoint = json.loads((phones.small.state.container(APP_ID) / "Documents" / "checkpoint.json").read_text())
    assert checkpoint["run_id"] == plan.run_id and checkpoint["reason"] == "memory_critical"


def test_app_without_a_bundle_ends_with_a_clear_error(phones: Phones, tmp_path: Path) -> None:
    from kvrig.device import apps

    ipa = _ipa(phones.bundle, tmp_path / "app", EMPTY_APP_ID)
    run(on_device(phones.large.identity.udid, lambda d: apps.install(d, ipa)))
    plan = make_plan(max_tokens=512, step_tokens=256, decode_tokens=1)
    result = _soak(phones, phones.large, plan, tmp_path / "out", EMPTY_APP_ID)
    events = _events(tmp_path / "out" / "telemetry.jsonl")
    assert [e["event"] for e in events] == ["end"]
    assert events[0]["reason"] == "error" and "no model bundle in Documents" in events[0]["message"]
    assert "kvrig deploy" in events[0]["message"]
    # The app's own error end is an error, not a completed run: it fails the run in the lab...
    assert result.outcome == "error" and "no model bundle in Documents" in result.outcome_detail
    assert [kind for kind, _ in failures(result)] == ["error"]
    # ... and `kvrig soak` exits with the soak-failed code (16), saying why.
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=phones.host.address)
    udid = phones.large.identity.udid
    args = ["soak", "--app-id", EMPTY_APP_ID, "--udid", udid, "--max-tokens", "512", "-o", str(tmp_path / "cli")]
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == SoakFailedError.exit_code == 16, proc.stderr
    assert "error" in proc.stderr and "no model bundle" in proc.stderr and "Traceback" not in proc.stderr
    saved = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert saved["runs"][0]["outcome"] == "error"
