"""The generated app's engine built once per session for Linux (`kvrig engine`), and ways to run it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from toolchain.appgen.linux import build_engine

_built: dict[str, Path] = {}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    # Debug, in the Xcode project's language mode: ~5 min from a clean scratch folder, seconds after.
    if "binary" not in _built:
        _built["binary"] = build_engine("5").binary
    return _built["binary"]


def run_engine(binary: Path, bundle: Path, documents: Path, *args: str, timeout: float = 900) -> str:
    documents.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "--bundle", str(bundle), "--documents", str(documents), "--exit-when-done", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"kvrig-engine exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
