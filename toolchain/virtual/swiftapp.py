"""The compiled Swift engine as the virtual iPhone's launched app.

An app built with `kvrig build --virtual --app-runtime swift` (the default once the Linux engine is built)
runs `kvrig-engine`, the generated app's own Engine, CacheSet and TokenLoop compiled against MLX Swift on
this host (see toolchain.appgen.linux), instead of kvrig's Python LLM runtime (toolchain.virtual.llmapp,
the fallback). With `--host-kernel` it speaks the same JSON-line channel as the Python runtime (see
toolchain.virtual.apprun): a measurement after every forward pass, the kernel's verdict back.
"""

from __future__ import annotations

from pathlib import Path

RUNTIME = "swift"
"""Info.plist `KvrigVirtualRuntime` value of apps the virtual iPhone runs with the Swift engine."""


class SwiftEngineMissingError(Exception):
    """The app asks for the Swift engine but it has not been built on this host."""


def engine_binary() -> Path | None:
    from toolchain.appgen.linux import built_engine

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
