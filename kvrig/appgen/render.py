"""Render templates/swift into an Xcode project for one bundle: `render_app(bundle, out, AppOptions(...))`.

Files ending in `.j2` are Jinja templates (StrictUndefined, autoescape off: every value goes through an
escaper from escape.py); other files are copied as they are. `_meta/` holds data about the templates (the MLX
symbol list) and is not rendered.

A project is written whole or not at all: into a hidden folder beside `out`, which is renamed into place at the
end (swapped with the old project in one rename), and removed on any failure. Each project carries a marker file
(MARKER); `replace` replaces only a folder that has it (or an empty one), never a folder kvrig did not make.
"""

from __future__ import annotations

import json
import re
import shutil
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from pydantic import TypeAdapter

from kvrig.appgen.escape import FILTERS
from kvrig.exceptions import AppExistsError, AppGenError, InputError, VerifyError
from kvrig.fileio import read_data, scratch_dir, swap_in
from kvrig.models import read_config
from kvrig.recipes import manifest_kv_problem
from kvrig.schemas import json_schema, load_model_file
from kvrig.schemas.bundle import MANIFEST_NAME, check_listed, load_manifest
from kvrig.schemas.keys import COREML_MODEL_KEY
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.schemas.soakplan import SOAKPLAN_FILE, GrowthSchedule, SoakPlan
from kvrig.schemas.telemetry import TelemetryEvent
from kvrig.version import __version__

# Swift packages the App target links. The engine's sources are compiled against these versions on Linux
# (kvrig/appgen/linux.py); mlx-swift 0.31.5+ needs a Swift 6.3 toolchain, so 0.31.4.
PINS: dict[str, dict[str, str]] = {
    "mlx-swift-lm": {"url": "https://github.com/ml-explore/mlx-swift-lm", "version": "3.31.4"},
    "mlx-swift": {"url": "https://github.com/ml-explore/mlx-swift", "version": "0.31.4"},
    "swift-transformers": {"url": "https://github.com/huggingface/swift-transformers", "version": "1.3.3"},
}

IOS_DEPLOYMENT_TARGET = "17.0"
# Bytes kept outside MLX's limit for the UI, Metal and the runtime (UI baseline + fragmentation).
DEFAULT_HEADROOM_BYTES = 256 * 1024 * 1024
CORE_FIXTURES = Path("Core/Tests/KvrigCoreTests/Fixtures")
SOAK_EXAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A soak test feeds this text again and again so that the "
    "context grows step by step until the phone runs out of memory or the plan says stop. "
)

# The Core ML program's name inside the app (Xcode compiles it to KvrigModel.mlmodelc), and its engine's folder.
COREML_RESOURCE = "KvrigModel.mlpackage"
COREML_SOURCES = ("App", "CoreML")

MARKER = ".kvrig-app.json"  # in every generated project: what `--replace` may replace
_BUNDLE_ID = re.compile(r"^[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$")
_TEAM_ID = re.compile(r"^[A-Z0-9]{10}$")


@dataclass(frozen=True)
class AppOptions:
    name: str
    bundle_id: str
    team: str | None = None
    extended_virtual_addressing: bool = False
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    coreml_model: Path | None = None
    """A .mlpackage from `kvrig export coreml` to ship beside the MLX bundle (with App/CoreML's engine)."""


@dataclass
class RenderResult:
    project: Path
    files: list[Path] = field(default_factory=list)
    kvcache: KVCacheConfig | None = None


