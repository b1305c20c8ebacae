"""pytest plugin (entry point `pytest11`: kvrig) for teams that write their own checks against a device lab.

    pytest --kvrig-lab LAB.yaml [--kvrig-usbmuxd [NAME=]HOST:PORT ...] --junitxml=report.xml

Fixtures: `kvrig_lab` (the lab file), `kvrig_phone` (one test per phone the lab selects, attached or virtual:
start one with `kvrig virtual start`), `kvrig_case` (one per matrix entry × scheme), `kvrig_bundle` (the
entry's app installed and bundle pushed on the phone), `kvrig_soak` (the entry's soak on the phone, with
the threshold search and gates, as `kvrig lab run` makes it). Marker `kvrig_phone(profile=, udid=, host=)`
keeps a test to the phones that match, `kvrig_case(entry=, scheme=)` to those matrix cells. Each test records
the phone's host, UDID and profile as JUnit properties, so CI reads them through pytest's usual --junitxml.

Nothing heavy is imported until a kvrig fixture is used: the plugin loads in every pytest session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvrig.device.discovery import connect
from kvrig.device.hosts import UsbmuxHost, list_devices_on, parse_hosts
from kvrig.device.loop import run_async
from kvrig.device.tunnel import TunnelMode
from kvrig.lab.model import device_ref, new_run
from kvrig.lab.schedule import Scheduler
from kvrig.lab.targets import select_targets
from kvrig.lab.worker import PhoneJob, prepare
from kvrig.schemas.lab import load_lab
from kvrig.schemas.results import short_udid


@dataclass(frozen=True)
class Phone:
    udid: str
    host: str | None
    address: str | None  # the usbmuxd to reach it through (None: this machine's)
    info: Any  # kvrig.device.discovery.DeviceInfo (None: the lab lists it and it is not attached)
    problem: str | None = None
    """Why the lab cannot use this phone (not attached, not trusted, another profile): its tests fail saying so."""

    @property
    def profile(self) -> str | None:
        return self.info.profile if self.info is not None else None

    def __str__(self) -> str:
        return f"{short_udid(self.udid)}@{self.host}" if self.host else short_udid(self.udid)


@dataclass(frozen=True)
class Deployed:
    phone: Phone
    app_id: str
    bundle: str | None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvrig", "kvrig device lab")
    group.addoption("--kvrig-lab", metavar="LAB.yaml", default=None, help="the lab file whose phones tests run on")
    group.addoption(
        "--kvrig-usbmuxd",
        action="append",
        default=[],
        metavar="[NAME=]HOST:PORT",
        help="a usbmuxd to find phones on (repeatable; default: this machine's)",
    )
    group.addoption(
        "--kvrig-tunnel",
        default="auto",
        metavar="auto|userspace|tunneld[=HOST:PORT]|none",
        help="how the soak reaches iOS 17+ developer services (as `kvrig lab run --tunnel`)",
    )
    group.addoption("--kvrig-out", metavar="DIR", default=None, help="where soak folders go (default: a tmp dir)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvrig_phone(profile=None, udid=None, host=None): only matching lab phones")
    config.addinivalue_line("markers", "kvrig_case(entry=None, scheme=None): only matching lab matrix cells")


def _lab(config: pytest.Config) -> Any:
    cached = getattr(config, "_kvrig_lab", None)
    if cached is None:
        path = config.getoption("kvrig_lab")
        if path is None:
            raise pytest.UsageError("kvrig fixtures need --kvrig-lab LAB.yaml")

        cached = load_lab(path)
        config._kvrig_lab = cached  # type: ignore[attr-defined]
    return cached


def _phones(config: pytest.Config) -> list[Phone]:
    cached = getattr(config, "_kvrig_phones", None)
    if cached is None:
        hosts = parse_hosts(config.getoption("kvrig_usbmuxd"))
        address = {h.name: h.address for h in hosts}
        attached, _ = run_async(list_devices_on(hosts))
        if config.getoption("kvrig_lab") is not None:
            # every phone the lab names, a missing or unusable one too: `kvrig lab run` fails its runs, and so
            # do its tests here (a phone left out would read as nothing wrong)
            targets = select_targets(_lab(config), attached)
            cached = [Phone(t.udid, t.host, address.get(t.host or ""), t.info, t.problem) for t in targets]
            if not targets:
                cached = [Phone("none", None, None, None, "no attached phone matches the lab's devices")]
        else:
            cached = [Phone(d.udid, d.host, address.get(d.host or ""), d) for d in attached if d.error is None]
        config._kvrig_phones = cached  # type: ignore[attr-defined]
    return cached


def _matches(marker: pytest.Mark | None, values: dict[str, Any]) -> bool:
    if marker is None:
        return True
    return all(values.get(key) == want for key, want in marker.kwargs.items() if want is not None)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvrig_phone" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("kvrig_phone")
        phones = [
            p
            for p in _phones(metafunc.config)
            if _matches(marker, {"profile": p.profile, "udid": p.udid, "host": p.host})
        ]
        metafunc.parametrize("kvrig_phone", phones, ids=[str(p) for p in phones], indirect=True, scope="session")
    if "kvrig_case" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("kvrig_case")
        cases = [
            (entry.label, scheme.name)
            for entry in _lab(metafunc.config).matrix
            for scheme in entry.schemes
            if _matches(marker, {"entry": entry.label, "scheme": scheme.name})
        ]
        metafunc.parametrize("kvrig_case", cases, ids=[f"{e}[{s}]" for e, s in cases], indirect=True)


@pytest.fixture(scope="session")
def kvrig_lab(pytestconfig: pytest.Config) -> Any:
    """The lab file given with --kvrig-lab (a kvrig.schemas.lab.Lab)."""
    return _lab(pytestconfig)


@pytest.fixture(scope="session")
def kvrig_phone(request: pytest.FixtureRequest) -> Phone:
    """One of the lab's phones, or without --kvrig-lab every attached one (each test runs once per phone); a
    lab phone that cannot be used fails its tests with the reason."""
    phone: Phone = request.param
    if phone.problem is not None:
        pytest.fail(f"{phone}: {phone.problem}", pytrace=False)
    return phone


@pytest.fixture()
def kvrig_case(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(matrix entry, scheme): each test using it runs once per cell of the lab's matrix."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _kvrig_properties(request: pytest.FixtureRequest) -> None:
    # Host and phone on every phone test's JUnit case, as `kvrig lab run` writes them.
    if "kvrig_phone" in request.fixturenames:
        phone: Phone = request.getfixturevalue("kvrig_phone")
        for key, value in (("host", phone.host), ("udid", phone.udid)):
            if value is not None:
                request.node.user_properties.append((key, value))
        for key in ("profile", "product_type", "os_version"):
            if phone.info is not None and getattr(phone.info, key) is not None:
                request.node.user_properties.append((key, getattr(phone.info, key)))


def _entry(lab: Any, case: tuple[str, str]) -> tuple[Any, Any]:
    entry = next(e for e in lab.matrix if e.label == case[0])
    return entry, next(s for s in entry.schemes if s.name == case[1])


@pytest.fixture()
def kvrig_bundle(kvrig_lab: Any, kvrig_phone: Phone, kvrig_case: tuple[str, str]) -> Deployed:
    """The case's app installed and its bundle pushed on the phone (what `kvrig lab run` does first)."""

    entry, _ = _entry(kvrig_lab, kvrig_case)

    async def deploy() -> None:
        async with await connect(kvrig_phone.udid, usbmux_address=kvrig_phone.address) as device:
            await prepare(device, entry)

    run_async(deploy())
    return Deployed(kvrig_phone, entry.app_id, entry.bundle_name)


