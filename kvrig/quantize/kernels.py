"""The compiled inner loops (numba) of kvrig's quantizers; each releases the GIL, and its caller runs it on one
thread per core. Compiled on first use and cached beside this file (or in numba's user cache where that is not
writable).

`search_groups`, the grid search of the importance-weighted recipes: for each group of a weight, the (scale, bias)
of its affine grid that minimises sum(wt · (x - s·levels - b)²), with s and b rounded to the scales' dtype.
Candidates, in order (the first of equal errors wins): MLX's round-to-nearest grid, the min/max grid, the min/max
grids of ranges stretched by -1 .. +1 level (SCALE_STEPS steps), each refitted by weighted least squares; then
three assign/refit steps from the best. A later candidate is kept only when its error is strictly lower and its
scale positive. tests/quality/reference_quant.py writes the same search out in MLX, one candidate at a time. One
pass over a group's values per candidate, in registers: in numpy the search took a dozen passes over (groups x
candidates x group size) temporaries and most of imx's and gpx's time.

`feed_columns`, gpx's error feedback within one group of columns (gpx.feedback), one column at a time: in numpy,
five calls per column of every weight were a Python loop of ~10^5 iterations."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

SCALE_STEPS = 20
"""Stretched grids tried per group (range/(levels-1) stretched by -1 .. +1 level), each refitted. Fewer searched
faster but cost the gpx recipes perplexity."""
DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2}
"""The scales' dtype as the kernel takes it."""

# The sums of `_error` and `_refit` (compiled apart, not inlined) may be reordered, which vectorizes them. Nothing
# else may: reordered, the stretched levels crossed level boundaries and some groups' searches ended worse.
_MATH = {"reassoc", "nsz", "contract"}


# A scalar's view, not a one-element array's: an array is a heap allocation per call, and `rounded` runs twice per
# candidate grid (most of the grid search's time, with arrays).
@njit(inline="always")
def _to_bits(v: Any) -> Any:
    return np.float32(v).view(np.uint32)


@njit(inline="always")
def _from_bits(bits: Any) -> Any:
    return np.uint32(bits).view(np.float32)


