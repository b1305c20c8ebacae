"""OpenBLAS preloading for the host runtime.

The Linux `mlx[cpu]` wheel links a slow reference BLAS; Debian's OpenBLAS exports the same symbols, so
preloading it (LD_PRELOAD, which must be in effect before MLX is loaded) makes float matmuls many times
faster. The CLI re-executes itself once with the preload; nothing here imports MLX.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV_DISABLE = "KVRIG_NO_OPENBLAS"  # set to 1 to run with MLX's bundled BLAS (for comparisons)
ENV_REEXECED = "KVRIG_OPENBLAS_REEXEC"  # guards against re-exec loops
THREAD_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")
"""OpenBLAS's idle threads spin for 2^28 cycles after each call unless told otherwise (2^4 here): between the
many mid-sized matmuls of calibration and perplexity they burned a third of `kvrig package`'s CPU as system time,
and took it from kvrig's own quantizer threads, for no gain in wall time. A value the user set is kept."""
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas() -> str | None:
    for path in _CANDIDATES:
        if Path(path).is_file():
            return path
    name = ctypes.util.find_library("openblas")
    return name


def openblas_loaded() -> bool:
    """True when OpenBLAS is mapped into this process (so MLX's BLAS calls resolve to it)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def load_openblas() -> bool:
    """Loads OpenBLAS into this process with global symbol binding, so that MLX, imported afterwards, resolves
    its BLAS calls to it as it would under LD_PRELOAD (without re-executing; children do not inherit it).
    Returns whether OpenBLAS is loaded; does nothing off Linux, when disabled, or once MLX is imported."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV_DISABLE) == "1" or "mlx.core" in sys.modules:
        return openblas_loaded()
    lib = find_openblas()
    if lib is not None and not openblas_loaded():
        os.environ.setdefault(*THREAD_TIMEOUT)  # read once, when the library loads
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return openblas_loaded()


def ensure_openblas(argv: list[str] | None = None, *, module: str = "kvrig", guard: str = ENV_REEXECED) -> None:
    """Re-executes `python -m MODULE ARGV` with OpenBLAS preloaded, once, if it is not loaded yet (execve: the
    pid stays the same). `guard` is the variable that marks the re-executed process.

    Does nothing off Linux, when disabled, when already re-executed, when OpenBLAS is not installed, or when
    MLX is already imported (too late for a preload to take effect in this process)."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV_DISABLE) == "1":
        return
    if os.environ.get(guard) == "1" or openblas_loaded() or "mlx.core" in sys.modules:
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.setdefault(*THREAD_TIMEOUT)
    env[guard] = "1"
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


def preload_env(enable: bool = True) -> dict[str, str]:
    """Environment for a child process with (or explicitly without) the OpenBLAS preload."""
    env = dict(os.environ)
    if not enable:
        env.pop("LD_PRELOAD", None)
    if enable and (lib := find_openblas()):
        env["LD_PRELOAD"] = lib
        env.setdefault(*THREAD_TIMEOUT)
        env[ENV_REEXECED] = "1"
    else:
        env[ENV_DISABLE] = "1"
    return env