def templates_root() -> Path:
    """templates/swift: inside the wheel first, then the repository's top-level folder."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_data" / "templates" / "swift", here.parent / "templates" / "swift"):
        if candidate.is_dir():
            return candidate
    raise AppGenError("templates/swift not found (neither in the installed package nor next to it)")


def product_name(name: str) -> str:
    """A target/product name Xcode accepts from any display name: ASCII letters and digits, letter first. Accented
    letters keep their base letter (Ü → U: decomposed, the combining marks dropped) instead of vanishing."""
    ascii_name = "".join(c for c in unicodedata.normalize("NFKD", name) if not unicodedata.combining(c))
    words = re.findall(r"[A-Za-z0-9]+", ascii_name)
    candidate = "".join(w[:1].upper() + w[1:] for w in words)
    if not candidate or not candidate[0].isalpha():
        candidate = "App" + candidate
    return candidate[:64]


def validate_options(options: AppOptions) -> None:
    if not options.name.strip():
        raise InputError("the app name is empty", field="--name", expected="a display name")
    try:
        options.name.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes that were not UTF-8 on the command line arrive as lone surrogates
        raise InputError(
            f"the app name is not valid UTF-8 (byte {exc.start} of the name)", field="--name", expected="UTF-8 text"
        ) from None
    if not _BUNDLE_ID.fullmatch(options.bundle_id):  # fullmatch: `$` would let a final newline through
        raise InputError(
            f"invalid bundle id {options.bundle_id!r}",
            field="--bundle-id",
            expected="reverse-DNS letters, digits and hyphens, like com.example.myllm",
        )
    if options.team is not None and not _TEAM_ID.fullmatch(options.team):
        raise InputError(
            f"invalid team id {options.team!r}", field="--team", expected="10 upper-case letters or digits"
        )
    if options.headroom_bytes < 0:
        raise InputError("headroom must not be negative", field="headroom_bytes")


def read_bundle(bundle: Path) -> tuple[KVCacheConfig, dict[str, Any]]:
    """kvcache.json and config.json of a bundle (its manifest read first, as every command reading bundles does, and
    both files held to it: one edited after packaging, which deploy would refuse, is VerifyError).
    config.json's model_type is the app's AppConfig.modelType, shown in the app and used for the cache only when
    the bundle it runs names none."""
    manifest = load_manifest(bundle)
    check_listed(bundle, manifest, (KVCACHE_NAME, "config.json"))  # what the project takes from the bundle
    kv = load_model_file(KVCacheConfig, bundle / KVCACHE_NAME)
    if (differs := manifest_kv_problem(manifest.recipe, kv, bundle / MANIFEST_NAME)) is not None:
        raise VerifyError(f"{bundle}: {KVCACHE_NAME} {differs} (see `kvrig verify`)")
    model_config, _ = read_config(bundle)
    return kv, model_config


def example_soak_plan(kv: KVCacheConfig) -> SoakPlan:
    start = min(512, kv.max_context)
    return SoakPlan(
        run_id="example",
        scheme=kv.scheme,
        schedule=GrowthSchedule(start_tokens=start, step_tokens=max(kv.page_tokens, 1), max_tokens=kv.max_context),
        text=SOAK_EXAMPLE_TEXT,
    )


def template_context(
    options: AppOptions, kv: KVCacheConfig, model_config: dict[str, Any], bundle_folder: str
) -> dict[str, Any]:
    model_type = model_config.get("model_type")
    return {
        "app_name": options.name,
        "product_name": product_name(options.name),
        "bundle_id": options.bundle_id,
        "team": options.team,
        "extended_virtual_addressing": options.extended_virtual_addressing,
        "headroom_bytes": options.headroom_bytes,
        # The bundle is pushed into Documents/<this folder> (file sharing is on).
        "bundle_folder": bundle_folder,
        "model_type": model_type if isinstance(model_type, str) else "unknown",
        "kv": kv.model_dump(mode="json", by_alias=True),
        "pins": PINS,
        "ios_target": IOS_DEPLOYMENT_TARGET,
        "generator": f"kvrig {__version__}",
        "soak_plan_argument": "--kvrig-soak-plan",
        "soak_plan_file": SOAKPLAN_FILE,
        "coreml_model": COREML_RESOURCE if options.coreml_model else None,
        "coreml_info_key": COREML_MODEL_KEY,
    }


def _environment(root: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters.update(FILTERS)
    return env


def _write(path: Path, text: str, written: list[Path]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    written.append(path)


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def check_output(out: Path, *, replace: bool) -> None:
    """`out` may take a project: absent, empty, or (with `replace`) a project kvrig generated."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise AppExistsError(f"{out}: exists and is not a folder; not replacing it")
    if not any(out.iterdir()):
        return
    if not replace:
        raise AppExistsError(f"{out}: folder is not empty (use --replace to replace a project kvrig generated)")
    marker = out / MARKER
    if marker.is_symlink() or not marker.is_file():
        raise AppExistsError(
            f"{out}: not a project kvrig generated (no {MARKER}); --replace replaces only those, so nothing was touched"
        )
    listed = _listed(marker)
    if listed is None:
        raise AppExistsError(
            f"{out}: its {MARKER} lists no files (written by an earlier kvrig, or edited), so kvrig cannot tell its "
            "files from yours; nothing was touched: remove the folder yourself if nothing in it is yours"
        )
    theirs = _not_generated(out, listed)
    if theirs:
        shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
        raise AppExistsError(
            f"{out}: holds files kvrig app did not write ({shown}); --replace replaces only a project's own files "
            "and what building it made, so nothing was touched: move them out first"
        )


