"""`kvrig app --coreml`: the generated project carries the Core ML program beside the MLX bundle (a
flag-guarded source entry in project.yml and the small Core ML engine); without the flag nothing changes."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import yaml

from toolchain.appgen.render import AppOptions, render_app
from toolchain.coreml.export import ExportResult
from toolchain.exceptions import InputError

ENGINE = Path("App/CoreML/CoreMLEngine.swift")
RESOURCE = Path("App/Resources/KvrigModel.mlpackage")


def _sources(project: Path) -> list[dict]:
    spec = yaml.safe_load((project / "project.yml").read_text())
    (target,) = spec["targets"].values()
    return target["sources"]


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_flag_ships_the_package_and_its_engine(tiny_exports: dict[str, ExportResult], tmp_path: Path) -> None:
    result = tiny_exports["qwen3-q8"]
    bundle = Path(result.bundle)
    options = AppOptions(name="Tiny", bundle_id="com.example.tiny", coreml_model=Path(result.output))
    out = tmp_path / "with"
    render_app(bundle, out, options)
    assert _sources(out) == [
        {"path": "App/Sources"},
        {"path": "App/CoreML"},
        {"path": RESOURCE.as_posix(), "type": "file", "buildPhase": "sources"},
    ]
    assert _same_tree(Path(result.output), out / RESOURCE)
    assert (out / ENGINE).is_file()

    plain = tmp_path / "without"
    render_app(bundle, plain, AppOptions(name="Tiny", bundle_id="com.example.tiny"))
    assert _sources(plain) == [{"path": "App/Sources"}]
    assert not (plain / "App/CoreML").exists() and not (plain / "App/Resources").exists()


def test_flag_needs_a_core_ml_package(tiny_exports: dict[str, ExportResult], tmp_path: Path) -> None:
    bundle = Path(tiny_exports["qwen3-q8"].bundle)
    options = AppOptions(name="Tiny", bundle_id="com.example.tiny", coreml_model=bundle)
    with pytest.raises(InputError, match="Core ML package") as info:
        render_app(bundle, tmp_path / "out", options)
    assert info.value.file == str(bundle) and info.value.exit_code == 3


def test_engine_source_parses_as_swift() -> None:
    # Core ML is not on Linux, so the file is not compiled here; its syntax is checked with tree-sitter-swift.
    import tree_sitter_swift
    from tree_sitter import Language, Parser

    from toolchain.appgen.render import templates_root

    source = (templates_root() / ENGINE).read_bytes()
    tree = Parser(Language(tree_sitter_swift.language())).parse(source)
    assert not tree.root_node.has_error
    assert b"backend: .coreml" in source
