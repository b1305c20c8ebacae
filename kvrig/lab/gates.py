"""Lab gates: what CI fails on, evaluated on one run's results. Nothing here talks to a device."""

from __future__ import annotations

import math

from kvrig.schemas.lab import Gates
from kvrig.schemas.results import BAD_OUTCOMES, JETSAM_OUTCOMES, GateCheck, SoakResult, TpsPoint

__all__ = ["BAD_OUTCOMES", "evaluate", "failures"]


def decode_tps_at(curve: list[TpsPoint], context: int) -> float | None:
    """Decode tok/s at `context`, linear between the two measured points around it; None if the run never
    measured at or beyond it."""
    points = sorted((p.context_tokens, p.decode_tps) for p in curve if p.decode_tps is not None)
    for i, (ctx, tps) in enumerate(points):
        if ctx == context:
            return tps
        if ctx > context:
            if i == 0:
                return tps  # the first measurement is past it: the closest we have
            c0, t0 = points[i - 1]
            return t0 + (tps - t0) * (context - c0) / (ctx - c0)
    return None


def prediction_error(result: SoakResult) -> float | None:
    """(measured − predicted) / predicted max context, when the run found the limit (jetsam) and the planner
    predicted one; positive: the phone held more than predicted (infinite when the plan said nothing fits)."""
    predicted = result.predicted.max_context if result.predicted is not None else None
    if predicted is None or result.outcome not in JETSAM_OUTCOMES or result.max_safe_context is None:
        return None
    return _relative(result.max_safe_context, predicted)


def _relative(measured: int, predicted: int) -> float:
    if predicted == 0:
        return math.inf if measured else 0.0
    return (measured - predicted) / predicted


def evaluate(result: SoakResult, gates: Gates) -> list[GateCheck]:
    checks: list[GateCheck] = []
    if gates.min_max_safe_context is not None:
        want = gates.min_max_safe_context
        got = result.max_safe_context
        confirmed = " (confirmed)" if result.max_safe_context_confirmed else ""
        if got is None:
            checks.append(_check("min_max_safe_context", "failed", want, None, "no context was measured"))
        else:
            ok = got >= want
            checks.append(
                _check(
                    "min_max_safe_context",
                    "passed" if ok else "failed",
                    want,
                    got,
                    f"max safe context {got}{confirmed} {'>=' if ok else '<'} {want}",
                )
            )
    for context, minimum in sorted(gates.min_decode_tps_at.items()):
        name = f"min_decode_tps_at[{context}]"
        tps = decode_tps_at(result.tps_curve, context)
        if tps is None:
            reached = result.max_context_reached
            checks.append(
                _check(name, "failed", minimum, None, f"no decode measurement at {context} tokens (reached {reached})")
            )
        else:
            ok = tps >= minimum
            rel = ">=" if ok else "<"
            checks.append(
                _check(
                    name, "passed" if ok else "failed", minimum, tps, f"{tps:.1f} tok/s at {context} {rel} {minimum}"
                )
            )
    if gates.max_predicted_error is not None:
        limit = gates.max_predicted_error
        error = prediction_error(result)
        predicted = result.predicted.max_context if result.predicted is not None else None
        held = result.max_safe_context
        if error is None and predicted is not None and held and _relative(held, predicted) > limit:
            # no limit found, but what the run held is a lower bound that already proves the prediction wrong
            lower = _relative(held, predicted)
            checks.append(
                _check(
                    "max_predicted_error",
                    "failed",
                    limit,
                    lower if math.isfinite(lower) else None,
                    f"held at least {held} without finding the limit, against {predicted} predicted: "
                    f"{lower:+.1%} at least (beyond ±{limit:.0%})",
                )
            )
        elif error is None:
            why = (
                "no prediction (give the entry a model and the device a known profile)"
                if predicted is None
                else "the run did not find the limit (no jetsam), so the prediction cannot be checked"
            )
            checks.append(_check("max_predicted_error", "not_evaluated", limit, None, why))
        else:
            ok = abs(error) <= limit
            assert result.predicted is not None
            checks.append(
                _check(
                    "max_predicted_error",
                    "passed" if ok else "failed",
                    limit,
                    error if math.isfinite(error) else None,
                    f"measured {result.max_safe_context} vs predicted {result.predicted.max_context}: "
                    f"{error:+.1%} ({'within' if ok else 'beyond'} ±{limit:.0%})",
                )
            )
    return checks


def _check(gate: str, status: str, threshold: float, measured: float | None, message: str) -> GateCheck:
    return GateCheck.model_validate(
        {"gate": gate, "status": status, "threshold": threshold, "measured": measured, "message": message}
    )


def failures(result: SoakResult) -> list[tuple[str, str]]:
    """(kind, message) for everything that fails this run in CI: a bad outcome, each failed gate."""
    found: list[tuple[str, str]] = []
    if result.outcome in BAD_OUTCOMES:
        found.append((result.outcome or "", f"run ended in {result.outcome}: {result.outcome_detail}"))
    for c in result.confirmations:
        if c.outcome in BAD_OUTCOMES or c.outcome is None:
            found.append((c.outcome or "error", f"confirmation run {c.run_id} ended in {c.outcome or 'an error'}"))
    found.extend(("gate", f"{c.gate}: {c.message}") for c in result.gates if c.status == "failed")
    return found
