"""Every model module the installed mlx-lm ships plans through the command line, with default options and with
every weight recipe in the grammar, without a traceback; each recipe is listed with its bytes or as unavailable
with the reason, and the bytes are those of the model really quantized that way.

A tiny model of each module (arch_configs.py: its own ModelArgs, random parameters) is written to a folder and
`kvrig plan FOLDER --device iPhone16,1 --json` runs as the installed command runs it, in child processes
(plan_sweep.py). The expected bytes come from elsewhere: the folder loaded by mlx-lm and quantized as `kvrig
package --weights R` quantizes it (kvrig's `apply_recipe`: mlx-lm's quantize_model, GPTQ and AWQ, kvrig's own
grids), MLX's `nbytes` summed. Round-to-nearest recipes are checked in the default run; the calibrated ones
quantize for real on calibration tokens (minutes for the sweep) and run with `-m slow`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from arch_configs import architectures
from plan_sweep import sweep

from kvrig.models.lazy import REFUSED, refused_here
from kvrig.planner.weights import DEFAULT_RECIPES
from kvrig.recipes import MIXED_RECIPES, RTN_BITS, WEIGHT_CANDIDATES, parse_weights

DEVICE = "iPhone16,1"
ROUND_TO_NEAREST = ("q2", "q3", "q4", "q5", "q6", "q8", "q4g32", *MIXED_RECIPES, "fp16")
CALIBRATED = ("awq-q4", "gptq-q4", "imx-q4", "gpx-q4", "imx-4.6", "gpx-4.6", "gpx-4.0", "q4+kd2")
# Its layout is chosen by a sensitivity measurement on the weights: listed unavailable, never guessed.
UNPLANNABLE = ("dq-4.6",)
EVERY_RECIPE = (*ROUND_TO_NEAREST, *CALIBRATED, *UNPLANNABLE)

# Architectures whose default recipe (q4) mlx-lm itself cannot quantize: the plan refuses the chosen recipe
# with a QuantizationError (exit 5) naming it and the architecture, and lists every recipe in the recipe run.
DEFAULT_UNAVAILABLE = {
    "afm7": "mlx-lm's FusedLinear.to_quantized takes no `mode`, which mlx-lm's own quantize_model passes",
}

# (architecture, recipe) the plan lists with bytes that the quantizer fails to write: the quantizer's defect,
# not the plan's (strict xfail: once it writes them, the bytes are checked).
_RECORDERS = (
    "kvrig's calibration recorders (input_statistics in quantize/imx.py, which quantize/gpx.py's input_hessians "
    "uses) stand in for every Linear and Embedding without its `weight`, which this model reads directly"
)
QUANTIZER_FAILS: dict[tuple[str, str], str] = {
    **{
        (arch, recipe): _RECORDERS
        for arch in ("gemma3n", "kimi_k3", "llama4_text", "seed_oss")
        for recipe in ("imx-q4", "gpx-q4", "imx-4.6", "gpx-4.6", "gpx-4.0")
    },
    ("dbrx", "gptq-q4"): "a Linear of dbrx is fed a 1-D input, which mlx-lm's GPTQ capture (x.flatten(0, -2)) "
    "cannot take",
    ("deepseek_v32", "gptq-q4"): "its indexer's weights_proj runs only once the keys pass index_topk (2048), "
    "longer than any calibration row, so mlx-lm's GPTQ finds its Hessian empty",
    ("helium", "gptq-q4"): "mlx-lm's tied helium keeps an lm_head it never calls, so GPTQ finds its Hessian empty",
}

# Modules that corrupt the heap of the process that runs them (glibc aborts, here and with mlx-lm alone) get a
# child process each; a crash before their row is written is an xfail with the child's last words.
ALONE = frozenset({"phi3small"})


def _rows(tmp_path_factory: pytest.TempPathFactory, reference: tuple[str, ...], name: str) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp(name)
    return sweep(architectures(), workdir, DEVICE, list(EVERY_RECIPE), list(reference), ALONE)


@pytest.fixture(scope="module")
def rtn_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _rows(tmp_path_factory, ROUND_TO_NEAREST, "rtn")


@pytest.fixture(scope="module")
def calibrated_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _rows(tmp_path_factory, CALIBRATED, "calibrated")


def _run(rows: dict[str, Any], arch: str, run: str) -> dict[str, Any]:
    row = rows[arch]
    if "crashed" in row and arch in ALONE:
        pytest.xfail(f"mlx-lm's {arch} crashed its process ({row['crashed']}): {row['stderr'][-300:]}")
    assert "crashed" not in row, f"the plan sweep's process died on {arch} ({row.get('crashed')}): {row.get('stderr')}"
    result: dict[str, Any] = row[run]
    assert result["traceback"] is None, result["traceback"]
    assert "Traceback" not in result["stderr"], result["stderr"]
    return result


def _refused(result: dict[str, Any], arch: str) -> bool:
    """A module kvrig refuses here (REFUSED) exits 4, an UnsupportedArchitectureError, with its reason."""
    if not refused_here(arch):
        return False
    assert result["exit"] == 4 and REFUSED[arch] in result["stderr"], result["stderr"]
    return True


def _listed(plan: dict[str, Any], recipes: tuple[str, ...]) -> None:
    """Each requested recipe exactly once: with its bytes, or unavailable with a reason."""
    with_bytes, unavailable = plan["weights_by_recipe"], plan["weights_unavailable"]
    assert set(with_bytes) | set(unavailable) == set(recipes)
    assert not set(with_bytes) & set(unavailable)
    assert all(b > 0 for b in with_bytes.values())
    assert all(reason.strip() for reason in unavailable.values())


def _agrees(plan: dict[str, Any], reference: dict[str, Any], recipe: str) -> None:
    """Planned bytes equal the quantized model's; a recipe the plan calls unavailable cannot be quantized."""
    ref = reference[recipe]
    if recipe in plan["weights_by_recipe"]:
        assert "bytes" in ref, f"planned {plan['weights_by_recipe'][recipe]} B but quantizing failed: {ref}"
        assert plan["weights_by_recipe"][recipe] == ref["bytes"]
    else:
        assert "error" in ref, f"unavailable ({plan['weights_unavailable'][recipe]}) but quantized to {ref}"


