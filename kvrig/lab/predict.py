"""The planner's prediction for a run: per (model, profile, limit, plan options, scheme), cached; MLX is
imported only here, and only when an entry names a model.

The limit planned against: the lab file's `limit_bytes` for the phone when it gives one, else the limit the
phone's ProductType × OS build × entitlement stated in a limits registry (`kvrig lab run --limits`), else the
device profile's; the prediction's `limit_source` says which."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvrig.exceptions import QuantizationError, SchemaError
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, bundle_recipe, plan_memory
from kvrig.planner.limits import describe, load_limits, lookup
from kvrig.profiles import RAM_SUFFIX_RE, AppMemoryLimit, SourcedInt, load_profile
from kvrig.recipes import AUTO, parse_kv
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig, WeightsResidency
from kvrig.schemas.lab import LabDevice, MatrixEntry, SchemeSpec
from kvrig.schemas.limits import MeasuredLimit
from kvrig.schemas.results import DeviceRef, Prediction

if TYPE_CHECKING:
    from kvrig.planner.transient import Backend


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
    ) -> Prediction | None:
        """`virtual`: kvrig's virtual iPhone, whose app runs MLX on the host's CPU; it is planned on the `cpu`
        backend (no fused attention, so prefill materializes the scores), a real phone on `metal`.
        `residency`: the run's (None: the bundle's layout)."""
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
        measured = self._measured(phone, entry.plan.limit) if device.limit_bytes is None else None
        key += (entry.plan.model_dump_json(), planner_scheme, backend, weights_residency)
        key += (measured.model_dump_json() if measured is not None else "",)
        if key not in self._cache:
            self._cache[key] = self._plan(
                source, profile, device, entry, planner_scheme, backend, weights_residency, measured
            )
        return self._cache[key]

    def _measured(self, phone: DeviceRef | None, limit: str) -> MeasuredLimit | None:
        """The registry's limit for this phone's ProductType and build (only that build: a phone on another
        build is planned with its profile), with the entitlement the entry plans for."""
        if self.limits is None or phone is None or phone.product_type is None or phone.build_version is None:
            return None
        return lookup(self.limits, [phone.product_type], phone.build_version, limit)

    def _plan(
        self,
        source: Path,
        profile_ref: str,
        device: LabDevice,
        entry: MatrixEntry,
        scheme: str,
        backend: Backend,
        residency: WeightsResidency,
        measured: MeasuredLimit | None = None,
    ) -> Prediction | None:
        limit_source = None
        try:
            profile = load_profile(profile_ref)
            # The phone says its ProductType, not its RAM: a lab file's `profile: REF@16GB` names the configuration.
            sized = RAM_SUFFIX_RE.match(device.profile or "")
            if sized is not None:
                profile = profile.with_ram(int(sized["gb"]))
            # A phone whose limit or baseline the lab knows better than the profile (a virtual iPhone).
            if device.limit_bytes is not None:
                limit_source = "lab file: limit_bytes"
                given = SourcedInt(value=device.limit_bytes, basis="reported", source="lab file: limit_bytes")
                profile = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
            if device.baseline_bytes is not None:
                given = SourcedInt(value=device.baseline_bytes, basis="reported", source="lab file: baseline_bytes")
                profile = profile.model_copy(update={"app_baseline_bytes": given})
            opts = entry.plan
            if measured is not None:
                assert self.limits_file is not None
                limit_source = f"measured: {describe(measured, self.limits_file)}"
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
                    limit=opts.limit,
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


def _bundle_layout(entry: MatrixEntry) -> WeightsResidency | None:
    """How the entry's bundle lays out its weights (kvcache.json), when the lab pushes one: what the app does
    with them unless the run says otherwise."""
    if entry.bundle_path is None or not (entry.bundle_path / KVCACHE_NAME).is_file():
        return None
    return load_model_file(KVCacheConfig, entry.bundle_path / KVCACHE_NAME).weights_layout
