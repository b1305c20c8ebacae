"""One-phone commands (prepare, deploy, soak) find a phone on any of the usbmuxd hosts `--usbmuxd` (or
KVRIG_USBMUXD) names, as `kvrig devices` and `kvrig lab run` list them: they answered "cannot reach usbmuxd"
for a phone `kvrig devices` had just listed on another host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrig.device.hosts import UsbmuxHost, address_of, list_devices_on
from kvrig.exceptions import DeviceNotFoundError
from tests.device.conftest import run
from tests.virtual.conftest import emulator_host

ROOT = Path(__file__).resolve().parents[2]
STATES: dict[str, str] = {}  # host name -> its phone's state folder


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, str]]]:
    """Two usbmuxd sockets, one virtual iPhone on each: host name -> (socket, the phone's UDID)."""
    root = tmp_path_factory.mktemp("hosts")
    with emulator_host(root / "a", "ha") as a, emulator_host(root / "b", "hb") as b:
        phones = {name: host.add_device(root / name / "phone") for name, host in (("a", a), ("b", b))}
        STATES.update({name: str(root / name / "phone") for name in phones})
        yield {name: (host.address, phones[name].identity.udid) for name, host in (("a", a), ("b", b))}


def test_the_host_that_lists_the_phone_is_the_one_dialled(two_hosts: dict[str, tuple[str, str]]) -> None:
    hosts = [UsbmuxHost(name, address) for name, (address, _) in two_hosts.items()]
    for address, udid in two_hosts.values():
        assert run(address_of(udid, hosts)) == address
        assert run(address_of(udid.replace("-", ""), hosts)) == address  # as some usbmuxd builds spell it
    with pytest.raises(DeviceNotFoundError, match=r"2 devices attached.*--udid"):
        run(address_of(None, hosts))
    with pytest.raises(DeviceNotFoundError, match=r"is not attached by USB to any of the usbmuxd hosts \(a, b\)"):
        run(address_of("00008130-0000000000000000", hosts))


def test_a_phone_a_mac_also_lists_over_wifi_is_found_where_it_is_cabled(
    two_hosts: dict[str, tuple[str, str]], tmp_path: Path
) -> None:
    """A Mac (Wi-Fi sync on) lists b's phone over Wi-Fi too: the lab keeps the cabled listing whatever the order
    of the hosts (it kept the first, the Wi-Fi one, and then found no phone on a cable)."""
    (b, phone) = two_hosts["b"]
    with emulator_host(tmp_path / "mac", "mac") as mac:
        # the same state folder, so the same UDID: the Mac's Wi-Fi view of the phone b holds on a cable
        seen = mac.add_device(Path(STATES["b"]))
        seen.connection = "Network"
        for order in (["mac", "b"], ["b", "mac"]):
            hosts = [UsbmuxHost(name, {"mac": mac.address, "b": b}[name]) for name in order]
            listed, _ = run(list_devices_on(hosts))
            ((kept,),) = [[d for d in listed if d.udid == phone]]
            assert (kept.connection, kept.host) == ("USB", "b"), order
            assert run(address_of(phone, hosts)) == b


def test_prepare_reaches_a_phone_on_the_second_host(two_hosts: dict[str, tuple[str, str]], tmp_path: Path) -> None:
    (a, _), (b, phone) = two_hosts["a"], two_hosts["b"]
    env = {k: v for k, v in os.environ.items() if k != "USBMUXD_SOCKET_ADDRESS"}
    env.update(KVRIG_USBMUXD=f"a={a} b={b}", HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "kvrig", "prepare", "--udid", phone, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["device"]["udid"] == phone
