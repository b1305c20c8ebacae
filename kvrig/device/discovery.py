"""Finding phones through usbmuxd and opening a lockdown session to one.

A real phone and the virtual iPhone look the same here: usbmuxd lists them (`USBMUXD_SOCKET_ADDRESS` in
libimobiledevice's or pymobiledevice3's form, address.py), lockdownd tells us ProductType and iOS version, and
the ProductType maps to one of our device profiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

from pymobiledevice3 import usbmux
from pymobiledevice3.exceptions import ConnectionFailedToUsbmuxdError, MuxException
from pymobiledevice3.lockdown import LockdownClient, create_using_usbmux
from pymobiledevice3.lockdown_service_provider import LockdownServiceProvider

from kvrig.device.address import resolve
from kvrig.device.errors import answer_errors, device_errors, translate
from kvrig.device.tunnel import Tunnel, same_udid
from kvrig.exceptions import DeviceAnswerError, DeviceError, DeviceLockedError, DeviceLostError, DeviceNotFoundError
from kvrig.profiles import find_profile_by_product_type
from kvrig.schemas.keys import VIRTUAL_KEY


@dataclass(frozen=True)
class DeviceInfo:
    udid: str
    connection: str
    product_type: str | None = None
    os_version: str | None = None
    build_version: str | None = None
    name: str | None = None
    profile: str | None = None
    error: str | None = None  # why lockdownd could not be asked (not trusted, refused)
    host: str | None = None  # the usbmuxd host it was found on (device/hosts.py)
    virtual: bool = False  # kvrig's virtual iPhone: its app runs MLX on the host's CPU, not on Metal
    problem: DeviceError | None = field(default=None, compare=False, repr=False)  # the same, typed

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "problem"}

    @property
    def os_major(self) -> int:
        try:
            return int((self.os_version or "0").split(".")[0])
        except ValueError:
            return 0


def profile_for(product_type: str | None) -> str | None:
    """Our device profile's name for a ProductType; None when we have no profile for it."""
    if not product_type:
        return None
    profile = find_profile_by_product_type(product_type)
    return profile.name if profile is not None else None


# The shape of each device value kvrig uses; a phone that answers anything else is described without it and
# with the reason (DeviceAnswerError), never trusted further.
_VALUES: dict[str, tuple[re.Pattern[str], str]] = {
    "ProductType": (re.compile(r"[A-Za-z]{2,16}\d{1,4},\d{1,4}"), "a model identifier like iPhone16,1"),
    "ProductVersion": (re.compile(r"\d{1,4}(\.\d{1,4}){0,3}"), "an iOS version like 17.4"),
    "BuildVersion": (re.compile(r"[0-9A-Za-z]{1,16}"), "a build like 21E219"),
    "DeviceName": (re.compile(r"[^\x00-\x1f\x7f]{0,255}"), "a name of at most 255 printable characters"),
}


def _value(udid: str, values: dict[str, Any], key: str, problems: list[str]) -> str | None:
    value = values.get(key)
    if value is None:
        return None
    pattern, expected = _VALUES[key]
    if isinstance(value, str) and pattern.fullmatch(value):
        return value
    shown = repr(value) if len(repr(value)) <= 40 else f"{type(value).__name__} of {len(repr(value))} characters"
    problems.append(f"{key} is {shown} (expected {expected})")
    return None


def _info(udid: str, connection: str, values: dict[str, Any]) -> DeviceInfo:
    """What lockdownd says of a phone; values of the wrong type or shape are left out and named in `error`."""
    problems: list[str] = []
    product_type = _value(udid, values, "ProductType", problems)
    info = DeviceInfo(
        udid=udid,
        connection=connection,
        product_type=product_type,
        os_version=_value(udid, values, "ProductVersion", problems),
        build_version=_value(udid, values, "BuildVersion", problems),
        name=_value(udid, values, "DeviceName", problems),
        profile=profile_for(product_type),
        virtual=values.get(VIRTUAL_KEY) is True,
    )
    if not problems:
        return info
    problem = DeviceAnswerError(f"reading device values: the device {udid} answered: {'; '.join(problems)}")
    return dataclasses.replace(info, error=str(problem), problem=problem)


SYSTEM_USBMUXD = "/var/run/usbmuxd"  # where usbmuxd listens on macOS and Linux, and pymobiledevice3 looks
WIFI_ONLY = "reachable over Wi-Fi only; kvrig drives phones over USB: connect it with a cable"


