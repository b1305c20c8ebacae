"""Runtime benchmark: our host runtime vs plain mlx-lm `stream_generate` on the same bundle, each measured in
its own fresh process (so peak memory and the BLAS in use are each side's own). Run as
`python -m kvrig.runtime.bench {ours|plain|plain-f32} BUNDLE PROMPT_TOKENS DECODE_TOKENS`; prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvrig.bundle.manifest import verify_bundle
from kvrig.exceptions import KvrigError
from kvrig.kvcache.caches import make_caches
from kvrig.models import read_config
from kvrig.runtime.blas import openblas_loaded, preload_env
from kvrig.runtime.generate import GenerationStats, generate_tokens, load_bundle
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books cheaper "
    "and faster to produce. Within a few decades printers worked in most large European cities, and the "
    "number of books in circulation grew from thousands to millions. Ideas travelled further "
    "and more quickly than ever before, and the spread of literacy changed science, religion and politics. "
)


@dataclass
class SideResult:
    side: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float
    peak_memory_bytes: int
    openblas: bool
    kv: str


def prompt_ids(tokenizer: object, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids = list(tokenizer.encode(TEXT * (1 + len(ids) // 16 + n // 40)))  # type: ignore[attr-defined]
    return ids[:n]


def measure_ours(bundle: Path, n_prompt: int, n_decode: int) -> SideResult:
    import mlx.core as mx

    loaded = load_bundle(bundle)
    ids = prompt_ids(loaded.tokenizer, n_prompt)
    mx.set_cache_limit(loaded.kvcache.buffer_cache_limit_bytes)
    mx.reset_peak_memory()
    stats = GenerationStats()
    model_type = str(loaded.config.get("model_type", ""))
    caches = make_caches(loaded.model, loaded.kvcache, model_type)
    for _ in generate_tokens(
        loaded.model, ids, caches, loaded.kvcache, max_tokens=n_decode, stats=stats, model_type=model_type
    ):
        pass
    return SideResult(
        "ours",
        stats.prompt_tokens,
        stats.generated_tokens,
        stats.prefill_tps,
        stats.decode_tps,
        stats.peak_memory_bytes,
        openblas_loaded(),
        loaded.kvcache.scheme,
    )


def measure_plain(bundle: Path, n_prompt: int, n_decode: int, *, float32: bool = False) -> SideResult:
    """Plain mlx-lm as a user runs it; `float32` casts the model first (a reference row, not the baseline)."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(bundle))[:2]
    if float32:
        model.set_dtype(mx.float32)
    kv = load_model_file(KVCacheConfig, bundle / KVCACHE_NAME)
    ids = prompt_ids(tokenizer, n_prompt)
    kwargs: dict[str, Any] = {}
    # Plain mlx-lm takes one KV bit width; with different K and V bits it runs an fp16 cache.
    if kv.key_bits is not None and kv.key_bits == kv.value_bits:
        kwargs = {"kv_bits": kv.key_bits, "kv_group_size": kv.group_size, "quantized_kv_start": 0}
    mx.reset_peak_memory()
    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=n_decode, **kwargs):  # noqa: B007
        pass
    assert last is not None
    return SideResult(
        "mlx-lm f32" if float32 else "plain mlx-lm",
        last.prompt_tokens,
        last.generation_tokens,
        last.prompt_tps,
        last.generation_tps,
        int(mx.get_peak_memory()),
        openblas_loaded(),
        f"k{kwargs['kv_bits']}v{kwargs['kv_bits']}" if kwargs else "fp16",
    )


def run_side(side: str, bundle: Path, n_prompt: int, n_decode: int, *, timeout: float) -> SideResult:
    """One side in a fresh process: ours with OpenBLAS preloaded, plain mlx-lm as installed."""

    env = preload_env(enable=side in ("ours", "plain-f32"))
    cmd = [sys.executable, "-m", "kvrig.runtime.bench", side, str(bundle), str(n_prompt), str(n_decode)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise KvrigError(f"benchmark side '{side}' did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise KvrigError(f"benchmark side '{side}' failed: {proc.stderr.strip()[-2000:]}")
    return SideResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


@dataclass
class Comparison:
    """Our runtime beside plain mlx-lm on one bundle, each side in its own process; `reference`: mlx-lm with the
    model cast to float32 and OpenBLAS preloaded (how much of the gap float32 alone closes)."""

    bundle: Path
    ours: SideResult
    plain: SideResult
    reference: SideResult | None

    @property
    def ratios(self) -> dict[str, float]:
        """Ours / plain: prefill and decode speed, peak memory."""
        ours, plain = self.ours, self.plain
        return {
            "prefill": ours.prefill_tps / plain.prefill_tps if plain.prefill_tps else float("inf"),
            "decode": ours.decode_tps / plain.decode_tps if plain.decode_tps else float("inf"),
            "peak_memory": ours.peak_memory_bytes / plain.peak_memory_bytes if plain.peak_memory_bytes else 0.0,
        }


def compare(bundle: Path, n_prompt: int, n_decode: int, *, timeout: float, reference: bool = True) -> Comparison:
    """Runs each side on `bundle`, checked first here as `kvrig verify` checks it (a folder that is not a bundle is
    BundleError, a file that does not match the manifest VerifyError, a kvcache.json or config.json that is wrong
    InputError naming it) rather than failing in the sides' processes, whose errors reach here only as text."""
    verify_bundle(bundle)
    read_config(bundle)
    ours = run_side("ours", bundle, n_prompt, n_decode, timeout=timeout)
    plain = run_side("plain", bundle, n_prompt, n_decode, timeout=timeout)
    f32 = run_side("plain-f32", bundle, n_prompt, n_decode, timeout=timeout) if reference else None
    return Comparison(bundle, ours, plain, f32)


def main(argv: list[str]) -> None:
    side, bundle, n_prompt, n_decode = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    if side == "ours":
        result = measure_ours(bundle, n_prompt, n_decode)
    else:
        result = measure_plain(bundle, n_prompt, n_decode, float32=side == "plain-f32")
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main(sys.argv[1:])
