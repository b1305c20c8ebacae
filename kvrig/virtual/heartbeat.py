"""com.apple.mobile.heartbeat: the phone sends `{"Command": "Marco"}` and expects `{"Command": "Polo"}`; a
host holds this open to notice the phone going away (a restart, an unplug)."""

from __future__ import annotations

import asyncio

from kvrig.virtual.phone import Link
from kvrig.virtual.wire import ProtocolViolation

INTERVAL_S = 1.0


async def serve_heartbeat(link: Link) -> None:
    while True:
        await link.send_plist({"Command": "Marco", "Interval": INTERVAL_S})
        reply = await link.recv_plist()
        if reply.get("Command") != "Polo":
            raise ProtocolViolation(f"heartbeat answered {reply!r}")
        await asyncio.sleep(INTERVAL_S)
