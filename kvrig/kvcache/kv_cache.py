"""A KV cache quantized at rest and dequantized when read, with keys and values at their own bit widths.

mlx-lm's QuantizedKVCache and its quantized attention take one bit width for both, and some models'
attention cannot take quantized keys at all (gemma2's soft-capping, gpt-oss's sinks), so for those the
cache dequantizes on read and attention runs on plain arrays. It has no `bits` attribute on purpose:
mlx-lm routes caches with `bits` to its one-width quantized SDPA.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, create_attention_mask

from kvrig.compat.mlx_lm_attention import route_attention
from kvrig.compat.mlx_lm_cache import BaseCache
from kvrig.exceptions import KVSchemeError

Quantized = tuple[mx.array, mx.array, mx.array]
DEQUANTIZED_ROWS = 16
"""Query rows (heads sharing a KV head x tokens) from which attention reads dequantized copies (BLAS)."""


class _QuantizedStore(BaseCache):
    """What both caches share: keys and values stored as mx.quantize triples, grown in mlx-lm's steps."""

    step = KVCache.step  # mlx-lm's growth, so these caches allocate as its own do
    keys: Quantized | None
    values: Quantized | None
    offset: int
    group_size: int
    key_bits: int
    value_bits: int

    def _empty(self, shape: tuple[int, ...], dim: int, bits: int, dtype: mx.Dtype) -> Quantized:
        return (
            mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // self.group_size), dtype=dtype),
            mx.zeros((*shape, dim // self.group_size), dtype=dtype),
        )

    def _store(self, keys: mx.array, values: mx.array) -> int:
        """Quantizes `keys` and `values` into the store after the tokens it holds, growing it first as mlx-lm's
        caches grow (whole 256-token steps, a ragged tail trimmed first; the planner replays this rule).
        Returns the offset the new tokens start at."""
        B, n_kv_heads, n, k_dim = keys.shape
        prev = self.offset
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[-2]:
            shape = (B, n_kv_heads, (self.step + n - 1) // self.step * self.step)
            new_k = self._empty(shape, k_dim, self.key_bits, keys.dtype)
            new_v = self._empty(shape, values.shape[-1], self.value_bits, values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys = tuple(mx.concatenate([a, b], axis=-2) for a, b in zip(self.keys, new_k, strict=True))  # type: ignore[assignment]
                self.values = tuple(mx.concatenate([a, b], axis=-2) for a, b in zip(self.values, new_v, strict=True))  # type: ignore[assignment]
        assert self.keys is not None and self.values is not None
        self.offset += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.key_bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.value_bits)
        for i in range(3):
            self.keys[i][..., prev : self.offset, :] = qk[i]
            self.values[i][..., prev : self.offset, :] = qv[i]
        return prev

    def size(self) -> int:
        return self.offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)  # type: ignore[misc]

    def empty(self) -> bool:
        return self.keys is None


class DequantizingKVCache(_QuantizedStore):
    def __init__(self, key_bits: int = 8, value_bits: int = 4, group_size: int = 64) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.offset = 0
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.group_size = group_size
        self._dtype: mx.Dtype = mx.float16

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._store(keys, values)
        self._dtype = keys.dtype
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Dequantized keys and values up to the offset (KV-shared layers read a cache through this)."""
        assert self.keys is not None and self.values is not None
        dtype = self._dtype
        k = tuple(x[..., : self.offset, :] for x in self.keys)
        v = tuple(x[..., : self.offset, :] for x in self.values)
        return (
            mx.dequantize(k[0], k[1], k[2], group_size=self.group_size, bits=self.key_bits).astype(dtype),
            mx.dequantize(v[0], v[1], v[2], group_size=self.group_size, bits=self.value_bits).astype(dtype),
        )

    @classmethod
    def from_kv_cache(cls, cache: KVCache, key_bits: int, value_bits: int, group_size: int) -> DequantizingKVCache:
        """Quantizes a filled fp cache in place of mlx-lm's `to_quantized` (keeps its capacity)."""
        out = cls(key_bits, value_bits, group_size)
        out.offset = cache.offset
        if cache.keys is not None and cache.values is not None:
            out._dtype = cache.keys.dtype
            out.keys = mx.quantize(cache.keys, group_size=group_size, bits=key_bits)  # type: ignore[assignment]
            out.values = mx.quantize(cache.values, group_size=group_size, bits=value_bits)  # type: ignore[assignment]
        return out

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.group_size, self.key_bits, self.value_bits

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.group_size, self.key_bits, self.value_bits = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


# --- kvrig's scheme cache: quantized attention with K and V at their own widths ---------------------------


def rotate(x: mx.array) -> mx.array:
    """The orthonormal Walsh-Hadamard transform of the last axis. For power-of-two sizes it is symmetric and
    its own inverse, so one function rotates keys and queries alike and undoes the rotation of values."""
    return mx.hadamard_transform(x)


class SchemeKVCache(_QuantizedStore):
    """Keys and values quantized at rest with their own bit widths, read by quantized matmuls (no dequantized
    copy), with the kvcache.json extras:

    - `rotation`: "hadamard_keys" stores H·k and attention uses H·q (dot products are unchanged, outliers are
      spread over the head dim before quantization); "hadamard" also stores H·v and un-rotates the output.
    - `sink_tokens`: the first tokens are also kept in the activation dtype and attention reads those copies.
    - `recent_tokens`: a ring of the latest tokens in the activation dtype, read instead of their quantized
      rows. The quantized store still holds every token, so its bytes follow mlx-lm's growth exactly; the
      sink and ring are fixed extra buffers allocated with the first update.

    Attention goes through `attention` (see `install_attention`): mlx-lm's own quantized SDPA takes one width.

    With `per_query_window` set, a multi-token update reads the recent window per query, as decoding reads it:
    each query its own latest `recent_tokens` tokens in float, older ones quantized (without it, the window
    at the update's end, as a prefill chunk reads it here and in the app). Perplexity sets it (quality/).
    """

    per_query_window = False

    def __init__(
        self,
        key_bits: int = 8,
        value_bits: int = 4,
        group_size: int = 64,
        *,
        rotation: str = "none",
        sink_tokens: int = 0,
        recent_tokens: int = 0,
    ) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.offset = 0
        self.key_bits, self.value_bits, self.group_size = key_bits, value_bits, group_size
        self.rotate_keys = rotation in ("hadamard", "hadamard_keys")
        self.rotate_values = rotation == "hadamard"
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.sink: tuple[mx.array, mx.array] | None = None
        self.recent: tuple[mx.array, mx.array] | None = None
        self._band: tuple[int, mx.array, mx.array] | None = None
        """(first position, keys, values) in float of the tokens the last update's queries read in float."""

    def _allocate_extras(self, keys: mx.array, values: mx.array) -> None:
        """The sink and recent buffers: fixed size, allocated with the first update."""
        B, n_kv_heads, _, k_dim = keys.shape
        if self.sink_tokens:
            self.sink = (
                mx.zeros((B, n_kv_heads, self.sink_tokens, k_dim), dtype=keys.dtype),
                mx.zeros((B, n_kv_heads, self.sink_tokens, values.shape[-1]), dtype=values.dtype),
            )
        if self.recent_tokens:
            self.recent = (
                mx.zeros((B, n_kv_heads, self.recent_tokens, k_dim), dtype=keys.dtype),
                mx.zeros((B, n_kv_heads, self.recent_tokens, values.shape[-1]), dtype=values.dtype),
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        if self.rotate_keys:
            keys = rotate(keys)
        if self.rotate_values:
            values = rotate(values)
        if self.keys is None:
            self._allocate_extras(keys, values)
        if self.per_query_window and self.recent_tokens:
            self._band = self._band_before(keys, values)
        prev = self._store(keys, values)
        assert self.keys is not None and self.values is not None
        # The rows written into the sink and the ring are copied out of the update first: written as slices of
        # it, each layer's whole chunk of keys and values stayed allocated until the forward pass ended (MLX's
        # peak over a 512-token SmolLM2 prefill rose by 30 layers' chunks, far past the copies' own bytes).
        if self.sink is not None and prev < self.sink_tokens:
            m = min(self.sink_tokens, self.offset) - prev
            self.sink[0][..., prev : prev + m, :] = mx.contiguous(keys[..., :m, :])
            self.sink[1][..., prev : prev + m, :] = mx.contiguous(values[..., :m, :])
        if self.recent is not None:
            w = self.recent_tokens
            first = max(prev, self.offset - w)  # only the last w of this update survive in the ring
            slots = mx.array([p % w for p in range(first, self.offset)])
            self.recent[0][..., slots, :] = mx.contiguous(keys[..., first - prev :, :])
            self.recent[1][..., slots, :] = mx.contiguous(values[..., first - prev :, :])
        return self.keys, self.values

    def _band_before(self, keys: mx.array, values: mx.array) -> tuple[int, mx.array, mx.array]:
        """The float tokens an update's queries may read: the ring's last `recent_tokens - 1` (read before
        this update overwrites them) and the update's own."""
        prev, w = self.offset, self.recent_tokens
        lo = max(0, prev - (w - 1))
        if self.recent is None or lo == prev:
            return prev, keys, values
        slots = mx.array([p % w for p in range(lo, prev)])
        old_k, old_v = (mx.take(x, slots, axis=-2) for x in self.recent)
        return lo, mx.concatenate([old_k, keys], axis=-2), mx.concatenate([old_v, values], axis=-2)

    def _attention_per_query(self, q: mx.array, mask: Any) -> mx.array:
        """Attention of L > 1 queries (scaled, rotated, [B, kv heads, reps, L, D]) as decoding reads the
        cache: a key is read in float when it is a sink token or among the query's own latest
        `recent_tokens`, dequantized otherwise."""
        assert self.keys is not None and self.values is not None and self._band is not None
        T, L = self.offset, q.shape[-2]
        lo, band_k, band_v = self._band
        sink_end = min(self.sink_tokens, T)
        kq, vq = self._dequantized(
            (tuple(x[..., :T, :] for x in self.keys), tuple(x[..., :T, :] for x in self.values))  # type: ignore[arg-type]
        )
        kf, vf = kq[..., :lo, :], vq[..., :lo, :]
        if sink_end and self.sink is not None:
            cut = min(sink_end, lo)
            kf = mx.concatenate([self.sink[0][..., :cut, :], kf[..., cut:, :]], axis=-2)
            vf = mx.concatenate([self.sink[1][..., :cut, :], vf[..., cut:, :]], axis=-2)
        kf = mx.concatenate([kf, band_k.astype(kq.dtype)], axis=-2)
        vf = mx.concatenate([vf, band_v.astype(vq.dtype)], axis=-2)
        pos, key = mx.arange(T - L, T)[:, None], mx.arange(T)[None]
        in_float = (key < sink_end) | ((key >= lo) & (key > pos - self.recent_tokens))
        kq, kf, vq, vf = (mx.expand_dims(x, -3) for x in (kq, kf, vq, vf))
        s = mx.where(in_float, q @ kf.swapaxes(-1, -2), q @ kq.swapaxes(-1, -2))
        s = self._masked(s, mask, T, L)
        p = mx.softmax(s, axis=-1, precise=True)
        return mx.where(in_float, p, 0) @ vf + mx.where(in_float, 0, p) @ vq

    @staticmethod
    def _masked(s: mx.array, mask: Any, T: int, L: int) -> mx.array:
        if mask is None:
            return s
        if isinstance(mask, str):
            mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        elif mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        return mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask

    def attention(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Softmax attention of `queries` over every cached token: sink and recent tokens from their float
        copies, the rest through quantized matmuls at the key and value widths."""
        assert self.keys is not None and self.values is not None
        B, n_q_heads, L, D = queries.shape
        n_kv_heads = self.keys[0].shape[-3]
        reps = n_q_heads // n_kv_heads
        T = self.offset
        sink_end = min(self.sink_tokens, T)
        recent_start = max(sink_end, T - self.recent_tokens) if self.recent_tokens else T
        q = queries * scale
        if self.rotate_keys:
            q = rotate(q)
        q = q.reshape(B, n_kv_heads, reps, L, D)
        if L > 1 and self._band is not None:
            read = self._attention_per_query(q, mask)
            return (rotate(read) if self.rotate_values else read).reshape(B, n_q_heads, L, -1)

        def part(x: mx.array, lo: int, hi: int) -> mx.array:
            return mx.expand_dims(x[..., lo:hi, :], -3)

        segments: list[tuple[str, Any]] = []
        if sink_end:
            assert self.sink is not None
            segments.append(("float", (part(self.sink[0], 0, sink_end), part(self.sink[1], 0, sink_end))))
        if recent_start > sink_end:
            k = tuple(part(x, sink_end, recent_start) for x in self.keys)
            v = tuple(part(x, sink_end, recent_start) for x in self.values)
            segments.append(("quantized", (k, v)))
        if recent_start < T:
            assert self.recent is not None
            slots = mx.array([p % self.recent_tokens for p in range(recent_start, T)])
            rk, rv = (mx.expand_dims(mx.take(x, slots, axis=-2), -3) for x in self.recent)
            segments.append(("float", (rk, rv)))

        # Many query rows (prefill): MLX's CPU quantized matmul is a plain loop, so dequantize the segment and
        # let BLAS multiply (one layer's float copy, transient); decode keeps the quantized matmul.
        if reps * L >= DEQUANTIZED_ROWS:
            floats = [kv if kind == "float" else self._dequantized(kv) for kind, kv in segments]
            # One key and one value array, as the app hands MLX's attention its float rows among the dequantized
            # ones: the scores are made once, not per segment and then again concatenated (a second score-sized
            # array the app never holds, which ended a virtual iPhone's soak a step before its plan).
            if len(floats) > 1:
                keys = mx.concatenate([k for k, _ in floats], axis=-2)
                floats = [(keys, mx.concatenate([v for _, v in floats], axis=-2))]
            segments = [("float", floats[0])]
        scores = []
        for kind, (k, _) in segments:
            if kind == "float":
                scores.append(q @ k.swapaxes(-1, -2))
            else:
                scores.append(
                    mx.quantized_matmul(
                        q, k[0], k[1], k[2], transpose=True, group_size=self.group_size, bits=self.key_bits
                    )
                )
        s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
        s = self._masked(s, mask, T, L)
        p = mx.softmax(s, axis=-1, precise=True)
        out: mx.array | None = None
        start = 0
        for (kind, (_k, v)), sc in zip(segments, scores, strict=True):
            width = sc.shape[-1]
            pi = p[..., start : start + width]
            start += width
            if kind == "float":
                o = pi @ v
            else:
                o = mx.quantized_matmul(
                    pi, v[0], v[1], v[2], transpose=False, group_size=self.group_size, bits=self.value_bits
                )
            out = o if out is None else out + o
        assert out is not None
        if self.rotate_values:
            out = rotate(out)
        return out.reshape(B, n_q_heads, L, -1)

    def _dequantized(self, kv: tuple[Quantized, Quantized]) -> tuple[mx.array, mx.array]:
        (k, v), g = kv, self.group_size
        return (
            mx.dequantize(k[0], k[1], k[2], group_size=g, bits=self.key_bits),
            mx.dequantize(v[0], v[1], v[2], group_size=g, bits=self.value_bits),
        )

    def keys_and_values(self) -> tuple[Quantized | None, Quantized | None]:
        """For KV-shared layers: they pass this cache on to attention, which reads it through `attention`."""
        return self.keys, self.values

    @classmethod
    def from_kv_cache(cls, cache: KVCache, target: SchemeKVCache) -> SchemeKVCache:
        """`target` (empty) filled with a float cache's tokens, as if they had entered one by one."""
        if cache.keys is not None and cache.values is not None and cache.offset:
            target.update_and_fetch(cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
        return target

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.sink, self.recent

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.sink, self.recent = v

    @property
    def nbytes(self) -> int:
        arrays = [*(self.keys or ()), *(self.values or ()), *(self.sink or ()), *(self.recent or ())]
        return sum(x.nbytes for x in arrays)


def install_attention(model: Any) -> None:
    """Routes the model's attention through `SchemeKVCache.attention` when a layer holds one (any other cache
    still goes to mlx-lm's function; kvrig/compat/mlx_lm_attention.py)."""
    if not route_attention(model, _is_scheme_cache, _scheme_attention):
        raise KVSchemeError(
            f"{type(model).__module__}: its attention does not go through mlx-lm's scaled_dot_product_attention, "
            "so kvrig's KV schemes (mixed bits, rotation, sinks, recent window) cannot be applied"
        )


def _is_scheme_cache(cache: Any) -> bool:
    return isinstance(cache, SchemeKVCache)


def _scheme_attention(cache: SchemeKVCache, queries: mx.array, scale: float, mask: Any, kw: dict[str, Any]) -> Any:
    if kw.get("sinks") is not None:
        raise ValueError("kvrig's scheme cache cannot take attention sinks")
    return cache.attention(queries, scale, mask)
