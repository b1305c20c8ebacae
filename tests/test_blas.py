"""The OpenBLAS preload (kvrig/runtime/blas.py): its threads do not spin once a matmul is done."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrig.runtime.blas import THREAD_TIMEOUT, find_openblas, preload_env

# Three multi-threaded float32 matmuls, then how often, sampled for 0.3 s, a thread other than the main one is
# running or runnable: a spinning OpenBLAS thread is, a sleeping one is not. (The CPU time a spinning thread burns
# is no measure on a loaded machine: it yields in its loop, so under load it spins as long but burns little.)
RUNNABLE_SAMPLES = """
import os, time
import mlx.core as mx
a = mx.random.normal((1024, 1024))
for _ in range(3):
    mx.eval(a @ a)
main, runnable = str(os.getpid()), 0
end = time.monotonic() + 0.3
while time.monotonic() < end:
    for tid in os.listdir("/proc/self/task"):
        if tid != main:
            with open(f"/proc/self/task/{tid}/stat") as f:
                runnable += f.read().rsplit(")", 1)[1].split()[0] == "R"
    time.sleep(0.002)
print(runnable)
"""

pytestmark = pytest.mark.skipif(find_openblas() is None, reason="Debian's OpenBLAS is not installed")


def runnable_samples(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", RUNNABLE_SAMPLES], capture_output=True, text=True, env=env, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def test_preloaded_threads_sleep_when_idle() -> None:
    name, _ = THREAD_TIMEOUT
    quiet = runnable_samples(preload_env())
    # OpenBLAS's own default (2^28 cycles of spinning per thread, ~0.1 s), as a user who sets it gets it: the
    # control that shows the measurement can see spinning at all.
    spinning = runnable_samples({**preload_env(), name: "28"})
    assert spinning >= 10
    assert quiet < spinning / 4


def test_a_timeout_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    name, default = THREAD_TIMEOUT
    monkeypatch.delenv(name, raising=False)
    assert preload_env()[name] == default
    monkeypatch.setenv(name, "12")
    assert preload_env()[name] == "12"


def test_single_threaded_blas_gives_the_threads_back() -> None:
    """The calibration statistics run OpenBLAS on one thread per call (quantize/imx.py), then restore the count,
    also when the work inside fails."""
    import ctypes

    from kvrig.quantize.blas_threads import single_threaded_blas

    process = ctypes.CDLL(None)  # the conftest loaded OpenBLAS into this process, as the CLI does
    before = process.openblas_get_num_threads()
    process.openblas_set_num_threads(3)
    try:
        with single_threaded_blas():
            assert process.openblas_get_num_threads() == 1
        assert process.openblas_get_num_threads() == 3
        with pytest.raises(KeyError), single_threaded_blas():
            raise KeyError("inside")
        assert process.openblas_get_num_threads() == 3
    finally:
        process.openblas_set_num_threads(before)
