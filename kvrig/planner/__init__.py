"""Memory planning: exact weight and KV-cache bytes per scheme, the device limit, and the context that fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrig.exceptions import PlanInputError
from kvrig.models import load_model_spec
from kvrig.planner.kv import kv_bytes
from kvrig.planner.memory import MemoryPlan, PlanRequest, plan_memory
from kvrig.profiles import load_profile
from kvrig.recipes import AUTO
from kvrig.schemas import load_model_file, validate_data
from kvrig.schemas.bundle import MANIFEST_NAME, Manifest

__all__ = ["MemoryPlan", "PlanRequest", "bundle_recipe", "bundle_residency", "kv_bytes", "plan", "plan_memory"]


def plan(
    model: str | Path | None, device: str | Path, request: PlanRequest | None = None, **options: Any
) -> MemoryPlan:
    """Plan `model` (directory, config.json, GGUF; None: the embedded SmolLM2) on `device` (ProductType,
    profile name or profile file) for `request`, or for a request of `options` (PlanRequest's fields)."""

    if options:
        base = dict(request) if request is not None else {}
        request = validate_data(PlanRequest, {**base, **options}, error=PlanInputError)
    request = request or PlanRequest()
    recipe = bundle_recipe(model) if request.weights == AUTO else None
    if recipe is not None:  # a bundle's weights are what it was packaged with
        request = request.model_copy(update={"weights": recipe})
    return plan_memory(load_model_spec(model), load_profile(device), request)


def _bundle_manifest(model: str | Path | None) -> Manifest | None:
    manifest = Path(model) / MANIFEST_NAME if model is not None else None
    if manifest is None or not manifest.is_file():
        return None
    return load_model_file(Manifest, manifest)


def bundle_recipe(model: str | Path | None) -> str | None:
    """The weight recipe a bundle was packaged with (its manifest), None for anything else."""
    manifest = _bundle_manifest(model)
    return manifest.recipe.weights if manifest is not None else None


def bundle_kv(model: str | Path | None) -> str | None:
    """The KV spec a bundle was packaged with, in full (its manifest), None for anything else."""
    manifest = _bundle_manifest(model)
    return manifest.recipe.kv if manifest is not None else None


def bundle_residency(model: str | Path | None) -> str:
    """`mapped` when `model` is a bundle written with `--weights-layout mapped` (its manifest says so), else
    `loaded`: what the app will do with it."""
    manifest = _bundle_manifest(model)
    return manifest.recipe.weights_layout if manifest is not None else "loaded"
