"""The device layer against the virtual iPhone: the same emulator fixture as tests/virtual (a 16.7 iPhone 15
Pro with a 160 MiB app limit and a 17.4 one on a private usbmuxd socket), driven through kvrig.device."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from kvrig.device import apps
from kvrig.device.discovery import Device, connect
from tests.virtual.conftest import BUNDLE_ID, Emulator, emulator, ipa, make_ipa

__all__ = ["BUNDLE_ID", "Emulator", "emulator", "installed", "ipa", "make_ipa", "on_device", "run"]
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    # A safety net, not a timing check: a real SmolLM2 soak on a loaded 2-core machine takes minutes.
    return asyncio.run(asyncio.wait_for(coro, 900))  # type: ignore[arg-type]


async def on_device(udid: str, job):  # type: ignore[no-untyped-def]
    """Opens a session to `udid`, runs `job(device)` and closes the session."""
    device: Device = await connect(udid)
    async with device:
        return await job(device)


@pytest.fixture(scope="module")
def installed(emulator: Emulator, ipa: Path) -> Emulator:
    run(on_device(emulator.udid, lambda d: apps.install(d, ipa)))
    return emulator
