"""The OpenBLAS preload (kvrig/runtime/blas.py): its threads do not spin once a matmul is done."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrig.runtime.blas import THREAD_TIMEOUT, find_openblas, preload_env

# Three multi-threaded float32 matmuls, then the CPU time the process burns while it only sleeps.
IDLE_CPU = """
import time
import mlx.core as mx
a = mx.random.normal((1024, 1024))
for _ in range(3):
    mx.eval(a @ a)
start = time.process_time()
time.sleep(0.5)
print(time.process_time() - start)
"""

pytestmark = pytest.mark.skipif(find_openblas() is None, reason="Debian's OpenBLAS is not installed")


def idle_cpu_seconds(env: dict[str, str]) -> float:
    proc = subprocess.run([sys.executable, "-c", IDLE_CPU], capture_output=True, text=True, env=env, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def test_preloaded_threads_sleep_when_idle() -> None:
    name, _ = THREAD_TIMEOUT
    quiet = idle_cpu_seconds(preload_env())
    # OpenBLAS's own default (2^28 cycles of spinning per thread), as a user who sets it gets it: the control
    # that shows the measurement can see spinning at all.
    spinning = idle_cpu_seconds({**preload_env(), name: "28"})
    assert spinning > 0.02
    assert quiet < spinning / 4


def test_a_timeout_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    name, default = THREAD_TIMEOUT
    monkeypatch.delenv(name, raising=False)
    assert preload_env()[name] == default
    monkeypatch.setenv(name, "12")
    assert preload_env()[name] == "12"
