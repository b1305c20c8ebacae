"""The device log as a bus: every part of the emulator writes to it (kernel, lockdownd, running apps) and the
relay services (syslog.py) follow it."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

HISTORY = 256
SYSTEM_PIDS = {
    "kernel": 0,
    "launchd": 1,
    "runningboardd": 33,
    "SpringBoard": 34,
    "lockdownd": 61,
    "ReportSystemMemory": 187,
    "osanalyticshelper": 210,
}


@dataclass
class LogLine:
    process: str
    pid: int
    message: str
    level: str = "notice"
    subsystem: str = ""
    category: str = ""
    t: float = field(default_factory=time.time)


class SyslogBus:
    """The phone's log: every part of the emulator emits lines, the relay services follow them."""

    def __init__(self) -> None:
        self.history: collections.deque[LogLine] = collections.deque(maxlen=HISTORY)
        self._subscribers: set[asyncio.Queue[LogLine]] = set()

    def emit(
        self,
        process: str,
        message: str,
        *,
        pid: int | None = None,
        level: str = "notice",
        subsystem: str = "",
    ) -> None:
        line = LogLine(process, SYSTEM_PIDS.get(process, 0) if pid is None else pid, message, level, subsystem)
        self.history.append(line)
        for queue in self._subscribers:
            queue.put_nowait(line)

    def subscribe(self) -> asyncio.Queue[LogLine]:
        queue: asyncio.Queue[LogLine] = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[LogLine]) -> None:
        self._subscribers.discard(queue)

    async def follow(self, queue: asyncio.Queue[LogLine], heartbeat_s: float = 1.0) -> LogLine:
        """Next line; a phone is never silent for long, so SpringBoard reports its idle state meanwhile."""
        try:
            return await asyncio.wait_for(queue.get(), heartbeat_s)
        except TimeoutError:
            line = LogLine("SpringBoard", SYSTEM_PIDS["SpringBoard"], "idle timer tick", "info")
            self.history.append(line)
            return line
