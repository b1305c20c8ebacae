"""Weight bytes per quantization recipe: mlx-lm's own `quantize_model` run on the lazily built model.

MLX arrays are not allocated until evaluated, so even a large config costs only its graph, and the bytes
are MLX's `nbytes` of the quantized parameters: mlx-lm's predicates, mixed recipes and packing, not a copy.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.models.spec import ModelSpec
from kvrig.recipes import WeightRecipe

DEFAULT_RECIPES = ("q4", "q8", "mixed_4_6")


def planned_layout(recipe: WeightRecipe) -> WeightRecipe:
    """The round-to-nearest recipe whose arrays a recipe's bytes are (awq-q4, gptq-q4, gpx-q4 → q4): the one
    the planner quantizes lazily. A target-bits-per-weight recipe picks its layout from the model's weights and
    has none to plan from."""
    layout = recipe.layout
    if layout is None:
        raise QuantizationError(
            f"recipe {recipe}: its layout (which layers get group 32) is chosen on the model's own weights; "
            "plan its bytes from a packaged bundle"
        )
    return layout


@dataclass
class WeightsAccount:
    total_bytes: int
    parameters: int
    """parameter count of the unquantized model."""
    quantized_parameters: int
    """parameters stored quantized."""
    active_bytes: int
    """bytes read per generated token: all weights but only the routed share of MoE experts."""
    largest_array: int = 0
    """the largest single parameter array (one Metal buffer: the embedding table, a stacked expert weight)."""


def _routed_fraction(config: dict[str, Any]) -> float:
    cfg = config.get("text_config", config)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    active = cfg.get("num_experts_per_tok")
    if experts and active:
        return float(active) / float(experts)
    return 1.0


def quantize_lazily(spec: ModelSpec, recipe: WeightRecipe, dtype: str = "float16") -> Any:
    """The lazily built model cast and quantized exactly as mlx-lm's convert does it (its `quantize_model`,
    its own predicates and mixed recipes); nothing is evaluated."""
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model

    recipe = planned_layout(recipe)
    model = spec.weights_model(dtype)
    if recipe.bits is None:
        return model
    predicate = mixed_quant_predicate_builder(recipe.mixed, model, recipe.group_size) if recipe.mixed else None
    config = {k: v for k, v in spec.config.items() if k not in ("quantization", "quantization_config")}
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        try:
            quantize_model(model, config, recipe.group_size, recipe.bits, quant_predicate=predicate)  # type: ignore[arg-type]
        except ValueError as exc:
            raise QuantizationError(f"mlx-lm cannot quantize {spec.model_type} with {recipe.name}: {exc}") from None
    return model


def account_weights(spec: ModelSpec, recipe: WeightRecipe, dtype: str = "float16") -> WeightsAccount:
    """Exact bytes of the model's parameters after mlx-lm's own cast and quantization: MLX's `nbytes`."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    params = spec.parameter_count()
    model = quantize_lazily(spec, recipe, dtype)
    routed = _routed_fraction(spec.config)
    total = active = qparams = largest = 0
    # One walk over the modules: each one's own arrays (not its children's), its kind and its bits.
    for _, module in model.named_modules():
        expert = "Switch" in type(module).__name__
        bits = getattr(module, "bits", None) if "scales" in module else None
        for name, value in module.items():
            if name.startswith("_") or isinstance(value, nn.Module):
                continue
            flat: list[tuple[str, Any]] = tree_flatten(value, is_leaf=nn.Module.is_module)  # type: ignore[assignment]
            arrays = [value] if isinstance(value, mx.array) else [v for _, v in flat]
            for p in arrays:
                if not isinstance(p, mx.array):
                    continue
                b = p.nbytes
                largest = max(largest, b)
                total += b
                active += int(b * routed) if expert else b
                if bits and name == "weight":
                    qparams += p.size * 32 // int(bits)
    return WeightsAccount(total, params, qparams, active, largest)
