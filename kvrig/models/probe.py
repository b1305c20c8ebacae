"""mlx-lm's own caches, driven lazily: how many bytes MLX allocates for any update schedule.

One decode step of the lazily built model runs through the caches the model makes for itself
(`make_prompt_cache`, i.e. its own `make_cache`). That step records, per cache, the keys and values it is
updated with (shapes and dtypes; nothing is evaluated) and which decoder layer owns or reads it. Bytes for a
schedule then come from fresh caches of the same classes fed unevaluated `mx.zeros` of those shapes through
`update_and_fetch`: MLX's `nbytes` of the result is exact and nothing is allocated. Caches that are not
updated that way (recurrent state: ArraysCache, Mamba) hold what the step left in them, whatever the length.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrig.exceptions import ModelConfigError
from kvrig.models.layers import LayerSpec

# A probe step of this many tokens: a single decode step (no prompt mask), cheapest to build.
PROBE_TOKENS = 1
# A second step for caches that hold state: as many tokens as a state that keeps recent tokens may keep.
STATE_TOKENS = 16


@dataclass(frozen=True)
class Update:
    """One update_and_fetch call: keys and values with the sequence axis (2) removed from the shapes."""

    key_shape: tuple[int, ...]
    key_dtype: Any
    value_shape: tuple[int, ...]
    value_dtype: Any

    def arrays(self, n: int) -> tuple[Any, Any]:
        return _zeros(self.key_shape, n, self.key_dtype), _zeros(self.value_shape, n, self.value_dtype)


@functools.lru_cache(maxsize=1024)
def _zeros(shape: tuple[int, ...], n: int, dtype: Any) -> Any:
    import mlx.core as mx

    return mx.zeros((*shape[:2], n, *shape[2:]), dtype)


@dataclass
class Slot:
    """One cache the model makes (one entry of make_prompt_cache, or one part of a CacheList)."""

    index: int
    path: tuple[int, ...]
    """position in make_prompt_cache's list, then inside nested CacheLists."""
    cls: type
    updates: list[Update] = field(default_factory=list)
    """update_and_fetch calls one step makes; empty for caches that hold state instead."""
    state_bytes: int = 0
    """bytes a state cache holds after a step (constant in context)."""
    layer: int | None = None
    """decoder layer that updates this cache."""
    window: int | None = None
    params: tuple[tuple[str, Any], ...] = ()
    """the fresh cache's scalar settings (step, keep, chunk size...): replays differ when they do."""
    before: list[str] = field(default_factory=list)
    """methods the model itself calls on this cache, without arguments, before a step's updates (llama4
    trims its chunked caches' front that way); a replay calls them too."""
    sealed: tuple[Any, ...] | None = None
    """the signature, fixed once the probe is done"""

    @property
    def kind(self) -> str:
        from mlx_lm.models import cache as c

        if not self.updates:
            return "linear"
        if issubclass(self.cls, c.RotatingKVCache):
            return "sliding"
        return "full"

    @property
    def signature(self) -> tuple[Any, ...]:
        if self.sealed is not None:
            return self.sealed
        return (self.cls, tuple(self.updates), self.window, self.state_bytes, self.params, tuple(self.before))


