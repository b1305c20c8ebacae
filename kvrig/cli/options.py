"""Options several commands take, declared once: the same type, range and choices wherever they appear (each
command still says in its own help what the option means for it). `--json` and `--usbmuxd` live in render.py."""

from __future__ import annotations

from typing import Any

import click

Decorator = Any


def ios_option(default: str, help: str) -> Decorator:
    """`--ios`: a release the virtual iPhone emulates."""
    # Imported here: only the virtual iPhone's commands take --ios, and the device layer never loads the emulator.
    from kvrig.virtual.state import IOS_BUILDS

    return click.option("--ios", type=click.Choice(list(IOS_BUILDS)), default=default, show_default=True, help=help)


def backend_option(default: str | None, help: str) -> Decorator:
    """`--backend`: the runtime the app runs the model on (soak plans, lab entries, telemetry name the same two)."""
    return click.option(
        "--backend", type=click.Choice(["mlx", "coreml"]), default=default, show_default=default is not None, help=help
    )


def tokens_option(name: str, default: int, help: str, *, minimum: int = 1) -> Decorator:
    """A count of tokens (a context, a step), at least `minimum`."""
    return click.option(name, type=click.IntRange(min=minimum), default=default, show_default=True, help=help)


def seconds_option(
    name: str, default: float | None, help: str, *, minimum: float, dest: str | None = None
) -> Decorator:
    """A duration in seconds, at least `minimum`; no default means no limit."""
    decls = (name, dest) if dest else (name,)
    return click.option(
        *decls, type=click.FloatRange(min=minimum), default=default, show_default=default is not None, help=help
    )
