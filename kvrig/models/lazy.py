"""The real mlx-lm model for a config, built lazily: MLX allocates nothing until arrays are evaluated, so even
a large model costs only its graph. The planner asks this model (and its caches) for every byte it counts.

Tied embeddings are decided as mlx-lm decides them: with a checkpoint, by its tensor names (the model's own
`sanitize` runs on placeholders named and shaped like the checkpoint's tensors); from a config alone, by its
`tie_word_embeddings`, else the default of the model's own ModelArgs, else the Hugging Face default.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from pathlib import Path
from typing import Any

from kvrig.compat.mlx_lm_classes import model_classes
from kvrig.exceptions import ModelConfigError, UnsupportedArchitectureError
from kvrig.fileio import SafetensorsHeaderError, safetensors_header

TIE_KEY = "tie_word_embeddings"
# transformers writes config.json without values equal to PretrainedConfig's defaults, and its default ties the
# embeddings; a config that says nothing (and a ModelArgs without the field) therefore means "tied".
HF_TIE_DEFAULT = True
LM_HEAD = "lm_head.weight"


# Modules the installed mlx-lm ships that kvrig cannot plan here, and why (checked by the coverage test).
REFUSED: dict[str, str] = {
    "olmo": "mlx-lm's olmo module needs the ai2-olmo package, which mlx-lm does not install",
    "bitnet": "its layers are custom Metal kernels, which MLX cannot build without a GPU (plan it on a Mac)",
    "muse_spark": "its attention, router and norms are mlx-lm's fused Metal kernels (mlx_lm.kernels), which MLX "
    "cannot run without a GPU (plan it on a Mac)",
    # Its cache is neither update_and_fetch KV nor fixed-size state, the two kinds the planner replays.
    "deepseek_v41": "its per-layer LayerCache keeps a sliding window plus compressed KV groups and index keys "
    "that grow at a per-layer compression ratio (compress_ratios) with an open pending group; kvrig's planner "
    "does not replay that cache yet",
}


# Refused only where MLX has no Metal back-end: on a Mac their kernels run and they plan like any other.
METAL_ONLY = frozenset({"bitnet", "muse_spark"})


def refused_here(model_type: str) -> bool:
    import mlx.core as mx

    return model_type in REFUSED and not (model_type in METAL_ONLY and mx.metal.is_available())


def refuse_if_unplannable(model_type: str, source: str | Path | None = None) -> None:
    if refused_here(model_type):
        raise UnsupportedArchitectureError(model_type, mlx_lm_architectures(), file=source, reason=REFUSED[model_type])


def mlx_lm_architectures() -> list[str]:
    """Model modules the installed mlx-lm ships (its own list: the package's modules)."""
    import pkgutil

    import mlx_lm.models

    skip = {"base", "cache", "activations", "rope_utils", "switch_layers", "pipeline", "gated_delta", "ssm", "mla"}
    skip |= {"bitlinear_layers"}
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in skip)


def mlx_classes(config: dict[str, Any], source: str | Path | None = None) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) for a config, with its own model-type remapping."""
    refuse_if_unplannable(str(config.get("model_type")), source)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return model_classes(config)
    except (ValueError, KeyError):
        raise UnsupportedArchitectureError(str(config.get("model_type")), mlx_lm_architectures(), file=source) from None
    except (ImportError, SystemExit):
        # A module that needs a package mlx-lm does not install (olmo exits without ai2-olmo).
        name = str(config.get("model_type"))
        reason = REFUSED.get(
            name, "mlx-lm's module for it cannot be imported (it needs a package mlx-lm does not install)"
        )
        raise UnsupportedArchitectureError(name, mlx_lm_architectures(), file=source, reason=reason) from None


def safetensors_tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor names -> (shape, dtype) from the headers of a folder's safetensors files (no tensor data read)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            header, _ = safetensors_header(path)
        except SafetensorsHeaderError as exc:
            raise ModelConfigError(str(exc), file=path) from None
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (tuple(info["shape"]), str(info["dtype"]))
    return out


def tie_decision(config: dict[str, Any], args_cls: Any, tensors: dict[str, Any] | None = None) -> bool:
    """Whether the LM head reuses the embedding table: the checkpoint's names when given, else the config,
    else ModelArgs' default, else Hugging Face's."""
    if tensors:
        return not any(name.endswith(LM_HEAD) for name in tensors)
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and isinstance(where.get(TIE_KEY), bool):
            return bool(where[TIE_KEY])
    fields = getattr(args_cls, "__dataclass_fields__", {})
    default = getattr(fields.get(TIE_KEY), "default", None)
    return default if isinstance(default, bool) else HF_TIE_DEFAULT


def required_fields(args_cls: Any, config: dict[str, Any]) -> list[str]:
    """The fields mlx-lm's ModelArgs has no default for and the config does not give (in declaration order)."""
    if not dataclasses.is_dataclass(args_cls):
        return []
    return [
        f.name
        for f in dataclasses.fields(args_cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in config
    ]


_MX_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "U32": "uint32", "I32": "int32", "U8": "uint8"}


