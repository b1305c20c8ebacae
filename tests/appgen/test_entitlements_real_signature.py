"""`app_entitlements` on a code signature Apple's tools made, not one a test wrote.

The executable is the Mitmproxy Redirector app from the mitmproxy-macos 0.11.5 wheel on PyPI: a fat (x86_64 +
arm64) Mach-O built by Xcode 15.4 and signed by codesign with a Developer ID, whose signature carries an
entitlements blob in each slice. Every byte but the fat header, each slice's Mach-O header and load commands and
each slice's code signature is zeroed, so all offsets are the real ones (tests/data/codesign/README.md says where
it comes from and how the expected entitlements were read, independently of kvrig)."""

from __future__ import annotations

import gzip
import hashlib
import plistlib
import zipfile
from pathlib import Path

from kvrig.appgen.entitlements import app_entitlements
from kvrig.schemas.keys import ENTITLEMENTS_FILE

DATA = Path(__file__).parent.parent / "data" / "codesign"
EXECUTABLE = "Mitmproxy Redirector"

# The entitlements blob (slot 5 of the SuperBlob's index) of both slices, decoded by lief and by macholib.
EXPECTED = {
    "com.apple.application-identifier": "S8XHQB96PW.org.mitmproxy.macos-redirector",
    "com.apple.developer.networking.networkextension": ["app-proxy-provider-systemextension"],
    "com.apple.developer.system-extension.install": True,
    "com.apple.developer.team-identifier": "S8XHQB96PW",
}
# What an .xcent left beside the executable might say: the signature must win over it.
STALE_XCENT = plistlib.dumps({"get-task-allow": True})


def _executable() -> bytes:
    return gzip.decompress((DATA / f"{EXECUTABLE}.trimmed.gz").read_bytes())


def _app(folder: Path) -> Path:
    """The real executable and Info.plist, laid out as an iOS .app (flat; a macOS one keeps them in Contents/)."""
    app = folder / "Redirector.app"
    app.mkdir()
    (app / "Info.plist").write_bytes((DATA / "Info.plist").read_bytes())
    (app / EXECUTABLE).write_bytes(_executable())
    (app / ENTITLEMENTS_FILE).write_bytes(STALE_XCENT)
    return app


def test_the_fixture_is_the_real_layout() -> None:
    """The fixture is what the README says: a fat Mach-O whose two signatures sit where LC_CODE_SIGNATURE says."""
    binary = _executable()
    assert hashlib.sha256(binary).hexdigest() == "08c6a1731616351e6bc072e9330acd0be0181dee33244def4969e8a8a0287334"
    assert binary[:8] == bytes.fromhex("cafebabe00000002")  # FAT_MAGIC, two slices
    # Offsets as lief and macholib read them: each slice's SuperBlob (CSMAGIC_EMBEDDED_SIGNATURE) and its
    # entitlements blob (CSMAGIC_EMBEDDED_ENTITLEMENTS, 577 bytes with its 8-byte header).
    for superblob, entitlements in ((1480832, 1492926), (2946704, 2958478)):
        assert binary[superblob : superblob + 4] == bytes.fromhex("fade0cc0")
        assert binary[entitlements : entitlements + 8] == bytes.fromhex("fade7171") + (577).to_bytes(4, "big")
        assert plistlib.loads(binary[entitlements + 8 : entitlements + 577]) == EXPECTED
    assert plistlib.loads((DATA / "Info.plist").read_bytes())["CFBundleExecutable"] == EXECUTABLE


def test_an_app_folders_entitlements_are_its_real_signatures(tmp_path: Path) -> None:
    assert app_entitlements(_app(tmp_path)) == EXPECTED


def test_an_ipas_entitlements_are_its_real_signatures(tmp_path: Path) -> None:
    app = _app(tmp_path)
    ipa = tmp_path / "Redirector.ipa"
    with zipfile.ZipFile(ipa, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in ("Info.plist", EXECUTABLE, ENTITLEMENTS_FILE):
            archive.write(app / name, f"Payload/Redirector.app/{name}")
    assert app_entitlements(ipa) == EXPECTED


def test_without_its_signature_the_app_falls_back_to_the_xcent(tmp_path: Path) -> None:
    """The same real headers with both signatures zeroed (as if never signed): what Xcode left beside it."""
    app = _app(tmp_path)
    binary = bytearray(_executable())
    for start, size in ((1480832, 30960), (2946704, 30640)):  # LC_CODE_SIGNATURE's dataoff/datasize per slice
        binary[start : start + size] = bytes(size)
    (app / EXECUTABLE).write_bytes(bytes(binary))
    assert app_entitlements(app) == plistlib.loads(STALE_XCENT)
