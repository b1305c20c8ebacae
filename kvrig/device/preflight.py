"""Preflight: what a phone needs before kvrig can launch an app on it, checked over lockdown (no tunnel).

Per phone: iOS version, Developer Mode on/off (iOS 16+), the developer disk image mounted or not, and which
tunnel kvrig would use. `kvrig devices` shows it; soak and lab stop on the first blocking cause with its own
typed error (and exit code): locked/not trusted, Developer Mode off, image not mounted, no tunnel possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pymobiledevice3 import exceptions as pmd3
from pymobiledevice3.services.mobile_image_mounter import MobileImageMounterService, image_type_for_device

from kvrig.device.discovery import Device, DeviceInfo, connect, list_devices
from kvrig.device.errors import DEVELOPER_MODE_HINT, problem_json
from kvrig.device.tunnel import TunnelMode, TunnelPlan, plan_tunnel
from kvrig.exceptions import DeveloperModeOffError, DeviceError, ImageNotMountedError, NoTunnelError

IMAGE_HINT = "run `kvrig prepare` to mount it (the first time it downloads the image and a signature from Apple)"


@dataclass
class Preflight:
    device: DeviceInfo
    developer_mode: bool | None = None  # None: this iOS has no Developer Mode, or the phone did not say
    image_mounted: bool | None = None  # None: the phone did not say (no image mounter service)
    image_type: str | None = None  # "Developer" before iOS 17, "Personalized" from 17
    tunnel: TunnelPlan | None = None
    problems: list[DeviceError] = field(default_factory=list)  # blocking causes, in the order they are checked

    @property
    def ready(self) -> bool:
        return not self.problems

    def raise_first(self) -> None:
        """Raises the first blocking cause (what soak and lab stop with)."""
        if self.problems:
            raise self.problems[0]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.device.to_json(),
            "developer_mode": self.developer_mode,
            "image_mounted": self.image_mounted,
            "image_type": self.image_type,
            "tunnel": self.tunnel.to_json() if self.tunnel is not None else None,
            "ready": self.ready,
            "problems": [problem_json(p) for p in self.problems],
        }


async def developer_mode(device: Device) -> bool | None:
    lockdown = device.lockdown
    if not lockdown.has_developer_mode:
        return None
    try:
        async with device.errors("reading the Developer Mode status"):
            return await lockdown.get_developer_mode_status()
    except DeviceError as exc:
        if isinstance(exc.__cause__, pmd3.MissingValueError):
            return None
        raise


async def image_mounted(device: Device) -> tuple[bool | None, str]:
    """Whether the developer disk image this phone uses is mounted (asked over lockdown's image mounter)."""
    image_type = image_type_for_device(device.lockdown)
    try:
        async with device.errors("asking the image mounter"), MobileImageMounterService(device.lockdown) as mounter:
            return await mounter.is_image_mounted(image_type), image_type
    except DeviceError as exc:
        if isinstance(exc.__cause__, pmd3.InvalidServiceError | pmd3.StartServiceError):
            return None, image_type
        raise


async def check(device: Device, tunnel: TunnelMode | str | None = None) -> Preflight:
    """Checks one connected phone; `problems` lists what blocks launching an app, first cause first."""
    info = device.info
    report = Preflight(info)
    report.developer_mode = await developer_mode(device)
    report.image_mounted, report.image_type = await image_mounted(device)
    report.tunnel = await plan_tunnel(info.udid, info.os_version, tunnel)
    where = f"{info.udid} (iOS {info.os_version})"
    if report.developer_mode is False:
        report.problems.append(DeveloperModeOffError(f"{where}: Developer Mode is off; {DEVELOPER_MODE_HINT}"))
    if report.image_mounted is False:
        image = f"the developer disk image ({report.image_type})"
        report.problems.append(ImageNotMountedError(f"{where}: {image} is not mounted; {IMAGE_HINT}"))
    if report.tunnel.kind is None:
        report.problems.append(NoTunnelError(f"{where}: no tunnel possible: {report.tunnel.reason}"))
    return report


async def check_all(tunnel: TunnelMode | str | None = None, *, usbmux_address: str | None = None) -> list[Preflight]:
    """`kvrig devices`: every attached phone with its preflight (a phone lockdownd refused keeps that reason)."""

    reports: list[Preflight] = []
    for info in await list_devices(usbmux_address=usbmux_address):
        if info.problem is not None:
            reports.append(Preflight(info, problems=[info.problem]))
            continue
        try:
            device = await connect(info.udid, usbmux_address=usbmux_address)
            async with device:
                reports.append(await check(device, tunnel))
        except DeviceError as exc:
            reports.append(Preflight(info, problems=[exc]))
    return reports