def build_lazy_model(
    config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]] | None = None, source: str | Path = ""
) -> Any:
    """The mlx-lm model for `config` with unevaluated (unallocated) parameters, its embeddings tied as mlx-lm
    would tie them for this checkpoint (`tensors`: names -> shape, dtype from the safetensors headers)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model_cls, args_cls = mlx_classes(config, source or None)
    tie = tie_decision(config, args_cls, tensors)
    cfg = copy.deepcopy(config)
    cfg[TIE_KEY] = tie
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"][TIE_KEY] = tie
    try:
        model = model_cls(args_cls.from_dict(cfg))
    except (TypeError, ValueError, KeyError, AssertionError, AttributeError, IndexError, ZeroDivisionError) as exc:
        # Fields ModelArgs has no default for, named from its own declaration (not from the TypeError's text).
        if isinstance(exc, TypeError) and (missing := required_fields(args_cls, cfg)):
            raise ModelConfigError(
                f"missing {', '.join(missing)} (mlx-lm's {config.get('model_type')} model requires them)",
                file=source or None,
            ) from None
        raise ModelConfigError(
            f"mlx-lm cannot build a {config.get('model_type')} model from it: {type(exc).__name__}: {exc}",
            file=source or None,
        ) from None
    finally:
        # Every lazy parameter draws from MLX's global random key, an unevaluated chain that grows with each
        # model built; evaluating the two-word key cuts it (a deep chain crashes MLX when it is freed).
        mx.eval(mx.random.state)
    if not hasattr(model, "sanitize"):
        return model
    if tensors:
        weights = {n: mx.zeros(s, getattr(mx, _MX_DTYPES.get(d, "float16"))) for n, (s, d) in tensors.items()}
    elif tie:
        # No checkpoint: what a tied checkpoint would hold, i.e. the model's own tensors without an LM head.
        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        if not any(name.endswith(LM_HEAD) for name, _ in flat):
            return model
        weights = {name: p for name, p in flat if not name.endswith(LM_HEAD)}
    else:
        return model
    # Some models tie in `sanitize` (they drop their head when the checkpoint has none); it sees names only.
    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
        model.sanitize(weights)
    return model


def count_parameters(config: dict[str, Any], model: Any = None) -> int:
    from mlx.utils import tree_flatten

    model = model if model is not None else build_lazy_model(config)
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(p.size for _, p in flat)


def copy_modules(model: Any) -> Any:
    """A copy of the model's module tree sharing its (unevaluated) arrays: mlx-lm's quantize_model swaps
    modules in place, so each recipe quantizes a copy instead of a freshly built model."""
    import mlx.nn as nn

    def dup(value: Any) -> Any:
        if isinstance(value, nn.Module):
            return copy_modules(value)
        if isinstance(value, list):
            return [dup(v) for v in value]
        if isinstance(value, dict):
            return {k: dup(v) for k, v in value.items()}
        return value

    new = copy.copy(model)  # the same class and attributes; its child entries replaced below
    for key, value in model.items():
        dict.__setitem__(new, key, dup(value))
    return new


def cast_model(model: Any, dtype: str) -> Any:
    """Floating parameters cast to `dtype` as mlx-lm's convert casts them (honouring `cast_predicate`)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, v: Any) -> Any:
        return v.astype(target) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))
    return model
