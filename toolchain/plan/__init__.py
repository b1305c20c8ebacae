"""Memory planning: exact weight and KV-cache bytes per scheme, the device limit, and the context that fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolchain.plan.kv import kv_bytes
from toolchain.plan.memory import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "kv_bytes", "plan", "plan_memory"]


def plan(model: str | Path | None, device: str | Path, **options: Any) -> MemoryPlan:
    """Plan `model` (directory, config.json, GGUF; None: the embedded SmolLM2) on `device` (ProductType,
    profile name or profile file)."""
    from toolchain.models import load_model_spec
    from toolchain.profiles import load_profile

    return plan_memory(load_model_spec(model), load_profile(device), **options)
