"""The planner's recommendation, with measured quality: `kvrig plan --quality quality.json` (written by
`kvrig bench quality`) keeps only KV schemes whose measured perplexity change is within a limit, and says
when the weight recipe the plan budgets for fails the package gate. The planner's own choice is kept when
it already passes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvrig.exceptions import QuantizationError, SchemaError
from kvrig.fileio import read_data
from kvrig.recipes import parse_kv, parse_weights

DEFAULT_KV_LIMIT_PCT = 2.0


def read_quality(path: Path) -> dict[str, Any]:
    """quality.json as `kvrig bench quality` writes it; a file that is not one is refused naming the field."""
    data = read_data(path, error=SchemaError, expected="quality.json from kvrig bench quality")
    if not isinstance(data, dict) or not isinstance(data.get("kv"), list) or not isinstance(data.get("weights"), list):
        raise SchemaError("not a quality report", file=path, field="kv", expected="lists 'kv' and 'weights'")
    for section, name, parse in (("kv", "kv", parse_kv), ("weights", "recipe", _parse_recipe)):
        for i, row in enumerate(data[section]):
            delta = row.get("ppl_delta_pct") if isinstance(row, dict) else None
            if not isinstance(row, dict) or not isinstance(row.get(name), str) or not _number(delta):
                raise SchemaError(
                    "not a row of kvrig bench quality",
                    file=path,
                    field=f"{section}.{i}",
                    expected=f"an object with '{name}' (text) and 'ppl_delta_pct' (a finite number)",
                )
            try:  # a misspelt name would match no plan row and drop out of the recommendation unseen
                parse(row[name])
            except QuantizationError as exc:
                raise SchemaError(str(exc), file=path, field=f"{section}.{i}.{name}") from None
    return data


def _parse_recipe(name: str) -> object:
    return None if name == "source" else parse_weights(name)  # the bench's unquantized reference row


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def apply_quality(
    plan: Any, path: Path, *, kv_limit_pct: float = DEFAULT_KV_LIMIT_PCT, weights_limit_pct: float = 10.0
) -> Any:
    """A copy of `plan` whose recommendation only takes schemes measured within `kv_limit_pct` (schemes the
    report did not measure are left out when any measured one fits)."""
    data = read_quality(path)
    measured = {k: float(r["ppl_delta_pct"]) for k, r in _worst(data["kv"], "kv").items() if "+" not in k}
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
    weights = _worst(data["weights"], "recipe")
    w = weights.get(plan.weights_recipe) or weights.get(f"{plan.weights_recipe}g{plan.group_size}")
    if w is not None and float(w["ppl_delta_pct"]) > weights_limit_pct:
        passing = sorted(
            (
                r
                for r in weights.values()
                if float(r["ppl_delta_pct"]) <= weights_limit_pct and r.get("bits_per_weight")
            ),
            key=lambda r: r["bits_per_weight"],
        )
        hint = f"; the smallest that passes: {passing[0]['recipe']}" if passing else ""
        reasons.append(
            f"weights {plan.weights_recipe}: {float(w['ppl_delta_pct']):+.1f} % perplexity, over the package gate's "
            f"{weights_limit_pct:g} %{hint}."
        )
    new = rec.model_copy(update={"scheme": chosen, "max_context": context, "reasons": reasons})
    return plan.model_copy(update={"recommendation": new})


def _worst(rows: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    """Each recipe's or KV spec's row on its worst kind of text: the report has one row per kind, and a choice
    holds only if it holds on every kind."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        kept = out.get(row[name])
        if kept is None or float(row["ppl_delta_pct"]) > float(kept["ppl_delta_pct"]):
            out[row[name]] = row
    return out
