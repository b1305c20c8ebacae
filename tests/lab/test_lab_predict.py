"""The lab's predictions plan each phone on the backend its app runs on: a virtual iPhone's app runs MLX on
the host's CPU (unfused attention, prefill scores materialized), a real phone's on Metal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrig.lab.predict import Predictor
from kvrig.models import load_model_spec
from kvrig.planner import MemoryPlan, PlanRequest, plan_memory
from kvrig.profiles import AppMemoryLimit, SourcedInt, list_profiles, load_profile
from kvrig.schemas.lab import LabDevice, MatrixEntry, PlanOptions
from tests.appgen.conftest import REFERENCE_KVCACHE

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "testapp-model" / "config.json"
MIB = 1 << 20
# Weights large beside the KV a limit holds: a 4B model, its config only (the planner builds it lazily).
QWEN3_4B = ROOT / "tests" / "data" / "field" / "configs" / "qwen3-4b.json"


def reference_plan(backend: str) -> int | None:
    """The planner asked directly, with the lab file's limit and baseline, on a named backend (weights loaded)."""
    return reference(backend).max_context["fp16"]


def reference(backend: str, model: Path = MODEL, limit_bytes: int = 160 * MIB) -> MemoryPlan:
    profile = load_profile("iphone-15-pro")
    limit = SourcedInt(value=limit_bytes, basis="reported", source="test")
    baseline = SourcedInt(value=48 * MIB, basis="reported", source="test")
    profile = profile.model_copy(
        update={"app_memory_limit": AppMemoryLimit(default_bytes=limit), "app_baseline_bytes": baseline}
    )
    opts = PlanOptions()  # the lab's defaults: no margin
    return plan_memory(
        load_model_spec(model),
        profile,
        PlanRequest(
            schemes=("fp16",),
            weights=opts.weights or "auto",  # an entry without a bundle is planned as kvrig plan does
            margin=opts.margin,
            limit="default",  # the lab file's limit_bytes: every app's, whatever it declares
            prefill_step=opts.prefill_step,
            contexts=(1024,),
            backend=backend,  # type: ignore[arg-type]
        ),
    )


def test_a_virtual_iphone_is_planned_on_the_cpu_and_a_phone_on_metal() -> None:
    entry = MatrixEntry.model_validate(
        {"name": "grow", "app_id": "com.example.app", "model": str(MODEL), "schemes": ["fp16"]}
    )
    device = LabDevice(udid="any", profile="iphone-15-pro", limit_bytes=160 * MIB, baseline_bytes=48 * MIB)
    predictor = Predictor([])
    virtual = predictor.predict(entry, entry.schemes[0], "iphone-15-pro", device, virtual=True)
    phone = predictor.predict(entry, entry.schemes[0], "iphone-15-pro", device, virtual=False)
    cpu, metal = reference_plan("cpu"), reference_plan("metal")
    # head dim 64: Metal's fused attention keeps no scores, the CPU holds them, so the two plans differ
    assert cpu is not None and metal is not None and cpu < metal
    assert virtual is not None and virtual.max_context == cpu
    assert phone is not None and phone.max_context == metal


@pytest.mark.parametrize("layout", ["loaded", "mapped"])
def test_a_run_is_planned_with_its_weights_where_the_app_holds_them(tmp_path: Path, layout: str) -> None:
    """Mapped weights leave the footprint: a mapped run is the loaded plan of a phone whose limit is larger by the
    weights' bytes. A bundle laid out to load is loaded whatever the run asks (the app falls back), and said so."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    kv = REFERENCE_KVCACHE.model_copy(
        update={"weights_layout": layout, "weights_alignment_bytes": 16384 if layout == "mapped" else None}
    )
    (bundle / "kvcache.json").write_text(kv.model_dump_json(by_alias=True))
    entry = MatrixEntry.model_validate(
        {"app_id": "com.example.app", "model": str(QWEN3_4B), "bundle_path": str(bundle), "schemes": ["fp16"]}
    )
    device = LabDevice(udid="any", profile="iphone-15-pro", limit_bytes=3072 * MIB, baseline_bytes=48 * MIB)
    notes: list[str] = []
    predictor = Predictor(notes)
    got = {
        asked: predictor.predict(entry, entry.schemes[0], "iphone-15-pro", device, virtual=True, residency=asked)
        for asked in (None, "loaded", "mapped")
    }
    loaded = reference("cpu", QWEN3_4B, 3072 * MIB)
    mapped = reference("cpu", QWEN3_4B, 3072 * MIB + loaded.weights_bytes).max_context["fp16"]
    assert mapped > loaded.max_context["fp16"]
    held = {"loaded": loaded.max_context["fp16"], "mapped": mapped}
    expected = {None: held[layout], "loaded": held["loaded"], "mapped": held[layout]}
    assert {asked: p.max_context if p else None for asked, p in got.items()} == expected
    said = [n for n in notes if "mapped weights asked of a bundle laid out to load" in n]
    assert len(said) == (0 if layout == "mapped" else 1), notes
    assert all(n.startswith(f"{entry.label}/fp16: ") for n in said), said


@pytest.mark.parametrize(
    ("asked", "entitled", "kind", "why"),
    [
        ("app", True, "entitled", "declares com.apple.developer.kernel.increased-memory-limit"),
        ("app", False, "default", "does not declare"),
        ("app", None, "default", "is not known"),
        ("default", True, "default", "plan.limit: default"),
        ("entitled", False, "entitled", "plan.limit: entitled"),
    ],
)
def test_a_run_is_predicted_against_the_limit_its_app_gets(
    asked: str, entitled: bool | None, kind: str, why: str
) -> None:
    entry = MatrixEntry.model_validate(
        {"app_id": "com.example.app", "model": str(MODEL), "schemes": ["fp16"], "plan": {"limit": asked}}
    )
    profile = load_profile("iphone-15-pro")
    assert profile.limit_entitled is not None and profile.limit_entitled > profile.limit_default
    device = LabDevice(udid="any", baseline_bytes=48 * MIB)  # no limit of the lab file's: the profile's
    got = Predictor([]).predict(entry, entry.schemes[0], "iphone-15-pro", device, entitled=entitled)
    assert got is not None and got.limit_source is not None
    assert got.limit_bytes == (profile.limit_entitled if kind == "entitled" else profile.limit_default)
    assert f"iphone-15-pro's {kind} limit" in got.limit_source and why in got.limit_source, got.limit_source


def test_an_entitled_app_gets_the_default_limit_where_the_profile_knows_no_other() -> None:
    entry = MatrixEntry.model_validate({"app_id": "com.example.app", "model": str(MODEL), "schemes": ["fp16"]})
    profile = next(p for p in list_profiles() if p.limit_entitled is None)
    got = Predictor([]).predict(entry, entry.schemes[0], profile.name, LabDevice(udid="any"), entitled=True)
    assert got is not None and got.limit_bytes == profile.limit_default
    assert got.limit_source is not None and "knows no entitled limit" in got.limit_source
    # A lab file's limit_bytes (a virtual iPhone started with one) is every app's.
    pinned = LabDevice(udid="any", limit_bytes=160 * MIB)
    got = Predictor([]).predict(entry, entry.schemes[0], "iphone-15-pro", pinned, entitled=True)
    assert got is not None and got.limit_bytes == 160 * MIB and "every app's" in (got.limit_source or "")
