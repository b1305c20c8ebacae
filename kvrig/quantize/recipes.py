"""Applying a weight recipe (recipes.py) to a float model: round-to-nearest (`base.quantize`), kvrig's
importance-weighted grids with or without error feedback (imx, gpx), and mlx-lm's own calibrated quantizers
(mlx_lm.quant: AWQ, GPTQ, sensitivity-driven dynamic mixed bits) fed a local calibration text instead of the
file their command lines download.

AWQ and GPTQ keep the layout of the uniform recipe (every linear and the embedding at the same bits and
group size, fp16 scales), so the planner's bytes for `q4` stay exact; only the chosen values differ."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrig.exceptions import QuantizationError
from kvrig.planner.layout import awq_unavailable_reason, quantize_layout, quantized_layout, recipe_layout
from kvrig.quantize.base import quantize
from kvrig.quantize.distill import BATCH_ROWS as DISTILL_BATCH_ROWS
from kvrig.quantize.distill import distill
from kvrig.quantize.gpx import DAMPING, EMBEDDING_DAMPING, fit_feedback, input_hessians
from kvrig.quantize.imx import activation_importance, fit_affine
from kvrig.recipes import WeightRecipe, parse_weights
from kvrig.texts import CALIBRATION_KINDS, kind_tokens, read_kind

CALIBRATION_ROWS = 8
"""Rows of `calibration_tokens` the quantizers measure on (the first rows of a longer call are these)."""


def calibration_rows(recipe: WeightRecipe) -> int:
    """How many calibration rows applying `recipe` reads: the quantizers', or a distillation's steps' worth."""
    return max(CALIBRATION_ROWS, recipe.distill_steps * DISTILL_BATCH_ROWS)


def calibration_tokens(tokenizer: Any, *, samples: int = CALIBRATION_ROWS, length: int = 256) -> Any:
    """`samples` rows of `length` consecutive tokens, the calibration kinds taken in turn (Python's tutorial,
    Python source, C headers; texts.py), each kind's rows in order: the same rows on every run (the first rows of
    a longer call are a shorter call's), and no kind of text the quality bench evaluates on."""
    import mlx.core as mx

    # The forward passes over these rows (and gpx's Hessians) were half of imx's and gpx's time at 16 rows;
    # 8 rows measured as well on every evaluation kind (SmolLM2: within the spread of two 16-row choices).

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


@dataclass
class CalibrationStatistics:
    """What kvrig's quantizers measure on one float model over one set of calibration rows, by layer path: kept
    by a caller that quantizes that model with several recipes (`kvrig package` trying gpx-q4, then gpx-4.6,
    then writing the one it keeps), so the calibration's forward passes run once."""

    hessians: dict[str, Any] | None = None
    """gpx's XᵀX / tokens (`gpx.input_hessians`)."""
    importance: dict[str, Any] | None = None
    """imx's mean x² per channel (`imx.activation_importance`)."""
    factors: dict[tuple[int, float], Any] = field(default_factory=dict)
    """gpx's inverse factor of each Hessian (`gpx.fit_feedback`): the stacks reading one input at different grids
    (gpx-4.6's q and k/v projections) share it."""
    fits: dict[tuple[Any, ...], tuple[Any, Any, Any]] = field(default_factory=dict)
    """Each layer stack's packed weight, scales and biases by (paths, group size, bits, feedback, dtype): a stack
    is fitted from its float weights and these statistics alone, so gpx-4.6 reuses every gpx-q4 stack it keeps
    at q4's grid."""


