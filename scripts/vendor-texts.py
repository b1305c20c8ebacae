"""Copies the calibration and gate texts kvrig reads (kvrig/texts.py: the kinds with `vendored` files) from the
Debian packages that ship them into kvrig/_texts/, gzipped, and records each file's package, version and SHA-256 in
kvrig/_texts/SOURCES.json. Run on Debian with the packages installed (`make setup`), after changing a kind's files:

    .venv/bin/python scripts/vendor-texts.py

kvrig ships these copies so that `kvrig package` calibrates and gates on the same bytes on every system (macOS has
none of these packages); tests/quality/test_texts.py holds each copy to the installed package of that version."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess

from kvrig.texts import KINDS, TEXTS_DIR, debian_path


def main() -> None:
    sources: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        for name, pattern in zip(kind.vendored, kind.files if kind.shipped else (), strict=True):
            origin = debian_path(pattern)
            raw = origin.read_bytes()
            text = gzip.decompress(raw) if origin.suffix == ".gz" else raw
            target = TEXTS_DIR / name
            target.parent.mkdir(parents=True, exist_ok=True)
            # mtime 0: the same text always makes the same file
            target.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
            # the package that owns the file (libpython3-stdlib only depends on libpython3.11-stdlib)
            owner = subprocess.run(["dpkg-query", "-S", str(origin)], capture_output=True, text=True, check=True)
            package = owner.stdout.split(":")[0]
            version = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=True
            ).stdout
            sources[name] = {
                "package": package,
                "version": version,
                "path": str(origin),
                "sha256": hashlib.sha256(text).hexdigest(),
            }
    (TEXTS_DIR / "SOURCES.json").write_text(json.dumps(sources, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
