"""Memory of the LLM app runtime in the phone's format, KV eviction, and the memory-pressure decision.

The host runtime computes in float32 on the CPU (activations, KV scales and biases, norm weights) where the
phone keeps float16. The emulator must account the phone's footprint, so every number is measured on the
host's real arrays and re-counted at the phone's element size for the same shapes:

- weights: the bundle's safetensors as stored (what MLX on the phone loads), vs the host's parameters;
- KV: each cache buffer's shape at the phone's activation dtype when the host holds it in float32;
- everything else MLX holds at the measurement (logits, hidden states) is float32 activations: half on the phone.

Residency is the phone's too: when the bundle is laid out for mapping (and the soak plan does not ask for
loaded), the phone's app maps the weights from the file and iOS leaves those clean pages out of the footprint.
The host cannot (MLX's CPU allocator has no no-copy path: it copies whatever buffer it is handed), so the host
loads as always and reports the phone's residency: `mapped_weight_bytes` in every measurement, which the kernel
(kvrig.virtual.footprint) leaves out of what it charges, and in the start event, listed as converted.

Eviction and the pressure decision mirror the generated app (CacheSet.evictFront, KvrigCore.PressureDecider).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvrig.bundle.mapped import PAGE_BYTES, extents, misaligned
from kvrig.exceptions import BundleError
from kvrig.kvcache.kv_cache import DequantizingKVCache, SchemeKVCache
from kvrig.models.layers import DTYPE_BYTES
from kvrig.schemas.kvcache import KVCacheConfig, WeightsResidency

HOST_ACTIVATION_BYTES = 4  # kvrig.runtime.host computes in float32
# What the accounting converts (StartEvent.converted): numbers that are the phone's format, not the host's.
CONVERTED_FIELDS = ("kv_bytes", "mlx_active_bytes", "phys_footprint_bytes")
# ... and, when the phone maps the weights, the residency the host could not reproduce.
RESIDENCY_FIELDS = ("weights_residency", "mapped_weight_bytes")


def stored_weight_bytes(bundle: Path) -> int:
    """Bytes of every tensor in the bundle's safetensors files, read from their headers (no data loaded)."""
    return sum(e.size for path in sorted(bundle.glob("*.safetensors")) for e in extents(path))


@dataclass(frozen=True)
class Residency:
    """How the phone's app holds the weights of this run, decided as the Swift engine decides it."""

    residency: WeightsResidency
    mapped_weight_bytes: int = 0
    note: str | None = None
    """Why the weights are loaded although mapping was asked for."""


def phone_residency(bundle: Path, kv: KVCacheConfig, requested: WeightsResidency | None) -> Residency:
    """The soak plan's residency (else kvcache.json's layout); mapped only when the bundle is laid out for it
    and every tensor of every safetensors file starts on the phone's 16 KiB page, else loaded with the reason
    (as the app falls back). Mapped: every tensor's bytes, as stored (what the app maps)."""
    wanted = requested or kv.weights_layout
    if wanted == "loaded":
        return Residency("loaded")
    if kv.weights_layout != "mapped":
        return Residency(
            "loaded",
            note="the bundle's weights are not laid out for mapping (kvcache.json weights_layout: loaded); "
            "repackage with `kvrig package --weights-layout mapped`",
        )
    files = sorted(bundle.glob("*.safetensors"))
    if not files:
        return Residency("loaded", note="the bundle has no safetensors file to map")
    for path in files:
        try:
            off = misaligned(path, PAGE_BYTES)
        except BundleError as exc:
            return Residency("loaded", note=f"cannot map {path.name}: {exc}")
        if off:
            return Residency(
                "loaded",
                note=f"{path.name}: tensor {off[0].name!r} starts at byte {off[0].offset}, not on a "
                f"{PAGE_BYTES}-byte page",
            )
    return Residency("mapped", mapped_weight_bytes=stored_weight_bytes(bundle))


