"""MLX's buffer cache replayed over an app's run: what an app that never caps it holds (`--app uncapped`).

MLX does not return a freed buffer to the system: it keeps it in its buffer cache and hands it out again for a
request of nearly its size (at least the size asked and less than min(2 x, + 2 pages)). A KV cache grows by
allocating a larger buffer and copying; the old one, and the attention scores of every prefill chunk (their
size grows with the context), can never be taken again by a later, larger request, so they stay in the cache
for the rest of the process unless the app caps it (`Memory.cacheLimit`; kvrig's app caps it at 20 MiB). The
cap's default is MLX's memory limit, and Metal empties the cache, oldest buffer first, only when active + cached
bytes would pass 0.95 x the GPU's recommended working set. The allocator below follows MLX's own
(mlx/backend/common/buffer_cache.h, metal/allocator.cpp, no_gpu/allocator.cpp) over the buffers a run
allocates and frees: the KV caches' own growth, replayed exactly through mlx-lm's caches (models/probe.py), and
each forward pass's activations as planner/runtime.py lists them.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from kvrig.models.layers import DTYPE_BYTES
from kvrig.models.probe import Growth
from kvrig.models.spec import ModelSpec
from kvrig.planner.kv import (
    cache_factory,
    context_schedule,
    dequantizes_on_read,
    extra_bytes,
    layer_quantized,
)
from kvrig.planner.runtime import forward_buffers
from kvrig.planner.transient import Backend
from kvrig.recipes import KVSpec

CPU_PAGE: Final = 4096  # mlx/backend/no_gpu/allocator.cpp: the buffer cache's page size
GC_FRACTION: Final = 0.95  # Metal empties its cache when active + cache would pass this share of the working set
BLOCK_FRACTION_WORKING_SET: Final = 1.5  # Metal's memory limit: min(1.5 x working set, 0.95 x RAM)
BLOCK_FRACTION_RAM: Final = 0.95
AppModel = Literal["kvrig", "uncapped"]
Key = tuple[int, int, int]


@dataclass(frozen=True)
class AllocatorPolicy:
    """How MLX's allocator on one backend caches freed buffers."""

    backend: Backend
    page: int
    """the reuse window is two pages; Metal also rounds buffers above a page up to whole pages"""
    cache_limit: int | None = None
    """the cache cap (Memory.cacheLimit / mx.set_cache_limit); None: uncapped (MLX's default on Metal)"""
    gc_limit: int | None = None
    """Metal: active + cache past this empties the cache, oldest first (0.95 x the recommended working set)"""

    @classmethod
    def phone(cls, page: int, working_set: int | None, ram: int, cache_limit: int | None = None) -> AllocatorPolicy:
        """MLX on a phone's Metal: the cache's default cap is MLX's memory limit."""
        block = int(BLOCK_FRACTION_RAM * ram)
        if working_set is not None:
            block = min(int(BLOCK_FRACTION_WORKING_SET * working_set), block)
        gc = min(int(GC_FRACTION * working_set), block) if working_set is not None else None
        return cls("metal", page, block if cache_limit is None else cache_limit, gc)

    @classmethod
    def host(cls, cache_limit: int | None = None) -> AllocatorPolicy:
        """MLX on a CPU (the host runtime, the virtual iPhone) with the cache capped or not."""
        return cls("cpu", CPU_PAGE, cache_limit, None)


