"""syslog_relay: the device log as text lines, for a while."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from pymobiledevice3.services.syslog import SyslogService

from kvrig.device.discovery import Device

RETRY_S = 1.0  # a broken relay is opened again this often while a run lasts


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


class LogFollower:
    """Follows syslog_relay in a task for as long as a run lasts, handing every line to `on_line`.

    Best effort: the log is evidence, never what a run depends on, so a relay that fails (the phone went
    away, a tunnel drop took lockdown with it) is opened again every RETRY_S until the follower is stopped;
    `failed` says why it last broke. Lines logged while it was broken are lost."""

    def __init__(self, device: Device, on_line: Callable[[str], None]) -> None:
        self.device, self.on_line = device, on_line
        self.task: asyncio.Task[None] | None = None
        self.failed: str | None = None
        self._first = asyncio.Event()

    async def start(self, ready_s: float = 2.0) -> None:
        """Starts following; returns once the relay delivered its first line (a phone's log is never quiet for
        long), or after `ready_s`, so lines the next step causes are not missed."""
        self.task = asyncio.create_task(self._follow(), name="kvrig-syslog")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first.wait(), ready_s)

    async def _follow(self) -> None:
        while True:
            try:
                # the device's lockdown as it is now: a reconnect after an unplug replaces it
                async with SyslogService(self.device.lockdown) as relay:
                    async for raw in relay.watch():
                        self._first.set()
                        self.on_line(raw if isinstance(raw, str) else raw.decode(errors="replace"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the relay is evidence only: its failure never fails the run
                self.failed = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(RETRY_S)

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stops following after `drain_s` more seconds (lines the kernel writes just after a kill)."""
        if self.task is None:
            return
        if drain_s > 0 and not self.task.done():
            await asyncio.sleep(drain_s)
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.task = None
