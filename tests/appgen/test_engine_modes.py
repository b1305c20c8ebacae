"""The compiler is the check on the templates' MLX symbols: the engine builds in Swift 6 mode as well as in the
Xcode project's mode 5, and an unknown MLX symbol in a template fails the build, naming it.

Both need MLX Swift resolved (the engine_binary fixture skips them with the reason where it is not). These
rebuild only the engine's own target (MLX's stay built in the shared scratch folder); they run after
the modules that use the engine binary, and leave the templates' real rendering behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvrig.appgen import linux, render
from kvrig.appgen.linux import build_engine
from kvrig.exceptions import SwiftBuildError
from tests.appgen.swift_engine import engine_binary  # noqa: F401

UNKNOWN = "kvrigNoSuchMLXSymbol"


def test_engine_builds_in_swift_6_mode(engine_binary: Path) -> None:  # noqa: F811
    result = build_engine("6")
    assert result.binary.is_file() and result.language_mode == "6"


def test_unknown_mlx_symbol_in_a_template_fails_the_build(
    engine_binary: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    templates = tmp_path / "swift"
    shutil.copytree(render.templates_root(), templates)
    engine = templates / "App" / "Sources" / "TokenLoop.swift"
    engine.write_text(engine.read_text() + f"\nfunc kvrigBroken() {{ _ = MLX.{UNKNOWN}(1) }}\n")
    monkeypatch.setattr(render, "templates_root", lambda: templates)
    try:
        with pytest.raises(SwiftBuildError) as failure:
            build_engine("5")
        assert UNKNOWN in str(failure.value)
        assert failure.value.exit_code == 31
    finally:
        monkeypatch.undo()
        linux.render_engine_project()  # the real templates again, for the next build
