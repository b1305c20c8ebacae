"""Framing shared by the services: a 4-byte big-endian length then a plist, and the two ways a connection
ends early (the client broke the protocol, the virtual cable was pulled)."""

from __future__ import annotations

import plistlib
import struct
from typing import Any

MAX_PLIST_FRAME = 16 * 1024 * 1024


class ProtocolViolation(Exception):
    """The client sent bytes that are not the protocol; the device drops that connection."""


class Unplugged(Exception):
    """The virtual cable was pulled while this connection was open."""


def encode_plist(obj: Any, *, binary: bool = False) -> bytes:
    payload = plistlib.dumps(obj, fmt=plistlib.FMT_BINARY if binary else plistlib.FMT_XML)
    return struct.pack(">I", len(payload)) + payload


def decode_plist(data: bytes) -> dict[str, Any]:
    try:
        obj = plistlib.loads(data)
    except Exception as exc:  # plistlib raises several types for garbage
        raise ProtocolViolation(f"not a plist: {data[:32]!r}") from exc
    if not isinstance(obj, dict):
        raise ProtocolViolation("plist root is not a dictionary")
    return obj
