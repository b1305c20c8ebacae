"""The planner's recommendation, with measured quality: `kvrig plan --quality quality.json` (written by
`kvrig bench quality`) keeps only KV schemes whose measured perplexity change is within a limit, and says
when the weight recipe the plan budgets for fails the package gate. The planner's own choice is kept when
it already passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrig.exceptions import QuantizationError, SchemaError
from kvrig.recipes import parse_kv, parse_weights
from kvrig.schemas import load_model_file
from kvrig.schemas.quality import QualityReport, Row

DEFAULT_KV_LIMIT_PCT = 2.0


def read_quality(path: Path) -> QualityReport:
    """quality.json as `kvrig bench quality` writes it (its schema); a row whose name does not parse, or whose
    change is not a finite number, is refused naming the field."""
    report = load_model_file(QualityReport, path, error=SchemaError)
    for section, rows in (("kv", report.kv), ("weights", report.weights)):
        for i, row in enumerate(rows):
            name, value = ("kv", row.kv) if section == "kv" else ("recipe", row.recipe)
            if not math.isfinite(row.ppl_delta_pct):  # a run that measured nothing can rank no choice
                raise SchemaError(
                    f"got {row.ppl_delta_pct}", file=path, field=f"{section}.{i}.ppl_delta_pct", expected="a number"
                )
            try:  # a misspelt name would match no plan row and drop out of the recommendation unseen
                parse_kv(value) if section == "kv" else _parse_recipe(value)
            except QuantizationError as exc:
                raise SchemaError(str(exc), file=path, field=f"{section}.{i}.{name}") from None
    return report


def _parse_recipe(name: str) -> object:
    return None if name == "source" else parse_weights(name)  # the bench's unquantized reference row


def apply_quality(
    plan: Any, path: Path, *, kv_limit_pct: float = DEFAULT_KV_LIMIT_PCT, weights_limit_pct: float = 10.0
) -> Any:
    """A copy of `plan` whose recommendation only takes schemes measured within `kv_limit_pct` (schemes the
    report did not measure are left out when any measured one fits)."""
    data = read_quality(path)
    # Every spec measured, extras and all: the plan ranks `k8v4+rot` as it ranks `k8v4` (a bundle's own spec too).
    measured = {k: r.ppl_delta_pct for k, r in _worst(data.kv, lambda r: r.kv).items()}
    rec = plan.recommendation
    reasons = list(rec.reasons)
    ok = [s for s, ctx in plan.max_context.items() if ctx > 0 and s in measured and measured[s] <= kv_limit_pct]
    chosen, context = rec.scheme, rec.max_context
    if rec.scheme in measured and measured[rec.scheme] <= kv_limit_pct:
        reasons.append(f"measured quality ({path.name}): {rec.scheme} {measured[rec.scheme]:+.2f} % perplexity.")
    elif ok:
        # Longest context among schemes that keep quality; the smaller PPL change breaks ties.
        chosen = max(ok, key=lambda s: (plan.max_context[s], -measured[s]))
        context = plan.max_context[chosen]
        was = f"{measured[rec.scheme]:+.2f} %" if rec.scheme in measured else "not measured"
        reasons.append(
            f"measured quality ({path.name}): {rec.scheme} is {was}, over the {kv_limit_pct:g} % limit; {chosen} "
            f"({measured[chosen]:+.2f} %) holds {context} tokens."
        )
    else:
        reasons.append(f"measured quality ({path.name}): no fitting scheme is within {kv_limit_pct:g} % perplexity.")
    weights = _worst(data.weights, lambda r: r.recipe)
    w = weights.get(plan.weights_recipe) or weights.get(f"{plan.weights_recipe}g{plan.group_size}")
    if w is not None and w.ppl_delta_pct > weights_limit_pct:
        passing = sorted(
            (r for r in weights.values() if r.ppl_delta_pct <= weights_limit_pct and r.bits_per_weight),
            key=lambda r: r.bits_per_weight or 0.0,
        )
        hint = f"; the smallest that passes: {passing[0].recipe}" if passing else ""
        reasons.append(
            f"weights {plan.weights_recipe}: {w.ppl_delta_pct:+.1f} % perplexity, over the package gate's "
            f"{weights_limit_pct:g} %{hint}."
        )
    new = rec.model_copy(update={"scheme": chosen, "max_context": context, "reasons": reasons})
    return plan.model_copy(update={"recommendation": new})


def _worst(rows: list[Row], name: Callable[[Row], str]) -> dict[str, Row]:
    """Each recipe's or KV spec's row on its worst kind of text: the report has one row per kind, and a choice
    holds only if it holds on every kind."""
    out: dict[str, Row] = {}
    for row in rows:
        kept = out.get(name(row))
        if kept is None or row.ppl_delta_pct > kept.ppl_delta_pct:
            out[name(row)] = row
    return out
