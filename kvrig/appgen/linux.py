"""The Linux (CPU) build of the generated app's engine: `build_engine()` renders the app once into a stable
folder and runs `swift build` on its Package.swift (every App source except the SwiftUI views, Core, and the
headless runner `kvrig-engine`) against MLX Swift, in the Swift language mode the Xcode project uses (5) or in
Swift 6 mode.

MLX Swift comes the way SwiftPM brings any package: the versions project.yml pins, resolved by URL or through
SwiftPM's mirrors, or local checkouts in the folder KVRIG_SWIFT_DEPS names. Where none resolves, the build
stops with SwiftDepsNotFoundError (exit 30) saying what is missing and how to provide it; `kvrig engine
--skip-unresolvable` (make test) records that as a skip: `kvrig engine` leaves its outcome in `status.json`
beside the build, which the engine tests read. The scratch folder (`.build/swift-engine`) stays put, so only
changed sources recompile.
"""

from __future__ import annotations

import filecmp
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvrig.appgen.render import PINS, AppOptions, render_project
from kvrig.appgen.toolchain import swift_version_problem
from kvrig.exceptions import EngineNotForThisHostError, SwiftBuildError, SwiftDepsNotFoundError
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, host_kvcache

DEPS_ENV = "KVRIG_SWIFT_DEPS"
MODE_ENV = "KVRIG_SWIFT_LANGUAGE_MODE"
XCODE_LANGUAGE_MODE = "5"  # project.yml's SWIFT_VERSION
LANGUAGE_MODES = ("5", "6")
PRODUCT = "kvrig-engine"
REQUIRED_DEPS = tuple(PINS)
TRANSITIVE_DEPS = (
    "swift-numerics (mlx-swift)",
    "swift-syntax (mlx-swift-lm's macros)",
    "swift-jinja, swift-huggingface, swift-xet, swift-collections, swift-crypto, yyjson (swift-transformers)",
)
"""What the pinned releases' own manifests require (read from their Package.swift at the pinned tags)."""
STATUS_FILE = "status.json"
# Cloning mlx-swift with its submodules takes minutes on a slow link; a host that drops packets instead of
# refusing them must not hold `make test` for ever.
RESOLVE_TIMEOUT_S = 1800.0
# MLX's C++ core optimized even in the debug build: at -O0 it prefills SmolLM2 at a few tokens/s, too slow to
# soak; -O2 costs some build time once and leaves the Swift code (the app's own) a debug build.
CXX_FLAGS = ("-Xcxx", "-O2")
ENGINE_OPTIONS = AppOptions(name="kvrig engine", bundle_id="dev.kvrig.engine")
LINUX_FIXES_DOC = "docs/engine-linux.md"

EngineState = Literal["built", "unresolvable", "build_failed"]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def build_root() -> Path:
    return repo_root() / ".build"


def scratch_root() -> Path:
    return build_root() / "swift-engine"


def local_deps() -> Path | None:
    """The folder of local checkouts KVRIG_SWIFT_DEPS names, or None (SwiftPM resolves the pins by URL)."""
    configured = os.environ.get(DEPS_ENV)
    if not configured:
        return None
    folder = Path(configured)
    missing = [name for name in REQUIRED_DEPS if not (folder / name / "Package.swift").is_file()]
    if missing:
        raise SwiftDepsNotFoundError(
            f"MLX Swift packages not resolvable: {DEPS_ENV}={folder} holds no {', '.join(missing)} checkout "
            f"(expected {', '.join(f'{name}/Package.swift' for name in REQUIRED_DEPS)} there)\n" + how_to_provide()
        )
    return folder.resolve()


