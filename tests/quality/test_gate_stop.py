"""A `--weights auto` candidate's gate stops at the first text over the limit: the texts before it are measured
exactly as a full gate measures them, the verdict is a failure that names what was left unmeasured, and the
measurement cache serves that partial entry only to a caller that would have stopped there too. Tiny models
built from arguments; the real SmolLM2 default is in test_quality_model.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvrig.quality.gate import GateTexts, judge, kind_perplexities, over_limit
from kvrig.quality.measured import Measurements
from kvrig.quality.perplexity import perplexity
from tests.quality.test_kv_schemes import tiny

KINDS = ("a", "b", "c")


def _texts(model: object) -> GateTexts:
    ids = {
        kind: [[int(t) for t in mx.random.randint(0, 97, (64,), key=mx.random.key(i)).tolist()]]
        for i, kind in enumerate(KINDS)
    }
    return GateTexts(ids, {k: perplexity(model, p[0], make_prompt_cache(model)).ppl for k, p in ids.items()})


def test_stops_after_the_first_kind_over_the_limit_and_fails() -> None:
    model, spec = tiny()
    texts = _texts(model)
    # The source against a baseline a tenth lower on "b": +11 % there, unchanged on "a".
    shifted = GateTexts(texts.ids, {**texts.source_ppl, "b": texts.source_ppl["b"] / 1.11})
    asked: list[list[str]] = []

    def enough(ppl: dict[str, float]) -> bool:
        asked.append(list(ppl))
        return over_limit(shifted, 10.0)(ppl)

    ppl = kind_perplexities(model, None, spec.model_type, texts.ids, enough=enough)
    assert list(ppl) == ["a", "b"] and asked == [["a"], ["a", "b"]]
    assert ppl == {k: v for k, v in texts.source_ppl.items() if k in ppl}  # measured as a full gate measures
    check = judge(ppl, shifted, max_increase_pct=10.0)
    assert not check.passed and [k.kind for k in check.kinds] == ["a", "b"]
    assert round(check.ppl_delta_pct) == 11 and "not measured once over the limit: c" in check.text


def test_a_candidate_within_the_limit_is_measured_on_every_kind() -> None:
    model, spec = tiny()
    texts = _texts(model)
    ppl = kind_perplexities(model, None, spec.model_type, texts.ids, enough=over_limit(texts, 10.0))
    assert list(ppl) == list(KINDS)
    assert judge(ppl, texts, max_increase_pct=10.0).passed


def test_a_partial_entry_serves_only_a_caller_that_would_stop_there(tmp_path: Path) -> None:
    ids = {kind: [[1, 2, 3]] for kind in KINDS}
    texts = GateTexts(ids, {"a": 10.0, "b": 10.0, "c": 10.0})
    cache = Measurements(tmp_path, "source")
    stop_at_10 = over_limit(texts, 10.0)
    partial = {"a": 10.1, "b": 12.0}  # b is +20 %
    first = cache.perplexities({"measured": "x"}, ids, lambda: dict(partial), enough=stop_at_10)
    assert first == (partial, False)
    # A caller with the same limit reads it; one with a limit the entry does not prove failed, or one that needs
    # every kind (an explicit recipe's gate), measures again and the full entry replaces it.
    assert cache.perplexities({"measured": "x"}, ids, lambda: {}, enough=stop_at_10) == (partial, True)
    full = {"a": 10.1, "b": 12.0, "c": 10.2}
    stop_at_25 = over_limit(texts, 25.0)
    assert cache.perplexities({"measured": "x"}, ids, lambda: dict(full), enough=stop_at_25) == (full, False)
    assert cache.perplexities({"measured": "x"}, ids, lambda: {}) == (full, True)


def test_a_change_the_gate_rounds_to_its_limit_does_not_stop() -> None:
    """The stop compares the figure the gate judges (rounded to 0.001 %): +10.0004 % is +10.0 %, a pass."""
    ids = {kind: [[1, 2, 3]] for kind in KINDS}
    texts = GateTexts(ids, {"a": 10.0, "b": 10.0, "c": 10.0})
    at_limit = {"a": 11.00004}
    assert not over_limit(texts, 10.0)(at_limit) and over_limit(texts, 10.0)({"a": 11.0001})
    assert judge({**at_limit, "b": 10.0, "c": 10.0}, texts, max_increase_pct=10.0).passed


def test_a_kind_whose_perplexity_is_not_a_number_fails_the_gate_and_is_named_worst() -> None:
    """Overflowed logits give a NaN perplexity: NaN compares false with every limit, so a check written as
    `change > limit` would pass it, and `max` would skip it unless it came first."""
    ids = {kind: [[1, 2, 3]] for kind in KINDS}
    texts = GateTexts(ids, {"a": 10.0, "b": 10.0, "c": 10.0})
    check = judge({"a": 10.2, "b": float("nan"), "c": 10.1}, texts, max_increase_pct=10.0)
    assert not check.passed and "worst: b" in check.text
    assert over_limit(texts, 10.0)({"a": 10.2, "b": float("nan")})
