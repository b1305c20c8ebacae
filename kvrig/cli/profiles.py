"""`kvrig profiles`: the device profiles kvrig knows, with the source of every number."""

from __future__ import annotations

from collections.abc import Callable

import click
from rich.table import Table

from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option
from kvrig.profiles import DeviceProfile, SourcedInt, list_profiles, load_profile
from kvrig.schemas import json_schema

MIB = 1 << 20


@click.group(short_help="List and show the device profiles kvrig knows.")
def profiles() -> None:
    """List and show the device profiles kvrig knows."""


@profiles.command("list")
@click.option("--sources", is_flag=True, help="Below the table, the basis and source of every RAM size and limit.")
@json_option
def list_command(sources: bool, as_json: bool) -> None:
    """One line per device: ProductTypes, chip, RAM, app memory limits, bandwidth (~ marks estimates). A product sold
    with two RAM sizes under the same ProductTypes has a line per size (NAME@NGB: `--ram N` chooses it)."""
    found = list_profiles()
    if as_json:
        echo_json(found)
        return
    table = Table(title=f"{len(found)} device profiles (~ estimated)")
    for column in ("name", "product types", "chip", "RAM", "limit", "entitled", "bandwidth"):
        table.add_column(column, justify="right" if column in {"RAM", "limit", "entitled", "bandwidth"} else "left")
    for p in found:
        table.add_row(
            p.name,
            " ".join(p.product_types),
            p.chip,
            _estimated(p.ram_bytes, human_bytes),
            _estimated(p.app_memory_limit.default_bytes, _as_mib),
            _estimated(p.app_memory_limit.entitled_bytes, _as_mib),
            _estimated(p.memory_bandwidth_bytes_per_s, _gb_per_s),
        )
        for v in p.ram_variants:
            table.add_row(
                f"{p.name}@{v.ram_bytes.value >> 30}GB",
                "(the same)",
                "",
                _estimated(v.ram_bytes, human_bytes),
                _estimated(v.app_memory_limit.default_bytes, _as_mib),
                _estimated(v.app_memory_limit.entitled_bytes, _as_mib),
                "",
            )
    console().print(table)
    if not sources:
        console().print("Every number's basis and source: --sources, or `kvrig profiles show NAME` (or --json).")
        return
    for p in found:
        configurations = [(p.name, p.ram_bytes, p.app_memory_limit)]
        configurations += [
            (f"{p.name}@{v.ram_bytes.value >> 30}GB", v.ram_bytes, v.app_memory_limit) for v in p.ram_variants
        ]
        for name, ram, limit in configurations:
            console().print(f"[bold]{name}[/bold]", highlight=False)
            for what, sourced, fmt in (
                ("RAM", ram, human_bytes),
                ("limit", limit.default_bytes, _as_mib),
                ("entitled", limit.entitled_bytes, _as_mib),
            ):
                line = (
                    "unknown (no source gives it)"
                    if sourced is None
                    else (f"{fmt(sourced.value)}, {sourced.basis}: {sourced.source}")
                )
                console().print(f"  {what}: {line}", markup=False, highlight=False)
        console().print(f"  sources: {'; '.join(p.sources)}", markup=False, highlight=False)


@profiles.command("show")
@click.argument("ref")
@json_option
def show_command(ref: str, as_json: bool) -> None:
    """Every field of one profile with its basis and source. REF: name, ProductType or YAML path."""
    profile = load_profile(ref)
    if as_json:
        echo_json(profile)
        return
    _print_profile(profile)


@profiles.command("schema")
@click.option("--limits", is_flag=True, help="The schema of a limits registry (`kvrig calibrate --limits`) instead.")
def schema_command(limits: bool) -> None:
    """The JSON Schema of a profile file (or of a limits registry)."""
    if limits:
        from kvrig.schemas.limits import LimitsRegistry

        echo_json(json_schema(LimitsRegistry))
        return
    echo_json(json_schema(DeviceProfile))


def _print_profile(p: DeviceProfile) -> None:
    out = console()
    out.print(f"[bold]{p.marketing_name}[/bold] ({p.name}): {', '.join(p.product_types)}, {p.chip}")
    table = Table(show_lines=True)
    table.add_column("field", no_wrap=True)
    table.add_column("value")
    table.add_column("basis")
    table.add_column("source", overflow="fold")
    rows: list[tuple[str, SourcedInt | None, Callable[[int], str]]] = [
        ("ram_bytes", p.ram_bytes, human_bytes),
        ("gpu_cores", p.gpu_cores, str),
        ("memory_bandwidth_bytes_per_s", p.memory_bandwidth_bytes_per_s, _gb_per_s),
        ("page_size_bytes", p.page_size_bytes, human_bytes),
        ("app_memory_limit.default_bytes", p.app_memory_limit.default_bytes, _as_mib),
        ("app_memory_limit.entitled_bytes", p.app_memory_limit.entitled_bytes, _as_mib),
        ("app_baseline_bytes", p.app_baseline_bytes, human_bytes),
    ]
    for field, sourced, fmt in rows:
        if sourced is None:
            table.add_row(field, "unknown", "", "")
        else:
            shown = fmt(sourced.value)
            value = str(sourced.value) if shown == str(sourced.value) else f"{sourced.value} ({shown})"
            table.add_row(field, value, sourced.basis, sourced.source)
    if p.os_seen is not None:
        table.add_row("os_seen", p.os_seen.value, p.os_seen.basis, p.os_seen.source)
    out.print(table)
    for title, lines in (("notes", p.notes), ("sources", p.sources)):
        if lines:
            out.print(f"[bold]{title}[/bold]")
            for line in lines:
                out.print(f"  - {line}", markup=False, highlight=False)


def _as_mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


def _gb_per_s(n: float) -> str:
    return f"{n / 1e9:.1f} GB/s"


def _estimated(sourced: SourcedInt | None, fmt: Callable[[int], str]) -> str:
    """Table cell: '~' marks an estimate."""
    if sourced is None:
        return "unknown"
    return ("~" if sourced.basis == "estimated" else "") + fmt(sourced.value)
