"""The threshold search's bookkeeping, with the soak itself stood in for (the virtual phones run the real one in
test_lab_runs.py): a figure a repeat run contradicted is never kept as if it stood."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvrig.lab import threshold
from kvrig.lab.gates import evaluate
from kvrig.lab.model import new_run
from kvrig.schemas.lab import Gates, Lab, MatrixEntry, SchemeSpec
from kvrig.schemas.results import DeviceRef


def _search(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcomes: list[dict[str, Any]]) -> Any:
    entry = MatrixEntry.model_validate({"app_id": "com.example.app", "schemes": ["k8v4"]})
    run = new_run(entry, SchemeSpec(name="k8v4"), DeviceRef(udid="u", profile="iphone-15-pro"), "20261201T000000")
    lab = Lab.model_validate({"schema": 1, "matrix": [entry.model_dump()], "threshold": {"confirm_runs": 1}})
    results = iter(outcomes)

    async def soak(bench: Any, device: Any, run: Any, max_tokens: int, run_id: str, *_: Any) -> Any:
        return run.result.model_copy(update={"run_id": run_id, **next(results)})

    monkeypatch.setattr(threshold, "soak", soak)
    bench = threshold.Bench(lab, tmp_path, lambda _: None, lambda _: None)
    asyncio.run(threshold.measure(bench, None, run, "tag"))  # type: ignore[arg-type]
    return run.result


def test_a_repeat_killed_before_its_first_step_leaves_no_safe_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = _search(
        monkeypatch,
        tmp_path,
        [{"outcome": "jetsam", "max_safe_context": 8192}, {"outcome": "jetsam", "max_safe_context": None}],
    )
    assert result.max_safe_context == 0 and not result.max_safe_context_confirmed
    assert "killed before its first step" in (result.outcome_detail or "")
    (gate,) = evaluate(result, Gates(min_max_safe_context=8000))
    assert gate.status == "failed"


def test_a_repeat_that_survives_confirms_the_figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = _search(
        monkeypatch,
        tmp_path,
        [{"outcome": "jetsam", "max_safe_context": 8192}, {"outcome": "completed", "max_context_reached": 8192}],
    )
    assert result.max_safe_context == 8192 and result.max_safe_context_confirmed
