"""Weight quantization recipes, applied with mlx-lm (group size always explicit in the written config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrig.exceptions import ModelConfigError, QuantizationError, UnsupportedArchitectureError
from kvrig.planner.layout import quantize_layout
from kvrig.recipes import WeightRecipe


def load_source_model(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """Builds the mlx-lm model for a Hugging Face-layout directory (lazily: weights are read on use)."""
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(model_dir, lazy=True)
    except FileNotFoundError as exc:
        raise ModelConfigError(f"cannot load the model: {exc}", file=model_dir) from None
    except ValueError as exc:
        # mlx-lm raises ValueError from the ImportError of a model type it has no module for
        if isinstance(exc.__cause__, ImportError):
            arch = _read_model_type(model_dir)
            raise UnsupportedArchitectureError(arch, _mlx_lm_architectures(), file=model_dir / "config.json") from None
        raise ModelConfigError(f"cannot build the model: {exc}", file=model_dir / "config.json") from None
    except (TypeError, KeyError) as exc:  # the model's args built from a config that lacks or mistypes a field
        raise ModelConfigError(f"cannot build the model: {exc!r}", file=model_dir / "config.json") from None
    return model, config


def quantize(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, *, work_dtype: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Casts floats to the model's dtype (or `work_dtype`, for a caller that casts afterwards: the layout is
    the model's dtype's) and quantizes linear/embedding layers round-to-nearest as the recipe's layout says
    (qN, mixed_X_Y, fp16; calibrated recipes go through `quantize.recipes.apply_recipe`). Returns the model and
    the config with an explicit `quantization` block."""
    if recipe.calibrated:
        raise QuantizationError(f"recipe {recipe} needs calibration: apply it with quantize.recipes.apply_recipe")
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import dequantize_model

    config = dict(config)
    if "quantization" in config or "quantization_config" in config:
        # Already-quantized source: start from its dequantized weights so the recipe applies cleanly.
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        model = dequantize_model(model)

    dtype_name = config.get("torch_dtype") or "float16"
    if dtype_name not in ("float16", "bfloat16", "float32"):
        dtype_name = "float16"
    dtype = getattr(mx, dtype_name)
    work = getattr(mx, work_dtype) if work_dtype else dtype
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, v: Any) -> Any:
        return v.astype(work) if cast_predicate(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))
    if not recipe.quantized:
        return model, config

    # The planner's layout (planner/layout.py): mlx-lm's quantize_model with its own or its mixed predicate.
    model, config = quantize_layout(model, config, recipe, dtype.size)
    quant = config["quantization"]
    # Never leave the group size implicit (the Swift loader has no default to fall back on).
    quant["group_size"] = recipe.group_size
    quant["bits"] = recipe.bits
    config["quantization_config"] = quant
    return model, config


def _read_model_type(model_dir: Path) -> str:
    import json

    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type", "?"))
    except (OSError, ValueError):
        return "?"


def _mlx_lm_architectures() -> list[str]:
    import pkgutil

    import mlx_lm.models

    return [m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if not m.name.startswith("_")]
