"""Fit the planner's estimated terms to measured soaks.

For every telemetry point of a soak (context, phys_footprint), the planner gives the exact weight bytes and
the exact KV allocated at that context; what is left, less the MLX buffer cache at that point (measured in
the app's telemetry; the bundle's cap when the telemetry is not at hand), is the app's baseline. The median
over all points of a device profile is its calibrated baseline; `kvrig plan --calibration` uses it in place
of the profile's estimate. A run whose app mapped its weights from the bundle's file (its start record says
how many bytes) was not charged for them: those bytes are left out of the weights its footprint is reduced by,
so loaded and mapped soaks of one phone fit the same baseline.

`collect_limits` gathers the app memory limit each phone stated in its log (results schema 4) into the limits
registry, per ProductType × OS build × entitlement, for `kvrig plan --limits` and the lab.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvrig.exceptions import CalibrationError, PlanInputError, ProfileError, QuantizationError, ReportError
from kvrig.fileio import atomic_write
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, plan_memory
from kvrig.profiles import load_profile
from kvrig.recipes import parse_kv
from kvrig.reports.telemetry import read_telemetry
from kvrig.schemas import load_model_file
from kvrig.schemas.bundle import load_manifest
from kvrig.schemas.calibration import Calibration, CalibrationPoint, ProfileCalibration
from kvrig.schemas.kvcache import KVCacheConfig
from kvrig.schemas.limits import LimitsRegistry, MeasuredLimit
from kvrig.schemas.results import ResultsFile, SoakResult
from kvrig.version import __version__


@dataclass(frozen=True)
class ModelRef:
    """What the planner needs to count a run's weights and KV."""

    path: Path
    weights: str = "q4"
    group_size: int = 64
    kv_group_size: int = 64
    dtype: str = "float16"
    prefill_step: int = 512
    buffer_cache_bytes: int = 20 * 1024 * 1024
    kv: str | None = None
    """the KV spec the app ran (the bundle's; None: the run's own scheme names it)."""


def bundle_ref(bundle: Path) -> ModelRef:
    """Recipe and KV spec from manifest.json (the KV spec from kvcache.json when the manifest predates it), dtype,
    prefill step and buffer cache from kvcache.json."""

    manifest = load_manifest(bundle)  # a folder that is not a bundle is BundleError (7), as everywhere
    kv = load_model_file(KVCacheConfig, bundle / "kvcache.json")
    return ModelRef(
        path=bundle,
        weights=manifest.recipe.weights,
        group_size=manifest.recipe.group_size,
        kv_group_size=manifest.recipe.kv_group_size,
        dtype=kv.dtype,
        prefill_step=kv.prefill_step_size,
        buffer_cache_bytes=kv.buffer_cache_limit_bytes,
        kv=manifest.recipe.kv or kv.spec,
    )


def find_bundle(name: str, results_path: Path, run_field: str) -> Path:
    """A results file names its bundle by folder name; look beside it the way soak, lab and demo lay out."""
    given = Path(name)
    here = results_path.resolve().parent
    candidates = [given] if given.is_absolute() else []
    for folder in (here, here.parent, here.parent.parent):
        candidates += [folder / name, folder / "bundles" / name]
    for candidate in candidates:
        if (candidate / "manifest.json").is_file():
            return candidate
    raise CalibrationError(
        f"bundle '{name}' not found beside the results (looked in {', '.join(str(c) for c in candidates[:4])}, ...)",
        file=results_path,
        field=run_field,
        expected="a bundle folder with manifest.json; pass --bundle PATH",
    )


def _profile_for(run: SoakResult, results_path: Path, index: int):  # type: ignore[no-untyped-def]

    ref = run.device.profile or run.device.product_type
    if ref is None:
        raise CalibrationError(
            "the run names no device profile or ProductType",
            file=results_path,
            field=f"runs.{index}.device.profile",
            expected="a profile name or ProductType",
        )
    try:
        return load_profile(ref)
    except ProfileError as exc:
        raise CalibrationError(str(exc), file=results_path, field=f"runs.{index}.device.profile") from None


