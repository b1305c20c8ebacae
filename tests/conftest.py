"""Session-wide test set-up.

OpenBLAS for the test processes, as the CLI has it (kvrig/runtime/blas.py): in-process MLX work (the
package quality gate, calibration, perplexity) runs float matmuls, ~15x slower on the wheel's reference BLAS.
Loaded here, before any test module imports MLX; the CLI subprocesses tests start still preload it themselves
(nothing is inherited), so their re-execution stays covered.

Heaviest files first: under `-n 2 --dist loadfile --no-loadscope-reorder` (the Makefile's) a worker takes the
next file as it frees up, so starting with the files that take minutes leaves short ones to even out the end,
instead of one worker finishing a long file alone."""

from __future__ import annotations

import pytest

from kvrig.runtime.blas import load_openblas
from tests.hostile_suite import Table

load_openblas()

# Most expensive first (each a minute or more with its module fixtures; `make test`'s --durations shows them).
HEAVY_FILES = (
    "tests/lab/test_shards.py",
    "tests/plan/test_plan.py",
    "tests/soak/test_llm_soak.py",
    "tests/outcomes/test_planned_vs_killed.py",
    "tests/outcomes/test_mapped_residency.py",
    "tests/lab/test_lab_residency.py",
    "tests/quality/test_quality_model.py",
    "tests/quality/test_quantize_bench.py",
    "tests/test_package.py",
    "tests/test_calibrate.py",
    "tests/plan/test_kv_exact.py",
    "tests/plan/test_uncapped.py",
    "tests/plan/test_plan_every_architecture.py",
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
