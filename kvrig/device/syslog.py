"""syslog_relay: the device log as text lines, for a while."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from pymobiledevice3.services.syslog import SyslogService

from kvrig.device.discovery import Device


async def stream(
    device: Device,
    seconds: float,
    *,
    contains: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> list[str]:
    """Lines logged during the next `seconds` (those containing `contains`, if given)."""
    lines: list[str] = []
    deadline = time.monotonic() + seconds

    async def read() -> None:
        async with SyslogService(device.lockdown) as relay:
            async for raw in relay.watch():
                line = raw if isinstance(raw, str) else raw.decode(errors="replace")
                if contains is None or contains in line:
                    lines.append(line)
                    if on_line is not None:
                        on_line(line)
                if time.monotonic() >= deadline:
                    return

    async with device.errors("reading the device log"):
        with contextlib.suppress(TimeoutError):  # the time is up: a quiet log ends here
            await asyncio.wait_for(read(), timeout=max(0.0, seconds))
    return lines
