"""Telemetry schema 2: the `start` record names the backend that ran; schema 3: `step` records too. Schema-1
files (MLX-only apps) still read, as mlx."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from kvrig.reports.telemetry import read_telemetry
from kvrig.schemas.telemetry import TELEMETRY_SCHEMA_VERSION, StartEvent, TelemetryEvent

ADAPTER: TypeAdapter = TypeAdapter(TelemetryEvent)
START = {"event": "start", "run_id": "r", "seq": 0, "t": 1.0, "model": "m", "scheme": "fp16",
         "product_type": "iPhone16,1", "os_version": "18.1"}  # fmt: skip


def test_schema_2_names_the_backend() -> None:
    assert TELEMETRY_SCHEMA_VERSION == 5
    event = ADAPTER.validate_python({**START, "schema": 2, "backend": "coreml"})
    assert event.backend == "coreml"
    written = json.loads(StartEvent(run_id="r", seq=0, t=1.0, model="m", scheme="fp16", product_type="p",
                                    os_version="18").model_dump_json(by_alias=True))  # fmt: skip
    assert written["schema"] == 5 and written["backend"] == "mlx"


def test_schema_1_reads_as_mlx_and_cannot_carry_a_backend() -> None:
    assert ADAPTER.validate_python({**START, "schema": 1}).backend == "mlx"
    with pytest.raises(ValidationError, match="schema-2 field"):
        ADAPTER.validate_python({**START, "schema": 1, "backend": "coreml"})


def test_unknown_backend_and_schema_are_rejected() -> None:
    with pytest.raises(ValidationError, match="backend"):
        ADAPTER.validate_python({**START, "schema": 2, "backend": "onnx"})
    with pytest.raises(ValidationError, match="schema"):
        ADAPTER.validate_python({**START, "schema": 6})


def test_reader_keeps_the_backend_per_run(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.jsonl"
    lines = [{**START, "schema": 2, "run_id": "a", "backend": "coreml"}, {**START, "schema": 1, "run_id": "b"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    runs = {run.run_id: run for run in read_telemetry(path).runs}
    assert runs["a"].start is not None and runs["a"].start.backend == "coreml"
    assert runs["b"].start is not None and runs["b"].start.backend == "mlx"


def test_exported_json_schema_lists_the_backends() -> None:
    schema = ADAPTER.json_schema(by_alias=True)
    start = schema["$defs"]["StartEvent"]["properties"]
    assert start["backend"]["enum"] == ["mlx", "coreml"]
    assert start["schema"]["enum"] == [1, 2, 3, 4, 5]
    assert schema["$defs"]["StepEvent"]["properties"]["backend"]["anyOf"][0]["enum"] == ["mlx", "coreml"]


STEP = {"event": "step", "run_id": "r", "seq": 1, "t": 2.0, "context_tokens": 512, "phys_footprint_bytes": 1}


def test_schema_3_steps_name_the_backend_and_older_steps_cannot() -> None:
    assert ADAPTER.validate_python({**STEP, "schema": 3, "backend": "coreml"}).backend == "coreml"
    assert ADAPTER.validate_python({**STEP, "schema": 2}).backend is None  # not recorded before schema 3
    with pytest.raises(ValidationError, match="schema-3 field"):
        ADAPTER.validate_python({**STEP, "schema": 2, "backend": "mlx"})


def test_scene_records_and_their_end_reason_need_schema_5() -> None:
    scene = {"event": "scene", "run_id": "r", "seq": 1, "t": 2.0, "phase": "background", "context_tokens": 512,
             "during": "decode", "gpu": "paused"}  # fmt: skip
    assert ADAPTER.validate_python({**scene, "schema": 5}).during == "decode"
    with pytest.raises(ValidationError, match="schema-5 record"):
        ADAPTER.validate_python({**scene, "schema": 4})
    end = {
        "event": "end",
        "run_id": "r",
        "seq": 2,
        "t": 3.0,
        "reason": "background_task_expired",
        "context_tokens": 512,
    }
    assert ADAPTER.validate_python({**end, "schema": 5}).reason == "background_task_expired"
    with pytest.raises(ValidationError, match="schema-5 end reason"):
        ADAPTER.validate_python({**end, "schema": 4})
