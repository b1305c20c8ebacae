"""Crash reports (crashreportmover + crashreportcopymobile): flush pending reports into the store, list
them, pull JetsamEvent and crash reports into a local folder.

Report names come from the phone; they are flattened to one clean file name each and never written outside
the output folder (see `paths`). Each report is pulled within its bounds (`files.Bounds`: real reports are
0.1-0.5 MB; the reader refuses more than 64 MiB anyway) and the whole pull within its deadline; an entry that
cannot be pulled (a directory named like a report, a report rotated away between listing and pulling, one too
large or too slow) is skipped with the reason, and the others are still pulled. Only a lost link ends a pull.
"""

from __future__ import annotations

import posixpath
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from pymobiledevice3.services.crash_reports import CrashReportsManager

from kvrig.device.discovery import Device
from kvrig.device.files import Bounds, pull_to_file
from kvrig.device.paths import flat_name, safe_join, taken_names, unique
from kvrig.exceptions import DeviceAnswerError, DeviceFileError
from kvrig.reports.jetsam import MAX_REPORT_BYTES

JETSAM_PATTERN = re.compile(r"^JetsamEvent-.*\.ips(\.synced)?$")
"""A JetsamEvent report's name; `.synced` is added once a computer (Finder, Xcode) has copied the report."""
SYNCED = ".synced"
REPORT = Bounds(MAX_REPORT_BYTES, 30.0)  # one report
MAX_LISTED = 10_000  # entries read from one listing of the store (a phone keeps a few hundred at most)
MAX_PULLED = 64  # reports pulled in one go; newest names first (they carry the date)


@dataclass
class ReportPull:
    pulled: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "<device path>: why", for each report not pulled


MOVER_DONE = b"ping\0"
"""What com.apple.crashreportmover sends once it has filed the pending reports."""


async def flush(device: Device) -> None:
    """Moves reports the phone has written but not yet filed into the store (so a fresh kill shows up)."""
    # Not `crashes.flush()`: pymobiledevice3 leaves the mover's connection to the garbage collector, and a lab
    # flushes once per run. The service name is the manager's (lockdown's or RSD's shim).
    async with (
        device.errors("flushing crash reports"),
        CrashReportsManager(device.lockdown) as crashes,
        await device.lockdown.start_lockdown_service(crashes.crash_mover_service_name) as mover,
    ):
        answer = await mover.recvall(len(MOVER_DONE))
    if answer != MOVER_DONE:
        raise DeviceAnswerError(f"the crash report mover answered {answer!r}, not {MOVER_DONE!r}")


async def list_reports(device: Device, pattern: str | re.Pattern[str] | None = None) -> list[str]:
    """Paths of the reports at the top of the store ("/JetsamEvent-....ips"), optionally by name pattern."""
    match = re.compile(pattern) if isinstance(pattern, str) else pattern
    async with device.errors("listing crash reports"), CrashReportsManager(device.lockdown) as crashes:
        entries = (await crashes.afc.listdir("/"))[:MAX_LISTED]
    names = []
    for entry in entries:
        if posixpath.basename(entry) in ("", ".", ".."):
            continue
        if match is None or match.search(posixpath.basename(entry)):
            names.append("/" + entry.lstrip("/"))
    return sorted(names)


def filed_since(listed: list[str], before: set[str]) -> list[str]:
    """The reports of `listed` that were not in the store at `before`: a report a computer synced meanwhile comes
    back under its `.synced` name, and is not new."""
    return [p for p in listed if p not in before and p.removesuffix(SYNCED) not in before]


async def list_jetsam_reports(device: Device) -> list[str]:
    return await list_reports(device, JETSAM_PATTERN)


async def pull_reports(
    device: Device, paths: list[str], out_dir: str | Path, *, bounds: Bounds = REPORT, timeout_s: float = 120.0
) -> ReportPull:
    """Copies the given reports into `out_dir` under cleaned, unique names, each within `bounds` and all within
    `timeout_s`; what could not be pulled is listed with why."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = ReportPull()
    taken = taken_names(out_dir)
    newest_first = sorted(paths, reverse=True)
    chosen, rest = newest_first[:MAX_PULLED], newest_first[MAX_PULLED:]
    result.skipped += [f"{p}: more than {MAX_PULLED} reports to pull; the newest were pulled" for p in rest]
    deadline = time.monotonic() + timeout_s
    async with device.errors("pulling crash reports"), CrashReportsManager(device.lockdown) as crashes:
        for path in sorted(chosen):
            left = deadline - time.monotonic()
            if left <= 0:
                result.skipped.append(f"{path}: not pulled, the pull's {timeout_s:g} s were spent")
                continue
            target = unique(safe_join(out_dir, flat_name(path)), taken)
            try:
                await pull_to_file(
                    device, crashes.afc, path, target, Bounds(bounds.max_bytes, min(bounds.timeout_s, left))
                )
            except DeviceFileError as exc:
                result.skipped.append(f"{path}: {exc}")
                continue
            result.pulled.append(target)
    return result
