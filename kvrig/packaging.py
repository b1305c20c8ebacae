"""`kvrig package`: the pipeline that writes a bundle. Source (converted from GGUF when needed) → plan for the
device → quantized weights, tokenizer, kvcache.json → quality gate → manifest.json, all in a hidden folder that
is renamed into place at the end, so a folder with the output's name is always complete; with `force` an
existing bundle there is swapped for the new one in one rename (Linux `renameat2(RENAME_EXCHANGE)`).
The format itself (options, kvcache.json, manifest and verify) is `kvrig.bundle`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrig.bundle.kvcache_json import build_kvcache_config
from kvrig.bundle.manifest import hash_files
from kvrig.bundle.options import MLX_CACHE_STEP, PackageOptions, PlanView, resolve_kv
from kvrig.exceptions import BundleError, BundleExistsError, BundleWriteError, DoesNotFitError, ModelConfigError
from kvrig.models import load_model_spec, spec_from_config
from kvrig.models.gguf import embedded_default_model
from kvrig.models.source import source_dir
from kvrig.planner import PlanRequest, plan_memory
from kvrig.planner.kv import check_dims
from kvrig.profiles import load_profile
from kvrig.quality.gate import enforce, measure_quality
from kvrig.quality.kv_sensitivity import resolve_for_source
from kvrig.quantize.base import load_source_model
from kvrig.quantize.recipes import apply_recipe, calibration_tokens
from kvrig.recipes import AUTO, KVSpec, WeightRecipe, parse_kv, parse_weights
from kvrig.schemas.bundle import MANIFEST_NAME, Manifest, Prediction, QualityCheck, Recipe, SourceModel
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.version import __version__

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class PackageResult:
    path: Path
    manifest: Manifest
    kvcache: KVCacheConfig
    warnings: list[str] = field(default_factory=list)


# --- the plan (adapter: the one place that calls the planner) ---------------------------------------------


def plan_for_bundle(config_path: Path, device: str, recipe: WeightRecipe, scheme: KVSpec) -> PlanView:
    """Calls the planner for one weight recipe and KV scheme on one device."""
    plan = plan_memory(
        load_model_spec(config_path),
        load_profile(device),
        PlanRequest(
            schemes=(scheme.name,),
            weights=recipe.name,
            recipes=(recipe.name,),
            group_size=recipe.group_size,
            kv_group_size=scheme.group_size,
        ),
    )
    # MLX's own limit sits below jetsam's: the app's non-MLX memory (runtime, UI baseline) lives in the gap.
    return PlanView(
        device=plan.device.name,
        limit_bytes=plan.limit_bytes,
        weights_bytes=plan.weights_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token[scheme.name],
        max_context=plan.max_context[scheme.name],
        memory_limit_bytes=max(0, plan.budget_bytes - plan.runtime.baseline_bytes),
    )


def check_fits(plan: PlanView, *, min_context: int, force: bool) -> list[str]:
    """Refuses (DoesNotFitError) when the plan's max context is below `min_context`, saying by how much."""
    if plan.max_context >= min_context:
        return []
    short_tokens = min_context - max(plan.max_context, 0)
    short_bytes = _mib(short_tokens * plan.kv_bytes_per_token)
    if plan.max_context <= 0:
        over = plan.weights_bytes - plan.limit_bytes
        how = (
            f"the weights alone ({_mib(plan.weights_bytes)}) exceed the {_mib(plan.limit_bytes)} limit by {_mib(over)}"
            if over > 0
            else f"weights and fixed overhead leave no room for the KV cache under the "
            f"{_mib(plan.limit_bytes)} limit; {min_context} tokens need {short_bytes} more"
        )
    else:
        how = (
            f"max context is {plan.max_context} tokens, {short_tokens} short of {min_context} "
            f"({short_bytes} over the {_mib(plan.limit_bytes)} limit)"
        )
    message = f"does not fit on {plan.device}: {how}"
    if not force:
        raise DoesNotFitError(message + "; use --force to package anyway")
    return [message + " (packaged anyway: --force)"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --- packaging --------------------------------------------------------------------------------------------


def package(model: str | Path | None, out: str | Path, options: PackageOptions) -> PackageResult:
    """Quantizes `model` (HF directory, GGUF file, None: the embedded SmolLM2) into a bundle at `out`."""
    out = Path(out)
    recipe = parse_weights(options.weights, options.group_size)
    if options.kv.strip().lower() != AUTO:
        parse_kv(options.kv)  # a spec that cannot be read is refused before anything is converted
    source = _check_paths(model, out, force=options.force)
    with contextlib.ExitStack() as stack:
        with _disk_errors(out.parent):
            src_dir, source_info = stack.enter_context(source_dir(source, scratch_parent=out.parent))
        config = json.loads((src_dir / "config.json").read_text())
        scheme = _resolve_kv(src_dir, config, options.kv)
        plan: PlanView | None = None
        warnings: list[str] = []
        if options.device is not None:
            plan = plan_for_bundle(src_dir / "config.json", options.device, recipe, scheme)
            warnings += check_fits(plan, min_context=MLX_CACHE_STEP, force=options.force)
        manifest, kvcache = _write_bundle(
            src_dir, source_info, out, config, recipe, scheme, options, plan, forced=bool(warnings)
        )
    return PackageResult(out, manifest, kvcache, warnings)


def _check_paths(model: str | Path | None, out: Path, *, force: bool) -> Path:
    """The source to read (refused when unreadable), after making sure `out` may be written."""
    _check_output(out, force=force)
    source = Path(model) if model is not None else embedded_default_model()
    _check_readable_source(source)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"{out.parent}: cannot create the output folder: {exc.strerror or exc}") from None
    return source


