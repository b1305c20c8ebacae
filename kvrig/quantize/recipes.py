"""Applying a weight recipe (recipes.py) to a float model: round-to-nearest (`base.quantize`), kvrig's
importance-weighted grids with or without error feedback (imx, gpx), and mlx-lm's own calibrated quantizers
(mlx_lm.quant: AWQ, GPTQ, sensitivity-driven dynamic mixed bits) fed a local calibration text instead of the
file their command lines download.

AWQ and GPTQ keep the layout of the uniform recipe (every linear and the embedding at the same bits and
group size, fp16 scales), so the planner's bytes for `q4` stay exact; only the chosen values differ."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.quantize.base import quantize
from kvrig.quantize.gpx import DAMPING, EMBEDDING_DAMPING, fit_feedback, input_hessians
from kvrig.quantize.imx import activation_importance, fit_affine, mlp_g32_layout
from kvrig.recipes import WeightRecipe, parse_weights
from kvrig.texts import CALIBRATION_KINDS, kind_tokens, read_kind


def calibration_tokens(tokenizer: Any, *, samples: int = 16, length: int = 256) -> Any:
    """`samples` rows of `length` consecutive tokens, the calibration kinds taken in turn (legal text, quotations
    and dialogue, C source; texts.py), each kind's rows in order: the same rows on every run, and no kind of text
    the quality bench evaluates on."""
    import mlx.core as mx

    per_kind = -(-samples // len(CALIBRATION_KINDS))
    streams = {k: kind_tokens(tokenizer, k, per_kind * length) for k in CALIBRATION_KINDS}
    rows = []
    for i in range(samples):
        k, r = CALIBRATION_KINDS[i % len(CALIBRATION_KINDS)], i // len(CALIBRATION_KINDS)
        rows.append(streams[k][r * length : (r + 1) * length])
    return mx.array(rows)


def calibration_files() -> dict[str, list[str]]:
    """Calibration kind -> the files `calibration_tokens` reads."""
    return {k: read_kind(k)[1] for k in CALIBRATION_KINDS}


def apply_recipe(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any = None
) -> tuple[Any, dict[str, Any]]:
    """Quantizes `model` (float weights, loaded by `load_source_model`) as the recipe says; returns the model
    and its config with an explicit `quantization` block. Calibrated methods need `calibration` tokens."""

    if not recipe.calibrated:
        return quantize(model, config, recipe)
    if calibration is None:
        raise QuantizationError(f"recipe {recipe.name} needs calibration tokens")
    import mlx.core as mx

    # Calibrate in float32 (float16 arithmetic is emulated on x86 CPUs), store scales as the source dtype.
    model, config = quantize(model, config, parse_weights("fp16"))
    dtype = getattr(mx, str(config.get("torch_dtype") or "float16"), mx.float16)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    with contextlib.redirect_stdout(sys.stderr), contextlib.redirect_stderr(sys.stderr):
        if recipe.method == "gptq":
            model, config = _gptq(model, config, recipe, calibration)
        elif recipe.method == "awq":
            model, config = _awq(model, config, recipe, calibration)
        elif recipe.method in ("imx", "gpx"):
            model, config = _imx(model, config, recipe, calibration, dtype)
        else:
            model, config = _dynamic(model, config, recipe, calibration)
    model.set_dtype(dtype)  # floating parameters only: packed weights stay uint32
    mx.eval(model.parameters())
    return model, config


def _gptq(model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any) -> tuple[Any, dict[str, Any]]:
    from mlx_lm.quant.gptq import gptq_quantize

    bits = recipe.bits
    assert bits is not None
    model, quant = gptq_quantize(model, calibration, bits, recipe.group_size, bits, recipe.group_size, batch_size=4)
    config = dict(config)
    config["quantization"] = quant
    config["quantization_config"] = quant
    return model, config


def _imx(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any, dtype: Any
) -> tuple[Any, dict[str, Any]]:
    feedback = recipe.method == "gpx"
    if recipe.target_bpw is None:
        assert recipe.bits is not None
        return quantize_weighted(
            model, config, recipe.bits, calibration, group_size=recipe.group_size, dtype=dtype, feedback=feedback
        )
    return quantize_weighted(
        model, config, 4, calibration, target_bpw=recipe.target_bpw, dtype=dtype, feedback=feedback
    )


def _awq(model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any) -> tuple[Any, dict[str, Any]]:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    model_type = str(config.get("model_type"))
    awq_config = AWQ_MODEL_CONFIGS.get(model_type)
    if awq_config is None:
        raise QuantizationError(
            f"mlx-lm's AWQ has no layer map for {model_type}; supported: {', '.join(sorted(AWQ_MODEL_CONFIGS))}"
        )
    bits = recipe.bits
    assert bits is not None
    awq_quantize(
        model,
        calibration,
        awq_config,
        group_size=recipe.group_size,
        bits=bits,
        embed_group_size=recipe.group_size,
        embed_bits=bits,
        n_grid=10,
    )
    config = update_config(model, dict(config))
    config["quantization"]["bits"] = bits
    config["quantization"]["group_size"] = recipe.group_size
    config["quantization_config"] = config["quantization"]
    return model, config


def _dynamic(model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's sensitivity estimate (gradient of the KL to the float model), then the threshold that meets the
    target bits per weight: 4-bit g64 layers, the most sensitive ones at 6-bit g64."""
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model

    assert recipe.target_bpw is not None
    low, high = (4, 64), (6, 64)
    sens = dict(estimate_sensitivities(model, calibration, *low, *high, batch_size=4))
    threshold = estimate_threshold(model, sens, recipe.target_bpw, *low, *high)

    def predicate(path: str, module: Any) -> Any:
        if not hasattr(module, "to_quantized"):
            return False
        return {"bits": high[0], "group_size": high[1]} if sens.get(path, 0.0) > threshold else True

    model, config = quantize_model(model, dict(config), low[1], low[0], quant_predicate=predicate)  # type: ignore[arg-type]
    config["quantization_config"] = config["quantization"]
    return model, config