@pytest.fixture()
def kvrig_soak(
    kvrig_lab: Any,
    kvrig_bundle: Deployed,
    kvrig_case: tuple[str, str],
    tmp_path: Path,
    pytestconfig: pytest.Config,
    request: pytest.FixtureRequest,
) -> Any:
    """The case's soak on the phone (with the threshold search and the lab's gates evaluated): a
    kvrig.schemas.results.SoakResult."""

    phone = kvrig_bundle.phone
    entry, scheme = _entry(kvrig_lab, kvrig_case)
    given = pytestconfig.getoption("kvrig_out")
    out = Path(given) if given else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    deployed = entry.model_copy(update={"ipa": None, "bundle_path": None})  # kvrig_bundle did that
    # The lab's own scheduler: the soak runs in a worker process of its own, and OUT gets results.json too.
    tunnel = str(TunnelMode.parse(pytestconfig.getoption("kvrig_tunnel")))
    scheduler = Scheduler(kvrig_lab, out, None, [UsbmuxHost(phone.host or "local", phone.address)], tunnel)
    ref = device_ref(phone.udid, phone.info, phone.host)
    run = new_run(deployed, scheme, ref, scheduler.stamp, on_critical=kvrig_lab.on_critical_for(entry))
    scheduler.results.runs = [run]
    run_async(scheduler.drive([PhoneJob(kvrig_lab, out, phone.udid, phone.address, [run], tunnel)]))
    soaked = run.result
    # user_properties, as _kvrig_properties writes them: record_property warns under pytest's default junit_family
    # (xunit2), which an error-on-warnings suite turns into an error at setup; pytest writes both the same way
    properties = {"outcome": soaked.outcome, "max_safe_context": soaked.max_safe_context}
    request.node.user_properties += [(k, v) for k, v in properties.items() if v is not None]
    return soaked
