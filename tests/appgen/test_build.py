"""`kvrig build` (XcodeGen and xcodebuild, macOS only): the refusal on other systems, and the Xcode it asks for."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvrig.appgen.toolchain import xcode_problem
from kvrig.exceptions import PlatformNotSupportedError


@pytest.mark.skipif(platform.system() == "Darwin", reason="the refusal is for systems without Xcode")
def test_build_refuses_clearly_where_there_is_no_xcode(reference_project: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", "build", str(reference_project)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == PlatformNotSupportedError.exit_code == 9, done.stderr
    assert "needs macOS" in done.stderr and "Traceback" not in done.stderr
    # What can be built here is named: the .ipa the virtual iPhone installs.
    assert f"kvrig build --virtual {reference_project}" in " ".join(done.stderr.split())


@pytest.mark.parametrize(
    ("printed", "refused"),
    [
        ("Xcode 16.2\nBuild version 16C5032a\n", True),  # Swift 6.0.3: mlx-swift-lm's manifest needs 6.1
        ("Xcode 15.4\nBuild version 15F31d\n", True),
        ("Xcode 16.3\nBuild version 16E140\n", False),
        ("Xcode 16.4\nBuild version 16F6\n", False),
        ("Xcode 26.1\nBuild version 17B55\n", False),
        ("xcode-select: error: tool 'xcodebuild' requires Xcode\n", True),  # only the Command Line Tools
    ],
)
def test_the_xcode_the_app_needs(printed: str, refused: bool) -> None:
    """`xcodebuild -version` as Xcode prints it; the app's MLX Swift packages need Swift 6.1 (Xcode 16.3)."""
    problem = xcode_problem(printed)
    assert (problem is not None) == refused, problem
    if refused:
        assert "Xcode" in problem  # type: ignore[operator]


def test_a_missing_metal_toolchain_is_named_first() -> None:
    """Xcode 26 installs its Metal Toolchain apart; without it MLX's kernels fail to compile, and Xcode's line
    saying so may be far above the 20 lines a failure shows."""
    from kvrig.appgen.build import failure_message

    log = (
        "error: cannot execute tool 'metal' due to missing Metal Toolchain; use: xcodebuild -downloadComponent "
        "MetalToolchain\n" + "\n".join(f"note: step {i}" for i in range(40)) + "\n** ARCHIVE FAILED **\n"
    )
    message = failure_message("xcodebuild", 65, log)
    assert message.splitlines()[1].startswith("Xcode has no Metal Toolchain")
    assert "xcodebuild -downloadComponent MetalToolchain" in message.splitlines()[1]
    assert message.endswith("** ARCHIVE FAILED **")
    assert "Metal" not in failure_message("xcodebuild", 65, "error: no signing certificate\n")
