"""Reading the JSON and YAML files kvrig is given, and writing the files it keeps current, in one place each.

Every read failure (missing, unreadable, not UTF-8, not parseable, nested beyond reason, not the mapping asked
for) raises the caller's InputError subclass naming the file; writes go through a temporary file so a reader
never sees half a file, and a write that fails (disk full) raises OutputWriteError and leaves the file as it was.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import plistlib
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from xml.parsers.expat import ExpatError

import yaml

from kvrig.exceptions import InputError, OutputWriteError

# libyaml parses far faster when present
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# JSON nests a few levels in any real file (a tokenizer.json under 10); Python's json and the tokenizers library
# recurse per level and a file nested 200,000 deep overflows both, so deeper files are refused before them.
MAX_JSON_DEPTH = 256
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAML_LOADER)


def read_data(
    path: str | Path,
    *,
    error: type[InputError] = InputError,
    kind: Literal["json", "yaml"] = "json",
    mapping: str | None = None,
    expected: str | None = None,
) -> Any:
    """The parsed contents of a JSON or YAML file. With `mapping` (what the mapping should be, for the message),
    anything but a mapping is refused; `expected` is added to every message."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error("file not found", file=path, expected=expected) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read: {exc}", file=path, expected=expected) from None
    try:
        data = json.loads(text) if kind == "json" else parse_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"not valid {kind.upper()}: {exc}", file=path, expected=expected) from None
    except RecursionError:
        raise error(f"not valid {kind.upper()}: nested too deeply to read", file=path, expected=expected) from None
    if mapping is not None and not isinstance(data, dict):
        raise error(f"not a {kind.upper()} mapping", file=path, expected=mapping)
    return data


