"""Bytes of the stateful Core ML program `kvrig export coreml` writes: its weight constants (at rest, and the
`weight.bin` file coremltools lays them out in) and its KV-cache state per context.

Computed from the model's config alone (no coremltools import), so `kvrig plan --backend coreml` stays light.
The export's tests read the saved package back and require these numbers byte for byte.

What the program holds (see kvrig/coreml/program.py): every quantized matrix as the bundle's own MLX groups
— the packed integers as uint4/uint8, one fp16 scale and one fp16 bias per group — unquantized vectors in
fp16, one fp32 table of RoPE inverse frequencies, and per layer a key and a value state of
[1, kv_heads, context, head_dim] in fp16 (iOS 18 states are fp16 only, whatever the bundle's KV scheme).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kvrig.exceptions import CoreMLUnsupportedError, ModelConfigError
from kvrig.models import default_model_path, read_config
from kvrig.profiles import load_profile
from kvrig.recipes import parse_weights
from kvrig.schemas import StrictModel

# Families whose mlx-lm implementation the exporter rebuilds op by op (llama covers SmolLM, Llama and Mistral).
COREML_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Core ML's block-wise constexpr takes 4- and 8-bit integers; MLX's 2/3/5/6-bit groups have no exact form.
COREML_BITS = (4, 8)

# coremltools' weight file (MILBlob v2): a 64-byte header, then per constant a 64-byte record and its data,
# each record starting on a 64-byte boundary; the file ends right after the last constant's data.
BLOB_HEADER = 64
BLOB_RECORD = 64
BLOB_ALIGN = 64
# Constants with fewer elements are written inline in model.mlmodel, not in weight.bin.
BLOB_MIN_ELEMENTS = 10

DTYPE_BITS = {"uint4": 4, "uint8": 8, "fp16": 16, "fp32": 32}


@dataclass(frozen=True)
class CoreMLArch:
    """The llama-family shape the exporter needs, read from config.json."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    attention_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scale: float
    norm_eps: float
    max_position: int


@dataclass(frozen=True)
class CoreMLConstant:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.shape) * DTYPE_BITS[self.dtype] / 8)

    @property
    def in_weight_file(self) -> bool:
        return math.prod(self.shape) >= BLOB_MIN_ELEMENTS


