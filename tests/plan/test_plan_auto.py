"""`--weights auto` means one thing in plan and package: a bundle is planned with the recipe it was packaged with,
anything else with the first recipe package's auto tries, and the plan says which it counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrig.planner import plan
from kvrig.recipes import WEIGHT_CANDIDATES
from tests.bundle_fixtures import smollm2_q4_k8v8


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_q4_k8v8(tmp_path_factory)


def test_a_bundle_is_planned_with_its_own_recipe(bundle: Path) -> None:
    recipe = json.loads((bundle / "manifest.json").read_text())["recipe"]["weights"]
    planned = plan(bundle, "iPhone16,1", weights="auto")
    assert planned.weights_recipe == recipe == "q4"
    assert not any(n.startswith("Weights auto") for n in planned.notes)


def test_a_model_is_planned_as_the_first_auto_candidate_and_says_so() -> None:
    planned = plan(None, "iPhone16,1")  # the library's default is the command's: auto
    assert planned.weights_recipe == WEIGHT_CANDIDATES[0] == "gpx-q4"
    (note,) = [n for n in planned.notes if n.startswith("Weights auto")]
    assert all(c in note for c in WEIGHT_CANDIDATES)
    # gpx-q4 keeps q4's layout: the same bytes as the round-to-nearest recipe
    assert planned.weights_bytes == plan(None, "iPhone16,1", weights="q4").weights_bytes
