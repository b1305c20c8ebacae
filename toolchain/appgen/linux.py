"""The Linux (CPU) build of the generated app's engine: `build_engine()` renders the app once into a stable
folder and runs `swift build` on its Package.swift (every App source except the SwiftUI views, Core, and the
headless runner `kvrig-engine`) against MLX Swift's sources, in the Swift language mode the Xcode project
uses (5) or in Swift 6 mode.

MLX Swift's sources come from the folder KVRIG_SWIFT_DEPS names (the Makefile sets it for `make test`): they are
changed to build offline on Linux and are not part of kvrig. The scratch folder
(`.build/swift-engine` in the repository) stays put, so only changed sources recompile.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from toolchain.appgen.render import AppOptions, render_app
from toolchain.exceptions import SwiftBuildError, SwiftDepsNotFoundError
from toolchain.schemas.kvcache import KVCacheConfig, LayerCache, host_kvcache

DEPS_ENV = "KVRIG_SWIFT_DEPS"
MODE_ENV = "KVRIG_SWIFT_LANGUAGE_MODE"
XCODE_LANGUAGE_MODE = "5"  # project.yml's SWIFT_VERSION
LANGUAGE_MODES = ("5", "6")
PRODUCT = "kvrig-engine"
REQUIRED_DEPS = ("mlx-swift", "mlx-swift-lm", "swift-transformers")
# MLX's C++ core optimized even in the debug build: at -O0 it prefills SmolLM2 at a few tokens/s, too slow to
# soak; -O2 costs some build time once and leaves the Swift code (the app's own) a debug build. README: numbers.
CXX_FLAGS = ("-Xcxx", "-O2")
ENGINE_OPTIONS = AppOptions(name="kvrig engine", bundle_id="dev.kvrig.engine")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def build_root() -> Path:
    return repo_root() / ".build"


def swift_deps() -> Path:
    """MLX Swift's sources: the folder KVRIG_SWIFT_DEPS names."""
    configured = os.environ.get(DEPS_ENV)
    if not configured:
        raise SwiftDepsNotFoundError(
            f"{DEPS_ENV} is not set: it names a folder holding mlx-swift, mlx-swift-lm and swift-transformers "
            "sources that build on Linux"
        )
    folder = Path(configured)
    missing = [name for name in REQUIRED_DEPS if not (folder / name / "Package.swift").is_file()]
    if missing:
        raise SwiftDepsNotFoundError(
            f"{folder}: no {', '.join(missing)} sources (set {DEPS_ENV} to a folder holding mlx-swift, "
            "mlx-swift-lm and swift-transformers that build on Linux)"
        )
    return folder.resolve()


def swift_executable() -> str:
    swift = shutil.which("swift")
    if swift is None:
        raise SwiftDepsNotFoundError("no `swift` on PATH: the engine's Linux build needs a Swift 6 toolchain")
    return swift


def _engine_kvcache() -> KVCacheConfig:
    # Only AppConfig.swift depends on the bundle, and the runner takes its bundle as an argument.
    return host_kvcache([LayerCache(layer=0, kind="full")], max_context=2048, prefill_step_size=256)


def sync_tree(source: Path, target: Path, *, keep: tuple[str, ...] = ()) -> None:
    """Copies changed files only (unchanged sources keep their times, so SwiftPM rebuilds only what changed) and
    removes what `source` no longer has, except below the folders named in `keep` (e.g. a build folder)."""
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        elif not dest.exists() or not filecmp.cmp(path, dest, shallow=False):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    for dest in sorted(target.rglob("*"), reverse=True):
        relative = dest.relative_to(target)
        if keep and set(relative.parts) & set(keep):
            continue
        if not (source / relative).exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()


def render_engine_project(project: Path | None = None) -> Path:
    """Renders the app's templates into `project` (default .build/swift-engine-app), changed files only."""
    project = project or build_root() / "swift-engine-app"
    staging = build_root() / "swift-engine-render"
    bundle = staging / "bundle" / "kvrig-engine"
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "kvcache.json").write_text(_engine_kvcache().model_dump_json(by_alias=True, indent=2))
    render_app(bundle, staging / "app", ENGINE_OPTIONS, force=True)
    project.mkdir(parents=True, exist_ok=True)
    sync_tree(staging / "app", project)
    return project


@dataclass(frozen=True)
class EngineBuild:
    binary: Path
    language_mode: str
    seconds: float


def build_engine(
    language_mode: str = XCODE_LANGUAGE_MODE,
    *,
    configuration: str = "debug",
    project: Path | None = None,
    scratch: Path | None = None,
) -> EngineBuild:
    """Renders and builds kvrig-engine; raises SwiftBuildError with the compiler's errors when it fails."""
    if language_mode not in LANGUAGE_MODES:
        raise ValueError(f"language mode {language_mode!r}: expected one of {LANGUAGE_MODES}")
    deps, swift = swift_deps(), swift_executable()
    project = render_engine_project(project)
    scratch = scratch or build_root() / "swift-engine"
    env = {**os.environ, DEPS_ENV: str(deps), MODE_ENV: language_mode}
    cmd = [swift, "build", "--package-path", str(project), "--scratch-path", str(scratch)]
    cmd += ["-c", configuration, "--product", PRODUCT, *(CXX_FLAGS if configuration == "debug" else ())]
    began = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        errors = [line for line in lines if "error:" in line] or lines[-30:]
        raise SwiftBuildError(f"swift build (Swift {language_mode} mode) failed:\n" + "\n".join(errors[:60]))
    return EngineBuild(scratch / configuration / PRODUCT, language_mode, time.monotonic() - began)


def built_engine(configuration: str = "debug") -> Path | None:
    """The runner binary if it has been built (the virtual iPhone runs it), else None."""
    binary = build_root() / "swift-engine" / configuration / PRODUCT
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None
