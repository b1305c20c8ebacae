"""com.apple.mobile.mobile_image_mounter: the developer disk image (DDI) a phone needs for developer services.

Before iOS 17 the image is the shared `Developer` one, checked against its signature; from iOS 17 it is the
`Personalized` one, mounted with a personalization manifest (an IM4M ticket) made for this phone's ECID. A
host gets that ticket from Apple's signing server once, and the phone stores it: `QueryPersonalizationManifest`
with the image's SHA-384 returns it, so later mounts need no network. The virtual phone plays that "once":
its state folder holds the image files (`ddi/`) and the manifest it stored for them, so a client mounts with
pymobiledevice3's mounter from local files and nothing is downloaded.

Requests and replies are length-prefixed plists (`ReceiveBytes` is followed by the raw image bytes). A
request the phone cannot serve gets `Error` + `DetailedError` in the phone's words, which pymobiledevice3
maps to its exceptions (`Developer mode is not enabled`, `... is already mounted`, `There is no matching
entry ...`); a missing manifest closes the connection, as the phone does.
"""

from __future__ import annotations

import hashlib
import plistlib
import secrets
from pathlib import Path
from typing import Any

from kvrig.virtual.phone import Link, Phone
from kvrig.virtual.state import DeveloperState
from kvrig.virtual.wire import ProtocolViolation

MOUNT_PATHS = {"Developer": "/Developer", "Personalized": "/System/Developer"}
MAX_IMAGE_BYTES = 64 * 1024 * 1024
# What the stand-in image holds: any fixed bytes do (the phone checks digests, never content).
_IMAGE_BYTES = b"kvrig virtual developer disk image\n" * 2048


def image_type_for(device: Phone) -> str:
    return "Personalized" if device.ios_major >= 17 else "Developer"


def developer_signature(image: bytes) -> bytes:
    """The 128-byte signature the shared pre-iOS 17 image ships with (stands in for Apple's RSA signature)."""
    return hashlib.sha512(b"signature-1" + image).digest() + hashlib.sha512(b"signature-2" + image).digest()


def personalization_manifest(device: Phone, image_digest: bytes) -> bytes:
    """An IM4M-shaped ticket bound to this phone's ECID and the image digest."""
    ecid = device.identity.ecid.to_bytes(8, "little")
    return b"IM4M" + hashlib.sha384(b"ticket" + ecid + image_digest).digest()


def local_image_files(device: Phone) -> dict[str, Path]:
    """Writes (once) the image files a host mounts this phone with; returns them by role."""
    folder = device.state.ddi_dir
    folder.mkdir(parents=True, exist_ok=True)
    if image_type_for(device) == "Developer":
        files = {"image": folder / "DeveloperDiskImage.dmg", "signature": folder / "DeveloperDiskImage.dmg.signature"}
        if not files["image"].exists():
            files["image"].write_bytes(_IMAGE_BYTES)
            files["signature"].write_bytes(developer_signature(_IMAGE_BYTES))
        return files
    files = {
        "image": folder / "Image.dmg",
        "build_manifest": folder / "BuildManifest.plist",
        "trust_cache": folder / "Image.trustcache",
    }
    if not files["image"].exists():
        ident = device.identity
        files["image"].write_bytes(_IMAGE_BYTES)
        files["trust_cache"].write_bytes(b"\x00\x00\x00\x01" + hashlib.sha256(_IMAGE_BYTES).digest())
        manifest = {
            "ProductBuildVersion": ident.build_version,
            "ProductVersion": ident.product_version,
            "BuildIdentities": [{"ApChipID": hex(ident.chip_id), "ApBoardID": "0xc", "Info": {"Variant": "DDI"}}],
        }
        files["build_manifest"].write_bytes(plistlib.dumps(manifest))
    return files


def boot_state(device: Phone, developer: DeveloperState, *, fresh: bool) -> None:
    """A fresh phone has its manifest stored and (as a phone prepared before) its image mounted."""
    image = local_image_files(device)["image"].read_bytes()
    kind = image_type_for(device)
    if kind == "Personalized":
        digest = hashlib.sha384(image).digest()
        developer.manifests.setdefault(digest.hex(), personalization_manifest(device, digest).hex())
    if fresh:
        signature = (
            developer_signature(image)
            if kind == "Developer"
            else bytes.fromhex(developer.manifests[hashlib.sha384(image).hexdigest()])
        )
        developer.mounted = {kind: signature.hex()}


def image_mounted(device: Phone) -> bool:
    return image_type_for(device) in device.state.developer().mounted


def _mounted_entry(kind: str, signature_hex: str) -> dict[str, Any]:
    return {
        "DiskImageType": kind,
        "IsMounted": True,
        "MountPath": MOUNT_PATHS[kind],
        "ImageSignature": bytes.fromhex(signature_hex),
        "DeviceType": "DiskImage",
    }


