"""installation_proxy through kvrig.device.apps: install an .ipa built here, list, uninstall, refusals."""

from __future__ import annotations

import plistlib
import zipfile
from pathlib import Path

import pytest

from kvrig.device import apps
from kvrig.device.deploy import deploy, ipa_bundle_id
from kvrig.exceptions import AppError, InputError
from tests.device.conftest import BUNDLE_ID, Emulator, make_ipa, on_device, run


def test_install_list_uninstall(emulator: Emulator, tmp_path: Path) -> None:
    ipa = make_ipa(tmp_path / "Probe.ipa", bundle_id="dev.kvrig.probe", executable="Probe")

    async def job(device):  # type: ignore[no-untyped-def]
        await apps.install(device, ipa)
        listed = await apps.list_apps(device)
        app = await apps.get_app(device, "dev.kvrig.probe")
        await apps.uninstall(device, "dev.kvrig.probe")
        after = await apps.list_apps(device)
        return listed, app, after

    listed, app, after = run(on_device(emulator.udid, job))
    assert "dev.kvrig.probe" in {a.bundle_id for a in listed}
    assert app.executable == "Probe" and app.version == "1.0" and app.path.endswith("/Probe.app")
    assert "dev.kvrig.probe" not in {a.bundle_id for a in after}
    # the emulator's own state agrees
    assert "dev.kvrig.probe" not in emulator.device.state.user_apps()


def test_missing_app_and_bad_package_are_app_errors(emulator: Emulator, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.ipa"
    with zipfile.ZipFile(bogus, "w") as archive:
        archive.writestr("Payload/Broken.app/readme.txt", b"no Info.plist")

    with pytest.raises(AppError, match="not installed"):
        run(on_device(emulator.udid, lambda d: apps.get_app(d, "com.example.absent")))
    with pytest.raises(AppError, match="PackageInspectionFailed"):
        run(on_device(emulator.udid, lambda d: apps.install(d, bogus)))
    with pytest.raises(InputError, match="not found"):
        run(on_device(emulator.udid, lambda d: apps.install(d, tmp_path / "nope.ipa")))


def test_ipa_bundle_id(tmp_path: Path) -> None:
    assert ipa_bundle_id(make_ipa(tmp_path / "A.ipa")) == BUNDLE_ID
    (tmp_path / "junk.ipa").write_bytes(b"not a zip")
    with pytest.raises(InputError, match=r"junk\.ipa.*not an app package"):
        ipa_bundle_id(tmp_path / "junk.ipa")


@pytest.mark.parametrize("info", [b"<?xml version='1.0'?><plist><dict><key>", b"\x00\x01", plistlib.dumps([1, 2])])
def test_an_app_whose_info_plist_is_broken_is_refused_naming_it(tmp_path: Path, info: bytes) -> None:
    """A .app folder or an .ipa with an Info.plist cut short, not a plist, or not a dictionary: InputError naming
    the plist (it was exit 70 for XML cut short and for a plist that is an array)."""
    app = tmp_path / "A.app"
    app.mkdir()
    (app / "Info.plist").write_bytes(info)
    with pytest.raises(InputError) as folder:
        ipa_bundle_id(app)
    assert folder.value.file == str(app / "Info.plist")
    with zipfile.ZipFile(tmp_path / "A.ipa", "w") as archive:
        archive.writestr("Payload/A.app/Info.plist", info)
    with pytest.raises(InputError) as packed:
        ipa_bundle_id(tmp_path / "A.ipa")
    assert packed.value.file == f"{tmp_path / 'A.ipa'}:Payload/A.app/Info.plist"


def test_deploy_refuses_an_app_id_the_ipa_does_not_install(tmp_path: Path) -> None:
    """`--app A.ipa --app-id other` pushed into the .ipa's app and dropped the id without a word; now refused
    before any phone is reached (none is attached here: reaching one would be DeviceNotFoundError)."""
    from tests.device.test_device_files import make_bundle

    ipa = make_ipa(tmp_path / "A.ipa")
    bundle = make_bundle(tmp_path / "b", weight_bytes=1_000)
    with pytest.raises(InputError) as refused:
        run(deploy(bundle, ipa=ipa, app_id="com.example.other", usbmux_address=str(tmp_path / "no.sock")))
    assert refused.value.field == "--app-id" and BUNDLE_ID in str(refused.value)
