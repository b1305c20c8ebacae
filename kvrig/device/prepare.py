"""`kvrig prepare`: make a phone ready for soak and lab, one reported step at a time.

1. Developer Mode: switched on only with `enable_developer_mode` (AMFI; the phone restarts, and a phone with a
   passcode refuses: then it is a switch in Settings). Never silently.
2. Developer disk image: pymobiledevice3's `auto_mount` (the personalized image from iOS 17). The image comes
   from pymobiledevice3's cache (downloaded once from GitHub) and its personalization from the phone's stored
   manifest, or once from Apple's signing server. `image_dir` mounts from local files instead: a folder with
   Image.dmg, BuildManifest.plist and Image.trustcache (iOS 17+, pymobiledevice3's cache layout) or
   DeveloperDiskImage.dmg and its .signature (before iOS 17, Xcode's layout).
3. Tunnel (iOS 17+): opened once to check the instruments service is there, then closed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import requests
from developer_disk_image.exceptions import DeveloperDiskImageException
from packaging.version import Version
from pymobiledevice3 import exceptions as pmd3
from pymobiledevice3.lockdown_service_provider import LockdownServiceProvider
from pymobiledevice3.services.amfi import AmfiService
from pymobiledevice3.services.mobile_image_mounter import (
    CRYPTEX_IMAGE_MIN_VERSION,
    DeveloperDiskImageMounter,
    PersonalizedImageMounter,
    auto_mount,
)

from kvrig.device import preflight
from kvrig.device.discovery import Device, DeviceInfo, connect
from kvrig.device.errors import DEVELOPER_MODE_HINT, problem_json
from kvrig.device.tunnel import HANDSHAKE_TIMEOUT_S, Tunnel, TunnelMode, plan_tunnel
from kvrig.exceptions import (
    DeveloperModeOffError,
    DeviceError,
    ImageNotMountedError,
    InputError,
    KvrigError,
    NoTunnelError,
)

DOWNLOAD_HINT = (
    "mounting needs the internet once (the image from GitHub's DeveloperDiskImage repository, its "
    "personalization from Apple's signing server): run `kvrig prepare` where that is reachable, or give the "
    "image files with --image DIR"
)
Status = Literal["done", "already", "skipped", "blocked"]
INSTRUMENTS_RSD_SERVICE = "com.apple.instruments.dtservicehub"


@dataclass
class Step:
    name: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PrepareResult:
    device: DeviceInfo
    steps: list[Step] = field(default_factory=list)
    tunnel: dict[str, Any] | None = None
    problem: KvrigError | None = None  # the step that blocked (raised after the report is complete)

    @property
    def ready(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device.to_json(),
            "steps": [s.to_json() for s in self.steps],
            "tunnel": self.tunnel,
            "ready": self.ready,
            "problem": None if self.problem is None else problem_json(self.problem),
        }


async def prepare(
    udid: str | None = None,
    *,
    enable_developer_mode: bool = False,
    tunnel: TunnelMode | str | None = None,
    usbmux_address: str | None = None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    image_dir: str | Path | None = None,
    on_step: Callable[[Step], None] | None = None,
) -> PrepareResult:
    """Runs the steps on one phone; stops at the first that blocks (its typed error in `problem`)."""
    device = await connect(udid, usbmux_address=usbmux_address)
    result = PrepareResult(device.info)

    def report(name: str, status: Status, detail: str) -> None:
        step = Step(name, status, detail)
        result.steps.append(step)
        if on_step is not None:
            on_step(step)

    async with device:
        try:
            await _developer_mode(device, enable_developer_mode, report)
            plan = await plan_tunnel(device.udid, device.info.os_version, tunnel)
            device.tunnel = Tunnel(
                device.udid,
                plan,
                os_version=device.info.os_version,
                usbmux_address=usbmux_address,
                handshake_timeout_s=handshake_timeout_s,
            )
            await _image(device, report, Path(image_dir) if image_dir is not None else None)
            await _tunnel(device, report)
            result.tunnel = device.tunnel.to_json()
        except KvrigError as exc:
            result.problem = exc
    return result


async def _developer_mode(device: Device, enable: bool, report: Callable[[str, Status, str], None]) -> None:
    name = "developer mode"
    state = await preflight.developer_mode(device)
    if state is None:
        report(name, "skipped", f"iOS {device.info.os_version} has no Developer Mode (or the phone did not say)")
        return
    if state:
        report(name, "already", "on")
        return
    if not enable:
        report(name, "blocked", "off; kvrig switches it on only with --enable-developer-mode (the phone restarts)")
        raise DeveloperModeOffError(f"{device.udid}: Developer Mode is off; {DEVELOPER_MODE_HINT}")
    try:
        async with device.errors("switching Developer Mode on"):
            await AmfiService(device.lockdown).enable_developer_mode(enable_post_restart=False)
            await device.restarted()  # bounded, over USB, never pairing
            await AmfiService(device.lockdown).enable_developer_mode_post_restart()
    except DeviceError as exc:
        if isinstance(exc.__cause__, pmd3.DeviceHasPasscodeSetError):
            report(name, "blocked", "the phone has a passcode, so AMFI will not switch it on remotely")
            raise DeveloperModeOffError(
                f"{device.udid}: Developer Mode is off and the phone has a passcode: switch it on in "
                "Settings > Privacy & Security > Developer Mode"
            ) from exc
        raise
    if not await preflight.developer_mode(device):
        report(name, "blocked", "asked to switch on, but the phone still reports it off")
        raise DeveloperModeOffError(f"{device.udid}: Developer Mode is still off; {DEVELOPER_MODE_HINT}")
    report(name, "done", "switched on (the phone restarted and the prompt was confirmed)")


PERSONALIZED_FILES = ("Image.dmg", "BuildManifest.plist", "Image.trustcache")
DEVELOPER_FILES = ("DeveloperDiskImage.dmg", "DeveloperDiskImage.dmg.signature")


def image_files(folder: Path, image_type: str) -> list[Path]:
    """The local image files for this image type, or InputError naming what is missing."""
    names = PERSONALIZED_FILES if image_type == "Personalized" else DEVELOPER_FILES
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        expected = f"a {image_type} image folder with {', '.join(names)}"
        raise InputError(f"missing {', '.join(missing)}", file=folder, expected=expected)
    return [folder / n for n in names]


async def _mount_local(device: Device, image_type: str, folder: Path) -> None:
    files = image_files(folder, image_type)
    if image_type == "Personalized":
        async with PersonalizedImageMounter(device.lockdown) as personalized:
            await personalized.mount(files[0], files[1], files[2])
    else:
        async with DeveloperDiskImageMounter(device.lockdown) as developer:
            await developer.mount(files[0], files[1])


async def _image(device: Device, report: Callable[[str, Status, str], None], image_dir: Path | None) -> None:
    name = "developer disk image"
    mounted, image_type = await preflight.image_mounted(device)
    if mounted:
        report(name, "already", f"{image_type} image mounted")
        return
    if mounted is None:
        report(name, "skipped", "the phone offers no image mounter service")
        return
    provider: LockdownServiceProvider = device.lockdown
    if image_dir is not None:
        image_files(image_dir, image_type)  # a wrong folder is the user's input, not the phone's refusal
    elif Version(device.lockdown.product_version) >= CRYPTEX_IMAGE_MIN_VERSION:
        # From there the image installs as a cryptex, which only a tunnel reaches.
        assert device.tunnel is not None
        provider = await device.tunnel.open() or device.lockdown
    try:
        async with device.errors(f"mounting the {image_type} developer disk image"):
            try:
                if image_dir is not None:
                    await _mount_local(device, image_type, image_dir)
                else:
                    await auto_mount(provider)
            # The one-time download, not the phone's link: no answer, or GitHub's refusal (a 5xx, a rate limit).
            except (requests.RequestException, DeveloperDiskImageException) as exc:
                report(name, "blocked", f"download failed: {exc}")
                raise ImageNotMountedError(
                    f"{device.udid}: the {image_type} developer disk image is not mounted: downloading it failed "
                    f"({exc}); {DOWNLOAD_HINT}"
                ) from exc
    except DeviceError as exc:
        cause = exc.__cause__
        if isinstance(cause, pmd3.AlreadyMountedError):
            report(name, "already", f"{image_type} image mounted")
            return
        if isinstance(exc, ImageNotMountedError | DeveloperModeOffError):
            raise
        report(name, "blocked", str(exc))
        hint = f"; {DOWNLOAD_HINT}" if isinstance(cause, pmd3.DeveloperDiskImageNotFoundError) else ""
        raise ImageNotMountedError(
            f"{device.udid}: the {image_type} developer disk image could not be mounted: {exc}{hint}"
        ) from exc
    if provider is not device.lockdown and device.tunnel is not None:
        # The tunnel's service list is the one the phone sent when it opened, before the image brought the
        # developer services: the next step must see a fresh one.
        await device.tunnel.close()
    source = f"from {image_dir}" if image_dir is not None else "with pymobiledevice3's auto_mount"
    report(name, "done", f"{image_type} image mounted {source}")


async def _tunnel(device: Device, report: Callable[[str, Status, str], None]) -> None:
    name = "tunnel"
    tunnel = device.tunnel
    assert tunnel is not None
    if tunnel.kind is None:
        report(name, "blocked", tunnel.plan.reason)
        raise NoTunnelError(f"{device.udid}: no tunnel possible: {tunnel.plan.reason}")
    if not tunnel.needed:
        report(name, "skipped", tunnel.plan.reason)
        return
    rsd = await tunnel.open()
    assert rsd is not None
    services = rsd.peer_info.get("Services", {}) if isinstance(rsd.peer_info, dict) else {}
    if INSTRUMENTS_RSD_SERVICE not in services:
        report(name, "blocked", f"{tunnel.kind} tunnel opened, but the phone lists no instruments service")
        raise ImageNotMountedError(
            f"{device.udid}: the tunnel is up but the instruments service is missing: the developer disk image "
            "is not mounted"
        )
    report(name, "done", f"{tunnel.kind} tunnel opened ({tunnel.plan.reason}); the instruments service is there")
