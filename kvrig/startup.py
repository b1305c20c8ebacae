"""How long a command takes before it does anything: `kvrig --help` timed side by side with `pymobiledevice3
--help` in one run (each a fresh interpreter, alternated so a machine whose load changes slows both alike)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

COMMANDS: dict[str, tuple[str, ...]] = {
    "python": ("-c", "pass"),
    "kvrig --help": ("-m", "kvrig", "--help"),
    "pymobiledevice3 --help": ("-m", "pymobiledevice3", "--help"),
}


@dataclass(frozen=True)
class StartupTime:
    command: str
    runs: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs)

    @property
    def best_s(self) -> float:
        return min(self.runs)


def time_startup(runs: int = 5, python: str = sys.executable) -> list[StartupTime]:
    """Wall seconds of each command, `runs` times, interleaved (python, kvrig, pymobiledevice3, python, ...)."""
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, args in COMMANDS.items():
            began = time.perf_counter()
            subprocess.run([python, *args], capture_output=True, check=True, stdin=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - began)
    return [StartupTime(name, values) for name, values in times.items()]
