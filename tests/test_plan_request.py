"""The typed plan request: it carries every option the planner takes, with the planner's defaults, and a request
built from loose options is validated into a typed error naming the option."""

from __future__ import annotations

import pytest

from kvrig.exceptions import PlanInputError
from kvrig.planner import PlanRequest, plan


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
