"""The App uses only MLX symbols that are on the checked-in list, each verified against a pinned version."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolchain.appgen.render import PINS, templates_root
from toolchain.appgen.symbols import collect_files, load_platform_names, load_symbol_list, unlisted_symbols

META = templates_root() / "_meta"


def sources(project: Path) -> tuple[list[Path], list[Path]]:
    app = sorted((project / "App/Sources").glob("*.swift"))
    return app, app + sorted((project / "Core/Sources").rglob("*.swift"))


def test_app_uses_only_listed_symbols(reference_project: Path) -> None:
    app, own = sources(reference_project)
    unknown = unlisted_symbols(app, own, load_symbol_list(META / "mlx_symbols.yaml"), load_platform_names(
        META / "platform_symbols.txt"))  # fmt: skip
    assert unknown == {}, "add these to templates/swift/_meta/mlx_symbols.yaml after checking them at the pin"


def test_an_unlisted_mlx_call_fails(tmp_path: Path, reference_project: Path) -> None:
    project = tmp_path / "p"
    shutil.copytree(reference_project, project)
    (project / "App/Sources/Extra.swift").write_text(
        "import MLX\nimport MLXLMCommon\n\nfunc extra(x: MLXArray) -> MLXArray {\n"
        "    let cache = RotatingKVCache(maxSize: 8, keep: 4)\n"
        "    return MLXFast.rmsNorm(x, weight: x, eps: 1e-5)\n}\n"
    )
    app, own = sources(project)
    unknown = unlisted_symbols(app, own, load_symbol_list(META / "mlx_symbols.yaml"), load_platform_names(
        META / "platform_symbols.txt"))  # fmt: skip
    assert {"RotatingKVCache", "MLXFast", "rmsNorm", "maxSize", "eps"} <= set(unknown)


def test_symbol_entries_name_a_pinned_version(reference_project: Path) -> None:
    entries = load_symbol_list(META / "mlx_symbols.yaml")
    pinned = {f"{name} {pin['version']}" for name, pin in PINS.items()}
    app_text = "\n".join(p.read_text() for p in sources(reference_project)[0])
    for entry in entries:
        assert entry.verified_against in pinned, entry
        assert entry.module in {"MLX", "MLXLMCommon", "MLXLLM", "Tokenizers"}, entry
        # No stale entries: at least one name of each entry still appears in the App sources.
        assert any(name in app_text for name in entry.names if len(name) > 3), entry.symbol


def test_app_imports_only_known_modules(reference_project: Path) -> None:
    imports = collect_files(sources(reference_project)[0]).imports
    assert imports <= {"Darwin", "Foundation", "KvrigCore", "MLX", "MLXLLM", "MLXLMCommon", "Observation",
                       "SwiftUI", "Tokenizers", "os"}  # fmt: skip
    core_imports = collect_files(sorted((reference_project / "Core/Sources").rglob("*.swift"))).imports
    assert core_imports == {"Foundation"}
