"""Which usbmuxd to dial. libimobiledevice's tools read `USBMUXD_SOCKET_ADDRESS` as `UNIX:/path` or
`HOST:PORT`; pymobiledevice3 reads it as a bare path or `HOST:PORT` and fails on the `UNIX:` form. kvrig takes
all three, so one exported variable serves both clients, and hands pymobiledevice3 its own form."""

from __future__ import annotations

import os
import sys
from typing import Final

from kvrig.exceptions import UsbmuxAddressError

ENV: Final = "USBMUXD_SOCKET_ADDRESS"
UNIX_PREFIX: Final = "UNIX:"
EXPECTED: Final = "UNIX:/path/to/socket, /path/to/socket or HOST:PORT"


def client_form(path: str) -> str:
    """What to export for a socket path so libimobiledevice's tools and kvrig both find it."""
    return f"{UNIX_PREFIX}{path}"


def usbmux_address(text: str, *, field: str = ENV) -> str:
    """`UNIX:/path`, `/path` or `HOST:PORT` in pymobiledevice3's form (a path, or HOST:PORT); anything else is
    UsbmuxAddressError naming `field` (the variable or option it came from)."""
    value = text.strip()
    if value.startswith(UNIX_PREFIX):
        value = value[len(UNIX_PREFIX) :]
        if not value:
            raise UsbmuxAddressError(f"{text!r}: UNIX: names no socket path", field=field, expected=EXPECTED)
        return _socket_path(value, field)
    if value.startswith(("/", ".")):
        return _socket_path(value, field)
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise UsbmuxAddressError(f"{text!r} is neither a socket path nor HOST:PORT", field=field, expected=EXPECTED)
    if ":" in host:  # pymobiledevice3 11.45's usbmux splits the address at its colon: it cannot dial IPv6
        raise UsbmuxAddressError(
            f"{text!r}: an IPv6 address (pymobiledevice3 cannot dial usbmuxd over IPv6)",
            field=field,
            expected="a host name or IPv4 address, HOST:PORT",
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsbmuxAddressError(f"{text!r}: {port!r} is not a TCP port", field=field, expected=EXPECTED)
    return value


# sockaddr_un's sun_path, its closing NUL included: 104 bytes on macOS (and the BSDs), 108 on Linux.
MAX_SOCKET_PATH = 104 if sys.platform != "linux" else 108


def _socket_path(path: str, field: str) -> str:
    size = len(os.fsencode(path))
    if size >= MAX_SOCKET_PATH:
        raise UsbmuxAddressError(
            f"{path!r}: a socket path of {size} bytes; this system's hold at most {MAX_SOCKET_PATH - 1}",
            field=field,
            expected="a shorter socket path, e.g. /tmp/kvrig-usbmuxd.sock",
        )
    return path


def resolve(address: str | None) -> str | None:
    """`address` if given, else `USBMUXD_SOCKET_ADDRESS` if set, in pymobiledevice3's form; None: the system's
    usbmuxd."""
    if address is not None:
        return usbmux_address(address, field="usbmuxd address")
    env = os.environ.get(ENV)
    return usbmux_address(env) if env else None
