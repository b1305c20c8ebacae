"""AFC (Apple File Connection) server over a host folder: the media partition, an app container
(house_arrest) or the crash-report store.

Packets: 40-byte little-endian header ("CFA6LPAA", entire length, this length, packet number, opcode) then
the operation's payload. Replies echo the packet number and carry a STATUS (u64 error code), DATA, or a
FILE_OPEN_RES / FILE_TELL_RES. Paths are confined to the served folder the way the phone's sandbox confines
them: ".." cannot climb above "/", a path outside the vended part is refused with PERM_DENIED, and a link
that points outside is not followed.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import IO

from toolchain.virtual.wire import Link, ProtocolViolation

MAGIC = b"CFA6LPAA"
HEADER = struct.Struct("<8sQQQQ")
MAX_PACKET = 64 * 1024 * 1024 + HEADER.size


class Op(IntEnum):
    STATUS = 0x01
    DATA = 0x02
    READ_DIR = 0x03
    REMOVE_PATH = 0x08
    MAKE_DIR = 0x09
    GET_FILE_INFO = 0x0A
    GET_DEVINFO = 0x0B
    FILE_OPEN = 0x0D
    FILE_OPEN_RES = 0x0E
    READ = 0x0F
    WRITE = 0x10
    FILE_SEEK = 0x11
    FILE_TELL = 0x12
    FILE_TELL_RES = 0x13
    FILE_CLOSE = 0x14
    FILE_SET_SIZE = 0x15
    RENAME_PATH = 0x18
    FILE_LOCK = 0x1B
    MAKE_LINK = 0x1C
    SET_FILE_TIME = 0x1E
    REMOVE_PATH_AND_CONTENTS = 0x22


class Err(IntEnum):
    SUCCESS = 0
    UNKNOWN_ERROR = 1
    READ_ERROR = 4
    UNKNOWN_PACKET_TYPE = 6
    INVALID_ARG = 7
    OBJECT_NOT_FOUND = 8
    OBJECT_IS_DIR = 9
    PERM_DENIED = 10
    OBJECT_EXISTS = 16
    DIR_NOT_EMPTY = 33


class AfcFailure(Exception):
    def __init__(self, code: Err) -> None:
        super().__init__(code.name)
        self.code = code


# AFC fopen modes -> Python open() modes
_OPEN_MODES = {1: "rb", 2: "r+b", 3: "wb", 4: "w+b", 5: "ab", 6: "a+b"}


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
            raise AfcFailure(Err.PERM_DENIED)
        return path

    def host(self, raw: str, *, follow: bool = True) -> Path:
        host = self.folder / self.device_path(raw).lstrip("/")
        real = host.resolve() if follow else host.parent.resolve() / host.name
        if real != self.folder.resolve() and not real.is_relative_to(self.folder.resolve()):
            raise AfcFailure(Err.PERM_DENIED)
        return host


def _cstrings(data: bytes) -> list[str]:
    try:
        return [part.decode() for part in data.split(b"\0")[:-1]]
    except UnicodeDecodeError as exc:
        raise AfcFailure(Err.INVALID_ARG) from exc


def _kv(pairs: dict[str, object]) -> bytes:
    return b"".join(f"{k}\0{v}\0".encode() for k, v in pairs.items())


class AfcSession:
    def __init__(self, root: AfcRoot) -> None:
        self.root = root
        self.handles: dict[int, IO[bytes]] = {}
        self._next_handle = 1

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def handle(self, op: int, payload: bytes) -> tuple[int, bytes]:
        """Runs one operation; returns (reply opcode, reply payload)."""
        try:
            return self._dispatch(op, payload)
        except AfcFailure as failure:
            return Op.STATUS, struct.pack("<Q", failure.code)
        except FileNotFoundError:
            return Op.STATUS, struct.pack("<Q", Err.OBJECT_NOT_FOUND)
        except IsADirectoryError:
            return Op.STATUS, struct.pack("<Q", Err.OBJECT_IS_DIR)
        except FileExistsError:
            return Op.STATUS, struct.pack("<Q", Err.OBJECT_EXISTS)
        except NotADirectoryError:
            # A path through a regular file: the phone says the object is not there, and when making a
            # directory, that something (the file) already exists.
            code = Err.OBJECT_EXISTS if op == Op.MAKE_DIR else Err.OBJECT_NOT_FOUND
            return Op.STATUS, struct.pack("<Q", code)
        except PermissionError:
            return Op.STATUS, struct.pack("<Q", Err.PERM_DENIED)
        except (struct.error, ValueError):
            return Op.STATUS, struct.pack("<Q", Err.INVALID_ARG)

    def _ok(self) -> tuple[int, bytes]:
        return Op.STATUS, struct.pack("<Q", Err.SUCCESS)

    def _dispatch(self, op: int, payload: bytes) -> tuple[int, bytes]:
        root = self.root
        if op == Op.GET_DEVINFO:
            usage = shutil.disk_usage(root.folder)
            devinfo: dict[str, object] = {
                "Model": "iPhone",
                "FSTotalBytes": usage.total,
                "FSFreeBytes": usage.free,
                "FSBlockSize": 4096,
            }
            return Op.DATA, _kv(devinfo)
        if op == Op.READ_DIR:
            folder = root.host(_cstrings(payload)[0])
            if not folder.exists():
                raise AfcFailure(Err.OBJECT_NOT_FOUND)
            if not folder.is_dir():
                raise AfcFailure(Err.READ_ERROR)  # what a phone answers for listing a regular file
            names = [".", "..", *sorted(p.name for p in folder.iterdir())]
            return Op.DATA, b"".join(n.encode() + b"\0" for n in names)
        if op == Op.GET_FILE_INFO:
            path = root.host(_cstrings(payload)[0], follow=False)
            if not path.exists() and not path.is_symlink():
                raise AfcFailure(Err.OBJECT_NOT_FOUND)
            st = path.lstat()
            kind = "S_IFLNK" if path.is_symlink() else "S_IFDIR" if path.is_dir() else "S_IFREG"
            size = st.st_size
            if kind == "S_IFDIR":
                # APFS sizes a directory by its entries (64 bytes empty), not in 4 KiB blocks as ext4 does.
                size = 64 + 32 * sum(1 for _ in path.iterdir())
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
            return Op.DATA, _kv(info)
        if op == Op.MAKE_DIR:
            root.host(_cstrings(payload)[0]).mkdir(parents=True, exist_ok=True)
            return self._ok()
        if op in (Op.REMOVE_PATH, Op.REMOVE_PATH_AND_CONTENTS):
            device_path = root.device_path(_cstrings(payload)[0])
            if device_path in ("/", root.allowed):
                raise AfcFailure(Err.PERM_DENIED)
            path = root.host(device_path, follow=False)
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                if op == Op.REMOVE_PATH_AND_CONTENTS:
                    shutil.rmtree(path)
                elif any(path.iterdir()):
                    raise AfcFailure(Err.DIR_NOT_EMPTY)
                else:
                    path.rmdir()
            else:
                raise AfcFailure(Err.OBJECT_NOT_FOUND)
            return self._ok()
        if op == Op.RENAME_PATH:
            source, target = _cstrings(payload)[:2]
            root.host(source, follow=False).rename(root.host(target, follow=False))
            return self._ok()
        if op == Op.MAKE_LINK:
            (kind,) = struct.unpack_from("<Q", payload)
            target, source = _cstrings(payload[8:])[:2]
            link_path = root.host(source, follow=False)
            if kind == 2:
                link_path.symlink_to(target)
            else:
                os.link(root.host(target), link_path)
            return self._ok()
        if op == Op.FILE_OPEN:
            (mode,) = struct.unpack_from("<Q", payload)
            if mode not in _OPEN_MODES:
                raise AfcFailure(Err.INVALID_ARG)
            path = root.host(_cstrings(payload[8:])[0])
            if path.is_dir():
                raise AfcFailure(Err.OBJECT_IS_DIR)
            if mode == 2 and not path.exists():
                path.touch()
            opened: IO[bytes] = open(path, _OPEN_MODES[mode])  # noqa: SIM115 - the handle outlives this call
            handle = self._next_handle
            self._next_handle += 1
            self.handles[handle] = opened
            return Op.FILE_OPEN_RES, struct.pack("<Q", handle)
        if op in (
            Op.READ,
            Op.WRITE,
            Op.FILE_SEEK,
            Op.FILE_TELL,
            Op.FILE_CLOSE,
            Op.FILE_SET_SIZE,
            Op.FILE_LOCK,
        ):
            (handle,) = struct.unpack_from("<Q", payload)
            f = self.handles.get(handle)
            if f is None:
                raise AfcFailure(Err.INVALID_ARG)
            if op == Op.READ:
                (size,) = struct.unpack_from("<Q", payload, 8)
                return Op.DATA, f.read(size)
            if op == Op.WRITE:
                f.write(payload[8:])
                return self._ok()
            if op == Op.FILE_SEEK:
                whence, offset = struct.unpack_from("<Qq", payload, 8)
                f.seek(offset, whence)
                return self._ok()
            if op == Op.FILE_TELL:
                return Op.FILE_TELL_RES, struct.pack("<Q", f.tell())
            if op == Op.FILE_SET_SIZE:
                (size,) = struct.unpack_from("<Q", payload, 8)
                f.truncate(size)
                return self._ok()
            if op == Op.FILE_CLOSE:
                self.handles.pop(handle).close()
            return self._ok()
        if op == Op.SET_FILE_TIME:
            return self._ok()
        raise AfcFailure(Err.UNKNOWN_PACKET_TYPE)


async def serve_afc(link: Link, root: AfcRoot) -> None:
    session = AfcSession(root)
    try:
        while True:
            magic, entire, _this, packet_num, op = HEADER.unpack(await link.recv_exactly(HEADER.size))
            if magic != MAGIC or entire < HEADER.size or entire > MAX_PACKET:
                raise ProtocolViolation(f"bad AFC header {magic!r} length {entire}")
            payload = await link.recv_exactly(entire - HEADER.size) if entire > HEADER.size else b""
            reply_op, reply = session.handle(op, payload)
            length = HEADER.size + len(reply)
            await link.send(HEADER.pack(MAGIC, length, length, packet_num, reply_op) + reply)
    finally:
        session.close()


async def serve_media(link: Link) -> None:
    await serve_afc(link, AfcRoot(link.device.state.media))
