"""Where MLX Swift comes from, with the real SwiftPM: not resolvable → exit 30 naming what is missing and how to
provide it (`--skip-unresolvable`: exit 0, recorded, and the engine tests skip); resolved through a mirror or
KVRIG_SWIFT_DEPS and failing to compile → exit 31, recorded as a failure, never a skip.

The resolvable cases resolve to stand-in packages (local git repositories with the pinned tags and MLX Swift's
product names, and none of its API): enough to show which way SwiftPM went, with nothing that can build the
engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvrig.appgen import linux
from kvrig.appgen.render import PINS
from kvrig.cli import main
from kvrig.exceptions import SwiftBuildError, SwiftDepsNotFoundError

pytestmark = pytest.mark.skipif(linux.shutil.which("swift") is None, reason="no Swift toolchain on PATH")

PRODUCTS = {
    "mlx-swift": ("MLX", "MLXNN"),
    "mlx-swift-lm": ("MLXLLM", "MLXLMCommon"),
    "swift-transformers": ("Tokenizers",),
}


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def _stand_in(folder: Path, name: str, *, tag: str | None) -> Path:
    """A package with `name`'s products, each an empty module, as a git repository tagged `tag`."""
    package = folder / name
    products = PRODUCTS[name]
    for product in products:
        (package / "Sources" / product).mkdir(parents=True)
        (package / "Sources" / product / f"{product}.swift").write_text("public let standIn = true\n")
    manifest = [
        "// swift-tools-version: 5.9",
        "import PackageDescription",
        f'let package = Package(name: "{name}",',
        "  products: [" + ", ".join(f'.library(name: "{p}", targets: ["{p}"])' for p in products) + "],",
        "  targets: [" + ", ".join(f'.target(name: "{p}")' for p in products) + "])",
    ]
    (package / "Package.swift").write_text("\n".join(manifest) + "\n")
    if tag is not None:
        _git(package, "init", "-q")
        _git(package, "add", ".")
        _git(package, "-c", "user.email=t@kvrig.dev", "-c", "user.name=t", "commit", "-qm", "stand-in")
        _git(package, "tag", tag)
    return package


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The engine's render and scratch folders in tmp_path, KVRIG_SWIFT_DEPS unset."""
    root = tmp_path / "build"
    monkeypatch.setattr(linux, "build_root", lambda: root)
    monkeypatch.delenv(linux.DEPS_ENV, raising=False)
    return root


