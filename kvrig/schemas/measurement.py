"""docs/benchmarks.yaml (the benchmarks the docs quote) and docs/data/NAME.json (what one of them measured, with
how, when and where): the docs' generated sections are rendered from these files and nothing typed by hand."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, JsonValue, RootModel

from kvrig.schemas import StrictModel

MEASUREMENT_SCHEMA: Literal[1] = 1


class Benchmark(StrictModel):
    """One entry of docs/benchmarks.yaml: `before` builds what `run` measures (in a fresh folder `{tmp}`);
    `run` prints the benchmark's own JSON."""

    run: str
    before: list[str] = Field(default_factory=list)


class Benchmarks(RootModel[dict[str, Benchmark]]):
    pass


class Host(StrictModel):
    cpus: int
    # os.getloadavg() as the benchmark started and ended: a figure from a loaded machine says so beside it
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    platform: str


class Measurement(StrictModel):
    schema_version: Literal[1] = Field(default=MEASUREMENT_SCHEMA, alias="schema")
    name: str
    before: list[str]
    command: str
    date: datetime
    seconds: float
    host: Host
    versions: dict[str, str | None]
    # the checkout's commit as the benchmark ran (kvrig's version number does not move with its code)
    commit: str | None = None
    # the benchmark's own --json, as it printed it (its command defines the shape; templates read it)
    result: JsonValue
