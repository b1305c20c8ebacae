"""Discovery through usbmuxd: both virtual phones listed with what lockdownd says, mapped to our profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from kvrig.device.discovery import connect, list_devices, select_device
from kvrig.exceptions import DeviceNotFoundError
from tests.device.conftest import Emulator, on_device, run

ROOT = Path(__file__).resolve().parents[2]


def _profile_names_for(product_type: str) -> set[str]:
    """Read straight from the shipped YAML files, not through kvrig.profiles."""
    names = set()
    for path in (ROOT / "device_profiles").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if product_type in data.get("product_types", []):
            names.add(data["name"])
    return names


def test_list_devices_maps_product_type_to_profile(emulator: Emulator) -> None:
    found = {d.udid: d for d in run(list_devices())}
    assert set(found) == {emulator.udid, emulator.ios17.identity.udid}
    phone = found[emulator.udid]
    assert phone.product_type == "iPhone16,1"
    assert phone.os_version == "16.7" and phone.build_version == "20H19"
    assert phone.connection == "USB" and phone.error is None
    assert _profile_names_for("iPhone16,1") == {phone.profile}
    assert found[emulator.ios17.identity.udid].os_version == "17.4"


def test_select_device(emulator: Emulator) -> None:
    assert run(select_device(emulator.udid)).udid == emulator.udid
    with pytest.raises(DeviceNotFoundError, match="--udid"):
        run(select_device(None))  # two attached: ambiguous
    with pytest.raises(DeviceNotFoundError, match=emulator.udid):
        run(select_device("00008130-DEADBEEF00000000"))  # names what is attached
    # Some usbmuxd builds spell the UDID without its hyphen; a user may type either form.
    assert run(select_device(emulator.udid.replace("-", "").lower())).udid == emulator.udid


def test_a_phone_listed_over_wifi_only_is_shown_and_never_driven(emulator: Emulator) -> None:
    """A Mac's usbmuxd lists phones it reaches over Wi-Fi; kvrig shows why it will not use one, never opens a
    lockdown session over Wi-Fi, and picks the phone on the cable when no UDID is given."""
    phone = emulator.ios17
    phone.connection = "Network"
    try:
        listed = {d.udid: d for d in run(list_devices())}
        wifi = listed[phone.identity.udid]
        assert wifi.connection == "Network" and isinstance(wifi.problem, DeviceNotFoundError)
        assert "Wi-Fi only" in str(wifi.error) and wifi.os_version is None  # lockdownd was not asked
        assert run(select_device(None)).udid == emulator.udid  # the only phone on a cable
        with pytest.raises(DeviceNotFoundError, match="USB"):
            run(select_device(phone.identity.udid))
        with pytest.raises(DeviceNotFoundError, match="USB"):
            run(connect(phone.identity.udid))
    finally:
        phone.connection = "USB"


def test_no_usbmuxd_is_device_not_found(tmp_path: Path) -> None:
    with pytest.raises(DeviceNotFoundError, match="usbmuxd"):
        run(list_devices(usbmux_address=str(tmp_path / "nothing.sock")))


CLI = """
import sys
from kvrig.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'mlx', 'mlx_lm'})
print('HEAVY=' + ','.join(heavy), file=sys.stderr)
sys.exit(code)
"""


def test_a_socket_this_user_may_not_open_is_not_a_lost_phone(monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES on usbmuxd's socket names the socket and its permissions, where it read as a phone that went away.
    Root opens any socket and a child run as nobody cannot reach this venv, so the connect is made to fail as the
    kernel fails it for another user: pymobiledevice3 passes PermissionError through (usbmux.py, 11.45)."""
    from pymobiledevice3.usbmux import MuxConnection

    async def refused(usbmux_address: str | None = None) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(MuxConnection, "create_usbmux_socket", staticmethod(refused))
    with pytest.raises(DeviceNotFoundError) as refusal:
        run(list_devices(usbmux_address="/run/usbmuxd-of-another-user"))
    message = str(refusal.value)
    assert "/run/usbmuxd-of-another-user" in message and "Permission denied" in message
    assert "lost the connection" not in message and refusal.value.exit_code == 11


