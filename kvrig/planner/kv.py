"""KV-cache bytes: update schedules, and what MLX allocates for a KV spec (`kv_bytes`).

The bytes come from mlx-lm's own caches driven lazily (models/probe.py), so step growth, ragged trims and
rotating windows are MLX's, not a copy of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import KVSchemeError, PlanInputError, QuantizationError
from kvrig.models.layers import DTYPE_BYTES, LayerSpec
from kvrig.models.probe import Slot
from kvrig.models.spec import ModelSpec
from kvrig.recipes import GROUP_SIZES, KVSpec

MLX_STEP = 256
"""mlx-lm's KVCache.step, the tokens a growing cache adds at a time; held here so planning imports no MLX until it
builds a model (tests/plan/test_plan.py holds it to mlx-lm's)."""
ALL_NAMED_SCHEMES = ("fp16", "bf16", "k8v8", "k8v4", "k4v8", "k4v4")


def dequantizes_on_read(kv: KVSpec, spec: ModelSpec) -> bool:
    """Whether attention reads a dequantized copy (kvrig's cache) rather than the quantized cache: K and V at
    different widths (mlx-lm's cache takes one), or a model whose attention cannot read quantized KV."""
    return kv.quantized and (kv.mixed or not spec.quantized_attention)


def check_dims(spec: ModelSpec, scheme: KVSpec) -> None:
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
                smaller = [g for g in GROUP_SIZES if dim % g == 0 and g < scheme.group_size]
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


def promoted_for_bytes(spec: ModelSpec, scheme: KVSpec) -> KVSpec:
    """`+kN@topM` counted before any measurement picks its layers (kvrig package measures them on the model):
    keys at N bits in the M quantized layers whose keys take the most bytes per token (the fewest when N is
    below the spec's key width), so the count never undercounts; exact where those layers' keys are alike."""
    if scheme.promote_keys is None:
        return scheme
    bits, count = scheme.promote_keys
    layers = [layer for layer in spec.layers if layer_quantized(layer, scheme)]
    if count > len(layers):
        raise KVSchemeError(
            f"KV spec '{scheme.name}': +k{bits}@top{count} promotes more layers than the {len(layers)} with a "
            f"quantized cache (expected M <= {len(layers)})"
        )
    ranked = sorted(layers, key=lambda layer: layer.kv_heads * layer.k_head_dim, reverse=bits > (scheme.key_bits or 0))
    return scheme.with_layer_key_bits(dict(scheme.layer_key_bits) | {layer.index: bits for layer in ranked[:count]})


def promotion_is_exact(spec: ModelSpec, scheme: KVSpec) -> bool:
    """Whether `promoted_for_bytes` counts exactly whichever layers the measurement picks: every quantized
    layer's keys take the same bytes per token."""
    return len({layer.kv_heads * layer.k_head_dim for layer in spec.layers if layer_quantized(layer, scheme)}) <= 1


def layer_quantized(layer: LayerSpec, scheme: KVSpec) -> bool:
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


def cache_factory(spec: ModelSpec, scheme: KVSpec) -> Callable[[Slot], Any] | None:
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


def _make_factory(spec: ModelSpec, scheme: KVSpec) -> Callable[[Slot], Any]:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from kvrig.kvcache.kv_cache import DequantizingKVCache  # subclasses mlx-lm's caches: loads MLX

    assert scheme.key_bits is not None and scheme.value_bits is not None
    kb, vb, gs = scheme.key_bits, scheme.value_bits, scheme.group_size
    dequantizing = dequantizes_on_read(scheme, spec)
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


def kv_bytes(spec: ModelSpec, scheme: KVSpec, schedule: Sequence[int], kinds: tuple[str, ...] | None = None) -> int:
    """Bytes MLX holds in the model's caches after feeding `schedule` (tokens per update, in order): soak
    steps, chat turns, prefill chunks. A growing cache that overflows grows to offset + ceil(n/256)*256 (a
    ragged tail trimmed first); rotating and recurrent caches keep their own sizes. Driven through mlx-lm's
    own caches with unevaluated arrays: exact, nothing allocated. Other helpers call this, never copy it.
    `kinds` limits the sum to caches of those kinds (full, sliding, linear)."""
    if kinds is None:
        return kv_bytes_detail(spec, scheme, schedule).total
    probe = spec.probe(scheme.dtype)
    make = cache_factory(spec, scheme)
    sched = tuple(schedule)
    extras = extra_bytes(spec, scheme) if sched and "full" in kinds else 0
    return extras + sum(n * probe.slot_bytes(slot, sched, make) for slot, n in probe.groups(make) if slot.kind in kinds)


def extra_bytes(spec: ModelSpec, scheme: KVSpec) -> int:
    """The sink and recent-window copies kvrig's cache keeps in the activation dtype on every quantized full
    layer (`+sN`, `+wN`): fixed once the first token is in. The quantized store itself is mlx-lm's (above)."""
    n = scheme.sink_tokens + scheme.recent_tokens
    if not n or not scheme.quantized:
        return 0
    width = DTYPE_BYTES[scheme.dtype]
    return sum(
        n * layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * width
        for layer in spec.layers
        if layer.kind == "full"
    )


@dataclass(frozen=True)
class KVBytes:
    total: int
    peak: int
    """the most the caches held together after any update of the schedule (a rotating cache briefly holds
    window-1+n tokens, so a model with sliding layers can peak before the end)."""
    largest_cache: int
    """bytes of the largest single cache at the end (one layer's buffer: what a growth copy duplicates)."""
    largest_array: int
    """the largest single array (one Metal buffer: a layer's keys or values) at the end."""


def kv_bytes_detail(spec: ModelSpec, scheme: KVSpec, schedule: Sequence[int]) -> KVBytes:
    probe = spec.probe(scheme.dtype)
    make = cache_factory(spec, scheme)
    sched = tuple(int(n) for n in schedule)
    if any(n < 1 for n in sched):
        raise PlanInputError(f"update sizes must be positive token counts, got {min(sched)}", field="schedule")
    groups = probe.groups(make)
    finals = [(probe.slot_bytes(slot, sched, make), n) for slot, n in groups]
    series = [(probe.slot_series(slot, sched, make), n) for slot, n in groups]
    if all(max(b, default=0) == b[-1] for b, _ in series if b):  # every cache is largest at the end
        together = [sum(b * n for b, n in finals)]
    else:
        together = [sum(b[i] * n for b, n in series) for i in range(len(sched))]
    largest = max((probe.slot_largest_array(slot, sched, make) for slot, _ in groups), default=0)
    extras = extra_bytes(spec, scheme) if sched else 0
    total, peak = sum(b * n for b, n in finals) + extras, max(together, default=0) + extras
    return KVBytes(total, peak, max((b for b, _ in finals), default=0), largest)


def bytes_per_token(spec: ModelSpec, scheme: KVSpec) -> int:
    """Steady-state bytes per additional context token: the growth MLX shows over one 256-token step."""
    probe = spec.probe(scheme.dtype)
    make = cache_factory(spec, scheme)
    step = MLX_STEP
    total = 0
    for slot, n in probe.groups(make):
        if slot.kind == "full":
            total += n * (probe.slot_bytes(slot, (step, step), make) - probe.slot_bytes(slot, (step,), make))
    return total // step


def row_bytes(spec: ModelSpec, scheme: KVSpec, layer: LayerSpec) -> int:
    """Bytes per cached token of one layer's cache under `scheme` (measured over one 256-token step)."""
    key = ("row", scheme, layer.index)
    memo = _memo(spec)
    if key not in memo:
        memo[key] = _row_bytes(spec, scheme, layer)
    return memo[key]  # type: ignore[no-any-return]


def _row_bytes(spec: ModelSpec, scheme: KVSpec, layer: LayerSpec) -> int:
    probe = spec.probe(scheme.dtype)
    make = cache_factory(spec, scheme)
    slot = probe.slot_of_layer(layer.index)
    if slot is None:
        return 0
    return probe.slot_bytes(slot, (MLX_STEP,), make) // MLX_STEP


def dequantized_read_bytes(spec: ModelSpec, scheme: KVSpec, context: int, backend: str = "metal") -> int:
    """Transient bytes of kvrig's dequantizing cache: one layer's K and V dequantized for attention."""
    if not dequantizes_on_read(scheme, spec):
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
