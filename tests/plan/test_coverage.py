"""Every model module the installed mlx-lm ships plans, exact against MLX.

For each module a tiny model is built from that module's own ModelArgs (tests/plan/arch_configs.py), its
parameters evaluated, and real tokens run through the caches the model makes for itself; the bytes MLX
allocated (`nbytes`) must equal what the planner answers for the same update schedule — step boundary
crossings included. Modules kvrig cannot plan are refused by name with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from arch_configs import architectures, tiny_config
from mlx_lm.models.cache import make_prompt_cache

from kvrig.exceptions import UnsupportedArchitectureError
from kvrig.models import spec_from_config
from kvrig.models.lazy import METAL_ONLY, REFUSED, build_lazy_model, refused_here
from kvrig.planner.kv import kv_bytes
from kvrig.recipes import parse_kv

# A prompt, a decode step, a chunk that crosses the first 256-token step, another decode step.
SCHEDULE = (3, 1, 254, 1)

# Modules whose tiny model runs but whose planned bytes differ from MLX's: a planner bug to fix (strict xfail).
MISPLANNED: dict[str, str] = {}

# phi3small corrupts the heap of the process that ran it (glibc aborts with "double free or corruption" at the
# next allocations or at exit, here and with mlx-lm alone): it runs in a process of its own, whose test result
# counts and whose abort afterwards does not.
OWN_PROCESS = {"phi3small"}
_CHILD = "KVRIG_COVERAGE_CHILD"


def _cases() -> list[object]:
    out: list[object] = []
    for name in architectures():
        marks = []
        if name in MISPLANNED:
            marks.append(pytest.mark.xfail(raises=AssertionError, strict=True, reason=MISPLANNED[name]))
        out.append(pytest.param(name, marks=marks))
    return out


def _node(name: str) -> str:
    return f"test_architecture_plans_exactly[{name}]"


def test_the_sweep_covers_what_mlx_lm_ships() -> None:
    assert len(architectures()) > 100
    assert set(architectures()) >= set(REFUSED)


@pytest.mark.parametrize("name", _cases())
def test_architecture_plans_exactly(name: str, tmp_path: Path) -> None:
    if name in OWN_PROCESS and not os.environ.get(_CHILD):
        # The child writes both numbers to a file before it compares them, and the comparison is made here: its
        # exit status and output say nothing once its heap is corrupt (a failure and a crash look alike).
        record = tmp_path / "bytes.json"
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{_node(name)}"],
            env={**os.environ, _CHILD: str(record)},
            capture_output=True,
            text=True,
        )
        if not record.exists():
            assert "corruption" in child.stderr or child.returncode < 0, child.stdout[-2000:] + child.stderr[-2000:]
            pytest.xfail(f"mlx-lm's {name} crashed its process before the check finished: {child.stderr[-200:]}")
        numbers = json.loads(record.read_text())
        assert numbers["planned"] == numbers["measured"], numbers
        return
    if refused_here(name):
        with pytest.raises(UnsupportedArchitectureError) as err:
            spec_from_config({"model_type": name})
        assert err.value.reason == REFUSED[name] and name in str(err.value)
        return
    config = tiny_config(name)
    spec = spec_from_config(config)
    assert spec.parameter_count() < 20_000_000, "the sweep's models must stay tiny"
    model = build_lazy_model(config)
    mx.eval(model.parameters())  # a real model: MLX allocates and computes everything below
    caches = make_prompt_cache(model)
    token = 1
    for n in SCHEDULE:
        mx.eval(model(mx.array([[(token + i) % 50 + 1 for i in range(n)]]), cache=caches))
        token += n
    measured = sum(c.nbytes for c in caches)
    planned = kv_bytes(spec, parse_kv("fp32", dtype="float32"), SCHEDULE)
    if record_to := os.environ.get(_CHILD):
        Path(record_to).write_text(json.dumps({"planned": planned, "measured": measured}))
    assert planned == measured


@pytest.mark.skipif(mx.metal.is_available(), reason="with Metal these modules run and are planned above")
@pytest.mark.parametrize("name", sorted(METAL_ONLY))
def test_metal_only_modules_cannot_run_without_metal(name: str) -> None:
    """Why they are refused here: mlx-lm's own model, built from its tiny config, cannot run one step."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{name}")
    model = module.Model(module.ModelArgs.from_dict(tiny_config(name)))
    with pytest.raises(RuntimeError, match="Metal"):
        mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))
