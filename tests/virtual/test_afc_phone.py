"""AFC answers as a phone does, for the cases pymobiledevice3's own device test-suite pins on real iPhones:
listing a regular file is a READ_ERROR, making a directory through a file is OBJECT_EXISTS, a path through a
file does not exist, a new empty directory has the APFS size (64), and stat times are the phone's clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
from pymobiledevice3.exceptions import AfcException, AfcFileNotFoundError
from pymobiledevice3.lockdown import create_using_usbmux
from pymobiledevice3.services.afc import AfcError, AfcService

from tests.virtual.conftest import Emulator


def _with_afc(emulator: Emulator, body: Callable[[AfcService], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        lockdown = await create_using_usbmux(serial=emulator.udid)
        try:
            async with AfcService(lockdown) as afc:
                return await body(afc)
        finally:
            await lockdown.close()

    return asyncio.run(main())


def test_listing_a_file_is_a_read_error(emulator: Emulator) -> None:
    async def body(afc: AfcService) -> AfcException:
        await afc.set_file_contents("afc_file", b"data")
        try:
            with pytest.raises(AfcException) as caught:
                await afc.listdir("afc_file")
            return caught.value
        finally:
            await afc.rm("afc_file")

    assert _with_afc(emulator, body).status == AfcError.READ_ERROR


def test_making_a_directory_through_a_file(emulator: Emulator) -> None:
    async def body(afc: AfcService) -> tuple[AfcException, bool, bool]:
        await afc.set_file_contents("afc_file", b"data")
        try:
            with pytest.raises(AfcException) as caught:
                await afc.makedirs("afc_file/sub_folder")
            exists = await afc.exists("afc_file/sub_folder")
            with pytest.raises(AfcFileNotFoundError):
                await afc.stat("afc_file/sub_folder")
            return caught.value, exists, await afc.isdir("afc_file")
        finally:
            await afc.rm("afc_file")

    error, exists, isdir = _with_afc(emulator, body)
    assert error.status == AfcError.OBJECT_EXISTS
    assert not exists and not isdir


@pytest.mark.parametrize("path", ["missing_folder", "/missing/missing_folder/"])
def test_missing_paths(emulator: Emulator, path: str) -> None:
    async def body(afc: AfcService) -> list[AfcException]:
        errors = []
        for call in (afc.listdir, afc.rm, afc.stat):
            with pytest.raises(AfcFileNotFoundError) as caught:
                await call(path)
            errors.append(caught.value)
        return errors

    assert {e.status for e in _with_afc(emulator, body)[:2]} == {AfcError.OBJECT_NOT_FOUND}


def test_stat_fields(emulator: Emulator) -> None:
    async def body(afc: AfcService) -> tuple[datetime, dict, dict]:
        clock = datetime.fromtimestamp(await afc.lockdown.get_value(key="TimeIntervalSince1970"))
        await afc.set_file_contents("afc_file", b"data")
        await afc.makedirs("afc_folder")
        try:
            return clock.replace(microsecond=0), await afc.stat("afc_file"), await afc.stat("afc_folder")
        finally:
            await afc.rm("afc_file")
            await afc.rm("afc_folder")

    clock, file_stat, folder_stat = _with_afc(emulator, body)
    assert (file_stat["st_size"], file_stat["st_ifmt"]) == (4, "S_IFREG")
    assert (folder_stat["st_size"], folder_stat["st_ifmt"]) == (64, "S_IFDIR")
    assert file_stat["st_mtime"] >= clock and folder_stat["st_mtime"] >= clock
    assert file_stat["st_birthtime"] <= file_stat["st_mtime"]


def test_handles_that_were_never_opened(emulator: Emulator) -> None:
    async def body(afc: AfcService) -> list[int]:
        statuses = []
        for call in (lambda: afc.fclose(77), lambda: afc.fread(77, 4), lambda: afc.fwrite(77, b"x")):
            with pytest.raises(AfcException) as caught:
                await call()
            statuses.append(caught.value.status)
        return statuses

    assert _with_afc(emulator, body) == [AfcError.INVALID_ARG] * 3
