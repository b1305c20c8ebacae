"""The planner's two residencies: loaded weights count in the footprint the jetsam limit judges, mapped weights
count against the mapped-memory ceiling (and Metal's working set) instead. Qwen3-4B at 4 bits on an iPhone 15 Pro
without the entitlement: the issue's case."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvrig.planner import PlanRequest, bundle_residency, plan

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "field" / "configs"
PROFILES = Path(__file__).resolve().parents[2] / "device_profiles"
QWEN3_4B = CONFIGS / "qwen3-4b.json"


def _request(residency: str) -> PlanRequest:
    return PlanRequest(schemes=("k8v4",), weights="q4", recipes=("q4",), limit="default", weights_residency=residency)  # type: ignore[arg-type]


def test_mapped_weights_leave_the_footprint_and_buy_context() -> None:
    loaded = plan(QWEN3_4B, "iPhone16,1", _request("loaded"))
    mapped = plan(QWEN3_4B, "iPhone16,1", _request("mapped"))
    assert loaded.weights_bytes == mapped.weights_bytes > 2 * 2**30  # the same weights, ~2.1 GiB
    assert loaded.limited_by["k8v4"] == "memory"
    assert mapped.max_context["k8v4"] > loaded.max_context["k8v4"]
    # At the context loaded weights allow, the mapped footprint is lower by exactly the weight bytes.
    at = loaded.max_context["k8v4"]
    same = plan(QWEN3_4B, "iPhone16,1", _request("mapped").model_copy(update={"max_context_cap": at}))
    assert same.max_context["k8v4"] == at
    lb, mb = loaded.budget_at_max_context["k8v4"], same.budget_at_max_context["k8v4"]
    assert (lb.weights_bytes, mb.weights_bytes) == (loaded.weights_bytes, 0)
    assert lb.total_bytes - mb.total_bytes == loaded.weights_bytes
    # ... and they count against the mapped-memory ceiling, with its evidence.
    assert loaded.mapped is None and mapped.mapped is not None
    assert mapped.mapped.mapped_bytes == mapped.weights_bytes and mapped.mapped.within_ceiling
    assert "cactus-compute/cactus/issues/793" in mapped.mapped.ceiling_basis
    assert any("mapped" in note for note in mapped.notes)


def test_weights_over_the_mapped_ceiling_hold_no_context(tmp_path: Path) -> None:
    profile = yaml.safe_load((PROFILES / "iphone-15-pro.yaml").read_text())
    profile["name"] = "small-map"
    profile["mapped_memory_limit"] = {
        "default_bytes": {"value": 2**30, "basis": "estimated", "source": "a test's phone: maps 1 GiB"}
    }
    path = tmp_path / "small-map.yaml"
    path.write_text(yaml.safe_dump(profile))
    mapped = plan(QWEN3_4B, path, _request("mapped"))
    assert mapped.max_context["k8v4"] == 0
    assert mapped.limited_by["k8v4"] == "mapped_ceiling" and mapped.binding_limit["k8v4"] == "mapped_ceiling"
    assert mapped.mapped is not None and not mapped.mapped.within_ceiling


def test_a_mapped_bundle_plans_mapped_by_default(tmp_path: Path) -> None:
    assert bundle_residency(None) == "loaded" and bundle_residency(tmp_path) == "loaded"  # no manifest: loaded
    manifest = {
        "schema": 2,
        "tool": "kvrig",
        "tool_version": "0",
        "created": "2026-12-01T00:00:00+00:00",
        "source": {"kind": "hf", "path": "/src", "name": "m", "architecture": "llama"},
        "recipe": {
            "weights": "q4",
            "bits": 4,
            "group_size": 64,
            "kv_scheme": "k8v4",
            "key_bits": 8,
            "value_bits": 4,
            "kv_group_size": 64,
            "weights_layout": "mapped",
            "weights_alignment_bytes": 16384,
        },
        "prediction": None,
        "files": [],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert bundle_residency(tmp_path) == "mapped"
