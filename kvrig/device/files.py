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

What is sent: with a manifest, exactly the files it lists and the manifest itself, each a regular file inside
the folder reached through no symbolic link, and each checked against its sha256 as it is streamed (a file
that does not match is never renamed into place); anything else in the folder (an unlisted file, a link) is
refused as `kvrig verify` refuses it (VerifyError). Without a manifest (a folder kvrig did not package), its
regular files; links are never followed.

Reading from the phone is bounded: every file is streamed in CHUNK_BYTES reads until its end, never taken whole,
and refused (DeviceFileError) when it is not a regular file, is gone, claims or yields more than its `Bounds`
allow, or is not read within their deadline. pymobiledevice3's `get_file_contents` trusts the size the phone
claims (a 2^50-byte claim is 2^28 reads of nothing) and joins the chunks in memory, so it is not used here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from pymobiledevice3.exceptions import AfcException, AfcFileNotFoundError
from pymobiledevice3.services.afc import AfcError, AfcService
from pymobiledevice3.services.house_arrest import HouseArrestService

from kvrig.device.discovery import Device
from kvrig.device.loop import bounded
from kvrig.device.paths import new_file, safe_join
from kvrig.exceptions import BundleError, DeviceFileError, OutputWriteError, SchemaError, VerifyError
from kvrig.fileio import read_data

DOCUMENTS = "/Documents"
JOURNAL_DIR = f"{DOCUMENTS}/.kvrig"
PARTIAL_SUFFIX = ".kvrig-partial"
MANIFEST = "manifest.json"
CHUNK_BYTES = 1024 * 1024
HASH_UNLISTED_BELOW = 4 * 1024 * 1024  # unlisted files smaller than this are hashed locally to compare
CLOSE_TIMEOUT_S = 5.0  # closing a handle after a read that failed: the phone may not answer that either


@dataclass(frozen=True)
class Bounds:
    """How much of one file kvrig reads from a phone, and for how long."""

    max_bytes: int
    timeout_s: float

    def describe(self) -> str:
        return f"at most {self.max_bytes} bytes within {self.timeout_s:g} s"


SMALL_FILE = Bounds(4 * 1024 * 1024, 30.0)  # journals, plans: kvrig's own small files
PULLED_FILE = Bounds(256 * 1024 * 1024, 300.0)  # `pull`: one file the app wrote
MAX_PULLED_ENTRIES = 10_000


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

    async def read(self, path: str, bounds: Bounds = SMALL_FILE) -> bytes:
        buffer = io.BytesIO()
        await stream_file(self.device, self._afc, path, buffer, bounds)
        return buffer.getvalue()

    async def pull_file(self, path: str, target: Path, bounds: Bounds) -> int:
        """Streams `path` into the local file `target` (whole or not at all); returns its size."""
        return await pull_to_file(self.device, self._afc, path, target, bounds)

    async def append_new(self, path: str, local: Path, offset: int, bounds: Bounds) -> int:
        """Appends what `path` holds beyond `offset` to `local` (which holds its first `offset` bytes); returns
        the bytes appended. `bounds.max_bytes` caps the whole file, not just the new part."""
        with _local_writes(local), local.open("r+b" if local.exists() else "wb") as sink:
            sink.truncate(offset)
            sink.seek(offset)
            return await stream_file(self.device, self._afc, path, sink, bounds, offset=offset)

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

    async def send_file(
        self,
        local: Path,
        remote: str,
        on_chunk: Callable[[int], None] | None = None,
        *,
        sha256: str | None = None,
    ) -> str:
        """Streams a local regular file (never through a link) to `remote` via a temporary name; returns its
        sha256. With `sha256`, a file whose bytes do not hash to it stays under the temporary name and is
        removed (VerifyError): the final name only ever holds what the manifest promised."""
        afc = self._afc
        digest = hashlib.sha256()
        partial = remote + PARTIAL_SUFFIX
        with open_regular(local) as f:
            async with self.device.errors(f"sending {local.name}"):
                await afc.makedirs(posixpath.dirname(remote))
                handle = await afc.fopen(partial, "w")
                try:
                    while chunk := f.read(CHUNK_BYTES):
                        await afc.fwrite(handle, chunk)
                        digest.update(chunk)
                        if on_chunk is not None:
                            on_chunk(len(chunk))
                finally:
                    await afc.fclose(handle)
                if sha256 is not None and digest.hexdigest() != sha256:
                    await afc.rm_single(partial, force=True)
                    raise VerifyError(f"{local}: sha256 {digest.hexdigest()} does not match the manifest ({sha256})")
                await afc.rm_single(remote, force=True)
                await afc.rename(partial, remote)
        return digest.hexdigest()