# What building a generated project writes into it (`kvrig build`'s .ipa, xcodegen's project, SwiftPM's
# folders): replaced with the project, as regenerating makes them stale.
BUILT = ("build", ".build", ".swiftpm", "DerivedData")


def _listed(marker: Path) -> set[str] | None:
    """The files the marker says kvrig wrote; None if it lists none."""
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else None


def _not_generated(out: Path, own: set[str]) -> list[str]:
    """Files in `out` that are not among `own` and that no build made."""
    found = []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if path.is_dir() and not path.is_symlink():
            continue
        top = rel.parts[0]
        if rel.as_posix() in own or rel.as_posix() == MARKER or top in BUILT or top.endswith(".xcodeproj"):
            continue
        found.append(rel.as_posix())
    return found


def render_app(bundle: str | Path, out: str | Path, options: AppOptions, *, replace: bool = False) -> RenderResult:
    """Writes the Xcode project for `bundle` into `out`, whole or not at all.

    Raises InputError for bad options or a bad bundle, AppExistsError when `out` holds files and is not (or,
    without `replace`, may not be replaced as) a project kvrig generated."""
    bundle = Path(bundle)
    validate_options(options)
    kv, model_config = read_bundle(bundle)
    return render_project(kv, model_config, bundle.resolve().name, out, options, replace=replace)


