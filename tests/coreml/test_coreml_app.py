"""`kvrig app --coreml`: the generated project carries the Core ML program beside the MLX bundle (a
flag-guarded source entry in project.yml and the small Core ML engine); without the flag nothing changes."""

from __future__ import annotations

import filecmp
import plistlib
import shutil
from pathlib import Path

import pytest
import yaml

from kvrig.appgen.render import AppOptions, render_app
from kvrig.coreml.export import ExportResult
from kvrig.exceptions import InputError
from kvrig.schemas.keys import COREML_MODEL_KEY

ENGINE = Path("App/CoreML/CoreMLEngine.swift")
RUNNER = Path("App/CoreML/CoreMLRunner.swift")
APP_ENGINE = Path("App/Sources/Engine.swift")
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
    assert (out / ENGINE).is_file() and (out / RUNNER).is_file()
    # What `kvrig soak --backend coreml` checks on the installed app, and what lets Engine reach App/CoreML.
    info = plistlib.loads((out / "App/Info.plist").read_bytes())
    assert info[COREML_MODEL_KEY] == RESOURCE.name
    spec = yaml.safe_load((out / "project.yml").read_text())
    (target,) = spec["targets"].values()
    assert "KVRIG_COREML" in target["settings"]["base"]["SWIFT_ACTIVE_COMPILATION_CONDITIONS"].split()

    plain = tmp_path / "without"
    render_app(bundle, plain, AppOptions(name="Tiny", bundle_id="com.example.tiny"))
    assert _sources(plain) == [{"path": "App/Sources"}]
    assert COREML_MODEL_KEY not in plistlib.loads((plain / "App/Info.plist").read_bytes())
    assert "KVRIG_COREML" not in (plain / "project.yml").read_text()
    assert not (plain / "App/CoreML").exists() and not (plain / "App/Resources").exists()


def test_flag_needs_a_core_ml_package(tiny_exports: dict[str, ExportResult], tmp_path: Path) -> None:
    bundle = Path(tiny_exports["qwen3-q8"].bundle)
    options = AppOptions(name="Tiny", bundle_id="com.example.tiny", coreml_model=bundle)
    with pytest.raises(InputError, match="Core ML package") as info:
        render_app(bundle, tmp_path / "out", options)
    assert info.value.file == str(bundle) and info.value.exit_code == 3


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda m: m.write_text("{not json"), "not valid JSON"),
        (lambda m: m.write_text("[]"), "not a JSON mapping"),
        (lambda m: m.write_text('{"itemInfoEntries": {}, "rootModelIdentifier": "x"}'), "rootModelIdentifier"),
        (lambda m: (m.parent / "Data/com.apple.CoreML/model.mlmodel").unlink(), "is not there"),
        (
            lambda m: m.write_text(m.read_text().replace("com.apple.CoreML/model.mlmodel", "../../../etc/hostname")),
            "is not there",
        ),
        (lambda m: m.write_text(m.read_text().replace("com.apple.CoreML/model.mlmodel", "a\\u0000b")), "is not there"),
    ],
    ids=["cut short", "a list", "no root entry", "no root model", "root outside the package", "a NUL in the path"],
)
def test_a_damaged_package_is_refused_before_it_is_shipped(
    tiny_exports: dict[str, ExportResult], tmp_path: Path, damage, says: str
) -> None:
    """Only Manifest.json's presence was checked: a package Xcode cannot read was copied into the project, to fail
    the build on a Mac."""
    package = tmp_path / "Bad.mlpackage"
    shutil.copytree(tiny_exports["qwen3-q8"].output, package)
    damage(package / "Manifest.json")
    options = AppOptions(name="Tiny", bundle_id="com.example.tiny", coreml_model=package)
    with pytest.raises(InputError, match=says) as info:
        render_app(Path(tiny_exports["qwen3-q8"].bundle), tmp_path / "out", options)
    assert info.value.exit_code == 3 and "Manifest.json" in str(info.value.file)
    assert not (tmp_path / "out").exists()


def _parse(path: Path):  # type: ignore[no-untyped-def]
    import tree_sitter_swift
    from tree_sitter import Language, Parser

    from kvrig.appgen.render import templates_root

    source = (templates_root() / path).read_bytes()
    return source, Parser(Language(tree_sitter_swift.language())).parse(source)


@pytest.mark.parametrize("path", [ENGINE, RUNNER, APP_ENGINE], ids=lambda p: p.name)
def test_core_ml_sources_parse_as_swift(path: Path) -> None:
    # Core ML is not on Linux, so these branches are not compiled here; their syntax is checked with
    # tree-sitter-swift (Engine.swift's Core ML branch sits under `#if KVRIG_COREML`).
    source, tree = _parse(path)
    assert not tree.root_node.has_error, path
    assert b"backend: .coreml" in source or path == APP_ENGINE


def _conditional_blocks(source: str) -> tuple[str, str]:
    """Splits Swift source into (outside any #if, inside #if KVRIG_COREML ... #else/#endif)."""
    outside, inside, depth, in_coreml = [], [], 0, False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#if"):
            depth += 1
            in_coreml = in_coreml or "KVRIG_COREML" in stripped
        elif stripped.startswith("#else") and in_coreml and depth == 1:
            in_coreml = False
        elif stripped.startswith("#endif"):
            depth -= 1
            in_coreml = in_coreml and depth > 0
        (inside if in_coreml else outside).append(line)
    return "\n".join(outside), "\n".join(inside)


def test_linux_visible_engine_has_no_core_ml_symbols() -> None:
    # The Linux engine build compiles Engine.swift without KVRIG_COREML: Core ML names appear only inside it.
    source, _ = _parse(APP_ENGINE)
    outside, inside = _conditional_blocks(source.decode())
    assert "CoreMLRunner()" in inside
    for symbol in ("import CoreML", "CoreMLRunner", "CoreMLEngine", "MLModel", "MLMultiArray"):
        assert symbol not in outside, symbol