def _int(config: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError("missing or not a positive integer", file=source, field=key, expected="an integer ≥ 1")
    return value


def coreml_arch(config: dict[str, Any], source: str | Path = "config.json") -> CoreMLArch:
    """The architecture, or CoreMLUnsupportedError naming what the exporter cannot express."""
    src = str(source)
    model_type = str(config.get("model_type", ""))
    if model_type not in COREML_FAMILIES:
        raise CoreMLUnsupportedError(
            f"model type '{model_type}' has no Core ML exporter; supported: {', '.join(COREML_FAMILIES)}",
            file=src,
            field="model_type",
        )
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or config.get("use_sliding_window"):
        raise CoreMLUnsupportedError(
            "sliding-window layers are not exported (the Core ML cache is one full-context state per layer)",
            file=src,
            field="layer_types",
        )
    if model_type == "mistral" and config.get("sliding_window"):
        raise CoreMLUnsupportedError("sliding-window attention is not exported", file=src, field="sliding_window")
    scaling = config.get("rope_scaling")
    rope_scale = 1.0
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind == "linear":
            rope_scale = float(scaling["factor"])
        elif kind != "default":
            raise CoreMLUnsupportedError(
                f"RoPE scaling '{kind}' is not exported (only none or linear)", file=src, field="rope_scaling"
            )
    if config.get("rope_traditional"):
        raise CoreMLUnsupportedError("interleaved RoPE is not exported", file=src, field="rope_traditional")
    if model_type != "qwen2" and (config.get("attention_bias") or config.get("mlp_bias")):
        field = "attention_bias" if config.get("attention_bias") else "mlp_bias"
        raise CoreMLUnsupportedError("projection biases are only exported for qwen2", file=src, field=field)
    heads = _int(config, "num_attention_heads", src)
    hidden = _int(config, "hidden_size", src)
    kv_heads = _int(config, "num_key_value_heads", src, heads)
    head_dim = config.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ModelConfigError("not a multiple of num_key_value_heads", file=src, field="num_attention_heads")
    return CoreMLArch(
        model_type=model_type,
        layers=_int(config, "num_hidden_layers", src),
        hidden=hidden,
        intermediate=_int(config, "intermediate_size", src),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        vocab=_int(config, "vocab_size", src),
        tied=bool(config.get("tie_word_embeddings", True)),  # mlx-lm's default
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scale=rope_scale,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position=_int(config, "max_position_embeddings", src, 4096),
    )


Overrides = dict[str, tuple[int | None, int]]
"""Layer name -> (bits, group size) where a mixed recipe gave a layer its own (bits None: left in fp16)."""


def bundle_quantization(config: dict[str, Any], source: str | Path) -> tuple[int | None, int, Overrides]:
    """The bits, group size and per-layer overrides a packaged bundle's config.json records (mlx-lm's
    `quantization`: the defaults, and an object, or false for a layer left unquantized, under a layer's name)."""
    quant = config.get("quantization")
    if quant is None:
        return None, 64, {}
    if not isinstance(quant, dict) or not all(isinstance(quant.get(k), int) for k in ("bits", "group_size")):
        raise ModelConfigError(
            f"got {quant!r:.60}", file=source, field="quantization", expected="an object with bits, group_size"
        )
    overrides: Overrides = {}
    for name, own in quant.items():
        if own is False:
            overrides[name] = (None, int(quant["group_size"]))
        elif isinstance(own, dict):
            if not all(isinstance(own.get(k), int) for k in ("bits", "group_size")):
                raise ModelConfigError(
                    f"got {own!r:.60}", file=source, field=f"quantization.{name}", expected="bits and group_size"
                )
            check_bits(int(own["bits"]), source, f"quantization.{name}.bits")
            overrides[name] = (int(own["bits"]), int(own["group_size"]))
    return int(quant["bits"]), int(quant["group_size"]), overrides


def _layer_matrix(name: str, out_dim: int, in_dim: int, bits: int | None, group_size: int) -> list[CoreMLConstant]:
    # mlx-lm quantizes a Linear/Embedding only when its input dim divides into groups; the rest stay fp16.
    if bits is None or in_dim % group_size:
        return [CoreMLConstant(f"{name}.weight", "fp16", (out_dim, in_dim))]
    groups = (out_dim, in_dim // group_size)
    return [
        CoreMLConstant(f"{name}.weight", f"uint{bits}", (out_dim, in_dim)),
        CoreMLConstant(f"{name}.scales", "fp16", groups),
        CoreMLConstant(f"{name}.biases", "fp16", groups),
    ]


def coreml_constants(
    arch: CoreMLArch, bits: int | None, group_size: int, overrides: Overrides | None = None
) -> list[CoreMLConstant]:
    """Every weight constant of the program, in the order the program creates (and the file stores) them."""
    a = arch
    own = overrides or {}

    def _matrix(name: str, out_dim: int, in_dim: int, bits: int | None, group_size: int) -> list[CoreMLConstant]:
        return _layer_matrix(name, out_dim, in_dim, *own.get(name, (bits, group_size)))

    q_dim, kv_dim = a.heads * a.head_dim, a.kv_heads * a.head_dim
    out = _matrix("model.embed_tokens", a.vocab, a.hidden, bits, group_size)
    out.append(CoreMLConstant("rope.inv_freq", "fp32", (a.head_dim // 2,)))
    for i in range(a.layers):
        p = f"model.layers.{i}"
        out.append(CoreMLConstant(f"{p}.input_layernorm.weight", "fp16", (a.hidden,)))
        for proj, dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            out += _matrix(f"{p}.self_attn.{proj}", dim, a.hidden, bits, group_size)
            if a.attention_bias:
                out.append(CoreMLConstant(f"{p}.self_attn.{proj}.bias", "fp16", (dim,)))
        if a.qk_norm:
            out.append(CoreMLConstant(f"{p}.self_attn.q_norm.weight", "fp16", (a.head_dim,)))
            out.append(CoreMLConstant(f"{p}.self_attn.k_norm.weight", "fp16", (a.head_dim,)))
        out += _matrix(f"{p}.self_attn.o_proj", a.hidden, q_dim, bits, group_size)
        out.append(CoreMLConstant(f"{p}.post_attention_layernorm.weight", "fp16", (a.hidden,)))
        out += _matrix(f"{p}.mlp.gate_proj", a.intermediate, a.hidden, bits, group_size)
        out += _matrix(f"{p}.mlp.up_proj", a.intermediate, a.hidden, bits, group_size)
        out += _matrix(f"{p}.mlp.down_proj", a.hidden, a.intermediate, bits, group_size)
    out.append(CoreMLConstant("model.norm.weight", "fp16", (a.hidden,)))
    if not a.tied:
        out += _matrix("lm_head", a.vocab, a.hidden, bits, group_size)
    return out


def weight_file_bytes(constants: list[CoreMLConstant]) -> int:
    """Size of weight.bin for these constants in this order (the last one is not padded)."""
    end = BLOB_HEADER
    for c in (c for c in constants if c.in_weight_file):
        start = -(-end // BLOB_ALIGN) * BLOB_ALIGN
        end = start + BLOB_RECORD + c.nbytes
    return end


def state_bytes_per_token(arch: CoreMLArch) -> int:
    """Keys and values, fp16, every layer."""
    return 2 * arch.layers * arch.kv_heads * arch.head_dim * 2


def check_bits(bits: int | None, where: str | Path, field: str) -> None:
    if bits is not None and bits not in COREML_BITS:
        raise CoreMLUnsupportedError(
            f"{bits}-bit groups have no exact Core ML form (block-wise constexpr ops take "
            f"{' or '.join(map(str, COREML_BITS))}-bit integers); re-package with q4 or q8",
            file=where,
            field=field,
        )


class CoreMLPlan(StrictModel):
    backend: Literal["coreml"] = "coreml"
    model: str
    model_type: str
    bits: int | None = Field(description="4 or 8; null for an fp16 program")
    group_size: int
    own_layers: int = Field(default=0, description="layers a mixed recipe gave their own bits or group size")
    weights_bytes: int = Field(description="every weight constant's data at rest")
    weight_file_bytes: int = Field(description="size of Data/com.apple.CoreML/weights/weight.bin")
    weights_by_dtype: dict[str, int]
    constants: int
    state_bytes_per_token: int
    state_bytes: dict[int, int] = Field(description="context -> key+value state bytes")
    total_bytes: dict[int, int] = Field(description="context -> weights + state")
    max_position_embeddings: int
    device: str | None = None
    limit_kind: Literal["entitled", "default"] = Field(
        default="entitled", description="the limit asked for: with the increased-memory-limit entitlement or without"
    )
    limit_bytes: int | None = Field(
        default=None,
        description="the device's app memory limit of that kind (the default one where no entitled one is known)",
    )


def plan_coreml(
    config: dict[str, Any],
    source: str | Path,
    *,
    bits: int | None,
    group_size: int,
    contexts: list[int],
    overrides: Overrides | None = None,
) -> CoreMLPlan:
    """The Core ML program's bytes for a model config, quantized with `bits` in groups of `group_size` (and the
    layers in `overrides` with their own)."""
    arch = coreml_arch(config, source)
    check_bits(bits, source, "bits")
    constants = coreml_constants(arch, bits, group_size, overrides)
    by_dtype: dict[str, int] = {}
    for c in constants:
        by_dtype[c.dtype] = by_dtype.get(c.dtype, 0) + c.nbytes
    weights = sum(c.nbytes for c in constants)
    per_token = state_bytes_per_token(arch)
    return CoreMLPlan(
        model=str(source),
        model_type=arch.model_type,
        bits=bits,
        group_size=group_size,
        own_layers=sum(1 for own in (overrides or {}).values() if own != (bits, group_size)),
        weights_bytes=weights,
        weight_file_bytes=weight_file_bytes(constants),
        weights_by_dtype=by_dtype,
        constants=len(constants),
        state_bytes_per_token=per_token,
        state_bytes={c: per_token * c for c in contexts},
        total_bytes={c: weights + per_token * c for c in contexts},
        max_position_embeddings=arch.max_position,
    )


def plan_coreml_model(
    model: str | Path | None,
    device: str | Path,
    *,
    weights: str,
    group_size: int,
    contexts: list[int],
    limit: Literal["entitled", "default"] = "entitled",
) -> CoreMLPlan:
    """`kvrig plan --backend coreml`: the program `kvrig export coreml` writes for MODEL packaged with
    `weights` (q4, q8 or fp16), beside the device's app memory limit of kind `limit`. A bundle (a config.json
    that records its quantization) is planned as it is quantized, layer by layer, as the export writes it:
    `weights` must then be `auto`."""
    config, path = read_config(model if model is not None else default_model_path())
    profile = load_profile(device)
    if config.get("quantization") is not None:
        if weights != "auto":
            raise CoreMLUnsupportedError(
                f"{path} is quantized already (a bundle), and its program is planned as it is quantized: "
                f"leave --weights at auto, or plan the model it was packaged from",
                field="weights",
            )
        bits, group_size, overrides = bundle_quantization(config, path)
        result = plan_coreml(config, path, bits=bits, group_size=group_size, contexts=contexts, overrides=overrides)
    else:
        # Core ML has exact forms of q4, q8 and fp16 only: auto counts q4 there (gpx-q4's bytes)
        recipe = parse_weights("q4" if weights == "auto" else weights, group_size)
        if recipe.mixed or (not recipe.quantized and recipe.name != "fp16"):
            raise CoreMLUnsupportedError(
                f"weight recipe '{recipe.name}' has no exact Core ML form (use q4, q8 or fp16)", field="weights"
            )
        result = plan_coreml(config, path, bits=recipe.bits, group_size=group_size, contexts=contexts)
    limit_bytes = (profile.limit_entitled if limit == "entitled" else None) or profile.limit_default
    return result.model_copy(update={"device": profile.name, "limit_kind": limit, "limit_bytes": limit_bytes})
