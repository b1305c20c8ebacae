"""kvcache.json: the KV-cache configuration and paging parameters the app applies (bundle contract)."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, Field, model_validator

from kvrig.schemas import StrictModel

KVCACHE_NAME: Final = "kvcache.json"
KVCACHE_SCHEMA_VERSION: Final = 3
"""2: rotation gains `hadamard_keys` (and `hadamard` now rotates keys and values); `sink_tokens` and
`recent_tokens` keep the first and the latest tokens in the activation dtype. 3: `weights_layout` says whether the
app maps the weights from the file (`mapped`: every tensor starts on `weights_alignment_bytes`)."""

WeightsLayout = Literal["loaded", "mapped"]
WeightsResidency = Literal["loaded", "mapped"]
"""How an app holds the weights in a run (telemetry, soak plans, results): the layout is what the bundle allows."""

KV_BITS: Final = (2, 3, 4, 5, 6, 8)
"""The bits MLX quantizes a KV cache to (mx.quantize); anything else is refused where kvcache.json is read."""


def _mlx_bits(bits: int) -> int:
    if bits not in KV_BITS:
        raise ValueError(f"{bits} bits: MLX quantizes to {', '.join(map(str, KV_BITS))} bits")
    return bits


KVBits = Annotated[int, AfterValidator(_mlx_bits), Field(json_schema_extra={"enum": list(KV_BITS)})]

GROUP_SIZES: Final = (32, 64, 128)
"""The group sizes MLX quantizes with (mx.quantize), weights and KV caches alike."""


def _mlx_group_size(size: int) -> int:
    if size not in GROUP_SIZES:
        raise ValueError(f"group size {size}: MLX quantizes in groups of {', '.join(map(str, GROUP_SIZES))}")
    return size


GroupSize = Annotated[int, AfterValidator(_mlx_group_size), Field(json_schema_extra={"enum": list(GROUP_SIZES)})]

Rotation = Literal["none", "hadamard", "hadamard_keys"]
ROTATION_PARTS: Final[dict[Rotation, str]] = {"none": "", "hadamard": "+rot", "hadamard_keys": "+rotk"}
"""How each rotation is written in a KV spec (`k8v4+rot`)."""

CacheKind = Literal["full", "sliding", "shared", "linear", "latent"]
"""full: grows with context; sliding: ring of `window` tokens; shared: reuses `source_layer`'s cache;
linear: constant recurrent state; latent: MLA compressed latent (+ rope part) that grows with context."""


class LayerCache(StrictModel):
    layer: int = Field(ge=0)
    kind: CacheKind
    window: int | None = Field(default=None, ge=1, description="ring size in tokens, sliding layers only")
    source_layer: int | None = Field(default=None, ge=0, description="shared layers only")
    key_bits: KVBits | None = Field(default=None, description="null: stored in the activation dtype")
    value_bits: KVBits | None = None

    @model_validator(mode="after")
    def _kind_fields(self) -> LayerCache:
        if self.kind == "sliding" and self.window is None:
            raise ValueError("sliding layers need 'window'")
        if self.kind == "shared" and self.source_layer is None:
            raise ValueError("shared layers need 'source_layer'")
        return self


class PressurePolicy(StrictModel):
    warning: Literal["evict_oldest_pages", "none"] = "evict_oldest_pages"
    warning_evict_pages: int = Field(default=1, ge=0, description="pages evicted per warning")
    critical: Literal["stop_and_save", "evict_oldest_pages", "none"] = "stop_and_save"


class KVCacheConfig(StrictModel):
    schema_version: Literal[2, 3] = Field(default=KVCACHE_SCHEMA_VERSION, alias="schema")
    scheme: str = Field(description="name such as k8v4, fp16")
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    key_bits: KVBits | None = Field(description="null: keys unquantized")
    value_bits: KVBits | None
    group_size: GroupSize
    quantized_kv_start: int = Field(ge=0, description="context length at which quantization begins")
    rotation: Rotation = Field(
        default="none",
        description="Walsh-Hadamard rotation before quantization: hadamard_keys rotates keys (and queries); "
        "hadamard also rotates values and un-rotates the attention output. Needs a power-of-two head dim.",
    )
    sink_tokens: int = Field(
        default=0, ge=0, description="first tokens also kept in the activation dtype; attention reads those"
    )
    recent_tokens: int = Field(
        default=0, ge=0, description="ring of the latest tokens kept in the activation dtype; attention reads those"
    )
    step: int = Field(default=256, ge=1, description="cache growth step in tokens (MLX: 256)")
    page_tokens: int = Field(ge=1, description="eviction granularity in tokens")
    max_context: int = Field(ge=1, description="from the plan, with its safety margin")
    keep_tokens: int = Field(
        ge=0,
        description="tokens eviction never drops from the start (stored as the rest are; sink_tokens: float copies)",
    )
    prefill_step_size: int = Field(ge=1)
    buffer_cache_limit_bytes: int = Field(ge=0, description="MLX Memory.cacheLimit")
    memory_limit_bytes: int = Field(ge=0, description="MLX Memory.memoryLimit, below the jetsam limit")
    pressure: PressurePolicy = PressurePolicy()
    weights_layout: WeightsLayout = Field(
        default="loaded",
        description="loaded: the app loads the weights into memory MLX allocates (footprint); mapped: every tensor "
        "of the bundle's safetensors starts on weights_alignment_bytes and the app maps the file read-only, handing "
        "the pages to MLX without a copy (schema 3), falling back to loading where it cannot",
    )
    weights_alignment_bytes: int | None = Field(
        default=None, ge=1, description="mapped: the boundary every tensor starts on (the phone's 16 KiB page)"
    )
    layers: list[LayerCache]

    @model_validator(mode="after")
    def _mapped_needs_schema_3(self) -> KVCacheConfig:
        mapped = self.weights_layout == "mapped" or self.weights_alignment_bytes is not None
        if mapped and self.schema_version < 3:
            raise ValueError("weights_layout / weights_alignment_bytes are schema-3 fields")
        if self.weights_layout == "mapped" and self.weights_alignment_bytes is None:
            raise ValueError("a mapped layout names its weights_alignment_bytes")
        return self

    @property
    def spec(self) -> str:
        """The KV spec in full, as `--kv` takes it and the manifest records it (`k8v4+rot+s4`): the scheme with
        the extras this file holds beside it."""
        sinks = f"+s{self.sink_tokens}" if self.sink_tokens else ""
        recent = f"+w{self.recent_tokens}" if self.recent_tokens else ""
        return self.scheme + ROTATION_PARTS[self.rotation] + sinks + recent


def host_kvcache(
    layers: list[LayerCache],
    *,
    max_context: int,
    prefill_step_size: int,
    scheme: str = "fp16",
    key_bits: int | None = None,
    value_bits: int | None = None,
    **fields: Any,
) -> KVCacheConfig:
    """kvcache.json for a run on this host with no phone plan behind it: no memory or buffer-cache limit,
    quantized from the first token, the packager's default pages (256 tokens, 4 kept); `fields` set the rest."""
    defaults: dict[str, Any] = {
        "group_size": 64,
        "quantized_kv_start": 0,
        "page_tokens": 256,
        "keep_tokens": 4,
        "buffer_cache_limit_bytes": 0,
        "memory_limit_bytes": 0,
    }
    return KVCacheConfig(
        scheme=scheme,
        key_bits=key_bits,
        value_bits=value_bits,
        max_context=max_context,
        prefill_step_size=prefill_step_size,
        layers=layers,
        **(defaults | fields),
    )