# --- bounded reads from the phone ------------------------------------------------------------------------


async def stream_file(
    device: Device, afc: AfcService, path: str, sink: BinaryIO, bounds: Bounds, *, offset: int = 0
) -> int:
    """Copies the regular file `path` from `offset` into `sink` in CHUNK_BYTES reads until a read comes back
    empty; returns the bytes copied. The size the phone claims is checked against the bounds, never trusted to
    end the loop (it may grow while read, or lie)."""
    what = f"reading {path}"
    async with device.errors(what):
        try:
            async with asyncio.timeout(bounds.timeout_s):
                return await _stream(afc, path, sink, bounds, offset)
        except TimeoutError:
            raise DeviceFileError(
                f"{what} on {device.udid}: not read within {bounds.timeout_s:g} s (a phone whose reads stall or "
                f"never end); kvrig reads {bounds.describe()}"
            ) from None
        except AfcFileNotFoundError:
            raise DeviceFileError(f"{what} on {device.udid}: it is gone (listed, then not there)") from None


async def _stream(afc: AfcService, path: str, sink: BinaryIO, bounds: Bounds, offset: int) -> int:
    info = await afc.stat(path)
    if info.get("st_ifmt") != "S_IFREG":
        raise DeviceFileError(f"{path}: not a regular file ({info.get('st_ifmt')}); kvrig pulls only files")
    if int(info["st_size"]) > bounds.max_bytes:
        raise DeviceFileError(f"{path}: the phone says it is {info['st_size']} bytes; kvrig reads {bounds.describe()}")
    handle = await afc.fopen(path, "r")
    try:
        if offset:
            await afc.fseek(handle, offset)
        copied = 0
        while chunk := await afc.fread(handle, min(CHUNK_BYTES, bounds.max_bytes - offset - copied + 1)):
            copied += len(chunk)
            if offset + copied > bounds.max_bytes:
                raise DeviceFileError(
                    f"{path}: the phone sent more than {bounds.max_bytes} bytes; kvrig reads {bounds.describe()}"
                )
            try:
                sink.write(chunk)
            except OSError as exc:  # here, not the link: device.errors would call it a lost phone
                raise OutputWriteError(f"writing what was pulled from {path}: {exc.strerror or exc}") from None
        return copied
    finally:
        with contextlib.suppress(Exception):  # the link may be gone, or the phone may not answer this either
            await bounded(afc.fclose(handle), CLOSE_TIMEOUT_S)


async def pull_to_file(device: Device, afc: AfcService, path: str, target: Path, bounds: Bounds) -> int:
    """`path` into `target` through a hidden partial file beside it, renamed into place when whole."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        with _local_writes(target), new_file(partial) as sink:
            size = await stream_file(device, afc, path, sink, bounds)
        os.replace(partial, target)  # replaces a link at `target` itself, never what it points to
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return size


@contextlib.contextmanager
def _local_writes(target: Path) -> Iterator[None]:
    """Opening, truncating and renaming the local copy: its errors (disk full, not writable) are this host's."""
    try:
        yield
    except OSError as exc:
        raise OutputWriteError(f"{target}: cannot write what was pulled: {exc.strerror or exc}") from None


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
    """What a push sends, manifest.json last: the manifest's files (and nothing else may be in the folder), or
    without a manifest the folder's regular files; sizes checked against the manifest."""
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a bundle folder")
    if (bundle / MANIFEST).is_symlink():
        raise VerifyError(f"{bundle / MANIFEST}: a symbolic link, not a regular file; a bundle holds only files")
    manifest = read_manifest(bundle)
    entries = _entries(bundle)
    if manifest:
        unexpected = sorted(set(entries) - set(manifest) - {MANIFEST})
        if unexpected:
            shown = ", ".join(f"{name} ({entries[name]})" for name in unexpected[:5])
            raise VerifyError(f"{bundle}: not listed in {MANIFEST}, so never pushed: {shown}")
        names = [*manifest, MANIFEST]
    else:
        names = [name for name, kind in entries.items() if kind == "file"]
    files: list[LocalFile] = []
    for relative in names:
        kind = entries.get(relative)
        if kind is None:
            raise VerifyError(f"{bundle}: {relative} is in {MANIFEST} but missing from the folder")
        if kind != "file":
            raise VerifyError(f"{bundle / relative}: a {kind}, not a regular file; a bundle holds only files")
        path = bundle / relative
        size = path.lstat().st_size
        listed_size, sha = manifest.get(relative, (None, None))
        if listed_size is not None and listed_size != size:
            raise VerifyError(f"{path}: {size} bytes, the manifest says {listed_size}")
        if sha is None and relative not in manifest and size < HASH_UNLISTED_BELOW:
            with open_regular(path) as f:
                sha = hashlib.sha256(f.read()).hexdigest()
        files.append(LocalFile(relative, path, size, sha))
    files.sort(key=lambda f: (f.relative == MANIFEST, f.relative))
    return files


