"""The global output settings (`-v`, `-q`, `--no-color`) and the consoles every command prints through. Kept
apart from render.py so that the group callback, which runs for `kvrig --help`, imports neither rich nor pydantic."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from rich.console import Console

# Off a terminal nothing wraps or truncates: rich would otherwise squeeze every table to 80 columns and cut cells
# with "…", so `kvrig plan | cat` lost digits and `kvrig profiles list | grep` lost names.
PIPE_WIDTH = 100_000


@dataclass
class Output:
    """What the global options asked for; the group callback sets it once per invocation."""

    verbosity: int = 0  # -1 quiet (-q), 0 normal, 1 verbose (-v: tracebacks, debug logging)
    color: bool = True


OUTPUT = Output()


def console(*, stderr: bool = False, min_width: int = 0, live: bool = False) -> Console:
    """A rich console for one command's output: the terminal's width (at least `min_width`) on a terminal,
    unbounded in a pipe or file (`live` displays such as progress bars keep rich's own width); plain text with
    `--no-color`, NO_COLOR or off a terminal."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width: int | None = PIPE_WIDTH
    if live or stream.isatty():
        width = max(min_width, Console(stderr=stderr).width) if min_width else None
    # NO_COLOR (no-color.org) and --no-color mean plain text: no escape codes at all, bold included.
    plain = not OUTPUT.color or bool(os.environ.get("NO_COLOR"))
    return Console(stderr=stderr, width=width, color_system=None if plain else "auto")


def info(line: str) -> None:
    """Progress and status for people, on stderr so stdout stays the result; silenced by `-q`."""
    if OUTPUT.verbosity >= 0:
        click.echo(line, err=True)


def warn(line: str) -> None:
    """A warning survives `-q`: it says something about the result."""
    click.echo(f"kvrig: warning: {line}", err=True)