def test_cli_devices_json_without_mlx(emulator: Emulator) -> None:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=emulator.address)
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "devices", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    listed = {d["udid"]: d for d in json.loads(proc.stdout)}
    assert listed[emulator.udid]["product_type"] == "iPhone16,1"
    assert "HEAVY=\n" in proc.stderr


def test_cli_devices_without_usbmuxd_exits_11(tmp_path: Path) -> None:
    env = dict(os.environ, USBMUXD_SOCKET_ADDRESS=str(tmp_path / "none.sock"))
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "devices"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 11
    assert proc.stderr.startswith("kvrig: error:") and "Traceback" not in proc.stderr


def test_device_layer_and_soak_import_neither_the_emulator_nor_mlx() -> None:
    code = (
        "import sys, kvrig.device.apps, kvrig.device.crash, kvrig.device.deploy, "
        "kvrig.device.files, kvrig.device.processes, kvrig.device.syslog, kvrig.soaking, "
        "kvrig.cli.device, kvrig.cli.soak\n"
        "print(sorted(m for m in sys.modules if m.startswith(('kvrig.virtual', 'mlx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_devices_on_hosts_none_of_which_answers_is_device_not_found(tmp_path: Path) -> None:
    """`kvrig devices --usbmuxd ...` (`hosts.preflight_on`): no host answering is DeviceNotFoundError naming each
    host and why; one that answers lists its phones and the others are only reported."""
    from kvrig.device.hosts import parse_hosts, preflight_on

    hosts = parse_hosts([f"a={tmp_path / 'a.sock'}", f"b={tmp_path / 'b.sock'}"])
    with pytest.raises(DeviceNotFoundError) as refusal:
        run(preflight_on(hosts))
    assert str(refusal.value).startswith("a: ") and "; b: " in str(refusal.value)
    assert str(tmp_path / "a.sock") in str(refusal.value) and str(tmp_path / "b.sock") in str(refusal.value)


def test_waiting_for_a_restart_is_bounded_and_reconnects(emulator: Emulator) -> None:
    """What `prepare --enable-developer-mode` waits on after AMFI's enable request (pymobiledevice3's own wait has
    no bound and pairs if asked): a phone that never leaves is DeviceLostError within the bound; one that leaves
    and comes back gets a fresh session."""
    from kvrig.exceptions import DeviceLostError

    async def stays(device):  # type: ignore[no-untyped-def]
        await device.restarted(timeout_s=1.5, poll_s=0.1)

    with pytest.raises(DeviceLostError, match=r"did not restart within 1\.5 s"):
        run(on_device(emulator.udid, stays))

    async def restarts(device):  # type: ignore[no-untyped-def]
        old, reconnect, refusals = device.lockdown, device.reconnect, []

        async def not_yet() -> None:  # usbmuxd lists a booting phone before its lockdownd answers
            if not refusals:
                refusals.append("lockdownd not up")
                raise DeviceLostError("connection refused")
            await reconnect()

        device.reconnect = not_yet
        emulator.host.run(emulator.device.unplug())
        threading.Timer(1.0, lambda: emulator.host.run(emulator.device.replug())).start()
        await device.restarted(timeout_s=60, poll_s=0.1)
        assert refusals == ["lockdownd not up"]  # refused once, then asked again
        return old is not device.lockdown and (await device.lockdown.get_value(key="UniqueDeviceID")) == device.udid

    assert run(on_device(emulator.udid, restarts))


def test_a_userspace_tunnel_opens_only_to_a_phone_on_the_cable(emulator: Emulator) -> None:
    """pymobiledevice3's userspace tunnel takes whichever connection usbmuxd lists: over Wi-Fi when the cable is
    out (as mid-reconnect after an unplug). kvrig refuses with the error its reconnect loop retries on."""
    from kvrig.device.tunnel import Tunnel, TunnelPlan
    from kvrig.exceptions import NoTunnelError

    phone = emulator.ios17
    plan = TunnelPlan("userspace", "no-root userspace tunnel over CoreDeviceProxy (iOS 17.4+)", "auto")
    phone.connection = "Network"
    try:
        with pytest.raises(NoTunnelError, match="not on the cable") as refused:
            run(Tunnel(phone.identity.udid, plan, os_version="17.4").open())
        assert refused.value.exit_code == 25
    finally:
        phone.connection = "USB"
