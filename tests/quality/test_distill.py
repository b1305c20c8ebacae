"""`+kd` recipes: the distillation trains only scales, biases and norms (levels and layout untouched, so the bytes
are the undistilled recipe's and the planner's), brings the quantized model's next-token distributions closer
to the float model's on rows it never trained on, and has one grammar."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kvrig.exceptions import QuantizationError
from kvrig.models import spec_from_config
from kvrig.planner.weights import account_weights
from kvrig.quantize.distill import distill
from kvrig.quantize.recipes import CALIBRATION_ROWS, apply_recipe, calibration_rows
from kvrig.recipes import DISTILL_STEPS, parse_weights
from tests.quality.test_recipes_weighted import CONFIG, nbytes, tiny


def kl(float_model: Any, model: Any, rows: Any) -> float:
    """Mean KL(float || quantized) of the next-token distributions over every position of `rows`."""
    p = nn.log_softmax(float_model(rows).astype(mx.float32), axis=-1)
    q = nn.log_softmax(model(rows).astype(mx.float32), axis=-1)
    return float((mx.exp(p) * (p - q)).sum(-1).mean().item())


def quantized(model: Any) -> dict[str, Any]:
    return {p: m for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)}


def test_grammar() -> None:
    r = parse_weights("GPX-4.6+kd")
    assert (str(r), r.distill_steps, str(r.undistilled), r.layout, r.calibrated) == (
        "gpx-4.6+kd",
        DISTILL_STEPS,
        "gpx-4.6",
        None,
        True,
    )
    r = parse_weights("q4g32+kd12")
    assert (str(r), r.distill_steps, str(r.layout), r.calibrated, r.method) == ("q4g32+kd12", 12, "q4g32", True, "rtn")
    assert str(parse_weights(f"q4+kd{DISTILL_STEPS}")) == "q4+kd"
    assert calibration_rows(parse_weights("gpx-q4")) == CALIBRATION_ROWS
    assert calibration_rows(parse_weights("gpx-q4+kd12")) == 48
    for bad in ("fp16+kd", "q4+kd0", "q4+kd+kd", "q4+rot", "q4+"):
        with pytest.raises(QuantizationError):
            parse_weights(bad)


def test_distillation_moves_grids_not_levels_and_generalises() -> None:
    """A 3-bit round-to-nearest tiny model distilled on random rows comes closer to the float model on them, and
    (less: random tokens share little) on rows it never saw; its packed levels are bit for bit the same and its
    scales keep their dtype."""
    float_model = tiny()
    teacher = dict(tree_flatten(float_model.parameters()))
    model = tiny()
    nn.quantize(model, 64, 3)
    before = {p: (m.weight, m.scales, m.biases) for p, m in quantized(model).items()}
    mx.random.seed(3)
    train, held_out = mx.random.randint(0, 256, (64, 32)), mx.random.randint(0, 256, (8, 32))
    start = kl(float_model, model, train), kl(float_model, model, held_out)
    losses = distill(model, teacher, train, 40)
    assert len(losses) == 40
    assert kl(float_model, model, train) < 0.8 * start[0]
    assert kl(float_model, model, held_out) < start[1]
    after = quantized(model)
    assert set(after) == set(before)
    for path, (weight, scales, biases) in before.items():
        assert mx.array_equal(after[path].weight, weight)
        assert (after[path].scales.dtype, after[path].biases.dtype) == (scales.dtype, biases.dtype)
    assert any(not mx.array_equal(after[p].scales, s) for p, (_, s, _) in before.items())
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear  # the float stand-ins are gone
    norms = [m.weight for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    assert any(not mx.array_equal(n, mx.ones_like(n)) for n in norms)  # the norms trained too


def test_kd_recipe_keeps_the_recipes_arrays_and_the_planners_bytes() -> None:
    rows = mx.random.randint(0, 256, (calibration_rows(parse_weights("imx-q4+kd3")), 16))
    plain, plain_config = apply_recipe(tiny(), dict(CONFIG), parse_weights("imx-q4"), rows[:CALIBRATION_ROWS])
    model, config = apply_recipe(tiny(), dict(CONFIG), parse_weights("imx-q4+kd3"), rows)
    assert config["quantization"] == plain_config["quantization"]
    planned = account_weights(spec_from_config(CONFIG), parse_weights("imx-q4+kd3"), "float16").total_bytes
    assert nbytes(model) == nbytes(plain) == planned
    ours, theirs = quantized(model), quantized(plain)
    assert all(mx.array_equal(ours[p].weight, theirs[p].weight) for p in theirs)
    assert all(ours[p].scales.dtype == mx.float16 for p in ours)
    assert not all(mx.array_equal(ours[p].scales, theirs[p].scales) for p in theirs)


def test_kd_on_round_to_nearest_needs_its_calibration_rows() -> None:
    with pytest.raises(QuantizationError, match="calibration"):
        apply_recipe(tiny(), dict(CONFIG), parse_weights("q4+kd2"))
    model, config = apply_recipe(tiny(), dict(CONFIG), parse_weights("q4+kd2"), mx.random.randint(0, 256, (8, 16)))
    assert config["quantization"]["bits"] == 4 and config.get("torch_dtype") == "float16"
    assert all(m.scales.dtype == mx.float16 for m in quantized(model).values())


def test_moe_experts_stay_as_fitted() -> None:
    """A tiny mixtral: its experts (SwitchLinear, quantized by mlx-lm as QuantizedSwitchLinear) are not trained and
    run quantized in the teacher too; the attention projections and the embedding are distilled."""
    from mlx_lm.models.mixtral import Model as Mixtral
    from mlx_lm.models.mixtral import ModelArgs as MixtralArgs

    args = {**CONFIG, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    mx.random.seed(0)
    float_model = Mixtral(MixtralArgs.from_dict(args))
    mx.eval(float_model.parameters())
    teacher = dict(tree_flatten(float_model.parameters()))
    model = Mixtral(MixtralArgs.from_dict(args))
    model.update(float_model.parameters())
    nn.quantize(model, 64, 4)
    experts = model.model.layers[0].block_sparse_moe.switch_mlp.up_proj
    fitted = (experts.weight, experts.scales, experts.biases)
    q_proj = model.model.layers[0].self_attn.q_proj.scales
    distill(model, teacher, mx.random.randint(0, 256, (8, 16)), 2)
    assert type(model.model.layers[0].block_sparse_moe.switch_mlp.up_proj) is type(experts)
    after = (experts.weight, experts.scales, experts.biases)
    assert all(mx.array_equal(a, b) for a, b in zip(after, fitted, strict=True))
    assert not mx.array_equal(model.model.layers[0].self_attn.q_proj.scales, q_proj)
