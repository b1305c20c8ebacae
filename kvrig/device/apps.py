"""installation_proxy: install an .ipa, list user apps, uninstall."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pymobiledevice3.services.installation_proxy import InstallationProxyService

from kvrig.compat import pymobiledevice3_install_bars as install_bars
from kvrig.device.discovery import Device
from kvrig.exceptions import AppError, InputError
from kvrig.profiles import INCREASED_MEMORY_LIMIT
from kvrig.schemas.keys import COREML_MODEL_KEY, VIRTUAL_RUNTIME_KEY

# Whether installs draw pymobiledevice3's upload and install bars (`kvrig -q` hides them).
INSTALL_BARS = install_bars.INSTALL_BARS


@dataclass(frozen=True)
class AppInfo:
    bundle_id: str
    executable: str  # the process name in jetsam reports and the device log
    version: str | None
    path: str | None
    coreml_model: str | None = None  # the Core ML program the app ships (Info.plist KvrigCoreMLModel)
    virtual_runtime: str | None = None  # the host runtime a virtual-iPhone app runs (KvrigVirtualRuntime)
    # The increased-memory-limit entitlement, as installation_proxy lists the app's signed entitlements;
    # None: the phone listed none (it says nothing, so neither do we).
    entitled: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _app(bundle_id: str, record: dict[str, Any]) -> AppInfo:
    entitlements = record.get("Entitlements")
    return AppInfo(
        bundle_id=bundle_id,
        executable=str(record.get("CFBundleExecutable") or bundle_id.rsplit(".", 1)[-1]),
        version=record.get("CFBundleShortVersionString"),
        path=record.get("Path"),
        coreml_model=record.get(COREML_MODEL_KEY),
        virtual_runtime=record.get(VIRTUAL_RUNTIME_KEY),
        entitled=entitlements.get(INCREASED_MEMORY_LIMIT) is True if isinstance(entitlements, dict) else None,
    )


async def install(device: Device, ipa: str | Path) -> None:
    """Installs (or upgrades, keeping its data container) an .ipa or an unpacked .app folder."""
    ipa = Path(ipa)
    if not ipa.exists():
        raise InputError("file not found", file=ipa, expected="an .ipa or a .app folder")
    async with device.errors(f"installing {ipa.name}"), InstallationProxyService(device.lockdown) as proxy:
        await proxy.install_from_local(ipa)


async def list_apps(device: Device) -> list[AppInfo]:
    async with device.errors("listing apps"), InstallationProxyService(device.lockdown) as proxy:
        apps = await proxy.get_apps(application_type="User")
    return sorted((_app(bid, rec) for bid, rec in apps.items()), key=lambda a: a.bundle_id)


async def get_app(device: Device, bundle_id: str) -> AppInfo:
    """The installed app with this bundle id, or AppError naming the installed ones."""
    apps = await list_apps(device)
    for app in apps:
        if app.bundle_id == bundle_id:
            return app
    installed = ", ".join(a.bundle_id for a in apps) or "no user apps"
    raise AppError(f"{bundle_id} is not installed on {device.udid} (installed: {installed})")


async def uninstall(device: Device, bundle_id: str) -> None:
    async with device.errors(f"uninstalling {bundle_id}"), InstallationProxyService(device.lockdown) as proxy:
        await proxy.uninstall(bundle_id)
