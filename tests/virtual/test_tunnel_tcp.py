"""The phone's TCP endpoint in a tunnel, for what the end-to-end tests with pymobiledevice3's stack cannot
provoke on a lossless link: a lost segment is sent again, a closed port answers RST, and a port reused
before its old connection closed gets a fresh connection."""

from __future__ import annotations

import asyncio
import ipaddress

from kvrig.virtual.tunnel_tcp import ACK, FIN, PSH, RST, SYN, Segment, TcpEndpoint, build_packet, parse_packet

PHONE, HOST = "fd00::1", "fd00::2"


def _segment(port: int, seq: int, ack: int, flags: int, payload: bytes = b"") -> bytes:
    phone, host = ipaddress.IPv6Address(PHONE).packed, ipaddress.IPv6Address(HOST).packed
    return build_packet(Segment(host, phone, 40000, port, seq, ack, flags, 65535, payload, 1400, 7))


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1000):
        writer.write(data.upper())
        await writer.drain()
    writer.close()


def test_lost_data_is_sent_again_and_closed_ports_reset() -> None:
    async def main() -> tuple[list[Segment], list[Segment], Segment, Segment]:
        out: list[Segment] = []

        async def send(packet: bytes) -> None:
            seg = parse_packet(packet)
            assert seg is not None
            out.append(seg)

        endpoint = TcpEndpoint(PHONE, send, lambda port: _echo if port == 7 else None, mtu=1500)
        await endpoint.on_packet(_segment(7, 1000, 0, SYN))
        synack = out[-1]
        assert synack.flags == SYN | ACK and synack.ack == 1001 and synack.wscale is not None
        await endpoint.on_packet(_segment(7, 1001, synack.seq + 1, ACK))
        await endpoint.on_packet(_segment(7, 1001, synack.seq + 1, ACK | PSH, b"hello"))
        for _ in range(50):
            if any(s.payload for s in out):
                break
            await asyncio.sleep(0.02)
        first = [s for s in out if s.payload]
        out.clear()
        await asyncio.sleep(1.5)  # the host never acknowledged: the echo must come again
        again = [s for s in out if s.payload]
        await endpoint.on_packet(_segment(9, 5000, 0, SYN))  # nobody listens on 9
        reset = out[-1]
        # the same port again with a new sequence: the old connection is dropped, a new one answers
        await endpoint.on_packet(_segment(7, 90000, 0, SYN))
        fresh = out[-1]
        await endpoint.on_packet(_segment(7, 90001, fresh.seq + 1, ACK | FIN))
        endpoint.close()
        return first, again, reset, fresh

    first, again, reset, fresh = asyncio.run(main())
    assert [s.payload for s in first] == [b"HELLO"]
    assert again and again[0].payload == b"HELLO" and again[0].seq == first[0].seq
    assert reset.flags & RST and reset.ack == 5001
    assert fresh.flags == SYN | ACK and fresh.ack == 90001
