"""The quality gate `kvrig package` runs, and what `--weights auto` and `--kv auto` choose with: perplexity of a
bundle (its weights and its KV cache) against the unquantized source (unquantized KV) on each gate kind —
kvrig's own prose, and passages spread over Python modules and a manual the calibration never reads (texts.py) —
judged on the worst kind. Seconds for SmolLM2 on a CPU with OpenBLAS loaded (the CLI preloads it;
blas.load_openblas for library callers)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import QualityGateError
from kvrig.kvcache.caches import make_caches
from kvrig.quality.perplexity import rows_nll
from kvrig.schemas.bundle import KindCheck, QualityCheck
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.texts import GATE_KINDS as FILE_KINDS
from kvrig.texts import GATE_TEXT, TextKind, kind_segments, user_kind
from kvrig.texts import kind as text_kind

DEFAULT_MAX_INCREASE_PCT = 10.0
"""Refuse bundles whose perplexity is more than this much above the source's on any gate kind."""
GATE_TOKENS = 320
"""kvrig's prose: its first tokens."""
GATE_SEGMENTS, SEGMENT_TOKENS = 4, 256
"""A file kind: passages spread over its files. One short passage per kind was a noisy sample: the same recipe
measured far apart on different passages of the same files."""
GATE_KINDS = ("prose", *FILE_KINDS)
LOGITS_BYTES = 256 * 2**20
"""A batch of passages holds float32 logits for each of its positions: SmolLM2's 49k vocabulary reads 5 passages
at once, Gemma 3's 262k one."""


@dataclass(frozen=True)
class GateTexts:
    """The gate's passages per kind and the unquantized source's perplexity on each kind (measured once per
    package)."""

    ids: dict[str, list[list[int]]]
    source_ppl: dict[str, float]


def gate_tokens(tokenizer: Any, user_texts: Iterable[str] = ()) -> dict[str, list[list[int]]]:
    """`prose`: kvrig's own text; the gate's file kinds (texts.py) and the user's text files (`user_texts`, each
    a kind named by its path): passages spread over their files."""
    ids = {"prose": [list(tokenizer.encode(GATE_TEXT))[:GATE_TOKENS]]}
    kinds: list[TextKind] = [*map(text_kind, FILE_KINDS), *map(user_kind, user_texts)]
    for kind in kinds:
        ids[kind.name] = kind_segments(tokenizer, kind, GATE_SEGMENTS, SEGMENT_TOKENS)
    return ids


def kind_perplexity(model: Any, passages: list[list[int]], caches: Callable[[], list[Any]]) -> float:
    """Perplexity over every passage of a kind, each read from empty caches: exp of the mean NLL per token.
    Passages of one length are read side by side, as many at once as keep their logits within LOGITS_BYTES."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    per_batch = max(1, LOGITS_BYTES // (4 * SEGMENT_TOKENS * vocab)) if isinstance(vocab, int) and vocab > 0 else 1
    by_length: dict[int, list[list[int]]] = {}
    for ids in passages:
        by_length.setdefault(len(ids), []).append(ids)
    nll = predicted = 0.0
    for rows in by_length.values():
        for first in range(0, len(rows), per_batch):
            part_nll, n = rows_nll(model, rows[first : first + per_batch], caches(), chunk=SEGMENT_TOKENS)
            nll, predicted = nll + part_nll, predicted + n
    return math.exp(nll / predicted)


def measure_source(source: Any, tokenizer: Any) -> GateTexts:
    """The gate's texts and the source's perplexity on them (`source` prepared for the host, fp KV)."""
    ids = gate_tokens(tokenizer)
    return GateTexts(ids, kind_perplexities(source, None, "", ids))


Enough = Callable[[dict[str, float]], bool]
"""Given the perplexities of the kinds measured so far, whether the rest can be left unmeasured."""


def kind_perplexities(
    model: Any,
    kv: KVCacheConfig | None,
    model_type: str,
    ids: dict[str, list[list[int]]],
    *,
    enough: Enough | None = None,
) -> dict[str, float]:
    """`model`'s perplexity on each kind's passages through the caches `kv` makes (None: mlx-lm's own
    unquantized cache, the reference every change is measured against), kind by kind in order; `enough` may end
    it after any kind (a candidate already over its limit on one kind fails whatever the others measure)."""
    from mlx_lm.models.cache import make_prompt_cache

    def caches() -> list[Any]:
        return make_prompt_cache(model) if kv is None else make_caches(model, kv, model_type)

    out: dict[str, float] = {}
    for kind, passages in ids.items():
        out[kind] = kind_perplexity(model, passages, caches)
        if enough is not None and len(out) < len(ids) and enough(out):
            break
    return out


def delta_pct(ppl: float, source_ppl: float) -> float:
    """A kind's perplexity change against the source's, in percent, as the gate records it (rounded)."""
    return round(100.0 * (ppl / source_ppl - 1.0), 3)


def exceeds(ppl: float, source_ppl: float, max_increase_pct: float) -> bool:
    """Whether a kind's change, as the gate records it, is over the limit (the record and the verdict agree); a
    perplexity that is not a number (overflowed logits) is over every limit."""
    return not delta_pct(ppl, source_ppl) <= max_increase_pct


def worst_first(change: float) -> float:
    """A sort key that takes the largest change, and a change that is not a number before any."""
    return math.inf if math.isnan(change) else change


def over_limit(texts: GateTexts, max_increase_pct: float) -> Enough:
    """`enough` for a candidate judged against `max_increase_pct`: some kind already measured above it (as
    `judge` judges it, so a stop never fails what a full measurement would pass)."""
    return lambda ppl: any(exceeds(v, texts.source_ppl[k], max_increase_pct) for k, v in ppl.items())


def unmeasured(texts: GateTexts, measured: Iterable[str]) -> list[str]:
    """The gate kinds a measurement stopped before (`over_limit`), in the gate's order."""
    done = set(measured)
    return [kind for kind in texts.ids if kind not in done]


