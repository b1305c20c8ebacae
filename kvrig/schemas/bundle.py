"""manifest.json: what a bundle holds (every file with size and sha256), where it came from, and what the
planner predicted for it (bundle contract; `kvrig verify` and the device side read it)."""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from pydantic import Field

from kvrig.exceptions import BundleError, SchemaError, VerifyError
from kvrig.fileio import sha256_file
from kvrig.schemas import StrictModel, load_model_file

MANIFEST_SCHEMA_VERSION: Final = 3
"""2: the quality check names each gate kind's perplexity (`quality.kinds`) and `--weights auto` / `--kv auto`
record what they tried (`choice`). 3: `recipe.kv`, the KV spec whole (a schema-2 manifest reads with it empty)."""
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
    kv: str = Field(
        default="",
        description="the KV spec in full, as `--kv` takes it (k8v4+rot+s4+w64): kv_scheme and the extras kvcache.json "
        "holds (rotation, sink tokens, recent window); empty in bundles written before it was recorded",
    )
    key_bits: int | None
    value_bits: int | None
    kv_group_size: int
    weights_layout: Literal["loaded", "mapped"] = Field(
        default="loaded", description="mapped: every tensor of the safetensors starts on weights_alignment_bytes"
    )
    weights_alignment_bytes: int | None = Field(default=None, ge=1)


class Prediction(StrictModel):
    device: str
    limit_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    max_context: int
    fits: bool
    forced: bool = Field(
        description="packaged with --ignore-fit (--force before) although the plan said it does not fit"
    )


class KindCheck(StrictModel):
    """The gate on one kind of text."""

    kind: str
    tokens: int = Field(ge=1)
    source_ppl: float
    bundle_ppl: float
    ppl_delta_pct: float


class QualityCheck(StrictModel):
    """The package quality gate: perplexity of the bundle (its weights and KV scheme) against the unquantized
    source on short texts of several kinds; the top-level numbers are the worst kind's."""

    text: str
    tokens: int = Field(ge=1)
    source_ppl: float
    bundle_ppl: float
    ppl_delta_pct: float
    max_increase_pct: float
    passed: bool
    forced: bool = Field(description="packaged with --ignore-gate (--force before) although the gate failed")
    seconds: float
    kinds: list[KindCheck] = Field(default_factory=list, description="per kind of text (schema 2)")


class Candidate(StrictModel):
    """One option `--weights auto`, `--kv auto` or `--fit` considered, with what was measured and planned."""

    weights: str = Field(description="a weight recipe, or `source` for a KV measurement on the source weights")
    kv: str
    weights_bytes: int | None = Field(default=None, description="MLX nbytes of the weights as planned")
    kv_bytes: int | None = Field(default=None, description="KV bytes at 4096 tokens (float16, extras included)")
    max_context: int | None = Field(default=None, description="the plan's max context on the device")
    bits_per_weight: float | None = None
    ppl_delta_pct: float | None = Field(default=None, description="measured, on the worst gate text")
    verdict: Literal["chosen", "passed", "failed gate", "over the limit", "does not fit", "unavailable", "not tried"]
    reason: str = ""


class Choice(StrictModel):
    """How the bundle's recipe and KV spec were chosen by measurement (schema 2)."""

    kv: list[Candidate] = Field(default_factory=list, description="`--kv auto`: the KV specs measured")
    kv_why: str = ""
    weights: list[Candidate] = Field(default_factory=list, description="`--weights auto`: the recipes tried")
    weights_why: str = ""
    fit_context: int | None = Field(default=None, description="`--fit N`: the context asked for")
    fit: list[Candidate] = Field(default_factory=list, description="`--fit`: every weights x KV pair considered")
    fit_why: str = ""


class Manifest(StrictModel):
    schema_version: Literal[1, 2, 3] = Field(default=MANIFEST_SCHEMA_VERSION, alias="schema")
    tool: str = "kvrig"
    tool_version: str
    created: str = Field(description="ISO 8601, UTC")
    source: SourceModel
    recipe: Recipe
    prediction: Prediction | None = Field(description="null when packaged without a device")
    quality: QualityCheck | None = Field(default=None, description="null when the gate was skipped")
    choice: Choice | None = Field(default=None, description="null when weights and KV were given, not chosen")
    files: list[ManifestFile]


def load_manifest(bundle: Path) -> Manifest:
    """The bundle's manifest: BundleError for a folder that is not a bundle, SchemaError for a wrong manifest."""
    if not bundle.is_dir():
        raise BundleError(
            f"{bundle}: {'not a folder' if bundle.exists() else 'no such folder'} (expected a bundle folder)"
        )
    if not (bundle / MANIFEST_NAME).exists():  # a folder, but not a bundle: the same cause as no folder at all
        raise BundleError(f"{bundle}: no {MANIFEST_NAME} (expected a bundle folder `kvrig package` wrote)")
    return load_model_file(Manifest, bundle / MANIFEST_NAME, error=SchemaError)


def file_problem(bundle: Path, entry: ManifestFile) -> str | None:
    """What is wrong with one file the manifest lists (escapes the bundle, missing, other size, other sha256), or
    None when it is as the manifest says."""
    path = bundle / entry.path
    if ".." in Path(entry.path).parts or Path(entry.path).is_absolute():
        return "path escapes the bundle"
    if not path.is_file():
        return "missing"
    if (size := path.stat().st_size) != entry.size:
        how = "truncated" if size < entry.size else "grown"
        return f"size {size} bytes, manifest says {entry.size} ({how})"
    if sha256_file(path) != entry.sha256:
        return "sha256 differs from the manifest (edited?)"
    return None


def check_listed(bundle: Path, manifest: Manifest, names: tuple[str, ...]) -> None:
    """The files `names` as the manifest lists them (the few a reader takes from a bundle without verifying all of
    it): VerifyError naming each that is not, or is not listed."""
    entries = {entry.path: entry for entry in manifest.files}
    problems = []
    for name in names:
        entry = entries.get(name)
        problem = "not listed in the manifest" if entry is None else file_problem(bundle, entry)
        if problem is not None:
            problems.append(f"{name}: {problem}")
    if problems:
        raise VerifyError(
            f"{bundle}: {len(problems)} file(s) do not match the manifest: {'; '.join(problems)} "
            "(changed after packaging: package again, or see `kvrig verify`)"
        )