def render_project(
    kv: KVCacheConfig,
    model_config: dict[str, Any],
    bundle_folder: str,
    out: str | Path,
    options: AppOptions,
    *,
    replace: bool = False,
) -> RenderResult:
    """render_app for a bundle given by what the app reads of it: its KV configuration, its model's config and the
    name of the folder it is pushed into (the Linux engine's project, which is rendered for no bundle)."""
    out = Path(out)
    validate_options(options)
    check_output(out, replace=replace)
    if options.coreml_model is not None:
        check_mlpackage(options.coreml_model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AppGenError(f"{out.parent}: cannot create the output folder: {exc.strerror or exc}") from None
    with _writes(out), scratch_dir(out.parent, f".{out.name}.partial-") as tmp:
        written = _render_into(tmp, bundle_folder, options, kv, model_config)
        check_output(out, replace=replace)  # again: it may have appeared while rendering
        swap_in(tmp, out)
    return RenderResult(project=out, files=[out / p.relative_to(tmp) for p in written], kvcache=kv)


@contextmanager
def _writes(out: Path) -> Iterator[None]:
    """Writing the project: a full disk (or a folder that cannot be written) is AppGenError naming `out`."""
    try:
        yield
    except OSError as exc:
        raise AppGenError(f"{out}: cannot write the project ({exc.strerror or exc}); nothing was changed") from None


MLPACKAGE_EXPECTED = "a .mlpackage written by `kvrig export coreml`"


def check_mlpackage(path: Path) -> None:
    """InputError naming the file unless `path` is a Core ML package whose Manifest.json names a root model that is
    there: Xcode compiles what the app ships, so a package it cannot read fails the build, not this command."""
    manifest = path / "Manifest.json"
    if not manifest.is_file():
        raise InputError("not a Core ML package (no Manifest.json)", file=path, expected=MLPACKAGE_EXPECTED)
    data = read_data(manifest, mapping="a Core ML package manifest", expected=MLPACKAGE_EXPECTED)
    entries, root = data.get("itemInfoEntries"), data.get("rootModelIdentifier")
    entry = entries.get(root) if isinstance(entries, dict) and isinstance(root, str) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        problem = "rootModelIdentifier names no entry of itemInfoEntries with a path"
        raise InputError(problem, file=manifest, expected=MLPACKAGE_EXPECTED)
    model = path / "Data" / entry["path"]
    try:
        there = model.resolve().is_relative_to(path.resolve()) and model.is_file()
    except (OSError, ValueError):  # a path the system cannot take (a NUL byte, too long)
        there = False
    if not there:
        problem = f"the root model Data/{entry['path']} is not there"
        raise InputError(problem, file=manifest, expected=MLPACKAGE_EXPECTED)


def _render_into(
    root_out: Path, bundle_folder: str, options: AppOptions, kv: KVCacheConfig, model_config: dict[str, Any]
) -> list[Path]:
    """Every file of the project, written below `root_out`; returns them, the marker last."""
    root = templates_root()
    env = _environment(root)
    context = template_context(options, kv, model_config, bundle_folder)
    written: list[Path] = []
    for source in sorted(root.rglob("*")):
        rel = source.relative_to(root)
        if source.is_dir() or rel.parts[0] == "_meta" or "__pycache__" in rel.parts:
            continue
        if rel.parts[:2] == COREML_SOURCES and options.coreml_model is None:
            continue
        if source.suffix == ".j2":
            try:
                text = env.get_template(rel.as_posix()).render(context)
            except jinja2.TemplateError as exc:
                raise AppGenError(f"template {rel}: {exc}") from exc
            _write(root_out / rel.with_suffix(""), text, written)
        else:
            _write(root_out / rel, source.read_text(), written)

    if options.coreml_model is not None:
        shutil.copytree(options.coreml_model, root_out / "App" / "Resources" / COREML_RESOURCE)
        written.append(root_out / "App" / "Resources" / COREML_RESOURCE)

    # Contract files: the Core tests decode exactly what Python wrote; the schemas document them for Swift.
    plan = example_soak_plan(kv)
    _write(root_out / CORE_FIXTURES / "kvcache.json", _dump(kv.model_dump(mode="json", by_alias=True)), written)
    _write(root_out / CORE_FIXTURES / SOAKPLAN_FILE, _dump(plan.model_dump(mode="json", by_alias=True)), written)
    _write(root_out / "Schemas" / "kvcache.schema.json", _dump(json_schema(KVCacheConfig)), written)
    _write(root_out / "Schemas" / "soakplan.schema.json", _dump(json_schema(SoakPlan)), written)
    telemetry_schema = TypeAdapter(TelemetryEvent).json_schema(by_alias=True)
    _write(root_out / "Schemas" / "telemetry.schema.json", _dump(telemetry_schema), written)
    _write(root_out / "Schemas" / "soakplan.example.json", _dump(plan.model_dump(mode="json", by_alias=True)), written)
    marker = {
        "generator": f"kvrig {__version__}",
        "app": options.name,
        "bundle": bundle_folder,
        "files": sorted(p.relative_to(root_out).as_posix() for p in written),
    }
    _write(root_out / MARKER, _dump(marker), written)
    return written