def check_model(
    model: Any,
    kv: KVCacheConfig,
    model_type: str,
    texts: GateTexts,
    *,
    max_increase_pct: float = DEFAULT_MAX_INCREASE_PCT,
    began: float | None = None,
) -> QualityCheck:
    """The gate's verdict on `model` (prepared for the host) with the caches `kv` makes, on every gate kind."""
    began = time.perf_counter() if began is None else began
    ppl = kind_perplexities(model, kv, model_type, texts.ids)
    return judge(ppl, texts, max_increase_pct=max_increase_pct, began=began)


def judge(
    ppl: dict[str, float],
    texts: GateTexts,
    *,
    max_increase_pct: float = DEFAULT_MAX_INCREASE_PCT,
    began: float | None = None,
) -> QualityCheck:
    """The gate's verdict on perplexities measured on `texts`' passages, kind by kind against the source's
    (`began`: when the measurement began, for the seconds it took; None: it was read, not measured). Kinds
    missing from `ppl` were left unmeasured (`over_limit`): the text names them and the gate cannot pass."""
    kinds = []
    for kind, passages in texts.ids.items():
        if kind not in ppl:
            continue
        base = texts.source_ppl[kind]
        kinds.append(
            KindCheck(
                kind=kind,
                tokens=sum(len(ids) - 1 for ids in passages),
                source_ppl=round(base, 4),
                bundle_ppl=round(ppl[kind], 4),
                ppl_delta_pct=delta_pct(ppl[kind], base),
            )
        )
    worst = max(kinds, key=lambda k: worst_first(k.ppl_delta_pct))
    left = unmeasured(texts, ppl)
    over = [k for k in kinds if exceeds(ppl[k.kind], texts.source_ppl[k.kind], max_increase_pct)]
    return QualityCheck(
        text=f"kvrig gate texts ({', '.join(texts.ids)}); worst: {worst.kind}"
        + (f"; not measured once over the limit: {', '.join(left)}" if left else ""),
        tokens=sum(k.tokens for k in kinds),
        source_ppl=worst.source_ppl,
        bundle_ppl=worst.bundle_ppl,
        ppl_delta_pct=worst.ppl_delta_pct,
        max_increase_pct=max_increase_pct,
        passed=not over and not left,
        forced=False,
        seconds=round(time.perf_counter() - began, 2) if began is not None else 0.0,
        kinds=kinds,
    )


def enforce(check: QualityCheck, *, force: bool, recipe: str, kv: str) -> QualityCheck:
    """Raises QualityGateError for a failed check unless forced; returns the check to record."""
    if check.passed:
        return check
    worst = max(check.kinds, key=lambda k: worst_first(k.ppl_delta_pct)) if check.kinds else None
    where = f" on the {worst.kind} text" if worst is not None else ""
    message = (
        f"quality gate: {recipe} weights with {kv} KV raise perplexity by {check.ppl_delta_pct:+.1f} %{where} "
        f"({check.source_ppl:.2f} -> {check.bundle_ppl:.2f}), above the {check.max_increase_pct:g} % limit"
    )
    if not force:
        raise QualityGateError(
            message + "; choose a recipe with more bits (`--weights auto` finds the smallest that passes, `kvrig "
            "bench quality` compares them), raise --max-ppl-increase, or use --ignore-gate"
        )
    return check.model_copy(update={"forced": True})
