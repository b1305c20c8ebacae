"""What the device log says about one app: the memory limit the phone gave it, and how it ended.

Lines come from syslog_relay as text ("Dec  1 20:40:24 iPhone runningboardd(RunningBoard)[33] <Notice>: ...").
The messages recognised, as real phones print them (iPadOS 26, getdictus/dictus-ios#202; iOS crash logs and
forum threads for the others):

    runningboardd  [DictusKeyboard:6637] Memory Limits: active 90 inactive 90
    kernel         memorystatus: DictusKeyboard [6637] exceeded mem limit: ActiveHard 90 MB (fatal)
    kernel         memorystatus: killing_specific_process pid 6637 [DictusKeyboard] (per-process-limit 100 4s) 92161KB
    ReportSystemMemory  Process DictusKeyboard [6637] killed by jetsam reason per-process-limit
    the app        ... Insufficient Permission (to submit GPU work from background) (00000006:kIOGPUCommand...)
    SpringBoard    [com.app.id] Executing termination ... exceptionCode: "Watchdog Violation (0x8BADF00D)" ...

The limits are in MB as the kernel counts them (memlimit_active/inactive, MiB: xnu multiplies by 1024 * 1024).
Nothing here talks to a phone; the soak driver feeds the lines in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

MIB = 1024 * 1024
MAX_LINES = 200  # lines about one app kept as evidence; a log that says more is repeating itself
MAX_LINE_CHARS = 2000  # of each line kept: a phone's lines are short, and nothing from outside is trusted for size

# syslog_relay's text form: "<Mon dd hh:mm:ss> <device name> <process>[(<library>)][<pid>] <<Level>>: <message>"
_HEADER = re.compile(r"^\w{3}\s+\d+ \d\d:\d\d:\d\d .*? (?P<process>[^\s\[(]+)(?:\([^)]*\))?\[(?P<pid>\d+)\] <\w+>: ")
_LIMITS = re.compile(
    r"\[(?P<name>[^\]]+?):(?P<pid>\d+)\] Memory Limits: active (?P<active>\d+) inactive (?P<inactive>\d+)"
)
_EXCEEDED = re.compile(
    r"memorystatus: (?P<name>.+?) \[(?P<pid>\d+)\] exceeded mem limit: (?P<kind>(?:Active|Inactive)(?:Hard|Soft)) "
    r"(?P<mb>\d+) MB \((?P<fatal>fatal|non-fatal)\)"
)
_KILLING = re.compile(r"killing_specific_process pid (?P<pid>\d+) \[(?P<name>[^\]]+)\] \((?P<reason>[a-z-]+)")
_KILLED_BY_JETSAM = re.compile(r"Process (?P<name>\S+) \[(?P<pid>\d+)\] killed by jetsam reason (?P<reason>[a-z-]+)")
GPU_BACKGROUND = "Insufficient Permission (to submit GPU work from background)"
_WATCHDOG = re.compile(r"0x8badf00d", re.IGNORECASE)

EndKind = Literal["jetsam", "gpu_background", "watchdog"]


@dataclass(frozen=True)
class LogLine:
    process: str
    pid: int
    message: str
    text: str  # the whole line as the phone sent it


def parse_line(text: str) -> LogLine | None:
    """The process, pid and message of a syslog_relay line; None for a line of another shape."""
    match = _HEADER.match(text)
    if match is None:
        return None
    return LogLine(match["process"], int(match["pid"]), text[match.end() :].rstrip("\x00\n"), text.rstrip("\x00\n"))


@dataclass
class AppLog:
    """What the log said about one app (by process name, then by pid once the launch tells it)."""

    process: str
    bundle_id: str | None = None
    pid: int | None = None
    lines: list[str] = field(default_factory=list)  # every line kept about the app, in order
    active_mb: int | None = None
    inactive_mb: int | None = None
    limit_line: str | None = None
    exceeded_kind: str | None = None
    exceeded_mb: int | None = None
    ends: list[tuple[EndKind, str]] = field(default_factory=list)  # (kind, the line that says so), in order

    def mentions(self, text: str) -> bool:
        """A cheap filter for the stream: could this line be about the app?"""
        return self.process in text or (self.bundle_id is not None and self.bundle_id in text)

    def _ours(self, pid: int) -> bool:
        return self.pid is None or pid == self.pid

    def _named(self, name: str) -> bool:
        """The app as a line names it: its executable (the kernel keeps the first 32 characters of a process's
        name, xnu's p_name), or a RunningBoard identity holding its bundle id (`app<dev.kvrig.demo(...)>`)."""
        if name == self.process or (len(name) >= 31 and self.process.startswith(name)):
            return True
        return self.bundle_id is not None and f"<{self.bundle_id}" in name

    def feed(self, text: str) -> None:
        """Looks at one line; keeps it when it says something about the app."""
        if not self.mentions(text) and GPU_BACKGROUND not in text:
            return
        if len(self.lines) >= MAX_LINES:
            return  # what it had to say was said long ago
        text = text[:MAX_LINE_CHARS]
        line = parse_line(text)
        message = line.message if line is not None else text
        kept = False
        if (m := _LIMITS.search(message)) and self._named(m["name"]) and self._ours(int(m["pid"])):
            self.active_mb, self.inactive_mb = int(m["active"]), int(m["inactive"])
            self.limit_line, kept = text.rstrip("\x00\n"), True
        elif (m := _EXCEEDED.search(message)) and self._named(m["name"]) and self._ours(int(m["pid"])):
            self.exceeded_kind, self.exceeded_mb = m["kind"], int(m["mb"])
            if m["fatal"] == "fatal":
                self.ends.append(("jetsam", text.rstrip("\x00\n")))
            kept = True
        elif ((m := _KILLING.search(message)) or (m := _KILLED_BY_JETSAM.search(message))) and (
            self._named(m["name"]) and self._ours(int(m["pid"]))
        ):
            self.ends.append(("jetsam", text.rstrip("\x00\n")))
            kept = True
        elif GPU_BACKGROUND in message and line is not None and line.process == self.process and self._ours(line.pid):
            self.ends.append(("gpu_background", text.rstrip("\x00\n")))
            kept = True
        elif _WATCHDOG.search(message) and (self.bundle_id is not None and self.bundle_id in message):
            self.ends.append(("watchdog", text.rstrip("\x00\n")))
            kept = True
        if kept and len(self.lines) < MAX_LINES:
            self.lines.append(text.rstrip("\x00\n"))

    @property
    def active_bytes(self) -> int | None:
        return None if self.active_mb is None else self.active_mb * MIB

    @property
    def inactive_bytes(self) -> int | None:
        return None if self.inactive_mb is None else self.inactive_mb * MIB

    @property
    def exceeded_bytes(self) -> int | None:
        return None if self.exceeded_mb is None else self.exceeded_mb * MIB

    def end(self, kind: EndKind) -> str | None:
        """The first line that says the app ended this way."""
        return next((line for k, line in self.ends if k == kind), None)
