"""installation_proxy: installs .ipa packages staged over AFC, looks up and browses apps, uninstalls.

Replies are binary plists, as the phone sends them. Install reports progress ({"Status", "PercentComplete"})
then {"Status": "Complete"}, or {"Error", "ErrorDescription"} for a package it cannot inspect.
"""

from __future__ import annotations

import plistlib
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from kvrig.virtual.afc import AfcFailure, AfcRoot
from kvrig.virtual.phone import Link

INSTALL_STAGES = (
    ("TakingInstallLock", 5),
    ("CreatingStagingDirectory", 10),
    ("ExtractingPackage", 15),
    ("InspectingPackage", 20),
    ("PreflightingApplication", 30),
    ("VerifyingApplication", 40),
    ("CreatingContainer", 50),
    ("InstallingApplication", 60),
    ("PostflightingApplication", 70),
    ("SandboxingApplication", 80),
    ("GeneratingApplicationMap", 90),
)


class PackageError(Exception):
    pass


def _select(apps: dict[str, dict[str, Any]], options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    app_type = options.get("ApplicationType", "Any")
    wanted = options.get("BundleIDs")
    attributes = options.get("ReturnAttributes")
    result: dict[str, dict[str, Any]] = {}
    for bundle_id, record in apps.items():
        if wanted is not None and bundle_id not in wanted:
            continue
        if app_type not in ("Any", record.get("ApplicationType")):
            continue
        public = {k: v for k, v in record.items() if not k.startswith("_")}
        if attributes:
            public = {k: v for k, v in public.items() if k in attributes}
            if "StaticDiskUsage" in attributes:
                public["StaticDiskUsage"] = 0
            if "DynamicDiskUsage" in attributes:
                public["DynamicDiskUsage"] = 0
        result[bundle_id] = public
    return result


def unpack_ipa(package: Path, into: Path) -> tuple[dict[str, Any], str, Path]:
    """Extracts Payload/X.app; returns (Info.plist, "X.app", extracted app folder). Refuses escaping names."""
    try:
        with zipfile.ZipFile(package) as archive:
            names = archive.namelist()
            apps = {PurePosixPath(n).parts[1] for n in names if n.startswith("Payload/") and n.count("/") >= 2}
            apps = {a for a in apps if a.endswith(".app")}
            if len(apps) != 1:
                raise PackageError("the package must hold exactly one Payload/*.app")
            app_name = apps.pop()
            for member in archive.infolist():
                parts = PurePosixPath(member.filename).parts
                if member.filename.startswith("/") or ".." in parts:
                    raise PackageError(f"unsafe path in package: {member.filename}")
                if parts[:2] != ("Payload", app_name):
                    continue
                target = into.joinpath(*parts[2:]) if len(parts) > 2 else into
                if member.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(member))
    except zipfile.BadZipFile as exc:
        raise PackageError("not a zip archive") from exc
    info_file = into / "Info.plist"
    if not info_file.exists():
        raise PackageError(f"{app_name} has no Info.plist")
    try:
        info = plistlib.loads(info_file.read_bytes())
    except Exception as exc:
        raise PackageError(f"{app_name}/Info.plist is not a plist") from exc
    if not isinstance(info.get("CFBundleIdentifier"), str):
        raise PackageError(f"{app_name}/Info.plist has no CFBundleIdentifier")
    return info, app_name, into


async def serve_installation_proxy(link: Link) -> None:
    device = link.device
    state = device.state

    async def reply(obj: dict[str, Any]) -> None:
        await link.send_plist(obj, binary=True)

    while True:
        request = await link.recv_plist()
        command = request.get("Command")
        options = request.get("ClientOptions") or {}
        if command == "Lookup":
            await reply({"LookupResult": _select(state.all_apps(), options), "Status": "Complete"})
        elif command == "Browse":
            apps = list(_select(state.all_apps(), options).values())
            await reply(
                {
                    "CurrentIndex": 0,
                    "CurrentAmount": len(apps),
                    "Total": len(apps),
                    "CurrentList": apps,
                    "Status": "BrowsingApplications",
                }
            )
            await reply({"Status": "Complete"})
        elif command in ("Install", "Upgrade"):
            try:
                staged = AfcRoot(state.media).host(str(request.get("PackagePath", "")))
                if not staged.is_file():
                    raise PackageError(f"no package at {request.get('PackagePath')}")
                for stage, percent in INSTALL_STAGES[:4]:
                    await reply({"Status": stage, "PercentComplete": percent})
                with tempfile.TemporaryDirectory(dir=state.root) as tmp:
                    info, app_name, unpacked = unpack_ipa(staged, Path(tmp) / "app")
                    await device.apps.kill_bundle(info["CFBundleIdentifier"])
                    for stage, percent in INSTALL_STAGES[4:]:
                        await reply({"Status": stage, "PercentComplete": percent})
                    state.register_app(info, app_name, unpacked)
                device.syslog.emit("installd", f"Installed {info['CFBundleIdentifier']}", pid=95)
                await reply({"Status": "Complete"})
            except (PackageError, AfcFailure) as exc:
                await reply({"Error": "PackageInspectionFailed", "ErrorDescription": str(exc)})
        elif command == "Uninstall":
            bundle_id = str(request.get("ApplicationIdentifier", ""))
            await device.apps.kill_bundle(bundle_id)
            await reply({"Status": "RemovingApplication", "PercentComplete": 50})
            state.remove_app(bundle_id)
            await reply({"Status": "Complete"})
        elif command == "CheckCapabilitiesMatch":
            await reply({"LookupResult": True, "Status": "Complete"})
        else:
            await reply({"Error": "UnknownCommand", "ErrorDescription": f"unknown command {command!r}"})
