"""One phone, ready for developer services: lockdown session, preflight, tunnel (iOS 17+), held together.

The device-level API a soak or a lab worker calls:

    async with open_session(udid, tunnel="auto") as device:
        ...  # device.developer is the RSD (iOS 17+) or lockdown; device.tunnel.plan says which tunnel and why

The userspace tunnel is one per process, so a lab with several iOS 17+ phones opens one session per worker
process (one phone each).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kvrig.device import preflight
from kvrig.device.discovery import Device, connect
from kvrig.device.tunnel import HANDSHAKE_TIMEOUT_S, Tunnel, TunnelMode


@contextlib.asynccontextmanager
async def open_session(
    udid: str | None = None,
    *,
    tunnel: TunnelMode | str | None = None,
    usbmux_address: str | None = None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    check: bool = True,
) -> AsyncIterator[Device]:
    """Connects, runs the preflight (raising its first blocking cause unless `check` is False) and opens the
    tunnel the preflight chose; closes everything on exit."""
    device = await connect(udid, usbmux_address=usbmux_address)
    async with device:
        report = await preflight.check(device, tunnel)
        if check:
            report.raise_first()
        assert report.tunnel is not None
        device.tunnel = Tunnel(
            device.udid,
            report.tunnel,
            os_version=device.info.os_version,
            usbmux_address=usbmux_address,
            handshake_timeout_s=handshake_timeout_s,
        )
        if report.tunnel.kind is not None:
            await device.tunnel.open()
        yield device
