"""KV-cache bytes: schemes, update schedules, and what MLX allocates for them (`kv_bytes`).

The bytes come from mlx-lm's own caches driven lazily (plan/caches.py), so step growth, ragged trims and
rotating windows are MLX's, not a copy of them.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import PlanInputError, QuantizationError
from kvrig.models.layers import DTYPE_BYTES, LayerSpec
from kvrig.models.probe import Slot
from kvrig.models.spec import ModelSpec

MLX_STEP = 256
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUPS = (32, 64, 128)
DEFAULT_SCHEMES = ("fp16", "k8v8", "k8v4", "k4v8", "k4v4")
ALL_NAMED_SCHEMES = ("fp16", "bf16", "k8v8", "k8v4", "k4v8", "k4v4")

_SCHEME_RE = re.compile(r"^k(\d+)v(\d+)(?:g(\d+))?$")
_LAYER_KEYS_RE = re.compile(r"^k(\d+)@(\d+(?:\.\d+)*)$")


@dataclass(frozen=True)
class KVScheme:
    """How K and V are stored: unquantized in `dtype` (bits None) or affine-quantized, with one scale and
    one bias per group in the activation dtype."""

    name: str
    key_bits: int | None
    value_bits: int | None
    group_size: int = 64
    dtype: str = "float16"
    layer_key_bits: tuple[tuple[int, int], ...] = ()
    """(layer index, key bits) for layers whose keys differ from `key_bits` (`k4v4+k8@1.3`): the layers whose
    keys suffer most at the base width keep more bits; kvcache.json carries them as per-layer `key_bits`."""

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    @property
    def mixed(self) -> bool:
        """K and V at different bits in some layer: needs kvrig's own cache (mlx-lm's takes one bit width)."""
        return self.quantized and any(
            k != self.value_bits for k in (self.key_bits, *dict(self.layer_key_bits).values())
        )

    def key_bits_for(self, layer: int) -> int | None:
        return dict(self.layer_key_bits).get(layer, self.key_bits)

    def dequantizes_on_read(self, spec: ModelSpec) -> bool:
        """Whether attention reads a dequantized copy (kvrig's cache) rather than the quantized cache."""
        return self.quantized and (self.mixed or not spec.quantized_attention)


def parse_scheme(text: str, *, group_size: int = 64, dtype: str = "float16") -> KVScheme:
    """`fp16`, `bf16`, `fp32`, `k8v4` or `k8v4g32` (group size in the name overrides `group_size`), optionally
    with keys of some layers at other widths: `k4v4+k8@1.3` (layers 1 and 3 keep 8-bit keys)."""
    base, *overrides = text.strip().lower().split("+")
    scheme = _parse_base_scheme(base, text, group_size=group_size, dtype=dtype)
    by_layer: dict[int, int] = {}
    for part in overrides:
        m = _LAYER_KEYS_RE.match(part)
        if not m or not scheme.quantized:
            raise QuantizationError(
                f"KV scheme '{text}': '+{part}' is not a layer override; expected kXvY+kN@L1.L2 (e.g. k4v4+k8@1.3)"
            )
        bits = int(m.group(1))
        if bits not in SUPPORTED_BITS:
            raise QuantizationError(f"KV scheme '{text}': key bits {bits} not in {SUPPORTED_BITS}")
        by_layer |= dict.fromkeys((int(i) for i in m.group(2).split(".")), bits)
    return with_layer_key_bits(scheme, by_layer)


def with_layer_key_bits(scheme: KVScheme, by_layer: dict[int, int]) -> KVScheme:
    """`scheme` with keys of the given layers at their own widths (the name spells them out, `+k8@1.3`)."""
    from dataclasses import replace

    pairs = tuple(sorted((i, b) for i, b in by_layer.items() if b != scheme.key_bits))
    if not pairs:
        return scheme
    groups: dict[int, list[int]] = {}
    for i, b in pairs:
        groups.setdefault(b, []).append(i)
    base = scheme.name.split("+")[0]
    name = base + "".join(f"+k{b}@{'.'.join(map(str, layers))}" for b, layers in sorted(groups.items()))
    return replace(scheme, name=name, layer_key_bits=pairs)


def _parse_base_scheme(name: str, text: str, *, group_size: int, dtype: str) -> KVScheme:
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


def check_dims(spec: ModelSpec, scheme: KVScheme) -> None:
    """Quantized KV needs every quantized cache's head dims divisible by the group size (and packable into
    uint32); the dims are those the model's own step handed its caches."""
    if not scheme.quantized:
        return
    known = {layer.index for layer in spec.layers if layer_quantized(layer, scheme)}
    for index, _ in scheme.layer_key_bits:
        if index not in known:
            raise QuantizationError(
                f"KV scheme {scheme.name}: layer {index} has no quantized KV cache "
                f"(quantized full-attention layers: {_ranges(sorted(known))})"
            )
    for layer in spec.layers:
        if not layer_quantized(layer, scheme):
            continue
        key_bits = scheme.key_bits_for(layer.index)
        dims = (("key", layer.k_head_dim, key_bits), ("value", layer.v_head_dim, scheme.value_bits))
        for what, dim, bits in dims:
            assert bits is not None
            if dim % scheme.group_size or (dim * bits) % 32:
                smaller = [g for g in SUPPORTED_GROUPS if dim % g == 0 and g < scheme.group_size]
                hint = f"use group size {max(smaller)}" if smaller else "use an unquantized scheme (fp16)"
                raise QuantizationError(
                    f"layer {layer.index}: {what} head dim {dim} is not divisible by KV group size "
                    f"{scheme.group_size} (scheme {scheme.name}); {hint}"
                )


def _ranges(indices: list[int]) -> str:
    return (
        f"{indices[0]}-{indices[-1]}"
        if indices and indices == list(range(indices[0], indices[-1] + 1))
        else (", ".join(map(str, indices)) or "none")
    )


def layer_quantized(layer: LayerSpec, scheme: KVScheme) -> bool:
    """Only plain growing caches are quantized (mlx-lm cannot quantize rotating caches or recurrent state)."""
    return scheme.quantized and layer.kind == "full" and layer.quantizable


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


_MEMOS: dict[int, dict[Any, Any]] = {}


def _memo(spec: ModelSpec) -> dict[Any, Any]:
    """The planner's memo for one model spec (cache factories, row bytes), dropped with the spec."""
    key = id(spec)
    if key not in _MEMOS:
        _MEMOS[key] = {}
        weakref.finalize(spec, _MEMOS.pop, key, None)
    return _MEMOS[key]


def _factory(spec: ModelSpec, scheme: KVScheme) -> Callable[[Slot], Any] | None:
    """The caches kvrig makes for a scheme: the model's own, with its plain KVCaches quantized (mlx-lm's
    QuantizedKVCache, or kvrig's dequantize-on-read cache for mixed bits or attention that cannot read
    quantized KV). None: the model's own caches unchanged. Made once per spec and scheme."""
    if not scheme.quantized:
        return None
    key = ("factory", scheme)
    memo = _memo(spec)
    if key not in memo:
        memo[key] = _make_factory(spec, scheme)
    return memo[key]  # type: ignore[no-any-return]


def _make_factory(spec: ModelSpec, scheme: KVScheme) -> Callable[[Slot], Any]:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from kvrig.kvcache.kv_cache import DequantizingKVCache  # subclasses mlx-lm's caches: loads MLX

    assert scheme.key_bits is not None and scheme.value_bits is not None
    kb, vb, gs = scheme.key_bits, scheme.value_bits, scheme.group_size
    dequantizing = scheme.dequantizes_on_read(spec)
    # Layers with a cache pair with make_prompt_cache's entries in order (the runtime's own rule).
    owners = [layer for layer in spec.layers if layer.kind != "shared"]
    chosen = {i for i, layer in enumerate(owners) if layer_quantized(layer, scheme)}

    def picks(slot: Slot) -> bool:
        return slot.cls is KVCache and len(slot.path) == 1 and slot.index in chosen

    def make(slot: Slot) -> Any:
        if not picks(slot):
            return None
        bits = scheme.key_bits_for(owners[slot.index].index) or kb
        return DequantizingKVCache(bits, vb, gs) if dequantizing else QuantizedKVCache(group_size=gs, bits=bits)

    make.key = lambda slot: (  # type: ignore[attr-defined]
        scheme.key_bits_for(owners[slot.index].index),
        vb,
        gs,
        scheme.dtype,
        dequantizing,
    )
    make.picks = picks  # type: ignore[attr-defined]
    return make


def kv_bytes(spec: ModelSpec, scheme: KVScheme, schedule: Sequence[int], kinds: tuple[str, ...] | None = None) -> int:
    """Bytes MLX holds in the model's caches after feeding `schedule` (tokens per update, in order): soak
    steps, chat turns, prefill chunks. A growing cache that overflows grows to offset + ceil(n/256)*256 (a
    ragged tail trimmed first); rotating and recurrent caches keep their own sizes. Driven through mlx-lm's
    own caches with unevaluated arrays: exact, nothing allocated. Other helpers call this, never copy it.
    `kinds` limits the sum to caches of those kinds (full, sliding, linear)."""
    if kinds is None:
        return kv_bytes_detail(spec, scheme, schedule).total
    probe = spec.probe(scheme.dtype)
    make = _factory(spec, scheme)
    sched = tuple(schedule)
    return sum(n * probe.slot_bytes(slot, sched, make) for slot, n in probe.groups(make) if slot.kind in kinds)


@dataclass(frozen=True)
class KVBytes:
    total: int
    peak: int
    """largest total at any point of the schedule (a rotating cache briefly holds window-1+n tokens)."""
    largest_cache: int
    """bytes of the largest single cache at the end (one layer's buffer: what a growth copy duplicates)."""
    largest_array: int
    """the largest single array (one Metal buffer: a layer's keys or values) at the end."""


def kv_bytes_detail(spec: ModelSpec, scheme: KVScheme, schedule: Sequence[int]) -> KVBytes:
    probe = spec.probe(scheme.dtype)
    make = _factory(spec, scheme)
    sched = tuple(int(n) for n in schedule)
    if any(n < 1 for n in sched):
        raise PlanInputError(f"update sizes must be positive token counts, got {min(sched)}", field="schedule")
    groups = probe.groups(make)
    finals = [(probe.slot_bytes(slot, sched, make), n) for slot, n in groups]
    peaks = [probe.slot_peak(slot, sched, make) * n for slot, n in groups]
    largest = max((probe.slot_largest_array(slot, sched, make) for slot, _ in groups), default=0)
    return KVBytes(sum(b * n for b, n in finals), sum(peaks), max((b for b, _ in finals), default=0), largest)


def bytes_per_token(spec: ModelSpec, scheme: KVScheme) -> int:
    """Steady-state bytes per additional context token: the growth MLX shows over one 256-token step."""
    probe = spec.probe(scheme.dtype)
    make = _factory(spec, scheme)
    step = MLX_STEP
    total = 0
    for slot, n in probe.groups(make):
        if slot.kind == "full":
            total += n * (probe.slot_bytes(slot, (step, step), make) - probe.slot_bytes(slot, (step,), make))
    return total // step


def row_bytes(spec: ModelSpec, scheme: KVScheme, layer: LayerSpec) -> int:
    """Bytes per cached token of one layer's cache under `scheme` (measured over one 256-token step)."""
    key = ("row", scheme, layer.index)
    memo = _memo(spec)
    if key not in memo:
        memo[key] = _row_bytes(spec, scheme, layer)
    return memo[key]  # type: ignore[no-any-return]


def _row_bytes(spec: ModelSpec, scheme: KVScheme, layer: LayerSpec) -> int:
    probe = spec.probe(scheme.dtype)
    make = _factory(spec, scheme)
    slot = probe.slot_of_layer(layer.index)
    if slot is None:
        return 0
    return probe.slot_bytes(slot, (MLX_STEP,), make) // MLX_STEP


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