def _arrays(tree: Any) -> list[Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    leaves: list[tuple[str, Any]] = tree_flatten(tree)  # type: ignore[assignment]
    return [v for _, v in leaves if isinstance(v, mx.array)]


def cache_buffers(cache: Any) -> list[Any]:
    """The arrays a cache has allocated (whole buffers, not the filled slice `state` returns)."""
    if hasattr(cache, "keys") and hasattr(cache, "values") and not callable(cache.keys):
        # kvrig's scheme cache also holds float copies of its sink and recent tokens.
        return _arrays([cache.keys, cache.values, getattr(cache, "sink", None), getattr(cache, "recent", None)])
    if hasattr(cache, "cache"):  # mlx-lm ArraysCache (linear-attention state)
        return _arrays(list(cache.cache))
    return _arrays(cache.state)


def kv_bytes(caches: list[Any], phone_dtype: str) -> tuple[int, int]:
    """(host bytes, phone bytes) of the caches' buffers: float32 buffers count at the phone's dtype."""
    import mlx.core as mx

    phone_width = DTYPE_BYTES[phone_dtype]
    host = phone = 0
    for cache in caches:
        for a in cache_buffers(cache):
            host += a.nbytes
            phone += a.size * phone_width if a.dtype == mx.float32 else a.nbytes
    return host, phone


@dataclass
class PhoneAccount:
    """Turns the host's MLX numbers into the phone's for one loaded bundle."""

    host_weight_bytes: int
    phone_weight_bytes: int
    phone_dtype: str = "float16"
    mapped_weight_bytes: int = 0
    """Of the phone's weight bytes, those it maps from the file (Residency.mapped_weight_bytes)."""
    cache_uncapped: bool = False
    """The app never caps nor empties MLX's buffer cache (the soak plan's `buffer_cache: uncapped`)."""

    def measure(self, caches: list[Any], context_tokens: int) -> dict[str, int]:
        """The measurement the emulator accounts (see kvrig.virtual.footprint): phone-format weights and
        KV, the host's allocator numbers, and the phone-format correction of the host's active bytes."""
        import mlx.core as mx

        active = int(mx.get_active_memory())
        # The peak since the previous measurement: the step's transients (activations, the old buffers a
        # growing cache copies from), which the kernel charges as iOS does.
        peak = max(int(mx.get_peak_memory()), active)
        mx.reset_peak_memory()
        host_kv, phone_kv = kv_bytes(caches, self.phone_dtype)
        return {
            "mlx_active_bytes": active,
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "mlx_peak_bytes": peak,
            "kv_bytes": phone_kv,
            "weight_bytes": self.phone_weight_bytes,
            "context_tokens": context_tokens,
            "phone_format_delta_bytes": self._delta(active, host_kv, phone_kv),
            "phone_format_peak_delta_bytes": self._delta(peak, host_kv, phone_kv),
            "mapped_weight_bytes": self.mapped_weight_bytes,
            "mlx_cache_uncapped": int(self.cache_uncapped),
        }

    def _delta(self, host_bytes: int, host_kv: int, phone_kv: int) -> int:
        """Phone minus host bytes for `host_bytes` of MLX memory holding the weights, the caches and float32
        activations (the rest), each at the phone's element size."""
        host_activations = max(0, host_bytes - self.host_weight_bytes - host_kv)
        phone_activations = host_activations * DTYPE_BYTES[self.phone_dtype] // HOST_ACTIVATION_BYTES
        return (
            (self.phone_weight_bytes - self.host_weight_bytes)
            + (phone_kv - host_kv)
            + (phone_activations - host_activations)
        )


def phone_active_bytes(measurement: dict[str, int]) -> int:
    """MLX active bytes as the phone would hold them (the host's plus the format correction)."""
    return max(0, measurement["mlx_active_bytes"] + measurement["phone_format_delta_bytes"])


# --- eviction ----------------------------------------------------------------------------------------------


def evictable(cache: Any) -> bool:
    """Growing full-attention caches: mlx-lm's KVCache and QuantizedKVCache, and kvrig's dequantizing cache.
    Rotating rings are bounded already; recurrent and shared state has no tokens to drop."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if type(cache) is SchemeKVCache:
        # Its recent-window ring is indexed by position: dropping tokens from the front would misplace it.
        return not cache.recent_tokens
    return type(cache) in (KVCache, QuantizedKVCache, DequantizingKVCache)


def evict_front(cache: Any, keep: int, count: int) -> int:
    """Drops up to `count` of the oldest tokens after the first `keep`; the buffers shrink to what is left
    (MLX grows them again in whole steps). Returns the tokens dropped."""
    import mlx.core as mx
    from mlx.utils import tree_map

    if not evictable(cache) or cache.keys is None:
        return 0
    offset = int(cache.offset)
    n = min(count, max(0, offset - keep))
    if n <= 0:
        return 0

    def cut(a: Any) -> Any:
        return mx.concatenate([a[..., :keep, :], a[..., keep + n : offset, :]], axis=-2)

    cache.keys = tree_map(cut, cache.keys)
    cache.values = tree_map(cut, cache.values)
    cache.offset = offset - n
    mx.eval(_arrays([cache.keys, cache.values]))
    return n


def evict_oldest(caches: list[Any], keep: int, count: int) -> tuple[int, int]:
    """Evicts from every cache that can; returns (tokens dropped, caches that could not evict)."""
    dropped, skipped = 0, 0
    for cache in caches:
        if evictable(cache):
            dropped = max(dropped, evict_front(cache, keep, count))
        else:
            skipped += 1
    return dropped, skipped


# --- the pressure decision ---------------------------------------------------------------------------------

Level = Literal["normal", "warning", "critical"]
Action = Literal["nothing", "evict", "stop"]


def tokens_to_evict(context: int, keep: int, page_tokens: int, pages: int) -> int:
    """Whole pages only, never touching the first `keep` tokens (KvrigCore Paging.tokensToEvict)."""
    evictable_tokens = max(0, context - keep)
    return min(max(0, pages) * page_tokens, evictable_tokens // page_tokens * page_tokens)


def respond(
    level: Level, context: int, kv: KVCacheConfig, on_critical: Literal["stop_and_save", "continue"]
) -> tuple[Action, int]:
    """What the app does on a pressure level: nothing, evict N tokens, or stop and save."""
    policy = kv.pressure
    if level == "normal":
        return "nothing", 0
    if level == "warning":
        action: str = policy.warning
    elif on_critical == "continue" and policy.critical == "stop_and_save":
        action = "evict_oldest_pages"  # a soak that wants to run into jetsam keeps going
    else:
        action = policy.critical
    if action == "none":
        return "nothing", 0
    if action == "stop_and_save":
        return "stop", 0
    tokens = tokens_to_evict(context, kv.keep_tokens, kv.page_tokens, max(1, policy.warning_evict_pages))
    if tokens > 0:
        return "evict", tokens
    # Nothing left to evict: at critical that leaves stopping as the only safe move.
    return ("stop", 0) if level == "critical" and on_critical == "stop_and_save" else ("nothing", 0)
