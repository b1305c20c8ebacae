"""`kvrig devices` and `kvrig deploy`: find phones (real or virtual) and put an app and a model bundle on one.

The device layer is async; each command bridges it once (`toolchain.cli.bridge.run_async`).
"""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli.bridge import run_async
from toolchain.cli.render import echo_json, human_bytes, json_option, usbmuxd_option


def _udid_option(func):  # type: ignore[no-untyped-def]
    return click.option("--udid", default=None, help="The device's UDID (needed when several are attached).")(func)


@click.command(
    "devices", short_help="List attached iPhones (real or virtual, on one or several hosts) with their profile."
)
@usbmuxd_option
@json_option
def devices(usbmuxd: tuple[str, ...], as_json: bool) -> None:
    """List attached iPhones: UDID, model, iOS version, the device profile kvrig maps them to, and the host."""
    from toolchain.device.hosts import list_devices_on, parse_hosts

    hosts = parse_hosts(usbmuxd)
    found, unreachable = run_async(list_devices_on(hosts))
    if unreachable and len(unreachable) == len(hosts):
        from toolchain.exceptions import DeviceNotFoundError

        raise DeviceNotFoundError(
            "; ".join(unreachable.values() if len(hosts) == 1 else map(": ".join, unreachable.items()))
        )
    for name, why in unreachable.items():
        click.echo(f"host {name}: {why}", err=True)
    if as_json:
        echo_json([d.to_json() for d in found])
        return
    if not found:
        click.echo("no devices attached (connect an iPhone, or start one with `kvrig virtual start`)")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("UDID", "ProductType", "iOS", "profile", "name", "connection", "host")
    for d in found:
        if d.error:
            table.add_row(d.udid, "?", "?", "?", f"[red]{d.error}[/red]", d.connection, d.host)
        else:
            table.add_row(
                d.udid,
                d.product_type or "?",
                d.os_version or "?",
                d.profile or "(no profile)",
                d.name or "",
                d.connection,
                d.host,
            )
    Console(width=max(120, Console().width)).print(table)


@click.command("deploy", short_help="Install the app and push a model bundle into its Documents (resumable).")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--app", "ipa", type=click.Path(exists=True, path_type=Path), help="The app (.ipa) to install first.")
@click.option("--app-id", default=None, help="Push into this installed app instead of installing one.")
@_udid_option
@json_option
def deploy(bundle: Path, ipa: Path | None, app_id: str | None, udid: str | None, as_json: bool) -> None:
    """Install the app and push BUNDLE into its Documents; an interrupted push resumes where it stopped."""
    from toolchain.device.deploy import deploy as run_deploy

    if ipa is None and app_id is None:
        raise click.UsageError("give the app to install (--app APP.ipa) or an installed app's id (--app-id)")
    if as_json:
        result = run_async(run_deploy(bundle, ipa=ipa, app_id=app_id, udid=udid))
        echo_json(result.to_json())
        return

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=console
    ) as bar:
        task = bar.add_task("pushing", total=None)

        def on_progress(p) -> None:  # type: ignore[no-untyped-def]
            bar.update(task, completed=p.sent, total=p.to_send or None, description=p.file)

        result = run_async(run_deploy(bundle, ipa=ipa, app_id=app_id, udid=udid, progress=on_progress))
    push = result.push
    installed = f"installed {result.app_id}; " if result.installed else ""
    click.echo(
        f"{result.device.udid} ({result.device.product_type}, iOS {result.device.os_version}): {installed}"
        f"{push.remote_dir}: sent {len(push.sent)} files ({human_bytes(push.bytes_sent)}), "
        f"kept {len(push.skipped)} already there ({human_bytes(push.bytes_skipped)})"
    )
