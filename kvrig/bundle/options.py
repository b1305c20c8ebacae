"""What a bundle is made with: `PackageOptions`, the plan's view of one recipe on one device, and the KV spec
`auto` resolves to for a model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvrig.exceptions import KVSchemeError
from kvrig.kvcache.families import APP_UNQUANTIZED_KV, NO_QUANTIZED_ATTENTION
from kvrig.models import spec_from_config
from kvrig.planner.kv import MLX_STEP
from kvrig.planner.runtime import DEFAULT_BUFFER_CACHE_BYTES
from kvrig.recipes import AUTO, KVSpec, Rotation, parse_kv
from kvrig.schemas.kvcache import PressurePolicy, WeightsLayout

DEFAULT_BUFFER_CACHE_LIMIT = DEFAULT_BUFFER_CACHE_BYTES
MLX_CACHE_STEP = MLX_STEP


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class PackageOptions:
    weights: str = AUTO
    """A weight recipe (`q8`, `gpx-q4`, `gpx-4.6`; recipes.py) or `auto`: the smallest of the candidates whose
    bundle passes the quality gate, measured on the model (quality/choose.py)."""
    group_size: int = 64
    kv: str = AUTO
    """A KV spec (`k8v4`, `k4v4+k8@top2+rot+s4`; recipes.py) or `auto`: k8v4 with the Hadamard rotation where it
    applies to the model (see `resolve_kv`)."""
    device: str | None = None
    replace: bool = False
    """Replace an existing bundle at the output (swapped in at once; never a folder that is not a bundle)."""
    ignore_fit: bool = False
    """Package even if the plan says it does not fit on `device` (recorded as forced in the manifest)."""
    ignore_gate: bool = False
    """Keep a bundle over the quality gate (the failed check recorded as forced in the manifest)."""
    quantized_kv_start: int = 0
    page_tokens: int = MLX_CACHE_STEP
    keep_tokens: int = 4
    prefill_step_size: int = 512
    buffer_cache_limit_bytes: int = DEFAULT_BUFFER_CACHE_LIMIT
    max_context: int | None = None
    """Without a device: the context written to kvcache.json (default: the model's own maximum)."""
    quality_gate: bool = True
    """Measure the bundle's perplexity against the source and refuse it over `max_ppl_increase_pct` (`ignore_gate`
    packages anyway and records the failed check). `auto` and `fit` choose by it."""
    max_ppl_increase_pct: float = 10.0
    gate_texts: tuple[str, ...] = ()
    """Text files of the user's own the gate reads too, each a kind of its own (texts.user_kind): the text the app
    will read. `auto` weights and KV, and `fit`, choose on them as on the gate's own kinds."""
    weights_layout: WeightsLayout = "loaded"
    """`mapped`: every tensor starts on a 16 KiB page (bundle/mapped.py), so the app can map the weights from the
    file and iOS counts them outside its footprint; `loaded`: plain safetensors, loaded into MLX's memory."""
    cache: bool = True
    """Read and keep the source's perplexities in the measurement cache (quality/measured.py): the next package
    of the same model skips the passes that give the same numbers."""
    fit: int | None = None
    """With a device: choose weights and KV spec that hold this many tokens there, best measured quality first."""
    progress: Callable[[str], None] = _quiet
    """Told what the packager is doing (quantizing, measuring, choosing): the CLI prints it to stderr."""
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


AUTO_KV = "k8v4"
"""What `--kv auto` stores: keys at 8 bits, values at 4 (rotated where `auto_rotation` says it applies)."""


def resolve_kv(text: str, config: dict[str, Any], file: Path) -> KVSpec:
    """The KV spec a bundle gets for `text` on the model `config` describes: `auto` resolves here, anything else
    is taken as written (and `+kN@topM` stays for the packager to measure)."""
    if text.strip().lower() != AUTO:
        return parse_kv(text)
    if spec_from_config(config, file).model_type in APP_UNQUANTIZED_KV:
        return parse_kv("fp16")  # the app keeps this family's KV unquantized (check_app_kv)
    spec = parse_kv(AUTO_KV)
    return replace(spec, rotation=auto_rotation(spec, config, file))


def auto_rotation(kv: KVSpec, config: dict[str, Any], file: Path) -> Rotation:
    """`hadamard` for a spec with keys or values below 8 bits whose caches kvrig's attention reads and whose head
    dims are powers of two (the transform is then its own inverse, here and in MLX Swift), `none` otherwise: it
    spreads outlier channels over the group before 4-bit rounding (`kvrig bench quality` measures it); k8v8 keeps
    mlx-lm's own quantized cache and its fused attention."""
    spec = spec_from_config(config, file)
    dims = [d for layer in spec.layers for d in (layer.k_head_dim, layer.v_head_dim) if d]
    powers_of_two = bool(dims) and all(d & (d - 1) == 0 for d in dims)
    narrow = kv.quantized and min(kv.key_bits or 16, kv.value_bits or 16) < 8
    usable = narrow and spec.model_type not in NO_QUANTIZED_ATTENTION and powers_of_two
    return "hadamard" if usable else "none"


def package_default_kv(src: Path) -> str:
    """`--kv auto` resolved for the model in `src` without measuring (what `kvrig package --no-quality-gate`
    writes): k8v4, rotated where the head dims allow."""
    file = src / "config.json"
    return resolve_kv(PackageOptions().kv, json.loads(file.read_text()), file).name


def check_app_kv(model_type: str, kv: KVSpec) -> None:
    """KVSchemeError for a quantized KV spec on a family the MLX Swift app keeps unquantized (`APP_UNQUANTIZED_KV`):
    the plan would count bytes the phone never holds."""
    if model_type in APP_UNQUANTIZED_KV and kv.quantized:
        raise KVSchemeError(
            f"{model_type}: the MLX Swift app keeps this family's KV cache unquantized (its KV-shared layers read "
            f"their owner's cache as float keys and values), so --kv {kv.name} would plan bytes the phone never "
            "holds; use --kv fp16 (--kv auto takes it for this family)"
        )
