"""Rendering shared by all commands: JSON for machines, rich tables for people."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import BaseModel

from kvrig.exceptions import KvrigError

T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json", by_alias=True)
    if isinstance(obj, list | tuple):
        return [to_jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), indent=2))


def json_option(func: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(func)


def usbmuxd_option(func: Any) -> Any:
    """Several usbmuxd hosts (phones on other machines); also from KVRIG_USBMUXD, space-separated."""
    return click.option(
        "--usbmuxd",
        "usbmuxd",
        multiple=True,
        envvar="KVRIG_USBMUXD",
        metavar="[NAME=]HOST:PORT",
        help="A usbmuxd to find phones on (repeatable; a socket path works too); default: this machine's.",
    )(func)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def read_each(
    paths: Iterable[Path], reader: Callable[[Path], T], *, as_json: bool, results: list[dict[str, Any]], errors: list
) -> Iterator[tuple[Path, T]]:
    """Reads files one by one, yielding what could be read; a bad file is reported (an error entry in the
    JSON, a message on stderr otherwise) and collected in `errors` so the good files still print."""
    for path in paths:
        try:
            value = reader(path)
        except KvrigError as exc:
            errors.append(exc)
            if as_json:
                results.append({"file": str(path), "error": str(exc), "exit_code": exc.exit_code})
            else:
                click.echo(f"kvrig: error: {exc}", err=True)
            continue
        yield path, value