def test_the_sweep_takes_every_recipe_the_grammar_knows() -> None:
    parsed = [parse_weights(r) for r in EVERY_RECIPE]
    assert {r.method for r in parsed} == {"none", "rtn", "awq", "gptq", "imx", "gpx", "dq"}
    assert {r.bits for r in parsed if r.method == "rtn" and r.mixed is None} == set(RTN_BITS)
    assert {r.group_size for r in parsed if r.method == "rtn"} == {32, 64}
    assert {r.mixed for r in parsed} >= set(MIXED_RECIPES)
    assert {(r.method, r.target_bpw is None) for r in parsed if r.method in ("imx", "gpx")} == {
        (m, qn) for m in ("imx", "gpx") for qn in (True, False)
    }
    assert {r.bits for r in parsed if r.target_bpw and r.method != "dq"} == {3, 4}  # both bases of a target
    assert any(r.distill_steps for r in parsed)
    assert set(DEFAULT_RECIPES) <= set(ROUND_TO_NEAREST)
    assert len(architectures()) > 100


@pytest.mark.parametrize("arch", architectures())
def test_plans_with_default_options(rtn_rows: dict[str, Any], arch: str) -> None:
    result = _run(rtn_rows, arch, "default")
    if _refused(result, arch):
        return
    auto = WEIGHT_CANDIDATES[0]  # what a plan counts for the default `--weights auto`: gpx-q4, q4's layout
    if arch in DEFAULT_UNAVAILABLE:
        assert result["exit"] == 5, result["stderr"]
        assert f"'{auto}'" in result["stderr"] and f"'{arch}'" in result["stderr"]
        return
    assert result["exit"] == 0, result["stderr"]
    plan = json.loads(result["stdout"])
    _listed(plan, (*DEFAULT_RECIPES, auto))
    for recipe in DEFAULT_RECIPES:
        _agrees(plan, rtn_rows[arch]["reference"], recipe)
    assert plan["weights_recipe"] == auto and plan["weights_by_recipe"][auto] == plan["weights_by_recipe"]["q4"]


@pytest.mark.parametrize("arch", architectures())
def test_lists_every_recipe(rtn_rows: dict[str, Any], arch: str) -> None:
    result = _run(rtn_rows, arch, "recipes")
    if _refused(result, arch):
        return
    assert result["exit"] == 0, result["stderr"]
    plan = json.loads(result["stdout"])
    _listed(plan, EVERY_RECIPE)
    assert set(UNPLANNABLE) <= set(plan["weights_unavailable"])


def _plannable() -> list[str]:
    return [a for a in architectures() if not refused_here(a)]


@pytest.mark.parametrize("recipe", ROUND_TO_NEAREST)
@pytest.mark.parametrize("arch", _plannable())
def test_round_to_nearest_bytes_are_the_quantized_models(rtn_rows: dict[str, Any], arch: str, recipe: str) -> None:
    plan = json.loads(_run(rtn_rows, arch, "recipes")["stdout"])
    _agrees(plan, rtn_rows[arch]["reference"], recipe)


def _calibrated_cases() -> list[Any]:
    cases = []
    for arch in _plannable():
        for recipe in CALIBRATED:
            reason = QUANTIZER_FAILS.get((arch, recipe))
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
            cases.append(pytest.param(arch, recipe, marks=marks))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "recipe"), _calibrated_cases())
def test_calibrated_bytes_are_the_quantized_models(calibrated_rows: dict[str, Any], arch: str, recipe: str) -> None:
    plan = json.loads(_run(calibrated_rows, arch, "recipes")["stdout"])
    _agrees(plan, calibrated_rows[arch]["reference"], recipe)


def test_a_recipe_the_architecture_cannot_take_is_listed_and_the_chosen_one_refused(tmp_path: Path) -> None:
    """gpt2 has no down_proj, which mlx-lm's mixed recipes place by: listed unavailable with mlx-lm's reason
    beside the bytes of the others; chosen, a QuantizationError (exit 5) naming the recipe and architecture."""
    from plan_sweep import run_cli, write_model

    write_model("gpt2", tmp_path / "gpt2")
    base = ["plan", str(tmp_path / "gpt2"), "--device", DEVICE, "--json"]
    listed = run_cli([*base, "--recipes", "q4,mixed_4_6,dq-4.6"])
    assert listed["exit"] == 0 and listed["traceback"] is None, listed["stderr"]
    plan = json.loads(listed["stdout"])
    # the listed recipes and the one the plan counts (`--weights auto`: gpx-q4, q4's layout)
    assert set(plan["weights_by_recipe"]) == {"q4", WEIGHT_CANDIDATES[0]}
    assert set(plan["weights_unavailable"]) == {"mixed_4_6", "dq-4.6"}
    chosen = run_cli([*base, "--weights", "mixed_4_6"])
    assert chosen["exit"] == 5 and chosen["traceback"] is None
    assert "'mixed_4_6'" in chosen["stderr"] and "'gpt2'" in chosen["stderr"]
