"""Straightforward reference implementations of kvrig's importance-weighted grid search and GPTQ-style error
feedback, in MLX, one candidate grid and one column at a time: the definitions the fast paths in
kvrig/quantize (imx.fit_grid, gpx.fit_feedback) must agree with. Slow; for tiny matrices in tests only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrig.quantize.kernels import SCALE_STEPS


def levels(x: Any, s: Any, b: Any, top: int) -> Any:
    return mx.clip(mx.round((x - b[..., None]) / mx.where(s == 0, 1, s)[..., None]), 0, top)


def refit(x: Any, q: Any, wt: Any) -> tuple[Any, Any]:
    """Weighted least squares x ≈ s·q + b per group (last axis)."""
    sw, sq, sqq = wt.sum(-1), (wt * q).sum(-1), (wt * q * q).sum(-1)
    sx, sqx = (wt * x).sum(-1), (wt * q * x).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 1e-20
    s = mx.where(ok, (sw * sqx - sq * sx) / mx.where(ok, det, 1), 0)
    return s, (sx - s * sq) / mx.maximum(sw, 1e-20)


def error(x: Any, wt: Any, s: Any, b: Any, top: int) -> Any:
    return (wt * (x - s[..., None] * levels(x, s, b, top) - b[..., None]) ** 2).sum(-1)


def fit_grid(x: Any, wt: Any, bits: int, dtype: Any) -> tuple[Any, Any]:
    """(scale, bias) per group of x (..., groups, group_size) rounded to dtype, as float32: MLX's grid, then
    each candidate in turn (min/max grid, 21 stretched ranges refitted, 3 assign/refit steps), kept when its
    weighted error is strictly lower and its scale positive."""
    top = 2**bits - 1
    lo, hi = x.min(-1), x.max(-1)
    span = mx.maximum(hi - lo, 1e-12)

    def rounded(v: Any) -> Any:
        return v.astype(dtype).astype(mx.float32)

    _, s0, b0 = mx.quantize(x.reshape(-1, x.shape[-1]), x.shape[-1], bits)
    best_s, best_b = rounded(s0.reshape(x.shape[:-1])), rounded(b0.reshape(x.shape[:-1]))
    best_e = error(x, wt, best_s, best_b, top)

    def keep(s: Any, b: Any) -> None:
        nonlocal best_s, best_b, best_e
        s, b = rounded(s), rounded(b)
        e = error(x, wt, s, b, top)
        better = (e < best_e) & (s > 0)
        best_s, best_b, best_e = mx.where(better, s, best_s), mx.where(better, b, best_b), mx.where(better, e, best_e)

    keep(span / top, lo)
    for i in range(SCALE_STEPS + 1):
        stretch = (top - 1.0 + 2.0 * i / SCALE_STEPS) / span
        keep(*refit(x, mx.clip(mx.round(stretch[..., None] * (x - lo[..., None])), 0, top), wt))
    for _ in range(3):
        keep(*refit(x, levels(x, best_s, best_b, top), wt))
    return best_s, best_b


def fit_feedback(w: Any, hessian: Any, group_size: int, bits: int, dtype: Any, damping: float) -> tuple[Any, Any, Any]:
    """(levels, scales, biases) of w (out, in): columns in order, each column's error e = (w - ŵ) / U[i, i]
    (U the upper Cholesky factor of the damped H⁻¹) subtracted times U[i, j] from every later column j at once;
    each group's grid fitted (`fit_grid`, weighted by H's diagonal) to the updated weights when it starts."""
    top = 2**bits - 1
    h = hessian.astype(mx.float32)
    diag = mx.diagonal(h)
    dead = diag <= 0
    h = h + mx.diag(mx.where(dead, 1.0, 0.0) + damping * mx.mean(diag))
    weights = mx.where(dead, 0.0, diag)
    u = mx.linalg.cholesky(mx.linalg.inv(h, stream=mx.cpu), upper=True, stream=mx.cpu)
    cur = w.astype(mx.float32)
    n = w.shape[1]
    qs, scales, biases = [], [], []
    s = b = mx.zeros((w.shape[0],))
    for i in range(n):
        if i % group_size == 0:
            block = cur[:, i : i + group_size]
            s, b = fit_grid(
                block[:, None, :], mx.broadcast_to(weights[i : i + group_size], block.shape)[:, None, :], bits, dtype
            )
            s, b = s[:, 0], b[:, 0]
            scales.append(s)
            biases.append(b)
        col = cur[:, i]
        q = levels(col[:, None], s, b, top)[:, 0]
        e = (col - (s * q + b)) / u[i, i]
        cur[:, i + 1 :] = cur[:, i + 1 :] - e[:, None] * u[i, i + 1 :][None]
        qs.append(q)
        mx.eval(cur)
    return mx.stack(qs, axis=1), mx.stack(scales, 1), mx.stack(biases, 1)
