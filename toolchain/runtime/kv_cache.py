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
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

Quantized = tuple[mx.array, mx.array, mx.array]


class DequantizingKVCache(_BaseCache):
    step = 256

    def __init__(self, key_bits: int = 8, value_bits: int = 4, group_size: int = 64) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.offset = 0
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.group_size = group_size
        self._dtype: mx.Dtype = mx.float16

    def _empty(self, shape: tuple[int, ...], dim: int, bits: int, dtype: mx.Dtype) -> Quantized:
        return (
            mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // self.group_size), dtype=dtype),
            mx.zeros((*shape, dim // self.group_size), dtype=dtype),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, n_kv_heads, n, k_dim = keys.shape
        v_dim = values.shape[-1]
        prev = self.offset
        if self.keys is None or prev + n > self.keys[0].shape[-2]:
            # Same growth rule as mlx-lm's caches: whole 256-token steps, trimming a ragged tail first.
            shape = (B, n_kv_heads, (self.step + n - 1) // self.step * self.step)
            new_k = self._empty(shape, k_dim, self.key_bits, keys.dtype)
            new_v = self._empty(shape, v_dim, self.value_bits, values.dtype)
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

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)  # type: ignore[misc]

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