def _leaves(cache: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    from mlx_lm.models.cache import CacheList

    if isinstance(cache, CacheList):
        for i, sub in enumerate(cache.caches):
            yield from _leaves(sub, (*path, i))
    else:
        yield path, cache


def _get(caches: list[Any], path: tuple[int, ...]) -> Any:
    cache = caches[path[0]]
    for i in path[1:]:
        cache = cache.caches[i]
    return cache


@contextlib.contextmanager
def _watching_layers(layers: list[Any], probe: CacheProbe) -> Iterator[None]:
    """While the probe step runs, each decoder layer's class notes which layer is running and the objects it
    was handed (to find the cache a KV-shared layer reads). Patched on the class: models call their layers
    through views (slices, properties) that an instance swap would miss."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    originals = {cls: cls.__call__ for cls in {type(layer) for layer in layers}}

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            i = index.get(id(self))
            if i is None:
                return original(self, *args, **kwargs)
            probe._current = i
            probe._handed[i] = {id(a) for a in _flatten((args, kwargs))}
            try:
                return original(self, *args, **kwargs)
            finally:
                probe._current = None

        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = wrap(original)  # type: ignore[method-assign]
        yield
    finally:
        for cls, original in originals.items():
            cls.__call__ = original  # type: ignore[method-assign]


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _flatten(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _flatten(o)
    else:
        yield obj


class CacheProbe:
    """What a model's caches are, learned from one lazy step of the model itself."""

    def __init__(self, model: Any, dtype: str = "float16") -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self._current: int | None = None
        self._first_step = True
        self._handed: dict[int, set[int]] = {}
        caches = make_prompt_cache(model)
        self.slots: list[Slot] = []
        by_id: dict[int, Slot] = {}
        returned: dict[int, Slot] = {}
        for index, cache in enumerate(caches):
            for path, leaf in _leaves(cache, (index,)):
                settings = tuple(
                    sorted((k, v) for k, v in vars(leaf).items() if v is None or isinstance(v, (bool, int, float, str)))
                )
                slot = Slot(index, path, type(leaf), window=getattr(leaf, "max_size", None), params=settings)
                self.slots.append(slot)
                by_id[id(leaf)] = slot
                if hasattr(leaf, "update_and_fetch"):
                    leaf.update_and_fetch = self._recorder(leaf, slot, returned)
                    self._watch_calls(leaf, slot)
        layers = getattr(model, "layers", None)
        originals = list(layers) if isinstance(layers, (list, tuple)) else []
        try:
            with _watching_layers(originals, self), contextlib.redirect_stdout(io.StringIO()):
                model(mx.zeros((1, PROBE_TOKENS), mx.int32), cache=caches)
            self._first_step = False
            if any(not slot.updates for slot in self.slots):
                # State that keeps the last few tokens (longcat_flash_ngram's n-gram context) is full only
                # after more than one token: read it after a second, longer step, not recorded as one.
                recorded = [list(slot.updates) for slot in self.slots]
                seen = dict(returned)
                with contextlib.redirect_stdout(io.StringIO()):
                    model(mx.zeros((1, STATE_TOKENS), mx.int32), cache=caches)
                for slot, updates in zip(self.slots, recorded, strict=True):
                    slot.updates = updates
                returned.clear()
                returned.update(seen)
        except Exception as exc:
            raise ModelConfigError(
                f"mlx-lm's {type(model).__module__} cannot run a step with its own caches: {type(exc).__name__}: {exc}"
            ) from None
        for slot in self.slots:
            if not slot.updates:
                slot.state_bytes = _get(caches, slot.path).nbytes
            slot.sealed = slot.signature  # fixed from here on; computed once, not per replay
        self.num_layers = len(originals)
        self.owners = self._owners({id(c): i for i, c in enumerate(caches)})
        self.layer_sources = self._sources({id(c): i for i, c in enumerate(caches)}, returned)

    def _watch_calls(self, cache: Any, slot: Slot) -> None:
        """Notes the cache's own methods the model calls without arguments before the cache's first update of
        the first step (a read that changes nothing is harmless to repeat; one that trims must be)."""
        import inspect

        for name, function in inspect.getmembers(type(cache), inspect.isfunction):
            if name.startswith("_") or name == "update_and_fetch":
                continue

            def call(*args: Any, _name: str = name, _function: Any = function, **kwargs: Any) -> Any:
                if self._first_step and not slot.updates and not args and not kwargs and _name not in slot.before:
                    slot.before.append(_name)
                return _function(cache, *args, **kwargs)

            setattr(cache, name, call)

    def _recorder(self, cache: Any, slot: Slot, returned: dict[int, Slot]) -> Callable[[Any, Any], Any]:
        original = cache.update_and_fetch

        def record(keys: Any, values: Any) -> Any:
            slot.updates.append(
                Update(
                    (*keys.shape[:2], *keys.shape[3:]),
                    keys.dtype,
                    (*values.shape[:2], *values.shape[3:]),
                    values.dtype,
                )
            )
            if self._current is not None and slot.layer is None:
                slot.layer = self._current
            out = original(keys, values)
            for a in _flatten(out):
                returned[id(a)] = slot
            return out

        return record

    def _owners(self, top_ids: dict[int, int]) -> dict[int, int]:
        """make_prompt_cache index -> the decoder layer that owns it: the layer that updated it, else the first
        layer handed it (recurrent state is written in place, not through update_and_fetch)."""
        owners = {slot.index: slot.layer for slot in self.slots if slot.layer is not None}
        for i in range(self.num_layers):
            for obj in self._handed.get(i, ()):
                index = top_ids.get(obj)
                if index is not None and index not in owners:
                    owners[index] = i
        return owners

    def _sources(self, top_ids: dict[int, int], returned: dict[int, Slot]) -> dict[int, int]:
        """Decoder layers holding no cache of their own -> the layer whose cache (or its arrays) they read."""
        owning = set(self.owners.values())
        sources: dict[int, int] = {}
        for i in range(self.num_layers):
            if i in owning:
                continue
            for obj in self._handed.get(i, ()):
                index = top_ids.get(obj)
                if index is None and obj in returned:
                    index = returned[obj].index
                if index is not None and self.owners.get(index, i) != i:
                    sources[i] = self.owners[index]
                    break
        return sources

    # --- bytes for a schedule ------------------------------------------------------------------------------

    def fresh(self, make: Callable[[Slot], Any] | None = None) -> list[tuple[Slot, Any]]:
        """New caches, one per slot: the model's own classes (or `make(slot)` where it returns one)."""
        from mlx_lm.models.cache import make_prompt_cache

        base = make_prompt_cache(self.model)
        out = []
        for slot in self.slots:
            cache = make(slot) if make is not None else None
            out.append((slot, cache if cache is not None else _get(base, slot.path)))
        return out

    def slot_bytes(self, slot: Slot, schedule: Sequence[int], make: Callable[[Slot], Any] | None = None) -> int:
        """Bytes one slot's cache holds after `schedule` (token counts per update)."""
        return _replay(self, slot, tuple(schedule), make)[0]

    def slot_series(self, slot: Slot, schedule: Sequence[int], make: Callable[[Slot], Any] | None = None) -> array[int]:
        """The bytes one slot's cache held after each update of `schedule`: the caches of a model peak together
        at the update where their sum does, which is not each one's own peak where a sliding cache peaks early."""
        return _replay(self, slot, tuple(schedule), make)[1]

    def slot_largest_array(self, slot: Slot, schedule: Sequence[int], make: Callable[[Slot], Any] | None = None) -> int:
        """The largest single array in one slot's cache after `schedule` (one Metal buffer)."""
        return _replay(self, slot, tuple(schedule), make)[2]

    def slot_growth(
        self, slot: Slot, schedule: Sequence[int], make: Callable[[Slot], Any] | None = None
    ) -> tuple[tuple[Growth, ...], ...]:
        """Per update of `schedule`, the buffers one slot's cache replaced: each new buffer, the one it
        replaced (freed once the copy is made) and the zeros it was grown with (a scratch buffer)."""
        return _growth_replay(self, slot, tuple(schedule), make)

    def slot_of_layer(self, layer: int) -> Slot | None:
        return next((s for s in self.slots if s.layer == layer), None)

    def groups(self, make: Callable[[Slot], Any] | None = None) -> list[tuple[Slot, int]]:
        """Slots whose replays are alike (same signature, same cache from `make`): one of each and how many,
        so a 48-layer model replays once per kind of layer instead of once per layer."""
        counts: dict[Any, list[Any]] = {}
        for slot in self.slots:
            entry = counts.setdefault(_memo_key(slot, (), make), [slot, 0])
            entry[1] += 1
        return [(slot, n) for slot, n in counts.values()]


def _replay(
    probe: CacheProbe, slot: Slot, schedule: tuple[int, ...], make: Callable[[Slot], Any] | None
) -> tuple[int, array[int], int]:
    """(bytes at the end, bytes after each update, the largest array at the end) of one slot's cache."""
    if not slot.updates:
        held = slot.state_bytes if schedule else 0
        return held, array("q", [held]) * len(schedule), held
    key = _memo_key(slot, schedule, make)
    if key not in _MEMO:
        # A plan's searches ask for [p] * k + [r] at many k (thousands of chunks at a long context): a replay
        # resumes from the cache as it stood after the longest run of p-token updates replayed before.
        run = next((i for i, n in enumerate(schedule) if n != schedule[0]), len(schedule))
        lead = _CHECKPOINTS.setdefault((slot.signature, key[2], schedule[:1]), _Lead())
        start = max((k for k in lead.caches if k <= run), default=0)
        # A checkpoint resumes as a copy, so it stays as it was.
        cache = _snapshot(lead.caches[start]) if start else next(c for s, c in probe.fresh(make) if s is slot)
        series = lead.nbytes[:start]
        for i, n in enumerate(schedule[start:], start + 1):
            for name in slot.before:
                getattr(cache, name)()
            for update in slot.updates:
                cache.update_and_fetch(*update.arrays(n))
            series.append(cache.nbytes)
            if i <= run and i == len(lead.nbytes) + 1:
                lead.nbytes.append(cache.nbytes)
            checkpoint = i <= run and i % CHECKPOINT_EVERY == 0 and i not in lead.caches
            if checkpoint and (saved := _snapshot(cache)) is not None:
                lead.caches[i] = saved
        # The buffers themselves (a cache's `state` may be a view trimmed to its offset).
        _MEMO[key] = (cache.nbytes, series, max((a.nbytes for a in _buffers(cache)), default=0))
    replayed: tuple[int, array[int], int] = _MEMO[key]
    return replayed


CHECKPOINT_EVERY = 16
"""A replay keeps the cache after every 16th update of its leading run: a later replay redoes at most 15."""


def _snapshot(cache: Any) -> Any:
    """A copy of a cache that later updates of either leave alone: its arrays as new, still unevaluated arrays
    (MLX writes a slice assignment into the array object itself), its containers rebuilt, its numbers shared.
    None for a cache holding anything else (its state could not be told apart from the original's)."""
    import mlx.core as mx

    unsupported = object()

    def copied(value: Any) -> Any:
        if isinstance(value, mx.array):
            return copy.copy(value)
        if value is None or isinstance(value, int | float | str | mx.Dtype):
            return value
        if isinstance(value, tuple | list):
            items = [copied(v) for v in value]
            if any(v is unsupported for v in items):
                return unsupported
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return unsupported

    if not hasattr(cache, "__dict__") or hasattr(cache, "__slots__"):
        return None
    state = {name: copied(value) for name, value in vars(cache).items()}
    if any(v is unsupported for v in state.values()):
        return None
    out = copy.copy(cache)
    vars(out).update(state)
    return out


@dataclass(frozen=True)
class Growth:
    """One buffer a cache update replaced (bytes): MLX allocates the zeros and the new buffer, copies, then
    frees the old buffer and the zeros."""

    index: int
    """the buffer's position among the cache's arrays"""
    freed: int
    allocated: int
    scratch: int


def _buffers(cache: Any) -> list[Any]:
    import mlx.core as mx

    return [a for a in _flatten(list(vars(cache).values())) if isinstance(a, mx.array)]


def _growth_replay(
    probe: CacheProbe, slot: Slot, schedule: tuple[int, ...], make: Callable[[Slot], Any] | None
) -> tuple[tuple[Growth, ...], ...]:
    if not slot.updates:
        # Recurrent state is allocated once and then written in place.
        return tuple((Growth(0, 0, slot.state_bytes, 0),) if i == 0 else () for i in range(len(schedule)))
    key = ("growth", *_memo_key(slot, schedule, make))
    if key not in _MEMO:
        cache = next(c for s, c in probe.fresh(make) if s is slot)
        steps: list[tuple[Growth, ...]] = []
        for n in schedule:
            before, offset = _buffers(cache), int(getattr(cache, "offset", 0) or 0)
            for name in slot.before:
                getattr(cache, name)()
            for update in slot.updates:
                cache.update_and_fetch(*update.arrays(n))
            after = _buffers(cache)
            changed: list[Growth] = []
            for i, new in enumerate(after):
                old = before[i] if len(before) == len(after) else None
                if old is new:
                    continue  # written in place: MLX donates the buffer to the slice update
                if old is None or new.ndim < 2 or not new.shape[-2]:
                    changed.append(Growth(i, 0 if old is None else old.nbytes, new.nbytes, 0))
                    continue
                # The old rows kept (a ragged tail past the offset is trimmed first); the rest are zeros.
                kept = min(old.shape[-2], offset) if old.ndim >= 2 else 0
                scratch = max(0, new.shape[-2] - kept) * (new.nbytes // new.shape[-2])
                changed.append(Growth(i, old.nbytes, new.nbytes, scratch))
            steps.append(tuple(changed))
        _MEMO[key] = tuple(steps)
    growth: tuple[tuple[Growth, ...], ...] = _MEMO[key]
    return growth


def _memo_key(slot: Slot, schedule: tuple[int, ...], make: Callable[[Slot], Any] | None) -> tuple[Any, ...]:
    # What a replay depends on: the slot's own signature, the schedule, and the cache `make` gives this slot
    # (None where it keeps the model's own: a nested or unchosen cache of the same signature differs).
    # (`key` may depend on the slot: per-layer key widths give layers of one signature different caches.)
    picks = getattr(make, "picks", None)
    made = getattr(make, "key", None) if picks is None or picks(slot) else None
    if callable(made):
        made = made(slot)
    return (slot.signature, schedule, made)


# Replays keyed by what determines them (cache class, update shapes, schedule, scheme): layers alike share one.
_MEMO: dict[Any, Any] = {}


@dataclass
class _Lead:
    """What replays starting with a run of one update size share: the cache after every CHECKPOINT_EVERY-th
    update of that run, and its bytes after each update of the run, as far as any replay went."""

    caches: dict[int, Any] = field(default_factory=dict)
    nbytes: array[int] = field(default_factory=lambda: array("q"))


# By (slot signature, the cache `make` gives, first update size).
_CHECKPOINTS: dict[Any, _Lead] = {}


def quantized_step_runs(probe: CacheProbe, model_type: str) -> bool:
    """Whether one lazy step of the model runs with the quantized caches kvrig's runtime would give its plain
    KVCaches (MLA attention, for one, multiplies the cached latent directly and cannot take them)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvrig.kvcache.caches import quantized_cache  # MLX's caches: loaded with MLX, when a probe runs

    caches = make_prompt_cache(probe.model)
    swapped = [quantized_cache(8, 8, 32, model_type) if type(c) is KVCache else c for c in caches]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            probe.model(mx.zeros((1, PROBE_TOKENS), mx.int32), cache=swapped)
    except Exception:  # any failure of the model's own code means it cannot take them
        return False
    return True


def layer_specs(probe: CacheProbe) -> list[Any]:
    """One LayerSpec per decoder layer (KV-shared layers name the layer they read); when the step did not
    show which layer owns which cache, one per cache the model makes."""
    from mlx_lm.models.cache import KVCache

    tops: dict[int, list[Slot]] = {}
    for slot in probe.slots:
        tops.setdefault(slot.index, []).append(slot)

    def spec(i: int, group: list[Slot]) -> LayerSpec:
        first = next((s for s in group if s.updates), group[0])
        nested = len(group) > 1 or len(first.path) > 1
        kinds = {s.kind for s in group}
        kind = "linear" if nested and kinds != {"full"} else first.kind
        u = first.updates[0] if first.updates else None
        return LayerSpec(
            i,
            kind,  # type: ignore[arg-type]
            kv_heads=u.key_shape[1] if u and len(u.key_shape) > 2 else 0,
            k_head_dim=u.key_shape[-1] if u else 0,
            v_head_dim=u.value_shape[-1] if u else 0,
            window=first.window if kind == "sliding" else None,
            # kvrig swaps only plain KVCaches (not llama4's chunked ones, nor caches nested in a CacheList).
            quantizable=not nested and first.cls is KVCache,
        )

    owner = {layer: index for index, layer in probe.owners.items()}
    complete = len(owner) == len(tops) == len(probe.owners)
    if complete and len(owner) + len(probe.layer_sources) == probe.num_layers:
        out = []
        for i in range(probe.num_layers):
            if i in owner:
                out.append(spec(i, tops[owner[i]]))
            else:
                out.append(LayerSpec(i, "shared", source_layer=probe.layer_sources[i]))
        return out
    return [spec(n, tops[index]) for n, index in enumerate(sorted(tops))]


def forget_replays() -> None:
    """Drops remembered replays (a benchmark measures answering from scratch)."""
    _MEMO.clear()
    _CHECKPOINTS.clear()
    _zeros.cache_clear()
