"""house_arrest (VendDocuments) + AFC: push a bundle folder into an app's Documents, resuming a partial
transfer, and pull files back out of the container.

Resuming: each file is written under a temporary name and renamed when complete, so a final name on the
phone always holds a whole file. After each file, a small journal on the phone
(`Documents/.kvrig/push-<bundle>.json`) records the sha256 the file was sent with. A later push skips a file
whose remote size matches and, when the bundle's manifest.json lists the file, whose journalled sha256
equals the manifest's (same-size files with other content are common: re-quantized weights keep their
shapes). A small file the manifest does not list (manifest.json itself, configs) is hashed here instead;
a large unlisted one is judged by size alone. manifest.json is sent last, so a bundle folder with a
manifest on the phone is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import posixpath
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pymobiledevice3.exceptions import AfcException, AfcFileNotFoundError
from pymobiledevice3.services.afc import AfcError
from pymobiledevice3.services.house_arrest import HouseArrestService

from kvrig.device.discovery import Device
from kvrig.device.paths import safe_join, write_new_file
from kvrig.exceptions import BundleError, SchemaError, VerifyError
from kvrig.fileio import read_data

DOCUMENTS = "/Documents"
JOURNAL_DIR = f"{DOCUMENTS}/.kvrig"
PARTIAL_SUFFIX = ".kvrig-partial"
MANIFEST = "manifest.json"
CHUNK_BYTES = 1024 * 1024
HASH_UNLISTED_BELOW = 4 * 1024 * 1024  # unlisted files smaller than this are hashed locally to compare


@dataclass(frozen=True)
class Progress:
    file: str
    file_sent: int
    file_size: int
    sent: int  # bytes sent in this push so far
    to_send: int  # bytes this push has to send (skipped files excluded)


@dataclass
class PushResult:
    remote_dir: str
    sent: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_skipped: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LocalFile:
    relative: str  # posix path inside the bundle
    path: Path
    size: int
    sha256: str | None  # from manifest.json, or computed here for a small unlisted file


class Container:
    """An app's Documents over house_arrest; `async with Container(device, bundle_id) as c:`."""

    def __init__(self, device: Device, bundle_id: str) -> None:
        self.device = device
        self.bundle_id = bundle_id
        self.afc: HouseArrestService | None = None

    async def __aenter__(self) -> Container:
        async with self.device.errors(f"opening the Documents of {self.bundle_id}"):
            self.afc = await HouseArrestService.create(self.device.lockdown, self.bundle_id, documents_only=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.afc is not None:
            with contextlib.suppress(Exception):  # the link may already be gone (unplugged)
                await self.afc.close()
            self.afc = None

    @property
    def _afc(self) -> HouseArrestService:
        assert self.afc is not None, "use `async with Container(...)`"
        return self.afc

    async def size(self, path: str) -> int | None:
        """Size of a remote file, None if it does not exist."""
        async with self.device.errors(f"stat {path}"):
            try:
                return int((await self._afc.stat(path))["st_size"])
            except AfcFileNotFoundError:
                return None
            except AfcException as exc:
                if exc.status == AfcError.OBJECT_NOT_FOUND:
                    return None
                raise

    async def read(self, path: str) -> bytes:
        async with self.device.errors(f"reading {path}"):
            return await self._afc.get_file_contents(path)

    async def write(self, path: str, data: bytes) -> None:
        async with self.device.errors(f"writing {path}"):
            await self._afc.makedirs(posixpath.dirname(path))
            await self._afc.set_file_contents(path, data)

    async def remove(self, path: str) -> None:
        async with self.device.errors(f"removing {path}"):
            await self._afc.rm_single(path, force=True)

    async def listdir(self, path: str) -> list[str]:
        async with self.device.errors(f"listing {path}"):
            return [n for n in await self._afc.listdir(path) if n not in (".", "..")]

    async def is_dir(self, path: str) -> bool:
        async with self.device.errors(f"stat {path}"):
            return bool(await self._afc.isdir(path))

    async def send_file(self, local: Path, remote: str, on_chunk: Callable[[int], None] | None = None) -> str:
        """Streams a local file to `remote` (via a temporary name); returns its sha256."""
        afc = self._afc
        digest = hashlib.sha256()
        partial = remote + PARTIAL_SUFFIX
        async with self.device.errors(f"sending {local.name}"):
            await afc.makedirs(posixpath.dirname(remote))
            handle = await afc.fopen(partial, "w")
            try:
                with local.open("rb") as f:
                    while chunk := f.read(CHUNK_BYTES):
                        await afc.fwrite(handle, chunk)
                        digest.update(chunk)
                        if on_chunk is not None:
                            on_chunk(len(chunk))
            finally:
                await afc.fclose(handle)
            await afc.rm_single(remote, force=True)
            await afc.rename(partial, remote)
        return digest.hexdigest()


# --- the bundle on the host --------------------------------------------------------------------------------


def read_manifest(bundle: Path) -> dict[str, tuple[int | None, str | None]]:
    """relative path -> (size, sha256) from the bundle's manifest.json; {} when there is none.

    Accepts `files` as a list of {"path", "size", "sha256"} or a mapping path -> {"size", "sha256"}.
    """
    path = bundle / MANIFEST
    if not path.exists():
        return {}
    data = read_data(path, error=SchemaError)
    files = data.get("files") if isinstance(data, dict) else None
    if isinstance(files, dict):
        files = [{"path": k, **(v if isinstance(v, dict) else {})} for k, v in files.items()]
    if not isinstance(files, list):
        raise SchemaError("missing", file=path, field="files", expected="a list of {path, size, sha256}")
    entries: dict[str, tuple[int | None, str | None]] = {}
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise SchemaError("entry without a path", file=path, field=f"files.{i}.path", expected="a string")
        size, sha = entry.get("size"), entry.get("sha256")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise SchemaError(f"got {size!r}", file=path, field=f"files.{i}.size", expected="a byte count")
        if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
            raise SchemaError(f"got {sha!r}", file=path, field=f"files.{i}.sha256", expected="64 hex digits")
        entries[entry["path"]] = (size, sha.lower() if sha else None)
    return entries


def bundle_files(bundle: Path) -> list[LocalFile]:
    """Every file of the bundle folder, manifest.json last; checks sizes against the manifest."""
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a bundle folder")
    manifest = read_manifest(bundle)
    files: list[LocalFile] = []
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        relative = path.relative_to(bundle).as_posix()
        size = path.stat().st_size
        listed_size, sha = manifest.get(relative, (None, None))
        if listed_size is not None and listed_size != size:
            raise VerifyError(f"{path}: {size} bytes, the manifest says {listed_size}")
        if sha is None and relative not in manifest and size < HASH_UNLISTED_BELOW:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
        files.append(LocalFile(relative, path, size, sha))
    missing = sorted(set(manifest) - {f.relative for f in files})
    if missing:
        raise VerifyError(f"{bundle}: files in manifest.json are missing: {', '.join(missing[:5])}")
    files.sort(key=lambda f: (f.relative == MANIFEST, f.relative))
    return files


# --- push and pull -----------------------------------------------------------------------------------------


async def push_bundle(
    device: Device,
    bundle_id: str,
    bundle: str | Path,
    *,
    remote_name: str | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> PushResult:
    """Copies a bundle folder into Documents/<remote_name or folder name>, skipping files already there."""
    bundle = Path(bundle)
    files = bundle_files(bundle)
    name = remote_name or bundle.resolve().name
    remote_dir = f"{DOCUMENTS}/{name}"
    journal_path = f"{JOURNAL_DIR}/push-{name}.json"
    result = PushResult(remote_dir=remote_dir)
    async with Container(device, bundle_id) as container:
        journal = await _read_journal(container, journal_path)
        todo: list[LocalFile] = []
        for f in files:
            remote_size = await container.size(f"{remote_dir}/{f.relative}")
            same = remote_size == f.size and (f.sha256 is None or journal.get(f.relative) == f.sha256)
            if same:
                result.skipped.append(f.relative)
                result.bytes_skipped += f.size
            else:
                todo.append(f)
        to_send = sum(f.size for f in todo)
        for f in todo:
            sent_before = result.bytes_sent

            def on_chunk(n: int, f: LocalFile = f, base: int = sent_before) -> None:
                result.bytes_sent += n
                if progress is not None:
                    progress(Progress(f.relative, result.bytes_sent - base, f.size, result.bytes_sent, to_send))

            sha = await container.send_file(f.path, f"{remote_dir}/{f.relative}", on_chunk)
            if f.sha256 is not None and sha != f.sha256:
                raise VerifyError(f"{f.path}: sha256 {sha} does not match the manifest ({f.sha256})")
            if f.size == 0 and progress is not None:
                progress(Progress(f.relative, 0, 0, result.bytes_sent, to_send))
            journal[f.relative] = sha
            await container.write(journal_path, json.dumps(journal, indent=1, sort_keys=True).encode())
            result.sent.append(f.relative)
    return result


async def _read_journal(container: Container, path: str) -> dict[str, str]:
    if await container.size(path) is None:
        return {}
    try:
        data = json.loads(await container.read(path))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # a torn journal only costs re-sending
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


async def pull(device: Device, bundle_id: str, remote: str, out_dir: str | Path) -> list[Path]:
    """Copies a file or folder from the app's Documents into `out_dir`; names from the phone are cleaned
    and never leave `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pulled: list[Path] = []
    async with Container(device, bundle_id) as container:
        remote = "/" + remote.strip("/")
        base = posixpath.dirname(remote)
        stack = [remote]
        while stack:
            path = stack.pop()
            if await container.is_dir(path):
                stack.extend(f"{path}/{n}" for n in sorted(await container.listdir(path), reverse=True))
                continue
            target = safe_join(out_dir, posixpath.relpath(path, base))
            write_new_file(target, await container.read(path))
            pulled.append(target)
    return pulled
