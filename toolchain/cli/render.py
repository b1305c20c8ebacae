"""Rendering shared by all commands: JSON for machines, rich tables for people."""

from __future__ import annotations

import json
from typing import Any

import click
from pydantic import BaseModel


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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
