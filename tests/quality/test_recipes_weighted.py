"""Importance-weighted recipes (`imx-q4`, `imx-BPW`): MLX's own packing and dequantize read what they write,
a weight already on a 4-bit group-32 grid (a Q4_1 GGUF's) comes back exactly, the fitted grid never does worse
than MLX's round-to-nearest on the weighted error, the bits per weight stay within the target as mlx-lm counts
them, and the bytes equal the planner's (uniform layout) or mlx-lm's own quantize_model of the same layout."""

from __future__ import annotations

import copy
import io
from contextlib import redirect_stdout
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import compute_bits_per_weight, quantize_model

from kvrig.exceptions import QuantizationError
from kvrig.models import spec_from_config
from kvrig.planner.layout import quantize_layout, target_layout
from kvrig.planner.weights import account_weights
from kvrig.quantize.imx import activation_importance, fit_affine, pack
from kvrig.quantize.recipes import apply_recipe
from kvrig.recipes import parse_weights

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float16",
}


def tiny() -> Any:
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    return model


def nbytes(model: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def weighted_error(w: Any, q: tuple[Any, Any, Any], group: int, bits: int, imp: Any) -> float:
    deq = mx.dequantize(q[0], q[1].astype(mx.float32), q[2].astype(mx.float32), group, bits)
    return float((((deq - w) ** 2) * imp).sum().item())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_packing(bits: int) -> None:
    w = mx.random.normal((8, 128))
    packed, s, b = mx.quantize(w, 64, bits)
    levels = mx.round((mx.dequantize(packed, s, b, 64, bits) - mx.repeat(b, 64, -1)) / mx.repeat(s, 64, -1))
    assert mx.array_equal(pack(levels, bits), packed)


def test_a_q4_1_grid_comes_back_exactly() -> None:
    """Weights built on a 16-level grid per 32 columns (fp16 scale and minimum, every level used: what a
    Q4_1 GGUF holds) are reproduced bit for bit at group 32; MLX's round-to-nearest grid (it keeps 0 exact)
    is not."""
    mx.random.seed(1)
    rows, groups = 16, 8
    levels = mx.random.randint(0, 16, (rows, groups, 32))
    levels[..., 0], levels[..., 1] = 0, 15
    scale = mx.random.uniform(0.001, 0.02, (rows, groups)).astype(mx.float16)
    low = mx.random.uniform(-0.2, 0.0, (rows, groups)).astype(mx.float16)
    w = (levels * scale[..., None].astype(mx.float32) + low[..., None].astype(mx.float32)).reshape(rows, -1)
    q = fit_affine(w, 32, 4)
    assert mx.array_equal(mx.dequantize(q[0], q[1].astype(mx.float32), q[2].astype(mx.float32), 32, 4), w)
    rtn = mx.quantize(w, 32, 4)
    assert weighted_error(w, rtn, 32, 4, mx.ones_like(w)) > 0


@pytest.mark.parametrize("group", [32, 64])
def test_fitted_grid_beats_round_to_nearest_on_the_weighted_error(group: int) -> None:
    mx.random.seed(2)
    w = mx.random.normal((32, 256)) * 0.05
    imp = mx.random.uniform(0.1, 1.0, (256,)) ** 4  # a few heavy input channels, as in real activations
    ours = weighted_error(w, fit_affine(w, group, 4, imp, mx.float32), group, 4, imp)
    rtn = weighted_error(w, mx.quantize(w, group, 4), group, 4, imp)
    assert ours < 0.9 * rtn


def test_fit_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(QuantizationError):
        fit_affine(mx.zeros((4, 64)), 32, 7)
    with pytest.raises(QuantizationError):
        fit_affine(mx.zeros((4, 96)), 64, 4)
    with pytest.raises(QuantizationError):
        parse_weights("imx-q7")
    with pytest.raises(QuantizationError):
        parse_weights("gpx-q7")


def test_parse() -> None:
    r = parse_weights("imx-4.6")
    assert (r.method, r.layout, r.target_bpw, str(r)) == ("imx", None, 4.6, "imx-4.6")
    r = parse_weights("IMX-q4g32")
    assert (r.method, str(r.layout), r.group_size, r.bits, str(r)) == ("imx", "q4g32", 32, 4, "imx-q4g32")
    r = parse_weights("gpx-4.6")
    assert (r.method, r.layout, r.target_bpw) == ("gpx", None, 4.6)
    r = parse_weights("gpx-q3g32")
    assert (r.method, str(r.layout), r.group_size, r.bits) == ("gpx", "q3g32", 32, 3)


def test_importance_is_the_mean_square_input() -> None:
    """The first layer's q_proj sees the normed embeddings; the tied embedding (as the output layer) sees the
    final normed hidden states."""
    model = tiny()
    tokens = mx.random.randint(0, CONFIG["vocab_size"], (2, 16))
    imp = activation_importance(model, tokens, batch_size=1)
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(tokens))
    assert mx.allclose(imp["model.layers.0.self_attn.q_proj"], (x**2).reshape(-1, x.shape[-1]).mean(0), rtol=1e-4)
    h = model.model(tokens)
    assert mx.allclose(imp["model.embed_tokens"], (h**2).reshape(-1, h.shape[-1]).mean(0), rtol=1e-4)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # the recorders are gone


