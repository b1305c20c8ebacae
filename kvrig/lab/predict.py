"""The planner's prediction for a run: per (model, profile, limit, plan options, scheme), cached; MLX is
imported only here, and only when an entry names a model.

The limit planned against: the lab file's `limit_bytes` for the phone when it gives one (every app's, as on a
virtual iPhone started with a limit), else the limit the phone's ProductType × OS build × entitlement stated in a
limits registry (`kvrig lab run --limits`), else the device profile's. Which of the profile's two limits, and which
entitlement to look up, is the limit the app gets (`plan.limit: app`, iOS's rule): the entitled limit when the app
declares com.apple.developer.kernel.increased-memory-limit and the profile knows one, else the default. The
prediction's `limit_source` says which limit was used and why."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvrig.appgen.entitlements import app_entitlements
from kvrig.device.apps import list_apps
from kvrig.device.discovery import connect
from kvrig.device.hosts import UsbmuxHost
from kvrig.exceptions import KvrigError, QuantizationError, SchemaError
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, bundle_recipe, plan_memory
from kvrig.planner.limits import describe, load_limits, lookup
from kvrig.profiles import (
    INCREASED_MEMORY_LIMIT,
    RAM_SUFFIX_RE,
    AppMemoryLimit,
    DeviceProfile,
    SourcedInt,
    load_profile,
)
from kvrig.recipes import AUTO, parse_kv
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig, WeightsResidency
from kvrig.schemas.lab import LabDevice, LimitChoice, MatrixEntry, SchemeSpec
from kvrig.schemas.limits import MeasuredLimit
from kvrig.schemas.results import DeviceRef, Prediction

if TYPE_CHECKING:
    from kvrig.lab.targets import Target
    from kvrig.planner.transient import Backend

LimitKind = Literal["default", "entitled"]
LAB_FILE_LIMIT = "lab file: limit_bytes"
LISTING_TIMEOUT_S = 20.0  # a phone that does not list its apps by then is predicted without its entitlement


class Predictor:
    def __init__(self, notes: list[str], *, limits: Path | None = None) -> None:
        self.notes = notes
        self.limits_file = limits
        self.limits = load_limits(limits) if limits is not None else None
        self.unavailable = False
        self._cache: dict[tuple[str, ...], Prediction | None] = {}

    def predict(
        self,
        entry: MatrixEntry,
        scheme: SchemeSpec,
        profile: str | None,
        device: LabDevice,
        *,
        virtual: bool = False,
        residency: WeightsResidency | None = None,
        phone: DeviceRef | None = None,
        entitled: bool | None = None,
    ) -> Prediction | None:
        """`virtual`: kvrig's virtual iPhone, whose app runs MLX on the host's CPU; it is planned on the `cpu`
        backend (no fused attention, so prefill materializes the scores), a real phone on `metal`.
        `residency`: the run's (None: the bundle's layout). `entitled`: whether the entry's app declares the
        increased-memory-limit entitlement (`app_entitled`; None: not known)."""
        source = entry.model_source
        if source is None or profile is None or self.unavailable:
            return None
        try:
            planner_scheme = parse_kv(scheme.plan_scheme or scheme.name).name
        except QuantizationError:
            if scheme.plan_scheme is not None:
                raise SchemaError(
                    f"'{scheme.plan_scheme}' is not a KV scheme the planner knows",
                    field=f"matrix.{entry.label}.schemes.{scheme.name}.plan_scheme",
                    expected="fp16, bf16 or kXvY such as k8v4",
                ) from None
            note = f"{entry.label}/{scheme.name}: no prediction (not a planner scheme; set plan_scheme)"
            if note not in self.notes:
                self.notes.append(note)
            return None
        key: tuple[str, ...] = (str(source), profile, str(device.limit_bytes), str(device.baseline_bytes))
        backend: Backend = "cpu" if virtual else "metal"
        # A mapped run is planned with its weights out of the footprint (and inside the mapped-memory ceiling);
        # the app loads a bundle not laid out for mapping whatever the run asks, so that run is planned loaded.
        layout = _bundle_layout(entry)
        weights_residency: WeightsResidency = residency or layout or "loaded"
        if weights_residency == "mapped" and layout == "loaded":
            note = (
                f"{entry.label}/{scheme.name}: mapped weights asked of a bundle laid out to load (the app loads "
                "them; predicted loaded; repackage with `kvrig package --weights-layout mapped`)"
            )
            if note not in self.notes:
                self.notes.append(note)
            weights_residency = "loaded"
        device_profile = _device_profile(profile, device)
        kind, why = limit_kind(entry.plan.limit, entitled, entry.app_id, device_profile)
        measured = self._measured(phone, kind) if device.limit_bytes is None else None
        key += (entry.plan.model_dump_json(), planner_scheme, backend, weights_residency, kind, why)
        key += (measured.model_dump_json() if measured is not None else "",)
        if key not in self._cache:
            self._cache[key] = self._plan(
                source, device_profile, device, entry, planner_scheme, backend, weights_residency, (kind, why), measured
            )
        return self._cache[key]

    def _measured(self, phone: DeviceRef | None, limit: LimitKind) -> MeasuredLimit | None:
        """The registry's limit for this phone's ProductType and build (only that build: a phone on another
        build is planned with its profile), with the entitlement the entry plans for."""
        if self.limits is None or phone is None or phone.product_type is None or phone.build_version is None:
            return None
        return lookup(self.limits, [phone.product_type], phone.build_version, limit)

    def _plan(
        self,
        source: Path,
        profile: DeviceProfile,
        device: LabDevice,
        entry: MatrixEntry,
        scheme: str,
        backend: Backend,
        residency: WeightsResidency,
        limit: tuple[LimitKind, str],
        measured: MeasuredLimit | None = None,
    ) -> Prediction | None:
        kind, limit_source = limit
        try:
            opts = entry.plan
            if measured is not None:
                assert self.limits_file is not None
                limit_source = f"measured: {describe(measured, self.limits_file)} ({limit_source})"
                note = f"predictions for {measured.product_type} build {measured.build_version} use {limit_source}"
                if note not in self.notes:
                    self.notes.append(note)
            plan = plan_memory(
                load_model_spec(source),
                profile,
                PlanRequest(
                    schemes=(scheme,),
                    weights=opts.weights or bundle_recipe(entry.bundle_path) or AUTO,
                    margin=opts.margin,
                    limit=kind,
                    prefill_step=opts.prefill_step,
                    contexts=(1024,),
                    backend=backend,
                    weights_residency=residency,
                    measured_limit_bytes=measured.limit_bytes if measured is not None else None,
                    measured_limit_source=limit_source if measured is not None else None,
                ),
            )
        except ImportError as exc:  # no MLX on this machine: the lab still runs, without predictions
            self.unavailable = True
            self.notes.append(f"no predictions: the planner needs MLX ({exc})")
            return None
        return Prediction(
            max_context=plan.max_context[scheme],
            limit_bytes=plan.limit_bytes,
            footprint_at_max_context_bytes=plan.budget_at_max_context[scheme].total_bytes,
            limit_source=limit_source,
        )


def _device_profile(profile_ref: str, device: LabDevice) -> DeviceProfile:
    """The profile the phone is planned with: its RAM configuration, and the limit and baseline the lab file
    knows better (a virtual iPhone started with a small limit gives it to every app)."""
    profile = load_profile(profile_ref)
    # The phone says its ProductType, not its RAM: a lab file's `profile: REF@16GB` names the configuration.
    sized = RAM_SUFFIX_RE.match(device.profile or "")
    if sized is not None:
        profile = profile.with_ram(int(sized["gb"]))
    if device.limit_bytes is not None:
        given = SourcedInt(value=device.limit_bytes, basis="reported", source=LAB_FILE_LIMIT)
        profile = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
    if device.baseline_bytes is not None:
        given = SourcedInt(value=device.baseline_bytes, basis="reported", source="lab file: baseline_bytes")
        profile = profile.model_copy(update={"app_baseline_bytes": given})
    return profile


def limit_kind(asked: LimitChoice, entitled: bool | None, app_id: str, profile: DeviceProfile) -> tuple[LimitKind, str]:
    """The profile limit a run is planned against, and why (the prediction's `limit_source`). `app`: the one iOS
    gives the app: entitled when it declares increased-memory-limit and the device has a larger limit, else default."""
    if profile.app_memory_limit.default_bytes.source == LAB_FILE_LIMIT:
        return "default", f"{LAB_FILE_LIMIT}, every app's whatever its entitlements"
    has_entitled = profile.limit_entitled is not None
    if asked == "default":
        return "default", f"{profile.name}'s default limit (plan.limit: default)"
    if asked == "entitled":
        if has_entitled:
            return "entitled", f"{profile.name}'s entitled limit (plan.limit: entitled)"
        return (
            "default",
            f"{profile.name}'s default limit: plan.limit is entitled, but the profile knows no entitled limit",
        )
    if entitled is None:
        return "default", (
            f"{profile.name}'s default limit: whether {app_id} declares {INCREASED_MEMORY_LIMIT} is not known "
            "(no .ipa in the lab file and the phone lists no entitlements; plan.limit: entitled if it does)"
        )
    if not entitled:
        return "default", f"{profile.name}'s default limit: {app_id} does not declare {INCREASED_MEMORY_LIMIT}"
    if not has_entitled:
        return "default", (
            f"{profile.name}'s default limit: {app_id} declares {INCREASED_MEMORY_LIMIT}, but the profile knows no "
            "entitled limit for this device"
        )
    return "entitled", f"{profile.name}'s entitled limit: {app_id} declares {INCREASED_MEMORY_LIMIT}"


def ipa_entitlements(matrix: list[MatrixEntry]) -> dict[str, bool]:
    """App id -> whether the .ipa the lab installs for it declares the increased-memory-limit entitlement."""
    found: dict[str, bool] = {}
    for entry in matrix:
        if entry.ipa is not None and entry.app_id not in found:
            declared = app_entitlements(entry.ipa) or {}
            found[entry.app_id] = declared.get(INCREASED_MEMORY_LIMIT) is True
    return found


async def installed_entitlements(
    matrix: list[MatrixEntry], targets: list[Target], hosts: list[UsbmuxHost], known: Iterable[str] = ()
) -> dict[tuple[str, str], bool | None]:
    """(UDID, app id) -> whether the app installed on the phone declares increased-memory-limit, as
    installation_proxy lists it, for the apps `plan.limit: app` predicts whose entitlement is not `known` (from
    the .ipa the lab installs). A phone that cannot be asked in time, or lacks the app, is left out (its prediction
    says the entitlement is unknown)."""
    wanted = {e.app_id for e in matrix if e.plan.limit == "app" and e.model_source is not None} - set(known)
    address = {h.name: h.address for h in hosts}
    only = hosts[0].address if len(hosts) == 1 else None
    found: dict[tuple[str, str], bool | None] = {}

    async def listing(target: Target) -> dict[str, bool | None]:
        device = await connect(target.udid, usbmux_address=address.get(target.host or "", only))
        async with device:
            return {a.bundle_id: a.entitled for a in await list_apps(device)}

    for target in targets if wanted else []:
        if target.problem is not None or target.spec.limit_bytes is not None:  # the lab file's limit: every app's
            continue
        try:
            listed = await asyncio.wait_for(listing(target), LISTING_TIMEOUT_S)
        except (KvrigError, OSError, TimeoutError):
            continue
        found.update({(target.udid, app_id): listed[app_id] for app_id in wanted if app_id in listed})
    return found


def _bundle_layout(entry: MatrixEntry) -> WeightsResidency | None:
    """How the entry's bundle lays out its weights (kvcache.json), when the lab pushes one: what the app does
    with them unless the run says otherwise."""
    if entry.bundle_path is None or not (entry.bundle_path / KVCACHE_NAME).is_file():
        return None
    return load_model_file(KVCacheConfig, entry.bundle_path / KVCACHE_NAME).weights_layout
