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
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "vocab_size": 32,
}
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


def test_attention_is_routed_where_mlx_lm_models_call_it() -> None:
    """Model modules call the `scaled_dot_product_attention` they import from mlx_lm.models.base: routed, a cache
    the predicate takes goes to the handler and any other cache to mlx-lm's function."""
    import mlx.core as mx
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    from kvrig.compat.mlx_lm_attention import route_attention

    assert "scaled_dot_product_attention" in vars(llama) and llama.scaled_dot_product_attention.__module__ in (
        base.__name__,
        "kvrig.compat.mlx_lm_attention",
    )
    model = llama.Model(llama.ModelArgs.from_dict(TINY_LLAMA))
    seen: list[object] = []
    marker = object()
    assert route_attention(model, lambda cache: cache is marker, lambda cache, q, *_: seen.append(cache) or q)
    q = mx.ones((1, 2, 3, 8))
    assert llama.scaled_dot_product_attention(q, q, q, cache=marker, scale=1.0, mask=None) is q and seen == [marker]
    plain = llama.scaled_dot_product_attention(q, q, q, cache=None, scale=1.0, mask=None)
    assert mx.allclose(plain, base.scaled_dot_product_attention(q, q, q, cache=None, scale=1.0, mask=None))


def test_install_bars_are_drawn_through_the_name_the_adapter_rebinds() -> None:
    import inspect

    from pymobiledevice3.services import installation_proxy

    from kvrig.compat import pymobiledevice3_install_bars as adapter

    assert installation_proxy.ProgressBar is adapter._install_bar
    for method in (
        installation_proxy.InstallationProxyService._upload_package,
        installation_proxy.InstallationProxyService._watch_completion,
    ):
        assert "with ProgressBar(" in inspect.getsource(method)
    token = adapter.INSTALL_BARS.set(False)
    try:
        with installation_proxy.ProgressBar(total=1) as bar:  # a disabled bar holds no display (pinned internals)
            assert bar._progress is None
    finally:
        adapter.INSTALL_BARS.reset(token)
    with installation_proxy.ProgressBar(total=1) as bar:
        assert bar._progress is not None


def test_a_finished_install_bar_ends_full_and_a_failed_one_where_it_stopped() -> None:
    """installd's last PercentComplete is 90 before its Complete status: a finished install was drawn at 90 %."""
    from pymobiledevice3.services import installation_proxy

    with installation_proxy.ProgressBar(total=100) as bar:
        bar.n = 90
    assert bar.n == 100
    with pytest.raises(RuntimeError), installation_proxy.ProgressBar(total=100) as failed:
        failed.n = 40
        raise RuntimeError("installd refused")
    assert failed.n == 40


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
