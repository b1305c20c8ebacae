"""The prefill transient's attention scores, as MLX's attention allocates them on a named backend.

Two backends run kvrig's apps, and they differ in exactly this term:

- `metal`, the phone: MLX's fused attention kernel (`sdpa_full`) takes chunks of more than 8 queries with head
  dims 64, 80 and 128 and never materializes the scores (up to 8 queries, a decode step, the vector kernel
  takes head dims 64, 96, 128 and 256). Other head dims fall back to MLX's unfused attention
  (matmul, mask, softmax, matmul), and so does attention over a quantized cache (mlx-lm's
  `quantized_scaled_dot_product_attention`) on every backend.
- `cpu`, the host runtime and the virtual iPhone: MLX's CPU backend has no fused attention, so every prefill
  chunk materializes heads × chunk × context scores.

How many score-sized buffers the unfused attention holds at its peak is not assumed: it is measured on MLX's
CPU with small real arrays (slopes over key lengths at two query counts, so inputs, output and fixed allocations
cancel). Metal runs the same graph of ops, so the count carries over; the element size is the plan's dtype.
The probe reads a few hundred bytes to 2 KB low now and then while other MLX processes run (a buffer freed
early), which the slopes turn into a plan that changes from run to run. So the figures for each MLX version are
recorded once, in a quiet process (attention_peaks.json), and a plan reads them; only an MLX version without a
record is probed live. tests/plan/test_transient.py holds the record to a live probe and, with
KVRIG_UPDATE_GOLDEN=1, records the installed MLX.

Which attention a quantized cache meets depends on its bits (the k4v4-vs-k8v4 difference):

- K and V at one width (k4v4, k8v8): mlx-lm's `QuantizedKVCache` and its quantized attention (quantized matmul
  for the scores, softmax, quantized matmul), unfused on every backend: heads x chunk x context scores per
  layer, on the phone too.
- K and V at different widths (k8v4): mlx-lm's attention takes one width. On the phone the app's
  `MixedBitsKVCache` dequantizes the layer's keys and values and hands them to MLX's fused attention: one
  dequantized layer (counted as the dequantized read), no scores where the kernel is fused. On the host (`cpu`)
  kvrig's `SchemeKVCache` dequantizes a prefill chunk's segment and multiplies with BLAS; the plan counts it as
  mlx-lm's quantized attention at the key width plus the dequantized layer. (A probe of that cache's own graph
  read very different buffers per score from one fresh process to the next: no plan can rest on it.)

So for Qwen3-4B at 8192 tokens on the phone a 512-token chunk of k4v4 holds 32 x 512 x 8192 scores (256 MiB at
float16, times the measured buffers per score) where k8v4 holds one dequantized layer (2 x 8 x 8192 x 128 x 2 B
= 32 MiB): k4v4's smaller cache comes with the larger transient. tests/plan/test_transient_qwen3_4b.py holds
both paths to MLX's peak on this host at Qwen3-4B's attention shapes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Final, Literal

Backend = Literal["metal", "cpu"]
BACKENDS: Final[dict[str, str]] = {
    "metal": "the phone: MLX on Metal, fused attention for head dims 64/80/128 over unquantized caches",
    "cpu": "the host and the virtual iPhone: MLX on the CPU, whose attention materializes the scores",
}
DEFAULT_BACKEND: Final[Backend] = "metal"
METAL_FUSED_HEAD_DIMS: Final = (64, 80, 128)  # mlx: sdpa_full_supported_head_dim
METAL_FUSED_MIN_QUERIES: Final = 9  # mlx: supports_sdpa_full needs query_sequence_length > 8
# Up to 8 queries (decoding) Metal runs the fused vector kernel instead (mlx: sdpa_vector_supported_head_dim).
METAL_VECTOR_HEAD_DIMS: Final = (64, 96, 128, 256)


def materializes_scores(backend: Backend, head_dim: int, queries: int, quantized_cache: bool) -> bool:
    """Whether MLX's attention materializes the scores for a chunk of `queries` on `backend`."""
    if backend == "cpu" or quantized_cache:
        return True
    if queries < METAL_FUSED_MIN_QUERIES:
        return head_dim not in METAL_VECTOR_HEAD_DIMS
    return head_dim not in METAL_FUSED_HEAD_DIMS


# The probe's shapes: about 1 MB of MLX memory and a few ms, still with a model's grouping (4 query heads
# per KV head, head dim 64 = one quantization group); exact multiples of the allocator's 16-byte rounding.
_HEADS, _KV_HEADS, _DIM = 8, 2, 64
_QUERIES = (16, 32)
_KEYS = (128, 384)
_REPEATS = 15
_ROUNDS = 3
RECORD: Final = Path(__file__).with_name("attention_peaks.json")


@dataclass(frozen=True)
class AttentionPeak:
    """What MLX's unfused attention holds at its peak beyond its inputs and output, in elements of the
    activation width: `per_score` × heads × queries × keys (the scores, the mask), `per_key` × kv_heads × keys
    × head_dim (CPU's quantized matmul dequantizes the keys and values it multiplies by), `per_query` × heads ×
    queries × head_dim (the scaled queries, the output before its transpose)."""

    per_score: float
    per_key: float
    per_query: float


def _peak(queries: int, keys: int, key_bits: int | None) -> int:
    import mlx.core as mx

    # The CPU even on a Mac: Metal's fused kernel would hold no scores for these shapes.
    with mx.stream(mx.cpu):
        return _peak_on_stream(queries, keys, key_bits)


