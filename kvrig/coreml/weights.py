"""The bundle's own weights as Core ML constants: MLX's packed groups unpacked into integers, with the same
fp16 scales and biases, nothing re-quantized."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrig.exceptions import BundleError, CoreMLUnsupportedError
from kvrig.models import read_config
from kvrig.planner.coreml import Overrides, bundle_quantization, check_bits
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig


@dataclass(frozen=True)
class Quantized:
    """One MLX affine-quantized matrix: w[i, j] = scales[i, j // g] * q[i, j] + biases[i, j // g]."""

    q: np.ndarray  # uint8 values < 2**bits, shape [out, in]
    scales: np.ndarray  # fp16 [out, in / g]
    biases: np.ndarray  # fp16 [out, in / g]
    bits: int

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]


Tensor = Quantized | np.ndarray


@dataclass
class BundleWeights:
    path: Path
    config: dict[str, Any]
    bits: int | None
    group_size: int
    tensors: dict[str, Tensor]
    kv_max_context: int | None
    overrides: Overrides = field(default_factory=dict)  # layers a mixed recipe gave their own bits or group size
    used: set[str] = field(default_factory=set)

    def get(self, name: str) -> Tensor:
        try:
            value = self.tensors[name]
        except KeyError:
            raise BundleError(f"{self.path}: weight '{name}' is missing from the bundle's safetensors") from None
        self.used.add(name)
        return value

    def vector(self, name: str) -> np.ndarray:
        t = self.get(name)
        if isinstance(t, Quantized):
            raise BundleError(f"{self.path}: weight '{name}' is quantized; expected an fp16 vector")
        return t


def unpack(packed: np.ndarray, bits: int, in_dim: int) -> np.ndarray:
    """MLX packs 32 // bits values per little-endian uint32, lowest bits first."""
    raw = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8)
    if bits == 8:
        return raw.reshape(packed.shape[0], in_dim).copy()
    low, high = raw & 0x0F, raw >> 4
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], in_dim)


def _to_numpy(array: Any) -> np.ndarray:
    return np.asarray(array)


def read_bundle_weights(bundle: Path) -> BundleWeights:
    """Reads config.json, kvcache.json (for the planned context) and the safetensors with MLX."""
    import mlx.core as mx

    config, config_path = read_config(bundle)
    quant = config.get("quantization") or None
    if isinstance(quant, dict) and quant.get("mode", "affine") != "affine":
        raise CoreMLUnsupportedError(
            f"quantization mode '{quant.get('mode')}' is not affine", file=config_path, field="quantization.mode"
        )
    bits, group_size, overrides = bundle_quantization(config, config_path)
    check_bits(bits, config_path, "quantization.bits")
    files = sorted(bundle.glob("*.safetensors"))
    if not files:
        raise BundleError(f"{bundle}: no .safetensors weights")
    raw: dict[str, Any] = {}
    for f in files:
        try:
            raw.update(mx.load(str(f)))  # type: ignore[arg-type]
        except (RuntimeError, ValueError, OSError) as exc:  # what MLX's loader raises on a damaged file
            raise BundleError(
                f"{f}: MLX cannot load it ({type(exc).__name__}: {exc}); `kvrig verify {bundle}` checks every file"
            ) from None
    dtypes = {str(v.dtype) for k, v in raw.items() if not k.endswith(".weight") or v.dtype != mx.uint32}
    if dtypes - {"mlx.core.float16"}:
        raise CoreMLUnsupportedError(
            f"weights in {sorted(dtypes)}; the Core ML program keeps fp16 (re-package with --dtype float16)",
            file=files[0],
        )
    tensors: dict[str, Tensor] = {}
    for name, value in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{stem}.scales" in raw:
            scales, biases = _to_numpy(raw[f"{stem}.scales"]), _to_numpy(raw[f"{stem}.biases"])
            layer_group = overrides.get(stem, (bits, group_size))[1]  # a mixed recipe's layer: its own
            layer_bits = value.shape[1] * 32 // (scales.shape[1] * layer_group)
            check_bits(layer_bits, files[0], f"{stem} (per-layer quantization)")
            in_dim = value.shape[1] * 32 // layer_bits
            tensors[name] = Quantized(unpack(_to_numpy(value), layer_bits, in_dim), scales, biases, layer_bits)
        else:
            tensors[name] = _to_numpy(value)
    kv_context = None
    kv_path = bundle / KVCACHE_NAME
    if kv_path.is_file():
        kv_context = load_model_file(KVCacheConfig, kv_path).max_context
    return BundleWeights(bundle, config, bits, group_size, tensors, kv_context, overrides)
