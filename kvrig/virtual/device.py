"""One virtual iPhone: identity, pairing, state folder, the services lockdownd starts, running apps, faults.

A device belongs to one `UsbmuxServer` (several devices may share one). Service handlers take a `Link` and
run until the client goes away; a handler that meets bad input raises `ProtocolViolation` and only that
connection is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pymobiledevice3.lockdown import SERVICE_PORT as LOCKDOWN_PORT

from kvrig.exceptions import InputError
from kvrig.profiles import INCREASED_MEMORY_LIMIT, load_profile
from kvrig.virtual.apprun import AppRunner
from kvrig.virtual.battery import Battery
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.image_mounter import boot_state, image_mounted, image_type_for, local_image_files
from kvrig.virtual.lockdownd import serve_lockdownd
from kvrig.virtual.logbus import SyslogBus
from kvrig.virtual.pairing import Pairing
from kvrig.virtual.phone import Handler, Link
from kvrig.virtual.services import SERVICES
from kvrig.virtual.state import IOS_BUILDS, DeviceState
from kvrig.virtual.wire import ProtocolViolation, Unplugged

log = logging.getLogger(__name__)

SUPPORTED_IOS = tuple(IOS_BUILDS)
REBOOT_DOWN_S = 1.0  # how long a restarting phone stays off usbmuxd


class Hub(Protocol):
    """The usbmuxd server a device is attached to (usbmuxd.py), as the device sees it."""

    def notify_attached(self, device: VirtualDevice) -> None: ...

    def notify_detached(self, device_id: int) -> None: ...


@dataclass(frozen=True)
class DeviceProfile:
    product_type: str
    marketing_name: str
    limit_bytes: int
    page_size: int
    baseline_bytes: int
    entitled_limit_bytes: int | None = None  # None: the profile does not know it


def _profile_for(ref: str) -> DeviceProfile:
    """The device profile for a ProductType, profile name or profile file: marketing name, limits, page size."""

    profile = load_profile(ref)
    product_type = ref if ref in profile.product_types else profile.product_types[0]
    return DeviceProfile(
        product_type,
        profile.marketing_name,
        profile.limit_default,
        profile.page_size,
        profile.baseline,
        profile.limit_entitled,
    )


class VirtualDevice:
    def __init__(
        self,
        state_dir: str | Path,
        *,
        profile: str = "iPhone16,1",
        ios: str = "16.7",
        limit_bytes: int | None = None,
        baseline_bytes: int | None = None,
        faults: FaultPlan | None = None,
        python: str | None = None,
        background_gpu: bool = True,
        continued_task_s: float | None = None,
    ) -> None:
        if ios not in SUPPORTED_IOS:
            raise InputError(f"unsupported iOS version '{ios}'", field="ios", expected=" or ".join(SUPPORTED_IOS))
        spec = _profile_for(profile)
        self.state, self.identity = DeviceState.open(
            Path(state_dir).resolve(),  # the app runs with its container as cwd: paths must be absolute
            product_type=spec.product_type,
            marketing_name=spec.marketing_name,
            ios=ios,
            limit_bytes=limit_bytes if limit_bytes is not None else spec.limit_bytes,
            page_size=spec.page_size,
        )
        # How usbmuxd lists it: "Network" is a phone a Mac reaches over Wi-Fi only (Finder's Wi-Fi sync).
        self.connection: Literal["USB", "Network"] = "USB"
        # iOS gives an app with the increased-memory-limit entitlement the larger limit where the device has one;
        # a limit given at start (a small one, for a quick soak) is every app's.
        if limit_bytes is not None:
            self.entitled_limit_bytes = limit_bytes
        else:
            self.entitled_limit_bytes = spec.entitled_limit_bytes or spec.limit_bytes
        # The app's footprint before weights and KV: the profile's baseline (the planner uses the same one).
        self.baseline_bytes = baseline_bytes if baseline_bytes is not None else spec.baseline_bytes
        self.pairing = Pairing.load_or_create(self.state.pairing_dir, self.identity.wifi_mac)
        self.syslog = SyslogBus()
        self.services = SERVICES
        self.battery = Battery()
        self.plugged = True
        self._background: set[asyncio.Task[None]] = set()
        developer = self.state.developer()
        fresh = not (self.state.root / "developer.json").exists()

        boot_state(self, developer, fresh=fresh)
        self.state.save_developer(developer)
        self.faults = faults or FaultPlan()
        self.afc_bytes = 0
        self.tunnel_bytes = 0
        # BGTaskScheduler.supportedResources has .gpu (from iOS 26; not every phone has it), and how long a
        # continued-processing task may run in the background before it expires (None: until it completes).
        self.background_gpu = background_gpu
        self.continued_task_s = continued_task_s
        self.rsd_peer_uuid: uuid.UUID | None = None
        self.rsd_reattached = False
        self.device_id = 0
        self.server: Hub | None = None
        self._ports = itertools.count(49152)
        self._pending: dict[int, Handler] = {}
        self._links: set[Link] = set()

        self.apps: AppRunner = AppRunner(self, python=python)

    def app_limit_bytes(self, entitlements: object) -> int:
        """The jetsam limit an app with these entitlements (installation_proxy's `Entitlements`) runs under."""
        if isinstance(entitlements, dict) and entitlements.get(INCREASED_MEMORY_LIMIT) is True:
            return self.entitled_limit_bytes
        return self.identity.limit_bytes

    @property
    def ios_major(self) -> int:
        return int(self.identity.product_version.split(".")[0])

    @property
    def ios_version(self) -> tuple[int, int]:
        major, minor = self.identity.product_version.split(".")[:2]
        return int(major), int(minor)

    @property
    def faults(self) -> FaultPlan:
        return self._faults

    @faults.setter
    def faults(self, plan: FaultPlan) -> None:
        """Faults that are device state (Developer Mode off, image missing) change that state when set; RSD
        reads that state on every handshake and connection, so a tunnel sees the change at once."""
        plan.check(self.identity.product_version)
        self._faults = plan
        self.tunnel_bytes = 0  # a tunnel-drop limit counts from when it was set
        if plan.developer_mode_off or plan.image_missing:
            developer = self.state.developer()
            if plan.developer_mode_off:
                developer.developer_mode = False
            developer.mounted = {}  # Developer Mode off takes the image with it, as its restart does
            self.state.save_developer(developer)

    def developer_ready(self) -> bool:
        developer = self.state.developer()
        mode_ok = developer.developer_mode or self.ios_major < 16

        return mode_ok and image_type_for(self) in developer.mounted

    def schedule_reboot(self, *, come_back: bool = True) -> None:
        """Restarts the phone shortly after the current reply went out: apps die, every connection drops,
        usbmuxd loses it, the developer disk image is unmounted; it comes back after `REBOOT_DOWN_S`."""

        async def reboot() -> None:
            await asyncio.sleep(0.2)
            await self.apps.kill_all()
            await self.unplug()
            developer = self.state.developer()
            developer.mounted = {}
            self.state.save_developer(developer)
            if come_back:
                await asyncio.sleep(REBOOT_DOWN_S)
                await self.replug()

        self.background(reboot())

    def background(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- lifecycle -------------------------------------------------------------------------------------

    def attach(self, server: Hub, device_id: int) -> None:
        self.server, self.device_id = server, device_id

    async def start(self) -> None:
        self.syslog.emit("kernel", f"virtual {self.identity.product_type} iOS {self.identity.product_version} up")

    async def shutdown(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.apps.kill_all()
        self._drop_links()

    def _drop_links(self) -> None:
        for link in list(self._links):
            link.close()
        self._links.clear()
        self._pending.clear()

    async def unplug(self) -> None:
        """Pulls the virtual cable: every open connection drops and usbmuxd reports the device detached."""
        if not self.plugged:
            return
        self.plugged = False
        self.battery.sample(self.apps.processes)
        self.battery.external_connected = False
        self._drop_links()
        if self.server is not None:
            self.server.notify_detached(self.device_id)

    async def replug(self) -> None:
        if self.plugged:
            return
        self.plugged = True
        self.battery.sample(self.apps.processes)
        self.battery.external_connected = True
        self.afc_bytes = 0
        self.faults.unplug_after_afc_bytes = None
        if self.server is not None:
            self.server.notify_attached(self)

    # --- ports and services ----------------------------------------------------------------------------

    def take_port(self, port: int) -> Handler | None:
        if port == LOCKDOWN_PORT:  # pymobiledevice3's lockdown SERVICE_PORT
            return serve_lockdownd
        return self._pending.pop(port, None)

    def open_service(self, name: str) -> tuple[int, bool] | str:
        """Opens a one-shot port for a service; returns (port, ssl) or lockdownd's error string."""
        spec = SERVICES.get(name)
        if spec is None or name in self.faults.refuse_services or self.ios_version < spec.min_ios:
            return "InvalidService"
        if spec.developer and (self.ios_major >= 17 or not self.developer_ready()):
            # iOS 17+ serves developer services only over a RemoteXPC tunnel, never through lockdownd; before
            # that they exist only while the developer disk image is mounted (and, on 16, Developer Mode on).
            return "InvalidService"
        handler = spec.handler
        port = next(self._ports)

        async def run(link: Link) -> None:
            link.counts_afc = spec.counts_afc
            if spec.ssl:
                await link.start_tls()
            await handler(link)

        self._pending[port] = run
        return port, spec.ssl

    async def serve(self, handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer, self)
        self._links.add(link)
        try:
            await handler(link)
        except ProtocolViolation as exc:
            log.info("%s: dropping a connection: %s", self.identity.udid, exc)
        except (Unplugged, ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self._links.discard(link)
            with contextlib.suppress(Exception):
                link.close()

    def status(self) -> dict[str, Any]:
        return {
            "udid": self.identity.udid,
            "product_type": self.identity.product_type,
            "ios": self.identity.product_version,
            "state": str(self.state.root),
            "limit_bytes": self.identity.limit_bytes,
            "entitled_limit_bytes": self.entitled_limit_bytes,
            "plugged": self.plugged,
            "faults": self.faults.to_json(),
            "developer_mode": self.state.developer().developer_mode,
            "image_mounted": image_mounted(self),
            "ddi": {role: str(path) for role, path in local_image_files(self).items()},
            "running": {str(pid): name for pid, name in self.apps.running().items()},
        }