def quantize_weighted(
    model: Any,
    config: dict[str, Any],
    bits: int,
    calibration: Any,
    *,
    group_size: int = 64,
    target_bpw: float | None = None,
    dtype: Any = None,
    feedback: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Any, dict[str, Any]]:
    """Quantizes a float model with mlx-lm's `quantize_model` (its layout and config block: `group_size`
    everywhere, or the mixed layout for `target_bpw`), then refits every layer's grid with `fit_affine` and
    the activation importance of the float model on `calibration`. With `feedback`, every layer is quantized
    with GPTQ-style error feedback instead (`feedback.fit_feedback`, the float model's input Hessians); a tied
    embedding with heavy damping (its rows are also looked up, where error moved onto other columns hurts)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import quantize_model

    dtype = dtype or mx.float16
    if feedback:
        hessians = input_hessians(model, calibration)
        importance = {p: None if h is None else mx.diagonal(h) for p, h in hessians.items()}
    else:
        hessians, importance = {}, activation_importance(model, calibration)
    floats = {p: m.weight for p, m in model.named_modules() if hasattr(m, "to_quantized") and "weight" in m}
    scale_bytes = mx.zeros((), dtype=dtype).itemsize
    layout = (
        mlp_g32_layout(model, target_bpw, bits, scale_bytes)
        if target_bpw is not None
        else dict.fromkeys(floats, group_size)
    )

    def predicate(path: str, module: Any) -> Any:
        if path not in layout:
            return False
        return {"bits": bits, "group_size": layout[path]}

    model, config = quantize_model(model, dict(config), group_size, bits, quant_predicate=predicate)  # type: ignore[arg-type]
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding) and path in floats:
            progress(path)
            if feedback and hessians.get(path) is not None:
                damping = EMBEDDING_DAMPING if isinstance(module, nn.QuantizedEmbedding) else DAMPING
                q = fit_feedback(floats[path], hessians[path], module.group_size, module.bits, dtype, damping)
            else:
                q = fit_affine(floats[path], module.group_size, module.bits, importance.get(path), dtype)
            module.weight, module.scales, module.biases = q
            mx.eval(module.parameters())
    config["quantization_config"] = config["quantization"]
    return model, config
