"""Importance-weighted affine quantization (the `imx-` recipes): each group's scale and bias are fitted to
minimise the weight error weighted by how strongly calibration activations drive each input channel (mean
x² per channel, llama.cpp's "imatrix" idea), instead of MLX's round-to-nearest grid that always contains 0.

The packed layout is MLX's own (same `weight`/`scales`/`biases` arrays `quantize_model` makes), so the planner
and the Swift loader see an ordinary affine-quantized model; only the values differ. The mixed variant gives
the attention k/v projections, then the MLP down/up projections of the last layers, group size 32 until a
bits-per-weight target is met."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvrig.exceptions import QuantizationError
from kvrig.quantize.blas_threads import single_threaded_blas
from kvrig.recipes import PACKED_BITS


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
    """`fit_grid` on float32 numpy arrays: x (groups, group size); wt (rows, group size), group g weighted by row
    g % rows (one row for every group, or one per group of a weight's row); `dtype` names the scales' type
    ("float16", "bfloat16" or "float32"). The search is `grid.search_groups`, on one thread per core."""
    import mlx.core as mx

    from kvrig.quantize.kernels import DTYPES, search_groups

    x, wt = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(wt, np.float32)
    _, s0, b0 = mx.quantize(mx.array(x), x.shape[1], bits)
    rtn_s, rtn_b = np.array(s0).reshape(-1), np.array(b0).reshape(-1)
    s, b = np.empty(len(x), np.float32), np.empty(len(x), np.float32)

    def run(start: int, stop: int) -> None:
        part = slice(start, stop)
        search_groups(x[part], wt, start, rtn_s[part], rtn_b[part], bits, DTYPES[dtype], s[part], b[part])

    on_cores(len(x), run)
    return s, b


def on_cores(total: int, run: Callable[[int, int], None]) -> None:
    """run(start, stop) over 0 .. total in parts of at least MIN_PART, one part per core (the compiled kernels
    release the GIL)."""
    parts = max(1, min(os.cpu_count() or 1, total // MIN_PART))
    size = -(-total // parts)
    spans = [(start, min(start + size, total)) for start in range(0, total, size)]
    if len(spans) == 1:
        run(*spans[0])
    else:
        list(_pool().map(lambda span: run(*span), spans))


MIN_PART = 256
"""Rows below which work is not split over threads: a handoff to a thread costs more than a few rows' work."""
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """One thread per core for the whole process: gpx runs the kernels a few rows at a time, thousands of times,
    and starting threads for each run cost more than the run on a loaded machine."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvrig-quantize"))
    return _POOL[0]


def grid_levels(x: np.ndarray, s: np.ndarray, b: np.ndarray, top: int) -> np.ndarray:
    """The level of each value of x (groups, group size) on its group's grid s, b (groups,): the nearest, in
    0 .. top."""
    return np.clip(np.rint((x - b[:, None]) / np.where(s == 0, np.float32(1), s)[:, None]), 0, top)


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
    # Row r·groups + g of x is group g of weight row r: weighted by row g of wt.
    if importance is None:
        wt = np.ones((1, group_size), np.float32)
    else:
        wt = np.array(importance.astype(mx.float32)).reshape(groups, group_size)
    s, b = grid_search(x, wt, bits, dtype_name(dtype))
    q = mx.array(grid_levels(x, s, b, 2**bits - 1)).reshape(w.shape)
    return (
        pack(q, bits),
        mx.array(s).reshape(rows, groups).astype(dtype),
        mx.array(b).reshape(rows, groups).astype(dtype),
    )


BATCH_ROWS = 4
"""Calibration rows per forward pass of the statistics. All of kvrig package's 8 in one pass was faster but moved
gpx-4.6's held-out perplexity (the same sums in another float order): gpx is that sensitive to rounding, and the
documented figures are measured with this setting."""
STREAMS = 2
"""Calibration batches in flight at once, each on a stream of its own (`input_statistics`). With OpenBLAS on one
thread per call it changes the sums' rounding as BATCH_ROWS does; the documented figures are measured with it."""


def activation_importance(model: Any, calibration: Any, batch_size: int = BATCH_ROWS) -> dict[str, Any]:
    """Mean squared input per channel of every quantizable layer over the calibration rows, by path. A tied
    embedding is weighted by the hidden states it projects to logits; an untied one gets None (its rows are
    looked up, not multiplied). Layers fed the same input get the same array."""
    return input_statistics(model, calibration, lambda x: [(x * x).sum(0)], batch_size)


def input_statistics(
    model: Any,
    calibration: Any,
    reduce: Callable[[Any], list[Any]],
    batch_size: int = BATCH_ROWS,
    finish: Callable[[list[Any]], Any] = lambda parts: parts[0],
) -> dict[str, Any]:
    """`finish` of the sums of `reduce(inputs)` (a list of arrays, summed part by part) over the calibration
    rows, divided by the token count, for every quantizable layer by path (inputs as float32 (tokens,
    in_features); None for an untied embedding, which only looks rows up). Layers fed the same input (a layer's
    q/k/v projections) get one array, reduced once per batch."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    sums: dict[str, Any] = {}
    # The latest input array (a layer's q/k/v projections read theirs one after another), with its reduction and
    # the first path that read it; across batches, that first path for every path. Only the latest is held: each
    # input held until the batch is evaluated kept every layer's activations in memory.
    latest: list[tuple[Any, Any, str]] = []
    owners: dict[str, set[str]] = {}

    def add(path: str, x: Any) -> None:
        if not latest or latest[0][0] is not x:
            latest[:] = [(x, reduce(x.astype(mx.float32).reshape(-1, x.shape[-1])), path)]
        _, v, owner = latest[0]
        owners.setdefault(path, set()).add(owner)
        sums[path] = v if path not in sums else [a + b for a, b in zip(sums[path], v, strict=True)]

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
    # Batches run in pairs, each on a stream of its own: on a CPU the element-wise ops (exp, in softmax and SiLU)
    # take one core each, and with single-threaded BLAS neither waits for the other's matrix products (about a
    # third of the statistics' time on 2 cores, at the memory of a second batch's activations).
    streams = [mx.new_stream(mx.default_device()) for _ in range(STREAMS)]
    starts = list(range(0, calibration.shape[0], batch_size))
    try:
        with single_threaded_blas():
            for pair in range(0, len(starts), STREAMS):
                for stream, start in zip(streams, starts[pair : pair + STREAMS], strict=False):
                    with mx.stream(stream):
                        model(calibration[start : start + batch_size])
                # Only the statistics are evaluated: MLX then never computes what they do not need (the logits).
                mx.eval(list(sums.values()))
    finally:
        model.update_modules(tree_unflatten(originals))
    rows = calibration.size
    out = {p: finish([part / rows for part in sums[p]]) if p in sums else None for p, _ in originals}
    for path, first in owners.items():
        if len(first) == 1 and (owner := next(iter(first))) != path:
            out[path] = out[owner]  # the same sums, added in the same order: one array for both
    return out
