"""Issue 22: the lab file says what a soak does at critical memory pressure (`on_critical`, as `kvrig soak
--on-critical`). One virtual iPhone with a small limit, SmolLM2 (q4, k8v4: its policy stops and saves at critical
pressure) in the LLM app built for the virtual iPhone, and a lab of two entries: one as the lab's default says,
one with `on_critical: continue`. The default run stops and saves at critical pressure; the other grows past it
into the kernel's limit, as tests/soak/test_llm_soak.py shows for `kvrig soak`. The limit is that test's: room for
the KV up to KILL_CONTEXT and a prefill step's transients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.device.loop import run_async
from kvrig.lab.schedule import run_lab
from kvrig.planner import plan as make_memory_plan
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import load_lab
from kvrig.schemas.results import ResultsFile, SoakResult
from tests.bundle_fixtures import smollm2_q4_k8v4
from tests.virtual.conftest import emulator_host

APP_ID = "dev.kvrig.labcritical"
PROFILE = "iPhone16,1"
KILL_CONTEXT = 768
TRANSIENT_ROOM = 10 * 1024 * 1024


@dataclass
class Soaked:
    out: Path
    saved: ResultsFile
    runs: dict[str, SoakResult]  # by entry


@pytest.fixture(scope="module")
def soaked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Soaked]:
    bundle = smollm2_q4_k8v4(tmp_path_factory)
    root = tmp_path_factory.mktemp("lab-on-critical")
    memory = make_memory_plan(bundle, PROFILE, schemes=["k8v4"], weights="q4", contexts=[KILL_CONTEXT])
    kv = memory.kv_bytes["k8v4"][str(KILL_CONTEXT)]
    limit = memory.runtime.baseline_bytes + memory.weights_bytes + memory.runtime.buffer_cache_bytes
    limit += kv + TRANSIENT_ROOM
    project = render_app(bundle, root / "project", AppOptions(name="LabCritical", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root)
    common = {
        "app_id": APP_ID,
        "schemes": ["k8v4"],
        "soak": {"step_tokens": 256, "max_tokens": 4096, "decode_tokens": 1},
    }
    with emulator_host(root, "labcrit") as host:
        phone = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit)
        lab_doc = {
            "schema": 1,
            "name": "on-critical",
            "devices": [{"udid": phone.identity.udid}],
            "matrix": [
                # installs the app and pushes the bundle for both entries; no on_critical: the lab's default
                {"name": "default", **common, "ipa": str(ipa), "bundle_path": str(bundle)},
                {"name": "continue", **common, "bundle": bundle.name, "on_critical": "continue"},
            ],
            "threshold": {"confirm_runs": 0},
            "timeouts": {"hang_after_s": 180, "reconnect_s": 1, "report_wait_s": 5, "poll_interval_s": 0.2},
        }
        lab_file = root / "lab.yaml"
        lab_file.write_text(yaml.safe_dump(lab_doc, sort_keys=False))
        try:
            run_async(run_lab(load_lab(lab_file), root / "out"))
        finally:
            host.run(phone.apps.kill_all())
    saved = load_model_file(ResultsFile, root / "out" / "results.json")
    yield Soaked(root / "out", saved, {r.entry or "": r for r in saved.runs})


def _events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return events


def test_results_record_what_each_run_did_at_critical_pressure(soaked: Soaked) -> None:
    assert sorted(soaked.runs) == ["continue", "default"]
    assert soaked.runs["default"].on_critical == "stop_and_save"
    assert soaked.runs["continue"].on_critical == "continue"
    assert soaked.saved.lab is not None and soaked.saved.lab.outcomes == {"completed": 1, "jetsam": 1}


def test_the_default_stops_and_saves_at_critical_pressure(soaked: Soaked) -> None:
    run = soaked.runs["default"]
    assert run.outcome == "completed", run.outcome_detail
    assert run.files.jetsam_reports == []
    events = _events(soaked.out / run.files.telemetry)  # type: ignore[operator]
    assert any(e["event"] == "memory_pressure" and e["level"] == "critical" for e in events)
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "memory_critical"
    assert (run.max_context_reached or 0) < 4096  # stopped well short of the schedule


def test_continue_grows_past_critical_pressure_into_jetsam(soaked: Soaked) -> None:
    stopped, run = soaked.runs["default"], soaked.runs["continue"]
    assert run.outcome == "jetsam", run.outcome_detail
    assert run.files.jetsam_reports and run.max_safe_context
    events = _events(soaked.out / run.files.telemetry)  # type: ignore[operator]
    assert not any(e["event"] == "end" for e in events)  # killed, never ended itself
    critical = next(e["seq"] for e in events if e["event"] == "memory_pressure" and e["level"] == "critical")
    assert any(e["event"] == "step" and e["seq"] > critical for e in events)  # went on measuring past it
    # It got at least as far as the run that stopped there.
    assert (run.max_context_reached or 0) >= (stopped.max_context_reached or 0)
