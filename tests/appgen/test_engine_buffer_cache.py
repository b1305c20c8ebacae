"""The buffer cache a plan of the virtual iPhone counts is what the app's MLX keeps on this host, measured:
Python's MLX keeps freed buffers up to the bundle's cap, the Swift engine's MLX Swift keeps none. The engine's
own telemetry (`mlx_cache_bytes` at every soak step) is held to its probe in test_engine_virtual.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from kvrig.virtual.swiftapp import buffer_cache_held
from tests.appgen.swift_engine import engine_binary  # noqa: F401

CAP = 4 * 1024 * 1024


def test_pythons_mlx_keeps_freed_buffers_up_to_the_cap() -> None:
    before = mx.set_cache_limit(CAP)
    mx.set_cache_limit(before)
    held = buffer_cache_held("python", CAP)
    # The probe frees twice the cap in 64 pieces: MLX keeps all it may, less than one piece short of the cap.
    assert CAP - 2 * CAP // 64 < held <= CAP
    assert mx.get_cache_memory() == 0 and mx.set_cache_limit(before) == before  # the probe tidied up


def test_the_swift_engines_mlx_keeps_no_buffer_cache(engine_binary: Path) -> None:  # noqa: F811
    assert buffer_cache_held("swift", CAP) == 0


def test_a_failing_probe_is_an_engine_run_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvrig import exceptions
    from kvrig.virtual import swiftapp

    broken = tmp_path / "kvrig-engine"
    broken.write_text("#!/bin/sh\necho 'kvrig-engine: unknown argument --probe-buffer-cache' >&2\nexit 2\n")
    broken.chmod(0o755)
    monkeypatch.setattr(swiftapp, "engine_binary", lambda: broken)
    with pytest.raises(exceptions.EngineRunError) as failure:
        buffer_cache_held("swift", CAP)
    assert failure.value.exit_code == 32 and "unknown argument" in str(failure.value)


def test_a_probe_printing_no_cache_bytes_is_an_engine_run_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvrig import exceptions
    from kvrig.virtual import swiftapp

    garbled = tmp_path / "kvrig-engine"
    garbled.write_text("#!/bin/sh\necho '{\"cache_limit_bytes\": 1}'\n")
    garbled.chmod(0o755)
    monkeypatch.setattr(swiftapp, "engine_binary", lambda: garbled)
    with pytest.raises(exceptions.EngineRunError) as failure:
        buffer_cache_held("swift", CAP)
    assert failure.value.exit_code == 32
