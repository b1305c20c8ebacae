"""Choosing by measurement (`--kv auto`, `--fit`): what is measured, how it is ranked, and a refusal that names
the closest option. Tiny models built from arguments; the real SmolLM2 end to end is in test_quality_model.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import yaml
from mlx_lm.models.cache import make_prompt_cache

from kvrig.bundle.kvcache_json import host_config
from kvrig.exceptions import DoesNotFitError
from kvrig.kvcache.caches import make_caches
from kvrig.models.spec import ModelSpec
from kvrig.quality import choose
from kvrig.quality.choose import KV_AUTO, KV_FALLBACK, KV_LIMIT_PCT, SourceWithKV, choose_kv, rank_fit
from kvrig.quality.gate import GateTexts, kind_perplexities
from kvrig.quality.perplexity import perplexity
from kvrig.recipes import parse_kv
from kvrig.schemas.bundle import Candidate
from tests.quality.test_kv_schemes import tiny

PROFILES = Path(__file__).resolve().parents[2] / "device_profiles"


def _texts(model: object) -> GateTexts:
    ids = {
        kind: [[int(t) for t in mx.random.randint(0, 97, (80,), key=mx.random.key(i)).tolist()]]
        for i, kind in enumerate(("a", "b"))
    }
    return GateTexts(ids, {k: perplexity(model, p[0], make_prompt_cache(model)).ppl for k, p in ids.items()})


def _with_kv(model: object, spec: ModelSpec, texts: GateTexts) -> SourceWithKV:
    """The source's perplexities through a KV configuration's caches, as the packager measures them."""
    return lambda kv, enough: kind_perplexities(model, kv, spec.model_type, texts.ids, enough=enough)


def test_kv_auto_measures_both_spellings_and_keeps_the_one_that_rises_least() -> None:
    model, spec = tiny()
    texts = _texts(model)
    kv, candidates, why = choose_kv(_with_kv(model, spec, texts), spec, texts)
    by_name = {c.kv: c for c in candidates}
    assert set(by_name) == set(KV_AUTO + KV_FALLBACK)
    # the measurement is the gate's: the worst text's change, recomputed here from the caches themselves, up to
    # the first text above the limit (a spec over it is not measured further)
    for name in KV_AUTO:
        caches = host_config(spec, parse_kv(name))
        changes = []
        for k, p in texts.ids.items():
            ppl = perplexity(model, p[0], make_caches(model, caches, "llama")).ppl
            changes.append(round(100 * (ppl / texts.source_ppl[k] - 1), 3))
            if changes[-1] > KV_LIMIT_PCT:
                break
        assert by_name[name].ppl_delta_pct == max(changes)
        assert by_name[name].reason.endswith("not measured") == (len(changes) < len(texts.ids))
    # The tiny model's k8v4 spellings pass (the next test makes them fail).
    passing = [by_name[n] for n in KV_AUTO if (by_name[n].ppl_delta_pct or 0) <= KV_LIMIT_PCT]
    assert passing, candidates
    best = min(passing, key=lambda c: c.ppl_delta_pct or 0.0)
    assert best.verdict == "chosen" and kv.name == best.kv and best.kv in why
    assert sum(c.verdict == "chosen" for c in candidates) == 1
    # a larger spec cannot win once a smaller one passes: never measured, still listed with its bytes
    for name in KV_FALLBACK:
        assert (by_name[name].verdict, by_name[name].ppl_delta_pct) == ("not tried", None)
        assert (by_name[name].kv_bytes or 0) > (best.kv_bytes or 0)


def test_kv_auto_measures_larger_specs_only_when_no_smaller_one_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = tiny()
    monkeypatch.setattr(choose, "KV_LIMIT_PCT", -1.0)  # nothing passes, so every group is measured in turn
    texts = _texts(model)
    kv, candidates, _ = choose_kv(_with_kv(model, spec, texts), spec, texts)
    assert [c.kv for c in candidates] == list(KV_AUTO + KV_FALLBACK)
    assert all(c.verdict == "over the limit" and c.ppl_delta_pct is not None for c in candidates)
    assert kv.name == "fp16"


def test_kv_auto_says_why_a_rotation_is_unavailable() -> None:
    model, spec = tiny(head_dim=96)  # no Hadamard matrix of size 96 is its own inverse; 32 divides it
    texts = _texts(model)
    _, candidates, _ = choose_kv(_with_kv(model, spec, texts), spec, texts)
    rotated = next(c for c in candidates if c.kv == "k8v4+rot")
    assert rotated.verdict == "unavailable" and rotated.reason  # the typed error's message, not a traceback


def test_fit_ranks_pairs_by_measured_quality_then_footprint() -> None:
    pairs = [
        Candidate(weights="q8", kv="fp16", weights_bytes=900, kv_bytes=400, max_context=5000, verdict="passed"),
        Candidate(weights="gpx-q4", kv="k8v4", weights_bytes=500, kv_bytes=150, max_context=9000, verdict="passed"),
        Candidate(
            weights="gpx-q4", kv="k4v4+rot", weights_bytes=500, kv_bytes=100, max_context=12000, verdict="passed"
        ),
        Candidate(weights="q8", kv="k8v4", weights_bytes=900, kv_bytes=150, max_context=3000, verdict="does not fit"),
    ]
    ranked = rank_fit(pairs, {"q8": 0.1, "gpx-q4": 3.0}, {"fp16": 0.0, "k8v4": 0.4, "k4v4+rot": 0.4})
    assert [(p.weights, p.kv) for p in ranked] == [("q8", "fp16"), ("gpx-q4", "k4v4+rot"), ("gpx-q4", "k8v4")]
    assert [p.ppl_delta_pct for p in ranked] == [0.1, 3.4, 3.4]  # the tie goes to the smaller footprint


def _fit(tmp_path: Path, device: str, context: int) -> subprocess.CompletedProcess[str]:
    out = f"{tmp_path}/never"
    cmd = [sys.executable, "-m", "kvrig", "package", "--device", device, "--fit", str(context), "-o", out]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_fit_past_the_models_trained_context_says_so(tmp_path: Path) -> None:
    proc = _fit(tmp_path, "iPhone16,1", 50_000)
    assert proc.returncode == DoesNotFitError.exit_code == 6, proc.stderr
    assert "the model's trained context is 8192 tokens" in proc.stderr and "Traceback" not in proc.stderr


def test_fit_that_no_pair_holds_names_the_closest_pair_and_devices_that_would(tmp_path: Path) -> None:
    # An iPhone 15 Pro profile whose app may use 230 MiB: the weights, baseline and buffer cache leave room for a
    # few thousand tokens, not for SmolLM2's whole 8192.
    profile = yaml.safe_load((PROFILES / "iphone-15-pro.yaml").read_text())
    profile["name"] = "tight-phone"
    for which in ("default_bytes", "entitled_bytes"):
        profile["app_memory_limit"][which]["value"] = 230 * 2**20
    path = tmp_path / "tight-phone.yaml"
    path.write_text(yaml.safe_dump(profile))
    proc = _fit(tmp_path, str(path), 8192)
    assert proc.returncode == 6, proc.stderr
    message = proc.stderr
    assert "nothing holds 8192 tokens on tight-phone: the closest is " in message and "Traceback" not in message
    assert "would hold it on iphone-" in message  # a real phone of kvrig's holds it with the smallest pair


def test_fit_kv_candidates_are_spelled_as_the_kv_grammar_writes_them() -> None:
    """`--fit` records these names in the manifest; each is the canonical spelling of the spec it parses to."""
    for name in choose.FIT_KV:
        assert parse_kv(name).name == name
