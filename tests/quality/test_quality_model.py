"""Quality on the real SmolLM2-135M: `kvrig package` with every default chooses the smallest recipe that passes
its quality gate, and that bundle answers as the source does. (The gate refusing a broken bundle, and 8-bit KV
keeping the greedy tokens: test_gate_model.py, a file of its own so a second worker runs it beside this one.)"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from kvrig.bundle.options import PackageOptions
from kvrig.models import load_model_spec
from kvrig.packaging import package
from kvrig.quantize.base import load_source_model
from tests.bundle_fixtures import converted_source


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_source(tmp_path_factory)


@pytest.fixture(scope="module")
def default_bundle(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`kvrig package` with every default: weights and KV chosen by measurement on SmolLM2."""
    out = tmp_path_factory.mktemp("default") / "bundle"
    package(source, out, PackageOptions())
    return out


def test_defaults_choose_the_smallest_recipe_that_passes_the_gate(default_bundle: Path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import compute_bits_per_weight, load_model

    from kvrig.bundle.manifest import load_manifest
    from kvrig.quality.choose import KV_AUTO
    from kvrig.recipes import WEIGHT_CANDIDATES

    manifest = load_manifest(default_bundle)
    q, choice = manifest.quality, manifest.choice
    assert q is not None and q.passed and not q.forced
    assert {k.kind for k in q.kinds} == {"prose", "python-held-out", "manual"}
    assert q.ppl_delta_pct == max(k.ppl_delta_pct for k in q.kinds) <= PackageOptions().max_ppl_increase_pct
    # The recipe: the first candidate that passed; every smaller one failed the gate, none larger was tried.
    assert choice is not None
    verdicts = [(c.weights, c.verdict) for c in choice.weights]
    chosen = next(i for i, (_, v) in enumerate(verdicts) if v == "chosen")
    assert [w for w, _ in verdicts] == list(WEIGHT_CANDIDATES)
    assert all(v == "failed gate" for _, v in verdicts[:chosen]) and all(
        v == "not tried" for _, v in verdicts[chosen + 1 :]
    )
    assert manifest.recipe.weights == verdicts[chosen][0]
    # A failed candidate's gate stopped at its first text over the limit, or measured them all: its figure is over
    # the limit either way, and what it left unmeasured is named.
    limit = PackageOptions().max_ppl_increase_pct
    for c in choice.weights[:chosen]:
        assert (c.ppl_delta_pct or 0.0) > limit and (c.reason == "" or c.reason.endswith("not measured")), c
    # <= 4.6 bits per weight, by mlx-lm's own count of the bundle as mlx-lm loads it (the host runtime widens
    # some arrays for the CPU, which is not what the phone holds)
    loaded = load_model(default_bundle)[0]
    bpw = compute_bits_per_weight(loaded)
    assert bpw <= 4.6 and manifest.choice.weights[chosen].bits_per_weight == round(bpw, 3)
    # every candidate measured has its bytes, with no device to plan for too: MLX's nbytes of what was written
    assert manifest.choice.weights[chosen].weights_bytes == sum(a.nbytes for _, a in tree_flatten(loaded.parameters()))
    assert all(c.weights_bytes for c in choice.weights[: chosen + 1])
    # The KV spec: both k8v4 spellings measured; the one chosen rose least.
    measured = {c.kv: c for c in choice.kv if c.kv in KV_AUTO}
    assert set(measured) == set(KV_AUTO) and all(c.ppl_delta_pct is not None for c in measured.values())
    winner = min(measured.values(), key=lambda c: c.ppl_delta_pct or 0.0)
    assert winner.verdict == "chosen"
    kv = json.loads((default_bundle / "kvcache.json").read_text())
    assert (kv["scheme"], kv["rotation"]) == ("k8v4", "hadamard" if winner.kv.endswith("+rot") else "none")


def test_default_bundle_answers_facts_as_the_source_does(source: Path, default_bundle: Path) -> None:
    """The issue's check: `kvrig run` on the default bundle names the facts the unquantized model (mlx-lm's
    own float cache) names."""
    import re

    from mlx_lm.utils import load_tokenizer

    from kvrig.quality.bench import FACTUAL_PROMPTS, greedy_answer
    from kvrig.runtime.generate import load_bundle, run_bundle

    loaded = load_bundle(default_bundle)
    # mlx-lm's own model at float32 (the host's float16 layers cast every weight at every decoded token: 4x slower)
    reference = load_source_model(source)[0]
    reference.set_dtype(mx.float32)
    tokenizer = load_tokenizer(source)
    spec = load_model_spec(source / "config.json")
    known = []
    for prompt, expected in FACTUAL_PROMPTS:
        pattern = re.compile(rf"\b({expected})\b", re.IGNORECASE)
        answer = greedy_answer(reference, tokenizer, prompt, spec)
        if not pattern.search(answer):  # the 135M source gets the planet wrong itself: nothing to keep
            continue
        known.append(expected)
        pieces: list[str] = []
        run_bundle(loaded, prompt, max_tokens=16, on_text=pieces.append)
        assert pattern.search("".join(pieces)), (prompt, "".join(pieces), answer)
    assert "paris" in known


def test_a_run_without_kv_variants_plots_weights_only(tmp_path: Path) -> None:
    """`--kv ''` measures no KV memory: no empty kv_memory.png (and no matplotlib warning about its legend)."""
    import warnings

    from kvrig.quality.bench import write_plots
    from kvrig.schemas.quality import QualityReport, Row

    row = Row(recipe="q4", kv="", kind="legal", ppl=20.0, ppl_delta_pct=5.0, tokens=512, bits_per_weight=4.5)
    report = QualityReport(model="m", text={}, calibration={}, source_ppl={"legal/512": 19.0}, weights=[row])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_plots(report, tmp_path)
    names = {p.name: p.stat().st_size for p in paths}
    assert "kv_memory.png" not in names and names["ppl_delta.png"] > 0
