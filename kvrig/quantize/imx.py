"""Importance-weighted affine quantization (the `imx-` recipes): each group's scale and bias are fitted to
minimise the weight error weighted by how strongly calibration activations drive each input channel (mean
x² per channel, llama.cpp's "imatrix" idea), instead of MLX's round-to-nearest grid that always contains 0.

The packed layout is MLX's own (same `weight`/`scales`/`biases` arrays `quantize_model` makes), so the planner
and the Swift loader see an ordinary affine-quantized model; only the values differ. The mixed variant gives
the MLP up/down projections of the last layers group size 32 until a bits-per-weight target is met."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.recipes import PACKED_BITS

"""Widths whose MLX packing this module writes itself (a little-endian bit stream of uint32 words: value k
of a row takes bits k·b .. k·b+b-1, so 3, 5 and 6 bits cross word boundaries)."""
SCALE_STEPS = 20
"""Candidate grids tried per group (scale stretched from range/(levels-1) by -1 .. +1 level), each refitted."""


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


def levels(x: Any, s: Any, b: Any, top: int) -> Any:
    import mlx.core as mx

    return mx.clip(mx.round((x - b[..., None]) / mx.where(s == 0, 1, s)[..., None]), 0, top)


def _refit(x: Any, q: Any, wt: Any) -> tuple[Any, Any]:
    """Weighted least squares x ≈ s·q + b per group (last axis)."""
    import mlx.core as mx

    sw, sq, sqq = wt.sum(-1), (wt * q).sum(-1), (wt * q * q).sum(-1)
    sx, sqx = (wt * x).sum(-1), (wt * q * x).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 1e-20
    s = mx.where(ok, (sw * sqx - sq * sx) / mx.where(ok, det, 1), 0)
    return s, (sx - s * sq) / mx.maximum(sw, 1e-20)


def fit_grid(x: Any, wt: Any, bits: int, dtype: Any) -> tuple[Any, Any]:
    """(scale, bias) per group of `x` (..., groups, group_size), rounded to `dtype`, returned as float32,
    minimising sum(wt * (x - s·q - b)²): candidates are min/max grids of stretched ranges and MLX's own
    round-to-nearest grid, each refitted by least squares, then a few alternating assign/refit steps."""
    import mlx.core as mx

    top = 2**bits - 1
    lo, hi = x.min(-1), x.max(-1)
    span = mx.maximum(hi - lo, 1e-12)

    def rounded(v: Any) -> Any:
        return v.astype(dtype).astype(mx.float32)

    def err(s: Any, b: Any) -> Any:
        return (wt * (x - s[..., None] * levels(x, s, b, top) - b[..., None]) ** 2).sum(-1)

    _, s0, b0 = mx.quantize(x.reshape(-1, x.shape[-1]), x.shape[-1], bits)
    s0, b0 = s0.reshape(x.shape[:-1]), b0.reshape(x.shape[:-1])
    best_s, best_b = rounded(s0), rounded(b0)
    best_e = err(best_s, best_b)

    def keep(s: Any, b: Any) -> None:
        nonlocal best_s, best_b, best_e
        s, b = rounded(s), rounded(b)
        e = err(s, b)
        better = (e < best_e) & (s > 0)
        best_s, best_b, best_e = mx.where(better, s, best_s), mx.where(better, b, best_b), mx.where(better, e, best_e)
        mx.eval(best_s, best_b, best_e)

    keep(span / top, lo)
    for i in range(SCALE_STEPS + 1):
        stretch = (top - 1.0 + 2.0 * i / SCALE_STEPS) / span
        keep(*_refit(x, mx.clip(mx.round(stretch[..., None] * (x - lo[..., None])), 0, top), wt))
    for _ in range(3):
        keep(*_refit(x, levels(x, best_s, best_b, top), wt))
    return best_s, best_b


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
    top = 2**bits - 1
    x = w.astype(mx.float32).reshape(*w.shape[:-1], -1, group_size)
    if importance is None:
        wt = mx.ones_like(x)
    else:
        wt = mx.broadcast_to(importance.astype(mx.float32).reshape(-1, group_size), x.shape)
    best_s, best_b = fit_grid(x, wt, bits, dtype)
    scales, biases = best_s.astype(dtype), best_b.astype(dtype)
    q = levels(x, scales.astype(mx.float32), biases.astype(mx.float32), top)
    return pack(q.reshape(w.shape), bits), scales, biases


def activation_importance(model: Any, calibration: Any, batch_size: int = 4) -> dict[str, Any]:
    """Mean squared input per channel of every quantizable layer over the calibration rows, by path. A tied
    embedding is weighted by the hidden states it projects to logits; an untied one gets None (its rows are
    looked up, not multiplied)."""
    return input_statistics(model, calibration, lambda x: (x**2).sum(0), batch_size)


def input_statistics(model: Any, calibration: Any, reduce: Callable[[Any], Any], batch_size: int = 4) -> dict[str, Any]:
    """Sum of `reduce(inputs)` over the calibration rows, divided by the token count, for every quantizable
    layer by path (inputs as float32 (tokens, in_features); None for an untied embedding, which only looks
    rows up)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    sums: dict[str, Any] = {}

    def add(path: str, x: Any) -> None:
        v = reduce(x.astype(mx.float32).reshape(-1, x.shape[-1]))
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
            mx.eval(model(calibration[start : start + batch_size]), list(sums.values()))
    finally:
        model.update_modules(tree_unflatten(originals))
    rows = calibration.size
    return {p: sums[p] / rows if p in sums else None for p, _ in originals}