def _resolve_kv(src_dir: Path, config: dict[str, Any], text: str) -> KVSpec:
    """The KV spec for the source in `src_dir`: `auto` resolved, `+kN@topM` resolved to the layers measured on
    the source, checked against the model's head dims."""
    config_path = src_dir / "config.json"
    kv = resolve_kv(text, config, config_path)
    if kv.promote_keys is not None:
        kv = resolve_for_source(src_dir, kv)
    check_dims(spec_from_config(config, config_path), kv)
    return kv


def _write_bundle(
    src_dir: Path,
    source: SourceModel,
    out: Path,
    config: dict[str, Any],
    recipe: WeightRecipe,
    scheme: KVSpec,
    options: PackageOptions,
    plan: PlanView | None,
    *,
    forced: bool,
) -> tuple[Manifest, KVCacheConfig]:
    """Writes everything into a hidden folder beside `out` and renames it into place; removes it on any error."""
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        with _disk_errors(tmp):
            tmp.mkdir()
            q_config = _write_weights(src_dir, tmp, recipe)
            _copy_tokenizer(src_dir, tmp)
            kvcache = build_kvcache_config(config, load_model_spec(src_dir / "config.json"), scheme, options, plan)
            (tmp / KVCACHE_NAME).write_text(kvcache.model_dump_json(by_alias=True, indent=2) + "\n")
            quality = _quality_gate(src_dir, tmp, kvcache, options, recipe.name, scheme.scheme)
            manifest = Manifest(
                tool_version=__version__,
                created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                source=source,
                recipe=Recipe(
                    weights=recipe.name,
                    bits=q_config.get("quantization", {}).get("bits"),
                    group_size=recipe.group_size,
                    kv_scheme=scheme.scheme,
                    key_bits=scheme.key_bits,
                    value_bits=scheme.value_bits,
                    kv_group_size=scheme.group_size,
                ),
                prediction=_prediction(plan, forced=forced),
                quality=quality,
                files=list(hash_files(tmp)),
            )
            (tmp / MANIFEST_NAME).write_text(manifest.model_dump_json(by_alias=True, indent=2) + "\n")
            _install(tmp, out, force=options.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest, kvcache


def _quality_gate(
    src_dir: Path, bundle: Path, kv: KVCacheConfig, options: PackageOptions, recipe: str, scheme: str
) -> QualityCheck | None:
    if not options.quality_gate:
        return None
    check = measure_quality(src_dir, bundle, kv, max_increase_pct=options.max_ppl_increase_pct)
    return enforce(check, force=options.force, recipe=recipe, kv=scheme)


def _check_output(out: Path, *, force: bool) -> None:
    """An existing output folder is replaced only with `force`, and only if it is a bundle (or empty)."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise BundleExistsError(f"{out}: output folder already exists; use --force to replace it, or another -o")
    if out.is_symlink() or not out.is_dir():
        raise BundleExistsError(f"{out}: exists and is not a folder; not replacing it")
    if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise BundleExistsError(f"{out}: exists and is not a kvrig bundle (no {MANIFEST_NAME}); not replacing it")


def _install(tmp: Path, out: Path, *, force: bool) -> None:
    """Renames the finished bundle into place; with `force` an existing one is swapped out, then removed."""
    if not out.exists():
        os.rename(tmp, out)
        return
    _check_output(out, force=force)  # again: it may have appeared while we quantized
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old bundle
        return
    # No atomic exchange on this system: the old bundle moves aside for the moment between two renames.
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where that is unavailable."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):  # kernel or filesystem without RENAME_EXCHANGE
        return False
    raise OSError(code, os.strerror(code), str(b))


def _prediction(plan: PlanView | None, *, forced: bool) -> Prediction | None:
    if plan is None:
        return None
    return Prediction(
        device=plan.device,
        limit_bytes=plan.limit_bytes,
        weights_bytes=plan.weights_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        max_context=plan.max_context,
        fits=not forced,
        forced=forced,
    )


def _check_readable_source(source: Path) -> None:
    if not source.exists():
        raise ModelConfigError("model not found", file=source, expected="a Hugging Face directory or a .gguf file")
    if source.is_dir():
        try:
            names = {p.name for p in source.iterdir()}
        except OSError as exc:
            raise ModelConfigError(f"cannot read the model directory: {exc.strerror or exc}", file=source) from None
        if "config.json" not in names:
            raise ModelConfigError("no config.json in the model directory", file=source)
        if not any(n.endswith(".safetensors") for n in names):
            raise ModelConfigError("no *.safetensors weights in the model directory", file=source)
        if not os.access(source / "config.json", os.R_OK):
            raise ModelConfigError("cannot read config.json", file=source / "config.json")
    elif not os.access(source, os.R_OK):
        raise ModelConfigError("cannot read the model file", file=source)


@contextlib.contextmanager
def _disk_errors(where: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise BundleWriteError(
                f"{where}: disk full while writing the bundle ({exc.strerror}); nothing was kept"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise BundleWriteError(f"{where}: cannot write: {exc.strerror}") from None
        raise
    except _WeightsWriteFailed as exc:
        free = shutil.disk_usage(where.parent).free
        reason = "disk full" if free < 64 * 2**20 else "write failed"
        raise BundleWriteError(f"{where}: {reason} while writing the bundle ({exc}); nothing was kept") from None


class _WeightsWriteFailed(Exception):
    """MLX's safetensors writer failed (MLX raises RuntimeError without an errno for it)."""


def _write_weights(src_dir: Path, dst: Path, recipe: WeightRecipe) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer, save_config, save_model

    model, config = load_source_model(src_dir)
    calibration = calibration_tokens(load_tokenizer(src_dir)) if recipe.calibrated else None
    model, config = apply_recipe(model, config, recipe, calibration)
    mx.eval(model.parameters())  # computed here, so a RuntimeError from the save below is the write's
    try:
        save_model(dst, model, donate_model=True)
    except RuntimeError as exc:  # MLX reports a failed safetensors write without an errno
        raise _WeightsWriteFailed(str(exc)) from exc
    save_config(config, config_path=dst / "config.json")
    return config


def _copy_tokenizer(src_dir: Path, dst: Path) -> None:
    found = [n for n in TOKENIZER_FILES if (src_dir / n).is_file()]
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        raise ModelConfigError("no tokenizer.json or tokenizer.model", file=src_dir)
    for name in found:
        shutil.copyfile(src_dir / name, dst / name)