def _kvrig(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Runs the CLI in this process (so build_root's patch holds): exit code, stdout, stderr."""
    code = 0
    try:
        main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _mirror_all(project: Path, to: dict[str, Path]) -> None:
    for name, pin in PINS.items():
        mirror = ["--original", pin["url"], "--mirror", str(to[name])]
        with linux.own_tmpdir(dict(os.environ)) as env:
            subprocess.run(
                ["swift", "package", "--package-path", str(project), "config", "set-mirror", *mirror],
                env=env,
                check=True,
                capture_output=True,
            )


def test_unresolvable_exits_30_saying_what_is_missing_and_how_to_provide_it(
    build_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Mirrors to folders that do not exist: unresolvable on any machine, with or without network.
    project = linux.render_engine_project()
    _mirror_all(project, {name: tmp_path / "nowhere" / name for name in PINS})
    code, _, err = _kvrig(capsys, "engine")
    assert code == SwiftDepsNotFoundError.exit_code == 30
    assert err.startswith("kvrig: error: MLX Swift packages not resolvable: ") and "Traceback" not in err
    message = err.removeprefix("kvrig: error: ").rstrip("\n")
    for name in PINS:
        assert str(tmp_path / "nowhere" / name) in message
    for name, pin in PINS.items():
        assert f"{name} {pin['version']}" in message
    assert linux.DEPS_ENV in message and "set-mirror" in message
    if linux.platform.system() == "Linux":
        assert linux.LINUX_FIXES_DOC in message
        assert (linux.repo_root() / linux.LINUX_FIXES_DOC).is_file()
    status = linux.engine_status()
    assert status is not None and status.state == "unresolvable" and status.detail == message


def test_skip_unresolvable_exits_0_and_records_the_skip(
    build_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = linux.render_engine_project()
    _mirror_all(project, {name: tmp_path / "nowhere" / name for name in PINS})
    code, stdout, err = _kvrig(capsys, "engine", "--skip-unresolvable", "--json")
    assert code == 0, err
    out = json.loads(stdout)
    assert out["built"] is False and out["exit_code"] == 30
    assert out["skipped"].startswith("MLX Swift packages not resolvable")
    status = linux.engine_status()
    assert status is not None and status.state == "unresolvable"


def test_deps_folder_without_the_checkouts_names_them(
    build_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "deps"
    _stand_in(folder, "mlx-swift", tag=None)
    monkeypatch.setenv(linux.DEPS_ENV, str(folder))
    with pytest.raises(SwiftDepsNotFoundError) as failure:
        linux.build_engine()
    assert f"{linux.DEPS_ENV}={folder}" in str(failure.value)
    assert "mlx-swift-lm, swift-transformers" in str(failure.value)


def test_no_swift_toolchain_is_not_resolvable(build_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SwiftDepsNotFoundError, match="no `swift` on PATH"):
        linux.build_and_record()
    status = linux.engine_status()
    assert status is not None and status.state == "unresolvable"


@pytest.mark.parametrize("source", ["mirror", "local"])
def test_resolved_but_not_building_is_a_failure_not_a_skip(
    source: str, build_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_ins = {name: _stand_in(tmp_path / "deps", name, tag=PINS[name]["version"]) for name in PINS}
    if source == "mirror":
        _mirror_all(linux.render_engine_project(), stand_ins)
    else:
        monkeypatch.setenv(linux.DEPS_ENV, str(tmp_path / "deps"))
    # The user's temporary folder: Swift's driver leaves a TemporaryDirectory.* there on every run on Linux.
    user_tmp = tmp_path / "tmp"
    user_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(user_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(SwiftBuildError) as failure:
        linux.build_and_record()
    assert sorted(user_tmp.iterdir()) == []
    assert failure.value.exit_code == 31
    # The app's sources reached the compiler, which found MLX's modules but none of their API in the stand-ins
    # (which name it meets first varies with the order the compiler takes the files in: MLXArray, Memory, ...).
    errors = [line for line in str(failure.value).splitlines() if "error:" in line]
    assert errors and not any("no such module" in line for line in errors), errors
    assert any(re.search(r"cannot find (type )?'\w+' in scope|has no member", line) for line in errors), errors
    status = linux.engine_status()
    assert status is not None and status.state == "build_failed"
    if source == "mirror":
        # SwiftPM records the original URLs at the pinned versions, fetched from the mirrors (no network here).
        resolved = json.loads((build_root / "swift-engine-app" / "Package.resolved").read_text())
        pins = {pin["identity"]: (pin["location"], pin["state"]["version"]) for pin in resolved["pins"]}
        assert pins == {name: (pin["url"], pin["version"]) for name, pin in PINS.items()}


def test_the_engine_is_not_built_on_macos(monkeypatch: pytest.MonkeyPatch) -> None:
    """On macOS the app's Darwin branches and Metal's library are Xcode's: `kvrig engine` says so as an
    unresolvable build (make test's --skip-unresolvable skips, the demo's auto runtime takes Python) instead of
    compiling MLX for minutes and failing."""
    import platform

    from kvrig.appgen.linux import build_engine
    from kvrig.exceptions import EngineNotForThisHostError
    from kvrig.virtual.swiftapp import resolve_runtime

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    with pytest.raises(EngineNotForThisHostError, match="Linux") as refused:
        build_engine()
    assert isinstance(refused.value, SwiftDepsNotFoundError) and refused.value.exit_code == 30
    choice = resolve_runtime("auto")
    assert choice.runtime == "python" and "Darwin" in choice.why


@pytest.mark.parametrize(
    ("printed", "refused"),
    [
        ("Swift version 6.3.1 (swift-6.3.1-RELEASE)\nTarget: x86_64-unknown-linux-gnu\n", False),
        ("Swift version 6.0.3 (swift-6.0.3-RELEASE)\nTarget: aarch64-unknown-linux-gnu\n", True),
        ("swift-driver version: 1.120.5 Apple Swift version 6.1 (swiftlang-6.1.0.110.21 clang-1700.0.13.3)\n", False),
        ("Apple Swift version 5.10 (swiftlang-5.10.0.13 clang-1500.3.9.4)\n", True),
        ("", True),
    ],
)
def test_a_toolchain_too_old_for_the_pins_is_unresolvable(printed: str, refused: bool) -> None:
    """`swift --version` as Swift.org's and Apple's toolchains print it: one before 6.1 cannot read mlx-swift-lm's
    manifest, which is a missing toolchain (a named skip), not a failed build of kvrig's sources."""
    from kvrig.appgen.toolchain import swift_version_problem

    assert (swift_version_problem(printed) is not None) == refused
