"""Telemetry: JSON Lines the app writes into its container (and mirrors to os_log), one record per event.

The app may be killed mid-write, so a torn last line is normal; readers skip it and say so.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import ConfigDict, Field, model_validator

from kvrig.schemas import StrictModel

# 2: `start` names the backend that ran (mlx or coreml). Schema-1 files (MLX-only apps) still read, as mlx.
# 3: `step` names it too, so a step read alone (or a file mixing runs) says which runtime measured it.
# 4: `start` says how the app holds its weights. 5: `scene` records (the app left the foreground or came back, and
# what its GPU work did) and the end reason `background_task_expired`.
TELEMETRY_SCHEMA_VERSION: Final = 5
_SURROGATE = re.compile("[\ud800-\udfff]")
TELEMETRY_FILE = "telemetry.jsonl"


class _Event(StrictModel):
    # JSON has no NaN or infinity (Python's reader takes them): a record with one is not the app's, and a summary
    # that carried it would print JSON strict readers refuse
    model_config = ConfigDict(allow_inf_nan=False)  # merged with StrictModel's

    schema_version: Literal[1, 2, 3, 4, 5] = Field(default=TELEMETRY_SCHEMA_VERSION, alias="schema")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: object) -> object:
        # JSON's "\ud83d" escape parses to a lone surrogate, which no UTF-8 writer can put back (results.json,
        # junit.xml): a record that holds one is not the app's (Swift's encoder writes whole characters)
        if isinstance(data, dict):
            for key, value in data.items():
                texts = value if isinstance(value, list) else [value]
                if any(isinstance(t, str) and not t.isascii() and _SURROGATE.search(t) for t in texts):
                    raise ValueError(f"field {key!r}: not Unicode text (a lone surrogate)")
        return data

    run_id: str
    seq: int = Field(ge=0, description="record number within the run, from 0")
    t: float = Field(description="seconds since the Unix epoch")


class StartEvent(_Event):
    event: Literal["start"] = "start"
    model: str
    scheme: str = Field(
        description="the KV spec the app runs, in full as kvrig's --kv writes it (k8v4+rot+s4+w64): kvcache.json's "
        "scheme with its rotation, sink and recent-window extras"
    )
    product_type: str
    os_version: str
    limit_bytes: int | None = Field(default=None, description="app memory limit the app believes in")
    backend: Literal["mlx", "coreml"] = Field(
        default="mlx", description="the runtime that ran: MLX, or the Core ML program from `kvrig export coreml`"
    )
    converted: list[str] = Field(
        default_factory=list,
        description="fields the virtual iPhone converted to the phone's format (e.g. fp32 host activations)",
    )
    weights_residency: Literal["loaded", "mapped"] | None = Field(
        default=None,
        description="how the app holds its weights (schema 4): loaded into MLX's memory, or mapped from the bundle's "
        "file (None: an older file, loaded)",
    )
    mapped_weight_bytes: int | None = Field(
        default=None, ge=0, description="bytes of weights backed by the file mapping (schema 4; 0 when loaded)"
    )
    residency_note: str | None = Field(
        default=None, description="why the weights are loaded although the bundle asked for mapped (schema 4)"
    )

    @model_validator(mode="after")
    def _fields_need_their_schema(self) -> StartEvent:
        if self.schema_version == 1 and "backend" in self.model_fields_set:
            raise ValueError("'backend' is a schema-2 field; a schema-1 record cannot carry it")
        residency = {"weights_residency", "mapped_weight_bytes", "residency_note"} & self.model_fields_set
        if self.schema_version < 4 and residency:
            raise ValueError(f"{sorted(residency)} are schema-4 fields; an older record cannot carry them")
        return self


class StepEvent(_Event):
    event: Literal["step"] = "step"
    context_tokens: int = Field(ge=0)
    decode_tps: float | None = Field(default=None, ge=0)
    prefill_tps: float | None = Field(default=None, ge=0)
    phys_footprint_bytes: int = Field(ge=0)
    available_bytes: int | None = Field(default=None, ge=0, description="os_proc_available_memory()")
    mlx_active_bytes: int | None = Field(default=None, ge=0)
    mlx_cache_bytes: int | None = Field(default=None, ge=0)
    mlx_peak_bytes: int | None = Field(default=None, ge=0)
    kv_bytes: int | None = Field(default=None, ge=0)
    thermal_state: Literal["nominal", "fair", "serious", "critical"] | None = None
    backend: Literal["mlx", "coreml"] | None = Field(
        default=None, description="the runtime that measured this step (schema 3; None: an older file)"
    )

    @model_validator(mode="after")
    def _backend_needs_schema_3(self) -> StepEvent:
        if self.schema_version < 3 and self.backend is not None:
            raise ValueError("a step's 'backend' is a schema-3 field; a schema-1/2 record cannot carry it")
        return self


class MemoryPressureEvent(_Event):
    event: Literal["memory_pressure"] = "memory_pressure"
    level: Literal["normal", "warning", "critical"]
    context_tokens: int = Field(ge=0)
    phys_footprint_bytes: int | None = Field(default=None, ge=0)


class EvictEvent(_Event):
    event: Literal["evict"] = "evict"
    tokens_evicted: int = Field(ge=0)
    context_tokens: int = Field(ge=0, description="context after eviction")
    kv_bytes: int | None = Field(default=None, ge=0)


class SceneEvent(_Event):
    """The app's scene left the foreground or came back (SwiftUI scenePhase), and what its GPU work did: `paused`
    before the next forward pass (`during` names the phase it was about to submit), `continued` under a
    continued-processing task that holds the GPU (iOS 26+, where `BGTaskScheduler.supportedResources` has it),
    `resumed` when the scene is active again."""

    event: Literal["scene"] = "scene"
    phase: Literal["active", "background"]
    context_tokens: int = Field(ge=0)
    during: Literal["prefill", "decode", "idle"]
    gpu: Literal["paused", "continued", "resumed"]

    @model_validator(mode="after")
    def _needs_schema_5(self) -> SceneEvent:
        if self.schema_version < 5:
            raise ValueError("'scene' is a schema-5 record; an older file cannot carry it")
        return self


class EndEvent(_Event):
    """`background_task_expired`: the continued-processing task ended (it expired, or the person cancelled it)
    while the app was in the background; the app stopped its GPU work, saved and ended the run."""

    event: Literal["end"] = "end"
    reason: Literal[
        "completed", "stop_condition", "memory_critical", "allocation_failed", "error", "background_task_expired"
    ]
    context_tokens: int = Field(ge=0)
    message: str | None = None

    @model_validator(mode="after")
    def _reason_needs_its_schema(self) -> EndEvent:
        if self.reason == "background_task_expired" and self.schema_version < 5:
            raise ValueError("'background_task_expired' is a schema-5 end reason; an older record cannot carry it")
        return self


TelemetryEvent = Annotated[
    StartEvent | StepEvent | MemoryPressureEvent | EvictEvent | SceneEvent | EndEvent, Field(discriminator="event")
]
