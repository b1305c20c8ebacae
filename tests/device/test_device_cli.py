"""`kvrig deploy`: install + push with resume, through the command line against the virtual iPhone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.device.conftest import BUNDLE_ID, Emulator
from tests.device.test_device_files import make_bundle

ROOT = Path(__file__).resolve().parents[2]


def _cli(emulator: Emulator, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    return subprocess.run(
        [sys.executable, "-m", "kvrig", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_deploy_installs_and_pushes_then_keeps(emulator: Emulator, ipa: Path, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "smol-cli", weight_bytes=40_000)
    first = _cli(emulator, "deploy", str(bundle), "--app", str(ipa), "--udid", emulator.udid, "--json")
    assert first.returncode == 0, first.stderr
    data = json.loads(first.stdout)
    assert data["app_id"] == BUNDLE_ID and data["installed"] is True
    assert data["device"]["product_type"] == "iPhone16,1"
    assert len(data["push"]["sent"]) == 8 and data["push"]["skipped"] == []
    documents = emulator.device.state.container(BUNDLE_ID) / "Documents" / "smol-cli"
    for path in bundle.rglob("*"):
        if path.is_file():
            assert (documents / path.relative_to(bundle)).read_bytes() == path.read_bytes()

    second = _cli(emulator, "deploy", str(bundle), "--app-id", BUNDLE_ID, "--udid", emulator.udid)
    assert second.returncode == 0, second.stderr
    assert "sent 0 files" in second.stdout and "kept 8 already there" in second.stdout


def test_quiet_deploy_draws_no_bars(emulator: Emulator, ipa: Path, tmp_path: Path) -> None:
    """pymobiledevice3's upload and install bars follow kvrig's own: drawn by default, gone with -q and --json."""
    bundle = make_bundle(tmp_path / "smol-q", weight_bytes=4_000)
    loud = _cli(emulator, "deploy", str(bundle), "--app", str(ipa), "--udid", emulator.udid)
    assert loud.returncode == 0, loud.stderr
    assert f"{ipa.name} ━" in loud.stderr and "install ━" in loud.stderr  # pymobiledevice3's: the control
    for quiet in (["-q", "deploy"], ["deploy", "--json"]):
        done = _cli(emulator, *quiet, str(bundle), "--app", str(ipa), "--udid", emulator.udid)
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", (quiet, done.stderr)


def test_deploy_refusals(emulator: Emulator, tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b", weight_bytes=1000)
    usage = _cli(emulator, "deploy", str(bundle), "--udid", emulator.udid)
    assert usage.returncode == 2 and "--app" in usage.stderr
    absent = _cli(emulator, "deploy", str(bundle), "--app-id", "com.example.absent", "--udid", emulator.udid)
    assert absent.returncode == 14 and "not installed" in absent.stderr and "Traceback" not in absent.stderr