async def list_devices(*, usbmux_address: str | None = None) -> list[DeviceInfo]:
    """Every device usbmuxd knows, USB first, each described by lockdownd (or with the reason it could not be)."""
    usbmux_address = resolve(usbmux_address)
    async with device_errors("listing devices"):
        try:
            mux_devices = await usbmux.list_devices(usbmux_address=usbmux_address)
        except PermissionError as exc:  # a socket this user may not open: not a phone that went away
            raise DeviceNotFoundError(
                f"listing devices: cannot reach usbmuxd: this user may not open its socket "
                f"{usbmux_address or SYSTEM_USBMUXD} ({exc.strerror}); usbmuxd makes it writable by everyone: check "
                "its permissions (ls -l) and who made it"
            ) from exc
        except ConnectionFailedToUsbmuxdError as exc:  # nothing listens there: say where kvrig looked
            where = (
                usbmux_address or f"{SYSTEM_USBMUXD} (the system's; USBMUXD_SOCKET_ADDRESS or --usbmuxd name another)"
            )
            raise DeviceNotFoundError(
                f"listing devices: cannot reach usbmuxd at {where}: is a phone attached, or a virtual one running?"
            ) from exc
    found: list[DeviceInfo] = []
    seen: set[str] = set()
    for mux in sorted(mux_devices, key=lambda d: (not d.is_usb, d.serial)):
        if mux.serial in seen:  # the same phone over USB and Wi-Fi
            continue
        seen.add(mux.serial)
        if not mux.is_usb:  # a Mac lists phones it reaches over Wi-Fi; kvrig never talks to them that way
            problem = DeviceNotFoundError(f"{mux.serial}: {WIFI_ONLY}")
            found.append(
                DeviceInfo(udid=mux.serial, connection=mux.connection_type, error=str(problem), problem=problem)
            )
            continue
        try:
            async with answer_errors("reading device values", udid=mux.serial):
                lockdown = await create_using_usbmux(
                    serial=mux.serial,
                    autopair=False,
                    usbmux_address=usbmux_address,
                    connection_type=mux.connection_type,
                )
                try:
                    values = dict(lockdown.all_values)
                finally:
                    await lockdown.close()
        except DeviceError as exc:
            found.append(DeviceInfo(udid=mux.serial, connection=mux.connection_type, error=str(exc), problem=exc))
            continue
        found.append(_info(mux.serial, mux.connection_type, values))
    return found


async def select_device(udid: str | None = None, *, usbmux_address: str | None = None) -> DeviceInfo:
    """The device with this UDID, or the only attached one when `udid` is None."""
    devices = await list_devices(usbmux_address=usbmux_address)
    if udid is not None:
        for device in devices:
            if same_udid(device.udid, udid):  # with or without the hyphen, as hosts spell it
                if device.connection != "USB":
                    raise DeviceNotFoundError(f"device {device.udid}: {WIFI_ONLY}")
                return device
        attached = ", ".join(d.udid for d in devices) or "none"
        raise DeviceNotFoundError(f"device {udid} is not attached (attached: {attached})")
    wifi = [d for d in devices if d.connection != "USB"]
    devices = [d for d in devices if d.connection == "USB"]
    if not devices and wifi:
        raise DeviceNotFoundError(f"no device attached over USB ({', '.join(d.udid for d in wifi)}: {WIFI_ONLY})")
    if not devices:
        raise DeviceNotFoundError("no device attached (connect an iPhone, or start one with `kvrig virtual start`)")
    if len(devices) > 1:
        listing = ", ".join(f"{d.udid} ({d.product_type}, iOS {d.os_version})" for d in devices)
        raise DeviceNotFoundError(f"{len(devices)} devices attached: {listing}; choose one with --udid")
    return devices[0]


RESTART_S = 300.0
"""How long a restarting phone may take to leave usbmuxd and come back (about a minute; more for an old phone)."""


