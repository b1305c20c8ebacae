"""An app's entitlements, read from its .ipa or .app as a phone lists them (installation_proxy's `Entitlements`).

A phone reads them from the code signature: the entitlements blob (an XML plist) embedded in the main executable.
An app built for the virtual iPhone runs no signed binary; it carries the plist Xcode writes beside the executable
(archived-expanded-entitlements.xcent), read when the signature has none."""

from __future__ import annotations

import plistlib
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from kvrig.schemas.keys import ENTITLEMENTS_FILE

# CSMAGIC_EMBEDDED_ENTITLEMENTS, then the blob's big-endian length (header included), then the plist.
_BLOB_MAGIC = bytes.fromhex("fade7171")


def app_entitlements(path: Path) -> dict[str, Any] | None:
    """The entitlements of the app in `path` (an .ipa, or an unpacked .app folder); None: it declares none, or
    `path` is not an app kvrig can read."""
    if path.is_dir():
        executable = _executable_name(_read(path / "Info.plist"))
        return _from_signature(_read(path / executable) if executable else b"") or _plist(
            _read(path / ENTITLEMENTS_FILE)
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            app = next((PurePosixPath(n).parent for n in names if _is_app_info(n)), None)
            if app is None:
                return None

            def member(name: str) -> bytes:
                return archive.read(str(app / name)) if str(app / name) in names else b""

            executable = _executable_name(member("Info.plist"))
            return _from_signature(member(executable) if executable else b"") or _plist(member(ENTITLEMENTS_FILE))
    except (OSError, zipfile.BadZipFile):
        return None


def _is_app_info(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return len(parts) == 3 and parts[0] == "Payload" and parts[1].endswith(".app") and parts[2] == "Info.plist"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes() if path.is_file() else b""
    except OSError:
        return b""


def _executable_name(info: bytes) -> str | None:
    data = _plist(info)
    name = data.get("CFBundleExecutable") if data else None
    return name if isinstance(name, str) and name and "/" not in name else None


def _from_signature(binary: bytes) -> dict[str, Any] | None:
    """The signature's entitlements blob, found by its magic: a Mach-O's signature sits at its end, so the last
    blob that holds a plist is the one the kernel reads."""
    at = binary.rfind(_BLOB_MAGIC)
    while at >= 0:
        length = int.from_bytes(binary[at + 4 : at + 8], "big")
        found = _plist(binary[at + 8 : at + length]) if 8 < length <= len(binary) - at else None
        if found is not None:
            return found
        at = binary.rfind(_BLOB_MAGIC, 0, at)
    return None


def _plist(data: bytes) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        parsed = plistlib.loads(data)
    except Exception:  # a broken plist is no entitlements, as an unsigned app has
        return None
    return parsed if isinstance(parsed, dict) else None
