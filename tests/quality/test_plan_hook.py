"""`kvrig plan --quality`: the recommendation only takes KV schemes whose measured perplexity change is within
2 %, and names a weight recipe that fails the package gate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.exceptions import SchemaError
from kvrig.quality.plan_hook import apply_quality
from kvrig.schemas.quality import QualityReport, Row


def row(name: str, kind: str, delta: float, bpw: float | None = None) -> Row:
    """A bench row: a KV spec's on the source weights, or (with bits per weight) a recipe's on an fp16 cache."""
    kv, recipe = ("fp16", name) if bpw is not None else (name, "source")
    return Row(recipe=recipe, kv=kv, kind=kind, ppl=30.0, ppl_delta_pct=delta, tokens=512, bits_per_weight=bpw)


def write(path: Path, kv: list[Row], weights: list[Row]) -> Path:
    """quality.json as `kvrig bench quality` writes it."""
    text = {"legal": ["GPL-3"], "quotes": ["literature"]}
    path.write_text(json.dumps(QualityReport(model="m", text=text, calibration={}, kv=kv, weights=weights).to_json()))
    return path


def report(tmp_path: Path, kv: dict[str, float]) -> Path:
    weights = [row("q4", "legal", 18.4, 4.5), row("q6", "legal", 6.2, 6.5)]
    return write(tmp_path / "quality.json", [row(k, "legal", d) for k, d in kv.items()], weights)


def test_recommendation_skips_schemes_measured_over_the_limit(tmp_path: Path) -> None:
    from kvrig.planner import plan

    p = plan(None, "iPhone16,1", schemes=("fp16", "k8v8", "k8v4", "k4v4"), weights="q4")
    # only k8v8 is within 2 % here, so whatever the planner picked by bytes, k8v8 is recommended
    measured = {"fp16": 3.0, "k8v8": 0.13, "k8v4": 2.5, "k4v4": 12.0}
    out = apply_quality(p, report(tmp_path, measured))
    assert out.recommendation.scheme == "k8v8"
    assert out.recommendation.max_context == p.max_context["k8v8"] > 0
    assert p.recommendation.reasons == out.recommendation.reasons[: len(p.recommendation.reasons)]
    assert any("q4" in r and "q6" in r for r in out.recommendation.reasons)

    # the CLI takes the same file; a file that is no quality report is exit 3 naming it and the field
    bad = tmp_path / "bad.json"
    good = json.loads(write(bad, [row("k8v4", "legal", 1.0)], [row("q4", "legal", 1.0, 4.5)]).read_text())
    for change, field in [
        ({"model": None}, "field 'model'"),
        ({"kv": [{"kv": "k8v4"}]}, "field 'kv.0.recipe'"),
        ({"weights": [{**good["weights"][0], "ppl_delta_pct": "high"}]}, "field 'weights.0.ppl_delta_pct'"),
        ({"colour": "red"}, "colour"),  # a key the report does not have
        # a name that matches no plan row, or a change no limit can be compared with, dropped out unseen
        ({"kv": [{**good["kv"][0], "kv": "k8v4x"}]}, "field 'kv.0.kv'"),
        ({"weights": [{**good["weights"][0], "recipe": "q4x"}]}, "field 'weights.0.recipe'"),
        ({"kv": [{**good["kv"][0], "ppl_delta_pct": float("inf")}]}, "field 'kv.0.ppl_delta_pct'"),
    ]:
        bad.write_text(json.dumps({k: v for k, v in {**good, **change}.items() if v is not None}))
        with pytest.raises(SchemaError):
            apply_quality(p, bad)
        proc = subprocess.run(
            [sys.executable, "-m", "kvrig", "plan", "--device", "iPhone16,1", "--quality", str(bad)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == SchemaError.exit_code == 3 and str(bad) in proc.stderr and field in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_choice_is_judged_on_its_worst_kind_of_text(tmp_path: Path) -> None:
    """The bench writes one row per kind: k8v4 over the limit on licences is over the limit, whatever the
    quotations say, and q5 over the gate's limit on one kind is not "the smallest that passes"."""
    from kvrig.planner import plan

    p = plan(None, "iPhone16,1", schemes=("k8v4", "k4v4"), weights="q4")
    assert p.recommendation.scheme == "k8v4"  # the planner's own choice, before the measurements
    kv = {"k8v4": (3.0, 0.5), "k4v4": (0.3, 1.0)}
    weights = {"q4": (4.5, 18.4, 20.1), "q5": (5.5, 12.0, 4.0), "q6": (6.5, 6.2, 6.0)}
    kinds = ("legal", "quotes")
    path = write(
        tmp_path / "quality.json",
        [row(k, kind, d) for k, deltas in kv.items() for kind, d in zip(kinds, deltas, strict=True)],
        [row(r, kind, d, bpw) for r, (bpw, *deltas) in weights.items() for kind, d in zip(kinds, deltas, strict=True)],
    )
    out = apply_quality(p, path)
    assert out.recommendation.scheme == "k4v4"
    added = out.recommendation.reasons[len(p.recommendation.reasons) :]
    assert any("k8v4 is +3.00 %" in r for r in added), added
    assert any("q4: +20.1 %" in r and "the smallest that passes: q6" in r for r in added), added


def test_a_spec_with_extras_measured_within_the_limit_is_kept(tmp_path: Path) -> None:
    """The plan now ranks specs with extras (a bundle's own k8v4+rot above k8v4 at the same bytes); the hook read
    only plain names, so a k8v4+rot measured well within the limit was "not measured" and replaced."""
    from kvrig.planner import plan

    schemes = ("fp16", "k8v4", "k8v4+rot", "k4v4")
    fp16 = plan(None, "iPhone16,1", schemes=schemes, weights="q4", max_context_cap=1 << 22).max_context["fp16"]
    # A target past fp16's reach: the best-ranked spec that holds it is the rotated k8v4.
    p = plan(None, "iPhone16,1", schemes=schemes, weights="q4", max_context_cap=1 << 22, target_context=fp16 + 1)
    assert p.recommendation.scheme == "k8v4+rot", p.recommendation
    out = apply_quality(p, report(tmp_path, {"k8v4": 3.0, "k8v4+rot": 0.5, "k4v4": 1.0}))
    assert out.recommendation.scheme == "k8v4+rot"
    assert any("k8v4+rot +0.50 % perplexity" in r for r in out.recommendation.reasons)
