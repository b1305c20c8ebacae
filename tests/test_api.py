"""The library's public names (`kvrig.__all__`): each resolves to the object its module defines, and importing
kvrig (or asking the command for help) loads neither MLX nor pymobiledevice3 nor Core ML."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvrig

HEAVY = ("mlx", "mlx_lm", "coremltools", "pymobiledevice3", "matplotlib", "transformers", "numba")
LOADED = """
import sys
{code}
print('HEAVY=' + ','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))))
"""


def _heavy_after(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", LOADED.format(code=code, heavy=HEAVY)], capture_output=True, text=True, check=True
    )
    return proc.stdout.rstrip().rsplit("HEAVY=", 1)[1]


@pytest.mark.parametrize("name", kvrig._API)
def test_every_public_name_is_its_modules_own(name: str) -> None:
    module = importlib.import_module(kvrig._API[name])
    assert getattr(kvrig, name) is getattr(module, name)
    assert name in kvrig.__all__ and name in dir(kvrig)


def test_all_lists_exactly_the_api() -> None:
    assert sorted(kvrig.__all__) == sorted(["__version__", *kvrig._API])


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        kvrig.no_such_thing  # noqa: B018


@pytest.mark.parametrize(
    "code",
    [
        "import kvrig",
        "import kvrig.cli",
        "from kvrig.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "import runpy, sys\nsys.argv = ['kvrig', '--help']\ntry:\n    runpy.run_module('kvrig', run_name='__main__')\n"
        "except SystemExit:\n    pass",
    ],
    ids=["import kvrig", "import kvrig.cli", "kvrig --help", "python -m kvrig --help"],
)
def test_startup_loads_no_heavy_library(code: str) -> None:
    assert _heavy_after(code) == ""


def test_device_commands_load_no_mlx() -> None:
    # What `kvrig devices` / `deploy` / `soak` import to run: the device layer, reports, the soak driver.
    code = (
        "import kvrig.device.deploy, kvrig.device.prepare, kvrig.device.hosts, kvrig.soaking.driver, kvrig.cli.device"
    )
    assert set(_heavy_after(code).split(",")) == {"pymobiledevice3"}
