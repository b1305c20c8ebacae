"""The generated Core package builds and passes `swift test`, and the contracts hold in both directions:
Core decodes (and re-encodes unchanged) the kvcache.json and soak plan Python wrote, and Python's schema (and
telemetry reader, when present) accepts the JSONL Core's writer produced."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from kvrig.appgen.linux import sync_tree
from kvrig.schemas.soakplan import GrowthSchedule, SoakPlan, StopConditions
from kvrig.schemas.telemetry import TelemetryEvent


@pytest.fixture(scope="module")
def swift_run(
    swift: str,
    reference_project: Path,
    reference_kvcache,
    tmp_path_factory,
    request,  # type: ignore[no-untyped-def]
) -> dict[str, Path]:
    # Built in a folder that survives sessions (pytest's cache): ~40 s from scratch on 2 cores, seconds after.
    package = Path(request.config.cache.mkdir("kvrig-swift-core")) / "Core"
    package.mkdir(parents=True, exist_ok=True)
    sync_tree(reference_project / "Core", package, keep=(".build",))

    inputs = tmp_path_factory.mktemp("contract-in")
    outputs = tmp_path_factory.mktemp("contract-out")
    (inputs / "kvcache.json").write_text(reference_kvcache.model_dump_json(by_alias=True, indent=2))
    plan = SoakPlan(
        run_id='run "7" \\ ü',
        scheme="k8v4",
        schedule=GrowthSchedule(start_tokens=256, step_tokens=512, max_tokens=8192, decode_tokens=8),
        stop=StopConditions(min_decode_tps=2.5, max_footprint_bytes=4 * 1024**3, max_seconds=1800.5),
        text='Feed me "text"\n\tagain.',
        telemetry_file="runs/telemetry-7.jsonl",
        on_critical="continue",
        backend="coreml",
        weights_residency="mapped",
        buffer_cache="uncapped",
    )
    (inputs / "soakplan.json").write_text(plan.model_dump_json(by_alias=True, indent=2))

    env = {**os.environ, "KVRIG_CONTRACT_IN": str(inputs), "KVRIG_CONTRACT_OUT": str(outputs)}
    env["TMPDIR"] = str(tmp_path_factory.mktemp("swift-tmp"))  # swift leaves a folder there on each run
    proc = subprocess.run([swift, "test"], cwd=package, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"in": inputs, "out": outputs}


def test_core_tests_pass_and_round_trip_python_files(swift_run: dict[str, Path]) -> None:
    for name in ("kvcache.json", "soakplan.json"):
        original = json.loads((swift_run["in"] / name).read_text())
        again = json.loads((swift_run["out"] / f"roundtrip-{name}").read_text())
        assert again == original, name
    # Soak plan schema 2 carries the backend across (the default, mlx, would pass unnoticed), schema 3 the
    # weights' residency (the default, null, likewise), schema 4 the buffer cache (null: capped).
    again = json.loads((swift_run["out"] / "roundtrip-soakplan.json").read_text())
    assert (again["schema"], again["backend"], again["weights_residency"]) == (4, "coreml", "mapped")
    assert again["buffer_cache"] == "uncapped"


def test_every_python_field_reaches_swift(swift_run: dict[str, Path], reference_kvcache) -> None:  # type: ignore[no-untyped-def]
    again = json.loads((swift_run["out"] / "roundtrip-kvcache.json").read_text())
    dumped = reference_kvcache.model_dump(mode="json", by_alias=True)
    assert set(again) == set(dumped)
    assert [set(layer) for layer in again["layers"]] == [set(layer) for layer in dumped["layers"]]
    sliding = {"layer": 1, "kind": "sliding", "window": 512}
    assert again["layers"][1] == {**sliding, "source_layer": None, "key_bits": None, "value_bits": None}


def test_the_app_names_the_kv_spec_as_kvrig_does(swift_run: dict[str, Path], reference_kvcache) -> None:  # type: ignore[no-untyped-def]
    """The app's telemetry names the KV spec it runs in full: kvcache.json's scheme alone read `k8v4` for a
    k8v4+rot+s4+w128 bundle, so two soaks of different specs recorded the same one."""
    specs = json.loads((swift_run["out"] / "specs.json").read_text())
    expected = {
        r: reference_kvcache.model_copy(update={"rotation": r}).spec for r in ("none", "hadamard_keys", "hadamard")
    }
    expected["plain"] = reference_kvcache.model_copy(update={"sink_tokens": 0, "recent_tokens": 0}).spec
    assert specs == expected
    assert specs["hadamard"] == "k8v4+rot+s4+w128" != specs["plain"]


def test_python_reads_core_telemetry(swift_run: dict[str, Path]) -> None:
    path = swift_run["out"] / "telemetry-from-swift.jsonl"
    lines = path.read_text().splitlines()
    adapter = TypeAdapter(TelemetryEvent)
    events = [adapter.validate_json(line) for line in lines]
    kinds = ["start", "start", "step", "step", "memory_pressure", "memory_pressure", "evict", "evict", "scene", "scene"]
    assert [e.event for e in events] == [*kinds, "end", "end", "end", "end", "end", "end"]
    assert [e.seq for e in events] == list(range(16))
    assert events[0].model == 'Smol "LM" \\ 135M' and events[0].limit_bytes == 3_221_225_472
    # Schema 2: `start` names the backend (the Core default is MLX; the second start ran Core ML); schema 3:
    # `step` too (set on the first step, unset on the second); schema 4: how the weights are held (the first
    # start leaves it unset: an app that says nothing about it).
    assert {e.schema_version for e in events} == {5}  # 5: scene records, the end reason background_task_expired
    starts = [e for e in events if e.event == "start"]
    assert [(e.weights_residency, e.mapped_weight_bytes) for e in starts] == [(None, None), ("loaded", 0)]
    assert starts[1].residency_note == 'mapping "refused": fell back'
    assert [e.backend for e in events if e.event == "step"] == ["coreml", None]
    assert [e.backend for e in events if e.event == "start"] == ["mlx", "coreml"]
    assert json.loads(lines[0])["backend"] == "mlx"  # written by Swift, not filled in by the Python default
    assert events[2].decode_tps == 31.5 and events[2].thermal_state == "fair"
    assert events[3].decode_tps is None
    assert {e.reason for e in events if e.event == "end"} == {
        "completed", "stop_condition", "memory_critical", "allocation_failed", "error", "background_task_expired"
    }  # fmt: skip
    scenes = [(e.phase, e.context_tokens, e.during, e.gpu) for e in events if e.event == "scene"]
    assert scenes == [("background", 1792, "decode", "paused"), ("active", 1792, "prefill", "resumed")]
    from kvrig.reports.telemetry import read_telemetry

    # kvrig's telemetry reader reads the same file, a torn last line (killed mid-write) included.
    torn = path.with_name("torn.jsonl")
    torn.write_text(path.read_text() + lines[2][: len(lines[2]) // 2])
    result = read_telemetry(torn)
    assert sum(len(run.events) for run in result.runs) == len(events)
    assert result.torn_line == len(lines) + 1


def test_the_app_the_planner_and_the_packager_agree_on_the_families(swift_run: dict[str, Path]) -> None:
    """Gemma 3n's KV stays unquantized in the app (KvrigCore's CachePlan); kvrig packages it with fp16 KV so the
    plan counts what the phone holds. The two lists are one fact: Core writes its own, Python compares."""
    from kvrig.kvcache.families import APP_UNQUANTIZED_KV, NO_QUANTIZED_ATTENTION

    families = json.loads((swift_run["out"] / "families.json").read_text())
    assert set(families["keeps_kv_unquantized"]) == APP_UNQUANTIZED_KV == {"gemma3n"}
    # the families whose quantized layers the app reads dequantized are the ones the plan counts that way
    assert set(families["reads_dequantized"]) == NO_QUANTIZED_ATTENTION and "gemma2" in NO_QUANTIZED_ATTENTION


def test_the_app_accepts_the_group_sizes_and_bits_the_schema_does(swift_run: dict[str, Path]) -> None:
    """A group size or bit width MLX lacks is refused by both readers of kvcache.json, the same ones."""
    from kvrig.schemas.kvcache import GROUP_SIZES, KV_BITS

    accepted = json.loads((swift_run["out"] / "quantization.json").read_text())
    assert accepted == {"group_sizes": list(GROUP_SIZES), "kv_bits": list(KV_BITS)}
