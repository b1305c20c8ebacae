"""Tunnels to iOS 17+ phones: from iOS 17 developer services (process control) are reachable only through
RemoteServiceDiscovery (RSD) inside a tunnel; lockdown keeps serving everything else.

`--tunnel auto|userspace|tunneld[=HOST:PORT]|none`:
- userspace: pymobiledevice3's no-root in-process tunnel over lockdown's CoreDeviceProxy service (iOS 17.4+).
  Its network stack is process-wide, so one process holds one userspace tunnel: a lab runs one worker
  process per iOS 17+ phone.
- tunneld: an RSD served by a running `pymobiledevice3 remote tunneld` (root; any iOS 17), through a tunnel to
  the phone that tunneld does not name as one over the network (`NETWORK_TUNNEL`).
- auto: tunneld when it is reachable and serves this phone over USB, else userspace (17.4+), else a refusal that says
  what to do. Phones before iOS 17 need no tunnel ("lockdown").
pymobiledevice3's Wi-Fi fallback (RemotePairing found by bonjour browsing) is never used: it sends
multicast off the machine, and kvrig drives USB phones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pymobiledevice3 import exceptions as pmd3
from pymobiledevice3.remote.remote_service_discovery import RemoteServiceDiscoveryService
from pymobiledevice3.tunneld.api import TUNNELD_DEFAULT_ADDRESS, get_tunneld_tunnels

from kvrig.compat.pymobiledevice3_tunneld import connect_listed
from kvrig.device.address import resolve
from kvrig.device.errors import translate
from kvrig.exceptions import InputError, KvrigError, NoTunnelError, TunnelHandshakeTimeoutError
from kvrig.schemas.results import udid_key

Mode = Literal["auto", "userspace", "tunneld", "none"]
Kind = Literal["lockdown", "userspace", "tunneld"]
MODES: tuple[Mode, ...] = ("auto", "userspace", "tunneld", "none")
CORE_DEVICE_PROXY_FROM = (17, 4)  # the first iOS with lockdown's CoreDeviceProxy service
HANDSHAKE_TIMEOUT_S = 20.0

# The interpreter kvrig runs in holds pymobiledevice3 (sudo's python3 is the system's); tunneld's Wi-Fi and
# mobdev2 monitors would serve the phone over the network, where kvrig never soaks.
TUNNELD_COMMAND = f"sudo {sys.executable} -m pymobiledevice3 remote tunneld --no-wifi --no-mobdev2"
TUNNELD_HINT = f"start `{TUNNELD_COMMAND}` on this computer and pass --tunnel tunneld"
NETWORK_TUNNEL = re.compile(r"usbmux-.+-Network|mobdev2-.+")
"""The `interface` of a tunnel tunneld names as running over the network: a Wi-Fi usbmux connection or a mobdev2
one. Its Wi-Fi RemotePairing tunnels are named by the phone's address, as its USB (NCM) ones are: nothing in the
listing tells them apart, so kvrig's tunneld command turns them off (--no-wifi)."""
OLD_17_HINT = (
    "iOS {version} has no CoreDeviceProxy service (it came with iOS 17.4), so kvrig cannot open a tunnel "
    "without root: " + TUNNELD_HINT + ", or update the phone to iOS 17.4 or later"
)


@dataclass(frozen=True)
class TunnelMode:
    """What the user asked for (`--tunnel`)."""

    mode: Mode = "auto"
    tunneld: tuple[str, int] = TUNNELD_DEFAULT_ADDRESS

    @classmethod
    def parse(cls, text: str | TunnelMode | None) -> TunnelMode:
        if isinstance(text, TunnelMode):
            return text
        if text is None:
            return cls()
        name, _, address = text.partition("=")
        if name not in MODES or (address and name != "tunneld"):
            raise InputError(
                f"unknown tunnel mode {text!r}", field="--tunnel", expected="auto, userspace, tunneld[=HOST:PORT], none"
            )
        if not address:
            return cls(name)  # type: ignore[arg-type]
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"bad tunneld address {address!r}", field="--tunnel", expected="tunneld=HOST:PORT")
        return cls("tunneld", (host.strip("[]"), int(port)))

    def __str__(self) -> str:
        if self.mode == "tunneld" and self.tunneld != TUNNELD_DEFAULT_ADDRESS:
            return f"tunneld={self.tunneld[0]}:{self.tunneld[1]}"
        return self.mode


@dataclass(frozen=True)
class TunnelPlan:
    """Which tunnel kvrig would use for one phone (`kind` None: none is possible; `reason` says what to do)."""

    kind: Kind | None
    reason: str
    mode: str = "auto"
    tunneld: str | None = None  # HOST:PORT when kind is "tunneld"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def version_tuple(version: str | None) -> tuple[int, int]:
    parts = (version or "0").split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return 0, 0


