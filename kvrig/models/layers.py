"""What one decoder layer's cache is (its kind, heads and head dims) and the phone's element sizes: the facts
the cache probe learns and everything above it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerKind = Literal["full", "sliding", "shared", "linear", "latent"]

# The phone's element sizes (kvrig keeps activations and caches in these dtypes).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's cache (one entry of the model's make_prompt_cache).

    full: a growing KV cache; sliding: a rotating cache of `window` tokens; linear: recurrent state (or a
    CacheList mixing kinds) of constant size; shared: reads `source_layer`'s cache and holds none. Heads and
    head dims are those the model's own step handed the cache.
    """

    index: int
    kind: LayerKind
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None
    source_layer: int | None = None
    quantizable: bool = True
    """a plain KVCache of its own (kvrig swaps those for quantized caches; not caches nested in a CacheList)."""

    @property
    def grows(self) -> bool:
        return self.kind in ("full", "latent")
