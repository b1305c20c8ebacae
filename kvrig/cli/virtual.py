"""`kvrig virtual start|stop|status`: a virtual iPhone that pymobiledevice3 drives over a usbmuxd socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvrig.cli.options import InputPath, ios_option, not_nan
from kvrig.cli.output import console
from kvrig.cli.render import echo_json, human_bytes, json_option
from kvrig.device.address import client_form, usbmux_address


@click.group(short_help="Run a virtual USB iPhone that pymobiledevice3 drives (start, stop, status).")
def virtual() -> None:
    """Run a virtual USB iPhone (usbmuxd socket, lockdownd, AFC, apps, crash reports, DTX)."""


def _socket_option(func):  # type: ignore[no-untyped-def]
    from kvrig.virtual.control import DEFAULT_SOCKET

    return click.option(
        "--socket",
        "address",
        default=DEFAULT_SOCKET,
        show_default=True,
        help="usbmuxd socket: a unix path ([UNIX:]/path) or HOST:PORT (give it to clients as USBMUXD_SOCKET_ADDRESS).",
        callback=lambda _ctx, _param, value: usbmux_address(value, field="--socket"),
    )(func)


@virtual.command()
@click.option(
    "--device",
    "--profile",
    "profile",
    default="iPhone16,1",
    show_default=True,
    help="ProductType or device profile, as plan, package and demo take it (--profile: its older name).",
)
@_socket_option
@click.option(
    "--state",
    "state",
    type=InputPath(file_okay=False, path_type=Path),
    required=True,
    help="State folder (apps, containers, crash reports); kept across restarts.",
)
@click.option(
    "--limit-mib",
    "--limit-mb",
    "limit_mb",
    type=click.IntRange(min=1),
    default=None,
    help="App memory limit in MiB, every app's (default: the profile's, as iOS gives it: the entitled limit to an "
    "app with the increased-memory-limit entitlement where the profile knows one, the default limit to others).",
)
@click.option(
    "--baseline-mib",
    "--baseline-mb",
    "baseline_mb",
    type=click.FloatRange(min=0, max=1 << 30),  # MiB: no phone's footprint; the bound also refuses inf
    callback=not_nan("a number of MiB"),
    default=None,
    help="App footprint before weights and KV, MiB (default: the profile's).",
)
@ios_option("16.7", "iOS release; from 17.4 developer services are reached through a CoreDeviceProxy tunnel.")
@click.option("--detach", is_flag=True, help="Run in the background and return.")
@click.option(
    "--tcp",
    default=None,
    metavar="HOST:PORT",
    help="Serve usbmuxd on this TCP address too (port 0: any free one; `status` shows it), for remote labs.",
)
@click.option("--unplug-after-afc-bytes", type=int, default=None, help="Fault: unplug after N bytes of AFC.")
@click.option(
    "--unplug-on-service",
    default=None,
    metavar="SERVICE",
    help="Fault: unplug when a client asks lockdownd for SERVICE (e.g. com.apple.crashreportmover).",
)
@click.option("--refuse-service", multiple=True, help="Fault: lockdownd refuses this service (repeatable).")
@click.option("--crash-at-tokens", type=int, default=None, help="Fault: the app crashes at N context tokens.")
@click.option("--hang-at-tokens", type=int, default=None, help="Fault: the app hangs at N context tokens.")
@click.option(
    "--jetsam-without-report", is_flag=True, help="Fault: a jetsam kill is logged as a phone logs it, no report filed."
)
@click.option(
    "--gpu-background-at-tokens",
    type=int,
    default=None,
    help="Fault: at N tokens Metal refuses the app's GPU work as from the background; the app aborts.",
)
@click.option(
    "--watchdog-at-tokens", type=int, default=None, help="Fault: the watchdog kills the app at N tokens (0x8badf00d)."
)
@click.option(
    "--vanish-at-tokens", type=int, default=None, help="Fault: the app dies at N tokens leaving no line and no report."
)
@click.option("--slow-link-bps", type=float, default=None, help="Fault: pace every connection to N bytes/s.")
@click.option("--developer-mode-off", is_flag=True, help="Fault: Developer Mode is off (AMFI can enable it).")
@click.option(
    "--image-missing", is_flag=True, help="Fault: no developer disk image mounted (the mounter can mount it)."
)
@click.option(
    "--tunnel-drop-after-bytes", type=int, default=None, help="Fault: the CoreDeviceProxy tunnel drops after N bytes."
)
@click.option(
    "--untrusted", is_flag=True, help="Fault: the phone does not trust this computer (no pair record, no session)."
)
@click.option(
    "--stall-handshake",
    "handshake_timeout",
    is_flag=True,
    help="Fault: the CDTunnel handshake is never answered (what `kvrig soak --handshake-timeout` bounds).",
)
@click.option("--rsd-silent", is_flag=True, help="Fault: RSD, inside the tunnel, never starts its handshake.")
@click.option("--launch-errors", type=int, default=0, help="Fault: the next N launches fail (transient NSError).")
@click.option(
    "--claim-size",
    multiple=True,
    metavar="PATTERN=BYTES",
    help="Fault: stat says files named PATTERN (fnmatch) are BYTES long; their content stays (repeatable).",
)
@click.option(
    "--endless-reads", multiple=True, metavar="PATTERN", help="Fault: reads of files named PATTERN never end."
)
@click.option(
    "--slow-reads",
    multiple=True,
    metavar="PATTERN=SECONDS",
    help="Fault: every read of a file named PATTERN waits SECONDS before its answer (repeatable).",
)
@click.option(
    "--phantom-entry", multiple=True, metavar="NAME", help="Fault: directory listings show NAME, which is not there."
)
@click.option(
    "--lockdown-value",
    multiple=True,
    metavar="KEY=JSON",
    help="Fault: lockdownd answers this device value instead (ProductType=7, ProductVersion='\"9999\"').",
)
@click.option(
    "--lockdown-garbage",
    type=click.Choice(["truncated", "array"]),
    default=None,
    help="Fault: the device values come cut off mid-plist, or as a plist array.",
)
@json_option
def start(
    profile: str,
    address: str,
    state: Path,
    limit_mb: int | None,
    baseline_mb: float | None,
    ios: str,
    detach: bool,
    tcp: str | None,
    unplug_after_afc_bytes: int | None,
    unplug_on_service: str | None,
    refuse_service: tuple[str, ...],
    crash_at_tokens: int | None,
    hang_at_tokens: int | None,
    jetsam_without_report: bool,
    gpu_background_at_tokens: int | None,
    watchdog_at_tokens: int | None,
    vanish_at_tokens: int | None,
    slow_link_bps: float | None,
    developer_mode_off: bool,
    image_missing: bool,
    tunnel_drop_after_bytes: int | None,
    untrusted: bool,
    handshake_timeout: bool,
    rsd_silent: bool,
    launch_errors: int,
    claim_size: tuple[str, ...],
    endless_reads: tuple[str, ...],
    slow_reads: tuple[str, ...],
    phantom_entry: tuple[str, ...],
    lockdown_value: tuple[str, ...],
    lockdown_garbage: str | None,
    as_json: bool,
) -> None:
    """Start a virtual iPhone and print its socket address."""
    import json

    from kvrig.virtual import control
    from kvrig.virtual.faults import FaultPlan

    def pairs(texts: tuple[str, ...], option: str, parse):  # type: ignore[no-untyped-def]
        out = {}
        for text in texts:
            key, sep, value = text.partition("=")
            try:
                if not sep or not key:
                    raise ValueError("no KEY=VALUE")
                out[key] = parse(value)
            except ValueError as exc:
                raise click.BadParameter(f"{text!r}: {exc}", param_hint=option) from None
        return out

    faults = FaultPlan(
        unplug_after_afc_bytes,
        set(refuse_service),
        crash_at_tokens,
        hang_at_tokens,
        slow_link_bps,
        unplug_on_service=unplug_on_service,
        developer_mode_off=developer_mode_off,
        image_missing=image_missing,
        tunnel_drop_after_bytes=tunnel_drop_after_bytes,
        handshake_timeout=handshake_timeout,
        untrusted=untrusted,
        rsd_silent=rsd_silent,
        launch_errors=launch_errors,
        claim_sizes=pairs(claim_size, "--claim-size", int),
        endless_reads=list(endless_reads),
        slow_reads=pairs(slow_reads, "--slow-reads", float),
        phantom_entries=list(phantom_entry),
        lockdown_values=pairs(lockdown_value, "--lockdown-value", json.loads),
        lockdown_garbage=lockdown_garbage,  # type: ignore[arg-type]
        jetsam_without_report=jetsam_without_report,
        gpu_background_at_tokens=gpu_background_at_tokens,
        watchdog_at_tokens=watchdog_at_tokens,
        vanish_at_tokens=vanish_at_tokens,
    )

    # the form libimobiledevice's tools need (UNIX:/path); kvrig reads it too
    exported = address if ":" in address and not address.startswith(("/", ".")) else client_form(address)

    def started(server: dict[str, Any], device: dict[str, Any], *, foreground: bool) -> None:
        tcp_address = server.get("TcpAddress")
        if as_json:
            out = {"socket": address, **({"tcp": tcp_address} if tcp_address else {}), **device}
            out |= {"usbmuxd_socket_address": exported, "pid": server["Pid"]}
            if foreground:  # one line, which a reader takes while the server goes on running
                click.echo(json.dumps(out))
            else:
                echo_json(out)
        else:
            click.echo(f"USBMUXD_SOCKET_ADDRESS={exported}")
            if tcp_address:
                click.echo(f"USBMUXD_SOCKET_ADDRESS={tcp_address}")
            click.echo(f"{device['udid']}  {device['product_type']}  iOS {device['ios']}  limit {_limits(device)}")

    def ready(server: dict[str, Any]) -> None:  # in the foreground: once the socket answers, before serving
        started(server, server["Devices"][0], foreground=True)

    result = control.start(
        address,
        state,
        profile=profile,
        ios=ios,
        limit_bytes=limit_mb * 1024 * 1024 if limit_mb is not None else None,
        baseline_bytes=int(baseline_mb * 1024 * 1024) if baseline_mb is not None else None,
        faults=faults,
        detach=detach,
        on_ready=ready,
        tcp=tcp,
    )
    if result:
        started(control.status(address), result, foreground=False)


def _limits(device: dict[str, Any]) -> str:
    """The default limit, and the entitled one where an app with the entitlement gets another."""
    default, entitled = device["limit_bytes"], device.get("entitled_limit_bytes") or device["limit_bytes"]
    return human_bytes(default) + (f" (entitled {human_bytes(entitled)})" if entitled != default else "")


@virtual.command()
@_socket_option
@click.option(
    "--state",
    type=InputPath(file_okay=False, path_type=Path),
    default=None,
    help="Stop only the device with this state folder (default: the whole server).",
)
@json_option
def stop(address: str, state: Path | None, as_json: bool) -> None:
    """Stop a virtual iPhone (or every one on the socket)."""
    from kvrig.virtual import control

    control.stop(address, state)
    if as_json:
        echo_json({"socket": address, "stopped": str(state) if state is not None else "all"})
        return
    click.echo("stopped")


@virtual.command()
@_socket_option
@json_option
def status(address: str, as_json: bool) -> None:
    """Show the virtual iPhones served on the socket."""
    from kvrig.virtual import control

    result = control.status(address)
    if as_json:
        echo_json(result)
        return
    from rich.table import Table

    table = Table(title=f"virtual iPhones on {result['Address']} (pid {result['Pid']})")
    columns = ("UDID", "ProductType", "iOS", "limit", "plugged", "dev mode", "image", "running apps", "state")
    for column in columns:
        table.add_column(column)
    for d in result["Devices"]:
        running = ", ".join(f"{name}[{pid}]" for pid, name in d["running"].items()) or "-"
        table.add_row(
            d["udid"],
            d["product_type"],
            d["ios"],
            _limits(d),
            str(d["plugged"]),
            "on" if d["developer_mode"] else "off",
            "mounted" if d["image_mounted"] else "missing",
            running,
            d["state"],
        )
    console().print(table)
