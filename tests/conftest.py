"""OpenBLAS for the test processes, as the CLI has it (toolchain/runtime/blas.py): in-process MLX work (the
package quality gate, calibration, perplexity) runs float matmuls, ~15x slower on the wheel's reference BLAS.
Loaded here, before any test module imports MLX; the CLI subprocesses tests start still preload it themselves
(nothing is inherited), so their re-execution stays covered."""

from toolchain.runtime.blas import load_openblas

load_openblas()
