"""Which arrays a weight recipe writes: its layout (which layers are quantized, at which bits and group size),
as mlx-lm's `quantize_model` lays it out. One rule for the plan and the quantizers: the planner counts the
bytes of this layout on the lazily built model, and `kvrig.quantize` writes this layout (its calibrated
methods only choose the values), so a plan's bytes are the packaged bytes.

    qN[gG], and awq-/gptq-/imx-/gpx-qN[gG]   mlx-lm's default layout (the model's own quant_predicate)
    mixed_X_Y                               mlx-lm's mixed predicate
    imx-BPW | gpx-BPW                       from 4.5: 4 bits everywhere; attention key/value projections, then
                                            MLP down/up projections of the last layers, at group 32 until the
                                            target; below 4.5: 3 bits, and 4 bits for the embedding and head,
                                            then those same projections; layers of other names last, from the
                                            last block (`target_layout`)
    dq-BPW                                  none before quantizing: mlx-lm's sensitivity measurement picks it
    R+kd[N]                                 R's (the distillation trains scales, biases and norms only)

The rule only needs module shapes, so it runs on a lazily built model (nothing evaluated).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.recipes import TARGET_BITS, WeightRecipe

Predicate = Callable[[str, Any], bool | dict[str, Any]]
"""What mlx-lm's quantize_model takes as quant_predicate: per layer, False, True or to_quantized's params."""

_NUMBERED = re.compile(r"(?:^|\.)(\d+)\.")  # a numbered block: layers.3., h.3.
_LAYER_PROJECTION = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def unplannable_reason(recipe: WeightRecipe) -> str | None:
    """Why the recipe has no layout before it is applied to the weights (None: it has one)."""
    if recipe.method == "dq":
        return (
            "mlx-lm's dynamic quantization picks which layers get 6 bits from a sensitivity measurement (gradients "
            "of the float model on calibration text, the cost of quantizing the model itself), so its bytes exist "
            f"only once the weights are quantized: package it (kvrig package --weights {recipe.name}) and read the "
            "bundle's"
        )
    return None


def awq_unavailable_reason(model_type: str) -> str | None:
    """Why mlx-lm's AWQ cannot quantize this architecture (None: it has a layer map for it)."""
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS

    if model_type in AWQ_MODEL_CONFIGS:
        return None
    return f"mlx-lm's AWQ has no layer map for {model_type}; it has one for {', '.join(sorted(AWQ_MODEL_CONFIGS))}"


def unavailable_reason(recipe: WeightRecipe, model_type: str) -> str | None:
    """Why a recipe cannot be planned for an architecture before anything is quantized (None: it can; what
    mlx-lm's quantize_model refuses on the model itself surfaces in `quantize_layout`)."""
    if recipe.method == "awq":
        return awq_unavailable_reason(model_type)
    return unplannable_reason(recipe)


def target_layout(model: Any, target_bpw: float, bits: int, scale_bytes: int) -> dict[str, tuple[int, int]]:
    """(bits, group size) by quantizable path for a target bits per weight: `bits` at group 64 everywhere, then
    layers upgraded one at a time, in a fixed order, while the model's bits per weight (as mlx-lm's
    compute_bits_per_weight counts them: every array's bytes over the parameter count) stays within
    `target_bpw`. A 4-bit base upgrades to group 32: the key/value projections of every layer, then the MLP
    down/up projections from the last layer backwards. A 3-bit base upgrades to 4 bits at group 64: the
    embedding and output head, the key/value projections, then from the last layer backwards the MLP down
    projections, the attention outputs, the MLP up and gate projections and the attention queries. Every layer
    not in that order (other architectures' names, experts; from 4 bits, the other projections too) comes last,
    block by block from the last."""
    from mlx.utils import tree_flatten

    quantizable = {p: m for p, m in model.named_modules() if hasattr(m, "to_quantized") and "weight" in m}
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    params = sum(v.size for _, v in flat)
    q_size = {p: m.weight.size for p, m in quantizable.items()}
    # Everything not quantized (norms, biases) is stored in the scales' float dtype.
    other_bits = 8 * scale_bytes * (params - sum(q_size.values()))

    def cost(grid: tuple[int, int]) -> float:
        return grid[0] + 16 * scale_bytes / grid[1]

    base = (bits, 64)
    layout = dict.fromkeys(quantizable, base)
    total = other_bits + cost(base) * sum(q_size.values())
    if total / params > target_bpw:
        raise QuantizationError(f"{bits}-bit group-64 weights alone exceed {target_bpw} bits per weight")
    upgrade = (bits, 32) if bits >= TARGET_BITS else (TARGET_BITS, 64)
    kv = _by_layer(quantizable, ("k_proj", "v_proj"), from_last=False)
    # Per bit spent, group 32 bought the most on the small k/v projections, then on the MLP's down and up
    # projections of the last layers (SmolLM2 gpx-4.6, perplexity on texts neither calibrated nor evaluated on).
    # From 3 bits: taking one kind of layer of gpx-q4 down to 3 bits cost the most per bit saved on v, the tied
    # embedding (also the output head) and down, then o, k and up, then gate and q; at 4.0 bits per weight this
    # order beat the MLP's down/up of the last layers in turn (SmolLM2, the same texts).
    if bits >= TARGET_BITS:
        order = kv + _by_layer(quantizable, ("down_proj", "up_proj"))
    else:
        later = ("down_proj",), ("o_proj",), ("up_proj",), ("gate_proj",), ("q_proj",)
        order = _heads(quantizable) + kv + [p for projections in later for p in _by_layer(quantizable, projections)]
    # Layers the order above does not reach (gpt2's c_attn/c_fc, a MoE's experts), so that any architecture's
    # target is spent: block by block from the last, then what is outside the blocks.
    named = set(order)
    order += sorted((p for p in quantizable if p not in named), key=_from_the_last_block)
    for path in order:
        extra = (cost(upgrade) - cost(base)) * q_size[path]
        if (total + extra) / params > target_bpw:
            break
        layout[path] = upgrade
        total += extra
    return layout


