"""The one place where pymobiledevice3's exceptions (and the socket errors under them) become kvrig's
DeviceError family. Every device module wraps its service calls in `device_errors(...)`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from xml.parsers.expat import ExpatError

from pymobiledevice3 import exceptions as pmd3
from pymobiledevice3.dtx.exceptions import DTXNsError, DTXProtocolError

from kvrig.exceptions import (
    AppError,
    DeveloperModeOffError,
    DeviceAnswerError,
    DeviceError,
    DeviceLockedError,
    DeviceLostError,
    DeviceNotFoundError,
    KvrigError,
    ServiceRefusedError,
)

TUNNEL_HINT = (
    "iOS 17 and later serve developer services (process control) only through a tunnel: let kvrig open one "
    "(--tunnel auto, the default) and run `kvrig devices` to see which it would use"
)

DEVELOPER_MODE_HINT = (
    "turn it on in Settings > Privacy & Security > Developer Mode (the phone restarts), or run "
    "`kvrig prepare --enable-developer-mode` on a phone without a passcode"
)

_NOT_FOUND = (pmd3.ConnectionFailedToUsbmuxdError, pmd3.DeviceNotFoundError, pmd3.NoDeviceConnectedError)
_REFUSED = (
    pmd3.InvalidServiceError,
    pmd3.StartServiceError,
    pmd3.RSDRequiredError,
    pmd3.DeviceFeatureNotSupportedError,
)
_PAIRING = (pmd3.NotTrustedError, pmd3.PairingError, pmd3.NotPairedError, pmd3.PasscodeRequiredError)
# The link went away under us: usbmuxd refuses the connect (device detached), the stream ends mid-reply.
_LOST = (
    pmd3.ConnectionFailedError,
    pmd3.ConnectionTerminatedError,
    pmd3.BadDevError,
    pmd3.MuxException,
    asyncio.IncompleteReadError,
    ConnectionError,
    EOFError,
    DTXProtocolError,
)


# What pymobiledevice3 raises while it reads a lockdownd answer that is not the protocol: it takes the plist's
# values as they come (a version of bytes, a reply that is a list, XML cut off), so a malformed phone surfaces
# as these. Caught only around reading a phone's values, where the phone is the only source of them.
_MALFORMED = (ValueError, TypeError, AttributeError, KeyError, IndexError, ExpatError)


def translate(exc: BaseException, what: str, *, udid: str | None = None, os_version: str | None = None) -> KvrigError:
    """The kvrig error for an exception raised while doing `what` on the device `udid`."""
    on = f" on {udid}" if udid else ""
    if isinstance(exc, KvrigError):
        return exc
    if isinstance(exc, _NOT_FOUND):
        if isinstance(exc, pmd3.ConnectionFailedToUsbmuxdError):
            return DeviceNotFoundError(f"{what}: cannot reach usbmuxd (is a phone attached, or a virtual one running?)")
        return DeviceNotFoundError(f"{what}: device {udid or ''} is not attached".replace("  ", " "))
    if isinstance(exc, _REFUSED):
        message = f"{what}: the device{on} refused the service ({_text(exc)})"
        hint = bool(os_version and _major(os_version) >= 17)
        return ServiceRefusedError(f"{message}; {TUNNEL_HINT}" if hint else message, tunnel_hint=hint)
    if isinstance(exc, pmd3.DeveloperModeIsNotEnabledError):
        return DeveloperModeOffError(f"{what}: Developer Mode is off{on}; {DEVELOPER_MODE_HINT}")
    if isinstance(exc, _PAIRING):
        return DeviceLockedError(
            f"{what}: the device{on} is locked or does not trust this computer ({_text(exc)}); unlock it, tap "
            "Trust when it asks, and run the command again"
        )
    if isinstance(exc, pmd3.AppInstallError):
        return AppError(f"{what}: installation failed{on}: {_text(exc)}")
    if isinstance(exc, pmd3.AppNotInstalledError):
        return AppError(f"{what}: {_text(exc)}")
    if isinstance(exc, DTXNsError):
        return AppError(f"{what}: the device{on} answered: {_text(exc)}")
    if isinstance(exc, pmd3.AfcException):
        # AfcException is an OSError too: a refused file operation, not a lost link.
        return DeviceError(f"{what}: file operation failed{on}: {_text(exc)}")
    if isinstance(exc, TimeoutError):  # an OSError too since Python 3.10: before the lost link, or it reads as one
        return DeviceLostError(f"{what}: the device{on} stopped answering (timed out)")
    if isinstance(exc, (*_LOST, OSError)):
        return DeviceLostError(f"{what}: lost the connection to the device{on} ({_text(exc)})")
    if isinstance(exc, pmd3.PyMobileDevice3Exception):
        return DeviceError(f"{what}: {_text(exc)}")
    raise exc


@asynccontextmanager
async def device_errors(what: str, *, udid: str | None = None, os_version: str | None = None) -> AsyncIterator[None]:
    try:
        yield
    except KvrigError:
        raise
    except Exception as exc:
        raise translate(exc, what, udid=udid, os_version=os_version) from exc


@asynccontextmanager
async def answer_errors(what: str, *, udid: str) -> AsyncIterator[None]:
    """`device_errors`, and a phone whose lockdownd answers break the protocol raises DeviceAnswerError."""
    try:
        async with device_errors(what, udid=udid):
            yield
    except _MALFORMED as exc:
        raise DeviceAnswerError(
            f"{what}: the device {udid} answered something that is not lockdownd's protocol "
            f"({type(exc).__name__}: {_text(exc)[:200]})"
        ) from exc


def problem_json(exc: KvrigError) -> dict[str, object]:
    """A typed error as data for --json output: its class (the cause), exit code and message."""
    return {"cause": type(exc).__name__, "exit_code": exc.exit_code, "message": str(exc)}


def _text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text or type(exc).__name__


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0
