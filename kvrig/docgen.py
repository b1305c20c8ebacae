"""The docs' measured figures, generated: `measure` runs a benchmark docs/benchmarks.yaml names and writes what it
printed to docs/data/NAME.json with the command, date, versions and host load; `render` fills each page's
generated sections from a Jinja template in docs/templates and that JSON. A page is never edited by hand where
it quotes a measurement, so its figures are always the ones the last run printed."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import jinja2

from kvrig.exceptions import DocsStaleError, InputError, KvrigError
from kvrig.fileio import atomic_write, read_data
from kvrig.schemas import load_model_file, validate_data
from kvrig.schemas.measurement import Benchmark, Benchmarks, Host, Measurement
from kvrig.texts import column_label
from kvrig.version import dependency_versions

__all__ = ["DocsStaleError", "GeneratedSection", "measure", "render_docs", "sections", "stale_pages", "write_docs"]

BENCHMARKS = Path("docs/benchmarks.yaml")
DATA = Path("docs/data")
TEMPLATES = Path("docs/templates")
PAGES = ("README.md", "docs/*.md", "examples/README.md")

# A generated section: the template's name in the opening comment, everything up to the closing one replaced.
SECTION = re.compile(
    r"^<!-- begin generated: (?P<template>[\w.-]+\.j2)[^\n]*-->\n(?P<body>.*?)^<!-- end generated -->$",
    re.S | re.M,
)


@dataclass(frozen=True)
class GeneratedSection:
    page: Path
    template: str
    start: int  # offsets of the body in the page's text
    end: int


def load_benchmarks(root: Path) -> dict[str, Benchmark]:
    path = root / BENCHMARKS
    return validate_data(Benchmarks, read_data(path, kind="yaml", mapping="name: {run, before}"), file=path).root


def benchmark(root: Path, name: str) -> Benchmark:
    """The benchmark docs/benchmarks.yaml names `name`; InputError naming the known ones when it names none."""
    benchmarks = load_benchmarks(root)
    if name not in benchmarks:
        raise InputError(f"no benchmark {name!r}", file=root / BENCHMARKS, expected=", ".join(sorted(benchmarks)))
    return benchmarks[name]


def measure(root: Path, name: str) -> Measurement:
    """Runs benchmark `name` (its `before` commands first, in a fresh temporary folder) with this Python's kvrig
    from `root`, and writes docs/data/NAME.json: the JSON the benchmark printed, never a figure typed in."""
    bench = benchmark(root, name)
    load_before, started, clock = _load(), datetime.now(UTC), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrig-measure-") as tmp:
        for command in bench.before:
            _kvrig(root, command, tmp)
        printed = _kvrig(root, bench.run, tmp)
    try:
        result = json.loads(printed)
    except json.JSONDecodeError as exc:
        raise InputError(f"{bench.run!r} did not print JSON: {exc}", file=root / BENCHMARKS, field=name) from None
    measurement = Measurement(
        name=name,
        before=bench.before,
        command=bench.run,
        date=started.replace(microsecond=0),
        seconds=round(time.monotonic() - clock, 1),
        host=Host(
            cpus=os.cpu_count() or 1,
            load_before=load_before,
            load_after=_load(),
            platform=platform.platform(),
        ),
        versions=dependency_versions(),
        commit=_commit(root),
        result=result,
    )
    out = root / DATA / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, measurement.model_dump_json(by_alias=True, indent=2) + "\n")
    return measurement


def _commit(root: Path) -> str | None:
    """HEAD of the checkout, with `+` when its tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True)
    except OSError:
        return None
    return head.stdout.strip() + ("+" if dirty.returncode else "") if head.returncode == 0 else None


def _load() -> tuple[float, float, float]:
    one, five, fifteen = (round(x, 2) for x in os.getloadavg())
    return one, five, fifteen


