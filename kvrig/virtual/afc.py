"""AFC (Apple File Connection) server over a host folder: the media partition, an app container
(house_arrest) or the crash-report store.

Packets: 40-byte little-endian header ("CFA6LPAA", entire length, this length, packet number, opcode) then
the operation's payload. Replies echo the packet number and carry a STATUS (u64 error code), DATA, or a
FILE_OPEN_RES / FILE_TELL_RES. Paths are confined to the served folder the way the phone's sandbox confines
them: ".." cannot climb above "/", a path outside the vended part is refused with PERM_DENIED, and a link
that points outside is not followed. A phone that lies (faults.py: claimed sizes, endless or stalling reads,
listed entries that are not there) lies here, to every AFC client.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bytestruct import CSTRING, U64_LE, BinaryParseError, ByteReader
from pymobiledevice3.services.afc import (
    AFC_HEADER_SIZE,
    AfcError,
    AfcFileSeekRequest,
    AfcFopenMode,
    AfcFopenRequest,
    AfcFopenResponse,
    AfcFreadRequest,
    AfcHeader,
    AfcLinkType,
    AfcMakeLinkRequest,
    AfcOpcode,
)

from kvrig.virtual.faults import FaultPlan
from kvrig.virtual.phone import Link
from kvrig.virtual.wire import ProtocolViolation

# The header, opcodes, status codes and request records are pymobiledevice3's (the client these serve), so an
# upstream change to the wire format shows on both sides. libimobiledevice's `afc_remove_path_and_contents`
# sends one opcode pymobiledevice3 does not declare (it recurses with REMOVE_PATH instead).
REMOVE_PATH_AND_CONTENTS = AfcOpcode(0x22)
MAX_PACKET = 64 * 1024 * 1024 + AFC_HEADER_SIZE


class AfcFailure(Exception):
    def __init__(self, code: AfcError) -> None:
        super().__init__(code.name)
        self.code = code


# AFC fopen modes -> Python open() modes
_OPEN_MODES = {
    AfcFopenMode.RDONLY: "rb",
    AfcFopenMode.RW: "r+b",
    AfcFopenMode.WRONLY: "wb",
    AfcFopenMode.WR: "w+b",
    AfcFopenMode.APPEND: "ab",
    AfcFopenMode.RDAPPEND: "a+b",
}


@dataclass
class AfcRoot:
    """A folder served over AFC; `allowed` is the one device path under which access is permitted."""

    folder: Path
    allowed: str = "/"

    def device_path(self, raw: str) -> str:
        path = posixpath.normpath("/" + raw.strip())
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
        if self.allowed != "/" and path != self.allowed and not path.startswith(self.allowed + "/"):
            raise AfcFailure(AfcError.PERM_DENIED)
        return path

    def host(self, raw: str, *, follow: bool = True) -> Path:
        host = self.folder / self.device_path(raw).lstrip("/")
        real = host.resolve() if follow else host.parent.resolve() / host.name
        if real != self.folder.resolve() and not real.is_relative_to(self.folder.resolve()):
            raise AfcFailure(AfcError.PERM_DENIED)
        return host


def _paths(payload: bytes, count: int = 1) -> list[str]:
    reader = ByteReader(payload)
    return [CSTRING.read(reader) for _ in range(count)]


def _status(code: AfcError) -> tuple[AfcOpcode, bytes]:
    return AfcOpcode.STATUS, U64_LE.build(code)


def _kv(pairs: dict[str, object]) -> bytes:
    return b"".join(f"{k}\0{v}\0".encode() for k, v in pairs.items())


class AfcSession:
    def __init__(self, root: AfcRoot, faults: Callable[[], FaultPlan] = FaultPlan) -> None:
        self.root = root
        self.faults = faults  # read at every operation: a test changes a running phone's faults
        self.handles: dict[int, IO[bytes]] = {}
        self.handle_paths: dict[int, str] = {}  # handle -> device path, for the faults that lie about a file
        self._next_handle = 1

    def read_delay_s(self, op: AfcOpcode, payload: bytes) -> float:
        """How long this phone stalls before answering a READ of a file a `slow_reads` fault names."""
        if op != AfcOpcode.READ or len(payload) < U64_LE.size:
            return 0.0
        path = self.handle_paths.get(ByteReader(payload).unpack_one(U64_LE))
        return self.faults().read_delay_s(path) if path is not None else 0.0

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def handle(self, op: AfcOpcode, payload: bytes) -> tuple[AfcOpcode, bytes]:
        """Runs one operation; returns (reply opcode, reply payload)."""
        try:
            return self._dispatch(op, payload)
        except AfcFailure as failure:
            return _status(failure.code)
        except FileNotFoundError:
            return _status(AfcError.OBJECT_NOT_FOUND)
        except IsADirectoryError:
            return _status(AfcError.OBJECT_IS_DIR)
        except FileExistsError:
            return _status(AfcError.OBJECT_EXISTS)
        except NotADirectoryError:
            # A path through a regular file: the phone says the object is not there, and when making a
            # directory, that something (the file) already exists.
            return _status(AfcError.OBJECT_EXISTS if op == AfcOpcode.MAKE_DIR else AfcError.OBJECT_NOT_FOUND)
        except PermissionError:
            return _status(AfcError.PERM_DENIED)
        except ValueError:  # a short or undecodable request (BinaryParseError is one), a bad seek
            return _status(AfcError.INVALID_ARG)

    def _dispatch(self, op: AfcOpcode, payload: bytes) -> tuple[AfcOpcode, bytes]:
        root = self.root
        if op == AfcOpcode.GET_DEVINFO:
            usage = shutil.disk_usage(root.folder)
            devinfo: dict[str, object] = {
                "Model": "iPhone",
                "FSTotalBytes": usage.total,
                "FSFreeBytes": usage.free,
                "FSBlockSize": 4096,
            }
            return AfcOpcode.DATA, _kv(devinfo)
        if op == AfcOpcode.READ_DIR:
            folder = root.host(_paths(payload)[0])
            if not folder.exists():
                raise AfcFailure(AfcError.OBJECT_NOT_FOUND)
            if not folder.is_dir():
                raise AfcFailure(AfcError.READ_ERROR)  # what a phone answers for listing a regular file
            names = [".", "..", *sorted(p.name for p in folder.iterdir()), *self.faults().phantom_entries]
            return AfcOpcode.DATA, b"".join(CSTRING.build(n) for n in names)
        if op == AfcOpcode.GET_FILE_INFO:
            device_path = _paths(payload)[0]
            path = root.host(device_path, follow=False)
            if not path.exists() and not path.is_symlink():
                raise AfcFailure(AfcError.OBJECT_NOT_FOUND)
            st = path.lstat()
            kind = "S_IFLNK" if path.is_symlink() else "S_IFDIR" if path.is_dir() else "S_IFREG"
            size = st.st_size
            if kind == "S_IFDIR":
                # APFS sizes a directory by its entries (64 bytes empty), not in 4 KiB blocks as ext4 does.
                size = 64 + 32 * sum(1 for _ in path.iterdir())
            claimed = self.faults().claimed_size(device_path) if kind == "S_IFREG" else None
            size = size if claimed is None else claimed
            info: dict[str, object] = {
                "st_size": size,
                "st_blocks": st.st_blocks,
                "st_nlink": st.st_nlink,
                "st_ifmt": kind,
                "st_mtime": st.st_mtime_ns,
                "st_birthtime": min(st.st_mtime_ns, st.st_ctime_ns),
            }
            if kind == "S_IFLNK":
                info["LinkTarget"] = os.readlink(path)
            return AfcOpcode.DATA, _kv(info)
        if op == AfcOpcode.MAKE_DIR:
            root.host(_paths(payload)[0]).mkdir(parents=True, exist_ok=True)
            return _status(AfcError.SUCCESS)
        if op in (AfcOpcode.REMOVE_PATH, REMOVE_PATH_AND_CONTENTS):
            device_path = root.device_path(_paths(payload)[0])
            if device_path in ("/", root.allowed):
                raise AfcFailure(AfcError.PERM_DENIED)
            path = root.host(device_path, follow=False)
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                if op == REMOVE_PATH_AND_CONTENTS:
                    shutil.rmtree(path)
                elif any(path.iterdir()):
                    raise AfcFailure(AfcError.DIR_NOT_EMPTY)
                else:
                    path.rmdir()
            else:
                raise AfcFailure(AfcError.OBJECT_NOT_FOUND)
            return _status(AfcError.SUCCESS)
        if op == AfcOpcode.RENAME_PATH:
            source, target = _paths(payload, 2)
            root.host(source, follow=False).rename(root.host(target, follow=False))
            return _status(AfcError.SUCCESS)
        if op == AfcOpcode.MAKE_LINK:
            link = AfcMakeLinkRequest.parse(payload)
            link_path = root.host(link.source, follow=False)
            if link.type == AfcLinkType.SYMLINK:
                link_path.symlink_to(link.target)
            else:
                os.link(root.host(link.target), link_path)
            return _status(AfcError.SUCCESS)
        if op == AfcOpcode.FILE_OPEN:
            request = AfcFopenRequest.parse(payload)
            if request.mode not in _OPEN_MODES:
                raise AfcFailure(AfcError.INVALID_ARG)
            path = root.host(request.filename)
            if path.is_dir():
                raise AfcFailure(AfcError.OBJECT_IS_DIR)
            if request.mode == AfcFopenMode.RW and not path.exists():
                path.touch()
            opened: IO[bytes] = open(path, _OPEN_MODES[request.mode])  # noqa: SIM115 - the handle outlives this call
            handle = self._next_handle
            self._next_handle += 1
            self.handles[handle] = opened
            self.handle_paths[handle] = root.device_path(request.filename)
            return AfcOpcode.FILE_OPEN_RES, AfcFopenResponse(handle=handle).build()
        if op in (
            AfcOpcode.READ,
            AfcOpcode.WRITE,
            AfcOpcode.FILE_SEEK,
            AfcOpcode.FILE_TELL,
            AfcOpcode.FILE_CLOSE,
            AfcOpcode.FILE_SET_SIZE,
            AfcOpcode.FILE_LOCK,
        ):
            # Every handle operation starts with the u64 handle; READ and SET_SIZE follow it with a u64 size.
            reader = ByteReader(payload)
            handle = reader.unpack_one(U64_LE)
            f = self.handles.get(handle)
            if f is None:
                raise AfcFailure(AfcError.INVALID_ARG)
            if op == AfcOpcode.READ:
                size = AfcFreadRequest.parse(payload).size
                if self.faults().endless(self.handle_paths[handle]):
                    return AfcOpcode.DATA, (b"x\n" * (size // 2 + 1))[:size]
                return AfcOpcode.DATA, f.read(size)
            if op == AfcOpcode.WRITE:
                f.write(reader.read_all())
                return _status(AfcError.SUCCESS)
            if op == AfcOpcode.FILE_SEEK:
                seek = AfcFileSeekRequest.parse(payload)
                f.seek(seek.offset, seek.whence)
                return _status(AfcError.SUCCESS)
            if op == AfcOpcode.FILE_TELL:
                return AfcOpcode.FILE_TELL_RES, U64_LE.build(f.tell())
            if op == AfcOpcode.FILE_SET_SIZE:
                f.truncate(reader.unpack_one(U64_LE))
                return _status(AfcError.SUCCESS)
            if op == AfcOpcode.FILE_CLOSE:
                self.handles.pop(handle).close()
                self.handle_paths.pop(handle, None)
            return _status(AfcError.SUCCESS)
        if op == AfcOpcode.SET_FILE_TIME:
            return _status(AfcError.SUCCESS)
        raise AfcFailure(AfcError.UNKNOWN_PACKET_TYPE)


async def serve_afc(link: Link, root: AfcRoot) -> None:
    session = AfcSession(root, lambda: link.device.faults)
    try:
        while True:
            try:
                header = AfcHeader.parse(await link.recv_exactly(AFC_HEADER_SIZE))
            except BinaryParseError as exc:  # the magic is declared constant in the header record
                raise ProtocolViolation(f"bad AFC header: {exc}") from exc
            entire = header.entire_length
            if entire < AFC_HEADER_SIZE or entire > MAX_PACKET:
                raise ProtocolViolation(f"bad AFC header length {entire}")
            payload = await link.recv_exactly(entire - AFC_HEADER_SIZE) if entire > AFC_HEADER_SIZE else b""
            if delay := session.read_delay_s(header.operation, payload):
                await asyncio.sleep(delay)
            reply_op, reply = session.handle(header.operation, payload)
            length = AFC_HEADER_SIZE + len(reply)
            reply_header = AfcHeader(
                entire_length=length, this_length=length, packet_num=header.packet_num, operation=reply_op
            )
            await link.send(reply_header.build() + reply)
    finally:
        session.close()


async def serve_media(link: Link) -> None:
    await serve_afc(link, AfcRoot(link.device.state.media))