@njit(inline="always")
def rounded(v: Any, dtype: int) -> Any:
    """float32 `v` rounded to float16 (dtype 0) or bfloat16 (1), to nearest, ties to even, as MLX casts; float32
    (2) unchanged."""
    if dtype == 2 or v != v:
        return v
    if dtype == 1:
        bits = _to_bits(v)
        return _from_bits((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    a = abs(v)
    if a >= np.float32(65520.0):  # rounds past float16's largest finite value, 65504
        return np.float32(np.inf) if v > 0 else np.float32(-np.inf)
    if a < np.float32(6.103515625e-05):  # float16's subnormals: whole multiples of 2^-24
        return np.float32(np.rint(v * np.float32(16777216.0)) / np.float32(16777216.0))
    bits = _to_bits(v)
    return _from_bits((bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000))


@njit(fastmath=_MATH)
def _error(x: np.ndarray, w: np.ndarray, s: Any, b: Any, top: Any) -> Any:
    """sum(w · (x - s·levels - b)²) with each value on its nearest level of the grid s, b."""
    e = np.float32(0.0)
    if s == 0:  # every value on the bias
        for j in range(x.shape[0]):
            d = x[j] - b
            e += w[j] * d * d
        return e
    inv = np.float32(1.0) / s  # one division: a vector division costs several multiplications
    for j in range(x.shape[0]):
        t = (x[j] - b) * inv
        d = t - min(max(np.rint(t), np.float32(0.0)), top)
        e += w[j] * d * d
    return e * (s * s)


@njit(fastmath=_MATH)
def _refit(q: np.ndarray, w: np.ndarray, wx: np.ndarray, sw: Any, sx: Any) -> tuple[Any, Any]:
    """Weighted least squares x ≈ s·q + b (wx = w·x; sw, sx their sums)."""
    sq = np.float32(0.0)
    sqx = np.float32(0.0)
    sqq = np.float32(0.0)
    for j in range(q.shape[0]):
        sq += q[j] * w[j]
        sqx += q[j] * wx[j]
        sqq += q[j] * q[j] * w[j]
    det = sw * sqq - sq * sq
    s = (sw * sqx - sq * sx) / det if det > np.float32(1e-20) else np.float32(0.0)
    return s, (sx - s * sq) / max(sw, np.float32(1e-20))


@njit(nogil=True, cache=True)
def search_groups(
    x: np.ndarray,
    wt: np.ndarray,
    first: int,
    rtn_s: np.ndarray,
    rtn_b: np.ndarray,
    bits: int,
    dtype: int,
    out_s: np.ndarray,
    out_b: np.ndarray,
) -> None:
    """The grid of each group (row) of float32 `x` (groups, group size) into out_s, out_b (groups,). Weights
    `wt` (rows, group size): x's group g (group first + g of the whole search) is weighted by row (first + g)
    % rows (one row for all groups, or one per group of a weight's row). rtn_s, rtn_b: MLX's own grid of each
    group (`mx.quantize`); `dtype`: a value of DTYPES."""
    top = np.float32(2**bits - 1)
    k = x.shape[1]
    q = np.empty(k, np.float32)
    wx = np.empty(k, np.float32)
    for g in range(x.shape[0]):
        xs, w = x[g], wt[(first + g) % wt.shape[0]]
        sw = np.float32(0.0)
        sx = np.float32(0.0)
        lo, hi = xs[0], xs[0]
        for j in range(k):
            wx[j] = w[j] * xs[j]
            sw += w[j]
            sx += wx[j]
            lo, hi = min(lo, xs[j]), max(hi, xs[j])
        span = max(hi - lo, np.float32(1e-12))
        best_s, best_b = rounded(rtn_s[g], dtype), rounded(rtn_b[g], dtype)
        best_e = _error(xs, w, best_s, best_b, top)
        if best_e != best_e:  # MLX's grid with a NaN error is kept outright, as when NaN compares below all
            out_s[g], out_b[g] = best_s, best_b
            continue
        for c in range(SCALE_STEPS + 2):
            if c == 0:
                s, b = span / top, lo
            else:
                stretch = np.float32(2**bits - 2.0 + 2.0 * (c - 1) / SCALE_STEPS) / span
                changed = c == 1
                for j in range(k):
                    level = min(np.rint((xs[j] - lo) * stretch), top)  # x - lo >= 0: only the top needs clipping
                    changed |= level != q[j]
                    q[j] = level
                if not changed:
                    # The previous stretch's levels again, so its grid and error again: never strictly better.
                    # (Common on a source already on a 4-bit grid, as a Q4_1 GGUF is.)
                    continue
                s, b = _refit(q, w, wx, sw, sx)
            s, b = rounded(s, dtype), rounded(b, dtype)
            if s > 0:
                e = _error(xs, w, s, b, top)
                if e < best_e:
                    best_s, best_b, best_e = s, b, e
        for _ in range(3):
            inv = np.float32(1.0) / (best_s if best_s != 0 else np.float32(1.0))
            for j in range(k):
                q[j] = min(max(np.rint((xs[j] - best_b) * inv), np.float32(0.0)), top)
            s, b = _refit(q, w, wx, sw, sx)
            s, b = rounded(s, dtype), rounded(b, dtype)
            e = _error(xs, w, s, b, top)
            if not (e < best_e and s > 0):
                break  # the best grid is unchanged, so each further step would repeat this one
            best_s, best_b, best_e = s, b, e
        out_s[g], out_b[g] = best_s, best_b


@njit(nogil=True, cache=True)
def round_all(v: np.ndarray, dtype: int) -> np.ndarray:
    """`rounded` over a float32 array (for tests and callers outside the kernel)."""
    out = np.empty_like(v)
    for i in range(v.size):
        out.flat[i] = rounded(v.flat[i], dtype)
    return out


@njit(nogil=True, cache=True)
def feed_columns(
    cur: np.ndarray,
    u: np.ndarray,
    s: np.ndarray,
    b: np.ndarray,
    bits: int,
    g0: int,
    g1: int,
    o0: int,
    o1: int,
    levels: np.ndarray,
    errors: np.ndarray,
) -> None:
    """Columns g0 .. g1 of a weight held transposed (`cur` (in, out), error-updated so far), output rows o0 ..
    o1, on their group's grid s, b (out,): each column's levels and its error divided by U[i, i] into `levels`
    and `errors` (in, out), the error moved onto the group's later columns times U[i, j] (U: gpx.inverse_factor)."""
    top = np.float32(2**bits - 1)
    width = o1 - o0
    inv = np.empty(width, np.float32)  # each grid's 1 / scale, once: the columns multiply by it
    for o in range(width):
        inv[o] = np.float32(1.0) / (s[o0 + o] if s[o0 + o] != 0 else np.float32(1.0))
    # Row slices, indexed from 0: LLVM vectorizes their loops, not those indexing the 2-D arrays (the same
    # arithmetic in the same order).
    grid_s, grid_b = s[o0:o1], b[o0:o1]
    for i in range(g0, g1):
        pivot = u[i, i]
        column, level, error = cur[i, o0:o1], levels[i, o0:o1], errors[i, o0:o1]
        for o in range(width):
            v = min(max(np.rint((column[o] - grid_b[o]) * inv[o]), np.float32(0.0)), top)
            level[o] = v
            error[o] = (column[o] - (grid_s[o] * v + grid_b[o])) / pivot
        for j in range(i + 1, g1):
            factor = u[i, j]
            later = cur[j, o0:o1]
            for o in range(width):
                later[o] -= factor * error[o]
