"""The lab's predictions plan each phone on the backend its app runs on: a virtual iPhone's app runs MLX on
the host's CPU (unfused attention, prefill scores materialized), a real phone's on Metal."""

from __future__ import annotations

from pathlib import Path

from kvrig.lab.predict import Predictor
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, plan_memory
from kvrig.profiles import AppMemoryLimit, SourcedInt, load_profile
from kvrig.schemas.lab import LabDevice, MatrixEntry, PlanOptions

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "testapp-model" / "config.json"
MIB = 1 << 20


def reference_plan(backend: str) -> int | None:
    """The planner asked directly, with the lab file's limit and baseline, on a named backend."""
    profile = load_profile("iphone-15-pro")
    limit = SourcedInt(value=160 * MIB, basis="reported", source="test")
    baseline = SourcedInt(value=48 * MIB, basis="reported", source="test")
    profile = profile.model_copy(
        update={"app_memory_limit": AppMemoryLimit(default_bytes=limit), "app_baseline_bytes": baseline}
    )
    opts = PlanOptions()  # the lab's defaults: no margin, the default limit
    plan = plan_memory(
        load_model_spec(MODEL),
        profile,
        PlanRequest(
            schemes=("fp16",),
            weights=opts.weights or "auto",  # an entry without a bundle is planned as kvrig plan does
            margin=opts.margin,
            limit=opts.limit,
            prefill_step=opts.prefill_step,
            contexts=(1024,),
            backend=backend,  # type: ignore[arg-type]
        ),
    )
    return plan.max_context["fp16"]


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
