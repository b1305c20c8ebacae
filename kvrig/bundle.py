"""Bundles: the directory pushed to the phone (weights, tokenizer, config.json, kvcache.json, manifest.json).

A bundle is written into a hidden temporary folder next to the output and renamed at the end, so a folder
with the output's name is always complete; with `force`, an existing bundle there is swapped for the new one
in one rename (Linux `renameat2(RENAME_EXCHANGE)`). `verify_bundle` re-checks every file against the manifest.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvrig import __version__
from kvrig.exceptions import (
    BundleError,
    BundleExistsError,
    BundleWriteError,
    DoesNotFitError,
    ModelConfigError,
    SchemaError,
    VerifyError,
)
from kvrig.fileio import read_data
from kvrig.plan.kv import MLX_STEP, KVScheme, check_dims, parse_scheme
from kvrig.plan.runtime import DEFAULT_BUFFER_CACHE_BYTES
from kvrig.plan.weights import WeightRecipe, parse_recipe
from kvrig.schemas import load_model_file
from kvrig.schemas.bundle import (
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    Prediction,
    QualityCheck,
    Recipe,
    SourceModel,
)
from kvrig.schemas.kvcache import KVCacheConfig, LayerCache, PressurePolicy

KVCACHE_NAME = "kvcache.json"
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
DEFAULT_BUFFER_CACHE_LIMIT = DEFAULT_BUFFER_CACHE_BYTES
MLX_CACHE_STEP = MLX_STEP
_TOP_KEYS = re.compile(r"\+k\d+@top\d+")


# --- options ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackageOptions:
    weights: str = "q8"
    """q8 rather than q4: on SmolLM2 q4 g64 raises perplexity 18-34 % and gets simple facts wrong; q5 is +16 %
    on the GPL-3 text, and q6 (+6-7 %) still answers 'capital of France' wrong (`kvrig bench quality`)."""
    group_size: int = 64
    kv: str = "k8v4"
    kv_group_size: int = 64
    device: str | None = None
    force: bool = False
    """Package even if the plan says it does not fit, and replace an existing bundle at the output."""
    quantized_kv_start: int = 0
    rotation: str = "auto"
    """`auto`: Hadamard on keys and values wherever it applies (see `resolve_rotation`), else none."""
    page_tokens: int = MLX_CACHE_STEP
    keep_tokens: int = 4
    prefill_step_size: int = 512
    buffer_cache_limit_bytes: int = DEFAULT_BUFFER_CACHE_LIMIT
    max_context: int | None = None
    """Without a device: the context written to kvcache.json (default: the model's own maximum)."""
    quality_gate: bool = False
    """Measure the bundle's perplexity against the source and refuse it over `max_ppl_increase_pct` (the CLI
    turns this on by default; `force` packages anyway and records the failed check)."""
    max_ppl_increase_pct: float = 10.0
    sink_tokens: int = 0
    recent_tokens: int = 0
    pressure: PressurePolicy = field(default_factory=PressurePolicy)
    """What the app does on memory-pressure levels (kvcache.json `pressure`)."""


@dataclass
class PackageResult:
    path: Path
    manifest: Manifest
    kvcache: KVCacheConfig
    warnings: list[str] = field(default_factory=list)


# --- the plan (adapter: the one place that calls the planner) ---------------------------------------------


@dataclass(frozen=True)
class PlanView:
    device: str
    limit_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    max_context: int
    memory_limit_bytes: int


def plan_for_bundle(
    config_path: Path, device: str, recipe: WeightRecipe, scheme: KVScheme, kv_group_size: int
) -> PlanView:
    """Calls the planner for one weight recipe and KV scheme on one device."""
    from kvrig.models import load_model_spec
    from kvrig.plan import PlanRequest, plan_memory
    from kvrig.profiles import load_profile

    profile = load_profile(device)
    spec = load_model_spec(config_path)
    plan = plan_memory(
        spec,
        profile,
        PlanRequest(
            schemes=(scheme.name,),
            weights=recipe.name,
            recipes=(recipe.name,),
            group_size=recipe.group_size,
            kv_group_size=kv_group_size,
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
    from kvrig.models.gguf import embedded_default_model

    out = Path(out)
    recipe = parse_recipe(options.weights, options.group_size)
    # `+kN@topM` (the layers whose keys suffer most get N bits) is resolved on the source below.
    scheme = parse_scheme(_TOP_KEYS.sub("", options.kv), group_size=options.kv_group_size)
    _check_output(out, force=options.force)
    source = Path(model) if model is not None else embedded_default_model()
    _check_readable_source(source)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"{out.parent}: cannot create the output folder: {exc.strerror or exc}") from None

    with _source_dir(source, scratch_parent=out.parent) as (src_dir, source_info):
        config = json.loads((src_dir / "config.json").read_text())
        if _TOP_KEYS.search(options.kv):
            from kvrig.quality.kv_sensitivity import resolve_for_source

            scheme = resolve_for_source(src_dir, options.kv, options.kv_group_size).scheme
        _check_kv_group(config, options.kv_group_size, scheme, src_dir / "config.json")
        options = replace(options, rotation=resolve_rotation(options.rotation, config, src_dir / "config.json", scheme))
        warnings: list[str] = []
        plan: PlanView | None = None
        if options.device is not None:
            plan = plan_for_bundle(src_dir / "config.json", options.device, recipe, scheme, options.kv_group_size)
            warnings += check_fits(plan, min_context=MLX_CACHE_STEP, force=options.force)
        tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            with _disk_errors(tmp):
                tmp.mkdir()
                q_config = _write_weights(src_dir, tmp, recipe)
                _copy_tokenizer(src_dir, tmp)
                kvcache = build_kvcache_config(config, src_dir, scheme, options, plan)
                (tmp / KVCACHE_NAME).write_text(kvcache.model_dump_json(by_alias=True, indent=2) + "\n")
                quality = _quality_gate(src_dir, tmp, kvcache, options, recipe.name, scheme.name)
                manifest = Manifest(
                    tool_version=__version__,
                    created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    source=source_info,
                    recipe=Recipe(
                        weights=recipe.name,
                        bits=q_config.get("quantization", {}).get("bits"),
                        group_size=recipe.group_size,
                        kv_scheme=scheme.name,
                        key_bits=scheme.key_bits,
                        value_bits=scheme.value_bits,
                        kv_group_size=options.kv_group_size,
                    ),
                    prediction=_prediction(plan, forced=bool(warnings)),
                    quality=quality,
                    files=list(_hash_files(tmp)),
                )
                (tmp / MANIFEST_NAME).write_text(manifest.model_dump_json(by_alias=True, indent=2) + "\n")
                _install(tmp, out, force=options.force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return PackageResult(out, manifest, kvcache, warnings)


def _quality_gate(
    src_dir: Path, bundle: Path, kv: KVCacheConfig, options: PackageOptions, recipe: str, scheme: str
) -> QualityCheck | None:
    if not options.quality_gate:
        return None
    from kvrig.quality.gate import enforce, measure_quality

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
def _source_dir(source: Path, *, scratch_parent: Path) -> Iterator[tuple[Path, SourceModel]]:
    """A Hugging Face-layout directory for `source` (a GGUF is converted into a scratch folder first)."""
    from kvrig.models.gguf import read_gguf_config

    if source.is_dir():
        config = read_data(source / "config.json", error=ModelConfigError, mapping="a JSON object")
        yield (
            source,
            SourceModel(
                kind="hf",
                path=str(source.resolve()),
                name=str(config.get("_name_or_path") or source.name),
                architecture=str(config.get("model_type", "?")),
            ),
        )
        return
    from kvrig.models.gguf_convert import convert_gguf

    config = read_gguf_config(source)  # fails fast on a non-GGUF file or an unknown architecture
    scratch = Path(tempfile.mkdtemp(prefix=".kvrig-convert-", dir=scratch_parent))
    try:
        with _disk_errors(scratch):
            convert_gguf(source, scratch)
        yield (
            scratch,
            SourceModel(
                kind="gguf",
                path=str(source.resolve()),
                name=source.name,
                sha256=_sha256(source),
                architecture=config["model_type"],
            ),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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


def _check_kv_group(config: dict[str, Any], group: int, scheme: KVScheme, file: Path) -> None:
    """Every quantized cache's head dims must divide by the KV group size (the planner's check, per layer)."""
    from kvrig.models import spec_from_config

    check_dims(spec_from_config(config, file), scheme)


def resolve_rotation(rotation: str, config: dict[str, Any], file: Path, scheme: KVScheme) -> str:
    """`auto` -> `hadamard` for a scheme with keys or values below 8 bits whose caches kvrig's attention reads
    and whose head dims are powers of two (the transform is then its own inverse, here and in MLX Swift),
    `none` otherwise. On SmolLM2 it takes k8v4 from +1.4 % to +0.4 % PPL and k4v4 from +18 % to +7 % (`kvrig
    bench quality`); k8v8 (+0.1 %) keeps mlx-lm's own quantized cache and its fused attention."""
    if rotation != "auto":
        return rotation
    from kvrig.models import spec_from_config
    from kvrig.models.families import NO_QUANTIZED_ATTENTION

    spec = spec_from_config(config, file)
    dims = [d for layer in spec.layers for d in (layer.k_head_dim, layer.v_head_dim) if d]
    powers_of_two = bool(dims) and all(d & (d - 1) == 0 for d in dims)
    narrow = scheme.quantized and min(scheme.key_bits or 16, scheme.value_bits or 16) < 8
    usable = narrow and spec.model_type not in NO_QUANTIZED_ATTENTION and powers_of_two
    return "hadamard" if usable else "none"


def _write_weights(src_dir: Path, dst: Path, recipe: WeightRecipe) -> dict[str, Any]:
    from mlx_lm.utils import save_config, save_model

    from kvrig.quantize import load_source_model, quantize

    model, config = load_source_model(src_dir)
    model, config = quantize(model, config, recipe)
    import mlx.core as mx

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


# --- kvcache.json -----------------------------------------------------------------------------------------


def layer_caches(src_dir: Path, scheme: KVScheme) -> list[LayerCache]:
    """Per-layer cache entries from the model spec (what mlx-lm really stores per layer). Only growing
    full-attention layers are quantized: mlx-lm cannot quantize rotating (sliding) caches, and latent (MLA)
    and linear caches are read as plain arrays."""
    from kvrig.models import load_model_spec

    spec = load_model_spec(src_dir / "config.json")
    out = []
    for layer in spec.layers:
        bits = (scheme.key_bits_for(layer.index), scheme.value_bits) if layer.kind == "full" else (None, None)
        out.append(
            LayerCache(
                layer=layer.index,
                kind=layer.kind,
                window=layer.window if layer.kind == "sliding" else None,
                source_layer=layer.source_layer if layer.kind == "shared" else None,
                key_bits=bits[0],
                value_bits=bits[1],
            )
        )
    return out


def build_kvcache_config(
    config: dict[str, Any], src_dir: Path, scheme: KVScheme, options: PackageOptions, plan: PlanView | None
) -> KVCacheConfig:
    dtype = str(config.get("torch_dtype") or "float16")
    if dtype not in ("float16", "bfloat16", "float32"):
        dtype = "float16"
    if plan is not None:
        max_context = max(plan.max_context, 1)
        memory_limit = plan.memory_limit_bytes
    else:
        text = config.get("text_config", config)
        max_context = options.max_context or int(text.get("max_position_embeddings", 4096))
        memory_limit = 0
    return KVCacheConfig(
        scheme=scheme.name,
        dtype=dtype,  # type: ignore[arg-type]
        key_bits=scheme.key_bits,
        value_bits=scheme.value_bits,
        group_size=options.kv_group_size,
        quantized_kv_start=options.quantized_kv_start,
        rotation=options.rotation,  # type: ignore[arg-type]
        sink_tokens=options.sink_tokens,
        recent_tokens=options.recent_tokens,
        step=MLX_CACHE_STEP,
        page_tokens=options.page_tokens,
        max_context=max_context,
        keep_tokens=options.keep_tokens,
        prefill_step_size=options.prefill_step_size,
        buffer_cache_limit_bytes=options.buffer_cache_limit_bytes,
        memory_limit_bytes=memory_limit,
        pressure=options.pressure,
        layers=layer_caches(src_dir, scheme),
    )


# --- manifest and verify ----------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(root: Path) -> Iterator[ManifestFile]:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST_NAME:
            yield ManifestFile(path=rel, size=path.stat().st_size, sha256=_sha256(path))


@dataclass
class FileProblem:
    path: str
    problem: str  # missing, size, sha256, unexpected


@dataclass
class VerifyResult:
    bundle: Path
    manifest: Manifest
    checked: int
    problems: list[FileProblem]

    @property
    def ok(self) -> bool:
        return not self.problems


def load_manifest(bundle: Path) -> Manifest:
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a bundle folder")
    return load_model_file(Manifest, bundle / MANIFEST_NAME, error=SchemaError)


def check_bundle(bundle: str | Path, *, progress: Callable[[str], None] | None = None) -> VerifyResult:
    """Every file against the manifest: present, same size, same sha256; files the manifest does not list."""
    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    problems: list[FileProblem] = []
    listed = set()
    for entry in manifest.files:
        listed.add(entry.path)
        path = bundle / entry.path
        if progress:
            progress(entry.path)
        if ".." in Path(entry.path).parts or Path(entry.path).is_absolute():
            problems.append(FileProblem(entry.path, "path escapes the bundle"))
        elif not path.is_file():
            problems.append(FileProblem(entry.path, "missing"))
        elif (size := path.stat().st_size) != entry.size:
            how = "truncated" if size < entry.size else "grown"
            problems.append(FileProblem(entry.path, f"size {size} bytes, manifest says {entry.size} ({how})"))
        elif _sha256(path) != entry.sha256:
            problems.append(FileProblem(entry.path, "sha256 differs from the manifest (edited?)"))
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        rel = path.relative_to(bundle).as_posix()
        if rel != MANIFEST_NAME and rel not in listed:
            problems.append(FileProblem(rel, "not listed in the manifest"))
    return VerifyResult(bundle, manifest, len(manifest.files), problems)


def verify_bundle(bundle: str | Path) -> VerifyResult:
    """Like check_bundle, but raises VerifyError naming every file at fault."""
    result = check_bundle(bundle)
    if not result.ok:
        detail = "; ".join(f"{p.path}: {p.problem}" for p in result.problems)
        raise VerifyError(f"{result.bundle}: {len(result.problems)} file(s) do not match the manifest: {detail}")
    return result
