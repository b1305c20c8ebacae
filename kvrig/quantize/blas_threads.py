"""OpenBLAS's thread count, for a stretch of code, through OpenBLAS's public C API (`openblas_get_num_threads`,
`openblas_set_num_threads`). On Linux kvrig loads Debian's OpenBLAS under MLX (runtime/blas.py); elsewhere
(Accelerate on a Mac, or no OpenBLAS) this does nothing."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS calls made inside run on the calling thread alone; the thread count is restored afterwards."""
    try:
        process = ctypes.CDLL(None)
        get, set_ = process.openblas_get_num_threads, process.openblas_set_num_threads
    except (OSError, AttributeError):  # no OpenBLAS in this process
        yield
        return
    threads = get()
    set_(1)
    try:
        yield
    finally:
        set_(threads)
