"""Writes a placeholder .ipa for the virtual iPhone: an Info.plist with the bundle id and a dummy executable.

The virtual iPhone runs its test app (`python -m kvrig.virtual.testapp`) for any installed app, so this is
all it needs. Usage: python examples/make_test_ipa.py [OUT.ipa] [BUNDLE_ID]
"""

from __future__ import annotations

import plistlib
import sys
import zipfile
from pathlib import Path


def make_ipa(
    path: Path, bundle_id: str = "dev.kvrig.soak", executable: str = "KVSoak", entitlements: dict | None = None
) -> Path:
    """`entitlements`: written where Xcode puts them in the .app (archived-expanded-entitlements.xcent); the
    virtual iPhone lists them as a phone lists a signed app's (com.apple.developer.kernel.increased-memory-limit)."""
    info = {
        "CFBundleIdentifier": bundle_id,
        "CFBundleExecutable": executable,
        "CFBundleName": executable,
        "CFBundleShortVersionString": "1.0",
        "CFBundleVersion": "1",
    }
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"Payload/{executable}.app/Info.plist", plistlib.dumps(info, fmt=plistlib.FMT_BINARY))
        archive.writestr(f"Payload/{executable}.app/{executable}", b"\xcf\xfa\xed\xfe" + bytes(60))
        if entitlements is not None:
            xcent = f"Payload/{executable}.app/archived-expanded-entitlements.xcent"
            archive.writestr(xcent, plistlib.dumps(entitlements))
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("KVSoak.ipa")
    print(make_ipa(out, *sys.argv[2:3]))