def _by_layer(quantizable: dict[str, Any], projections: tuple[str, ...], *, from_last: bool = True) -> list[str]:
    """The layers' `projections` (attention's or the MLP's) layer by layer, from the last layer backwards or from
    the first, within a layer in the order named."""
    sign = -1 if from_last else 1
    found = [
        (sign * int(m.group(1)), projections.index(m.group(2)), p)
        for p in quantizable
        if (m := _LAYER_PROJECTION.search(p)) and m.group(2) in projections
    ]
    return [p for *_, p in sorted(found)]


def _from_the_last_block(path: str) -> tuple[int, int]:
    """Sorts numbered blocks from the last backwards, and paths outside them after every block."""
    numbers = _NUMBERED.findall(path)
    return (0, -int(numbers[0])) if numbers else (1, 0)


def _heads(quantizable: dict[str, Any]) -> list[str]:
    """The token embedding (the widest one: a position embedding is another) and any linear layer outside the
    numbered blocks that maps onto its vocabulary (an untied output head, whatever the architecture calls it)."""
    import mlx.nn as nn

    embeddings = {p: m.weight.shape[0] for p, m in quantizable.items() if isinstance(m, nn.Embedding)}
    if not embeddings:
        return []
    vocabulary = max(embeddings.values())
    outside = [p for p, m in quantizable.items() if not _NUMBERED.search(p) and m.weight.shape[0] == vocabulary]
    return [p for p in embeddings if embeddings[p] == vocabulary] + [p for p in outside if p not in embeddings]


def layout_predicate(model: Any, recipe: WeightRecipe, scale_bytes: int) -> Predicate | None:
    """The quant_predicate that gives `model` the recipe's layout in mlx-lm's quantize_model (None: its
    default, which follows the model's own quant_predicate). `scale_bytes`: the bytes of one scale (the
    float dtype the quantized model keeps), which a target bits per weight counts."""
    if (reason := unplannable_reason(recipe)) is not None:
        raise QuantizationError(reason)
    if recipe.mixed is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        try:
            return mixed_quant_predicate_builder(recipe.mixed, model, recipe.group_size)  # type: ignore[return-value]
        except (ValueError, AttributeError) as exc:  # no down_proj / no `layers` to count: mlx-lm's own refusal
            raise QuantizationError(f"mlx-lm's {recipe.mixed} cannot lay out this model: {exc}") from None
    if recipe.target_bpw is None:
        return None
    assert recipe.bits is not None
    grids = target_layout(model, recipe.target_bpw, recipe.bits, scale_bytes)

    # Every layer on its grid, as the target was counted: the model's own quant_predicate (a router gate at 8
    # bits) would spend bits the count did not see.
    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        return {"bits": grids[path][0], "group_size": grids[path][1]} if path in grids else False

    return predicate


def quantize_layout(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, scale_bytes: int
) -> tuple[Any, dict[str, Any]]:
    """`model` quantized in place round-to-nearest with the recipe's layout by mlx-lm's quantize_model; returns
    the model and mlx-lm's config (its `quantization` block). Arrays stay lazy until evaluated. What mlx-lm
    cannot do for this model is a QuantizationError with mlx-lm's reason."""
    from mlx_lm.utils import quantize_model

    if recipe.bits is None:
        raise QuantizationError(f"recipe {recipe} is not quantized")
    predicate = layout_predicate(model, recipe, scale_bytes)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        try:
            model, config = quantize_model(model, config, recipe.group_size, recipe.bits, quant_predicate=predicate)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            # mlx-lm's own layers refusing its own quantization (a width the group does not divide, a module
            # whose to_quantized takes other arguments): the architecture cannot take the recipe.
            raise QuantizationError(f"mlx-lm cannot quantize this model with {recipe.name}: {exc}") from None
    if not quantized_layout(model):
        # mlx-lm skips every layer whose input width the group does not divide, silently: a "q2g128" SmolLM2
        # (width 576) would be float16 weights under a quantization block.
        widths = sorted({int(m.weight.shape[-1]) for _, m in model.named_modules() if hasattr(m, "to_quantized")})
        raise QuantizationError(
            f"{recipe.name} quantizes no layer of this model: group size {recipe.group_size} divides none of its "
            f"layers' input widths ({', '.join(map(str, widths[:6]))})"
        )
    return model, config


def quantized_layout(model: Any) -> dict[str, dict[str, Any]]:
    """path -> to_quantized params (bits, group_size, and mode where not affine) of every quantized module."""
    out: dict[str, dict[str, Any]] = {}
    for path, module in model.named_modules():
        if "scales" in module and hasattr(module, "bits"):
            params = {"bits": module.bits, "group_size": module.group_size}
            if getattr(module, "mode", "affine") != "affine":
                params["mode"] = module.mode
            out[path] = params
    return out


def recipe_layout(model: Any, recipe: WeightRecipe, scale_bytes: int) -> dict[str, dict[str, Any]]:
    """The recipe's layout on `model` (path -> to_quantized params), read off mlx-lm's quantize_model run on a
    copy of the model's modules: the arrays are shared and the quantized ones never computed."""
    from kvrig.models.lazy import copy_modules

    quantized, _ = quantize_layout(copy_modules(model), {}, recipe, scale_bytes)
    return quantized_layout(quantized)
