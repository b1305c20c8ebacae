"""The compiled Swift engine as the virtual iPhone's launched app.

An app built with `kvrig build --virtual --app-runtime swift` runs `kvrig-engine`, the generated app's own
Engine, CacheSet and TokenLoop compiled against MLX Swift on this host (see kvrig.appgen.linux), instead
of kvrig's Python LLM runtime (kvrig.virtual.llmapp). With `--host-kernel` it speaks the same JSON-line
channel as the Python runtime (see kvrig.virtual.apprun): a measurement after every forward pass, the
kernel's verdict back. `resolve_runtime` picks the runtime for `kvrig demo` (`auto`: the Swift engine when
it can be built here, else the Python runtime, saying why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrig.appgen.linux import build_engine, built_engine
from kvrig.exceptions import EngineRunError, SwiftBuildError, SwiftDepsNotFoundError

RUNTIME = "swift"
"""Info.plist `KvrigVirtualRuntime` value of apps the virtual iPhone runs with the Swift engine."""
CHOICES = ("auto", "swift", "python")


class SwiftEngineMissingError(Exception):
    """The app asks for the Swift engine but it has not been built on this host."""


def engine_binary() -> Path | None:
    return built_engine()


def command(arguments: list[str]) -> list[str]:
    """The launched process: the engine binary talking to the virtual kernel, with the launch arguments."""
    binary = engine_binary()
    if binary is None:
        raise SwiftEngineMissingError(
            "this app runs the Swift engine, which is not built on this host: run `kvrig engine` "
            "(or rebuild the app with --app-runtime python)"
        )
    return [str(binary), "--host-kernel", *arguments]


@dataclass(frozen=True)
class RuntimeChoice:
    runtime: str
    """`swift` or `python` (an --app-runtime choice of `kvrig build --virtual`)."""
    why: str
    """What ran and why, for the user."""


def resolve_runtime(choice: str, on_event: Callable[[str], None] | None = None) -> RuntimeChoice:
    """`swift`: build the engine (incremental; errors propagate: exit 30/31); `python`: the Python runtime;
    `auto`: the Swift engine when it builds here, else the Python runtime with the reason."""

    if choice == "python":
        return RuntimeChoice("python", "kvrig's Python LLM runtime (asked for with --app-runtime python)")
    if choice not in CHOICES:
        raise ValueError(f"app runtime {choice!r}: expected one of {CHOICES}")
    if on_event is not None:
        on_event("building the app's Swift engine for this host (`kvrig engine`; minutes the first time) ...")
    try:
        build = build_engine()
    except (SwiftDepsNotFoundError, SwiftBuildError) as exc:
        if choice == "swift":
            raise
        first = str(exc).splitlines()[0]
        return RuntimeChoice(
            "python",
            f"kvrig's Python LLM runtime: the app's Swift engine cannot be built here ({first}); "
            "--app-runtime swift would stop instead",
        )
    return RuntimeChoice(
        "swift",
        f"the app's Swift engine ({build.binary.name}: its Engine, CacheSet and TokenLoop compiled against "
        "MLX Swift for this host)",
    )


def buffer_cache_held(runtime: str, limit: int) -> int:
    """Bytes MLX's buffer cache keeps, with its cap at `limit`, once arrays are freed, measured in the MLX the
    virtual iPhone's app runs: the Swift engine's MLX Swift (`kvrig-engine --probe-buffer-cache`) or this
    Python's MLX (`python`). The plan of the virtual iPhone counts this, not the cap: MLX Swift 0.31's CPU
    allocator keeps nothing (Memory.cacheMemory stays 0), while Python's mlx 0.32 keeps freed buffers up to it.
    """
    if runtime == RUNTIME:
        import json
        import subprocess

        proc = subprocess.run(
            [*command([])[:1], "--probe-buffer-cache", str(limit)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise EngineRunError(
                f"kvrig-engine --probe-buffer-cache exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
            )
        try:
            return int(json.loads(proc.stdout)["cache_bytes"])
        except (ValueError, KeyError, TypeError) as err:
            raise EngineRunError(
                f"kvrig-engine --probe-buffer-cache printed no JSON object with an integer `cache_bytes`: "
                f"{proc.stdout.strip()[-200:]!r}"
            ) from err
    import mlx.core as mx

    previous = mx.set_cache_limit(limit)
    mx.clear_cache()
    # Twice the cap in 64 pieces, as a forward pass frees many buffers (the Swift probe does the same).
    arrays = [mx.ones((max(1, 2 * limit // 4 // 64),), dtype=mx.float32) * (i + 1) for i in range(64)]
    mx.eval(arrays)
    del arrays
    held = int(mx.get_cache_memory())
    mx.clear_cache()
    mx.set_cache_limit(previous)
    return held
