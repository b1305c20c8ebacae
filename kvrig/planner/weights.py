"""Weight bytes per quantization recipe: mlx-lm's own `quantize_model` run on the lazily built model.

MLX arrays are not allocated until evaluated, so even a large config costs only its graph, and the bytes
are MLX's `nbytes` of the quantized parameters: mlx-lm's predicates, mixed recipes and packing, not a copy.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.models.spec import ModelSpec

MIXED_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
DEFAULT_RECIPES = ("q4", "q8", "mixed_4_6")
_Q_RE = re.compile(r"^q(\d)$")


GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightRecipe:
    """`q4`, `q8` (uniform bits), mlx-lm's `mixed_X_Y`, or `fp16`/`bf16` (not quantized). For mixed recipes
    `bits` is the low width most weights get."""

    name: str
    bits: int | None
    group_size: int

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def mixed(self) -> str | None:
        """mlx-lm's mixed recipe name, or None for a uniform recipe."""
        return self.name if self.name in MIXED_RECIPES else None


def parse_recipe(text: str, group_size: int = 64) -> WeightRecipe:
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"group size {group_size} is not supported by MLX; choose one of {GROUP_SIZES}")
    name = text.strip().lower()
    if name in ("fp16", "bf16", "fp32"):
        return WeightRecipe(name, None, group_size)
    if name in MIXED_RECIPES:
        low = int(name.split("_")[1])
        return WeightRecipe(name, low, group_size)
    m = _Q_RE.match(name)
    if m and int(m.group(1)) in (2, 3, 4, 5, 6, 8):
        return WeightRecipe(name, int(m.group(1)), group_size)
    raise QuantizationError(
        f"unknown weight recipe '{text}': expected q2, q3, q4, q5, q6, q8, {', '.join(MIXED_RECIPES)} or fp16"
    )


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

    model = spec.weights_model(dtype)
    if recipe.bits is None:
        return model
    predicate = mixed_quant_predicate_builder(recipe.name, model, recipe.group_size) if recipe.mixed else None
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