def _peak_on_stream(queries: int, keys: int, key_bits: int | None) -> int:
    import mlx.core as mx

    q = mx.zeros((1, _HEADS, queries, _DIM), mx.float32)
    k = mx.zeros((1, _KV_HEADS, keys, _DIM), mx.float32)
    v = mx.zeros((1, _KV_HEADS, keys, _DIM), mx.float32)
    if key_bits is None:
        mx.eval(q, k, v)
        attend = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")  # noqa: E731
    else:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        qk, qv = mx.quantize(k, group_size=64, bits=key_bits), mx.quantize(v, group_size=64, bits=key_bits)
        mx.eval(q, qk, qv)
        attend = lambda: quantized_scaled_dot_product_attention(  # noqa: E731
            q,
            qk,
            qv,
            scale=0.125,
            mask="causal",  # type: ignore[arg-type]  # what mlx-lm's caches hand it for a prefill chunk
            group_size=64,
            bits=key_bits,
        )
    mx.eval(attend())  # once unmeasured: a first call's one-off allocations (kernel set-up) are not attention's
    peaks = []
    for _ in range(_REPEATS):
        mx.synchronize()
        mx.clear_cache()  # a cached buffer larger than asked for would count at its own size
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(attend())
        peaks.append(mx.get_peak_memory() - before)
    # The largest: now and then MLX donates a buffer already counted as resident or frees one early, and the
    # peak reads lower (by up to 2 KB; never higher). Under load from other MLX processes all fifteen can read
    # low, hence the record.
    return int(max(peaks))


def _key(key_bits: int | None) -> str:
    return "float" if key_bits is None else str(key_bits)


def _mlx_version() -> str | None:
    try:
        return version("mlx")
    except PackageNotFoundError:
        return None


@functools.cache
def recorded_peaks() -> dict[str, dict[str, AttentionPeak]]:
    """The record: MLX version -> key bits ("float" for an unquantized cache) -> its peak."""
    table = json.loads(RECORD.read_text())
    return {mlx: {bits: AttentionPeak(**peak) for bits, peak in by_bits.items()} for mlx, by_bits in table.items()}


@functools.cache
def attention_peak(key_bits: int | None) -> AttentionPeak:
    """What MLX's unfused attention holds (causal mask): plain `mx.fast.scaled_dot_product_attention` (key_bits
    None) or mlx-lm's quantized attention over keys and values quantized at `key_bits`. The installed MLX's
    record where there is one, else `measure_attention_peak`."""
    recorded = recorded_peaks().get(_mlx_version() or "", {}).get(_key(key_bits))
    return recorded if recorded is not None else measure_attention_peak(key_bits)


def measure_attention_peak(key_bits: int | None) -> AttentionPeak:
    """`attention_peak` probed on this host's MLX (CPU, float32). Four probes (two query counts × two key
    counts) separate the three terms; inputs, output and fixed allocations cancel. Each probe's largest of
    `_ROUNDS` × `_REPEATS` readings: a reading is low, never high, when MLX frees a buffer early."""
    (q0, q1), (k0, k1) = _QUERIES, _KEYS
    peaks = {(q, k): max(_peak(q, k, key_bits) for _ in range(_ROUNDS)) / 4 for q in _QUERIES for k in _KEYS}
    slope = {q: (peaks[q, k1] - peaks[q, k0]) / (k1 - k0) for q in _QUERIES}  # per key, at q queries
    per_query_key = (slope[q1] - slope[q0]) / (q1 - q0)
    intercept = {q: peaks[q, k0] - slope[q] * k0 for q in _QUERIES}  # at no keys
    return AttentionPeak(
        per_score=_steady(per_query_key / _HEADS),
        per_key=_steady(max(0.0, (slope[q0] - per_query_key * q0) / (_KV_HEADS * _DIM))),
        per_query=_steady(max(0.0, (intercept[q1] - intercept[q0]) / (q1 - q0) / (_HEADS * _DIM))),
    )


def _steady(elements: float) -> float:
    """To 1/1024 of an element: the allocator's few stray bytes in a probe (a 4-byte scalar) move a coefficient
    by less than that, and a plan must not change from one run to the next (the change: ≤ 0.1 % of a score)."""
    return round(elements * 1024) / 1024


def scores_buffers(
    *,
    backend: Backend,
    heads: int,
    kv_heads: int,
    head_dim: int,
    queries: int,
    keys: int,
    width: int,
    key_bits: int | None,
) -> tuple[int, int, int]:
    """Bytes MLX's attention holds for one layer's chunk at its peak beyond inputs and output (0 when Metal's
    fused kernel runs), in the three buffers MLX allocates for them: the scores (queries × keys), the keys the
    CPU dequantizes (keys) and the per-query arrays (queries only, so a chunk of the same length can take them
    again from MLX's buffer cache). Metal's quantized matmul dequantizes tiles inside its kernel, so the per-key
    copy the CPU makes is not counted there."""
    if not materializes_scores(backend, head_dim, queries, key_bits is not None):
        return 0, 0, 0
    else:
        peak = attention_peak(key_bits)
        per_key = peak.per_key if backend == "cpu" else 0.0
    scores = peak.per_score * heads * queries * keys
    dequantized = per_key * kv_heads * head_dim * keys
    total = int((scores + dequantized + peak.per_query * heads * queries * head_dim) * width)
    first, second = int(scores * width), int(dequantized * width)
    return first, second, total - first - second


def record() -> str:
    """Probes every key width and writes the installed MLX's entry into the record; returns that version. Run it
    in a process of its own on a quiet host (tests/plan/test_transient.py does, with KVRIG_UPDATE_GOLDEN=1)."""
    from kvrig.schemas.kvcache import KV_BITS

    mlx = _mlx_version()
    if mlx is None:
        raise ImportError("MLX is not installed: there is nothing to record")
    table = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    table[mlx] = {_key(bits): asdict(measure_attention_peak(bits)) for bits in (None, *KV_BITS)}
    RECORD.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return mlx
