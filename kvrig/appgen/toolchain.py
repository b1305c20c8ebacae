"""The toolchain versions the app's pinned MLX Swift packages need: mlx-swift-lm's manifest at the pinned version
says swift-tools-version 6.1, which Xcode has from 16.3."""

from __future__ import annotations

import re

MIN_SWIFT = (6, 1)
MIN_XCODE = (16, 3)


def too_old(printed: str, pattern: str, minimum: tuple[int, int], command: str, advice: str) -> str | None:
    """Why the toolchain whose `command` printed `printed` cannot build the app (None: it can). `pattern` finds
    its name and version (major and minor as groups 1 and 2)."""
    found = re.search(pattern, printed, re.MULTILINE)
    if found is None:
        return f"`{command}` printed no version: {printed.strip()[:200]!r}"
    if (int(found[1]), int(found[2])) < minimum:
        return f"{found[0]} is too old: the app's MLX Swift packages need {advice}"
    return None


def xcode_problem(printed: str) -> str | None:
    """Why the Xcode that `xcodebuild -version` printed cannot build the app."""
    need = f"Xcode {MIN_XCODE[0]}.{MIN_XCODE[1]} or later (Swift 6.1); install one, or select one with xcode-select"
    return too_old(printed, r"^Xcode (\d+)\.(\d+)", MIN_XCODE, "xcodebuild -version", need)


def swift_version_problem(printed: str) -> str | None:
    """Why the toolchain `swift --version` describes cannot build the engine."""
    need = f"Swift {MIN_SWIFT[0]}.{MIN_SWIFT[1]} or later (https://www.swift.org/install)"
    return too_old(printed, r"Swift version (\d+)\.(\d+)", MIN_SWIFT, "swift --version", need)
