"""The commands' output on the embedded model held to golden files: `kvrig plan --json` byte for byte, and what
`kvrig package` writes (every file's sha256, kvcache.json, config.json, the manifest but for its clock and
version). A refactoring changes none of it; a change that means to, regenerates them and says why:
KVRIG_UPDATE_GOLDEN=1 pytest tests/test_golden_outputs.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).parent / "golden"
# The installed command, as a user runs it (not an import path, which a refactoring may move).
KVRIG = str(Path(sys.executable).parent / "kvrig")
PLAN_ARGS = ("plan", "--device", "iPhone16,1", "--json")
# `k8v4+rot`: the same bundle the golden file was made from with `--kv k8v4` and the automatic rotation of then,
# spelled in the one KV grammar (a spec is taken as written now; `auto` adds the rotation).
PACKAGE_ARGS = ("package", "--device", "iPhone16,1", "--weights", "q8", "--kv", "k8v4+rot")


def _kvrig(*args: str) -> str:
    proc = subprocess.run([KVRIG, *args], capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"kvrig {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _check(name: str, current: str) -> None:
    # The embedded model sits in this checkout's virtualenv: the same output from any checkout.
    current = current.replace(sysconfig.get_paths()["purelib"], "<site-packages>")
    path = GOLDEN / name
    if os.environ.get("KVRIG_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(current)
        # Nothing was compared: a run that regenerates never reads as a pass.
        pytest.skip(f"{name} regenerated: review its diff")
    assert current == path.read_text(), f"{name} changed (KVRIG_UPDATE_GOLDEN=1 to accept)"


def test_plan_json_is_unchanged() -> None:
    _check("plan-iphone16-1.json", _kvrig(*PLAN_ARGS))


def _bundle_record(bundle: Path) -> dict[str, Any]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    # The clock, the tool's version and the gate's wall time change from run to run; nothing else may.
    manifest.pop("created")
    manifest.pop("tool_version")
    if manifest.get("quality"):
        manifest["quality"].pop("seconds")
    return {
        "manifest": manifest,
        "kvcache.json": json.loads((bundle / "kvcache.json").read_text()),
        "config.json": json.loads((bundle / "config.json").read_text()),
    }


def _measured(record: dict[str, Any]) -> dict[str, float]:
    """The gate's perplexities of the bundle (and their changes), taken out of `record`: the same bytes measure a
    little differently on another CPU (OpenBLAS picks its kernels by CPU, and a 4-bit KV value can round the other
    way), so they are compared within a bound; the source's perplexity and everything else, exactly."""
    quality = record["manifest"]["quality"]
    out = {}
    for where, entry in [("all", quality), *((k["kind"], k) for k in quality["kinds"])]:
        for field in ("bundle_ppl", "ppl_delta_pct"):
            out[f"{where}.{field}"] = entry[field]
            entry[field] = "<measured>"
    return out


def test_package_writes_the_same_bundle(tmp_path: Path) -> None:
    _kvrig(*PACKAGE_ARGS, "-o", str(tmp_path / "bundle"))
    record = _bundle_record(tmp_path / "bundle")
    name = "package-q8-k8v4.json"
    if os.environ.get("KVRIG_UPDATE_GOLDEN") == "1":
        _check(name, json.dumps(record, indent=2, sort_keys=True) + "\n")
    golden = json.loads((GOLDEN / name).read_text())
    measured, expected = _measured(record), _measured(golden)
    current = json.dumps(record, indent=2, sort_keys=True).replace(sysconfig.get_paths()["purelib"], "<site-packages>")
    assert current == json.dumps(golden, indent=2, sort_keys=True), f"{name} changed (KVRIG_UPDATE_GOLDEN=1 to accept)"
    assert measured.keys() == expected.keys()
    for key, value in expected.items():
        bound = 1.0 if key.endswith("ppl_delta_pct") else value / 100  # points of change; 1 % of a perplexity
        assert abs(measured[key] - value) <= bound, f"{key}: {measured[key]} against the golden {value}"