def points_for_run(
    run: SoakResult,
    index: int,
    results_path: Path,
    ref: ModelRef,
    profile,  # type: ignore[no-untyped-def]
) -> list[CalibrationPoint]:
    measured = [p for p in run.tps_curve if p.phys_footprint_bytes is not None and p.context_tokens > 0]
    if not measured:
        return []
    contexts = sorted({p.context_tokens for p in measured})
    # The app runs its bundle's kvcache.json whatever the run is called (a lab scheme's name may be any label).
    scheme = ref.kv or run.scheme
    try:
        parse_kv(scheme)
    except QuantizationError as exc:
        where = (ref.path / "manifest.json", "recipe.kv") if ref.kv else (results_path, f"runs.{index}.scheme")
        raise CalibrationError(str(exc), file=where[0], field=where[1], expected="a KV spec") from None
    request = PlanRequest(
        schemes=(scheme,),
        weights=ref.weights,
        recipes=(ref.weights,),
        group_size=ref.group_size,
        kv_group_size=ref.kv_group_size,
        dtype=ref.dtype,
        contexts=tuple(contexts),
        prefill_step=ref.prefill_step,
        buffer_cache_bytes=ref.buffer_cache_bytes,
    )
    try:
        plan = plan_memory(load_model_spec(ref.path), profile, request)
    except PlanInputError as exc:  # contexts no plan takes, as the run's telemetry says
        raise CalibrationError(str(exc), file=results_path, field=f"runs.{index}.tps_curve") from None
    caches = measured_buffer_caches(run, results_path)
    if run.weights_residency == "mapped" and run.mapped_weight_bytes is None:
        # the footprint left out some weights, but the app did not say how many: none can be subtracted right
        raise CalibrationError(
            "the run held its weights mapped but does not say how many bytes",
            file=results_path,
            field=f"runs.{index}.mapped_weight_bytes",
            expected="the bytes the app mapped (its start record's mapped_weight_bytes); rerun with a current app",
        )
    mapped = (run.mapped_weight_bytes or 0) if run.weights_residency == "mapped" else 0
    points = []
    for p in measured:
        footprint = p.phys_footprint_bytes
        assert footprint is not None
        kv = plan.kv_bytes[scheme][str(p.context_tokens)]
        overhead = footprint - (plan.weights_bytes - mapped) - kv
        cache = caches.get(p.t, ref.buffer_cache_bytes) if p.t is not None else ref.buffer_cache_bytes
        if overhead - cache < 0:  # less than the app's own weights and KV: no baseline can be below nothing
            step = run.tps_curve.index(p)
            raise CalibrationError(
                f"a footprint of {footprint} bytes at {p.context_tokens} tokens is below the weights and KV cache "
                f"the app holds there ({footprint - overhead + cache} bytes with its buffer cache): the run is of "
                "another bundle than the one calibrated against, or the file was edited",
                file=results_path,
                field=f"runs.{index}.tps_curve.{step}.phys_footprint_bytes",
                expected=f"the run's own bundle ({ref.path})",
            )
        points.append(
            CalibrationPoint(
                source=str(results_path),
                run_id=run.run_id,
                scheme=scheme,
                context_tokens=p.context_tokens,
                footprint_bytes=footprint,
                weights_bytes=plan.weights_bytes,
                mapped_weight_bytes=mapped,
                kv_bytes=kv,
                buffer_cache_bytes=cache,
                overhead_bytes=overhead,
                baseline_bytes=overhead - cache,
            )
        )
    return points


