"""The generated app's engine as `kvrig engine` built it (make test builds it before pytest), and ways to run it.

Tests reuse that build: none of them builds the engine again (test_engine_modes.py is the build check). Whether
they run follows what `kvrig engine` recorded: built → run; MLX Swift not resolvable here → skip, naming why;
resolved but failed to build → fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvrig.appgen.linux import built_engine, engine_status


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    status = engine_status()
    if status is not None and status.state == "unresolvable":
        pytest.skip(status.detail.splitlines()[0])
    if status is not None and status.state == "build_failed":
        pytest.fail(f"`kvrig engine` resolved MLX Swift and failed to build the engine:\n{status.detail}")
    binary = built_engine()
    if binary is None:
        why = "the Swift engine is not built here: `kvrig engine` builds it (make test does, before pytest)"
        # In CI make test ran `kvrig engine` first, so no record and no binary is a broken step, not a skip.
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
