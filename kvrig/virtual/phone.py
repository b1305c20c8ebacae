"""What a service sees of the phone it runs on: the `Phone` protocol (VirtualDevice implements it), one client
connection (`Link`, which applies the link faults, a slow link or an unplug after N bytes, to every byte a service
sends or receives) and the table entry that says how lockdownd starts a service (`ServiceSpec`).

Services import this module, never the device: the device imports every service (services.py), so imports run
one way."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvrig.virtual.apprun import AppRunner
from kvrig.virtual.battery import Battery
from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.logbus import SyslogBus
from kvrig.virtual.pairing import Pairing
from kvrig.virtual.state import DeviceState, Identity
from kvrig.virtual.wire import MAX_PLIST_FRAME, ProtocolViolation, Unplugged, decode_plist, encode_plist

Handler = Callable[["Link"], Awaitable[None]]


@dataclass(frozen=True)
class ServiceSpec:
    """How lockdownd (and, from iOS 17, the tunnel's RSD) offers one service."""

    handler: Handler
    ssl: bool = False
    developer: bool = False  # needs the image mounted (and Developer Mode); refused without a tunnel on iOS 17+
    counts_afc: bool = False
    min_ios: tuple[int, int] = (0, 0)  # the first iOS release that serves it
    tunnel: bool = False  # opens a tunnel; never offered inside one


class Phone(Protocol):
    state: DeviceState
    identity: Identity
    pairing: Pairing
    syslog: SyslogBus
    battery: Battery
    apps: AppRunner
    baseline_bytes: int
    plugged: bool
    afc_bytes: int
    tunnel_bytes: int
    rsd_peer_uuid: uuid.UUID | None  # the UUID the last RSD handshake presented (remoted keeps it per peer)
    rsd_reattached: bool  # iOS 27.2+: the advertised service listeners are closed until a handshake re-discovers

    @property
    def faults(self) -> FaultPlan: ...

    @property
    def services(self) -> Mapping[str, ServiceSpec]: ...

    @property
    def ios_major(self) -> int: ...

    @property
    def ios_version(self) -> tuple[int, int]: ...

    def developer_ready(self) -> bool: ...

    def schedule_reboot(self, *, come_back: bool = True) -> None: ...

    def open_service(self, name: str) -> tuple[int, bool] | str: ...

    async def serve(self, handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None: ...

    async def unplug(self) -> None: ...


class Link:
    """One service connection of one device: counts bytes for the unplug fault and paces for a slow link."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        device: Phone,
        *,
        counts_afc: bool = False,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.device = device
        self.counts_afc = counts_afc
        self.closed = False

    async def _account(self, n: int) -> None:
        faults = self.device.faults
        if self.counts_afc:
            self.device.afc_bytes += n
            limit = faults.unplug_after_afc_bytes
            if limit is not None and self.device.afc_bytes >= limit:
                await self.device.unplug()
                raise Unplugged()
        if faults.slow_link_bytes_per_s:
            await asyncio.sleep(n / faults.slow_link_bytes_per_s)

    async def recv_exactly(self, n: int) -> bytes:
        if not self.device.plugged:
            raise Unplugged()
        try:
            data = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("client closed the connection") from exc
        await self._account(len(data))
        return data

    async def send(self, data: bytes) -> None:
        if not self.device.plugged:
            raise Unplugged()
        await self._account(len(data))
        self.writer.write(data)
        await self.writer.drain()

    async def recv_plist(self) -> dict[str, Any]:
        (size,) = struct.unpack(">I", await self.recv_exactly(4))
        if size == 0 or size > MAX_PLIST_FRAME:
            raise ProtocolViolation(f"plist frame of {size} bytes")
        return decode_plist(await self.recv_exactly(size))

    async def send_plist(self, obj: dict[str, Any], *, binary: bool = False) -> None:
        await self.send(encode_plist(obj, binary=binary))

    async def start_tls(self) -> None:
        """Upgrades this connection to TLS as the server, presenting the device certificate."""
        await self.writer.start_tls(self.device.pairing.server_ssl_context())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()
