"""Developer Mode (AMFI) and the developer disk image, driven by pymobiledevice3's own services: status through
lockdownd and the mounter, the personalized image mounted from the phone's local files with the manifest the
phone stored (nothing downloads), the shared pre-17 image with its signature, unmount, enabling Developer
Mode through a restart, and the developer services refused while the image is missing."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from pymobiledevice3.exceptions import (
    AlreadyMountedError,
    DeveloperModeIsNotEnabledError,
    InvalidServiceError,
    MissingManifestError,
)
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.amfi import AmfiService
from pymobiledevice3.services.dvt.instruments.dvt_provider import DvtProvider
from pymobiledevice3.services.mobile_image_mounter import (
    DeveloperDiskImageMounter,
    MobileImageMounterService,
    PersonalizedImageMounter,
)

from kvrig.virtual.faults import FaultPlan
from tests.virtual.conftest import Emulator


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _status(udid: str) -> tuple[bool, bool, list[dict]]:
    lockdown = await create_using_usbmux(serial=udid)
    try:
        mode = await lockdown.get_developer_mode_status()
        async with MobileImageMounterService(lockdown) as mounter:
            mounter_mode = await mounter.query_developer_mode_status()
            images = await mounter.list_images()
        return mode, mounter_mode, images
    finally:
        await lockdown.close()


def test_a_fresh_phone_is_prepared(emulator: Emulator) -> None:
    mode, mounter_mode, images = _run(_status(emulator.ios17.identity.udid))
    assert mode is True and mounter_mode is True
    assert [(i["DiskImageType"], i["MountPath"]) for i in images] == [("Personalized", "/System/Developer")]


def test_personalized_image_unmount_and_mount_from_local_files(emulator: Emulator) -> None:
    device = emulator.ios17
    ddi = {role: Path(path) for role, path in device.status()["ddi"].items()}

    async def main() -> tuple[bool, bool]:
        lockdown = await create_using_usbmux(serial=device.identity.udid)
        try:
            async with PersonalizedImageMounter(lockdown) as mounter:
                await mounter.umount()
                unmounted = await mounter.is_image_mounted("Personalized")
            async with PersonalizedImageMounter(lockdown) as mounter:
                # stored manifest found for the image digest: no ticket server is asked
                await mounter.mount(ddi["image"], ddi["build_manifest"], ddi["trust_cache"])
            async with PersonalizedImageMounter(lockdown) as mounter:
                mounted = await mounter.is_image_mounted("Personalized")
                with pytest.raises(AlreadyMountedError):
                    await mounter.mount(ddi["image"], ddi["build_manifest"], ddi["trust_cache"])
            return unmounted, mounted
        finally:
            await lockdown.close()

    assert _run(main()) == (False, True)
    assert device.status()["image_mounted"] is True


def test_an_image_the_phone_has_no_manifest_for(emulator: Emulator) -> None:
    async def main() -> None:
        lockdown = await create_using_usbmux(serial=emulator.ios17.identity.udid)
        try:
            async with PersonalizedImageMounter(lockdown) as mounter:
                digest = hashlib.sha384(b"an image this phone never stored a ticket for").digest()
                await mounter.query_personalization_manifest("DeveloperDiskImage", digest)
        finally:
            await lockdown.close()

    with pytest.raises(MissingManifestError):
        _run(main())


def test_shared_developer_image_on_16(emulator: Emulator) -> None:
    device = emulator.device
    ddi = {role: Path(path) for role, path in device.status()["ddi"].items()}
    assert set(ddi) == {"image", "signature"}

    async def main() -> list[dict]:
        lockdown = await create_using_usbmux(serial=device.identity.udid)
        try:
            async with DeveloperDiskImageMounter(lockdown) as mounter:
                await mounter.umount()
            async with DeveloperDiskImageMounter(lockdown) as mounter:
                await mounter.mount(ddi["image"], ddi["signature"])
                return await mounter.list_images()
        finally:
            await lockdown.close()

    assert [i["DiskImageType"] for i in _run(main())] == ["Developer"]


def test_image_missing_refuses_developer_services_on_16(emulator: Emulator) -> None:
    device = emulator.device
    device.faults = FaultPlan(image_missing=True)
    try:

        async def main() -> None:
            lockdown = await create_using_usbmux(serial=device.identity.udid)
            try:
                async with DvtProvider(lockdown):
                    pass
            finally:
                await lockdown.close()

        with pytest.raises(InvalidServiceError):
            _run(main())
        assert _run(_status(device.identity.udid))[2] == []
    finally:
        device.faults = FaultPlan()
        ddi = {role: Path(path) for role, path in device.status()["ddi"].items()}

        async def remount() -> None:
            lockdown = await create_using_usbmux(serial=device.identity.udid)
            async with DeveloperDiskImageMounter(lockdown) as mounter:
                await mounter.mount(ddi["image"], ddi["signature"])
            await lockdown.close()

        _run(remount())


def test_developer_mode_off_then_enabled_through_a_restart(emulator: Emulator) -> None:
    device = emulator.ios17
    device.faults = FaultPlan(developer_mode_off=True)
    mode, mounter_mode, images = _run(_status(device.identity.udid))
    assert (mode, mounter_mode, images) == (False, False, [])
    ddi = {role: Path(path) for role, path in device.status()["ddi"].items()}

    async def mount() -> None:
        lockdown = await create_using_usbmux(serial=device.identity.udid)
        try:
            async with PersonalizedImageMounter(lockdown) as mounter:
                await mounter.mount(ddi["image"], ddi["build_manifest"], ddi["trust_cache"])
        finally:
            await lockdown.close()

    with pytest.raises(DeveloperModeIsNotEnabledError):
        _run(mount())

    async def enable() -> None:
        lockdown = await create_using_usbmux(serial=device.identity.udid)
        try:
            # pymobiledevice3 holds a heartbeat until the phone restarts, reconnects, then confirms
            await asyncio.wait_for(AmfiService(lockdown).enable_developer_mode(), 60)
        finally:
            await lockdown.close()

    device.faults = FaultPlan()
    _run(enable())
    mode, _, images = _run(_status(device.identity.udid))
    assert mode is True
    assert images == []  # a restart unmounts the image
    _run(mount())
    assert _run(_status(device.identity.udid))[2][0]["DiskImageType"] == "Personalized"
