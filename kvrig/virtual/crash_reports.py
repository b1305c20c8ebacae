"""The crash-report services: `com.apple.crashreportcopymobile` serves the CrashReporter store over AFC;
`com.apple.crashreportmover` moves pending reports into that store and answers "ping\\0" when done."""

from __future__ import annotations

import shutil

from kvrig.virtual.afc import AfcRoot, serve_afc
from kvrig.virtual.phone import Link


async def serve_copy_mobile(link: Link) -> None:
    await serve_afc(link, AfcRoot(link.device.state.crash))


async def serve_mover(link: Link) -> None:
    state = link.device.state
    for item in sorted(state.crash_pending.iterdir()):
        shutil.move(str(item), str(state.crash / item.name))
    await link.send(b"ping\0")
