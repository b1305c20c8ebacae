"""A lab file's mistakes are found before any phone is contacted or the output folder is claimed: exit 3 naming
the file and the field, and nothing written (they used to end every run, after the phones were reached, and
leave `runs/` behind so that the corrected lab was refused its own folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "testapp-model" / "config.json"


def _entry(**changes: Any) -> dict[str, Any]:
    return {"app_id": "dev.kvrig.demo", "model": str(MODEL), "schemes": ["k8v4"], **changes}


def _lab_run(tmp_path: Path, lab: dict[str, Any]) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """`kvrig lab run` on this lab file: (the file, its output folder, what the command did)."""
    lab_file = tmp_path / "lab.yaml"
    lab_file.write_text(yaml.safe_dump({"schema": 1, **lab}))
    out = tmp_path / "out"
    # No usbmuxd at this address: a lab that went on to look for phones would fail there instead (exit 11 or 18).
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=str(tmp_path / "no-usbmuxd.sock"))
    command = [sys.executable, "-m", "kvrig", "lab", "run", str(lab_file), "-o", str(out)]
    return lab_file, out, subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("lab", "field", "words"),
    [
        ({"matrix": [_entry(plan={"weights": "q9"})]}, "matrix.0.plan.weights", "q9"),
        ({"matrix": [_entry(schemes=[{"name": "wide", "plan_scheme": "k9v9"}])]}, "matrix.0.schemes.0", "k9v9"),
        ({"matrix": [_entry(model="nowhere/config.json")]}, "matrix.0.model", "does not exist"),
        ({"matrix": [_entry(ipa="App.ipa")]}, "matrix.0.ipa", "does not exist"),
        ({"devices": [{"udid": "any", "profile": "iphone-99"}], "matrix": [_entry()]}, "devices.0.profile", "99"),
        # what the paths hold, not only that they are there
        ({"matrix": [_entry(model=str(ROOT / "README.md"))]}, "matrix.0.model", "not valid JSON"),
        ({"matrix": [_entry(model=None, bundle_path=str(ROOT))]}, "matrix.0.bundle_path", "no manifest.json"),
        ({"matrix": [_entry(ipa=str(ROOT / "examples"))]}, "matrix.0.ipa", "a .app folder"),
        # numbers a run could never meet or end on
        ({"matrix": [_entry(gates={"min_decode_tps_at": {512: float("nan")}})]}, "matrix.0.gates", "finite"),
        ({"matrix": [_entry(soak={"start_tokens": 9000, "max_tokens": 4096})]}, "matrix.0.soak", "past max_tokens"),
        ({"matrix": [_entry()], "timeouts": {"run_s": float("inf")}}, "timeouts.run_s", "finite"),
    ],
)
def test_a_lab_file_mistake_is_refused_before_any_phone(
    tmp_path: Path, lab: dict[str, Any], field: str, words: str
) -> None:
    lab_file, out, done = _lab_run(tmp_path, lab)
    assert done.returncode == 3, done.stderr
    assert str(lab_file) in done.stderr and f"field '{field}" in done.stderr and words in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_a_bundle_that_does_not_match_its_manifest_stops_the_lab_before_it_starts(tmp_path: Path) -> None:
    """A bundle edited after packaging was found only when its push failed, after the output folder was claimed and
    the app installed (exit 18, "no run could be made"): now `kvrig verify`'s refusal (8), naming the lab field."""
    from tests.device.test_device_files import make_bundle

    bundle = make_bundle(tmp_path / "bundle", weight_bytes=5_000)
    (bundle / "config.json").write_text('{"model_type": "qwen2"}')  # same size: only its sha256 tells
    _, out, done = _lab_run(tmp_path, {"matrix": [_entry(model=None, bundle_path=str(bundle))]})
    assert done.returncode == 8, done.stderr
    assert "field 'matrix.0.bundle_path'" in done.stderr and "config.json: sha256 differs" in done.stderr
    assert not out.exists()
