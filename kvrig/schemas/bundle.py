"""manifest.json: what a bundle holds (every file with size and sha256), where it came from, and what the
planner predicted for it (bundle contract; `kvrig verify` and the device side read it)."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from kvrig.schemas import StrictModel

MANIFEST_SCHEMA_VERSION: Final = 1
MANIFEST_NAME = "manifest.json"


class ManifestFile(StrictModel):
    path: str = Field(description="relative to the bundle root, '/' separated")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class SourceModel(StrictModel):
    kind: Literal["gguf", "hf"]
    path: str
    name: str
    sha256: str | None = Field(default=None, description="of the GGUF file; null for a directory")
    architecture: str


class Recipe(StrictModel):
    weights: str = Field(description="q4, q8, mixed_3_6, fp16, ...")
    bits: int | None
    group_size: int
    mode: Literal["affine"] = "affine"
    kv_scheme: str
    key_bits: int | None
    value_bits: int | None
    kv_group_size: int


class Prediction(StrictModel):
    device: str
    limit_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    max_context: int
    fits: bool
    forced: bool = Field(description="packaged with --force although the plan said it does not fit")


class QualityCheck(StrictModel):
    """The package quality gate: perplexity of the bundle (its weights and KV scheme) against the unquantized
    source on a short built-in text."""

    text: str
    tokens: int = Field(ge=1)
    source_ppl: float
    bundle_ppl: float
    ppl_delta_pct: float
    max_increase_pct: float
    passed: bool
    forced: bool = Field(description="packaged with --force although the gate failed")
    seconds: float


class Manifest(StrictModel):
    schema_version: Literal[1] = Field(default=MANIFEST_SCHEMA_VERSION, alias="schema")
    tool: str = "kvrig"
    tool_version: str
    created: str = Field(description="ISO 8601, UTC")
    source: SourceModel
    recipe: Recipe
    prediction: Prediction | None = Field(description="null when packaged without a device")
    quality: QualityCheck | None = Field(default=None, description="null when the gate was skipped")
    files: list[ManifestFile]
