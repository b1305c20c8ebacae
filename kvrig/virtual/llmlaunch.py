"""The Python LLM app's entry point on the virtual iPhone: `python -m kvrig.virtual.llmlaunch [APP ARGS]`.

MLX binds its BLAS when it is loaded, and llmapp imports MLX at module level; this module imports nothing heavy,
so it can re-execute itself once with Debian's OpenBLAS preloaded (runtime/blas.py) before llmapp loads. Without
it the app's float matmuls run on the wheel's reference BLAS, many times slower.
"""

from __future__ import annotations

import sys

from kvrig.runtime.blas import ensure_openblas

MODULE = "kvrig.virtual.llmlaunch"
ENV_REEXECED = "KVRIG_LLMAPP_OPENBLAS"  # our own guard: the emulator's environment may carry the CLI's


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ensure_openblas(argv, module=MODULE, guard=ENV_REEXECED)
    from kvrig.virtual.llmapp import main as run_app

    return run_app(argv)


if __name__ == "__main__":
    sys.exit(main())