class Device:
    """An open lockdown session to one phone; every service starts from it. Use `async with connect(...)`.

    `tunnel` (iOS 17+) carries the developer services; `developer` is the provider they start from: the
    tunnel's RSD when there is one, lockdown otherwise."""

    def __init__(
        self, info: DeviceInfo, lockdown: LockdownClient, usbmux_address: str | None, tunnel: Tunnel | None = None
    ) -> None:
        self.info = info
        self.lockdown = lockdown
        self.usbmux_address = usbmux_address
        self.tunnel = tunnel

    @property
    def udid(self) -> str:
        return self.info.udid

    @property
    def developer(self) -> LockdownServiceProvider:
        if self.tunnel is not None and self.tunnel.rsd is not None:
            return self.tunnel.rsd
        return self.lockdown

    def errors(self, what: str):  # type: ignore[no-untyped-def]
        """`async with device.errors("pushing"):` — pymobiledevice3 errors as kvrig's, naming this device."""
        return device_errors(what, udid=self.udid, os_version=self.info.os_version)

    def translate(self, exc: BaseException, what: str) -> Exception:
        return translate(exc, what, udid=self.udid, os_version=self.info.os_version)

    async def reconnect(self) -> None:
        """A fresh lockdown session and tunnel (after the phone was unplugged and came back)."""
        await self.close()
        self.lockdown = await _session("reconnecting", self.udid, self.usbmux_address)
        if self.tunnel is not None:
            await self.tunnel.open()

    async def restarted(self, timeout_s: float = RESTART_S, poll_s: float = 0.5) -> None:
        """Waits for the phone to leave usbmuxd and come back over USB (it restarts), then opens a fresh session:
        DeviceLostError when that takes longer than `timeout_s`. pymobiledevice3's own wait (AMFI's) has no
        bound and pairs when the phone asks."""
        deadline = time.monotonic() + timeout_s
        gone = False
        while time.monotonic() < deadline:
            try:
                listed = await asyncio.wait_for(usbmux.list_devices(usbmux_address=self.usbmux_address), poll_s + 5)
            except (TimeoutError, MuxException, OSError):
                listed = []  # usbmuxd restarting with the phone (macOS does): the phone is not back yet
            here = any(same_udid(d.serial, self.udid) and d.connection_type == "USB" for d in listed)
            if gone and here:
                try:
                    await self.reconnect()
                    return
                except (DeviceLostError, DeviceNotFoundError):
                    pass  # listed as soon as USB enumerates, before lockdownd answers: asked again
            gone = gone or not here
            await asyncio.sleep(poll_s)
        state = "did not come back" if gone else "did not restart"
        raise DeviceLostError(f"{self.udid}: {state} within {timeout_s:g} s; check the phone and run the command again")

    async def reopen_tunnel(self) -> None:
        """The phone is still there but its tunnel dropped: open a new one over the same lockdown session."""
        if self.tunnel is not None:
            await self.tunnel.reopen()

    async def close(self) -> None:
        if self.tunnel is not None:
            await self.tunnel.close()
        with contextlib.suppress(Exception):  # closing a session whose link is already gone
            await self.lockdown.close()

    async def __aenter__(self) -> Device:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(udid: str | None = None, *, usbmux_address: str | None = None) -> Device:
    """Opens a lockdown session to the selected device (pairing through usbmuxd's pair record)."""
    usbmux_address = resolve(usbmux_address)
    info = await select_device(udid, usbmux_address=usbmux_address)
    if isinstance(info.problem, DeviceAnswerError):
        raise info.problem  # a phone whose answers break the protocol is not trusted with a session
    # A phone lockdownd could not describe (locked, not trusted) is asked again: the typed error says why.
    lockdown = await _session("connecting", info.udid, usbmux_address)
    if info.error:
        with contextlib.suppress(Exception):
            info = _info(info.udid, info.connection, dict(lockdown.all_values))
    return Device(info, lockdown, usbmux_address)


UNTRUSTED_HINT = (
    "unlock it and pair it once: `idevicepair pair` or `pymobiledevice3 lockdown pair` (or open it in Finder on a "
    "Mac), tap Trust on the phone, and run the command again"
)


async def _session(what: str, udid: str, usbmux_address: str | None) -> LockdownClient:
    """A paired lockdown session. Never pairs: pymobiledevice3's autopair waits, with no bound, for someone to tap
    Trust, so a phone that does not trust this computer would hold every command (and a lab worker) forever."""
    async with answer_errors(what, udid=udid):
        lockdown = await create_using_usbmux(
            serial=udid, autopair=False, usbmux_address=usbmux_address, connection_type="USB"
        )
    if lockdown.paired:
        return lockdown
    with contextlib.suppress(Exception):
        await lockdown.close()
    raise DeviceLockedError(
        f"{what}: the device {udid} does not trust this computer (no pair record it accepts); {UNTRUSTED_HINT}"
    )
