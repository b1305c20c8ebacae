"""The fast grid search (imx) and the blocked error feedback (gpx) against their definitions, written out
straightforwardly in tests/quality/reference_quant.py (one candidate grid, one column at a time, in MLX): the
same grids and levels up to the order of float sums (which can flip a near-tie), and never a worse objective.
Also: layers fed the same input share one statistics array, scales round as MLX casts, and every quantized
layer is reported to `progress` once."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvrig.quantize import gpx, imx, recipes
from kvrig.quantize.gpx import feedback, input_hessians, inverse_factor
from kvrig.quantize.imx import activation_importance, dtype_name, fit_grid
from kvrig.quantize.kernels import DTYPES, round_all
from kvrig.quantize.recipes import CalibrationStatistics, apply_recipe
from kvrig.recipes import parse_weights
from tests.quality import reference_quant as ref
from tests.quality.test_recipes_weighted import CONFIG, tiny


def weights_and_importance(rows: int, cols: int, seed: int) -> tuple[Any, Any]:
    mx.random.seed(seed)
    w = 0.05 * mx.random.normal((rows, cols))
    w[:, :8] = w[:, :8] * 6  # a few outlier channels, as real layers have
    return w, mx.random.uniform(0.1, 1.0, (cols,)) ** 4


@pytest.mark.parametrize(
    ("bits", "group", "dtype"),
    [(4, 64, mx.float16), (3, 32, mx.bfloat16), (2, 64, mx.float16), (8, 32, mx.float32), (5, 64, mx.bfloat16)],
)
def test_grid_search_is_the_reference_search(bits: int, group: int, dtype: Any) -> None:
    w, imp = weights_and_importance(96, 256, bits)
    x = w.reshape(96, -1, group)
    wt = mx.broadcast_to(imp.reshape(-1, group), x.shape)
    s, b = fit_grid(x, wt, bits, dtype)
    rs, rb = ref.fit_grid(x, wt, bits, dtype)
    top = 2**bits - 1
    e, re = ref.error(x, wt, s, b, top), ref.error(x, wt, rs, rb, top)
    close = mx.abs(e - re) <= 1e-4 * re
    assert mx.mean(close).item() >= 0.97
    # Where a near-tie went the other way, the search may end elsewhere; in total it is as good.
    assert abs(e.sum().item() - re.sum().item()) <= 1e-4 * re.sum().item()
    if dtype != mx.float32:
        assert mx.mean((s == rs) & (b == rb)).item() >= 0.97
    # The grids are representable in the scales' dtype.
    assert mx.array_equal(s.astype(dtype).astype(mx.float32), s)


@pytest.mark.parametrize("group", [32, 64])
def test_grid_search_on_a_4_bit_source_is_the_reference_search(group: int) -> None:
    """Weights already on 4-bit grids of 32 (as a Q4_1 GGUF's): most stretched candidates repeat the levels of the
    one before, which the fast search skips; it ends on the reference's grids, which tries every candidate."""
    mx.random.seed(group)
    levels = mx.random.randint(0, 16, (64, 256)).astype(mx.float32)
    scales, mins = mx.random.uniform(0.001, 0.02, (64, 8, 1)), mx.random.uniform(-0.2, 0.0, (64, 8, 1))
    w = (levels.reshape(64, 8, 32) * scales + mins).reshape(64, -1)
    imp = mx.random.uniform(0.1, 1.0, (256,)) ** 4
    x = w.reshape(64, -1, group)
    wt = mx.broadcast_to(imp.reshape(-1, group), x.shape)
    s, b = fit_grid(x, wt, 4, mx.float16)
    rs, rb = ref.fit_grid(x, wt, 4, mx.float16)
    assert mx.mean((s == rs) & (b == rb)).item() >= 0.97
    e, re = ref.error(x, wt, s, b, 15), ref.error(x, wt, rs, rb, 15)
    assert abs(e.sum().item() - re.sum().item()) <= 1e-4 * re.sum().item()


@pytest.mark.parametrize(("out", "n", "group", "bits"), [(48, 256, 64, 4), (40, 192, 32, 3), (24, 256, 128, 2)])
def test_blocked_feedback_is_the_column_by_column_update(out: int, n: int, group: int, bits: int) -> None:
    """Correlated inputs (so every column's error moves the later ones): the blocked update picks the reference's
    levels and grids, and the layer's output error tr((W - Ŵ) H (W - Ŵ)ᵀ) is the reference's."""
    mx.random.seed(out)
    mixing = mx.eye(n) + 0.1 * mx.random.normal((n, n))
    x = (mx.random.normal((512, n)) @ mixing) * mx.random.uniform(0.2, 2.0, (n,))
    w = 0.05 * mx.random.normal((out, n))
    h = x.T @ x / x.shape[0]
    u, importance = inverse_factor(h, gpx.DAMPING)
    q, s, b = feedback(np.array(w), u, importance, group, bits, "float16")
    rq, rs, rb = ref.fit_feedback(w, h, group, bits, mx.float16, gpx.DAMPING)

    def output_error(q: Any, s: Any, b: Any) -> float:
        deq = (mx.array(q).reshape(out, -1, group) * mx.array(s)[..., None] + mx.array(b)[..., None]).reshape(out, n)
        d = w - deq
        return float(mx.trace(d @ h @ d.T).item())

    # A near-tie rounded the other way moves the later columns a little (a dropped block update moves a quarter
    # of the levels and half of the grids).
    assert np.mean(np.array(rq) == q) >= 0.98
    assert np.mean(np.array(rs) == s) >= 0.95
    fast, slow = output_error(q, s, b), output_error(rq, rs, rb)
    assert abs(fast - slow) <= 0.01 * slow


def test_rows_split_over_threads_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output rows are independent in the grid search and the feedback: parts of 8 rows on every thread give the
    levels, scales and biases of one part, bit for bit."""
    mx.random.seed(5)
    n = 128
    x = mx.random.normal((256, n)) @ (mx.eye(n) + 0.2 * mx.random.normal((n, n)))
    w = np.array(0.05 * mx.random.normal((96, n)))
    u, importance = inverse_factor(x.T @ x / 256, gpx.DAMPING)
    monkeypatch.setattr(imx, "MIN_PART", 10**6)
    whole = feedback(w, u, importance, 64, 4, "float16")
    monkeypatch.setattr(imx, "MIN_PART", 8)
    monkeypatch.setattr(imx.os, "cpu_count", lambda: 12)
    monkeypatch.setattr(imx, "_POOL", [])
    split = feedback(w, u, importance, 64, 4, "float16")
    assert all(np.array_equal(a, b) for a, b in zip(whole, split, strict=True))


def test_inverse_factor_is_the_cholesky_factor_of_the_inverse() -> None:
    """U upper triangular with UᵀU = (H + damping)⁻¹, as the definition computes it (invert, then factor)."""
    mx.random.seed(7)
    x = mx.random.normal((300, 96)) @ (mx.eye(96) + 0.3 * mx.random.normal((96, 96)))
    h = x.T @ x / 300
    h[5, :], h[:, 5] = 0.0, 0.0  # a channel the calibration never drives
    u, importance = inverse_factor(h, gpx.DAMPING)
    damped = h + mx.diag(mx.where(mx.diagonal(h) <= 0, 1.0, 0.0) + gpx.DAMPING * mx.mean(mx.diagonal(h)))
    expected = mx.linalg.cholesky(mx.linalg.inv(damped, stream=mx.cpu), upper=True, stream=mx.cpu)
    assert np.allclose(u, np.array(expected), rtol=1e-3, atol=1e-5 * np.abs(u).max())
    assert importance[5] == 0 and np.array_equal(np.delete(importance, 5), np.delete(np.diag(np.array(h)), 5))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_scales_round_as_mlx_casts(dtype: Any) -> None:
    mx.random.seed(6)
    v = mx.concatenate([mx.random.normal((4096,)) * 0.01, mx.random.uniform(-3, 3, (4096,))])
    # halfway cases of bfloat16 (the low 16 bits exactly 0x8000) and of float16
    ties = mx.array(np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32))
    # float16's ties, its subnormals (below 2^-14, some halfway), what rounds to its largest value or past it
    edges = [1 + 2**-11, 1 + 3 * 2**-11, 3e-5, -(2**-20), 2.5 * 2**-24, 3.5 * 2**-24, 1e-9, 65504, 65519, 65520, 7e4]
    v = mx.concatenate([v, ties, mx.array(edges, mx.float32)])
    expected = np.array(v.astype(dtype).astype(mx.float32))
    assert np.array_equal(round_all(np.array(v), DTYPES[dtype_name(dtype)]), expected)


def test_layers_reading_one_input_share_one_array() -> None:
    """q/k/v read the normed hidden state, gate/up the other: one array each (computed once), equal to the
    statistic of that input computed here; o_proj and down_proj have their own."""
    model = tiny()
    tokens = mx.random.randint(0, CONFIG["vocab_size"], (2, 16))
    hess = input_hessians(model, tokens, batch_size=1)
    imp = activation_importance(model, tokens, batch_size=1)
    p = "model.layers.1."
    for stats in (hess, imp):
        attn = stats[p + "self_attn.q_proj"]
        assert stats[p + "self_attn.k_proj"] is attn and stats[p + "self_attn.v_proj"] is attn
        assert stats[p + "mlp.up_proj"] is stats[p + "mlp.gate_proj"]
        assert stats[p + "self_attn.o_proj"] is not attn and stats[p + "mlp.down_proj"] is not attn
    layer = model.model.layers[1]
    h = model.model.layers[0](model.model.embed_tokens(tokens), mask="causal")
    mid = h + layer.self_attn(layer.input_layernorm(h), mask="causal")
    x = layer.post_attention_layernorm(mid).reshape(-1, CONFIG["hidden_size"])
    assert mx.allclose(hess[p + "mlp.up_proj"], x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
    assert mx.allclose(imp[p + "mlp.up_proj"], (x * x).mean(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recipe", ["gpx-q4", "imx-4.6", "gpx-q4+kd2"])
def test_progress_names_every_quantized_layer_once(recipe: str) -> None:
    """A line per layer as it is done, then (`+kd`) one per distillation step."""
    seen: list[str] = []
    model, _ = apply_recipe(
        tiny(), dict(CONFIG), parse_weights(recipe), mx.random.randint(0, 256, (8, 16)), progress=seen.append
    )
    quantized = [p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)]
    steps = parse_weights(recipe).distill_steps
    layers, distilled = seen[: len(seen) - steps], seen[len(seen) - steps :]
    assert sorted(layers) == sorted(f"quantized {p}" for p in quantized)
    first, last = (f"quantized model.layers.{i}.mlp.down_proj" for i in (0, 3))
    assert layers.index(first) < layers.index(last)
    assert [line.split(":")[0] for line in distilled] == [f"distilled step {i + 1}/{steps}" for i in range(steps)]


def test_a_bench_tallies_the_layers_and_steps() -> None:
    """`kvrig bench quality` runs many recipes: their line per layer and per step become counts (one at the end,
    and one every few seconds while they run); the other lines pass as they are."""
    from kvrig.quality import bench

    seen: list[str] = []
    tally = bench.Tally(seen.append, every_s=3600)
    model, _ = apply_recipe(
        tiny(), dict(CONFIG), parse_weights("gpx-q4+kd2"), mx.random.randint(0, 256, (8, 16)), progress=tally
    )
    assert seen == []
    tally("a line of another kind")  # closes the recipe's count before it: each recipe's count is its own
    quantized = [p for p, m in model.named_modules() if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)]
    assert seen == [f"layers quantized: {len(quantized)}, distillation steps: 2", "a line of another kind"]
    tally.close()
    assert len(seen) == 2  # nothing counted since
    # A slow recipe shows where it is: every line once every_s has passed (here: always).
    often: list[str] = []
    running = bench.Tally(often.append, every_s=0)
    for line in ("quantized model.layers.0.mlp.up_proj", "quantized model.layers.0.mlp.down_proj"):
        running(line)
    assert often == [
        "layers quantized: 1 (last: quantized model.layers.0.mlp.up_proj)",
        "layers quantized: 2 (last: quantized model.layers.0.mlp.down_proj)",
    ]


def test_a_goal_nothing_qualified_for_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrig.cli.bench import _print_quality
    from kvrig.quality import bench

    goal = "a <= 4.0 bits/weight recipe within +10.0 % PPL on every kind (legal)"
    report = bench.QualityReport(
        model="m", text={"legal": []}, calibration={}, goals=[{"goal": goal, "met": False, "best": None}]
    )
    _print_quality(report, [])
    assert f"[MISSED] {goal}: nothing this run measured qualifies" in capsys.readouterr().out


def test_statistics_kept_for_the_next_recipe_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvrig package` trying gpx-q4 then gpx-4.6 on one source: the Hessians are measured for the first only,
    the second fits only what it does not keep at q4's grid (stacks of layers as q4 stacked them), and it writes
    what it writes when it measures and fits everything itself."""
    measured: list[int] = []
    real = recipes.input_hessians
    monkeypatch.setattr(recipes, "input_hessians", lambda *a, **k: measured.append(1) or real(*a, **k))
    fitted: list[tuple[int, int]] = []
    real_fit = recipes.fit_feedback
    monkeypatch.setattr(
        recipes, "fit_feedback", lambda w, h, g, b, *a: fitted.append((g, b)) or real_fit(w, h, g, b, *a)
    )
    calibration = mx.random.randint(0, 256, (4, 16))
    kept = CalibrationStatistics()
    apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-q4"), calibration, statistics=kept)
    assert set(fitted) == {(64, 4)}
    fitted.clear()
    again, _ = apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-4.6"), calibration, statistics=kept)
    assert len(measured) == 1
    fitted_after_q4 = len(fitted)
    fitted.clear()
    alone, _ = apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-4.6"), calibration)
    assert len(measured) == 2
    assert 0 < fitted_after_q4 < len(fitted)  # gpx-q4's stacks were reused, not fitted again
    for (path, a), (_, b) in zip(tree_flatten(again.parameters()), tree_flatten(alone.parameters()), strict=True):
        assert mx.array_equal(a, b), path


def test_each_hessian_is_inverted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpx-4.6 fits a layer's q projection and its k/v projections at different grids from one Hessian: its
    inverse factor is computed once per Hessian and damping, however many stacks read it."""
    inverted: list[int] = []
    real = gpx.inverse_factor
    monkeypatch.setattr(gpx, "inverse_factor", lambda h, d: inverted.append(id(h)) or real(h, d))
    fitted: list[int] = []
    real_fit = recipes.fit_feedback
    monkeypatch.setattr(recipes, "fit_feedback", lambda w, h, *a: fitted.append(id(h)) or real_fit(w, h, *a))
    kept = CalibrationStatistics()
    apply_recipe(tiny(), dict(CONFIG), parse_weights("gpx-4.6"), mx.random.randint(0, 256, (4, 16)), statistics=kept)
    assert len(fitted) > len(set(fitted))  # some Hessian fed stacks at two grids
    assert sorted(inverted) == sorted(set(fitted))


@pytest.mark.parametrize("recipe", ["gpx-q4", "imx-4.6"])
def test_calibration_ids_past_the_vocabulary_are_refused(recipe: str) -> None:
    """A tokenizer that is not the model's gave ids past the embedding: gpx wrote NaN scales without a word."""
    from kvrig.exceptions import QuantizationError

    ids = mx.array([[0, 1, CONFIG["vocab_size"]]])
    with pytest.raises(QuantizationError, match="past the model's vocabulary"):
        apply_recipe(tiny(), dict(CONFIG), parse_weights(recipe), ids)
