"""The adapters for dependencies' private names (kvrig/compat/): each still reaches what it wraps, states the
range pyproject.toml pins and the installed version is in it, and no other module imports a private name."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import kvrig.compat

REPO = Path(__file__).resolve().parents[1]
JETSAM = REPO / "tests" / "data" / "jetsam" / "JetsamEvent-ios16.6-iPhone14-2-excerpt.ips"
ADAPTERS = [f"kvrig.compat.{m.name}" for m in pkgutil.iter_modules(kvrig.compat.__path__)]


def _pinned() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return {req.name: req for req in map(Requirement, lines)}


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_states_the_pinned_range_and_the_installed_version_is_in_it(name: str) -> None:
    adapter = importlib.import_module(name)
    pin = _pinned()[adapter.DISTRIBUTION]
    assert str(pin.specifier) == str(Requirement(f"x{adapter.TESTED}").specifier)
    assert Version(version(adapter.DISTRIBUTION)) in pin.specifier


def test_model_classes_are_mlx_lms_own() -> None:
    import mlx_lm.models.llama as llama

    from kvrig.compat.mlx_lm_classes import model_classes

    assert model_classes({"model_type": "llama"}) == (llama.Model, llama.ModelArgs)


def test_base_cache_is_the_base_of_mlx_lms_caches() -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    from kvrig.compat.mlx_lm_cache import BaseCache

    assert all(issubclass(cls, BaseCache) for cls in (KVCache, QuantizedKVCache, RotatingKVCache))


def test_crash_report_header_and_body_are_the_files_two_json_parts() -> None:
    from pycrashreport.crash_report import get_crash_report_from_buf

    from kvrig.compat.crash_report import report_body, report_header

    text = JETSAM.read_text()
    first, _, rest = text.partition("\n")
    report = get_crash_report_from_buf(text, filename=JETSAM.name)
    assert report_header(report) == json.loads(first)
    assert report_body(report) == json.loads(rest)


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top not in {"kvrig", "tests", "conftest"}


def test_no_module_but_the_adapters_imports_a_dependencys_private_name() -> None:
    offenders = []
    for path in sorted((REPO / "kvrig").rglob("*.py")) + sorted((REPO / "tests").rglob("*.py")):
        if path.is_relative_to(REPO / "kvrig" / "compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _third_party(node.module):
                names = [node.module, *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if _third_party(alias.name)]
            else:
                continue
            private = [n for n in names for part in n.split(".") if part.startswith("_") and not part.startswith("__")]
            if private:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {private}")
    assert offenders == []
