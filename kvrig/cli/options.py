"""Options several commands take, declared once: the same type, range and choices wherever they appear (each
command still says in its own help what the option means for it). `--json` and `--usbmuxd` live in render.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

Decorator = Any


def int_list(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> list[int] | None:
    """A callback for comma-separated counts (`--contexts 2048,8192`): positive integers, a usage error otherwise."""
    if value is None:
        return None
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got '{value}'") from None
    if not items or any(i < 1 for i in items):
        raise click.BadParameter(f"expected positive integers, got '{value}'")
    return items


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


def retired_force_option(instead: str) -> Decorator:
    """`--force`, no longer taken: it meant several things, each its own flag now, so a script that used it is
    refused (a usage error, exit 2) with `instead` saying which flag to give."""

    def refuse(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value:
            raise click.UsageError(f"--force is retired: {instead}")

    return click.option("--force", is_flag=True, hidden=True, expose_value=False, callback=refuse, help=instead)


def tokens_option(name: str, default: int, help: str, *, minimum: int = 1, alias: str | None = None) -> Decorator:
    """A count of tokens (a context, a step), at least `minimum`; `alias`: an older name still accepted."""
    decls = (name, alias) if alias else (name,)
    return click.option(*decls, type=click.IntRange(min=minimum), default=default, show_default=True, help=help)


def seconds_option(
    name: str, default: float | None, help: str, *, minimum: float, dest: str | None = None
) -> Decorator:
    """A duration in seconds, at least `minimum` and finite (NaN would never trigger); no default means no limit."""
    decls = (name, dest) if dest else (name,)
    return click.option(
        *decls,
        type=click.FloatRange(min=minimum),
        default=default,
        show_default=default is not None,
        callback=finite("a number of seconds"),
        help=help,
    )


def group_size_option(name: str, default: int | None, help: str) -> Decorator:
    """A quantization group size: one MLX quantizes with, refused before any model is read."""
    from kvrig.recipes import GROUP_SIZES

    def check(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
        if value is not None and value not in GROUP_SIZES:
            raise click.BadParameter(
                f"{value} is not a group size MLX quantizes with ({', '.join(map(str, GROUP_SIZES))})"
            )
        return value

    return click.option(
        name, type=int, default=default, show_default=default is not None, callback=check, is_eager=True, help=help
    )


def checked_specs(kind: str, *, auto: bool, several: bool, beside: str | None = None, empty_ok: bool = False) -> Any:
    """A callback that reads weight recipes (`kind` "weights") or KV specs ("kv") as the recipe grammar does, so a
    misspelt one is refused with the option's name before any model loads (the error keeps its own exit code).
    `beside`: a prefix naming another tool's method on the same layout (bench quantize's `dwq-` + a recipe);
    `empty_ok`: '' means none (the bench's rows of one kind left out)."""
    from kvrig.exceptions import KvrigError
    from kvrig.recipes import AUTO, parse_kv, parse_weights

    parse = parse_weights if kind == "weights" else parse_kv

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        items = [v.strip() for v in value.split(",") if v.strip()] if several else [value] if value.strip() else []
        if not items and empty_ok:
            return [] if several else ""
        if not items:  # an empty list would plan the defaults, as if the option had not been given
            raise click.BadParameter(f"expected one or more, separated by commas, got {value!r}")
        for item in items:
            if auto and item.lower() == AUTO:
                continue
            try:
                parse(item.removeprefix(beside) if beside else item)
            except KvrigError as exc:
                exc.args = (f"{param.opts[0]}: {exc}",)
                raise
        return items if several else value

    return check


def ram_option(help_suffix: str = "") -> Decorator:
    """`--ram`: the RAM of a product sold with two memory sizes under the same ProductTypes (the iPad Pro's 1 TB and
    2 TB models); the same as naming the device `REF@NGB`."""
    return click.option(
        "--ram",
        "ram_gb",
        type=click.IntRange(min=1),
        default=None,
        metavar="GB",
        help="RAM of the device in GB, for products sold with two sizes under the same ProductTypes (iPad Pro 8 GB "
        "or 16 GB; `kvrig profiles list` names each configuration); default: the base configuration. The same as "
        "--device REF@NGB." + help_suffix,
    )


def finite(expected: str) -> Any:
    """A callback refusing NaN and infinity, which click's FloatRange lets through."""

    def check(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise click.BadParameter(f"expected {expected}, got {value}")
        return value

    return check


def not_nan(expected: str) -> Any:
    """A callback refusing NaN, which click's FloatRange lets through (NaN passes every comparison)."""

    def check(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
        if value is not None and value != value:
            raise click.BadParameter(f"expected {expected}, got nan")
        return value

    return check


class InputPath(click.Path):
    """A file or folder a command reads: one that is missing or of the wrong kind is InputError (exit 3) naming it,
    as every file kvrig reads is refused, not click's usage error (exit 2)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from kvrig.exceptions import InputError

        path = Path(value)
        name = param and (param.opts[0] if param.param_type_name == "option" else param.human_readable_name)
        given = f" (given to {name})" if name else ""
        wanted = "a folder" if not self.file_okay else "a file" if not self.dir_okay else "a file or a folder"
        if self.exists and not path.exists():
            raise InputError(f"not found{given}", file=path, expected=wanted)
        if path.is_dir() and not self.dir_okay:
            raise InputError(f"is a folder{given}", file=path, expected=wanted)
        if path.exists() and not path.is_dir() and not self.file_okay:
            raise InputError(f"is not a folder{given}", file=path, expected=wanted)
        return super().convert(value, param, ctx)
