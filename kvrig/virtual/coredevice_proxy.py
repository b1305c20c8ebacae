"""com.apple.internal.devicecompute.CoreDeviceProxy (iOS 17.4+): a tunnel over lockdown, without root.

Over the service's TLS connection the host sends a CDTunnel handshake (`CDTunnel` magic, a big-endian 16-bit
length, JSON `{"type": "clientHandshakeRequest", "mtu": N}`); the phone answers with the addresses of both
ends of the tunnel, the MTU and its RSD port. From then on the connection carries raw IPv6 packets, each
delimited by its own header's payload length. The phone's end is a `TcpEndpoint`: the RSD port and the ports
RSD lists accept TCP connections, served by the same service code as lockdown ports. 17.0–17.3 phones do not
have this service (lockdownd refuses it), as real ones do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import struct

from pymobiledevice3.remote.remote_service_discovery import RSD_PORT
from pymobiledevice3.remote.tunnel_service import CDTUNNEL_MAGIC, CDTunnelPacket

from kvrig.virtual.phone import Link, Phone
from kvrig.virtual.rsd import serve_rsd, service_at
from kvrig.virtual.tunnel_tcp import Accept, TcpEndpoint
from kvrig.virtual.wire import ProtocolViolation

MAX_MTU = 16000
MIN_MTU = 1280
IPV6_HEADER = 40
NETMASK = "ffff:ffff:ffff:ffff::"


def tunnel_addresses(device: Phone) -> tuple[str, str]:
    """(phone, host) addresses in a unique-local /64 derived from the phone's ECID."""
    prefix = hashlib.sha256(device.identity.ecid.to_bytes(8, "little")).digest()[:7]
    network = int.from_bytes(b"\xfd" + prefix, "big") << 64
    return str(ipaddress.IPv6Address(network | 1)), str(ipaddress.IPv6Address(network | 2))


async def serve_coredevice_proxy(link: Link) -> None:
    device = link.device
    header = await link.recv_exactly(len(CDTUNNEL_MAGIC) + 2)
    if not header.startswith(CDTUNNEL_MAGIC):
        raise ProtocolViolation("not a CDTunnel handshake")
    (size,) = struct.unpack(">H", header[-2:])
    try:
        request = json.loads(await link.recv_exactly(size))
    except ValueError as exc:
        raise ProtocolViolation("CDTunnel handshake is not JSON") from exc
    if request.get("type") != "clientHandshakeRequest":
        raise ProtocolViolation(f"unexpected CDTunnel message {request.get('type')!r}")
    if device.faults.handshake_timeout:
        # The fault: the phone took the connection and never answers; the host has to give up by itself.
        while await link.reader.read(65536):
            pass
        return
    mtu = max(MIN_MTU, min(int(request.get("mtu", MIN_MTU)), MAX_MTU))
    phone, host = tunnel_addresses(device)
    response = {
        "type": "serverHandshakeResponse",
        "clientParameters": {"address": host, "netmask": NETMASK, "mtu": mtu},
        "serverAddress": phone,
        "serverRSDPort": RSD_PORT,
    }
    await link.send(CDTunnelPacket(body=json.dumps(response).encode()).build())
    device.syslog.emit("remoted", f"tunnel up: {phone} <-> {host} mtu {mtu}")
    await Tunnel(link, phone, mtu).run()


class Tunnel:
    def __init__(self, link: Link, phone: str, mtu: int) -> None:
        self.link = link
        self.device = link.device
        self.endpoint = TcpEndpoint(phone, self.send, self.listener, mtu=mtu)

    def listener(self, port: int) -> Accept | None:
        handler = serve_rsd if port == RSD_PORT else service_at(self.device, port)
        if handler is None:
            return None

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self.device.serve(handler, reader, writer)

        return accept

    def _count(self, n: int) -> bool:
        """Counts tunnel bytes for the drop fault; False once the tunnel has been dropped."""
        if self.link.closed:
            return False
        self.device.tunnel_bytes += n
        limit = self.device.faults.tunnel_drop_after_bytes
        if limit is not None and self.device.tunnel_bytes >= limit:
            self.device.syslog.emit("remoted", "tunnel dropped", level="error")
            self.link.close()
            return False
        return True

    async def send(self, packet: bytes) -> None:
        if self._count(len(packet)):
            await self.link.send(packet)

    async def run(self) -> None:
        try:
            while True:
                header = await self.link.recv_exactly(IPV6_HEADER)
                (length,) = struct.unpack_from(">H", header, 4)
                packet = header + await self.link.recv_exactly(length)
                if not self._count(len(packet)):
                    return
                await self.endpoint.on_packet(packet)
        finally:
            self.endpoint.close()
            with contextlib.suppress(Exception):
                self.link.close()