def same_udid(a: str, b: str) -> bool:
    return udid_key(a) == udid_key(b)


async def tunneld_tunnels(udid: str, address: tuple[str, int]) -> tuple[str, list[dict[str, Any]]] | None:
    """The key under which the tunneld at `address` lists `udid` and its tunnels to it ("" and [] if none), or
    None if it is not reachable."""
    try:
        listing = await get_tunneld_tunnels(address)
    except pmd3.TunneldConnectionError:
        return None
    if not isinstance(listing, dict):
        return "", []
    key = next((k for k in listing if isinstance(k, str) and same_udid(k, udid)), "")
    tunnels = listing.get(key) if key else None
    return key, [t for t in tunnels if isinstance(t, dict)] if isinstance(tunnels, list) else []


def over_usb(tunnels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tunnels of a tunneld listing that do not run over the network (`NETWORK_TUNNEL`)."""
    return [t for t in tunnels if not NETWORK_TUNNEL.fullmatch(str(t.get("interface", "")))]


def unusable(listed: tuple[str, list[dict[str, Any]]] | None) -> str | None:
    """Why a tunneld (its `tunneld_tunnels`) cannot serve the phone over USB; None when it can."""
    if listed is None:
        return "is not reachable"
    tunnels = listed[1]
    if over_usb(tunnels):
        return None
    if not tunnels:
        return "holds no tunnel to this phone"
    names = ", ".join(str(t.get("interface")) for t in tunnels)
    return f"holds tunnels to this phone over the network only ({names}), and kvrig soaks over USB"


async def plan_tunnel(udid: str, os_version: str | None, mode: TunnelMode | str | None = None) -> TunnelPlan:
    """Decides (without opening anything) which tunnel to use for this phone."""
    mode = TunnelMode.parse(mode)
    version = version_tuple(os_version)
    where = f"{mode.tunneld[0]}:{mode.tunneld[1]}"
    if version[0] < 17:
        return TunnelPlan("lockdown", f"iOS {os_version} serves developer services over lockdown", str(mode))
    if mode.mode == "none":
        why = f"iOS {os_version} needs a tunnel for process control and --tunnel none was given"
        return TunnelPlan(None, why, "none")
    if mode.mode in ("auto", "tunneld"):
        refused = unusable(await tunneld_tunnels(udid, mode.tunneld))
        if refused is None:
            return TunnelPlan("tunneld", f"tunneld at {where} serves this phone over USB", str(mode), where)
        if mode.mode == "tunneld":
            return TunnelPlan(None, f"tunneld at {where} {refused}; {TUNNELD_HINT}", str(mode))
    if version >= CORE_DEVICE_PROXY_FROM:
        return TunnelPlan("userspace", "no-root userspace tunnel over CoreDeviceProxy (iOS 17.4+)", str(mode))
    return TunnelPlan(None, OLD_17_HINT.format(version=os_version), str(mode))


# The userspace stack is one per process; which phone holds it (kvrig's own record, so a second phone gets a
# clear refusal instead of pymobiledevice3's generic one).
_userspace_holder: str | None = None


@contextlib.contextmanager
def _usbmux_env(address: str | None) -> Iterator[None]:
    """pymobiledevice3's userspace tunnel finds usbmuxd only through USBMUXD_SOCKET_ADDRESS; point it at ours
    (or at the exported one, in the form pymobiledevice3 reads)."""
    address = resolve(address)
    if address is None:
        yield
        return
    previous = os.environ.get("USBMUXD_SOCKET_ADDRESS")
    os.environ["USBMUXD_SOCKET_ADDRESS"] = address
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("USBMUXD_SOCKET_ADDRESS", None)
        else:
            os.environ["USBMUXD_SOCKET_ADDRESS"] = previous


class Tunnel:
    """One phone's tunnel and its connected RSD: opened once, held for a whole soak or lab run, reopened
    after the phone comes back. `rsd` is None for a phone that needs no tunnel (before iOS 17)."""

    def __init__(
        self,
        udid: str,
        plan: TunnelPlan,
        *,
        os_version: str | None = None,
        usbmux_address: str | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.udid, self.plan, self.os_version = udid, plan, os_version
        self.usbmux_address = usbmux_address
        self.handshake_timeout_s = handshake_timeout_s
        self.rsd: RemoteServiceDiscoveryService | None = None
        self.opened = 0  # how many times it was opened (1 + reopens)
        self._userspace: Any = None  # pymobiledevice3's UserspaceRsdTunnel handle

    @property
    def kind(self) -> Kind | None:
        return self.plan.kind

    @property
    def needed(self) -> bool:
        return self.plan.kind in ("userspace", "tunneld")

    @property
    def alive(self) -> bool:
        """False once the tunnel's transport died (pymobiledevice3 tears a userspace tunnel down then)."""
        if not self.needed:
            return True
        if self._userspace is not None:
            return self._userspace.rsd is not None
        return self.rsd is not None

    async def open(self) -> RemoteServiceDiscoveryService | None:
        if not self.needed:
            if self.plan.kind is None:
                raise NoTunnelError(f"{self.udid}: no tunnel possible: {self.plan.reason}")
            return None
        if self.rsd is not None and self.alive:
            return self.rsd
        what = f"opening the {self.plan.kind} tunnel"
        try:
            self.rsd = await asyncio.wait_for(self._open(), self.handshake_timeout_s)
        except (TimeoutError, pmd3.RemoteXPCHandshakeTimeoutError) as exc:
            await self.close()
            # pymobiledevice3 bounds some handshake steps itself (a few seconds): its timeout can fire before ours.
            if isinstance(exc, pmd3.RemoteXPCHandshakeTimeoutError):
                waited = f"(pymobiledevice3 stopped waiting: {exc})"
            else:
                waited = f"within {self.handshake_timeout_s:g} s"
            raise TunnelHandshakeTimeoutError(
                f"{what} to {self.udid}: the phone accepted it but did not finish the handshake {waited}; unplug and "
                "replug it (or restart it) and try again"
            ) from exc
        except pmd3.UserspaceTunnelUnavailableError as exc:
            await self.close()
            if version_tuple(self.os_version) >= CORE_DEVICE_PROXY_FROM:
                why = f"the phone (iOS {self.os_version}) refused the CoreDeviceProxy service; {TUNNELD_HINT}"
            else:
                why = OLD_17_HINT.format(version=self.os_version)
            raise NoTunnelError(f"{what} to {self.udid}: {why}") from exc
        except KvrigError:
            await self.close()
            raise
        except Exception as exc:
            await self.close()
            raise translate(exc, what, udid=self.udid, os_version=self.os_version) from exc
        self.opened += 1
        return self.rsd

    async def _open(self) -> RemoteServiceDiscoveryService:
        if self.plan.kind == "tunneld":
            host, _, port = (self.plan.tunneld or "").rpartition(":")
            address = (host.strip("[]"), int(port))
            listed = await tunneld_tunnels(self.udid, address)
            why = unusable(listed)
            if why is not None or listed is None:
                raise NoTunnelError(f"{self.udid}: tunneld at {self.plan.tunneld} {why}; {TUNNELD_HINT}")
            key, tunnels = listed
            rsd = await connect_listed(key, over_usb(tunnels), address)
            if rsd is None:
                raise NoTunnelError(
                    f"tunneld at {self.plan.tunneld} lists a tunnel to {self.udid} that does not answer (a stale one, "
                    "as after the phone was replugged or restarted): wait for tunneld to renew it, or restart tunneld"
                )
            return rsd
        global _userspace_holder
        if _userspace_holder not in (None, self.udid):
            raise NoTunnelError(
                f"this process already holds the userspace tunnel to {_userspace_holder}; pymobiledevice3's "
                f"userspace network stack is one per process: drive {self.udid} from its own process"
            )
        from pymobiledevice3.remote.userspace_tunnel import UserspaceRsdTunnel  # its network stack is slow to import

        # pymobiledevice3 opens it over whichever connection usbmuxd lists, Wi-Fi when the cable is out: kvrig
        # opens it only while the phone is on the cable, and keeps it only if the phone still is.
        await self._on_cable()
        handle = UserspaceRsdTunnel(serial=self.udid, autopair=False, remotepairing_fallback=False)
        self._userspace = handle
        _userspace_holder = self.udid
        with _usbmux_env(self.usbmux_address):
            rsd = await handle.aopen()
        await self._on_cable()
        return rsd

    async def _on_cable(self) -> None:
        """NoTunnelError unless usbmuxd lists the phone on USB."""
        from pymobiledevice3 import usbmux

        listed = await usbmux.list_devices(usbmux_address=resolve(self.usbmux_address))
        if not any(same_udid(d.serial, self.udid) and d.connection_type == "USB" for d in listed):
            raise NoTunnelError(
                f"{self.udid}: not on the cable (usbmuxd lists it over Wi-Fi only, or not at all); kvrig opens "
                "tunnels to phones over USB only: connect it with a cable"
            )

    async def close(self) -> None:
        global _userspace_holder
        rsd, handle = self.rsd, self._userspace
        self.rsd = self._userspace = None
        if handle is not None:
            with contextlib.suppress(Exception):  # the transport may already be gone
                await handle.aclose()
            if _userspace_holder == self.udid:
                _userspace_holder = None
        elif rsd is not None:
            with contextlib.suppress(Exception):
                await rsd.close()

    async def reopen(self) -> RemoteServiceDiscoveryService | None:
        await self.close()
        return await self.open()

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "opened": self.opened}
