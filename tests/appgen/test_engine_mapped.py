"""The compiled Swift engine on a bundle laid out for mapping (issue 27, item 4): where MLX Swift resolves.

On Linux MLX's CPU allocator cannot adopt a caller's pages (it copies them and runs the finalizer at once), so
the engine must notice, load the weights instead and say why in its telemetry `start` record; on a Mac (Metal's
no-copy buffers) the same run maps them, every tensor's bytes. Without a host kernel the engine reports what it
holds itself, not the phone's residency. Expected numbers come from elsewhere: MLX's own `nbytes` of the bundle's
tensors. Skips, naming why, where `kvrig engine` could not resolve MLX Swift (tests/appgen/swift_engine.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.appgen.swift_engine import engine_binary, read_events, run_engine  # noqa: F401
from tests.bundle_fixtures import MAPPED, MAPPED_NAME, packaged


def test_the_engine_maps_or_says_why_it_loads(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    engine_binary: Path,  # noqa: F811
) -> None:
    bundle = packaged(tmp_path_factory, MAPPED_NAME, MAPPED)
    weights = sum(int(a.nbytes) for f in sorted(bundle.glob("*.safetensors")) for a in mx.load(str(f)).values())
    documents = tmp_path / "Documents"
    args = ("--chat", "Hello.", "--temperature", "0", "--max-tokens", "2")
    run_engine(engine_binary, bundle, documents, *args, timeout=300)
    start = read_events(documents / "telemetry.jsonl")[0]
    assert start["event"] == "start"
    held = (start["weights_residency"], start["mapped_weight_bytes"])
    if sys.platform == "linux":
        assert held == ("loaded", 0), start
        assert "MLX copied the mapped buffer" in (start.get("residency_note") or ""), start
    else:
        assert held == ("mapped", weights), start
        assert start.get("residency_note") is None, start
    # Either way the engine held its own residency, not a phone's it was told (no host kernel here).
    assert not {"weights_residency", "mapped_weight_bytes"} & set(start.get("converted") or []), start
