"""Distillation of a quantized model's grids (`+kd` recipes): every quantized layer keeps its levels, and the
layers' scales and biases, with the model's norm weights, are trained with Adam so that the quantized model's
next-token distributions come closer to the float model's (KL divergence) on calibration rows. The loss is the
whole model's, so a layer's error can be made up in the layers after it, which a layer-by-layer fit (imx, gpx)
cannot do. mlx-lm's DWQ (`mlx_lm.quant.dwq`) trains the same parameters from round-to-nearest weights over
thousands of rows; `+kd` starts from any recipe's grids, the closest kvrig fits, and takes a few dozen steps.

The student runs as a float model whose weights are levels × scale + bias: MLX's CPU quantized matmul is a plain
loop, several times slower than the float matmul (and its gradients) on OpenBLAS. Levels, scales and biases keep
their arrays and layout, so the bytes are the undistilled recipe's. Quantized layers other than MLX's Linear and
Embedding (MoE experts, MLA's per-head projections) are not trained, and run quantized in the teacher too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

LEARNING_RATE = 1e-5
"""Adam's step size (twice it did worse on held-out text at every step measured, docs/quality.md)."""
BATCH_ROWS = 4
"""Calibration rows per step."""


def distill(
    model: Any,
    teacher: dict[str, Any],
    rows: Any,
    steps: int,
    *,
    learning_rate: float = LEARNING_RATE,
    batch_rows: int = BATCH_ROWS,
    progress: Callable[[str], None] = lambda _: None,
) -> list[float]:
    """Trains, in place, the scales and biases of `model`'s quantized layers (affine mode) and its norms' weights
    for `steps` steps of `batch_rows` rows of `rows` (tokens, shape (rows, length); a fixed shuffle, repeated
    when the steps need more rows) against the next-token distributions of the same model with the float
    parameters `teacher` (flattened path -> array, as before quantizing; float32, as the norms). Trains in
    float32, and the scales and biases go back to their own dtype. Returns each step's loss; `progress` hears
    each step."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten

    quantized: dict[str, Any] = {
        p: m
        for p, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) and getattr(m, "mode", "affine") == "affine"
    }
    if not quantized:
        return []
    levels = {p: _levels(m) for p, m in quantized.items()}
    f32 = mx.float32
    dtypes = {p: m.scales.dtype for p, m in quantized.items()}
    trainable = {
        "grids": {p: {"scales": m.scales.astype(f32), "biases": m.biases.astype(f32)} for p, m in quantized.items()},
        "norms": {p + ".weight": m.weight for p, m in model.named_modules() if _is_norm(m)},
    }
    model.update_modules(tree_unflatten([(p, _float_module(m)) for p, m in quantized.items()]))
    # Quantized layers of other kinds (MoE experts' SwitchLinear, MLA's MultiLinear) stay as fitted, in the
    # teacher too: their float weights would not fit the quantized modules that hold them.
    current = dict(tree_flatten(model.parameters()))
    floating = {p for p, v in current.items() if mx.issubdtype(v.dtype, mx.floating)}
    teacher_params = tree_unflatten([(p, v) for p, v in teacher.items() if p in floating])

    def student(params: dict[str, Any]) -> list[tuple[str, Any]]:
        weights = [(p + ".weight", _weights(levels[p], g["scales"], g["biases"])) for p, g in params["grids"].items()]
        return weights + list(params["norms"].items())

    def loss_fn(params: dict[str, Any], x: Any, target: Any) -> Any:
        model.update(tree_unflatten(student(params)))
        log_q = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        return nn.losses.kl_div_loss(log_q, nn.log_softmax(target, axis=-1), axis=-1, reduction="mean")

    order = _order(rows.shape[0], steps * batch_rows)
    optimizer = optim.Adam(learning_rate=learning_rate)
    value_and_grad = mx.value_and_grad(loss_fn)
    losses = []
    try:
        for step in range(steps):
            x = rows[mx.array(order[step * batch_rows : (step + 1) * batch_rows])]
            model.update(teacher_params)
            target = mx.stop_gradient(model(x).astype(mx.float32))
            mx.eval(target)
            loss, grads = value_and_grad(trainable, x, target)
            trainable = optimizer.apply_gradients(grads, trainable)
            mx.eval(loss, trainable)
            losses.append(float(loss.item()))
            progress(f"distilled step {step + 1}/{steps}: KL {losses[-1]:.4f}")
    finally:
        model.update_modules(tree_unflatten(list(quantized.items())))
    for path, grid in trainable["grids"].items():
        module = quantized[path]
        module.scales, module.biases = grid["scales"].astype(dtypes[path]), grid["biases"].astype(dtypes[path])
    model.update(tree_unflatten(list(trainable["norms"].items())))
    mx.eval(model.parameters())
    return losses


def _levels(module: Any) -> Any:
    """The module's integer levels, one byte each, shaped (rows, groups, group size)."""
    import mlx.core as mx

    ones = mx.ones_like(module.scales)
    levels = mx.dequantize(module.weight, ones, mx.zeros_like(ones), module.group_size, module.bits).astype(mx.uint8)
    return levels.reshape(levels.shape[0], -1, module.group_size)


def _weights(levels: Any, scales: Any, biases: Any) -> Any:
    w = levels.astype(scales.dtype) * scales[..., None] + biases[..., None]
    return w.reshape(w.shape[0], -1)


def _float_module(module: Any) -> Any:
    """A float layer of the quantized one's shape (its weight is set at each step)."""
    import mlx.nn as nn

    rows, groups = module.scales.shape
    if isinstance(module, nn.QuantizedEmbedding):
        return nn.Embedding(rows, groups * module.group_size)
    return nn.Linear(groups * module.group_size, rows, bias="bias" in module)


def _is_norm(module: Any) -> bool:
    """A normalisation layer with a learned scale (RMSNorm, LayerNorm and the models' own variants)."""
    return "Norm" in type(module).__name__ and "weight" in module and not module.children()


def _order(rows: int, needed: int) -> np.ndarray:
    """A fixed shuffle of the rows, another one appended while more are needed: each row once per epoch."""
    rng = np.random.default_rng(0)
    return np.concatenate([rng.permutation(rows) for _ in range(-(-needed // rows))])[:needed]
