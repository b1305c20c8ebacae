"""quality.json: what `kvrig bench quality` measured (perplexity per recipe or KV spec and kind of text, KV bytes,
decode speed, factual answers), and what `kvrig plan --quality` reads back."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field

from kvrig.schemas import StrictModel


class Row(StrictModel):
    """One recipe or KV spec on one kind of text."""

    recipe: str = Field(description="the weight recipe, or `source` for a KV row on the unquantized weights")
    kv: str
    kind: str = Field(description="the kind of evaluation text (texts.py)")
    ppl: float
    ppl_delta_pct: float
    tokens: int = Field(ge=1, description="tokens per passage")
    bits_per_weight: float | None = None
    seconds: float = 0.0
    kv_bytes: dict[int, int] = Field(default_factory=dict)
    predicted_kv_bytes: dict[int, int] = Field(default_factory=dict)
    phone_kv_bytes: dict[int, int] = Field(
        default_factory=dict,
        description="the planner's bytes at float16 (the phone's activation dtype) for a prompt of that length",
    )
    decode_tps: dict[int, float] = Field(default_factory=dict)
    kv_scheme: str = Field(
        default="", description="the planner's scheme the KV row ran (a `+kN@topM` variant names the layers it chose)"
    )
    passages: int = Field(default=1, ge=1, description="passages of `tokens` tokens the perplexity is over")


class FactualCheck(StrictModel):
    prompt: str
    expected: str
    source_answer: str
    answer: str
    source_ok: bool
    ok: bool


QUALITY_SCHEMA_VERSION: Final = 1
"""1: the first with a schema (files written before it have no `schema` key and read as 1)."""


class QualityReport(StrictModel):
    schema_version: Literal[1] = Field(default=QUALITY_SCHEMA_VERSION, alias="schema")
    model: str
    text: dict[str, list[str]] = Field(description="evaluation kind -> the files read")
    calibration: dict[str, list[str]] = Field(
        description="calibration kind -> the files read (empty when no recipe needed calibration)"
    )
    source_ppl: dict[str, float] = Field(
        default_factory=dict,
        description="\"KIND/PASSAGESxTOKENS\" (the weight rows' passages, the KV rows') -> the unquantized "
        "model's perplexity there",
    )
    weights: list[Row] = Field(default_factory=list)
    kv: list[Row] = Field(default_factory=list)
    paired_decode_tps: dict[str, float] = Field(
        default_factory=dict,
        description="fp16, k8v4 (and k8v4+rot) decode tok/s at the goal's context, their steps interleaved",
    )
    kv_reads: str = Field(
        default="decoded",
        description="decoded: KV rows read a recent window per position, as decoding does; chunked: as a prefill "
        "chunk does",
    )
    factual_recipe: str = ""
    factual_kv: str = ""
    factual: list[FactualCheck] = Field(default_factory=list)
    goals: list[dict[str, Any]] = Field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
