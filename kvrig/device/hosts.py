"""Phones on several usbmuxd hosts: a lab with one controller reaches each host's usbmuxd over TCP (what
pymobiledevice3 takes as `USBMUXD_SOCKET_ADDRESS=HOST:PORT`, e.g. a Mac mini's usbmuxd exposed with socat), and
every phone found is tagged with the host it is on."""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrig.device.address import usbmux_address
from kvrig.device.discovery import DeviceInfo, list_devices
from kvrig.device.preflight import check_all
from kvrig.device.tunnel import same_udid
from kvrig.exceptions import DeviceError, DeviceNotFoundError, LabShardError

if TYPE_CHECKING:
    from kvrig.device.preflight import Preflight
    from kvrig.device.tunnel import TunnelMode


@dataclass(frozen=True)
class UsbmuxHost:
    name: str  # how results and JUnit name the host
    address: str | None = None  # None: this machine's usbmuxd (or USBMUXD_SOCKET_ADDRESS)


def local_host() -> UsbmuxHost:
    return UsbmuxHost(socket.gethostname())


def parse_host(text: str) -> UsbmuxHost:
    """`[NAME=]HOST:PORT` or `[NAME=][UNIX:]/path/to/usbmuxd.sock`; without NAME the address names the host."""
    name, sep, address = text.partition("=")
    if not sep:
        name, address = text, text
    address, name = address.strip(), name.strip()
    if not address or not name:
        raise LabShardError(f"--usbmuxd {text!r}: expected [NAME=]HOST:PORT or [NAME=]/path/to/socket")
    return UsbmuxHost(name, usbmux_address(address, field="--usbmuxd"))


def parse_hosts(texts: list[str] | tuple[str, ...]) -> list[UsbmuxHost]:
    """The hosts named on the command line (comma- or space-separated as well as repeated); none: this one."""
    hosts = [parse_host(t) for text in texts for t in text.replace(",", " ").split()]
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise LabShardError(f"--usbmuxd: host names repeat: {names}")
    return hosts or [local_host()]


async def list_devices_on(hosts: list[UsbmuxHost]) -> tuple[list[DeviceInfo], dict[str, str]]:
    """Every phone on every host, tagged with its host, and the hosts that could not be asked (with why).
    A phone seen on two hosts is kept where it is on a cable (a Mac may list it over Wi-Fi too), else on the first."""
    found: list[DeviceInfo] = []
    unreachable: dict[str, str] = {}
    at: dict[str, int] = {}
    for host in hosts:
        try:
            devices = await list_devices(usbmux_address=host.address)
        except DeviceError as exc:
            unreachable[host.name] = str(exc)
            continue
        for info in devices:
            tagged = dataclasses.replace(info, host=host.name)
            if info.udid in at and _on_cable_now(found[at[info.udid]].connection, info.connection):
                found[at[info.udid]] = tagged
            elif info.udid not in at:
                at[info.udid] = len(found)
                found.append(tagged)
    return found, unreachable


def _on_cable_now(kept: str, listed: str) -> bool:
    """Whether a phone listed again, over `listed`, replaces the one kept (over `kept`): a cable beats Wi-Fi."""
    return listed == "USB" and kept != "USB"


async def address_of(udid: str | None, hosts: list[UsbmuxHost]) -> str | None:
    """The usbmuxd address of the host that lists `udid` (with or without its hyphen), or of the only phone on any
    host when `udid` is None: how one-phone commands (prepare, deploy, soak) find a phone `kvrig devices --usbmuxd`
    lists. DeviceNotFoundError names the hosts asked, and why any could not be."""
    if len(hosts) == 1:
        return hosts[0].address  # one host: the phone is looked for there, with that host's own messages
    found, unreachable = await list_devices_on(hosts)
    by_name = {h.name: h for h in hosts}
    usb = [d for d in found if d.connection == "USB"]
    matches = [d for d in usb if same_udid(d.udid, udid)] if udid is not None else usb
    if len(matches) == 1:
        return by_name[matches[0].host or ""].address
    asked = ", ".join(h.name for h in hosts)
    cannot = "".join(f"; {name}: {why}" for name, why in unreachable.items())
    if not matches:
        what = f"device {udid} is not" if udid is not None else "no device is"
        raise DeviceNotFoundError(f"{what} attached by USB to any of the usbmuxd hosts ({asked}){cannot}")
    listing = ", ".join(f"{d.udid} @ {d.host}" for d in matches)
    raise DeviceNotFoundError(f"{len(matches)} devices attached: {listing}; choose one with --udid")


async def preflight_on(
    hosts: list[UsbmuxHost], tunnel: TunnelMode | str | None = None
) -> tuple[list[Preflight], dict[str, str]]:
    """`kvrig devices`: every phone on every host with its preflight (Developer Mode, image, tunnel), tagged
    with its host, and the hosts that could not be asked (DeviceNotFoundError saying why when none could be). A
    phone seen on two hosts is kept as list_devices_on keeps it."""

    found: list[Preflight] = []
    unreachable: dict[str, str] = {}
    at: dict[str, int] = {}
    for host in hosts:
        try:
            reports = await check_all(tunnel, usbmux_address=host.address)
        except DeviceError as exc:
            unreachable[host.name] = str(exc)
            continue
        for report in reports:
            udid = report.device.udid
            report.device = dataclasses.replace(report.device, host=host.name)
            if udid in at and _on_cable_now(found[at[udid]].device.connection, report.device.connection):
                found[at[udid]] = report
            elif udid not in at:
                at[udid] = len(found)
                found.append(report)
    if unreachable and len(unreachable) == len(hosts):
        why = unreachable.values() if len(hosts) == 1 else map(": ".join, unreachable.items())
        raise DeviceNotFoundError("; ".join(why))
    return found, unreachable
