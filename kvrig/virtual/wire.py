"""Framing shared by the services: a 4-byte big-endian length then a plist, and a `Link` that applies the
link faults (slow link, unplug after N bytes) to every byte a service sends or receives."""

from __future__ import annotations

import asyncio
import plistlib
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrig.virtual.device import VirtualDevice

MAX_PLIST_FRAME = 16 * 1024 * 1024


class ProtocolViolation(Exception):
    """The client sent bytes that are not the protocol; the device drops that connection."""


class Unplugged(Exception):
    """The virtual cable was pulled while this connection was open."""


def encode_plist(obj: Any, *, binary: bool = False) -> bytes:
    payload = plistlib.dumps(obj, fmt=plistlib.FMT_BINARY if binary else plistlib.FMT_XML)
    return struct.pack(">I", len(payload)) + payload


def decode_plist(data: bytes) -> dict[str, Any]:
    try:
        obj = plistlib.loads(data)
    except Exception as exc:  # plistlib raises several types for garbage
        raise ProtocolViolation(f"not a plist: {data[:32]!r}") from exc
    if not isinstance(obj, dict):
        raise ProtocolViolation("plist root is not a dictionary")
    return obj


class Link:
    """One service connection of one device: counts bytes for the unplug fault and paces for a slow link."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        device: VirtualDevice,
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
