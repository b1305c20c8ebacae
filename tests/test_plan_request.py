"""The typed plan request: it carries every option the planner takes, with the planner's defaults, and a request
built from loose options is validated into a typed error naming the option."""

from __future__ import annotations

import inspect

import pytest

from kvrig.exceptions import PlanInputError
from kvrig.plan import PlanRequest, plan
from kvrig.plan.memory import _plan_memory


def test_the_request_has_every_planner_option_with_its_default() -> None:
    planner = {
        name: param.default
        for name, param in inspect.signature(_plan_memory).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    }
    request = {name: field.default for name, field in PlanRequest.model_fields.items()}
    assert request.keys() == planner.keys()
    for name, default in planner.items():
        assert request[name] == (tuple(default) if isinstance(default, list) else default), name


@pytest.mark.parametrize(
    ("options", "field"),
    [({"margins": 0.1}, "margins"), ({"limit": "lowest"}, "limit"), ({"prefill_step": "big"}, "prefill_step")],
)
def test_loose_options_are_checked_before_planning(options: dict[str, object], field: str) -> None:
    with pytest.raises(PlanInputError) as raised:
        plan("no-such-model-folder", "no-such-device", **options)  # type: ignore[arg-type]
    assert raised.value.field == field


def test_a_request_is_immutable_so_variants_are_copies() -> None:
    base = PlanRequest(schemes=("fp16",))
    variant = base.model_copy(update={"margin": 0.0})
    with pytest.raises(ValueError):
        base.margin = 0.0  # type: ignore[misc]
    assert (base.margin, variant.margin, variant.schemes) == (PlanRequest().margin, 0.0, ("fp16",))
