"""Crash reports (crashreportmover + crashreportcopymobile): flush pending reports into the store, list
them, pull JetsamEvent and crash reports into a local folder.

Report names come from the phone; they are flattened to one clean file name each and never written outside
the output folder (see `paths`).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from pymobiledevice3.services.crash_reports import CrashReportsManager

from kvrig.device.discovery import Device
from kvrig.device.paths import flat_name, safe_join, unique, write_new_file

JETSAM_PATTERN = re.compile(r"^JetsamEvent-.*\.ips$")


async def flush(device: Device) -> None:
    """Moves reports the phone has written but not yet filed into the store (so a fresh kill shows up)."""
    async with device.errors("flushing crash reports"), CrashReportsManager(device.lockdown) as crashes:
        await crashes.flush()


async def list_reports(device: Device, pattern: str | re.Pattern[str] | None = None) -> list[str]:
    """Paths of the reports at the top of the store ("/JetsamEvent-....ips"), optionally by name pattern."""
    match = re.compile(pattern) if isinstance(pattern, str) else pattern
    async with device.errors("listing crash reports"), CrashReportsManager(device.lockdown) as crashes:
        entries = await crashes.ls("/", depth=1)
    names = []
    for entry in entries:
        if posixpath.basename(entry) in ("", ".", ".."):
            continue
        if match is None or match.search(posixpath.basename(entry)):
            names.append(entry)
    return sorted(names)


async def list_jetsam_reports(device: Device) -> list[str]:
    return await list_reports(device, JETSAM_PATTERN)


async def pull_reports(device: Device, paths: list[str], out_dir: str | Path) -> list[Path]:
    """Copies the given reports into `out_dir` under cleaned, unique names; returns the local paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pulled: list[Path] = []
    taken: set[Path] = set()
    async with device.errors("pulling crash reports"), CrashReportsManager(device.lockdown) as crashes:
        for path in paths:
            data = await crashes.afc.get_file_contents(path)
            target = unique(safe_join(out_dir, flat_name(path)), taken)
            write_new_file(target, data)
            pulled.append(target)
    return pulled


async def pull_new_jetsam_reports(device: Device, before: set[str], out_dir: str | Path) -> list[Path]:
    """Flushes, then pulls the JetsamEvent reports that were not in `before` (a listing taken earlier)."""
    await flush(device)
    new = [p for p in await list_jetsam_reports(device) if p not in before]
    return await pull_reports(device, new, out_dir)
