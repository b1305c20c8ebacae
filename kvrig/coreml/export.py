"""`kvrig export coreml`: write a bundle as a stateful Core ML program (.mlpackage), then read it back and hold
it to the plan (kvrig/planner/coreml.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from kvrig.exceptions import CoreMLExportError, CoreMLToolsMissingError, CoreMLUnsupportedError
from kvrig.models import read_config
from kvrig.planner.coreml import CoreMLPlan, coreml_arch, plan_coreml
from kvrig.schemas import StrictModel
from kvrig.schemas.bundle import load_manifest

from .inspect import PackageInfo, inspect_package

# The MIL builder API used here (iOS 18 states, constexpr_blockwise_shift_scale, RangeDim inputs on a pymil
# program) is what coremltools 8 and 9 provide.
SUPPORTED_COREMLTOOLS = (8, 9)
TARGETS = ("iOS18", "iOS26")


class ExportResult(StrictModel):
    output: str
    bundle: str
    target: str
    context: int
    context_source: str = Field(description="--context, kvcache.json (the packaged plan) or the model's maximum")
    model_type: str
    coremltools_version: str
    package: PackageInfo
    plan: CoreMLPlan


def import_coremltools() -> Any:
    """coremltools, or CoreMLToolsMissingError saying how to install it."""
    import logging

    # On Linux coremltools logs a warning per missing Core ML framework proxy at import; the export needs none.
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    # coremltools imports transformers, which advises installing PyTorch; the export needs none. mlx-lm silences
    # the same advice this way at its import.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import coremltools as ct
    except ImportError as exc:
        raise CoreMLToolsMissingError(
            f"coremltools is not installed ({exc}); install kvrig's 'coreml' extra: pip install 'kvrig[coreml]'"
        ) from None
    major = int(ct.__version__.split(".")[0])
    if major not in SUPPORTED_COREMLTOOLS:
        raise CoreMLToolsMissingError(
            f"coremltools {ct.__version__} is not supported; expected {' or '.join(map(str, SUPPORTED_COREMLTOOLS))}.x"
        )
    return ct


def _target(ct: Any, name: str) -> Any:
    if name not in TARGETS or not hasattr(ct.target, name):
        raise CoreMLUnsupportedError(
            f"target '{name}' is not supported: KV states need iOS 18 or later ({', '.join(TARGETS)})", field="target"
        )
    return getattr(ct.target, name)


def _quiet_convert(ct: Any, prog: Any, **kwargs: Any) -> Any:
    # coremltools prints progress bars on stderr for every pass; the CLI has its own output.
    from coremltools.converters.mil.mil.passes import pass_pipeline  # noqa: F401 - present in 8/9

    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        return ct.convert(prog, **kwargs)


def _check_output(output: Path, *, replace: bool) -> None:
    """Before any work: `output` is new, or (with `replace`) a Core ML package, never a file or another folder;
    its parent is a folder or can be one."""
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CoreMLExportError(f"{output}: {parent} is a file, not a folder")
            break
    if not output.exists() and not output.is_symlink():
        return
    if not replace:
        raise CoreMLExportError(f"{output}: already exists (pass --replace to replace it)")
    if output.is_symlink() or not output.is_dir() or not (output / "Manifest.json").is_file():
        raise CoreMLExportError(f"{output}: exists and is not a Core ML package; --replace replaces only those")


def export_coreml(
    bundle: Path,
    output: Path,
    *,
    target: str = "iOS18",
    context: int | None = None,
    replace: bool = False,
) -> ExportResult:
    """Write `bundle` as a stateful Core ML program at `output` and return what the saved package holds."""
    import numpy as np

    ct = import_coremltools()
    from .program import INPUT_IDS, build_program
    from .weights import read_bundle_weights

    if output.suffix != ".mlpackage":
        raise CoreMLExportError(f"{output}: the output must end in .mlpackage")
    _check_output(output, replace=replace)
    load_manifest(bundle)  # a folder that is not a bundle, as every command reading bundles says
    # The architecture first: a family the exporter cannot express is refused before any weight is read.
    config, config_path = read_config(bundle)
    arch = coreml_arch(config, config_path)
    weights = read_bundle_weights(bundle)
    if context is not None:
        source = "--context"
    elif weights.kv_max_context:
        context, source = int(weights.kv_max_context), "kvcache.json"
    else:
        context, source = arch.max_position, "max_position_embeddings"
    if not 1 <= context <= arch.max_position:
        raise CoreMLUnsupportedError(
            f"context {context} is outside 1..{arch.max_position} (the model's max_position_embeddings)",
            file=config_path if source != "--context" else None,
            field="context",
        )
    opset = _target(ct, target)
    prog = build_program(weights, arch, context, opset)
    unused = sorted(set(weights.tensors) - weights.used)
    if unused:
        # A weight the program does not read would be silently dropped: refuse rather than export a different model.
        raise CoreMLUnsupportedError(
            f"the exporter does not use {len(unused)} weight(s) of the bundle, e.g. {', '.join(unused[:3])}",
            file=bundle,
        )
    model = _quiet_convert(
        ct,
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=opset,
        inputs=[ct.TensorType(name=INPUT_IDS, shape=(1, ct.RangeDim(1, context, default=1)), dtype=np.int32)],
        # The program is written as built: no fusion or constant folding that would change its ops or weights.
        pass_pipeline=ct.PassPipeline.EMPTY,
        skip_model_load=True,
    )
    model.short_description = f"kvrig export of {bundle.name}: stateful KV cache, context {context}"
    model.user_defined_metadata["kvrig.context"] = str(context)
    model.user_defined_metadata["kvrig.packaging"] = bundle.name

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent)) / output.name
    try:
        model.save(str(tmp))
        info = inspect_package(tmp)
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)

    plan = plan_coreml(
        weights.config,
        config_path,
        bits=weights.bits,
        group_size=weights.group_size,
        contexts=[context],
        overrides=weights.overrides,
    )
    if (info.weight_blob_bytes, info.weight_file_bytes) != (plan.weights_bytes, plan.weight_file_bytes):
        raise CoreMLExportError(
            f"{output}: weights read back as {info.weight_blob_bytes} bytes in a {info.weight_file_bytes}-byte file; "
            f"the plan says {plan.weights_bytes} in {plan.weight_file_bytes}"
        )
    return ExportResult(
        output=str(output),
        bundle=str(bundle),
        target=target,
        context=context,
        context_source=source,
        model_type=arch.model_type,
        coremltools_version=ct.__version__,
        package=info,
        plan=plan,
    )
