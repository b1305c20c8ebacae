"""What a virtual device keeps across restarts, all inside its state folder:

device.json            identity (UDID, ProductType, iOS version, limit)
pairing/               the pair record and certificates (see `pairing`)
media/                 what AFC serves (/var/mobile/Media on a phone)
apps.json, apps/<id>/  installed app bundles and their Info.plist attributes
containers/<id>/       each app's data container: Documents, Library, tmp
crash/                 CrashReporter store served by crashreportcopymobile
crash_pending/         reports not yet moved; crashreportmover moves them into crash/
developer.json         Developer Mode, the mounted developer disk image, stored personalization manifests
ddi/                   the developer disk image files a host mounts this phone with (see `image_mounter`)
"""

from __future__ import annotations

import json
import secrets
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrig.appgen.entitlements import app_entitlements
from kvrig.exceptions import InputError
from kvrig.fileio import read_data

# ProductVersion -> BuildVersion of the releases the emulator imitates. iOS 27 from AppleDB's records
# (littlebyteorg/appledb, osFiles/iOS/24x - 27.x): 27.0.1 is 24A446 (released 2026-09-28); 24B5099f is the 27.2
# build of the third 27.2 seed (2026-10-05), the newest 27.x those records list, and the release whose remoted
# re-attaches on a changed RSD handshake UUID (see `rsd.REATTACH_FROM`).
IOS_BUILDS = {
    "16.7": "20H19",
    "17.0": "21A329",
    "17.4": "21E219",
    "18.6": "22G86",
    "26.1": "23B85",
    "27.0.1": "24A446",
    "27.2": "24B5099f",
}
# ProductType -> (HardwareModel, ChipID); the UDID of A12-and-later phones is "<ChipID:08X>-<ECID:016X>".
HARDWARE = {
    "iPhone16,1": ("D83AP", 0x8130),
    "iPhone16,2": ("D84AP", 0x8130),
    "iPhone15,2": ("D73AP", 0x8120),
    "iPhone15,3": ("D74AP", 0x8120),
    "iPhone14,2": ("D63AP", 0x8110),
    "iPhone13,2": ("D53gAP", 0x8101),
}
SYSTEM_APPS = {
    "com.apple.mobilesafari": ("Safari", "MobileSafari"),
    "com.apple.Preferences": ("Settings", "Preferences"),
}
CONTAINER_DIRS = ("Documents", "Library", "Library/Caches", "Library/Preferences", "tmp")
MEDIA_DIRS = ("DCIM", "Downloads", "Books", "PublicStaging")


@dataclass
class Identity:
    udid: str
    serial_number: str
    product_type: str
    marketing_name: str
    product_version: str
    build_version: str
    hardware_model: str
    chip_id: int
    ecid: int
    device_name: str
    wifi_mac: str
    limit_bytes: int
    page_size: int


@dataclass
class DeveloperState:
    """A phone prepared for development, by default: Developer Mode on and the image mounted (the faults
    `developer_mode_off` and `image_missing` take either away; AMFI and the mounter bring them back)."""

    developer_mode: bool = True
    # ImageType -> hex of the signature (or personalization manifest) it was mounted with
    mounted: dict[str, str] = field(default_factory=dict)
    # hex sha384 of an image -> hex of the personalization manifest this phone stored for it
    manifests: dict[str, str] = field(default_factory=dict)