def swift_executable() -> str:
    swift = shutil.which("swift")
    if swift is None:
        raise SwiftDepsNotFoundError(
            "MLX Swift packages not resolvable: no `swift` on PATH (the engine build needs a Swift 6.1 or later "
            "toolchain, https://www.swift.org/install)"
        )
    with own_tmpdir(dict(os.environ)) as env:
        shown = subprocess.run([swift, "--version"], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if (problem := swift_version_problem(shown.stdout + shown.stderr)) is not None:
        raise SwiftDepsNotFoundError(f"MLX Swift packages not resolvable: {problem}")
    return swift


def how_to_provide() -> str:
    """What a user can do when the pinned packages do not resolve: the lines of SwiftDepsNotFoundError."""
    pins = ", ".join(f"{name} {pin['version']}" for name, pin in PINS.items())
    lines = [
        f"The engine builds against {pins}. Provide them one of these ways:",
        "  - network access to github.com: SwiftPM resolves the pinned versions by URL;",
        f"  - {DEPS_ENV}=/path/to/folder holding local checkouts {', '.join(f'{n}/' for n in REQUIRED_DEPS)};",
        "  - SwiftPM mirrors to local git repositories carrying the pinned tags, e.g. "
        f"`swift package --package-path {build_root() / 'swift-engine-app'} config set-mirror --original "
        f"{PINS['mlx-swift']['url']} --mirror /path/to/mlx-swift` (or ~/.swiftpm/configuration/mirrors.json).",
        "Their own manifests name more packages, which SwiftPM resolves the same ways (by URL, or a mirror each, or "
        f"dropped from a local checkout's manifest): {', '.join(TRANSITIVE_DEPS)}.",
    ]
    if platform.system() == "Linux":
        lines.append(
            "On Linux the pinned releases also need fixes before they build (MLXFast on Linux, the default device "
            "from the core, a compiled preamble generated with g++, mlx-swift-lm's Linux shims): "
            f"{LINUX_FIXES_DOC} names them with their upstream references."
        )
    return "\n".join(lines)


def _write_status(scratch: Path, state: EngineState, detail: str, **extra: object) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "detail": detail, DEPS_ENV: os.environ.get(DEPS_ENV), **extra}
    (scratch / STATUS_FILE).write_text(json.dumps(record, indent=2) + "\n")


@dataclass(frozen=True)
class EngineStatus:
    """The outcome of the last `kvrig engine` (or build_engine) in this repository."""

    state: EngineState
    detail: str


