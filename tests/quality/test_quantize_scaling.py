"""kvrig's quantizers grow no faster than parameters × hidden size (GPTQ's feedback: each column's error reaches
the later columns of its rows), counted on tiny llama models built from arguments, not timed: every quantized
weight goes through the grid search exactly once, and the Python-level calls (the loops over layers, groups
and columns) grow no faster than parameters × hidden size as the hidden size doubles. The times themselves
are `kvrig bench quantize`'s (its scaling check)."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs

from kvrig.quantize import gpx, imx
from kvrig.quantize.recipes import apply_recipe
from kvrig.recipes import parse_weights

HIDDEN = (64, 128, 256)


def tiny_model(hidden: int) -> tuple[Any, dict[str, Any]]:
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": hidden // 64,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
    }
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def count_work(recipe: str, hidden: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int, int]:
    """(parameters, quantized weights, weights the grid search saw, Python-level calls) of one quantization."""
    model, config = tiny_model(hidden)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    searched = [0]
    real = imx.grid_search

    def search(x: np.ndarray, *args: Any) -> Any:
        searched[0] += x.size
        return real(x, *args)

    monkeypatch.setattr(imx, "grid_search", search)
    monkeypatch.setattr(gpx, "grid_search", search)
    calls = [0]

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    calibration = mx.random.randint(0, 256, (2, 32))
    sys.setprofile(profile)
    try:
        model, _ = apply_recipe(model, dict(config), parse_weights(recipe), calibration)
    finally:
        sys.setprofile(None)
    quantized = sum(
        m.weight.size * 32 // m.bits
        for _, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    )
    return params, quantized, searched[0], calls[0]


@pytest.mark.parametrize("recipe", ["imx-q4", "gpx-q4", "gpx-4.6"])
def test_work_grows_no_faster_than_parameters_times_hidden(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    points = [count_work(recipe, hidden, monkeypatch) for hidden in HIDDEN]
    for params, quantized, searched, _ in points:
        assert searched == quantized < params
    for (p0, _, _, c0), (p1, _, _, c1), h0, h1 in zip(points, points[1:], HIDDEN, HIDDEN[1:], strict=False):
        assert c1 / c0 <= (p1 * h1) / (p0 * h0), f"hidden {h0} -> {h1}: calls x{c1 / c0:.2f}"