class MounterSession:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.device = link.device
        self.uploaded: dict[str, bytes] = {}  # ImageType -> image bytes received on this connection

    def _fail(self, error: str, detail: str) -> dict[str, Any]:
        return {"Error": error, "DetailedError": detail}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        device, state = self.device, self.device.state
        developer = state.developer()
        command = request.get("Command")
        kind = str(request.get("ImageType") or request.get("PersonalizedImageType") or "")
        personalized = device.ios_major >= 17
        if command == "LookupImage":
            signature = developer.mounted.get(kind)
            listed = [bytes.fromhex(signature)] if signature else []
            return {"ImagePresent": bool(listed), "ImageSignature": listed, "Status": "Complete"}
        if command == "CopyDevices":
            entries = [_mounted_entry(k, sig) for k, sig in developer.mounted.items()]
            return {"EntryList": entries, "Status": "Complete"}
        if command == "QueryDeveloperModeStatus":
            return {"DeveloperModeStatus": developer.developer_mode, "Status": "Complete"}
        if command == "ReceiveBytes":
            size = int(request.get("ImageSize", -1))
            if kind not in MOUNT_PATHS or not 0 < size <= MAX_IMAGE_BYTES:
                return self._fail("InvalidArgument", f"cannot receive a {kind!r} image of {size} bytes")
            await self.link.send_plist({"Status": "ReceiveBytesAck"})
            self.uploaded[kind] = await self.link.recv_exactly(size)
            return {"Status": "Complete"}
        if command == "MountImage":
            return self.mount(kind, bytes(request.get("ImageSignature") or b""), developer)
        if command == "UnmountImage":
            path = str(request.get("MountPath", ""))
            for mounted_kind in list(developer.mounted):
                if MOUNT_PATHS[mounted_kind] == path:
                    del developer.mounted[mounted_kind]
                    state.save_developer(developer)
                    return {"Status": "Complete"}
            return self._fail("InternalError", f"There is no matching entry in the device map for {path}.")
        if personalized and command == "QueryNonce":
            return {"PersonalizationNonce": self.nonce(), "Status": "Complete"}
        if personalized and command == "QueryPersonalizationIdentifiers":
            ident = device.identity
            identifiers = {
                "BoardId": 0xC,
                "ChipID": ident.chip_id,
                "SecurityDomain": 1,
                "SecurityMode": True,
                "ProductionMode": True,
                "UniqueChipID": ident.ecid,
            }
            return {"PersonalizationIdentifiers": identifiers, "Status": "Complete"}
        if personalized and command == "QueryPersonalizationManifest":
            digest = bytes(request.get("ImageSignature") or b"")
            manifest = developer.manifests.get(digest.hex())
            if manifest is None:
                # The phone answers, then hangs up: the client reconnects to ask the signing server.
                await self.link.send_plist(self._fail("MissingManifest", "no personalization manifest stored"))
                return None
            return {"ImageSignature": bytes.fromhex(manifest), "Status": "Complete"}
        if personalized and command in ("RollPersonalizationNonce", "RollCryptexNonce"):
            self._nonce = secrets.token_bytes(20)
            return {"Status": "Complete"}
        if command == "Hangup":
            await self.link.send_plist({"Status": "Complete"})
            return None
        return self._fail("UnknownCommand", f"unknown command {command!r}")

    _nonce: bytes | None = None

    def nonce(self) -> bytes:
        if self._nonce is None:
            self._nonce = hashlib.sha1(self.device.identity.udid.encode()).digest()
        return self._nonce

    def mount(self, kind: str, signature: bytes, developer: DeveloperState) -> dict[str, Any]:
        device = self.device
        if kind != image_type_for(device):
            return self._fail("InternalError", f"image type {kind!r} is not mountable on this device")
        if device.ios_major >= 16 and not developer.developer_mode:
            return self._fail("DeveloperModeIsNotEnabled", "Developer mode is not enabled.")
        if kind in developer.mounted:
            return self._fail("InternalError", f"A {kind} image is already mounted at {MOUNT_PATHS[kind]}.")
        image = self.uploaded.get(kind)
        if image is None:
            return self._fail("InternalError", f"no {kind} image was received before MountImage")
        if kind == "Developer":
            valid = signature == developer_signature(image)
        else:
            stored = developer.manifests.get(hashlib.sha384(image).hexdigest())
            valid = stored is not None and signature == bytes.fromhex(stored)
        if not valid:
            return self._fail("ImageSignatureMismatch", f"the {kind} image failed signature verification")
        developer.mounted[kind] = signature.hex()
        device.state.save_developer(developer)
        device.syslog.emit("mobile_storage_proxy", f"Mounted {kind} image at {MOUNT_PATHS[kind]}")
        return {"Status": "Complete"}


async def serve_image_mounter(link: Link) -> None:
    session = MounterSession(link)
    while True:
        request = await link.recv_plist()
        if "Command" not in request:
            raise ProtocolViolation("mobile_image_mounter request without Command")
        reply = await session.handle(request)
        if reply is None:
            return
        await link.send_plist(reply)
