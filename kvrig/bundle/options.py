"""What a bundle is made with: `PackageOptions`, the plan's view of one recipe on one device, and the KV
rotation `auto` resolves to for a model."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrig.kvcache.families import NO_QUANTIZED_ATTENTION
from kvrig.models import spec_from_config
from kvrig.planner.kv import MLX_STEP, KVScheme, parse_scheme
from kvrig.planner.runtime import DEFAULT_BUFFER_CACHE_BYTES
from kvrig.schemas.kvcache import PressurePolicy

DEFAULT_BUFFER_CACHE_LIMIT = DEFAULT_BUFFER_CACHE_BYTES
MLX_CACHE_STEP = MLX_STEP
TOP_KEYS = re.compile(r"\+k\d+@top\d+")
"""`+kN@topM` in a KV option: the layers whose keys suffer most get N bits, resolved on the source model."""


@dataclass(frozen=True)
class PackageOptions:
    weights: str = "q8"
    """q8 rather than q4: on SmolLM2 q4 g64 raises perplexity 18-34 % and gets simple facts wrong; q5 is +16 %
    on the GPL-3 text, and q6 (+6-7 %) still answers 'capital of France' wrong (`kvrig bench quality`)."""
    group_size: int = 64
    kv: str = "k8v4"
    kv_group_size: int = 64
    device: str | None = None
    force: bool = False
    """Package even if the plan says it does not fit, and replace an existing bundle at the output."""
    quantized_kv_start: int = 0
    rotation: str = "auto"
    """`auto`: Hadamard on keys and values wherever it applies (see `resolve_rotation`), else none."""
    page_tokens: int = MLX_CACHE_STEP
    keep_tokens: int = 4
    prefill_step_size: int = 512
    buffer_cache_limit_bytes: int = DEFAULT_BUFFER_CACHE_LIMIT
    max_context: int | None = None
    """Without a device: the context written to kvcache.json (default: the model's own maximum)."""
    quality_gate: bool = False
    """Measure the bundle's perplexity against the source and refuse it over `max_ppl_increase_pct` (the CLI
    turns this on by default; `force` packages anyway and records the failed check)."""
    max_ppl_increase_pct: float = 10.0
    sink_tokens: int = 0
    recent_tokens: int = 0
    pressure: PressurePolicy = field(default_factory=PressurePolicy)
    """What the app does on memory-pressure levels (kvcache.json `pressure`)."""


@dataclass(frozen=True)
class PlanView:
    """What the planner says of one weight recipe and KV scheme on one device (the manifest's prediction)."""

    device: str
    limit_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    max_context: int
    memory_limit_bytes: int


def resolve_rotation(rotation: str, config: dict[str, Any], file: Path, scheme: KVScheme) -> str:
    """`auto` -> `hadamard` for a scheme with keys or values below 8 bits whose caches kvrig's attention reads
    and whose head dims are powers of two (the transform is then its own inverse, here and in MLX Swift),
    `none` otherwise. On SmolLM2 it takes k8v4 from +1.4 % to +0.4 % PPL and k4v4 from +18 % to +7 % (`kvrig
    bench quality`); k8v8 (+0.1 %) keeps mlx-lm's own quantized cache and its fused attention."""
    if rotation != "auto":
        return rotation
    spec = spec_from_config(config, file)
    dims = [d for layer in spec.layers for d in (layer.k_head_dim, layer.v_head_dim) if d]
    powers_of_two = bool(dims) and all(d & (d - 1) == 0 for d in dims)
    narrow = scheme.quantized and min(scheme.key_bits or 16, scheme.value_bits or 16) < 8
    usable = narrow and spec.model_type not in NO_QUANTIZED_ATTENTION and powers_of_two
    return "hadamard" if usable else "none"


def package_default_kv(src: Path) -> str:
    """The KV variant `kvrig package` writes by default for the model in `src`, in the bench's syntax."""
    options = PackageOptions()
    scheme = parse_scheme(options.kv, group_size=options.kv_group_size)
    file = src / "config.json"
    rotation = resolve_rotation(options.rotation, json.loads(file.read_text()), file, scheme)
    return options.kv + {"none": "", "hadamard": "+rot", "hadamard_keys": "+rotk"}[rotation]
