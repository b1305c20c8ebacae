"""Importance-weighted affine quantization (the `imx-` recipes): each group's scale and bias are fitted to
minimise the weight error weighted by how strongly calibration activations drive each input channel (mean
x² per channel, llama.cpp's "imatrix" idea), instead of MLX's round-to-nearest grid that always contains 0.

The packed layout is MLX's own (same `weight`/`scales`/`biases` arrays `quantize_model` makes), so the planner
and the Swift loader see an ordinary affine-quantized model; only the values differ. The mixed variant gives
the MLP up/down projections of the last layers group size 32 until a bits-per-weight target is met."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvrig.exceptions import QuantizationError
from kvrig.recipes import PACKED_BITS

"""Widths whose MLX packing this module writes itself (a little-endian bit stream of uint32 words: value k
of a row takes bits k·b .. k·b+b-1, so 3, 5 and 6 bits cross word boundaries)."""
# Half as many (10) searched a third faster but cost gpx-q4 and gpx-4.6 1-2 % perplexity on SmolLM2.
SCALE_STEPS = 20
"""Candidate grids tried per group (scale stretched from range/(levels-1) by -1 .. +1 level), each refitted."""
CHUNK_ELEMENTS = 1 << 19
"""Elements (groups x candidates x group size) searched at once: large enough that numpy's per-call cost is small
next to the work, small enough to stay near the core (measured best on this 2-core EPYC: 2^18 .. 2^19)."""


def pack(q: Any, bits: int) -> Any:
    """Integer levels (..., n) -> MLX's packed uint32 words (..., n * bits / 32)."""
    import mlx.core as mx

    per = 32 // math.gcd(32, bits)  # values in one period of whole words
    q = q.astype(mx.uint32).reshape(*q.shape[:-1], -1, per)
    words = [mx.zeros(q.shape[:-1], dtype=mx.uint32) for _ in range(per * bits // 32)]
    for k in range(per):
        word, offset = divmod(k * bits, 32)
        words[word] = words[word] | (q[..., k] << offset)
        if offset + bits > 32:  # the value's high bits open the next word
            words[word + 1] = words[word + 1] | (q[..., k] >> (32 - offset))
    return mx.stack(words, axis=-1).reshape(*q.shape[:-2], -1)


def fit_grid(x: Any, wt: Any, bits: int, dtype: Any) -> tuple[Any, Any]:
    """(scale, bias) per group of `x` (..., groups, group_size), rounded to `dtype`, returned as float32,
    minimising sum(wt * (x - s·q - b)²): candidates are MLX's own round-to-nearest grid, the min/max grid and
    min/max grids of ranges stretched by -1 .. +1 level, each refitted by weighted least squares, the first
    best kept; then a few alternating assign/refit steps (`grid_search`)."""
    import mlx.core as mx

    gs = x.shape[-1]
    s, b = grid_search(
        np.array(x.reshape(-1, gs).astype(mx.float32)),
        np.array(mx.broadcast_to(wt, x.shape).reshape(-1, gs).astype(mx.float32)),
        bits,
        dtype_name(dtype),
    )
    return mx.array(s).reshape(x.shape[:-1]), mx.array(b).reshape(x.shape[:-1])


def grid_search(x: np.ndarray, wt: np.ndarray, bits: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """`fit_grid` on float32 numpy arrays x, wt (groups, group size); `dtype` names the scales' type
    ("float16", "bfloat16" or "float32"). Works through cache-sized chunks of groups, every candidate of a
    chunk at once, on one thread per core (numpy releases the GIL in its loops)."""
    import mlx.core as mx

    _, s0, b0 = mx.quantize(mx.array(x), x.shape[1], bits)
    rtn_s, rtn_b = np.array(s0).reshape(-1), np.array(b0).reshape(-1)
    s, b = np.empty(len(x), np.float32), np.empty(len(x), np.float32)
    candidates = SCALE_STEPS + 3
    # The candidates are tried `step` groups at a time, the assign/refit steps (one candidate) on `step *
    # candidates` groups: the same buffers, and few numpy calls per group either way.
    step = max(1, CHUNK_ELEMENTS // (candidates * x.shape[1]))
    cpus = os.cpu_count() or 1
    # Big chunks, but at least one per core when there is enough to share.
    size = min(step * candidates, max(step, -(-len(x) // cpus)))
    starts = range(0, len(x), size)
    threads = max(1, min(len(starts), cpus))
    top = 2**bits - 1

    def run(first: int) -> None:
        # Every temporary is one of two buffers per thread: fresh large arrays would cost page faults each time.
        work = np.empty((2, step * candidates, x.shape[1]), np.float32)
        for start in starts[first::threads]:
            part = slice(start, start + size)
            xs, ws = x[part], wt[part]
            sums = np.stack([ws, ws * xs])  # [wt, wt·x]: weighted sums over a group are products with these
            grid_s, grid_b = rtn_s[part], rtn_b[part]
            best = [
                _candidates(
                    xs[i : i + step],
                    sums[:, i : i + step],
                    grid_s[i : i + step],
                    grid_b[i : i + step],
                    top,
                    dtype,
                    work,
                )
                for i in range(0, len(xs), step)
            ]
            best_s, best_b, best_e = (np.concatenate([c[k] for c in best]) for k in range(3))
            s[part], b[part] = _refine(xs, sums, best_s, best_b, best_e, top, dtype, work)

    if threads == 1:
        run(0)
    else:
        list(_pool().map(run, range(threads)))
    return s, b


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """One thread per core for the whole process: gpx searches a few groups at a time, thousands of times, and
    starting threads for each search cost more than the search on a loaded machine."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvrig-grid"))
    return _POOL[0]


def grid_levels(x: np.ndarray, s: np.ndarray, b: np.ndarray, top: int) -> np.ndarray:
    """The level of each value of x (groups, group size) on its group's grid s, b (groups,): the nearest, in
    0 .. top."""
    return np.clip(np.rint((x - b[:, None]) / np.where(s == 0, np.float32(1), s)[:, None]), 0, top)


def _candidates(
    x: np.ndarray, sums: np.ndarray, s0: np.ndarray, b0: np.ndarray, top: int, dtype: str, work: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best of the candidate grids of each group: (scale, bias, weighted error), each (groups, 1)."""
    n, gs = x.shape
    stretched = SCALE_STEPS + 1
    buf = work[:, : n * (stretched + 2)].reshape(2, n, stretched + 2, gs)
    lo, hi = x.min(-1), x.max(-1)
    span = np.maximum(hi - lo, np.float32(1e-12))
    # The stretched grids' levels, every candidate at once: (groups, candidates, group size). x - lo >= 0, so
    # only the top needs clipping.
    q = buf[0, :, :stretched]
    np.multiply((x - lo[:, None])[:, None, :], (_steps(top)[None, :] / span[:, None])[..., None], out=q)
    np.clip(np.rint(q, out=q), 0, top, out=q)
    s, b = _refit(q, sums, buf[1, :, :stretched])
    # Candidate 0 is MLX's grid (kept unless a later one is strictly better), 1 the min/max grid; a later
    # candidate needs a positive scale. The first of equal errors wins, as when they are tried in turn.
    cand_s = round_scales(np.concatenate([s0[:, None], (span / top)[:, None], s], axis=1), dtype)
    cand_b = round_scales(np.concatenate([b0[:, None], lo[:, None], b], axis=1), dtype)
    e = _error(x, sums, cand_s, cand_b, top, buf)
    first = e[:, 0].copy()
    e = np.where((cand_s > 0) & ~np.isnan(e), e, np.inf)
    e[:, 0] = np.where(np.isnan(first), -np.inf, first)
    pick = np.argmin(e, axis=1)[:, None]
    return tuple(np.take_along_axis(v, pick, 1) for v in (cand_s, cand_b, e))  # type: ignore[return-value]


def _refine(
    x: np.ndarray,
    sums: np.ndarray,
    best_s: np.ndarray,
    best_b: np.ndarray,
    best_e: np.ndarray,
    top: int,
    dtype: str,
    work: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Three alternating steps from the best candidates: assign levels on the grid, refit the grid to them,
    keep it where the error is strictly lower."""
    buf = work[:, : len(x)].reshape(2, len(x), 1, x.shape[1])
    for _ in range(3):
        q = buf[0]
        np.subtract(x[:, None, :], best_b[..., None], out=q)
        np.divide(q, np.where(best_s == 0, np.float32(1), best_s)[..., None], out=q)
        np.clip(np.rint(q, out=q), 0, top, out=q)
        s, b = _refit(q, sums, buf[1])
        s, b = round_scales(s, dtype), round_scales(b, dtype)
        e = _error(x, sums, s, b, top, buf)
        better = (e < best_e) & (s > 0)
        best_s, best_b, best_e = np.where(better, s, best_s), np.where(better, b, best_b), np.where(better, e, best_e)
    return best_s[:, 0], best_b[:, 0]


def _steps(top: int) -> np.ndarray:
    """The stretched grids' levels per range: top - 1 .. top + 1 in SCALE_STEPS steps."""
    return np.array([top - 1.0 + 2.0 * i / SCALE_STEPS for i in range(SCALE_STEPS + 1)], np.float32)


def _error(x: np.ndarray, sums: np.ndarray, s: np.ndarray, b: np.ndarray, top: int, work: np.ndarray) -> np.ndarray:
    """sum(wt * (x - s·levels(x, s, b) - b)²) over each group (x: (groups, group size), sums[0] the weights
    wt) for every candidate scale and bias (s, b: (groups, candidates)), as s² · sum(wt * (t -
    levels)²) with t = (x - b) / s; `work` holds two buffers of (groups, candidates, group size)."""
    t, r = work[0, :, : s.shape[1]], work[1, :, : s.shape[1]]
    np.subtract(x[:, None, :], b[..., None], out=t)
    np.divide(t, np.where(s == 0, np.float32(1), s)[..., None], out=t)
    np.clip(np.rint(t, out=r), 0, top, out=r)
    np.subtract(t, r, out=r)
    np.multiply(r, r, out=r)
    e = np.einsum("nck,nk->nc", r, sums[0]) * (s * s)
    if (s == 0).any():  # a zero scale puts every value on the bias: the error is that of x - b itself
        np.subtract(x[:, None, :], b[..., None], out=t)
        e = np.where(s == 0, np.einsum("nck,nck,nk->nc", t, t, sums[0]), e)
    return e


def _refit(q: np.ndarray, sums: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares x ≈ s·q + b per group and candidate: q (groups, candidates, group size); sums
    (2, groups, group size): wt and wt·x; `work` q's shape."""
    # einsum, not matmul: numpy's matmul calls its wheel's BLAS, whose thread start-up costs more than these sums.
    sw, sx = sums.sum(-1)[..., None]
    sq, sqx = np.einsum("nck,nk->nc", q, sums[0]), np.einsum("nck,nk->nc", q, sums[1])
    sqq = np.einsum("nck,nk->nc", np.multiply(q, q, out=work), sums[0])
    det = sw * sqq - sq * sq
    ok = det > 1e-20
    s = np.where(ok, (sw * sqx - sq * sx) / np.where(ok, det, 1), 0).astype(np.float32)
    return s, ((sx - s * sq) / np.maximum(sw, np.float32(1e-20))).astype(np.float32)


def round_scales(v: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (to nearest, ties to even, as MLX casts), as float32."""
    if dtype == "float16":
        return v.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = v.astype(np.float32).view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return bits.view(np.float32)
    return v.astype(np.float32)


def dtype_name(dtype: Any) -> str:
    import mlx.core as mx

    names = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
    if dtype not in names:
        raise QuantizationError(f"scales are stored as float16, bfloat16 or float32, not {dtype}")
    return names[dtype]


def fit_affine(w: Any, group_size: int, bits: int, importance: Any = None, dtype: Any = None) -> tuple[Any, Any, Any]:
    """(packed weight, scales, biases) for `w` (out, in) in MLX's affine layout, the grid of each group chosen
    to minimise sum(importance[col] * (w - s·q - b)²) with s and b rounded to `dtype` (default float16), see
    `fit_grid`."""
    import mlx.core as mx

    if bits not in PACKED_BITS:
        raise QuantizationError(f"importance-weighted recipes pack {PACKED_BITS} bits, not {bits}")
    if w.shape[-1] % group_size:
        raise QuantizationError(f"a {w.shape[-1]}-column weight does not split into groups of {group_size}")
    dtype = dtype or mx.float16
    rows, groups = w.shape[0], w.shape[-1] // group_size
    x = np.array(w.astype(mx.float32)).reshape(-1, group_size)
    if importance is None:
        wt = np.ones_like(x)
    else:
        wt = np.tile(np.array(importance.astype(mx.float32)).reshape(groups, group_size), (rows, 1))
    s, b = grid_search(x, wt, bits, dtype_name(dtype))
    q = mx.array(grid_levels(x, s, b, 2**bits - 1)).reshape(w.shape)
    return (
        pack(q, bits),
        mx.array(s).reshape(rows, groups).astype(dtype),
        mx.array(b).reshape(rows, groups).astype(dtype),
    )


def activation_importance(model: Any, calibration: Any, batch_size: int = 4) -> dict[str, Any]:
    """Mean squared input per channel of every quantizable layer over the calibration rows, by path. A tied
    embedding is weighted by the hidden states it projects to logits; an untied one gets None (its rows are
    looked up, not multiplied). Layers fed the same input get the same array."""
    return input_statistics(model, calibration, lambda x: (x * x).sum(0), batch_size)


def input_statistics(model: Any, calibration: Any, reduce: Callable[[Any], Any], batch_size: int = 4) -> dict[str, Any]:
    """Sum of `reduce(inputs)` over the calibration rows, divided by the token count, for every quantizable
    layer by path (inputs as float32 (tokens, in_features); None for an untied embedding, which only looks
    rows up). Layers fed the same input (a layer's q/k/v projections) get one array, reduced once per batch."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    sums: dict[str, Any] = {}
    # Per batch, each distinct input array by id (kept alive, so ids stay unique) with its reduction and the
    # first path that read it; across batches, that first path for every path.
    batch: dict[int, tuple[Any, Any, str]] = {}
    owners: dict[str, set[str]] = {}

    def add(path: str, x: Any) -> None:
        if id(x) not in batch:
            batch[id(x)] = (x, reduce(x.astype(mx.float32).reshape(-1, x.shape[-1])), path)
        _, v, owner = batch[id(x)]
        owners.setdefault(path, set()).add(owner)
        sums[path] = v if path not in sums else sums[path] + v

    class Linear(nn.Module):
        def __init__(self, inner: Any, path: str) -> None:
            super().__init__()
            self.inner, self.record = inner, lambda x: add(path, x)

        def __call__(self, x: Any) -> Any:
            self.record(x)
            return self.inner(x)

    class Embedding(Linear):
        def __call__(self, x: Any) -> Any:
            return self.inner(x)

        def as_linear(self, x: Any) -> Any:
            self.record(x)
            return self.inner.as_linear(x)

    originals = [(p, m) for p, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    model.update_modules(
        tree_unflatten([(p, (Embedding if isinstance(m, nn.Embedding) else Linear)(m, p)) for p, m in originals])
    )
    try:
        for start in range(0, calibration.shape[0], batch_size):
            model(calibration[start : start + batch_size])
            # Only the statistics are evaluated: MLX then never computes what they do not need (the logits).
            mx.eval(list(sums.values()))
            batch.clear()
    finally:
        model.update_modules(tree_unflatten(originals))
    rows = calibration.size
    out = {p: sums[p] / rows if p in sums else None for p, _ in originals}
    for path, first in owners.items():
        if len(first) == 1 and (owner := next(iter(first))) != path:
            out[path] = out[owner]  # the same sums, added in the same order: one array for both
    return out
