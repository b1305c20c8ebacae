"""The generated app's engine as `kvrig engine` built it (make test builds it before pytest), and ways to run it.

Tests reuse that build: none of them builds the engine again (test_engine_modes.py is the build check)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from toolchain.appgen.linux import built_engine


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    binary = built_engine()
    if binary is None:
        why = "the Swift engine is not built here: `kvrig engine` builds it (make test does, before pytest)"
        # In CI make test built it first, so a missing binary is a broken build, not a reason to skip.
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return binary


def run_engine(binary: Path, bundle: Path, documents: Path, *args: str, timeout: float = 900) -> str:
    documents.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "--bundle", str(bundle), "--documents", str(documents), "--exit-when-done", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"kvrig-engine exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
