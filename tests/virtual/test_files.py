"""AFC, installation_proxy and house_arrest through pymobiledevice3's library."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pymobiledevice3.exceptions import (
    AfcException,
    AfcFileNotFoundError,
    AppInstallError,
    AppNotInstalledError,
)
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.afc import AfcError, AfcService
from pymobiledevice3.services.house_arrest import HouseArrestService
from pymobiledevice3.services.installation_proxy import InstallationProxyService

from tests.virtual.conftest import BUNDLE_ID, Emulator, make_ipa


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _lockdown(emulator: Emulator):  # type: ignore[no-untyped-def]
    return await create_using_usbmux(serial=emulator.udid)


def test_afc_round_trip_and_listing(emulator: Emulator) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def main() -> tuple[list[str], bytes, dict, list[str]]:
        lockdown = await _lockdown(emulator)
        async with AfcService(lockdown) as afc:
            root = await afc.listdir("/")
            await afc.makedirs("/Downloads/kvrig/deep")
            await afc.set_file_contents("/Downloads/kvrig/deep/blob.bin", payload)
            back = await afc.get_file_contents("/Downloads/kvrig/deep/blob.bin")
            stat = await afc.stat("/Downloads/kvrig/deep/blob.bin")
            await afc.rename("/Downloads/kvrig/deep/blob.bin", "/Downloads/kvrig/blob2.bin")
            listing = await afc.listdir("/Downloads/kvrig")
            await afc.rm("/Downloads/kvrig")
        await lockdown.close()
        return root, back, stat, listing

    root, back, stat, listing = run(main())
    assert {"DCIM", "Downloads", "PublicStaging"} <= set(root)
    assert back == payload
    assert stat["st_size"] == len(payload) and stat["st_ifmt"] == "S_IFREG"
    assert sorted(listing) == ["blob2.bin", "deep"]
    assert not (emulator.device.state.media / "Downloads" / "kvrig").exists()


def test_afc_cannot_leave_its_root(emulator: Emulator) -> None:
    secret = emulator.root / "outside.txt"
    secret.write_text("host file")

    async def main() -> None:
        lockdown = await _lockdown(emulator)
        async with AfcService(lockdown) as afc:
            with pytest.raises(AfcFileNotFoundError):
                await afc.get_file_contents("/../../outside.txt")
            with pytest.raises(AfcFileNotFoundError):
                await afc.stat("../outside.txt")
            # and the connection still works after the refusals
            assert "DCIM" in await afc.listdir("/")
        await lockdown.close()

    run(main())


def test_install_lookup_house_arrest_and_uninstall(emulator: Emulator, ipa: Path) -> None:
    async def main() -> None:
        lockdown = await _lockdown(emulator)
        proxy = InstallationProxyService(lockdown)
        await proxy.install_from_local(ipa)
        apps = await proxy.get_apps(application_type="User")
        assert apps[BUNDLE_ID]["CFBundleExecutable"] == "KVSoak"
        assert apps[BUNDLE_ID]["Path"].endswith("/KVSoak.app")
        assert BUNDLE_ID in {a["CFBundleIdentifier"] for a in await proxy.browse()}

        house = await HouseArrestService.create(lockdown, BUNDLE_ID)
        assert {"Documents", "Library", "tmp"} <= set(await house.listdir("/"))
        await house.set_file_contents("/Documents/kvcache.json", b'{"schema": 1}')
        await house.close()

        documents = await HouseArrestService.create(lockdown, BUNDLE_ID, documents_only=True)
        assert await documents.get_file_contents("/Documents/kvcache.json") == b'{"schema": 1}'
        with pytest.raises(AfcException) as refused:
            await documents.listdir("/Library")
        assert refused.value.status == AfcError.PERM_DENIED
        await documents.close()

        with pytest.raises(AppNotInstalledError):
            await HouseArrestService.create(lockdown, "com.example.not.installed")
        await lockdown.close()

    run(main())
    container = emulator.device.state.containers / BUNDLE_ID
    assert (container / "Documents" / "kvcache.json").read_bytes() == b'{"schema": 1}'


def test_uninstall_removes_app_and_container(emulator: Emulator, tmp_path: Path) -> None:
    other = make_ipa(tmp_path / "Other.ipa", bundle_id="dev.kvrig.other", executable="Other")

    async def main() -> dict:
        lockdown = await _lockdown(emulator)
        proxy = InstallationProxyService(lockdown)
        await proxy.install_from_local(other)
        await proxy.uninstall("dev.kvrig.other")
        apps = await proxy.get_apps(application_type="User")
        await lockdown.close()
        return apps

    assert "dev.kvrig.other" not in run(main())
    assert not (emulator.device.state.containers / "dev.kvrig.other").exists()


def test_bad_package_gets_an_install_error(emulator: Emulator, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.ipa"
    import zipfile

    with zipfile.ZipFile(bogus, "w") as archive:
        archive.writestr("Payload/Broken.app/readme.txt", b"no Info.plist here")

    async def main() -> None:
        lockdown = await _lockdown(emulator)
        try:
            await InstallationProxyService(lockdown).install_from_local(bogus)
        finally:
            await lockdown.close()

    with pytest.raises(AppInstallError, match="PackageInspectionFailed"):
        run(main())
