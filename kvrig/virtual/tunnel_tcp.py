"""The phone's end of a CoreDeviceProxy tunnel: an IPv6 address that accepts TCP connections.

Inside the tunnel the host sends raw IPv6 packets (pymobiledevice3's userspace stack, pmd-pytcp, or a kernel
utun). This endpoint answers what such a stack needs to reach the phone's services: TCP segments to the
phone's address (SYN / SYN-ACK with an MSS option, in-order data with cumulative ACKs, retransmission of
unacknowledged data after a timeout, FIN in both directions, RST for a port nobody listens on). Everything else
(ICMPv6, MLD, router solicitations, packets for other addresses) is dropped, as it carries nothing a
service needs. Window scaling is answered when the host offers it (pmd-pytcp needs it: it advertises a
4 MiB window); SACK and timestamps are not offered, so the host's stack does not use them.

Each accepted connection is handed to a service handler as an ordinary asyncio stream pair (one end of a
socketpair), so the same service code serves a lockdown port and a tunnel port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

IPV6 = struct.Struct(">IHBB16s16s")
TCP = struct.Struct(">HHIIBBHHH")
NEXT_TCP = 6
FIN, SYN, RST, PSH, ACK = 0x01, 0x02, 0x04, 0x08, 0x10
WINDOW = 65535
DEFAULT_MSS = 1220  # IPv6 minimum MTU less headers, until the SYN names one
RTO_S = 0.5
OWN_WSCALE = 6  # our advertised 65535 then means 4 MiB: service data is buffered, never refused
HOP_LIMIT = 64

# A service: gets the stream pair of one accepted connection.
Accept = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f">{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _seq_lt(a: int, b: int) -> bool:
    return ((a - b) & 0xFFFFFFFF) > 0x7FFFFFFF


@dataclass
class Segment:
    src: bytes
    dst: bytes
    src_port: int
    dst_port: int
    seq: int
    ack: int
    flags: int
    window: int
    payload: bytes
    mss: int | None = None
    wscale: int | None = None


def parse_packet(packet: bytes) -> Segment | None:
    """A TCP segment inside an IPv6 packet, or None for anything else."""
    if len(packet) < IPV6.size or packet[0] >> 4 != 6:
        return None
    _vtf, length, next_header, _hops, src, dst = IPV6.unpack_from(packet)
    if next_header != NEXT_TCP or len(packet) < IPV6.size + length or length < TCP.size:
        return None
    tcp = packet[IPV6.size : IPV6.size + length]
    src_port, dst_port, seq, ack, offset, flags, window, _sum, _urg = TCP.unpack_from(tcp)
    header_len = (offset >> 4) * 4
    if header_len < TCP.size or header_len > len(tcp):
        return None
    mss = wscale = None
    options, i = tcp[TCP.size : header_len], 0
    while i < len(options):
        kind = options[i]
        if kind == 0:
            break
        if kind == 1:
            i += 1
            continue
        if i + 1 >= len(options) or options[i + 1] < 2:
            break
        if kind == 2 and options[i + 1] == 4:
            (mss,) = struct.unpack_from(">H", options, i + 2)
        elif kind == 3 and options[i + 1] == 3:
            wscale = min(options[i + 2], 14)
        i += options[i + 1]
    return Segment(src, dst, src_port, dst_port, seq, ack, flags, window, tcp[header_len:], mss, wscale)


def build_packet(seg: Segment) -> bytes:
    options = struct.pack(">BBH", 2, 4, seg.mss) if seg.mss else b""
    if seg.wscale is not None:
        options += struct.pack(">BBBB", 1, 3, 3, seg.wscale)  # NOP + window scale: 4-byte aligned
    header_len = TCP.size + len(options)
    tcp = TCP.pack(seg.src_port, seg.dst_port, seg.seq, seg.ack, (header_len // 4) << 4, seg.flags, seg.window, 0, 0)
    tcp += options + seg.payload
    pseudo = seg.src + seg.dst + struct.pack(">IxxxB", len(tcp), NEXT_TCP)
    tcp = tcp[:16] + struct.pack(">H", _checksum(pseudo + tcp)) + tcp[18:]
    return IPV6.pack(6 << 28, len(tcp), NEXT_TCP, HOP_LIMIT, seg.src, seg.dst) + tcp


@dataclass
class Connection:
    endpoint: TcpEndpoint
    peer: bytes
    peer_port: int
    port: int
    rcv_nxt: int
    mss: int
    peer_wscale: int | None = None  # the host's window scale, when it offered scaling
    iss: int = field(default_factory=lambda: secrets.randbits(32))
    snd_una: int = 0
    snd_nxt: int = 0
    snd_wnd: int = WINDOW
    unacked: bytearray = field(default_factory=bytearray)  # bytes from snd_una, sent or not yet sent
    established: bool = False
    fin_received: bool = False
    fin_sent: bool = False
    local_eof: bool = False
    closed: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.snd_una = self.snd_nxt = self.iss

    @property
    def key(self) -> tuple[bytes, int, int]:
        return self.peer, self.peer_port, self.port

    def segment(self, flags: int, seq: int, payload: bytes = b"", *, syn: bool = False) -> Segment:
        seg = Segment(
            self.endpoint.address, self.peer, self.port, self.peer_port, seq, self.rcv_nxt, flags, WINDOW, payload
        )
        if syn:
            seg.mss = self.endpoint.mss
            # A non-zero shift, as a phone offers (pmd-pytcp takes a zero shift for "no scaling").
            seg.wscale = OWN_WSCALE if self.peer_wscale is not None else None
        return seg

    async def emit(self, flags: int, seq: int, payload: bytes = b"", *, syn: bool = False) -> None:
        await self.endpoint.send(build_packet(self.segment(flags, seq, payload, syn=syn)))

    # --- from the host ------------------------------------------------------------------------------

    async def on_segment(self, seg: Segment) -> None:
        if seg.flags & RST:
            self.close()
            return
        if seg.flags & SYN:
            # A retransmitted SYN: our SYN-ACK was lost; say it again.
            await self.emit(SYN | ACK, self.iss, syn=True)
            return
        if seg.flags & ACK:
            self.on_ack(seg)
        if not self.established:
            return
        accepted = False
        if seg.payload or seg.flags & FIN:
            offset = (self.rcv_nxt - seg.seq) & 0xFFFFFFFF
            if _seq_lt(self.rcv_nxt, seg.seq):
                pass  # a gap (a packet lost on the way): keep ACKing rcv_nxt until the host resends
            elif offset <= len(seg.payload):
                data = seg.payload[offset:]
                if data and self.writer is not None and not self.fin_received:
                    self.writer.write(data)
                    self.rcv_nxt = (self.rcv_nxt + len(data)) & 0xFFFFFFFF
                    accepted = True
                if seg.flags & FIN and not self.fin_received:
                    self.fin_received = True
                    self.rcv_nxt = (self.rcv_nxt + 1) & 0xFFFFFFFF
                    if self.writer is not None and self.writer.can_write_eof():
                        with contextlib.suppress(OSError):
                            self.writer.write_eof()
            await self.emit(ACK, self.snd_nxt)
        if accepted or seg.flags & ACK:
            self.wake.set()
        self.maybe_finished()

    def on_ack(self, seg: Segment) -> None:
        acked = (seg.ack - self.snd_una) & 0xFFFFFFFF
        in_flight = (self.snd_nxt - self.snd_una) & 0xFFFFFFFF
        self.snd_wnd = seg.window << (self.peer_wscale or 0)
        if acked == 0 or acked > in_flight:
            return
        if not self.established:
            self.established = True
            acked -= 1  # our SYN
        data_acked = min(acked, len(self.unacked))
        del self.unacked[:data_acked]
        self.snd_una = seg.ack
        self.last_progress = time.monotonic()
        self.wake.set()

    # --- to the host --------------------------------------------------------------------------------

    async def pump_out(self) -> None:
        """Moves what the service writes into segments, within the host's window; retransmits on timeout."""
        assert self.reader is not None
        read_task: asyncio.Task[bytes] | None = None
        try:
            while not self.closed:
                if read_task is None and not self.local_eof and len(self.unacked) < 4 * WINDOW:
                    read_task = asyncio.ensure_future(self.reader.read(65536))
                waiter = asyncio.ensure_future(self.wake.wait())
                waits: set[asyncio.Future[object]] = {waiter}  # type: ignore[arg-type]
                if read_task is not None:
                    waits.add(read_task)  # type: ignore[arg-type]
                done, _ = await asyncio.wait(waits, timeout=RTO_S, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                self.wake.clear()
                if read_task is not None and read_task in done:
                    chunk = read_task.result()
                    read_task = None
                    if chunk:
                        self.unacked += chunk
                    else:
                        self.local_eof = True
                await self.transmit(retransmit=not done and bool(self.in_flight()))
                self.maybe_finished()
        finally:
            if read_task is not None:
                read_task.cancel()

    def in_flight(self) -> int:
        return (self.snd_nxt - self.snd_una) & 0xFFFFFFFF

    async def transmit(self, *, retransmit: bool = False) -> None:
        if not self.established:
            return
        if retransmit and time.monotonic() - self.last_progress >= RTO_S:
            # go back to the first unacknowledged byte (the host dropped something)
            self.snd_nxt = self.snd_una
            self.fin_sent = False
            self.last_progress = time.monotonic()
        while True:
            sent = (self.snd_nxt - self.snd_una) & 0xFFFFFFFF
            if self.fin_sent:
                return
            pending = len(self.unacked) - sent
            room = self.snd_wnd - sent
            if pending > 0 and room > 0:
                size = min(pending, room, self.mss)
                await self.emit(ACK | PSH, self.snd_nxt, bytes(self.unacked[sent : sent + size]))
                self.snd_nxt = (self.snd_nxt + size) & 0xFFFFFFFF
                continue
            if pending == 0 and self.local_eof:
                await self.emit(FIN | ACK, self.snd_nxt)
                self.snd_nxt = (self.snd_nxt + 1) & 0xFFFFFFFF
                self.fin_sent = True
            return

    def maybe_finished(self) -> None:
        if self.fin_received and self.fin_sent and self.snd_una == self.snd_nxt:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.wake.set()
        if self.writer is not None:
            self.writer.close()
        self.endpoint.forget(self)


class TcpEndpoint:
    """The phone's address in one tunnel, with its listening ports."""

    def __init__(
        self,
        address: str,
        send: Callable[[bytes], Awaitable[None]],
        listeners: Callable[[int], Accept | None],
        *,
        mtu: int,
    ) -> None:
        self.address = ipaddress.IPv6Address(address).packed
        self._send = send
        self.listeners = listeners
        self.mss = mtu - IPV6.size - TCP.size
        self.connections: dict[tuple[bytes, int, int], Connection] = {}
        self._send_lock = asyncio.Lock()
        self._service_tasks: set[asyncio.Task[None]] = set()

    async def send(self, packet: bytes) -> None:
        async with self._send_lock:
            await self._send(packet)

    async def on_packet(self, packet: bytes) -> None:
        seg = parse_packet(packet)
        if seg is None or seg.dst != self.address:
            return
        connection = self.connections.get((seg.src, seg.src_port, seg.dst_port))
        if connection is not None and seg.flags & SYN and (seg.seq + 1) & 0xFFFFFFFF != connection.rcv_nxt:
            connection.close()  # a new connection from a port whose old one was never closed
            connection = None
        if connection is not None:
            await connection.on_segment(seg)
            return
        if seg.flags & RST:
            return
        accept = self.listeners(seg.dst_port) if seg.flags & SYN and not seg.flags & ACK else None
        if accept is None:
            # nobody listens (or a segment for a connection long gone): reset, as a phone's kernel does
            ack = (seg.seq + len(seg.payload) + (1 if seg.flags & (SYN | FIN) else 0)) & 0xFFFFFFFF
            seq = seg.ack if seg.flags & ACK else 0
            rst = Segment(self.address, seg.src, seg.dst_port, seg.src_port, seq, ack, RST | ACK, 0, b"")
            await self.send(build_packet(rst))
            return
        await self.open(seg, accept)

    async def open(self, syn: Segment, accept: Accept) -> None:
        mss = min(syn.mss or DEFAULT_MSS, self.mss)
        connection = Connection(self, syn.src, syn.src_port, syn.dst_port, (syn.seq + 1) & 0xFFFFFFFF, mss, syn.wscale)
        connection.snd_nxt = (connection.iss + 1) & 0xFFFFFFFF
        connection.snd_wnd = syn.window  # a SYN's window is never scaled
        ours, theirs = socket.socketpair()
        connection.reader, connection.writer = await asyncio.open_connection(sock=ours)
        service_reader, service_writer = await asyncio.open_connection(sock=theirs)
        self.connections[connection.key] = connection
        connection.tasks.append(asyncio.ensure_future(connection.pump_out()))
        task = asyncio.ensure_future(accept(service_reader, service_writer))
        self._service_tasks.add(task)
        task.add_done_callback(self._service_tasks.discard)
        await connection.emit(SYN | ACK, connection.iss, syn=True)

    def forget(self, connection: Connection) -> None:
        self.connections.pop(connection.key, None)
        for task in connection.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def close(self) -> None:
        for connection in list(self.connections.values()):
            connection.close()
        for task in list(self._service_tasks):
            task.cancel()