class DeviceState:
    """The state folder of one virtual device."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.media = root / "media"
        self.apps_dir = root / "apps"
        self.containers = root / "containers"
        self.crash = root / "crash"
        self.crash_pending = root / "crash_pending"
        self.pairing_dir = root / "pairing"
        self.ddi_dir = root / "ddi"

    @classmethod
    def open(
        cls,
        root: Path,
        *,
        product_type: str,
        marketing_name: str,
        ios: str,
        limit_bytes: int,
        page_size: int,
    ) -> tuple[DeviceState, Identity]:
        """Opens (or creates) a state folder. A new folder gets a fresh identity; an existing one keeps its
        UDID and pairing, and takes the iOS version and limit asked for now."""
        state = cls(root)
        for folder in (state.media, state.apps_dir, state.containers, state.crash, state.crash_pending):
            folder.mkdir(parents=True, exist_ok=True)
        for name in MEDIA_DIRS:
            (state.media / name).mkdir(exist_ok=True)
        identity_file = root / "device.json"
        hardware_model, chip_id = HARDWARE.get(product_type, ("D83AP", 0x8130))
        if identity_file.exists():
            identity = state_record(identity_file, Identity)
        else:
            ecid = secrets.randbits(52)
            identity = Identity(
                udid=f"{chip_id:08X}-{ecid:016X}",
                serial_number="".join(secrets.choice("CDFGHJKLMNPQRTVWXY0123456789") for _ in range(10)),
                product_type=product_type,
                marketing_name=marketing_name,
                product_version=ios,
                build_version=IOS_BUILDS[ios],
                hardware_model=hardware_model,
                chip_id=chip_id,
                ecid=ecid,
                device_name=f"Virtual {marketing_name}",
                wifi_mac=":".join(f"{secrets.randbits(8):02x}" for _ in range(6)),
                limit_bytes=limit_bytes,
                page_size=page_size,
            )
        identity.product_version = ios
        identity.build_version = IOS_BUILDS[ios]
        identity.limit_bytes = limit_bytes
        identity_file.write_text(json.dumps(asdict(identity), indent=2))
        return state, identity

    # --- developer mode and the developer disk image -------------------------------------------------

    def developer(self) -> DeveloperState:
        path = self.root / "developer.json"
        return state_record(path, DeveloperState) if path.exists() else DeveloperState()

    def save_developer(self, developer: DeveloperState) -> None:
        (self.root / "developer.json").write_text(json.dumps(asdict(developer), indent=2, sort_keys=True))

    # --- apps ------------------------------------------------------------------------------------------

    def _apps_file(self) -> Path:
        return self.root / "apps.json"

    def user_apps(self) -> dict[str, dict[str, Any]]:
        path = self._apps_file()
        if not path.exists():
            return {}
        apps = read_data(path, mapping=STATE_FILE, expected=STATE_FILE)
        if not all(isinstance(record, dict) for record in apps.values()):
            raise InputError("an app's record is not an object", file=path, expected=STATE_FILE)
        return apps

    def all_apps(self) -> dict[str, dict[str, Any]]:
        apps: dict[str, dict[str, Any]] = {}
        for bundle_id, (display, executable) in SYSTEM_APPS.items():
            apps[bundle_id] = {
                "CFBundleIdentifier": bundle_id,
                "CFBundleDisplayName": display,
                "CFBundleName": display,
                "CFBundleExecutable": executable,
                "ApplicationType": "System",
                "Path": f"/Applications/{executable}.app",
                "CFBundleShortVersionString": "1.0",
                "CFBundleVersion": "1",
            }
        apps.update(self.user_apps())
        return apps

    def register_app(self, info: dict[str, Any], app_dir_name: str, source: Path) -> dict[str, Any]:
        """Records an app whose bundle was unpacked at `source`; keeps its data container if it existed."""
        bundle_id = info["CFBundleIdentifier"]
        apps = self.user_apps()
        old = apps.get(bundle_id)
        bundle_uuid = str(uuid.uuid4()).upper()
        data_uuid = old["_DataUUID"] if old else str(uuid.uuid4()).upper()
        target = self.apps_dir / bundle_id
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        shutil.move(str(source), str(target / app_dir_name))
        record = {k: v for k, v in info.items() if isinstance(v, str | int | float | bool | list | dict)}
        record.update(
            {
                "ApplicationType": "User",
                "Path": f"/private/var/containers/Bundle/Application/{bundle_uuid}/{app_dir_name}",
                "Container": f"/private/var/mobile/Containers/Data/Application/{data_uuid}",
                "_DataUUID": data_uuid,
                "_AppDir": app_dir_name,
            }
        )
        entitlements = _entitlements(target / app_dir_name)
        if entitlements is not None:
            record["Entitlements"] = entitlements
        apps[bundle_id] = record
        self.container(bundle_id)
        self._apps_file().write_text(json.dumps(apps, indent=2, sort_keys=True))
        return record

    def remove_app(self, bundle_id: str) -> bool:
        apps = self.user_apps()
        if apps.pop(bundle_id, None) is None:
            return False
        shutil.rmtree(self.apps_dir / bundle_id, ignore_errors=True)
        shutil.rmtree(self.containers / bundle_id, ignore_errors=True)
        self._apps_file().write_text(json.dumps(apps, indent=2, sort_keys=True))
        return True

    def app_bundle(self, bundle_id: str) -> Path | None:
        record = self.user_apps().get(bundle_id)
        return None if record is None else self.apps_dir / bundle_id / record["_AppDir"]

    def container(self, bundle_id: str) -> Path:
        root = self.containers / bundle_id
        for name in CONTAINER_DIRS:
            (root / name).mkdir(parents=True, exist_ok=True)
        return root


def _entitlements(app: Path) -> dict[str, Any] | None:
    """The app's entitlements, as installation_proxy lists them (its signature's, else its .xcent's)."""
    return app_entitlements(app)


STATE_FILE = "a file `kvrig virtual start` wrote in its --state folder (remove the folder to start a new phone)"


def state_record(path: Path, cls: Any) -> Any:
    """A dataclass of the virtual phone's state read from `path`: InputError naming the file when it is not one
    kvrig wrote (cut short, edited, or from another version)."""
    data = read_data(path, mapping=STATE_FILE, expected=STATE_FILE)
    try:
        return cls(**data)
    except TypeError as exc:  # keys the record does not have, or lacks
        raise InputError(f"not a {cls.__name__} record: {exc}", file=path, expected=STATE_FILE) from None
