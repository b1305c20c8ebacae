"""Weight bytes per quantization recipe, from the parameter shapes of the real mlx-lm model.

The model is built lazily (MLX arrays are not allocated until evaluated), so even a large config costs
only its graph. Which modules get quantized follows mlx-lm's `quantize_model` (and its mixed recipes); the
bytes are counted from shapes: packed uint32 data plus one scale and one bias per group in the weight dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolchain.exceptions import QuantizationError
from toolchain.models.lazy import build_lazy_model
from toolchain.models.spec import DTYPE_BYTES

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


def _predicate(recipe: WeightRecipe, model: Any) -> Callable[[str, Any], dict[str, int] | None]:
    """Per-module quantization decision, as mlx-lm's quantize_model wraps it."""
    group = recipe.group_size
    custom = None
    if recipe.name in MIXED_RECIPES:
        from mlx_lm.convert import mixed_quant_predicate_builder

        custom = mixed_quant_predicate_builder(recipe.name, model, group)
    else:
        custom = getattr(model, "quant_predicate", None)

    def decide(path: str, module: Any) -> dict[str, int] | None:
        if recipe.bits is None or not hasattr(module, "to_quantized"):
            return None
        if module.weight.shape[-1] % group != 0:
            return None
        choice: Any = True if custom is None else custom(path, module)  # type: ignore[call-arg]
        if choice is False:
            return None
        if isinstance(choice, dict):
            return {"bits": choice.get("bits", recipe.bits), "group_size": choice.get("group_size", group)}
        return {"bits": recipe.bits, "group_size": group}

    return decide


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _routed_fraction(config: dict[str, Any]) -> float:
    cfg = config.get("text_config", config)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    active = cfg.get("num_experts_per_tok")
    if experts and active:
        return float(active) / float(experts)
    return 1.0


def account_weights(
    config: dict[str, Any], recipe: WeightRecipe, dtype: str = "float16", model: Any = None
) -> WeightsAccount:
    """Exact bytes of the model's parameters after casting to `dtype` and quantizing with `recipe`."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = model if model is not None else build_lazy_model(config)
    decide = _predicate(recipe, model)
    cast = getattr(model, "cast_predicate", lambda _: True)
    width = DTYPE_BYTES[dtype]
    routed = _routed_fraction(config)

    # Parameters can sit on non-leaf modules too (gpt-oss attention sinks), so walk all parameters and look
    # up the leaf module that owns each one.
    quantized: dict[str, dict[str, int]] = {}
    experts: set[str] = set()
    leaves: list[tuple[str, Any]] = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)  # type: ignore[assignment]
    for path, module in leaves:
        q = decide(path, module)
        if q is not None:
            quantized[path] = q
        if "Switch" in type(module).__name__:
            experts.add(path)

    total = active = params = qparams = 0
    floats = _mx_floats()
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for full, p in flat:
        owner, _, name = full.rpartition(".")
        n = p.size
        params += n
        q = quantized.get(owner)
        if q is not None and name == "weight":
            *lead, cols = p.shape
            if (cols * q["bits"]) % 32:
                raise QuantizationError(f"{full}: {cols} columns cannot pack {q['bits']}-bit values into uint32")
            rows = _size(tuple(lead))
            b = rows * (cols * q["bits"] // 32) * 4 + 2 * rows * (cols // q["group_size"]) * width
            qparams += n
        elif cast(full) and p.dtype in floats:
            b = n * width
        else:
            b = p.nbytes
        total += b
        active += int(b * routed) if owner in experts else b
    return WeightsAccount(total, params, qparams, active)


def _mx_floats() -> tuple[Any, ...]:
    import mlx.core as mx

    return (mx.float32, mx.float16, mx.bfloat16)