class BufferCache:
    """MLX's BufferCache: freed buffers by size, most recently freed first, released oldest first."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.size = 0
        self._sizes: list[int] = []  # sorted distinct sizes held
        self._by_size: dict[int, list[int]] = {}  # size -> buffer ids, oldest first (a multimap's order)
        self._lru: OrderedDict[int, int] = OrderedDict()  # id -> size, oldest first
        self._next = 0

    def reuse(self, size: int) -> int | None:
        """The smallest cached buffer of at least `size` bytes if it is less than min(2 x, + 2 pages)."""
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes) or self._sizes[i] >= min(2 * size, size + 2 * self.page):
            return None
        found = self._sizes[i]
        self._take(self._by_size[found][0])
        return found

    def recycle(self, size: int) -> None:
        self._next += 1
        self._lru[self._next] = size
        if size not in self._by_size:
            bisect.insort(self._sizes, size)
            self._by_size[size] = []
        self._by_size[size].append(self._next)
        self.size += size

    def release(self, at_least: int) -> None:
        if at_least >= 0.9 * self.size:
            self.__init__(self.page)  # type: ignore[misc]
            return
        freed = 0
        while self._lru and freed < at_least:
            oldest = next(iter(self._lru))
            freed += self._lru[oldest]
            self._take(oldest)

    def _take(self, buffer: int) -> None:
        size = self._lru.pop(buffer)
        ids = self._by_size[size]
        ids.remove(buffer)
        if not ids:
            del self._by_size[size]
            self._sizes.pop(bisect.bisect_left(self._sizes, size))
        self.size -= size


@dataclass
class Allocator:
    """MLX's allocator on one backend: active bytes, the buffer cache, and the highest active + cache seen."""

    policy: AllocatorPolicy
    active: int = 0
    high: int = 0
    high_cached: int = 0
    """the cache's share of `high` when it was reached"""
    cache: BufferCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = BufferCache(self.policy.page)

    @property
    def cached(self) -> int:
        return self.cache.size

    def malloc(self, size: int) -> int:
        """Allocates `size` bytes; returns the buffer's real size (a cached buffer may be a little larger)."""
        p = self.policy
        if p.backend == "metal" and size > p.page:
            size = -(-size // p.page) * p.page
        got = self.cache.reuse(size)
        if got is None:
            got = size
            if p.gc_limit is not None and self.active + self.cached + size >= p.gc_limit:
                self.cache.release(self.active + self.cached + size - p.gc_limit)
        self.active += got
        if p.backend == "metal" and p.cache_limit is not None and self.cached > p.cache_limit:
            self.cache.release(self.cached - p.cache_limit)
        if self.active + self.cached > self.high:
            self.high, self.high_cached = self.active + self.cached, self.cached
        return got

    def free(self, size: int) -> None:
        p = self.policy
        self.active -= size
        if p.backend == "metal":
            keep = p.cache_limit is None or self.cached < p.cache_limit
        else:
            keep = p.cache_limit is None or self.cached + size <= p.cache_limit
        if keep:
            self.cache.recycle(size)


@dataclass(frozen=True)
class Generation:
    """One generation of a run, on new caches: the tokens of each update in order (prefill chunks, then one
    token per decode step), as mlx-lm's generation loop feeds them."""

    updates: tuple[int, ...]

    @classmethod
    def of(cls, prompt_tokens: int, decode_tokens: int = 0, prefill_step: int = 512) -> Generation:
        """A prompt prefilled in chunks of `prefill_step`, then `decode_tokens` decoded."""
        return cls(tuple(context_schedule(prompt_tokens + decode_tokens, prefill_step, prompt_tokens)))

    @property
    def context(self) -> int:
        return sum(self.updates)


@dataclass(frozen=True)
class StepMemory:
    """MLX's memory after one update (a prefill chunk or a decoded token) of a run, weights included."""

    generation: int
    context: int
    tokens: int
    active_bytes: int
    cache_bytes: int
    high_bytes: int
    """the highest active + cache so far (inside a forward pass: its activations)"""
    high_cache_bytes: int
    """the cache's share of `high_bytes`"""

    @property
    def total_bytes(self) -> int:
        return self.active_bytes + self.cache_bytes


def chat_run(context: int, generations: int, decode_tokens: int, prefill_step: int) -> list[Generation]:
    """`generations` turns of a chat whose context grows evenly to `context`, each re-prefilling the whole
    conversation and decoding `decode_tokens` of it (fewer where a turn is shorter)."""
    run = []
    for i in range(1, generations + 1):
        reach = max(1, context * i // generations)
        decode = min(decode_tokens, reach - 1)
        run.append(Generation.of(reach - decode, decode, prefill_step))
    return run


def trace_run(
    spec: ModelSpec,
    scheme: KVSpec,
    run: Sequence[Generation],
    *,
    dtype: str,
    policy: AllocatorPolicy,
    base_bytes: int = 0,
) -> list[StepMemory]:
    """MLX's active and cached bytes after every update of `run` (generations in a row, each with new caches,
    fed as mlx-lm's generation loop feeds them), on top of `base_bytes` already allocated (the weights)."""
    alloc = Allocator(policy)
    alloc.active = alloc.high = base_bytes
    probe = spec.probe(scheme.dtype)
    make = cache_factory(spec, scheme)
    groups = probe.groups(make)
    width = DTYPE_BYTES[scheme.dtype]
    dequantized = dequantized_rows(spec, scheme) * width
    extras = extra_bytes(spec, scheme)
    steps: list[StepMemory] = []
    for g, generation in enumerate(run):
        schedule = generation.updates
        growth = [(probe.slot_growth(slot, schedule, make), count) for slot, count in groups]
        held: dict[Key, int] = {}  # (group, layer, buffer) -> its real size
        extra = alloc.malloc(extras) if extras else 0
        context = 0
        for k, n in enumerate(schedule):
            context += n
            transients = forward_buffers(spec, n, context, dtype, scheme=scheme, backend=policy.backend)
            if dequantized:
                transients += [dequantized * context] * 2  # one layer's keys and values, dequantized for attention
            live = [alloc.malloc(b) for b in transients]
            for i, (per_update, count) in enumerate(growth):
                for layer in range(count):
                    for change in per_update[k]:
                        _replace(alloc, held, (i, layer, change.index), change)
            for b in live:
                alloc.free(b)
            steps.append(StepMemory(g, context, n, alloc.active, alloc.cached, alloc.high, alloc.high_cached))
        for b in held.values():
            alloc.free(b)
        if extra:
            alloc.free(extra)
    return steps


def _replace(
    alloc: Allocator, held: dict[tuple[int, int, int], int], key: tuple[int, int, int], change: Growth
) -> None:
    """One buffer a cache replaces: zeros and the new buffer allocated, the copy made, the old buffer freed."""
    scratch = alloc.malloc(change.scratch) if change.scratch else 0
    new = alloc.malloc(change.allocated)
    old = held.pop(key, 0)
    if old:
        alloc.free(old)
    if scratch:
        alloc.free(scratch)
    held[key] = new


def dequantized_rows(spec: ModelSpec, scheme: KVSpec) -> int:
    """Elements per cached token of the largest layer kvrig's dequantizing cache reads back (keys or values)."""
    if not dequantizes_on_read(scheme, spec):
        return 0
    return max(
        (
            layer.kv_heads * max(layer.k_head_dim, layer.v_head_dim)
            for layer in spec.layers
            if layer_quantized(layer, scheme)
        ),
        default=0,
    )
