"""The plan command on a tiny model of each mlx-lm architecture, beside the bytes of that model really quantized.

Run as a script in a process of its own (some modules corrupt the heap of the process that runs them):

    python tests/plan/plan_sweep.py OUT.jsonl WORKDIR --device D --recipes R,R --reference R,R ARCH [ARCH ...]

For each architecture it writes a model folder (config.json from the module's own ModelArgs, arch_configs.py;
model.safetensors: the parameters of mlx-lm's own model for it, random), then runs `kvrig plan FOLDER --device D
--json` as the command line does (`kvrig.cli.main`: its exit code, stdout, stderr, and any uncaught exception's
traceback), once with default options and once with `--recipes`, and quantizes the folder as `kvrig package`
does (mlx-lm's `load_model`, kvrig's `apply_recipe`; calibrated recipes on random tokens) for each reference
recipe: MLX's `nbytes` of the result, or the error's type and message. One JSON line per architecture, written
as soon as it is done, so a crash loses only the architecture that crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

# The every-recipe run budgets with fp16 weights, which every architecture takes (its recipes are listed either
# way), and a fast KV part: the default run already plans every named scheme.
RECIPE_RUN_OPTIONS = ("--weights", "fp16", "--schemes", "fp16", "--contexts", "1024")

# Changes to the tiny configs for the sweep, each for a reason of its own.
SWEEP_CONFIG: dict[str, dict[str, Any]] = {
    # Untied where mlx-lm cannot load its own tied checkpoint (so `kvrig package` could not either): minicpm's
    # sanitize adds lm_head.weight when the checkpoint has none, which the tied model then refuses;
    # qwen3_vl_moe's sanitize reads the checkpoint's lm_head.
    "minicpm": {"tie_word_embeddings": False},
    "qwen3_vl_moe": {"tie_word_embeddings": False},
    # 32-wide kv_b_proj and expert down_proj inputs stay float under group 64, out of reach of mlx-lm's AWQ,
    # whose deepseek_v2 map scales them (published models: 512 and 1408).
    "deepseek_v2": {"kv_lora_rank": 64, "moe_intermediate_size": 64},
}


def write_model(name: str, folder: Path) -> None:
    """config.json and the random parameters of mlx-lm's own model for the architecture's tiny config (only
    the model type where kvrig refuses the architecture by name: its module may not even import)."""
    import mlx.core as mx
    from arch_configs import tiny_config
    from mlx.utils import tree_flatten

    from kvrig.compat.mlx_lm_classes import model_classes
    from kvrig.models.lazy import refused_here

    folder.mkdir(parents=True, exist_ok=True)
    if refused_here(name):
        (folder / "config.json").write_text(json.dumps({"model_type": name}))
        return
    config = tiny_config(name)
    for key, value in SWEEP_CONFIG.get(name, {}).items():
        config[key] = value
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], key: value}
    (folder / "config.json").write_text(json.dumps(config))
    with contextlib.redirect_stdout(io.StringIO()):
        model_cls, args_cls = model_classes(config)
        model = model_cls(args_cls.from_dict(config))
    mx.random.seed(0)
    flat: dict[str, Any] = dict(tree_flatten(model.parameters()))
    mx.eval(flat)
    # Small noise for arrays the module initializes to zero: they would hand calibrated quantizers all-zero
    # inputs (an empty GPTQ Hessian), which no trained checkpoint does. Other values stay (Hadamard signs).
    for k, v in flat.items():
        if mx.issubdtype(v.dtype, mx.floating) and not v.any().item():
            flat[k] = (0.02 * mx.random.normal(v.shape)).astype(v.dtype)
    mx.eval(flat)
    mx.save_safetensors(str(folder / "model.safetensors"), flat)  # type: ignore[arg-type]


def run_cli(argv: list[str]) -> dict[str, Any]:
    """`kvrig ARGV` in this process as the installed command runs it: exit code, stdout, stderr, traceback."""
    from kvrig.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    trace = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code or 0
        except BaseException:  # what `python -m kvrig` would die of, with a traceback
            code = 1
            trace = traceback.format_exc()
    return {"exit": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "traceback": trace}


def reference_bytes(folder: Path, recipe_name: str) -> dict[str, Any]:
    """The folder quantized as `kvrig package --weights R` does: MLX's nbytes of every parameter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvrig.quantize.base import load_source_model
    from kvrig.quantize.recipes import apply_recipe
    from kvrig.recipes import parse_weights

    recipe = parse_weights(recipe_name)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model, config = load_source_model(folder)
            calibration = None
            if recipe.calibrated:
                mx.random.seed(1)
                vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 128)
                calibration = mx.random.randint(0, min(vocab, 128), (2, 32))
            model, _ = apply_recipe(model, config, recipe, calibration)
            mx.eval(model.parameters())
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:500]}
    return {"bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters()))}


def sweep_one(name: str, workdir: Path, device: str, recipes: list[str], reference: list[str]) -> dict[str, Any]:
    folder = workdir / name
    write_model(name, folder)
    base = ["plan", str(folder), "--device", device, "--json"]
    row: dict[str, Any] = {"arch": name, "default": run_cli(base)}
    if recipes:
        row["recipes"] = run_cli([*base, "--recipes", ",".join(recipes), *RECIPE_RUN_OPTIONS])
    if (folder / "model.safetensors").exists():
        row["reference"] = {r: reference_bytes(folder, r) for r in reference}
    return row


def sweep(
    archs: list[str], workdir: Path, device: str, recipes: list[str], reference: list[str], alone: frozenset[str]
) -> dict[str, dict[str, Any]]:
    """Rows by architecture from this script run in child processes: one for the architectures in `alone`
    each, one for the rest. A child that dies (a module that corrupts the heap) costs the architecture it was
    on, which gets a row of its own with the child's exit code and last words; the rest run in a new child."""
    out = workdir / "sweep.jsonl"
    rows: dict[str, dict[str, Any]] = {}
    batches = [[a] for a in archs if a in alone] + [[a for a in archs if a not in alone]]
    for batch in batches:
        todo = list(batch)
        while todo:
            options = ["--device", device, "--recipes", ",".join(recipes), "--reference", ",".join(reference)]
            child = subprocess.run(
                [sys.executable, __file__, str(out), str(workdir), *options, *todo],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            )
            if out.exists():
                for line in out.read_text().splitlines():
                    row = json.loads(line)
                    rows[row["arch"]] = row
            todo = [a for a in todo if a not in rows]
            if child.returncode != 0 and todo:
                rows[todo[0]] = {"arch": todo[0], "crashed": child.returncode, "stderr": child.stderr[-3000:]}
                todo = todo[1:]
            elif todo:  # a clean exit that skipped architectures: never expected
                raise RuntimeError(f"plan_sweep stopped before {todo}: {child.stderr[-3000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--recipes", default="")
    parser.add_argument("--reference", default="")
    parser.add_argument("archs", nargs="+")
    args = parser.parse_args()
    from kvrig.runtime.blas import load_openblas

    load_openblas()  # the calibrated references run float matmuls (as the CLI has them)
    recipes = [r for r in args.recipes.split(",") if r]
    reference = [r for r in args.reference.split(",") if r]
    with args.out.open("a") as out:
        for name in args.archs:
            row = sweep_one(name, args.workdir, args.device, recipes, reference)
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
