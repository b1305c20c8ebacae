"""`kvrig soak` options over a plan: what each sets, and an older plan file carried to the schema that has the field."""

from __future__ import annotations

import pytest

from kvrig.exceptions import SchemaError
from kvrig.schemas.soakplan import SoakPlan
from kvrig.soaking.plan import make_plan, with_overrides


def _schema2() -> SoakPlan:
    """A plan file written as schema 2: none of the fields later schemas added."""
    data = make_plan(max_tokens=512, scheme="k8v4").model_dump(by_alias=True, exclude_none=True)
    for key in ("weights_residency", "buffer_cache", "on_critical", "backend"):
        data.pop(key, None)
    return SoakPlan.model_validate({**data, "schema": 2})


def test_nothing_given_keeps_the_plan_as_it_is() -> None:
    plan = _schema2()
    assert with_overrides(plan) is plan


def test_each_option_sets_its_field_and_older_files_move_to_the_schema_that_has_it() -> None:
    plan = _schema2()
    assert with_overrides(plan, scheme="k4v4").scheme == "k4v4"
    resident = with_overrides(plan, weights_residency="mapped")
    assert (resident.schema_version, resident.weights_residency) == (3, "mapped")
    both = with_overrides(plan, weights_residency="loaded", buffer_cache="uncapped", on_critical="continue")
    assert (both.schema_version, both.weights_residency, both.buffer_cache, both.on_critical) == (
        4,
        "loaded",
        "uncapped",
        "continue",
    )
    assert with_overrides(both, backend="coreml").backend == "coreml"
    assert plan.schema_version == 2 and plan.scheme == "k8v4"  # the plan given is not changed


def test_a_value_the_plan_cannot_hold_is_a_schema_error_naming_the_field() -> None:
    with pytest.raises(SchemaError) as caught:
        with_overrides(make_plan(max_tokens=512), buffer_cache="sometimes")
    assert caught.value.field == "buffer_cache"
