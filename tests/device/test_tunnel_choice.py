"""Choosing a tunnel (`--tunnel auto|userspace|tunneld[=HOST:PORT]|none`) per iOS version, with a tunneld
stand-in on loopback (port 0) that answers tunneld's `GET /` listing, and refusals that say what to do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kvrig.device.tunnel import Tunnel, TunnelMode, TunnelPlan, plan_tunnel
from kvrig.exceptions import InputError, NoTunnelError

UDID = "00008130-001A2B3C4D5E6F70"


@pytest.fixture
def closed_port() -> Iterator[tuple[str, int]]:
    """A loopback port nothing listens on (bound, never listening: connections are refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()
    sock.close()


@pytest.fixture
def tunneld() -> Iterator[tuple[str, int]]:
    """Answers like a tunneld holding a tunnel to UDID (the listing format of pymobiledevice3's tunneld)."""
    with serving({UDID: [{"tunnel-address": "fd00::1", "tunnel-port": 55555, "interface": "utun7"}]}) as address:
        yield address


@contextlib.contextmanager
def serving(listing: dict[str, object]) -> Iterator[tuple[str, int]]:
    """A tunneld stand-in answering `GET /` with this listing."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(listing).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[0], server.server_address[1]
    server.shutdown()
    server.server_close()


def plan(version: str, mode: TunnelMode, udid: str = UDID) -> TunnelPlan:
    return asyncio.run(plan_tunnel(udid, version, mode))


def test_parse_modes() -> None:
    assert TunnelMode.parse("auto").mode == "auto"
    assert TunnelMode.parse(None) == TunnelMode()
    assert TunnelMode.parse("tunneld") == TunnelMode("tunneld")
    assert TunnelMode.parse("tunneld=10.0.0.5:5000") == TunnelMode("tunneld", ("10.0.0.5", 5000))
    assert TunnelMode.parse("tunneld=[::1]:49151").tunneld == ("::1", 49151)
    assert str(TunnelMode.parse("tunneld=10.0.0.5:5000")) == "tunneld=10.0.0.5:5000"
    for bad in ("wifi", "userspace=1.2.3.4:5", "tunneld=host", "tunneld=host:0", "tunneld=:80"):
        with pytest.raises(InputError) as refused:
            TunnelMode.parse(bad)
        assert refused.value.field == "--tunnel"


def test_before_ios17_no_tunnel_is_needed(closed_port: tuple[str, int]) -> None:
    for mode in ("auto", "userspace", "none"):
        chosen = plan("16.7", TunnelMode(mode, closed_port))  # type: ignore[arg-type]
        assert chosen.kind == "lockdown"


def test_auto_picks_userspace_from_17_4_when_tunneld_is_not_there(closed_port: tuple[str, int]) -> None:
    for version in ("17.4", "18.6", "26.1"):
        chosen = plan(version, TunnelMode("auto", closed_port))
        assert chosen.kind == "userspace" and chosen.mode == "auto"
        assert "CoreDeviceProxy" in chosen.reason


def test_auto_refuses_17_0_to_17_3_without_tunneld(closed_port: tuple[str, int]) -> None:
    for version in ("17.0", "17.3.1"):
        chosen = plan(version, TunnelMode("auto", closed_port))
        assert chosen.kind is None
        assert "tunneld" in chosen.reason and "17.4" in chosen.reason
    assert plan("17.2", TunnelMode("userspace", closed_port)).kind is None


def test_tunneld_when_it_serves_the_phone(tunneld: tuple[str, int]) -> None:
    for version in ("17.2", "18.6"):
        chosen = plan(version, TunnelMode("auto", tunneld))
        assert chosen.kind == "tunneld" and chosen.tunneld == f"{tunneld[0]}:{tunneld[1]}"
    assert plan("17.2", TunnelMode("tunneld", tunneld)).kind == "tunneld"
    # A tunneld without this phone: auto goes on to userspace where it can, `tunneld` says so.
    assert plan("18.6", TunnelMode("auto", tunneld), udid="other").kind == "userspace"
    refused = plan("18.6", TunnelMode("tunneld", tunneld), udid="other")
    assert refused.kind is None and "holds no tunnel" in refused.reason


def test_explicit_tunneld_unreachable_and_none(closed_port: tuple[str, int]) -> None:
    refused = plan("18.6", TunnelMode("tunneld", closed_port))
    assert refused.kind is None and "not reachable" in refused.reason and "remote tunneld" in refused.reason
    none = plan("18.6", TunnelMode("none", closed_port))
    assert none.kind is None and "--tunnel none" in none.reason


def test_opening_an_impossible_tunnel_is_no_tunnel_error() -> None:
    tunnel = Tunnel(UDID, TunnelPlan(None, "iOS 17.2 has no CoreDeviceProxy"), os_version="17.2")
    with pytest.raises(NoTunnelError) as refused:
        asyncio.run(tunnel.open())
    assert refused.value.exit_code == 25 and "17.2" in str(refused.value)


def test_a_stale_tunnel_tunneld_lists_is_no_tunnel_error(closed_port: tuple[str, int]) -> None:
    """tunneld lists a tunnel that no longer answers (the phone was replugged): pymobiledevice3 skips it and then
    indexes an empty list; kvrig says what happened, with the exit code a soak's reconnect loop retries on."""
    stale = {UDID: [{"tunnel-address": closed_port[0], "tunnel-port": closed_port[1], "interface": "utun7"}]}
    with serving(stale) as (host, port):
        chosen = plan("18.6", TunnelMode("tunneld", (host, port)))
        assert chosen.kind == "tunneld"
        with pytest.raises(NoTunnelError) as refused:
            asyncio.run(Tunnel(UDID, chosen, os_version="18.6").open())
    assert refused.value.exit_code == 25 and "does not answer" in str(refused.value)


def test_tunneld_finds_a_phone_whose_udid_usbmuxd_spells_without_the_hyphen(tunneld: tuple[str, int]) -> None:
    """Some usbmuxd builds (usbmuxd2, old Linux releases) report the UDID without its hyphen; tunneld keys the
    tunnel by the phone's own, hyphenated one."""
    bare = UDID.replace("-", "")
    assert plan("18.6", TunnelMode("tunneld", tunneld), udid=bare).kind == "tunneld"
    assert plan("18.6", TunnelMode("tunneld", tunneld), udid=bare.lower()).kind == "tunneld"


NETWORK_TUNNELS = [
    {"tunnel-address": "fd00::2", "tunnel-port": 55556, "interface": f"usbmux-{UDID}-Network"},
    {"tunnel-address": "fd00::3", "tunnel-port": 55557, "interface": f"mobdev2-{UDID}-192.168.1.5"},
]


def test_tunnels_tunneld_runs_over_the_network_are_never_used() -> None:
    """tunneld's usbmux monitor tunnels a phone seen over Wi-Fi, and its mobdev2 monitor one found on the network
    (their `interface` names say so): pymobiledevice3's client connects to whichever answers first, and kvrig had
    planned and soaked over them as over USB."""
    with serving({UDID: NETWORK_TUNNELS}) as address:
        assert plan("18.6", TunnelMode("auto", address)).kind == "userspace"  # on, as without tunneld
        for version in ("17.2", "18.6"):
            refused = plan(version, TunnelMode("tunneld", address))
            assert refused.kind is None and "over the network only" in refused.reason
            assert f"usbmux-{UDID}-Network" in refused.reason and "--no-wifi --no-mobdev2" in refused.reason
        assert plan("17.2", TunnelMode("auto", address)).kind is None
        forced = Tunnel(UDID, TunnelPlan("tunneld", "", "tunneld", f"{address[0]}:{address[1]}"), os_version="18.6")
        with pytest.raises(NoTunnelError, match="over the network only"):
            asyncio.run(forced.open())


def test_only_the_usb_tunnels_are_connected_to(monkeypatch: pytest.MonkeyPatch, closed_port: tuple[str, int]) -> None:
    """With USB and network tunnels listed, kvrig hands pymobiledevice3's connector the USB ones alone (kvrig's
    adapter recording them here); none answering is the stale tunnel's NoTunnelError."""
    import kvrig.device.tunnel as tunnel

    usb = {"tunnel-address": closed_port[0], "tunnel-port": closed_port[1], "interface": "fe80::1%en7"}
    handed: list[list[dict[str, object]]] = []

    async def connect(key: str, tunnels: list[dict[str, object]], address: tuple[str, int]) -> None:
        handed.append(tunnels)

    monkeypatch.setattr(tunnel, "connect_listed", connect)
    with serving({UDID: [*NETWORK_TUNNELS, usb]}) as address:
        chosen = plan("18.6", TunnelMode("tunneld", address))
        assert chosen.kind == "tunneld" and "over USB" in chosen.reason
        with pytest.raises(NoTunnelError, match="does not answer"):
            asyncio.run(Tunnel(UDID, chosen, os_version="18.6").open())
    assert handed == [[usb]]


def test_a_dead_tunnel_interface_only_skips_that_tunnel(closed_port: tuple[str, int]) -> None:
    """pymobiledevice3's connector skips a tunnel that refuses or times out, but raises on a host it cannot route
    to (the interface of a replugged phone, gone): kvrig's adapter skips that one tunnel and tries the next."""
    from kvrig.compat.pymobiledevice3_tunneld import connect_listed

    unroutable = {"tunnel-address": "fd00::1", "tunnel-port": 5555, "interface": "fe80::1%en7"}
    refused = {"tunnel-address": closed_port[0], "tunnel-port": closed_port[1], "interface": "fe80::2%en8"}
    assert asyncio.run(connect_listed(UDID, [unroutable, refused], ("127.0.0.1", 1))) is None


def test_the_tunneld_command_kvrig_gives_is_one_pymobiledevice3_takes() -> None:
    """The hint names this interpreter (sudo's python3 is the system's, without pymobiledevice3) and flags that
    pymobiledevice3's own tunneld command lists."""
    import subprocess
    import sys

    from kvrig.device.tunnel import TUNNELD_COMMAND

    assert TUNNELD_COMMAND.startswith(f"sudo {sys.executable} -m pymobiledevice3 remote tunneld ")
    flags = TUNNELD_COMMAND.split("tunneld ", 1)[1].split()
    shown = subprocess.run(
        [sys.executable, "-m", "pymobiledevice3", "remote", "tunneld", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert shown.returncode == 0, shown.stderr
    assert flags and all(flag in shown.stdout for flag in flags), (flags, shown.stdout)
