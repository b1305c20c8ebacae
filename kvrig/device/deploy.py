"""Deploy = install the app (if given) + push the model bundle into its Documents, resumable. Only a bundle with
its manifest is deployed, and only the files the manifest lists (see `files.bundle_files`)."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.bundle.manifest import verify_bundle
from kvrig.device import apps, files
from kvrig.device.discovery import DeviceInfo, connect
from kvrig.exceptions import DeviceLostError, InputError
from kvrig.fileio import plist_dict


@dataclass
class DeployResult:
    device: DeviceInfo
    app_id: str
    installed: bool
    push: files.PushResult

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device.to_json(),
            "app_id": self.app_id,
            "installed": self.installed,
            "push": self.push.to_json(),
        }


def ipa_bundle_id(ipa: Path) -> str:
    """CFBundleIdentifier from an .ipa's Payload/<App>.app/Info.plist (or an unpacked .app folder)."""
    try:
        if ipa.is_dir():
            where, data = ipa / "Info.plist", (ipa / "Info.plist").read_bytes()
        else:
            with zipfile.ZipFile(ipa) as archive:
                name = next(
                    n
                    for n in archive.namelist()
                    if n.startswith("Payload/") and n.count("/") == 2 and n.endswith(".app/Info.plist")
                )
                where, data = Path(f"{ipa}:{name}"), archive.read(name)
    except FileNotFoundError:
        raise InputError("file not found", file=ipa, expected="an .ipa or a .app folder") from None
    except (zipfile.BadZipFile, StopIteration, OSError) as exc:
        reason = "no Payload/<App>.app/Info.plist" if isinstance(exc, StopIteration) else str(exc)
        raise InputError(f"not an app package: {reason}", file=ipa, expected="an .ipa") from None
    info = plist_dict(data, file=where, expected="the app's Info.plist, a dictionary")
    bundle_id = info.get("CFBundleIdentifier")
    if not isinstance(bundle_id, str) or not bundle_id:
        raise InputError("missing", file=ipa, field="CFBundleIdentifier", expected="the app's bundle id")
    return bundle_id


async def deploy(
    bundle: Path,
    *,
    ipa: Path | None = None,
    app_id: str | None = None,
    udid: str | None = None,
    progress: Callable[[files.Progress], None] | None = None,
    usbmux_address: str | None = None,
) -> DeployResult:
    """Installs `ipa` (when given) and pushes `bundle` into the app's Documents on the selected device."""
    if ipa is None and app_id is None:
        raise InputError("nothing to deploy into", expected="an .ipa (--app) or an installed app's id (--app-id)")
    files.deployable(bundle)  # refuse a broken bundle before touching the phone: its folder as the push sends it,
    verify_bundle(bundle)  # and every file's content as `kvrig verify` holds it
    target = ipa_bundle_id(ipa) if ipa is not None else str(app_id)
    if ipa is not None and app_id is not None and app_id != target:  # one of them is not what the user means
        raise InputError(
            f"{ipa} installs {target}, not {app_id}",
            field="--app-id",
            expected="the .ipa's own bundle id, or one of the two",
        )
    device = await connect(udid, usbmux_address=usbmux_address)
    async with device:
        if ipa is not None:
            await apps.install(device, ipa)
        else:
            await apps.get_app(device, target)
        try:
            pushed = await files.push_bundle(device, target, bundle, progress=progress)
        except DeviceLostError as exc:
            raise DeviceLostError(
                f"{exc}; files already on the phone are kept: run the same command again to resume"
            ) from exc
    return DeployResult(device.info, target, ipa is not None, pushed)
