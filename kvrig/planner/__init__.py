"""Memory planning: exact weight and KV-cache bytes per scheme, the device limit, and the context that fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrig.exceptions import PlanInputError
from kvrig.models import load_model_spec
from kvrig.planner.kv import kv_bytes
from kvrig.planner.memory import MemoryPlan, PlanRequest, plan_memory
from kvrig.profiles import load_profile
from kvrig.schemas import validate_data

__all__ = ["MemoryPlan", "PlanRequest", "kv_bytes", "plan", "plan_memory"]


def plan(
    model: str | Path | None, device: str | Path, request: PlanRequest | None = None, **options: Any
) -> MemoryPlan:
    """Plan `model` (directory, config.json, GGUF; None: the embedded SmolLM2) on `device` (ProductType,
    profile name or profile file) for `request`, or for a request of `options` (PlanRequest's fields)."""

    if options:
        base = dict(request) if request is not None else {}
        request = validate_data(PlanRequest, {**base, **options}, error=PlanInputError)
    return plan_memory(load_model_spec(model), load_profile(device), request)
