"""`kvrig devices` and `kvrig deploy`: find phones (real or virtual) and put an app and a model bundle on one.

The device layer is async; each command bridges it once (`kvrig.device.loop.run_async`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvrig.cli.options import InputPath
from kvrig.cli.output import OUTPUT, console
from kvrig.cli.render import echo_json, human_bytes, json_option, usbmuxd_option
from kvrig.device.loop import run_async

if TYPE_CHECKING:
    from kvrig.schemas.limits import MeasuredLimit


def _udid_option(func):  # type: ignore[no-untyped-def]
    return click.option("--udid", default=None, help="The device's UDID (needed when several are attached).")(func)


def tunnel_option(func):  # type: ignore[no-untyped-def]
    """`--tunnel`: how iOS 17+ developer services are reached (shared by devices, prepare, soak)."""
    return click.option(
        "--tunnel",
        "tunnel",
        default="auto",
        show_default=True,
        metavar="auto|userspace|tunneld[=HOST:PORT]|none",
        help="How to reach iOS 17+ developer services: auto picks tunneld if it serves the phone, else the "
        "no-root userspace tunnel (iOS 17.4+).",
    )(func)


def parse_tunnel(value: str):  # type: ignore[no-untyped-def]
    from kvrig.device.tunnel import TunnelMode
    from kvrig.exceptions import InputError

    try:
        return TunnelMode.parse(value)
    except InputError as exc:
        raise click.BadParameter(str(exc), param_hint="--tunnel") from None


def _yes_no(value: bool | None, yes: str = "on", no: str = "off") -> str:
    return "?" if value is None else (f"[green]{yes}[/green]" if value else f"[red]{no}[/red]")


@click.command(
    "devices",
    short_help="List attached iPhones (real or virtual, on one or several hosts): profile, iOS, Developer Mode, "
    "image, tunnel.",
)
@tunnel_option
@usbmuxd_option
@click.option(
    "--limits",
    "limits_file",
    type=InputPath(exists=True, dir_okay=False, path_type=Path),
    help="Limits registry (`kvrig calibrate --limits`): show the app memory limit each phone's ProductType and OS "
    "build stated, with and without the increased-memory-limit entitlement.",
)
@json_option
def devices(tunnel: str, usbmuxd: tuple[str, ...], limits_file: Path | None, as_json: bool) -> None:
    """List attached iPhones: UDID, model, iOS, Developer Mode, developer disk image, the tunnel kvrig would
    use and the usbmuxd host, with what blocks a soak on each (and, with --limits, the limit each stated)."""
    from kvrig.device.hosts import parse_hosts, preflight_on
    from kvrig.planner.limits import load_limits

    hosts = parse_hosts(usbmuxd)
    registry = load_limits(limits_file) if limits_file is not None else None  # a bad file is refused before phones
    found, unreachable = run_async(preflight_on(hosts, parse_tunnel(tunnel)))
    for name, why in unreachable.items():
        click.echo(f"host {name}: {why}", err=True)
    phones = [p.device for p in found]
    measured = [registry.for_phone(d.product_type, d.build_version) for d in phones] if registry is not None else None
    if as_json:
        rows = [d.to_json() for d in found]
        if measured is not None:
            for row, limits in zip(rows, measured, strict=True):
                row["measured_limits"] = {kind: e.model_dump(mode="json") if e else None for kind, e in limits.items()}
        echo_json(rows)
        return
    if not found:
        click.echo("no devices attached (connect an iPhone, or start one with `kvrig virtual start`)")
        return
    from rich.table import Table

    table = Table("UDID", "ProductType", "iOS", "profile", "dev mode", "image", "tunnel", "connection", "host")
    if measured is not None:
        table.add_column("measured limit (entitled / default)")
    for i, p in enumerate(found):
        d = p.device
        tunnel_text = "?" if p.tunnel is None else (p.tunnel.kind or "[red]none possible[/red]")
        extra = []
        if measured is not None:
            shown = [_measured(e) for e in measured[i].values()]
            extra = [f"{' / '.join(shown)} (build {d.build_version or '?'})"]
        table.add_row(
            d.udid,
            d.product_type or "?",
            d.os_version or "?",
            d.profile or "(no profile)",
            _yes_no(p.developer_mode),
            _yes_no(p.image_mounted, "mounted", "not mounted"),
            tunnel_text,
            d.connection,
            d.host,
            *extra,
        )
    out = console(min_width=120)
    out.print(table)
    for p in found:
        for problem in p.problems:
            out.print(f"[red]{p.device.udid}[/red]: {problem}", markup=True, highlight=False)


@click.command(
    "prepare", short_help="Make a phone ready: Developer Mode (only if asked), developer disk image, tunnel."
)
@_udid_option
@click.option(
    "--enable-developer-mode",
    is_flag=True,
    help="Switch Developer Mode on if it is off (the phone restarts; refused on a phone with a passcode).",
)
@click.option(
    "--image",
    "image_dir",
    type=InputPath(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Mount from this folder (Image.dmg, BuildManifest.plist, Image.trustcache; before iOS 17 "
    "DeveloperDiskImage.dmg + .signature) instead of pymobiledevice3's download cache.",
)
@tunnel_option
@usbmuxd_option
@json_option
def prepare(
    udid: str | None,
    enable_developer_mode: bool,
    image_dir: Path | None,
    tunnel: str,
    usbmuxd: tuple[str, ...],
    as_json: bool,
) -> None:
    """Make a phone ready for soak and lab: Developer Mode, the developer disk image, the tunnel; each step
    reported. Developer Mode is switched on only with --enable-developer-mode."""
    from kvrig.device.prepare import prepare as run_prepare

    address = phone_address(udid, usbmuxd)

    def on_step(step) -> None:  # type: ignore[no-untyped-def]
        if not as_json:
            click.echo(f"{step.name}: {step.status}: {step.detail}")

    result = run_async(
        run_prepare(
            udid,
            enable_developer_mode=enable_developer_mode,
            tunnel=parse_tunnel(tunnel),
            image_dir=image_dir,
            on_step=on_step,
            usbmux_address=address,
        )
    )
    if as_json:
        echo_json(result.to_json())
    elif result.ready:
        d = result.device
        click.echo(f"{d.udid} ({d.product_type}, iOS {d.os_version}) is ready")
    if result.problem is not None:
        raise result.problem


@click.command("deploy", short_help="Install the app and push a model bundle into its Documents (resumable).")
@click.argument("bundle", type=click.Path(path_type=Path))  # not a bundle: BundleError (7), as everywhere
@click.option("--app", "ipa", type=InputPath(exists=True, path_type=Path), help="The app (.ipa) to install first.")
@click.option("--app-id", default=None, help="Push into this installed app instead of installing one.")
@_udid_option
@usbmuxd_option
@json_option
def deploy(
    bundle: Path, ipa: Path | None, app_id: str | None, udid: str | None, usbmuxd: tuple[str, ...], as_json: bool
) -> None:
    """Install the app and push BUNDLE into its Documents; an interrupted push resumes where it stopped."""
    from kvrig.device.apps import INSTALL_BARS
    from kvrig.device.deploy import deploy as run_deploy

    if ipa is None and app_id is None:
        raise click.UsageError("give the app to install (--app APP.ipa) or an installed app's id (--app-id)")
    address = phone_address(udid, usbmuxd)
    INSTALL_BARS.set(not as_json and OUTPUT.verbosity >= 0)  # as kvrig's own push bar below
    if as_json:
        result = run_async(run_deploy(bundle, ipa=ipa, app_id=app_id, udid=udid, usbmux_address=address))
        echo_json(result.to_json())
        return

    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console(stderr=True, live=True),
        disable=OUTPUT.verbosity < 0,
    )
    tasks: list[TaskID] = []  # the bar shows from the first file pushed: a bundle refused before leaves no bar

    def on_progress(p) -> None:  # type: ignore[no-untyped-def]
        if not tasks:
            bar.start()
            tasks.append(bar.add_task("pushing", total=None))
        bar.update(tasks[0], completed=p.sent, total=p.to_send or None, description=p.file)

    try:
        result = run_async(
            run_deploy(bundle, ipa=ipa, app_id=app_id, udid=udid, progress=on_progress, usbmux_address=address)
        )
    finally:
        if tasks:
            bar.stop()
    push = result.push
    installed = f"installed {result.app_id}; " if result.installed else ""
    click.echo(
        f"{result.device.udid} ({result.device.product_type}, iOS {result.device.os_version}): {installed}"
        f"{push.remote_dir}: sent {len(push.sent)} files ({human_bytes(push.bytes_sent)}), "
        f"kept {len(push.skipped)} already there ({human_bytes(push.bytes_skipped)})"
    )


def phone_address(udid: str | None, usbmuxd: tuple[str, ...]) -> str | None:
    """The usbmuxd of the host holding the phone, when --usbmuxd (or KVRIG_USBMUXD) names hosts; None: this one."""
    from kvrig.device.hosts import address_of, parse_hosts

    return run_async(address_of(udid, parse_hosts(usbmuxd))) if usbmuxd else None


def _measured(entry: MeasuredLimit | None) -> str:
    if entry is None:
        return "-"
    # kept by calibrate --include-virtual: the limit a virtual iPhone was started with, no phone's
    return human_bytes(entry.limit_bytes) + (" (virtual)" if entry.virtual_sources else "")
