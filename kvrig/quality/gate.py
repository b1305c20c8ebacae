"""The quality gate `kvrig package` runs, and what `--weights auto` and `--kv auto` choose with: perplexity of a
bundle (its weights and its KV cache) against the unquantized source (unquantized KV) on one text of each gate
kind — kvrig's own prose, Python modules and a manual the calibration never reads (texts.py) — judged on the
worst kind. Seconds for SmolLM2 on a
CPU with OpenBLAS loaded (the CLI preloads it; blas.load_openblas for library callers)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.exceptions import QualityGateError
from kvrig.kvcache.caches import make_caches
from kvrig.quality.perplexity import perplexity
from kvrig.quantize.base import load_source_model
from kvrig.runtime.host import load_bundle_model, prepare_for_host
from kvrig.schemas.bundle import KindCheck, QualityCheck
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.texts import GATE_KINDS as FILE_KINDS
from kvrig.texts import GATE_TEXT, kind_tokens

DEFAULT_MAX_INCREASE_PCT = 10.0
"""Refuse bundles whose perplexity is more than this much above the source's on any gate kind."""
GATE_TOKENS = 320
GATE_KINDS = ("prose", *FILE_KINDS)


@dataclass(frozen=True)
class GateTexts:
    """The gate's tokens per kind and the unquantized source's perplexity on each (measured once per package)."""

    ids: dict[str, list[int]]
    source_ppl: dict[str, float]


def gate_tokens(tokenizer: Any, tokens: int = GATE_TOKENS) -> dict[str, list[int]]:
    """`prose`: kvrig's own text; the gate's file kinds (texts.py): their last `tokens` tokens."""
    ids = {"prose": list(tokenizer.encode(GATE_TEXT))[:tokens]}
    for kind in FILE_KINDS:
        ids[kind] = kind_tokens(tokenizer, kind, tokens, from_end=True)
    return ids


def measure_source(source: Any, tokenizer: Any) -> GateTexts:
    """The gate's texts and the source's perplexity on them (`source` prepared for the host, fp KV)."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = gate_tokens(tokenizer)
    return GateTexts(ids, {k: perplexity(source, i, make_prompt_cache(source)).ppl for k, i in ids.items()})


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
    kinds = []
    for kind, ids in texts.ids.items():
        ppl = perplexity(model, ids, make_caches(model, kv, model_type)).ppl
        base = texts.source_ppl[kind]
        delta = 100.0 * (ppl / base - 1.0)
        kinds.append(
            KindCheck(
                kind=kind,
                tokens=len(ids) - 1,
                source_ppl=round(base, 4),
                bundle_ppl=round(ppl, 4),
                ppl_delta_pct=round(delta, 3),
            )
        )
    worst = max(kinds, key=lambda k: k.ppl_delta_pct)
    return QualityCheck(
        text=f"kvrig gate texts ({', '.join(texts.ids)}); worst: {worst.kind}",
        tokens=sum(k.tokens for k in kinds),
        source_ppl=worst.source_ppl,
        bundle_ppl=worst.bundle_ppl,
        ppl_delta_pct=worst.ppl_delta_pct,
        max_increase_pct=max_increase_pct,
        passed=worst.ppl_delta_pct <= max_increase_pct,
        forced=False,
        seconds=round(time.perf_counter() - began, 2),
        kinds=kinds,
    )


def measure_quality(
    source_dir: Path, bundle_dir: Path, kv: KVCacheConfig, *, max_increase_pct: float = DEFAULT_MAX_INCREASE_PCT
) -> QualityCheck:
    """The gate on the bundle in `bundle_dir` (read as the host runtime reads it, with its kvcache.json) against
    the source in `source_dir`."""
    from mlx_lm.utils import load_tokenizer

    began = time.perf_counter()
    source = prepare_for_host(load_source_model(source_dir)[0])
    texts = measure_source(source, load_tokenizer(source_dir))
    del source
    model, _, config = load_bundle_model(bundle_dir)
    model_type = str(config.get("model_type", ""))
    return check_model(model, kv, model_type, texts, max_increase_pct=max_increase_pct, began=began)


def enforce(check: QualityCheck, *, force: bool, recipe: str, kv: str) -> QualityCheck:
    """Raises QualityGateError for a failed check unless forced; returns the check to record."""
    if check.passed:
        return check
    worst = max(check.kinds, key=lambda k: k.ppl_delta_pct) if check.kinds else None
    where = f" on the {worst.kind} text" if worst is not None else ""
    message = (
        f"quality gate: {recipe} weights with {kv} KV raise perplexity by {check.ppl_delta_pct:+.1f} %{where} "
        f"({check.source_ppl:.2f} -> {check.bundle_ppl:.2f}), above the {check.max_increase_pct:g} % limit"
    )
    if not force:
        raise QualityGateError(
            message + "; choose a recipe with more bits (`--weights auto` finds the smallest that passes, `kvrig "
            "bench quality` compares them), raise --max-ppl-increase, or use --force"
        )
    return check.model_copy(update={"forced": True})