def _kvrig(root: Path, command: str, tmp: str) -> str:
    """One `kvrig ...` line of docs/benchmarks.yaml run as a user runs it ({tmp}: the measurement's folder);
    its stdout, its stderr passed through so a long benchmark shows its progress."""
    words = shlex.split(command.replace("{tmp}", tmp))
    if words[:1] != ["kvrig"]:
        raise InputError(f"not a kvrig command: {command!r}", file=root / BENCHMARKS)
    done = subprocess.run([sys.executable, "-m", "kvrig", *words[1:]], cwd=root, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise KvrigError(f"`{command}` exited {done.returncode}")
    return done.stdout


def load_measurements(root: Path) -> dict[str, Measurement]:
    return {path.stem: load_model_file(Measurement, path) for path in sorted((root / DATA).glob("*.json"))}


def pages(root: Path) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


_BEGIN = re.compile(r"^<!-- begin generated: [\w.-]+\.j2[^\n]*-->$")
_END = "<!-- end generated -->"


def sections(root: Path, page: Path) -> list[GeneratedSection]:
    """The page's generated sections; a section whose closing comment is missing is refused, since its body
    would run on to the next section's end and rendering would replace the prose between them."""
    text = page.read_text()
    opened: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if _BEGIN.match(line) or line == _END:
            if (opened is None) != bool(_BEGIN.match(line)):
                where = f"line {opened if opened is not None else number}"
                raise InputError(
                    "a generated section is not closed before the next one, or closed without being opened",
                    file=page,
                    field=where,
                    expected=f"each '<!-- begin generated: NAME.j2 -->' followed by its own '{_END}'",
                )
            opened = number if opened is None else None
    if opened is not None:
        raise InputError(
            "a generated section is never closed", file=page, field=f"line {opened}", expected=f"'{_END}' after it"
        )
    return [GeneratedSection(page, m["template"], m.start("body"), m.end("body")) for m in SECTION.finditer(text)]


def render_docs(root: Path) -> dict[Path, str]:
    """Every page with generated sections, as its templates render it from docs/data now (unchanged pages too)."""
    env = _environment(root)
    data = load_measurements(root)
    rendered: dict[Path, str] = {}
    for page in pages(root):
        text = page.read_text()
        found = sections(root, page)
        for section in reversed(found):  # from the end, so earlier offsets stay valid
            try:
                body = env.get_template(section.template).render(data=data)
            except jinja2.TemplateNotFound:
                raise InputError("no such template", file=page, field=section.template) from None
            except jinja2.TemplateSyntaxError as exc:  # TemplateAssertionError too (an unknown filter)
                raise InputError(
                    f"line {exc.lineno}: {exc.message}", file=root / TEMPLATES / section.template
                ) from None
            except jinja2.UndefinedError as exc:
                raise InputError(
                    f"{exc.message}",
                    file=root / TEMPLATES / section.template,
                    expected=f"a field the benchmark printed; for a name of {BENCHMARKS} absent from {DATA}, "
                    "`kvrig docs measure NAME` first",
                ) from None
            text = text[: section.start] + body.rstrip("\n") + "\n" + text[section.end :]
        if found:
            rendered[page] = text
    return rendered


def stale_pages(root: Path) -> list[str]:
    """What `kvrig docs render --check` refuses: pages that differ from their render, and measurements whose
    commands are no longer the ones docs/benchmarks.yaml runs."""
    stale = [
        f"{page.relative_to(root)}: differs from its render"
        for page, text in render_docs(root).items()
        if page.read_text() != text
    ]
    benchmarks = load_benchmarks(root)
    for name, measurement in load_measurements(root).items():
        bench = benchmarks.get(name)
        if bench is None:
            stale.append(f"{DATA / name}.json: no benchmark {name!r} in {BENCHMARKS}")
        elif (bench.run, bench.before) != (measurement.command, measurement.before):
            stale.append(f"{DATA / name}.json: measured by other commands than {BENCHMARKS} gives; rerun it")
    return stale


def write_docs(root: Path) -> list[Path]:
    """Renders every page and writes those that changed; returns them. A root without the docs' benchmarks is
    refused as `--check` refuses it (a checkout's docs/, not a folder where nothing would be rendered)."""
    load_benchmarks(root)
    changed = {page: text for page, text in render_docs(root).items() if page.read_text() != text}
    for page, text in changed.items():
        atomic_write(page, text)
    return list(changed)


def _environment(root: Path) -> jinja2.Environment:
    # StrictUndefined: a template that names a field the benchmark no longer prints fails instead of going blank
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root / TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters.update(
        thousands=lambda n: f"{n:,}",
        mib=lambda n, digits=1: f"{n / 2**20:,.{digits}f} MiB",
        fixed=lambda n, digits=2: f"{n:,.{digits}f}",
        signed_pct=lambda ratio, digits=2: f"{ratio * 100:+.{digits}f} %".replace("-", "−"),
        text_file=_text_file,
        column_label=column_label,
    )
    env.globals["measured"] = _measured_line
    return env


def _text_file(path: str) -> str:
    """A text file a benchmark read, as the docs name it: the copies kvrig ships by their place in the package
    (the measuring checkout's own folder means nothing to a reader), system files by their path."""
    _, sep, tail = path.partition("/kvrig/_texts/")
    return f"kvrig/_texts/{tail}" if sep else path


def _measured_line(m: Measurement) -> str:
    """The line beside every generated figure: what ran, when, on what."""
    # the commit is kvrig's (a trailing + when the tree had changes), so it sits beside kvrig's version
    versions = ", ".join(
        f"{k} {m.versions.get(k) or 'absent'}" + (f" at {m.commit}" if k == "kvrig" and m.commit else "")
        for k in ("kvrig", "mlx", "mlx-lm")
    )
    before = "".join(f"`{c}`, then " for c in m.before)
    return (
        f"Measured by {before}`{m.command}` on {m.date:%Y-%m-%d} ({m.seconds:.0f} s; {versions}; "
        f"load average {m.host.load_before[0]:.1f} on {m.host.cpus} cores; `docs/data/{m.name}.json`)"
    )
