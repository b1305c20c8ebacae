"""Session-wide test set-up.

OpenBLAS for the test processes, as the CLI has it (kvrig/runtime/blas.py): in-process MLX work (the
package quality gate, calibration, perplexity) runs float matmuls, ~15x slower on the wheel's reference BLAS.
Loaded here, before any test module imports MLX; the CLI subprocesses tests start still preload it themselves
(nothing is inherited), so their re-execution stays covered.

Heaviest files first: under `-n 2 --dist loadfile --no-loadscope-reorder` (the Makefile's) a worker takes the
next file as it frees up, so starting with the files that take minutes leaves short ones to even out the end,
instead of one worker finishing a long file alone."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from kvrig.quality.measured import CACHE_ENV
from kvrig.runtime.blas import load_openblas
from tests.hostile_suite import Table

load_openblas()

if sys.platform == "darwin":
    # macOS's $TMPDIR (/private/var/folders/…) leaves the sockets tests make under tmp_path past the 104 bytes a
    # unix socket path holds there; pytest roots its temporary folders here instead (read when first used).
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", "/tmp")


@pytest.fixture(scope="session", autouse=True)
def measurement_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One measurement cache per test run, shared by its workers and the commands they start: a run starts with
    nothing measured (so the measuring paths run), and never reads or fills the user's own cache."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root / "measurement-cache"))
        yield


# Most expensive first (each a minute or more with its module fixtures; `make test`'s --durations shows them).
HEAVY_FILES = (
    "tests/quality/test_quality_model.py",
    "tests/quality/test_gate_model.py",
    "tests/outcomes/test_planned_vs_killed.py",
    "tests/test_docs_commands.py",
    "tests/lab/test_shards.py",
    "tests/plan/test_plan.py",
    "tests/outcomes/test_mapped_residency.py",
    "tests/plan/test_plan_every_architecture.py",
    "tests/soak/test_llm_soak.py",
    "tests/plan/test_uncapped.py",
    "tests/lab/test_lab_residency.py",
    "tests/quality/test_quantize_bench.py",
    "tests/test_package.py",
    "tests/test_calibrate.py",
    "tests/plan/test_kv_exact.py",
    "tests/test_runtime.py",
    "tests/lab/test_lab_runs.py",
    "tests/coreml/test_coreml_cli.py",
    "tests/virtual/test_cli.py",
    "tests/coreml/test_coreml_export.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FILES)))


# `pytest -m hostile`: the reliability suite's table (tests/hostile_suite.py).
HOSTILE = Table()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    if call.when == "setup":
        HOSTILE.add_properties(item)
    return (yield)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    HOSTILE.record(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if HOSTILE.rows:
        terminalreporter.section("reliability suite (issue 24): case, bound, verdict")
        for line in HOSTILE.lines():
            terminalreporter.write_line(line)