def engine_status(scratch: Path | None = None) -> EngineStatus | None:
    path = (scratch or scratch_root()) / STATUS_FILE
    try:
        record = json.loads(path.read_text())
        return EngineStatus(record["state"], record["detail"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _engine_kvcache() -> KVCacheConfig:
    # Only AppConfig.swift depends on the bundle, and the runner takes its bundle as an argument (the engine reads
    # that bundle's config.json for its model type).
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
    shutil.rmtree(staging / "app", ignore_errors=True)  # kvrig's own staging, whatever rendered it before
    render_project(_engine_kvcache(), {}, PRODUCT, staging / "app", ENGINE_OPTIONS)
    project.mkdir(parents=True, exist_ok=True)
    # SwiftPM's own state in the project (mirrors set with `swift package config set-mirror`, the resolved pins).
    sync_tree(staging / "app", project, keep=(".swiftpm", "Package.resolved"))
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
    """Renders, resolves and builds kvrig-engine. Raises SwiftDepsNotFoundError when MLX Swift cannot be
    resolved (or there is no Swift toolchain) and SwiftBuildError with the compiler's errors when the build
    fails."""
    if language_mode not in LANGUAGE_MODES:
        raise ValueError(f"language mode {language_mode!r}: expected one of {LANGUAGE_MODES}")
    if platform.system() != "Linux":
        # On macOS the Darwin branches (os_proc_available_memory, iOS only) and Metal's library are Xcode's work.
        raise EngineNotForThisHostError(
            f"MLX Swift engine not built on {platform.system()}: kvrig engine is the app's Linux (CPU) build; "
            "on macOS Xcode builds the app (kvrig build), and the virtual iPhone runs kvrig's Python runtime"
        )
    scratch = scratch or scratch_root()
    began = time.monotonic()
    deps, swift = local_deps(), swift_executable()
    project = render_engine_project(project)
    env = {key: value for key, value in os.environ.items() if key != DEPS_ENV}
    env[MODE_ENV] = language_mode
    if deps is not None:
        env[DEPS_ENV] = str(deps)
    cmd = [swift, "build", *_package_args(project, scratch), "-c", configuration, "--product", PRODUCT]
    cmd += CXX_FLAGS if configuration == "debug" else ()
    with own_tmpdir(env) as env:
        _check_manifest(swift, project, scratch, env)
        _resolve(swift, project, scratch, env)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        message = f"swift build (Swift {language_mode} mode) failed:\n" + _errors(proc)
        if platform.system() == "Linux" and deps is None:
            message += f"\nThe pinned MLX Swift releases need Linux fixes before they build: see {LINUX_FIXES_DOC}."
        raise SwiftBuildError(message)
    return EngineBuild(scratch / configuration / PRODUCT, language_mode, time.monotonic() - began)


def build_and_record(language_mode: str = XCODE_LANGUAGE_MODE, *, configuration: str = "debug") -> EngineBuild:
    """`kvrig engine`: build_engine, leaving its outcome in status.json, where the engine tests read whether to
    run (built), skip (unresolvable) or fail (build_failed). Other builds (the demo's, the tests' own) leave it."""
    scratch = scratch_root()
    try:
        result = build_engine(language_mode, configuration=configuration, scratch=scratch)
    except SwiftDepsNotFoundError as exc:
        _write_status(scratch, "unresolvable", str(exc))
        raise
    except SwiftBuildError as exc:
        _write_status(scratch, "build_failed", str(exc))
        raise
    _write_status(scratch, "built", f"built {result.binary}", binary=str(result.binary), language_mode=language_mode)
    return result


@contextmanager
def own_tmpdir(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """`env` with TMPDIR pointing at a folder removed afterwards: Swift's driver on Linux leaves an empty
    TemporaryDirectory.* in TMPDIR on every run (swift, swiftc, swift package), hundreds over a user's builds."""
    with tempfile.TemporaryDirectory(prefix="kvrig-swift-") as tmp:
        yield {**env, "TMPDIR": tmp}


def _package_args(project: Path, scratch: Path) -> list[str]:
    return ["--package-path", str(project), "--scratch-path", str(scratch)]


def _errors(proc: subprocess.CompletedProcess[str], limit: int = 60) -> str:
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join(([line for line in lines if "error:" in line] or lines[-30:])[:limit])


def _check_manifest(swift: str, project: Path, scratch: Path, env: dict[str, str]) -> None:
    """The manifests are ours: one that does not compile is a build failure, never "not resolvable"."""
    cmd = [swift, "package", *_package_args(project, scratch), "dump-package"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SwiftBuildError(f"{project / 'Package.swift'}: the manifest does not compile:\n" + _errors(proc))


def _resolve(swift: str, project: Path, scratch: Path, env: dict[str, str]) -> None:
    cmd = [swift, "package", *_package_args(project, scratch), "resolve"]
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=RESOLVE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise SwiftDepsNotFoundError(
            f"MLX Swift packages not resolvable: `swift package resolve` did not finish in {RESOLVE_TIMEOUT_S:.0f} s\n"
            + how_to_provide()
        ) from exc
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        # SwiftPM's error often names only its cache folder; the URLs it was fetching say what is missing.
        fetching = sorted(set(re.findall(r"Fetching (\S+)", output)))
        tried = f"SwiftPM could not fetch {', '.join(fetching)}; " if fetching else ""
        if any(url.startswith("https://") for url in fetching) and "org.swift.swiftpm/repositories" in output:
            # The clone left nothing in SwiftPM's cache: what it names is the folder, not the cause.
            tried += "its clones never reached its cache (usually no network access to those hosts); "
        raise SwiftDepsNotFoundError(
            f"MLX Swift packages not resolvable: {tried}it said: {_errors(proc, limit=4).strip()}\n" + how_to_provide()
        )


def built_engine(configuration: str = "debug") -> Path | None:
    """The runner binary if it has been built (the virtual iPhone runs it), else None."""
    binary = scratch_root() / configuration / PRODUCT
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None
