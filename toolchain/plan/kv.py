"""KV-cache bytes: schemes, per-token cost per layer, and the allocation MLX really makes as a cache grows.

MLX caches grow in 256-token steps and copy on growth; a sliding (rotating) cache can hold window-1+S
tokens while a chunk of S tokens is prefilled. `CacheGrowth` replays mlx-lm's growth rules for a schedule
of update sizes so planned bytes equal MLX's `nbytes` at every offset, step boundaries included.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from toolchain.exceptions import QuantizationError
from toolchain.models.spec import DTYPE_BYTES, LayerSpec, ModelSpec

MLX_STEP = 256
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUPS = (32, 64, 128)
DEFAULT_SCHEMES = ("fp16", "k8v8", "k8v4", "k4v8", "k4v4")
ALL_NAMED_SCHEMES = ("fp16", "bf16", "k8v8", "k8v4", "k4v8", "k4v4")

_SCHEME_RE = re.compile(r"^k(\d+)v(\d+)(?:g(\d+))?$")


@dataclass(frozen=True)
class KVScheme:
    """How K and V are stored: unquantized in `dtype` (bits None) or affine-quantized, with one scale and
    one bias per group in the activation dtype."""

    name: str
    key_bits: int | None
    value_bits: int | None
    group_size: int = 64
    dtype: str = "float16"

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    @property
    def mixed(self) -> bool:
        """K and V at different bits: needs kvrig's own cache (mlx-lm's takes one bit width)."""
        return self.quantized and self.key_bits != self.value_bits

    def dequantizes_on_read(self, spec: ModelSpec) -> bool:
        """Whether attention reads a dequantized copy (kvrig's cache) rather than the quantized cache."""
        return self.quantized and (self.mixed or not spec.quantized_attention)


def parse_scheme(text: str, *, group_size: int = 64, dtype: str = "float16") -> KVScheme:
    """`fp16`, `bf16`, `fp32`, `k8v4` or `k8v4g32` (group size in the name overrides `group_size`)."""
    name = text.strip().lower()
    plain = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
    if name in plain:
        return KVScheme(name, None, None, group_size, plain[name])
    m = _SCHEME_RE.match(name)
    if not m:
        raise QuantizationError(
            f"unknown KV scheme '{text}': expected fp16, bf16, fp32 or kXvY[gZ] (e.g. k8v4, k6v4g32)"
        )
    kb, vb = int(m.group(1)), int(m.group(2))
    gs = int(m.group(3)) if m.group(3) else group_size
    for label, bits in (("key", kb), ("value", vb)):
        if bits not in SUPPORTED_BITS:
            raise QuantizationError(f"KV scheme '{text}': {label} bits {bits} not in {SUPPORTED_BITS}")
    if gs not in SUPPORTED_GROUPS:
        raise QuantizationError(f"KV scheme '{text}': group size {gs} not in {SUPPORTED_GROUPS}")
    canonical = f"k{kb}v{vb}" + (f"g{gs}" if gs != group_size else "")
    return KVScheme(canonical, kb, vb, gs, dtype)


def quantized_row_bytes(dim: int, bits: int, group_size: int, dtype: str) -> int:
    """Bytes of one row of `dim` values after mx.quantize: packed uint32 data + scales + biases."""
    return dim * bits // 8 + 2 * (dim // group_size) * DTYPE_BYTES[dtype]


def check_dims(spec: ModelSpec, scheme: KVScheme) -> None:
    """Quantized KV needs every cached head dim divisible by the group size (and packable into uint32)."""
    if not scheme.quantized:
        return
    for layer in spec.layers:
        if not layer_quantized(layer, scheme):
            continue
        dims = (("key", layer.k_head_dim, scheme.key_bits), ("value", layer.v_head_dim, scheme.value_bits))
        for what, dim, bits in dims:
            assert bits is not None
            if dim % scheme.group_size or (dim * bits) % 32:
                smaller = [g for g in SUPPORTED_GROUPS if dim % g == 0 and g < scheme.group_size]
                hint = f"use group size {max(smaller)}" if smaller else "use an unquantized scheme (fp16)"
                raise QuantizationError(
                    f"layer {layer.index}: {what} head dim {dim} is not divisible by KV group size "
                    f"{scheme.group_size} (scheme {scheme.name}); {hint}"
                )


def layer_row_bytes(layer: LayerSpec, scheme: KVScheme) -> tuple[int, int]:
    """Bytes per cached token of (keys, values) for one layer as MLX stores them under `scheme`.

    mlx-lm cannot quantize a rotating (sliding) cache, and its MLA cache is used unquantized, so those
    layers stay in the activation dtype whatever the scheme says.
    """
    width = DTYPE_BYTES[scheme.dtype]
    h = layer.kv_heads
    if scheme.quantized and layer.kind == "full":
        assert scheme.key_bits is not None and scheme.value_bits is not None
        return (
            h * quantized_row_bytes(layer.k_head_dim, scheme.key_bits, scheme.group_size, scheme.dtype),
            h * quantized_row_bytes(layer.v_head_dim, scheme.value_bits, scheme.group_size, scheme.dtype),
        )
    return h * layer.k_head_dim * width, h * layer.v_head_dim * width


def layer_quantized(layer: LayerSpec, scheme: KVScheme) -> bool:
    return scheme.quantized and layer.kind == "full"


def state_bytes(layer: LayerSpec, dtype: str) -> int:
    total = 0
    for shape, state_dtype in layer.state:
        n = 1
        for d in shape:
            n *= d
        total += n * DTYPE_BYTES[state_dtype or dtype]
    return total


def bytes_per_token(spec: ModelSpec, scheme: KVScheme) -> int:
    """Steady-state bytes per additional context token (growing layers only, no step rounding)."""
    return sum(sum(layer_row_bytes(layer, scheme)) for layer in spec.layers if layer.grows)


# --- allocation as MLX grows caches ---------------------------------------------------------------------


def prefill_schedule(prompt_tokens: int, prefill_step: int) -> list[int]:
    """Update sizes mlx-lm's generate_step feeds a cache for a prompt: chunks of `prefill_step` that leave
    the last token, then that token alone."""
    if prompt_tokens <= 0:
        return []
    chunks: list[int] = []
    remaining = prompt_tokens
    while remaining > 1:
        n = min(prefill_step, remaining - 1)
        chunks.append(n)
        remaining -= n
    chunks.append(remaining)
    return chunks


def context_schedule(context: int, prefill_step: int, prompt_tokens: int | None = None) -> list[int]:
    """A prompt of `prompt_tokens` (default: the whole context) then single-token decode up to `context`."""
    prompt = context if prompt_tokens is None else min(prompt_tokens, context)
    return prefill_schedule(prompt, prefill_step) + [1] * (context - prompt)


class CacheGrowth:
    """Tracks the tokens a cache has allocated (its capacity), replaying mlx-lm's growth rules."""

    def __init__(self, layer: LayerSpec, step: int = MLX_STEP) -> None:
        self.layer = layer
        self.step = step
        self.offset = 0
        self.capacity = 0
        self._idx = 0  # RotatingKVCache write index
        self.peak_capacity = 0

    def update(self, n: int) -> None:
        kind = self.layer.kind
        if kind in ("full", "latent"):
            self._grow_linear(n)
        elif kind == "sliding":
            assert self.layer.window is not None
            if n == 1:
                self._rotate_in_place(self.layer.window)
            else:
                self._rotate_concat(n, self.layer.window)
        self.offset += n
        self.peak_capacity = max(self.peak_capacity, self.capacity)

    def _grow_linear(self, n: int) -> None:
        # KVCache / QuantizedKVCache.update_and_fetch
        if self.capacity == 0 or self.offset + n > self.capacity:
            new = (self.step + n - 1) // self.step * self.step
            if self.capacity and self.offset % self.step:
                self.capacity = self.offset
            self.capacity += new

    def _rotate_concat(self, n: int, window: int) -> None:
        # RotatingKVCache._update_concat (keep=0): temporal order, trim to window-1, append n.
        if self.capacity == 0:
            self.capacity = n
        else:
            size = self.capacity
            if not (self._idx == size or self._idx < self.offset):
                size = self._idx
            self.capacity = (window - 1 if size >= window else size) + n
        self._idx = self.capacity

    def _rotate_in_place(self, window: int) -> None:
        # RotatingKVCache._update_in_place (keep=0)
        prev = self.offset
        if self.capacity == 0 or (prev >= self.capacity and self.capacity < window):
            self.capacity += min(self.step, window - prev)
            self._idx = prev
        if self.capacity > window:
            self.capacity = window
            self._idx = window
        if self._idx == window:
            self._idx = 0
        self._idx += 1


@functools.lru_cache(maxsize=4096)
def _capacity(kind: str, window: int | None, schedule: tuple[int, ...]) -> tuple[int, int]:
    # Every layer of one kind (and window) grows the same way, so replay the schedule once per kind.
    growth = CacheGrowth(LayerSpec(0, kind, window=window))  # type: ignore[arg-type]
    for n in schedule:
        growth.update(n)
    return growth.capacity, growth.peak_capacity


def layer_allocated_bytes(layer: LayerSpec, scheme: KVScheme, schedule: list[int]) -> tuple[int, int]:
    """(bytes allocated after the schedule, peak bytes during it) for one layer's cache."""
    if layer.kind == "shared" or not schedule:
        return 0, 0
    if layer.kind == "linear":
        b = state_bytes(layer, scheme.dtype)
        return b, b
    kind = "full" if layer.kind == "latent" else layer.kind
    capacity, peak = _capacity(kind, layer.window, tuple(schedule))
    row = sum(layer_row_bytes(layer, scheme))
    return capacity * row, peak * row


def allocated_bytes(spec: ModelSpec, scheme: KVScheme, schedule: list[int]) -> int:
    """Total cache bytes allocated after feeding `schedule` (what MLX's nbytes sums to)."""
    return sum(layer_allocated_bytes(layer, scheme, schedule)[0] for layer in spec.layers)


def dequantized_read_bytes(spec: ModelSpec, scheme: KVScheme, context: int) -> int:
    """Transient bytes of kvrig's dequantizing cache: one layer's K and V dequantized for attention."""
    if not scheme.dequantizes_on_read(spec):
        return 0
    width = DTYPE_BYTES[scheme.dtype]
    return max(
        (
            layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * context * width
            for layer in spec.layers
            if layer_quantized(layer, scheme)
        ),
        default=0,
    )
