"""GPTQ-style error feedback (`gpx-` recipes): on a layer whose inputs are correlated it lowers the output error
‖X·Wᵀ − X·Ŵᵀ‖ (computed here from MLX's own dequantize) against the same grids without feedback; with
uncorrelated inputs there is nothing to feed back and it writes exactly `fit_affine`'s arrays; the Hessians
are XᵀX of each layer's inputs; the recipes keep the planner's / imx's bytes."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvrig.models import spec_from_config
from kvrig.planner.weights import account_weights
from kvrig.quantize.gpx import fit_feedback, gram_matrix, gram_strips, input_hessians
from kvrig.quantize.imx import fit_affine
from kvrig.quantize.recipes import apply_recipe
from kvrig.recipes import parse_weights
from tests.quality.test_recipes_weighted import CONFIG, tiny


def output_error(x: Any, w: Any, q: tuple[Any, Any, Any], group: int, bits: int) -> float:
    deq = mx.dequantize(q[0], q[1].astype(mx.float32), q[2].astype(mx.float32), group, bits)
    return float(((x @ (w - deq).T) ** 2).sum().item())


@pytest.mark.parametrize(("group", "bits"), [(64, 4), (32, 3)])
def test_feedback_lowers_the_output_error_on_correlated_inputs(group: int, bits: int) -> None:
    mx.random.seed(3)
    n = 256
    mixing = mx.eye(n) + 0.1 * mx.random.normal((n, n))  # inputs share directions, as activations do
    x = (mx.random.normal((1024, n)) @ mixing) * mx.random.uniform(0.2, 2.0, (n,))
    w = 0.05 * mx.random.normal((48, n))
    h = x.T @ x / x.shape[0]
    plain = output_error(x, w, fit_affine(w, group, bits, mx.diagonal(h), mx.float16), group, bits)
    fed = output_error(x, w, fit_feedback(w, h, group, bits, mx.float16), group, bits)
    assert fed < 0.8 * plain


def test_uncorrelated_inputs_give_the_plain_fit() -> None:
    """A diagonal H: the inverse's Cholesky factor is diagonal, no error reaches another column, and each
    group's grid is fitted to the untouched weights with H's diagonal as importance."""
    mx.random.seed(4)
    w = 0.05 * mx.random.normal((16, 128))
    h = mx.diag(mx.random.uniform(0.1, 2.0, (128,)))
    fed = fit_feedback(w, h, 64, 4, mx.float16)
    plain = fit_affine(w, 64, 4, mx.diagonal(h), mx.float16)
    for a, b in zip(fed, plain, strict=True):
        assert mx.array_equal(a, b)


def test_hessians_are_the_inputs_gram_matrix() -> None:
    model = tiny()
    tokens = mx.random.randint(0, CONFIG["vocab_size"], (2, 16))
    hess = input_hessians(model, tokens, batch_size=1)
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(tokens)).reshape(-1, CONFIG["hidden_size"])
    assert mx.allclose(hess["model.layers.0.self_attn.k_proj"], x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)


def test_gpx_bytes_equal_the_planners_and_imx() -> None:
    calibration = mx.random.randint(0, 256, (4, 16))
    model, _ = apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-q4"), calibration)
    planned = account_weights(spec_from_config(CONFIG), parse_weights("q4", 64), "float16").total_bytes
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == planned
    gpx, gpx_config = apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-4.6"), calibration)
    imx, imx_config = apply_recipe(tiny(), dict(CONFIG), parse_weights("imx-4.6"), calibration)
    assert gpx_config["quantization"] == imx_config["quantization"]
    shapes = {k: (v.shape, v.dtype) for k, v in tree_flatten(gpx.parameters())}
    assert shapes == {k: (v.shape, v.dtype) for k, v in tree_flatten(imx.parameters())}


@pytest.mark.parametrize("width", [64, 130, 200, 576, 1000])
def test_the_hessians_strips_put_back_are_the_gram_matrix(width: int) -> None:
    """XᵀX from its upper triangle's strips, in fewer products' entries than XᵀX has, whatever width the last
    strip is left with: every entry where x.T @ x has it."""
    mx.random.seed(width)
    x = mx.random.normal((300, width))
    strips = gram_strips(x)
    assert sum(s.size for s in strips) < width * width or len(strips) == 1
    h = gram_matrix(strips)
    assert h.shape == (width, width)
    assert mx.allclose(h, x.T @ x, rtol=1e-5, atol=1e-4)
