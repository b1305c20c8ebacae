"""Outcomes never read better than what happened: an app's own error end is a failure everywhere.

The end-to-end cases (the real LLM app without a bundle: `error`, a failed run, `kvrig soak` exit 16) are in
tests/soak/test_llm_soak.py; these check each rule on its own."""

from __future__ import annotations

import pytest

from kvrig.lab.gates import evaluate, failures
from kvrig.schemas.lab import Gates
from kvrig.schemas.results import DeviceRef, SoakResult
from kvrig.schemas.telemetry import EndEvent
from kvrig.soaking.analyse import classify

END_REASONS = EndEvent.model_fields["reason"].annotation.__args__  # type: ignore[union-attr]


def _classify(reason: str, message: str | None = None) -> tuple[str, str]:
    outcome, detail, _evidence = classify(
        end_seen=True,
        end_reason=reason,
        end_message=message,
        hung=False,
        timed_out=False,
        lost=False,
        killed_by_jetsam=False,
        crash_reports=[],
    )
    return outcome, detail


@pytest.mark.parametrize("reason", ["error", "allocation_failed"])
def test_an_app_that_ends_itself_with_an_error_failed(reason: str) -> None:
    outcome, detail = _classify(reason, "no model bundle in Documents")
    assert outcome == reason
    assert "no model bundle in Documents" in detail
    result = SoakResult(run_id="r", device=DeviceRef(udid="u"), app_id="a", scheme="fp16", outcome=outcome)
    assert [kind for kind, _ in failures(result)] == [reason]


def test_ends_the_app_chose_are_completed_runs() -> None:
    # background_task_expired: iOS ended the continued-processing task and the app ended cleanly (tests/soak/
    # test_background.py tells what the background step made of it)
    planned = {"completed", "stop_condition", "memory_critical", "background_task_expired"}
    assert planned | {"error", "allocation_failed"} == set(END_REASONS)  # every end reason is decided here
    for reason in planned:
        outcome, detail = _classify(reason)
        assert outcome == "completed" and reason in detail


def test_a_gate_on_an_error_run_fails() -> None:
    result = SoakResult(
        run_id="r", device=DeviceRef(udid="u"), app_id="a", scheme="fp16", outcome="error", max_safe_context=None
    )
    (check,) = evaluate(result, Gates(min_max_safe_context=512))
    assert check.status == "failed"
    assert {kind for kind, _ in failures(result.model_copy(update={"gates": [check]}))} == {"error", "gate"}
