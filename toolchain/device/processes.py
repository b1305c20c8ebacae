"""DTX process control (the instruments service): launch an app with arguments and environment, look up
its pid, kill it.

On iOS 17 and later these developer services are reachable only through a RemoteXPC tunnel, never through
lockdownd; without one the phone refuses the service and we say so (ServiceRefusedError).
"""

from __future__ import annotations

import contextlib

from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.dvt.instruments.process_control import ProcessControl

from toolchain.device.discovery import Device
from toolchain.device.errors import TUNNEL_HINT
from toolchain.exceptions import AppError, ServiceRefusedError


class Processes:
    """One DTX connection for several calls: `async with Processes(device) as p: pid = await p.launch(...)`."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._dvt: DvtProvider | None = None
        self._control: ProcessControl | None = None

    async def __aenter__(self) -> Processes:
        async with self.device.errors("starting process control"):
            dvt = DvtProvider(self.device.lockdown)
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
        if isinstance(error, ServiceRefusedError) and self.device.info.os_major >= 17 and TUNNEL_HINT not in str(error):
            return ServiceRefusedError(f"{error}; {TUNNEL_HINT}")
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
    ) -> int:
        async with self.device.errors(f"launching {bundle_id}"):
            try:
                pid = await self._pc.launch(
                    bundle_id, arguments=arguments or [], environment=environment or {}, kill_existing=kill_existing
                )
            except AssertionError:  # pymobiledevice3 asserts on a zero pid
                raise AppError(f"launching {bundle_id}: the device returned no process id") from None
        return int(pid)

    async def pid_for(self, bundle_id: str) -> int:
        """The pid of the running app, 0 if it is not running."""
        async with self.device.errors(f"looking up {bundle_id}"):
            return int(await self._pc.process_identifier_for_bundle_identifier(bundle_id) or 0)

    async def kill(self, pid: int) -> None:
        async with self.device.errors(f"killing pid {pid}"):
            await self._pc.kill(pid)


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
