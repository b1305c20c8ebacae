"""DTX process control (the instruments service): launch an app with arguments and environment, look up
its pid, kill it.

Before iOS 17 the instruments service starts from lockdown; from iOS 17 only from RemoteServiceDiscovery in a
tunnel (`device.developer` is whichever the device has: see `tunnel`). Without a tunnel an iOS 17+ phone
refuses the service and we say so (ServiceRefusedError); with one, a missing instruments service means the
developer disk image is not mounted (ImageNotMountedError).

Launches the phone refuses with a process-control NSError (domain com.apple.dt.deviceprocesscontrolservice:
the app is still being installed, the phone is busy) are retried a few times, then reported as LaunchError.
"""

from __future__ import annotations

import asyncio
import contextlib

from pymobiledevice3.dtx.exceptions import DTXNsError
from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControl

from kvrig.device.apps import list_apps
from kvrig.device.discovery import Device
from kvrig.device.errors import TUNNEL_HINT
from kvrig.exceptions import AppError, ImageNotMountedError, LaunchError, ServiceRefusedError

PROCESS_CONTROL_DOMAIN = "com.apple.dt.deviceprocesscontrolservice"
LAUNCH_ATTEMPTS = 3
LAUNCH_RETRY_DELAY_S = 1.0


class Processes:
    """One DTX connection for several calls: `async with Processes(device) as p: pid = await p.launch(...)`."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._dvt: DvtProvider | None = None
        self._control: ProcessControl | None = None

    async def __aenter__(self) -> Processes:
        async with self.device.errors("starting process control"):
            dvt = DvtProvider(self.device.developer)
            try:
                await dvt.__aenter__()
            except Exception as exc:
                raise self._refused(exc) from exc
            self._dvt = dvt
            self._control = ProcessControl(dvt)
            await self._control.__aenter__()
        return self

    def _refused(self, exc: Exception) -> Exception:
        error = self.device.translate(exc, "starting process control")
        if not isinstance(error, ServiceRefusedError):
            return error
        tunnel = self.device.tunnel
        if tunnel is not None and tunnel.rsd is not None:
            return ImageNotMountedError(
                f"starting process control on {self.device.udid}: the phone offers no instruments service, "
                "so the developer disk image is not mounted: run `kvrig prepare`"
            )
        if self.device.info.os_major >= 17 and not error.tunnel_hint:
            return ServiceRefusedError(f"{error}; {TUNNEL_HINT}", tunnel_hint=True)
        return error

    async def __aexit__(self, *exc: object) -> None:
        for closer in (self._control, self._dvt):
            if closer is not None:
                with contextlib.suppress(Exception):  # the link may already be gone
                    await closer.__aexit__(None, None, None)
        self._control = self._dvt = None

    @property
    def _pc(self) -> ProcessControl:
        assert self._control is not None, "use `async with Processes(device)`"
        return self._control

    async def launch(
        self,
        bundle_id: str,
        *,
        arguments: list[str] | None = None,
        environment: dict[str, str] | None = None,
        kill_existing: bool = True,
        attempts: int = LAUNCH_ATTEMPTS,
        retry_delay_s: float = LAUNCH_RETRY_DELAY_S,
    ) -> int:
        """Launches the app and returns its pid; transient process-control refusals are retried."""
        what = f"launching {bundle_id}"
        for attempt in range(1, attempts + 1):
            try:
                pid = await self._pc.launch(
                    bundle_id, arguments=arguments or [], environment=environment or {}, kill_existing=kill_existing
                )
            except AssertionError:  # pymobiledevice3 asserts on a zero pid
                raise LaunchError(f"{what}: the device returned no process id") from None
            except DTXNsError as exc:
                if exc.error.domain != PROCESS_CONTROL_DOMAIN:
                    raise self.device.translate(exc, what) from exc
                await self._require_installed(bundle_id, exc)
                if attempt == attempts:
                    raise LaunchError(
                        f"{what} on {self.device.udid}: process control refused {attempts} times "
                        f"(last: {exc.error.domain} code {exc.error.code}: {_ns_text(exc)})"
                    ) from exc
                await asyncio.sleep(retry_delay_s * attempt)
            except Exception as exc:
                raise self.device.translate(exc, what) from exc
            else:
                return int(pid)
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _require_installed(self, bundle_id: str, refused: DTXNsError) -> None:
        """A refusal for an app that is not installed is final, not transient."""

        if all(app.bundle_id != bundle_id for app in await list_apps(self.device)):
            raise AppError(f"launching {bundle_id}: it is not installed on {self.device.udid} ({_ns_text(refused)})")

    async def pid_for(self, bundle_id: str) -> int:
        """The pid of the running app, 0 if it is not running."""
        async with self.device.errors(f"looking up {bundle_id}"):
            return int(await self._pc.process_identifier_for_bundle_identifier(bundle_id) or 0)

    async def kill(self, pid: int) -> None:
        async with self.device.errors(f"killing pid {pid}"):
            await self._pc.kill(pid)


def _ns_text(exc: DTXNsError) -> str:
    info = exc.error.user_info
    if isinstance(info, dict):
        info = info.get("NSLocalizedDescription") or info.get("NSLocalizedFailureReason")
    return str(info or f"code {exc.error.code}")


async def launch(
    device: Device,
    bundle_id: str,
    *,
    arguments: list[str] | None = None,
    environment: dict[str, str] | None = None,
) -> int:
    async with Processes(device) as processes:
        return await processes.launch(bundle_id, arguments=arguments, environment=environment)


async def pid_for(device: Device, bundle_id: str) -> int:
    async with Processes(device) as processes:
        return await processes.pid_for(bundle_id)


async def kill(device: Device, pid: int) -> None:
    async with Processes(device) as processes:
        await processes.kill(pid)


async def kill_app(device: Device, bundle_id: str) -> int:
    """Kills the app if it runs; returns the pid it had (0: it was not running)."""
    async with Processes(device) as processes:
        pid = await processes.pid_for(bundle_id)
        if pid:
            await processes.kill(pid)
        return pid
