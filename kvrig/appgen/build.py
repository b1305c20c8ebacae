"""`kvrig build PROJECT`: xcodegen + xcodebuild archive + export to an .ipa. macOS with Xcode only."""

from __future__ import annotations

import os
import platform
import plistlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.appgen.toolchain import xcode_problem
from kvrig.exceptions import AppGenError, InputError, PlatformNotSupportedError
from kvrig.fileio import read_data

TEAM_ENV = "KVRIG_TEAM_ID"


@dataclass(frozen=True)
class BuildResult:
    ipa: Path
    archive: Path


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AppGenError(failure_message(cmd[0], proc.returncode, proc.stdout + proc.stderr))


def failure_message(tool: str, code: int, output: str) -> str:
    """What a failed xcodegen or xcodebuild said: its last lines, and first what to do where the cause is known."""
    tail = "\n".join(output.strip().splitlines()[-20:])
    hint = ""
    if "missing Metal Toolchain" in output:
        # Xcode 26 installs it apart; MLX's Metal kernels need it, and Xcode's own line may be far up the log.
        hint = "Xcode has no Metal Toolchain (Xcode 26 ships it apart): xcodebuild -downloadComponent MetalToolchain\n"
    return f"{tool} failed (exit {code}):\n{hint}{tail}"


def read_project(project: Path) -> tuple[dict[str, Any], str]:
    """A generated project's project.yml and its product name (the Xcode scheme)."""
    spec_file = project / "project.yml"
    spec = read_data(spec_file, kind="yaml", mapping="the project.yml `kvrig app` writes")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InputError("missing", file=spec_file, field="name", expected="the product name")
    return spec, name


def build_app(project: str | Path, *, team: str | None = None, output: str | Path | None = None) -> BuildResult:
    """Generates the Xcode project, archives it for iphoneos and exports a development-signed .ipa.

    The signing team comes from `team`, else $KVRIG_TEAM_ID, else the project's DEVELOPMENT_TEAM.
    """
    if platform.system() != "Darwin":
        raise PlatformNotSupportedError(
            f"kvrig build needs macOS with Xcode and XcodeGen (this is {platform.system()}); "
            "copy the project to a Mac and run `kvrig build` there, or `xcodegen generate` and Xcode; here, "
            f"`kvrig build --virtual {project}` makes the .ipa the virtual iPhone installs"
        )
    project = Path(project).resolve()
    if not (project / "project.yml").is_file():
        raise InputError("not a generated project (no project.yml)", file=project)
    for tool in ("xcodegen", "xcodebuild"):
        if shutil.which(tool) is None:
            raise AppGenError(f"{tool} not found on PATH (install Xcode and `brew install xcodegen`)")
    version = subprocess.run(["xcodebuild", "-version"], capture_output=True, text=True)
    if (problem := xcode_problem(version.stdout + version.stderr)) is not None:
        raise AppGenError(problem)
    _, scheme = read_project(project)
    team = team or os.environ.get(TEAM_ENV)
    out = Path(output).resolve() if output else project / "build"
    archive = out / f"{scheme}.xcarchive"

    _run(["xcodegen", "generate"], project)
    archive_cmd = [
        "xcodebuild", "-project", f"{scheme}.xcodeproj", "-scheme", scheme, "-configuration", "Release",
        "-destination", "generic/platform=iOS", "-archivePath", str(archive), "-allowProvisioningUpdates",
        "archive",
    ]  # fmt: skip
    if team:
        archive_cmd.append(f"DEVELOPMENT_TEAM={team}")
    _run(archive_cmd, project)

    options = {"method": "development", "signingStyle": "automatic"}
    if team:
        options["teamID"] = team
    export_plist = out / "ExportOptions.plist"
    export_plist.write_bytes(plistlib.dumps(options))
    _run(
        ["xcodebuild", "-exportArchive", "-archivePath", str(archive), "-exportPath", str(out),
         "-exportOptionsPlist", str(export_plist), "-allowProvisioningUpdates"],
        project,
    )  # fmt: skip
    ipas = sorted(out.glob("*.ipa"))
    if not ipas:
        raise AppGenError(f"xcodebuild exported no .ipa into {out}")
    return BuildResult(ipa=ipas[0], archive=archive)