def make_folder(path: Path, what: str = "the output folder") -> None:
    """`path` and its parents made: OutputWriteError naming it when they cannot be (a file where a folder goes, no
    permission, a full disk)."""
    if path.exists() and not path.is_dir():
        raise OutputWriteError(f"{path}: cannot be {what}: it exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputWriteError(f"{path}: cannot create {what}: {exc.strerror or exc}") from None


def check_folder_possible(path: Path, what: str = "the output folder") -> None:
    """That `path` is a folder or could be made one (its nearest existing ancestor a folder this process may write
    in), made by nothing here: OutputWriteError naming it otherwise, before work whose results would go there."""
    if path.exists():
        if not path.is_dir():
            raise OutputWriteError(f"{path}: cannot be {what}: it exists and is not a folder")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputWriteError(f"{path}: cannot create {what}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputWriteError(f"{path}: cannot create {what}: {ancestor} is not writable")


def plist_dict(data: bytes, *, file: str | Path, expected: str) -> dict[str, Any]:
    """A property list that must be a dictionary (an app's Info.plist): InputError naming `file` otherwise."""
    try:
        info = plistlib.loads(data)
    except (plistlib.InvalidFileException, ExpatError, ValueError) as exc:  # XML that does not parse is ExpatError
        raise InputError(f"not a property list: {exc}", file=file, expected=expected) from None
    if not isinstance(info, dict):
        raise InputError(f"a property list of a {type(info).__name__}", file=file, expected=expected)
    return info


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A hidden temporary beside `path` to write (its folder made when missing), renamed over `path` when the block
    ends well and removed when it does not; a write that fails (disk full, not writable) is OutputWriteError and
    `path` stays as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise OutputWriteError(f"{path}: cannot write: {exc.strerror or exc}") from None
        raise


def check_json_depth(path: Path, *, error: type[InputError] = InputError, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuses a JSON file nested deeper than `limit` (strings skipped), before any parser recurses into it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", file=path) from None
    depth = 0
    for token in _JSON_TOKENS.finditer(data):
        bracket = token.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > limit:
                raise error(
                    f"nested more than {limit} levels deep", file=path, expected="JSON nested as models write it"
                )
        elif bracket in (b"]", b"}"):
            depth -= 1


def check_json_files(folder: Path, *, error: type[InputError] = InputError) -> None:
    """`check_json_depth` for every JSON file at the top of a model or bundle folder (tokenizer files included)."""
    for path in sorted(folder.glob("*.json")):
        if path.is_file():
            check_json_depth(path, error=error)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Replaces `path` whole: the new contents go to a hidden temporary beside it, then are renamed over it."""
    with atomic_output(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB pieces (bundles hold files of gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- work in progress: hidden folders beside the output ----------------------------------------------------


@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new hidden folder `parent/<prefix><8 hex>` for work in progress, removed when the block ends however it
    ends (an exception, Ctrl-C, SIGTERM through Terminated); the caller may rename it away first (then nothing is
    left to remove). A lock file beside it (`<folder>.lock`, held for the block's life) tells the next
    `sweep_scratch` whether a folder left behind belongs to a live process or one that was SIGKILLed."""
    sweep_scratch(parent, prefix)
    path = parent / f"{prefix}{uuid.uuid4().hex[:8]}"
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)  # the lock first: a folder never exists without it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path.mkdir()
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def sweep_scratch(parent: Path, prefix: str) -> list[Path]:
    """Removes the `scratch_dir` folders in `parent` whose process is gone (its lock is free: the kernel releases
    a SIGKILLed process's locks); returns them. Folders of running processes are left alone."""
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for lock in parent.glob(f"{glob.escape(prefix)}*.lock"):
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                os.close(fd)
                continue  # held: a live process works there
            folder = lock.with_name(lock.name.removesuffix(".lock"))
            shutil.rmtree(folder, ignore_errors=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
            removed.append(folder)
    return removed


def exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (Linux renameat2 with RENAME_EXCHANGE, macOS renamex_np with RENAME_SWAP); False
    where that is unavailable."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if sys.platform == "darwin":
        renamex_np = getattr(libc, "renamex_np", None)
        rename_swap = 2  # <stdio.h>
        done = None if renamex_np is None else renamex_np(os.fsencode(a), os.fsencode(b), rename_swap)
        unsupported: tuple[int, ...] = (errno.ENOTSUP, errno.EINVAL)  # a file system without RENAME_SWAP
    else:
        renameat2 = getattr(libc, "renameat2", None)
        at_fdcwd, rename_exchange = -100, 2
        paths = (at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b))
        done = None if renameat2 is None else renameat2(*paths, rename_exchange)
        unsupported = (errno.ENOSYS, errno.EINVAL)  # kernel or filesystem without RENAME_EXCHANGE
    if done is None:
        return False
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in unsupported:
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_in(new: Path, out: Path) -> None:
    """Puts the finished folder `new` at `out`: renamed when `out` is absent; else exchanged with it in one rename
    (or, without an atomic exchange here, the old one moved aside for the moment between two renames), and the
    old one removed."""
    if not out.exists() and not out.is_symlink():
        os.rename(new, out)
        return
    if exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # now the old one
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(new, out)
    shutil.rmtree(old, ignore_errors=True)


SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
"""safetensors' own limit for the JSON header."""


class SafetensorsHeaderError(Exception):
    """Why a safetensors header cannot be read; each caller raises it again as its own error, naming the file."""


def safetensors_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """A safetensors file's header (tensor name -> {dtype, shape, data_offsets}, and `__metadata__` when the file
    has it) and where its data starts, every tensor's entry checked for the fields the format gives it:
    SafetensorsHeaderError otherwise."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise SafetensorsHeaderError("not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > SAFETENSORS_MAX_HEADER:
                raise SafetensorsHeaderError(f"a header of {length} bytes (at most {SAFETENSORS_MAX_HEADER})")
            header = json.loads(fh.read(length))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SafetensorsHeaderError(f"cannot read the safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("the safetensors header is not a JSON object")
    for name, entry in header.items():
        if name != "__metadata__" and not _tensor_entry(entry):
            raise SafetensorsHeaderError(
                f"tensor {name!r}: {entry!r:.80} is not {{dtype, shape, data_offsets}} as safetensors writes them"
            )
    return header, 8 + length


def _tensor_entry(entry: Any) -> bool:
    """{dtype: text, shape: [counts], data_offsets: [begin, end]} with begin <= end."""

    def counts(value: Any) -> bool:
        return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)

    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (counts(shape) and isinstance(offsets, list) and counts(offsets) and len(offsets) == 2):
        return False
    return bool(offsets[0] <= offsets[1])
