"""The quality gate `kvrig package` runs: the bundle's perplexity (its weights and its KV scheme) against the
unquantized source (unquantized KV) on kvrig's short built-in text. Seconds for SmolLM2 on a CPU with OpenBLAS
loaded (the CLI preloads it; blas.load_openblas for library callers): the wheel's own BLAS is ~7x slower."""

from __future__ import annotations

import time
from pathlib import Path

from kvrig.exceptions import QualityGateError
from kvrig.kvcache.caches import make_caches
from kvrig.quality.perplexity import perplexity
from kvrig.quantize.base import load_source_model
from kvrig.runtime.host import load_bundle_model, prepare_for_host
from kvrig.schemas.bundle import QualityCheck
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.texts import GATE_TEXT

DEFAULT_MAX_INCREASE_PCT = 10.0
"""Refuse bundles whose perplexity is more than this much above the source's (q4 g64 SmolLM2 is ~+19 %)."""
GATE_TOKENS = 320


def measure_quality(
    source_dir: Path, bundle_dir: Path, kv: KVCacheConfig, *, max_increase_pct: float = DEFAULT_MAX_INCREASE_PCT
) -> QualityCheck:
    """Perplexity of the bundle in `bundle_dir` (read as the host runtime reads it, with its kvcache.json) and
    of the source in `source_dir` on the built-in text."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_tokenizer

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(source_dir)
    ids = list(tokenizer.encode(GATE_TEXT))[:GATE_TOKENS]
    source = prepare_for_host(load_source_model(source_dir)[0])
    base = perplexity(source, ids, make_prompt_cache(source)).ppl
    del source
    model, _, config = load_bundle_model(bundle_dir)
    ppl = perplexity(model, ids, make_caches(model, kv, str(config.get("model_type", "")))).ppl
    delta = 100.0 * (ppl / base - 1.0)
    return QualityCheck(
        text="kvrig built-in gate text",
        tokens=len(ids) - 1,
        source_ppl=round(base, 4),
        bundle_ppl=round(ppl, 4),
        ppl_delta_pct=round(delta, 3),
        max_increase_pct=max_increase_pct,
        passed=delta <= max_increase_pct,
        forced=False,
        seconds=round(time.perf_counter() - t0, 2),
    )


def enforce(check: QualityCheck, *, force: bool, recipe: str, kv: str) -> QualityCheck:
    """Raises QualityGateError for a failed check unless forced; returns the check to record."""
    if check.passed:
        return check
    message = (
        f"quality gate: {recipe} weights with {kv} KV raise perplexity by {check.ppl_delta_pct:+.1f} % over the "
        f"source ({check.source_ppl:.2f} -> {check.bundle_ppl:.2f}), above the {check.max_increase_pct:g} % limit"
    )
    if not force:
        raise QualityGateError(
            message + "; choose a recipe with more bits (`kvrig bench quality` compares them), raise "
            "--max-ppl-increase, or use --force"
        )
    return check.model_copy(update={"forced": True})