def measured_buffer_caches(run: SoakResult, results_path: Path) -> dict[float, int]:
    """MLX's buffer cache at each telemetry step (by the step's time), from the run's telemetry file beside
    the results; empty when there is none. The cache is often far below its cap between steps, so counting
    the cap would put the difference into the baseline."""

    if run.files.telemetry is None:
        return {}
    path = results_path.parent / run.files.telemetry
    if not path.is_file():
        return {}
    try:
        log = read_telemetry(path)
    except ReportError:
        return {}
    steps = [step for r in log.runs if r.run_id == run.run_id for step in r.steps]
    return {step.t: step.mlx_cache_bytes for step in steps if step.mlx_cache_bytes is not None}


def calibrate(
    results: list[Path], *, bundle: Path | None = None, model: Path | None = None, weights: str = "q4"
) -> Calibration:
    """Fit a baseline per device profile from the telemetry points of every run in `results`.

    `bundle` overrides the bundle each run names; `model` (a model directory, config.json or GGUF, with the
    `weights` recipe) is for runs that ran without a bundle kvrig wrote."""
    if not results:
        raise CalibrationError("no results files given", field="RESULTS", expected="one or more results.json")
    by_profile: dict[str, list[CalibrationPoint]] = {}
    profile_baseline: dict[str, int] = {}
    for path in results:
        data = load_model_file(ResultsFile, path)
        found = 0
        for i, run in enumerate(data.runs):
            if not any(p.phys_footprint_bytes is not None for p in run.tps_curve):
                continue
            if bundle is not None:
                ref = bundle_ref(bundle)
            elif run.bundle is not None:
                ref = bundle_ref(find_bundle(run.bundle, path, f"runs.{i}.bundle"))
            elif model is not None:
                ref = ModelRef(path=model, weights=weights)
            else:
                raise CalibrationError(
                    "the run names no bundle", file=path, field=f"runs.{i}.bundle", expected="--bundle or --model"
                )
            profile = _profile_for(run, path, i)
            points = points_for_run(run, i, path, ref, profile)
            found += len(points)
            by_profile.setdefault(profile.name, []).extend(points)
            profile_baseline[profile.name] = profile.baseline
        if not found:
            raise CalibrationError(
                "no run has telemetry footprints to calibrate from",
                file=path,
                field="runs.*.tps_curve.*.phys_footprint_bytes",
                expected="a soak whose app wrote step records with phys_footprint_bytes",
            )
    profiles = {}
    for name, points in by_profile.items():
        baselines = [p.baseline_bytes for p in points]
        profiles[name] = ProfileCalibration(
            baseline_bytes=int(statistics.median(baselines)),
            points=len(points),
            spread_bytes=max(baselines) - min(baselines),
            min_baseline_bytes=min(baselines),
            max_baseline_bytes=max(baselines),
            profile_baseline_bytes=profile_baseline[name],
            sources=sorted({p.source for p in points}),
            measurements=points,
        )
    return Calibration(tool_version=__version__, profiles=profiles)


def load_calibration(path: Path) -> Calibration:
    return load_model_file(Calibration, path)


def update_limits(results: list[Path], limits_file: Path, *, include_virtual: bool = False) -> LimitsCollected:
    """The limits the runs in `results` stated, merged into the registry at `limits_file` (read first when it
    exists) and written back whole."""
    from kvrig.planner.limits import load_limits

    existing = load_limits(limits_file) if limits_file.exists() else None
    collected = collect_limits(results, existing, include_virtual=include_virtual)
    atomic_write(limits_file, json.dumps(collected.registry.model_dump(mode="json", by_alias=True), indent=2) + "\n")
    return collected


def write_calibration(calibration: Calibration, out: Path) -> None:
    """calibration.json, replaced whole (OutputWriteError when it cannot be written; nothing half-written)."""
    atomic_write(out, json.dumps(calibration.model_dump(mode="json", by_alias=True), indent=2) + "\n")