def test_imx_q4_bytes_equal_the_planners_q4() -> None:
    model, config = apply_recipe(tiny(), dict(CONFIG), parse_weights("imx-q4"), mx.random.randint(0, 256, (4, 16)))
    planned = account_weights(spec_from_config(CONFIG), parse_weights("q4", 64), "float16").total_bytes
    assert nbytes(model) == planned
    assert config["quantization"]["group_size"] == 64


def test_imx_target_layout_meets_the_target_and_matches_mlx_lm() -> None:
    """The mixed recipe: every k/v projection, then MLP down/up projections of the last layers, at group 32,
    bits per weight (mlx-lm's count) within the target, and the bytes mlx-lm's quantize_model gives for the
    config's per-layer entries."""
    target = 4.7  # the tiny model's k/v projections and two layers' MLP down/up projections fit
    model, config = apply_recipe(
        tiny(), dict(CONFIG), parse_weights(f"imx-{target}"), mx.random.randint(0, 256, (4, 16))
    )
    bpw = compute_bits_per_weight(model)
    assert bpw <= target
    groups = {p: m.group_size for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert all(groups[f"model.layers.{i}.self_attn.{p}"] == 32 for i in range(4) for p in ("k_proj", "v_proj"))
    assert all(groups[f"model.layers.{i}.mlp.{p}"] == 32 for i in (2, 3) for p in ("down_proj", "up_proj"))
    assert groups["model.layers.1.mlp.down_proj"] == 64 and groups["model.layers.0.mlp.up_proj"] == 64
    assert groups["model.layers.3.self_attn.q_proj"] == 64 and groups["model.layers.3.mlp.gate_proj"] == 64

    reference = tiny()
    reference.set_dtype(mx.float16)
    quant = config["quantization"]

    def predicate(path: str, module: Any) -> Any:
        return quant.get(path, False) if hasattr(module, "to_quantized") else False

    with redirect_stdout(io.StringIO()):
        quantize_model(reference, copy.deepcopy(CONFIG), 64, 4, quant_predicate=predicate)  # type: ignore[arg-type]
    assert nbytes(model) == nbytes(reference)
    # the layout spends the budget: the next MLP projection in line would cross the target
    layout = target_layout(tiny(), target, 4, 2)
    assert layout == {p: (4, g) for p, g in (groups | {"model.embed_tokens": 64}).items()}
    left = sorted((p for p, g in groups.items() if g == 64 and ("mlp.up" in p or "mlp.down" in p)), reverse=True)
    params = sum(v.size for _, v in tree_flatten(tiny().parameters()))
    assert left and bpw + 0.5 * CONFIG["hidden_size"] * CONFIG["intermediate_size"] / params > target


def test_smollm2_layout_is_within_4_6_bits_per_weight() -> None:
    """On the embedded model's config, built lazily (nothing evaluated), mlx-lm's quantize_model with the
    layout counts at most 4.6 bits per weight."""
    from kvrig.models.gguf import embedded_default_model, gguf_config_from_header, read_gguf_header

    config = gguf_config_from_header(read_gguf_header(embedded_default_model()))
    spec = spec_from_config(config)
    layout = target_layout(spec.weights_model("float16"), 4.6, 4, 2)
    model = spec.weights_model("float16")

    def grid(path: str, module: Any) -> Any:
        return {"bits": layout[path][0], "group_size": layout[path][1]} if path in layout else False

    with redirect_stdout(io.StringIO()):
        quantize_model(model, dict(config), 64, 4, quant_predicate=grid)  # type: ignore[arg-type]
    bpw = compute_bits_per_weight(model)
    assert 4.55 < bpw <= 4.6
    assert sum(g == (4, 32) for g in layout.values()) >= 20


def test_a_target_below_4_5_bits_starts_from_3_bits() -> None:
    """gpx-4.0: 3 bits at group 64, and 4 bits for the tied embedding, every k/v projection, then the MLP down
    projections and the attention outputs from the last layer backwards, while mlx-lm's count of the bits per
    weight stays within the target; the bytes are the planner's."""
    r = parse_weights("gpx-4.0")
    assert (r.method, r.bits, r.target_bpw, str(r)) == ("gpx", 3, 4.0, "gpx-4.0")
    assert (parse_weights("gpx-4").name, parse_weights("imx-4.5").bits, parse_weights("dq-4.0").bits) == (
        "gpx-4.0",
        4,
        4,
    )
    for text in ("gpx-3.4", "imx-3", "dq-3.9"):
        with pytest.raises(QuantizationError, match="outside"):
            parse_weights(text)
    model, _ = apply_recipe(tiny(), dict(CONFIG), r, mx.random.randint(0, 256, (4, 16)))
    grids = {
        p: (m.bits, m.group_size)
        for p, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }
    four = {p for p, g in grids.items() if g == (4, 64)}
    # on this model 4.0 bits per weight pay for the embedding, k/v, and every down projection and output
    expected = {"model.embed_tokens"} | {
        f"model.layers.{i}.{p}"
        for i in range(4)
        for p in ("self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj", "self_attn.o_proj")
    }
    assert four == expected and set(grids.values()) == {(3, 64), (4, 64)}
    bpw = compute_bits_per_weight(model)
    params = sum(v.size for _, v in tree_flatten(tiny().parameters()))
    next_in_line = CONFIG["hidden_size"] * CONFIG["intermediate_size"]  # layer 3's up projection
    assert bpw <= 4.0 < bpw + next_in_line / params
    assert nbytes(model) == account_weights(spec_from_config(CONFIG), r, "float16").total_bytes


def test_an_untied_output_head_is_upgraded_with_the_embedding() -> None:
    mx.random.seed(0)
    untied = Model(ModelArgs.from_dict(CONFIG | {"tie_word_embeddings": False}))
    layout = target_layout(untied, 3.7, 3, 2)
    assert layout["lm_head"] == layout["model.embed_tokens"] == (4, 64)
    assert layout["model.layers.0.self_attn.q_proj"] == (3, 64)


GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 512,
    "n_ctx": 128,
    "n_embd": 128,
    "n_head": 2,
    "n_layer": 4,
    "n_positions": 128,
    "layer_norm_epsilon": 1e-5,
}


