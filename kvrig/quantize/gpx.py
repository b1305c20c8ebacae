"""GPTQ-style error feedback on the importance-weighted grids (the `gpx-` recipes): a layer's input columns
are quantized in order, and each column's rounding error is pushed onto the columns not yet quantized through
the inverse of the calibration Hessian H = XᵀX, so that the layer's output X·Ŵᵀ (not each weight) stays close.
Each group's grid is `fit_grid`'s, fitted to the current, error-updated weights when the group starts.

The written arrays are MLX's affine layout (`pack`), so bytes and loaders are those of the `imx-` recipes."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from kvrig.exceptions import QuantizationError
from kvrig.quantize.imx import BATCH_ROWS, dtype_name, grid_search, input_statistics, on_cores, pack
from kvrig.recipes import PACKED_BITS

DAMPING = 0.1
"""Added to H's diagonal, as a fraction of its mean: keeps the inverse finite for rarely driven channels, and
keeps the feedback from fitting the calibration text too closely (chosen on held-out text; docs/quality.md)."""
EMBEDDING_DAMPING = 1.0
"""The same for a tied embedding: its rows are also looked up, where the error feedback moves onto other
columns only hurts, so H is pulled towards its diagonal (chosen as DAMPING was)."""


def input_hessians(model: Any, calibration: Any, batch_size: int = BATCH_ROWS) -> dict[str, Any]:
    """XᵀX / tokens of every quantizable layer's inputs over the calibration rows, by path (None for an untied
    embedding)."""
    return input_statistics(model, calibration, gram_strips, batch_size, finish=gram_matrix)


STRIP = 128
"""Rows per strip of XᵀX (`gram_strips`): on SmolLM2's 576- and 1536-wide inputs the strips took two thirds of
the full product's time on this project's 2-core host; narrower ones lost it to more, smaller products."""


def gram_strips(x: Any) -> list[Any]:
    """XᵀX's upper triangle as strips of STRIP rows, each from the diagonal to the last column: about half the
    products of XᵀX (which is symmetric), in products still wide enough for BLAS to run at full speed. Each entry
    is the same dot product over the tokens as in x.T @ x (with OpenBLAS, the same float: the gpx recipes' bytes
    did not change); `gram_matrix` puts them back together."""
    n = x.shape[-1]
    # A narrow last strip joins the one before: BLAS sums tiny products in another order (another float).
    starts = [i for i in range(0, n, STRIP) if i == 0 or n - i >= STRIP // 2]
    return [x[:, i:stop].T @ x[:, i:] for i, stop in zip(starts, [*starts[1:], n], strict=True)]


def gram_matrix(strips: list[Any]) -> Any:
    """The symmetric matrix whose upper triangle `gram_strips` computed: each strip's rows, led by the columns
    below the diagonal (the earlier strips' entries, transposed)."""
    import mlx.core as mx

    n = strips[0].shape[1]
    starts = [n - strip.shape[1] for strip in strips]
    rows = []
    for strip, start in zip(strips, starts, strict=True):
        height = strip.shape[0]
        left = [up[:, start - s : start - s + height].T for up, s in zip(strips, starts, strict=True) if s < start]
        rows.append(mx.concatenate([*left, strip], axis=1))
    return mx.concatenate(rows, axis=0)


def fit_feedback(
    w: Any,
    hessian: Any,
    group_size: int,
    bits: int,
    dtype: Any = None,
    damping: float = DAMPING,
    factors: dict[tuple[int, float], Any] | None = None,
) -> tuple[Any, Any, Any]:
    """(packed weight, scales, biases) for `w` (out, in) in MLX's affine layout, columns quantized in order
    with GPTQ's error feedback: the error e of column i, divided by U[i, i] (U the upper Cholesky factor of
    H⁻¹), is subtracted times U[i, j] from every later column j, which minimises the growth of
    tr((W - Ŵ) H (W - Ŵ)ᵀ). Each group's grid is fitted (weighted by H's diagonal) when its first column is
    reached. Rows sharing H (a layer's q/k/v projections) may come stacked in one `w`. `factors`, when given,
    keeps each H's inverse factor for the next weight that reads the same H at another grid."""
    import mlx.core as mx

    if bits not in PACKED_BITS:
        raise QuantizationError(f"importance-weighted recipes pack {PACKED_BITS} bits, not {bits}")
    n = w.shape[-1]
    if n % group_size:
        raise QuantizationError(f"a {n}-column weight does not split into groups of {group_size}")
    dtype = dtype or mx.float16
    factors = {} if factors is None else factors
    if (key := (id(hessian), damping)) not in factors:
        # The Hessian is kept beside its factor, so that its id is not reused while the entry lives.
        factors[key] = (hessian, *inverse_factor(hessian, damping))
    _, u, weights = factors[key]
    q, scales, biases = feedback(np.array(w.astype(mx.float32)), u, weights, group_size, bits, dtype_name(dtype))
    return pack(mx.array(q), bits), mx.array(scales).astype(dtype), mx.array(biases).astype(dtype)


def inverse_factor(hessian: Any, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """(U, the grids' importance): U the upper Cholesky factor of the damped H⁻¹, importance H's diagonal (0
    for a channel the calibration never drives: its weights cannot matter to the output, so H gets a 1 there
    to stay invertible)."""
    import mlx.core as mx

    h = hessian.astype(mx.float32)
    diag = mx.diagonal(h)
    dead = diag <= 0
    h = h + mx.diag(mx.where(dead, 1.0, 0.0) + damping * mx.mean(diag))
    # H = R·Rᵀ with R upper (the Cholesky factor of H with its order reversed) gives H⁻¹ = R⁻ᵀR⁻¹, so U = R⁻¹:
    # a third of the work of inverting H and factoring the inverse.
    r = mx.linalg.cholesky(h[::-1, ::-1], stream=mx.cpu)[::-1, ::-1]
    u = mx.linalg.tri_inv(r, upper=True, stream=mx.cpu)
    return np.array(u), np.array(mx.where(dead, 0.0, diag))


def feedback(
    w: np.ndarray, u: np.ndarray, weights: np.ndarray, group_size: int, bits: int, dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels (out, in), scales, biases (out, groups)) of float32 `w` (out, in) by GPTQ's error feedback with
    the factor `u` (`inverse_factor`), a group at a time as GPTQ's lazy batch updates: within a group, each
    column's error reaches the group's later columns at once (`kernels.feed_columns`); a group, when it starts,
    gets the errors of every earlier group as one matrix product. Each column sees the same updates as column by
    column; only the order of the sums differs. Output rows are independent: they are split over the cores."""
    import mlx.core as mx

    from kvrig.quantize.kernels import feed_columns

    cur = np.ascontiguousarray(w.T)  # column i of w is row i here, contiguous
    n, out = cur.shape
    q = np.empty_like(cur)
    scales = np.empty((n // group_size, out), np.float32)
    biases = np.empty_like(scales)
    u = np.ascontiguousarray(u, np.float32)
    # The errors live in an MLX array written through a numpy view (MLX's documented zero-copy view): the group
    # products read them where they are. They are MLX's: its BLAS (OpenBLAS) is several times numpy's wheel's.
    factor, shared = mx.array(u), mx.zeros((n, out), mx.float32)
    mx.eval(shared)
    errors = np.array(shared, copy=False)
    for g, g0 in enumerate(range(0, n, group_size)):
        g1 = g0 + group_size
        if g0:
            cur[g0:g1] -= np.array(factor[:g0, g0:g1].T @ shared[:g0], copy=False)
        s, b = grid_search(np.ascontiguousarray(cur[g0:g1].T), weights[None, g0:g1], bits, dtype)
        on_cores(out, functools.partial(feed_columns, cur, u, s, b, bits, g0, g1, levels=q, errors=errors))
        scales[g], biases[g] = s, b
    return np.ascontiguousarray(q.T), np.ascontiguousarray(scales.T), np.ascontiguousarray(biases.T)
