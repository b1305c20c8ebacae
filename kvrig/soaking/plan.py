"""Building a soak plan from command-line choices."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from kvrig.schemas import validate_data
from kvrig.schemas.kvcache import WeightsResidency
from kvrig.schemas.soakplan import BufferCacheMode, GrowthSchedule, OnCritical, SoakPlan, StopConditions

# Fed repeatedly to grow the context: plain prose, so tokenizers see ordinary text.
DEFAULT_TEXT = (
    "The harbour was quiet in the early morning. Fishing boats rocked against the pier while gulls "
    "circled above the market, where traders laid out the night's catch on beds of ice. "
)


# The label a soak records until the app says which KV scheme its bundle runs (its start record).
UNNAMED_SCHEME = "default"


def make_plan(
    *,
    max_tokens: int,
    step_tokens: int = 256,
    start_tokens: int | None = None,
    decode_tokens: int = 16,
    scheme: str = UNNAMED_SCHEME,
    run_id: str | None = None,
    text: str = DEFAULT_TEXT,
    max_seconds: float | None = None,
    backend: Literal["mlx", "coreml"] = "mlx",
    weights_residency: WeightsResidency | None = None,
    buffer_cache: BufferCacheMode | None = None,
    on_critical: OnCritical = "stop_and_save",
) -> SoakPlan:
    return SoakPlan(
        run_id=run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
        scheme=scheme,
        schedule=GrowthSchedule(
            start_tokens=min(start_tokens or step_tokens, max_tokens),  # a step longer than the soak: one point
            step_tokens=step_tokens,
            max_tokens=max_tokens,
            decode_tokens=decode_tokens,
        ),
        stop=StopConditions(max_seconds=max_seconds),
        text=text,
        backend=backend,
        weights_residency=weights_residency,
        buffer_cache=buffer_cache,
        on_critical=on_critical,
    )


def with_overrides(
    plan: SoakPlan,
    *,
    scheme: str | None = None,
    backend: str | None = None,
    weights_residency: str | None = None,
    buffer_cache: str | None = None,
    on_critical: str | None = None,
) -> SoakPlan:
    """`plan` with the options given set (None: the plan's own), validated as a plan file is. A field a later
    schema brought (the residency: 3, the buffer cache: 4) carries an older plan file forward to that schema."""
    given = {"scheme": scheme, "backend": backend, "on_critical": on_critical}
    update: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    if weights_residency is not None:
        update |= {"schema": max(3, plan.schema_version), "weights_residency": weights_residency}
    if buffer_cache is not None:
        update |= {"schema": max(4, plan.schema_version), "buffer_cache": buffer_cache}
    return validate_data(SoakPlan, {**plan.model_dump(by_alias=True), **update}) if update else plan
