"""What a lab file names, checked before any phone is contacted or the output folder is claimed: the files it
points at exist, its recipes and KV specs parse, its device profiles are known. The schema (schemas/lab.py)
holds the file's shape; these need the recipe grammar and the profiles, which sit above it. A mistake found
mid-run used to end every run with it and leave the output folder claimed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrig.bundle.manifest import verify_bundle
from kvrig.exceptions import BundleError, InputError, ProfileError, QuantizationError, SchemaError, VerifyError
from kvrig.models import read_config
from kvrig.profiles import load_profile
from kvrig.recipes import AUTO, parse_kv, parse_weights
from kvrig.schemas.bundle import load_manifest
from kvrig.schemas.lab import Lab


def check_lab(lab: Lab, file: str | Path | None = None) -> None:
    """Raises SchemaError (exit 3) naming `file` and the field for the first thing the lab names that cannot be
    used. Scheme names without a `plan_scheme` may be any label (the run records them; only a KV spec is
    predicted), so only `plan_scheme` must parse."""
    for j, device in enumerate(lab.devices):
        if device.profile is not None:
            _read(file, f"devices.{j}.profile", load_profile, device.profile)
    for i, entry in enumerate(lab.matrix):
        for key in ("ipa", "bundle_path", "model"):
            path = getattr(entry, key)
            if path is not None and not path.exists():
                raise SchemaError(
                    f"{path} does not exist",
                    file=file,
                    field=f"matrix.{i}.{key}",
                    expected="a path that exists, absolute or relative to the lab file's folder",
                )
        if entry.ipa is not None and entry.ipa.is_dir() and entry.ipa.suffix != ".app":
            raise SchemaError(
                f"{entry.ipa} is a folder", file=file, field=f"matrix.{i}.ipa", expected="an .ipa or a .app folder"
            )
        if entry.bundle_path is not None:
            _read(file, f"matrix.{i}.bundle_path", load_manifest, entry.bundle_path)
            try:  # every file as `kvrig verify` holds it: a damaged bundle stops the lab before it starts
                verify_bundle(entry.bundle_path)
            except VerifyError as exc:
                raise VerifyError(f"{file}: field 'matrix.{i}.bundle_path': {exc}") from None
        if entry.model is not None:
            _read(file, f"matrix.{i}.model", read_config, entry.model)
        if entry.plan.weights is not None and entry.plan.weights.strip().lower() != AUTO:
            _read(file, f"matrix.{i}.plan.weights", parse_weights, entry.plan.weights)
        for k, scheme in enumerate(entry.schemes):
            if scheme.plan_scheme is not None:
                _read(file, f"matrix.{i}.schemes.{k}.plan_scheme", parse_kv, scheme.plan_scheme)


def _read(file: str | Path | None, field: str, read: Callable[[Any], object], value: Any) -> None:
    """`read(value)`, its refusal (a profile, recipe, bundle or model error) raised as the lab file's, at `field`."""
    try:
        read(value)
    except (ProfileError, QuantizationError, BundleError, InputError) as exc:
        raise SchemaError(str(exc), file=file, field=field) from None