def deployable(bundle: Path) -> list[LocalFile]:
    """`bundle_files` of a bundle `kvrig package` wrote: one without its manifest is refused (deploy and the lab
    send only what a manifest lists)."""
    if not bundle.is_dir():
        what = "not a folder" if bundle.exists() else "no such folder"
        raise BundleError(f"{bundle}: {what} (expected a bundle folder `kvrig package` wrote)")
    if not (bundle / MANIFEST).is_file():
        raise BundleError(f"{bundle}: no {MANIFEST}; kvrig deploys a bundle `kvrig package` wrote, as it lists")
    return bundle_files(bundle)


def _entries(bundle: Path) -> dict[str, str]:
    """Every entry below `bundle` that is not a directory, by posix path, with its kind; links are listed,
    never followed (a linked directory is one entry, a link)."""
    found: dict[str, str] = {}
    for folder, dirs, names in os.walk(bundle, followlinks=False):
        here = Path(folder)
        for name in [*names, *(d for d in dirs if (here / d).is_symlink())]:
            path = here / name
            mode = path.lstat().st_mode
            kind = "file" if stat.S_ISREG(mode) else "symbolic link" if stat.S_ISLNK(mode) else "special file"
            found[path.relative_to(bundle).as_posix()] = kind
    return found


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO]:
    """`path` opened for reading only if it is a regular file reached through no link (checked on the open file,
    so a file swapped for a link after it was listed is refused too)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise VerifyError(f"{path}: cannot open it as a regular file ({exc.strerror or exc})") from None
    f = os.fdopen(fd, "rb")
    with f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise VerifyError(f"{path}: not a regular file")
        yield f


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

            listed = f.sha256 if f.relative != MANIFEST else None
            sha = await container.send_file(f.path, f"{remote_dir}/{f.relative}", on_chunk, sha256=listed)
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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, DeviceFileError):
        return {}  # a torn (or hostile) journal only costs re-sending
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


async def pull(
    device: Device, bundle_id: str, remote: str, out_dir: str | Path, *, bounds: Bounds = PULLED_FILE
) -> list[Path]:
    """Copies a file or folder from the app's Documents into `out_dir`, each file within `bounds` and at most
    MAX_PULLED_ENTRIES entries; names from the phone are cleaned and never leave `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pulled: list[Path] = []
    async with Container(device, bundle_id) as container:
        remote = "/" + remote.strip("/")
        base = posixpath.dirname(remote)
        stack, seen = [remote], 0
        while stack:
            path = stack.pop()
            seen += 1
            if seen > MAX_PULLED_ENTRIES:
                raise DeviceFileError(f"pulling {remote} from {device.udid}: more than {MAX_PULLED_ENTRIES} entries")
            if await container.is_dir(path):
                stack.extend(f"{path}/{n}" for n in sorted(await container.listdir(path), reverse=True))
                continue
            target = safe_join(out_dir, posixpath.relpath(path, base))
            await container.pull_file(path, target, bounds)
            pulled.append(target)
    return pulled
