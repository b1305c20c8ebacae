"""Weight bytes per quantization recipe: mlx-lm's own `quantize_model` run on the lazily built model.

MLX arrays are not allocated until evaluated, so even a large config costs only its graph, and the bytes
are MLX's `nbytes` of the quantized parameters: mlx-lm's predicates, mixed recipes and packing, not a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.models.spec import ModelSpec
from kvrig.planner.layout import quantize_layout, unavailable_reason
from kvrig.recipes import WeightRecipe

DEFAULT_RECIPES = ("q4", "q8", "mixed_4_6")


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
    """The lazily built model cast to `dtype` and quantized by mlx-lm's own `quantize_model` with the recipe's
    layout (layout.py: the one the quantizers write); nothing is evaluated. A recipe the architecture cannot
    take is a QuantizationError whose message is the reason."""
    model = spec.weights_model(dtype)
    if recipe.bits is None:
        return model
    import mlx.core as mx

    if (reason := unavailable_reason(recipe, str(spec.config.get("model_type")))) is not None:
        raise QuantizationError(reason)
    quantized, _ = quantize_layout(model, spec.config, recipe, getattr(mx, dtype).size)
    return quantized


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
