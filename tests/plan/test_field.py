"""kvrig's device profiles and planner against field reports: real apps on real iPhones (tests/data/field/
reports.yaml, each fact with its source). Where kvrig and a report disagree, the report is right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, plan_memory
from kvrig.planner.kv import context_schedule, kv_bytes
from kvrig.profiles import load_profile
from kvrig.recipes import parse_kv

FIELD = Path(__file__).parents[1] / "data" / "field"
REPORTS: dict[str, list[dict[str, Any]]] = yaml.safe_load((FIELD / "reports.yaml").read_text())
MIB = 1024 * 1024


def _expected(fact: dict[str, Any]) -> tuple[float, float]:
    value = fact["bytes"] if "bytes" in fact else fact["mib"] * MIB
    return value, fact["tolerance_mib"] * MIB


def _id(fact: dict[str, Any]) -> str:
    return f"{fact.get('device') or fact.get('model')}-{fact['kind']}"


@pytest.mark.parametrize("fact", REPORTS["limits"], ids=_id)
def test_app_memory_limit(fact: dict[str, Any]) -> None:
    profile = load_profile(fact["device"])
    value, tolerance = _expected(fact)
    if fact["kind"] == "limit_at_least":
        assert max(profile.limit_default, profile.limit_entitled or 0) >= value, fact["source"]
        return
    got = profile.limit_default if fact["kind"] == "limit_default" else profile.limit_entitled
    assert got is not None, fact["source"]
    assert abs(got - value) <= tolerance, (got, value, fact["source"])


@pytest.mark.parametrize("fact", REPORTS["gpu"], ids=_id)
def test_metal_limits(fact: dict[str, Any]) -> None:
    profile = load_profile(fact["device"])
    value, tolerance = _expected(fact)
    got = profile.gpu_working_set if fact["kind"] == "gpu_working_set" else profile.gpu_max_buffer
    assert got is not None, fact["source"]
    assert abs(got - value) <= max(tolerance, 1), (got, value, fact["source"])


def _models(kind: str) -> list[dict[str, Any]]:
    return [f for f in REPORTS["models"] if f["kind"] == kind]


@pytest.mark.parametrize("fact", _models("kv_bytes"), ids=_id)
def test_kv_bytes(fact: dict[str, Any]) -> None:
    spec = load_model_spec(FIELD / "configs" / fact["config"])
    value, tolerance = _expected(fact)
    got = kv_bytes(spec, parse_kv("fp16"), context_schedule(fact["context"], 512))
    assert abs(got - value) <= tolerance, (got, value, fact["source"])


@pytest.mark.parametrize("fact", _models("kv_bytes"), ids=_id)
def test_plan_json_on_the_published_config_gives_the_reported_kv(fact: dict[str, Any]) -> None:
    """The same fact through the command a user runs: `kvrig plan CONFIG --json` on the published config."""
    config = FIELD / "configs" / fact["config"]
    context = str(fact["context"])
    args = ["plan", str(config), "--device", fact["device"], "--json", "--schemes", "fp16", "--contexts", context]
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, check=True)
    value, tolerance = _expected(fact)
    got = json.loads(proc.stdout)["kv_bytes"]["fp16"][context]
    assert abs(got - value) <= tolerance, (got, value, fact["source"])


@pytest.mark.parametrize("fact", _models("fits"), ids=_id)
def test_planner_lets_what_ran_fit(fact: dict[str, Any]) -> None:
    """No margin, the default limit (the reports do not say the app had the entitlement): a context that ran
    must be within the plan's max context on that phone."""
    spec = load_model_spec(FIELD / "configs" / fact["config"])
    plan = plan_memory(
        spec,
        load_profile(fact["device"]),
        PlanRequest(
            schemes=(fact["scheme"],),
            weights=fact["weights"],
            recipes=(fact["weights"],),
            contexts=(fact["context"],),
            margin=0.0,
            limit="default",
        ),
    )
    assert plan.max_context[fact["scheme"]] >= fact["context"], (plan.max_context, fact["source"])
