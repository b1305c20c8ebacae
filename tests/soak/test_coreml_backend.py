"""`kvrig soak --backend coreml` against the virtual iPhone, through the real pymobiledevice3 client: an app
without the Core ML model and the virtual phone itself (which has no Core ML) are refused before anything is
written to the phone or launched, each with its own error type (exit 50); the plan says which backend."""

from __future__ import annotations

import json
import os
import plistlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvrig.device import apps
from kvrig.exceptions import CoreMLBackendError, CoreMLVirtualPhoneError
from kvrig.schemas import load_model_file
from kvrig.schemas.keys import COREML_MODEL_KEY, VIRTUAL_RUNTIME_KEY
from kvrig.schemas.lab import MatrixEntry
from kvrig.schemas.results import ResultsFile
from kvrig.schemas.soakplan import SoakPlan
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from tests.soak.conftest import BUNDLE_ID, Emulator, installed, on_device, run

__all__ = ["installed"]
ROOT = Path(__file__).resolve().parents[2]
CORE_ML_APP = "dev.kvrig.coremlvirtual"


def _cli(emulator: Emulator, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def _virtual_core_ml_ipa(path: Path) -> Path:
    """What `kvrig build --virtual` makes of an app rendered with --coreml: its Info.plist names the Core ML
    resource (test_coreml_app checks the rendered plist) and the virtual runtime."""
    info = {
        "CFBundleIdentifier": CORE_ML_APP,
        "CFBundleExecutable": "KVCoreML",
        "CFBundleShortVersionString": "1.0",
        "CFBundleVersion": "1",
        COREML_MODEL_KEY: "KvrigModel.mlpackage",
        VIRTUAL_RUNTIME_KEY: "llm",
    }
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("Payload/KVCoreML.app/Info.plist", plistlib.dumps(info, fmt=plistlib.FMT_BINARY))
    return path


def test_app_without_core_ml_model_is_refused(installed: Emulator, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    common = ["soak", "--app-id", BUNDLE_ID, "--udid", installed.udid, "--max-tokens", "512"]
    proc = _cli(installed, *common, "--backend", "coreml", "-o", str(out))
    assert proc.returncode == CoreMLBackendError.exit_code == 50, proc.stderr
    assert COREML_MODEL_KEY in proc.stderr and "Traceback" not in proc.stderr
    # The plan kept beside the results asked for Core ML; the run stopped at "find app", nothing launched.
    assert load_model_file(SoakPlan, out / "soakplan.json").backend == "coreml"
    saved = load_model_file(ResultsFile, out / "results.json").runs[0]
    assert saved.backend == "coreml" and saved.outcome is None and saved.error.startswith("find app: ")
    assert saved.steps_done == []


def test_virtual_phone_refuses_core_ml(installed: Emulator, tmp_path: Path) -> None:
    ipa = _virtual_core_ml_ipa(tmp_path / "KVCoreML.ipa")
    run(on_device(installed.udid, lambda d: apps.install(d, ipa)))
    plan = make_plan(max_tokens=512, backend="coreml")
    options = SoakOptions(poll_interval_s=0.2, hang_after_s=30, report_wait_s=5)
    with pytest.raises(CoreMLVirtualPhoneError, match="no Core ML"):
        run(on_device(installed.udid, lambda d: run_soak(d, CORE_ML_APP, plan, tmp_path / "lib", options)))
    saved = load_model_file(ResultsFile, tmp_path / "lib" / "results.json").runs[0]
    assert saved.steps_done == [] and saved.files.telemetry is None

    proc = _cli(installed, "soak", "--app-id", CORE_ML_APP, "--udid", installed.udid, "--backend", "coreml",
                "-o", str(tmp_path / "cli"), "--json")  # fmt: skip
    assert proc.returncode == 50, proc.stderr
    assert "virtual iPhone" in proc.stderr and "Traceback" not in proc.stderr


def test_lab_entries_choose_the_backend() -> None:
    entry = MatrixEntry.model_validate({"app_id": "a", "schemes": ["fp16"], "backend": "coreml"})
    assert entry.backend == "coreml"
    assert MatrixEntry.model_validate({"app_id": "a", "schemes": ["fp16"]}).backend == "mlx"
    with pytest.raises(ValueError, match="backend"):
        MatrixEntry.model_validate({"app_id": "a", "schemes": ["fp16"], "backend": "metal"})
    assert json.loads(make_plan(max_tokens=64, backend="coreml").model_dump_json(by_alias=True))["backend"] == "coreml"