def _gpt2() -> Any:
    from mlx_lm.models import gpt2

    model = gpt2.Model(gpt2.ModelArgs.from_dict(GPT2))
    model.set_dtype(mx.float16)
    return model


def test_a_position_embedding_is_no_head() -> None:
    """gpt2's token embedding (wte) goes to 4 bits first; its position embedding (wpe) is no output head."""
    layout = target_layout(_gpt2(), 3.7, 3, 2)
    assert (layout["model.wte"], layout["model.wpe"]) == ((4, 64), (3, 64))


def test_a_target_is_spent_on_layers_of_any_name() -> None:
    """gpt2 names none of llama's projections: after its embedding, its blocks go to 4 bits from the last one
    backwards, while mlx-lm's count stays within the target (before, gpx-4.0 stopped at the embedding)."""
    r = parse_weights("gpx-4.0")
    model, _ = quantize_layout(_gpt2(), dict(GPT2), r, 2)
    four = {p for p, m in model.named_modules() if getattr(m, "bits", None) == 4}
    last_block = {f"model.h.3.{p}" for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert {"model.wte", *last_block} <= four and not any(p.startswith(("model.h.0.", "model.h.1.")) for p in four)
    bpw = compute_bits_per_weight(model)
    params = sum(v.size for _, v in tree_flatten(_gpt2().parameters()))
    sizes = {p: m.weight.size for p, m in _gpt2().named_modules() if hasattr(m, "to_quantized")}
    # The next layer in line did not fit (one bit more per weight for it), and it is at most the largest left.
    largest_left = max(sizes[p] for p, m in model.named_modules() if getattr(m, "bits", None) == 3)
    assert 4.0 - largest_left / params < bpw <= 4.0
    assert nbytes(model) == account_weights(spec_from_config(GPT2), r, "float16").total_bytes
