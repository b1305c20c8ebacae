"""pymobiledevice3's tunneld client: `get_tunneld_device_by_udid` connects to whichever of a phone's listed
tunnels answers first, over USB, Wi-Fi or mobdev2 alike, and kvrig soaks over USB only. `connect_listed` hands
the client's own connector (`_create_rsds_from_tunnels`: the handshake, and bridging through tunneld's
/connect where its interface is out of reach) the tunnels kvrig chose from the listing."""

from __future__ import annotations

from typing import Any

from pymobiledevice3.remote.remote_service_discovery import RemoteServiceDiscoveryService
from pymobiledevice3.tunneld.api import _create_rsds_from_tunnels

DISTRIBUTION = "pymobiledevice3"
TESTED = ">=11.45,<12"


async def connect_listed(
    udid: str, tunnels: list[dict[str, Any]], address: tuple[str, int]
) -> RemoteServiceDiscoveryService | None:
    """The first of `tunnels` (entries of tunneld's listing for `udid`) that answers, connected, one at a time: the
    connector skips a tunnel that times out or refuses but raises on other OSErrors (EHOSTUNREACH from a dead
    interface), which here only skip that one. None when none answers (a stale listing)."""
    for tunnel in tunnels:
        try:
            rsds = await _create_rsds_from_tunnels({udid: [tunnel]}, address)
        except OSError:
            continue
        if rsds:
            return rsds[0]
    return None