def calibrated_baseline(path: Path, profile_name: str) -> ProfileCalibration:
    """The calibrated terms for one device profile, or a clear error naming the file and the profile."""
    calibration = load_calibration(path)
    entry = calibration.profiles.get(profile_name)
    if entry is None:
        raise CalibrationError(
            f"no calibration for device profile '{profile_name}'",
            file=path,
            field=f"profiles.{profile_name}",
            expected=f"one of: {', '.join(sorted(calibration.profiles)) or 'none (empty file)'}",
        )
    return entry


@dataclass
class LimitsCollected:
    registry: LimitsRegistry
    added: int  # runs whose stated limit went in
    skipped: list[str]  # runs that stated a limit the registry cannot key, each with why


def collect_limits(
    results: list[Path], into: LimitsRegistry | None = None, *, include_virtual: bool = False
) -> LimitsCollected:
    """The limits the phones stated in the runs of `results` (results schema 4 on), merged into `into` (a registry
    read from a team's file): one entry per ProductType × OS build × entitlement. A run already in the registry
    (its RESULTS.json#run_id) is not counted twice; a virtual iPhone's, and one from a file before schema 5 (which
    cannot say), only with `include_virtual`."""
    if not results:
        raise CalibrationError("no results files given", field="RESULTS", expected="one or more results.json")
    entries = {e.key: e.model_copy(deep=True) for e in (into.limits if into is not None else [])}
    added, skipped = 0, []
    for path in results:
        data = load_model_file(ResultsFile, path)
        for i, run in enumerate(data.runs):
            stated = run.stated_limit
            if stated is None or stated.limit_bytes is None:
                continue
            where = f"{path}#{run.run_id}"
            virtual = run.device.virtual or data.schema_version < 5
            if run.device.virtual and not include_virtual:  # the limit `kvrig virtual start` was given
                skipped.append(f"{where}: a virtual iPhone's limit, not a phone's (--include-virtual keeps it)")
                continue
            if data.schema_version < 5 and not include_virtual:  # device.virtual came with schema 5
                skipped.append(
                    f"{where}: results schema {data.schema_version} does not say whether the phone was kvrig's virtual "
                    "iPhone, whose limit is whatever it was started with (--include-virtual keeps it)"
                )
                continue
            missing = [
                name
                for name, value in (
                    ("product_type", stated.product_type),
                    ("build_version", stated.build_version),
                    ("entitled", stated.entitled),
                )
                if value is None
            ]
            if missing:
                skipped.append(f"{where}: runs.{i}.stated_limit has no {', '.join(missing)}")
                continue
            assert stated.product_type is not None and stated.build_version is not None and stated.entitled is not None
            key = (stated.product_type, stated.build_version, stated.entitled)
            entry = entries.get(key)
            if entry is not None and where in entry.sources:
                continue
            added += 1
            latest = entry is None or (run.started or 0.0) >= (entry.last_seen or 0.0)
            if entry is None:
                entries[key] = MeasuredLimit(
                    product_type=key[0],
                    build_version=key[1],
                    os_version=stated.os_version,
                    entitled=key[2],
                    limit_bytes=stated.limit_bytes,
                    inactive_bytes=stated.inactive_bytes,
                    seen_bytes=[stated.limit_bytes],
                    runs=1,
                    last_seen=run.started,
                    sources=[where],
                    virtual_sources=[where] if virtual else [],
                )
                continue
            entry.runs += 1
            entry.sources.append(where)
            if virtual:
                entry.virtual_sources.append(where)
            entry.seen_bytes = sorted({*entry.seen_bytes, stated.limit_bytes})
            if latest:
                entry.limit_bytes, entry.last_seen = stated.limit_bytes, run.started
                entry.inactive_bytes = stated.inactive_bytes or entry.inactive_bytes
                entry.os_version = stated.os_version or entry.os_version
    ordered = sorted(entries.values(), key=lambda e: (e.product_type, e.build_version, e.entitled))
    return LimitsCollected(LimitsRegistry(tool_version=__version__, limits=ordered), added, skipped)