def apply_recipe(
    model: Any,
    config: dict[str, Any],
    recipe: WeightRecipe,
    calibration: Any = None,
    progress: Callable[[str], None] = lambda _: None,
    statistics: CalibrationStatistics | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantizes `model` (float weights, loaded by `load_source_model`) as the recipe says; returns the model
    and its config with an explicit `quantization` block. Calibrated methods need `calibration` tokens
    (`calibration_tokens`, `calibration_rows(recipe)` of them: the quantizers measure on the first
    CALIBRATION_ROWS, a `+kd` distillation reads them all). `progress` hears of each layer kvrig's own
    quantizers (imx, gpx) finish and of each distillation step, a line each; mlx-lm's print their own progress
    bars to stderr. `statistics`, when given, holds (or gets) what imx and gpx measured on this model and
    calibration before."""

    if not recipe.calibrated:
        return quantize(model, config, recipe)
    if calibration is None:
        raise QuantizationError(f"recipe {recipe.name} needs calibration tokens")
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path

    vocab = (config.get("text_config") or config).get("vocab_size")
    if isinstance(vocab, int) and int(calibration.max()) >= vocab:
        # An id past the embedding reads whatever memory follows it: NaN scales, written without a word.
        raise QuantizationError(
            f"recipe {recipe.name}: the calibration text's token ids reach {int(calibration.max())}, past the "
            f"model's vocabulary of {vocab}: the tokenizer beside the weights is not the model's"
        )

    # Calibrate in float32 (float16 arithmetic is emulated on x86 CPUs), store scales as the source dtype.
    model, config = quantize(model, config, parse_weights("fp16"))
    dtype = getattr(mx, str(config.get("torch_dtype") or "float16"), mx.float16)
    # What the model's cast_predicate keeps out of the cast (a router's float32 correction bias) goes back to
    # its own dtype afterwards, as in round-to-nearest recipes and the plan.
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    kept = {p: v.dtype for p, v in flat if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype}
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    fitted, rows = recipe.undistilled, calibration[:CALIBRATION_ROWS]
    teacher = dict(tree_flatten(model.parameters())) if recipe.distill_steps else {}
    with contextlib.redirect_stdout(sys.stderr), contextlib.redirect_stderr(sys.stderr):
        if fitted.method == "gptq":
            model, config = _gptq(model, config, fitted, rows, dtype)
        elif fitted.method == "awq":
            model, config = _awq(model, config, fitted, rows, dtype)
        elif fitted.method in ("imx", "gpx"):
            model, config = _imx(model, config, fitted, rows, dtype, progress, statistics)
        elif fitted.method == "dq":
            model, config = _dynamic(model, config, fitted, rows)
        else:  # round-to-nearest, kept in float32 for the distillation
            model, config = quantize(model, config, fitted, work_dtype="float32")
    if recipe.distill_steps:
        distill(model, teacher, calibration, recipe.distill_steps, progress=progress)
    model.set_dtype(dtype)  # floating parameters only: packed weights stay uint32
    model.update(
        tree_map_with_path(
            lambda p, v: v.astype(kept[p]) if p in kept and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model, config


def _gptq(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any, dtype: Any
) -> tuple[Any, dict[str, Any]]:
    from mlx_lm.quant.gptq import gptq_quantize

    bits = recipe.bits
    assert bits is not None

    def run(model: Any) -> None:
        gptq_quantize(model, calibration, bits, recipe.group_size, bits, recipe.group_size, batch_size=4)

    return _on_layout(model, config, recipe, dtype, run)


def _imx(
    model: Any,
    config: dict[str, Any],
    recipe: WeightRecipe,
    calibration: Any,
    dtype: Any,
    progress: Callable[[str], None],
    statistics: CalibrationStatistics | None,
) -> tuple[Any, dict[str, Any]]:
    shared = {"dtype": dtype, "feedback": recipe.method == "gpx", "progress": progress, "statistics": statistics}
    assert recipe.bits is not None
    if recipe.target_bpw is None:
        return quantize_weighted(model, config, recipe.bits, calibration, group_size=recipe.group_size, **shared)
    return quantize_weighted(model, config, recipe.bits, calibration, target_bpw=recipe.target_bpw, **shared)


def _awq(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, calibration: Any, dtype: Any
) -> tuple[Any, dict[str, Any]]:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize

    model_type = str(config.get("model_type"))
    if (reason := awq_unavailable_reason(model_type)) is not None:
        raise QuantizationError(reason)
    bits = recipe.bits
    assert bits is not None

    def run(model: Any) -> None:
        awq_quantize(
            model,
            calibration,
            AWQ_MODEL_CONFIGS[model_type],
            group_size=recipe.group_size,
            bits=bits,
            embed_group_size=recipe.group_size,
            embed_bits=bits,
            n_grid=10,
        )

    return _on_layout(model, config, recipe, dtype, run)


def _held(layer: Any) -> Any:
    """A float layer out of an mlx-lm quantizer's reach: calls and attribute reads go to the layer, which is
    no child of the returned module (so no walk over the model's modules finds it) and has no `to_quantized`."""
    import mlx.nn as nn

    class Held(nn.Module):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return layer(*args, **kwargs)

        def __getattr__(self, key: str) -> Any:
            if key == "to_quantized":
                raise AttributeError(key)
            return getattr(layer, key)

        def __setattr__(self, key: str, value: Any) -> None:
            if key.startswith("_"):  # Module's own bookkeeping (training flag, frozen names)
                super().__setattr__(key, value)
            else:  # a model that recasts a layer's weight in place (gemma3n) sets it on the layer
                setattr(layer, key, value)

    return Held()


def _on_layout(
    model: Any, config: dict[str, Any], recipe: WeightRecipe, dtype: Any, run: Callable[[Any], None]
) -> tuple[Any, dict[str, Any]]:
    """Runs one of mlx-lm's calibrated quantizers (`run`, in place) so that the model comes out with qN's
    layout, the one the planner counts (planner/layout.py): GPTQ and AWQ quantize every layer they reach at one
    width, whatever the model's own quant_predicate says (a router gate at 8 bits) and whether the group
    divides the layer. So the layers qN quantizes otherwise are quantized as qN does first, the ones qN keeps
    float are held out of reach, and the qN layers the quantizer did not reach are quantized as qN does after.
    Returns the model and its config with the layout's `quantization` block."""
    from mlx.utils import tree_unflatten

    assert recipe.bits is not None
    layout = recipe_layout(model, recipe, dtype.size)
    uniform = {"bits": recipe.bits, "group_size": recipe.group_size}
    held: list[tuple[str, Any]] = []
    early: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized"):
            continue
        if path not in layout:
            held.append((path, module))
        elif layout[path] != uniform:
            early.append((path, module.to_quantized(**layout[path])))
    model.update_modules(tree_unflatten([(p, _held(m)) for p, m in held] + early))
    try:
        run(model)
    except (ValueError, RuntimeError, AttributeError) as exc:
        # mlx-lm's quantizer meeting a model it does not handle (a layer the calibration never reaches has an
        # empty Hessian, a layer fed a 1-D input): the recipe cannot be applied to this model.
        name = {"gptq": "GPTQ", "awq": "AWQ"}.get(recipe.method, recipe.method)
        raise QuantizationError(f"mlx-lm's {name} failed on this model: {type(exc).__name__}: {exc}") from None
    finally:
        model.update_modules(tree_unflatten(held))
    late = [(p, m) for p, m in model.named_modules() if p in layout and hasattr(m, "to_quantized")]
    if late:
        model.update_modules(tree_unflatten([(p, m.to_quantized(**layout[p])) for p, m in late]))
    got = quantized_layout(model)
    if got != layout:
        wrong = sorted(p for p in set(got) | set(layout) if got.get(p) != layout.get(p))
        raise QuantizationError(
            f"recipe {recipe}: mlx-lm's quantizer left {len(wrong)} layer(s) off {recipe.layout}'s layout "
            f"(e.g. {wrong[0]}: {got.get(wrong[0], 'float')}, expected {layout.get(wrong[0], 'float')})"
        )
    quant: dict[str, Any] = dict(uniform)
    quant.update({p: params for p, params in got.items() if params != uniform})
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config["quantization"] = quant
    config["quantization_config"] = quant
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
    statistics: CalibrationStatistics | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantizes a float model with mlx-lm's `quantize_model` in the planner's layout (planner/layout.py: qN's
    at `group_size`, or `target_bpw`'s mix of grids from `bits` upwards), then refits every
    layer's grid with `fit_affine` and the activation importance of the float model on `calibration`. With
    `feedback`, every layer is quantized with GPTQ-style error feedback instead (`gpx.fit_feedback`, the float
    model's input Hessians); a tied embedding with heavy damping (its rows are also looked up, where error moved
    onto other columns hurts). Layers that read the same input at the same grid (q/k/v) are fitted as one
    stacked matrix; `progress` hears of each layer as it is done. `statistics` keeps the calibration's
    measurements for the next recipe (see `CalibrationStatistics`)."""
    import mlx.core as mx
    import mlx.nn as nn

    dtype = dtype or mx.float16
    statistics = statistics or CalibrationStatistics()
    if feedback:
        if statistics.hessians is None:
            statistics.hessians = input_hessians(model, calibration)
        hessians = statistics.hessians
        importance = {p: None if h is None else mx.diagonal(h) for p, h in hessians.items()}
    else:
        if statistics.importance is None:
            statistics.importance = activation_importance(model, calibration)
        hessians, importance = {}, statistics.importance
    floats = {p: m.weight for p, m in model.named_modules() if hasattr(m, "to_quantized") and "weight" in m}
    # The layout is the planner's (planner/layout.py): qN's, or a target's mix of grids.
    recipe = WeightRecipe("gpx" if feedback else "imx", bits, group_size, target_bpw=target_bpw)
    model, config = quantize_layout(model, dict(config), recipe, mx.zeros((), dtype=dtype).itemsize)
    modules = {
        p: m
        for p, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) and p in floats
    }
    # Layers that read the same input (their statistics are one array) at the same grid shape are one stack.
    stats = hessians if feedback else importance
    stacks: dict[tuple[int, ...], list[str]] = {}
    for path in sorted(modules, key=_natural):
        m, stat = modules[path], stats.get(path)
        key = (id(m),) if stat is None else (id(stat), m.group_size, m.bits, isinstance(m, nn.QuantizedEmbedding))
        stacks.setdefault(key, []).append(path)
    for paths in stacks.values():
        first = modules[paths[0]]
        # A stack's rows are fitted together (one matrix product per group), so a stack is reused whole: the
        # same paths at the same grid, as another recipe's layout stacked them.
        fit = (tuple(paths), first.group_size, first.bits, feedback, str(dtype))
        if (q := statistics.fits.get(fit)) is None:
            w = mx.concatenate([floats[p] for p in paths]) if len(paths) > 1 else floats[paths[0]]
            if feedback and hessians.get(paths[0]) is not None:
                damping = EMBEDDING_DAMPING if isinstance(first, nn.QuantizedEmbedding) else DAMPING
                q = fit_feedback(
                    w, hessians[paths[0]], first.group_size, first.bits, dtype, damping, statistics.factors
                )
            else:
                q = fit_affine(w, first.group_size, first.bits, importance.get(paths[0]), dtype)
            statistics.fits[fit] = q
        start = 0
        for path in paths:
            rows = floats[path].shape[0]
            module = modules[path]
            module.weight, module.scales, module.biases = (a[start : start + rows] for a in q)
            mx.eval(module.parameters())
            start += rows
            progress(f"quantized {path}")
    config["quantization_config"] = config["quantization"]
    return model, config


def _natural(path: str) -> list[Any]:
    """Sort key: model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def distill_dwq(
    model: Any,
    config: dict[str, Any],
    layout: WeightRecipe,
    train: Any,
    valid: Any,
    *,
    learning_rate: float = 1e-6,
    batch_size: int = 4,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Any, dict[str, Any], int]:
    """mlx-lm's DWQ (`mlx_lm.quant.dwq`): `layout` (a round-to-nearest qN[gG]) quantized by mlx-lm, then its
    scales and biases trained to match the float model's next-token distributions on the rows of `train`
    (tokens, one epoch), with mlx-lm's Adam, learning rate and KL loss; `valid` rows for its validation loss.
    Returns the quantized model (float16 scales), its config and the number of steps taken; `progress` hears
    of each batch as it starts. Distills in float32, like the other calibrated recipes (float16 and bfloat16
    arithmetic are emulated on x86 CPUs)."""
    import copy

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    if layout.method != "rtn" or layout.mixed is not None or layout.bits is None:
        raise QuantizationError(f"DWQ starts from a round-to-nearest qN[gG] layout, not {layout.name}")
    if train.shape[0] < batch_size or valid.shape[0] < batch_size:
        raise QuantizationError(f"DWQ needs at least {batch_size} training and {batch_size} validation rows")
    model, config = quantize(model, config, parse_weights("fp16"))
    dtype = getattr(mx, str(config.get("torch_dtype") or "float16"), mx.float16)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    student = copy.deepcopy(model)
    steps, started = train.shape[0] // batch_size, {"train": 0, "valid": 0}

    def target(batch: Any, _index: int, split: str) -> Any:
        started[split] += 1
        progress(f"DWQ {split} batch {started[split]} ({steps} training steps)")
        return model(batch)

    with contextlib.redirect_stdout(sys.stderr):
        student, config = quantize_model(student, dict(config), layout.group_size, layout.bits)
        rows = [(list(r), 0) for r in train.tolist()], [(list(r), 0) for r in valid.tolist()]
        dwq_quantize(
            student,
            target,
            optim.Adam(learning_rate=learning_rate, bias_correction=True),
            *rows,
            batch_size=batch_size,
            max_seq_length=train.shape[1] + 1,
            seed=0,
            dtype=mx.float32,
        )
    student.eval()
    student.set_dtype(dtype)
    mx.eval(student.parameters())
    config["quantization"]["bits"], config["quantization"]["group_size"] = layout.bits, layout.group_size
    config["quantization_config"] = config["quantization"]
    return student, config, steps
