"""Running a bundle on the host CPU fast, with its weights still quantized at rest.

On a CPU, MLX's quantized matmul is a naive loop and float16 arithmetic is emulated, so the host runtime:
- computes in float32 (activations, attention, KV cache); weights stay packed with their float16 scales;
- for inputs with many rows (prefill) dequantizes the weight to float32 transiently and runs one BLAS GEMM
  (OpenBLAS when preloaded);
- for one or a few rows (decode) uses MLX's quantized matrix-vector product with the scales in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kvrig.models.source import read_tokenizer

COMPUTE_DTYPE = mx.float32
MANY_ROWS = 16
"""From this many input rows on, dequantize + GEMM beats the quantized matrix-vector kernel."""
DEQUANT_CHUNK_ELEMENTS = 1 << 20
"""Weight elements dequantized at a time (4 MiB in float32). MLX evaluates weight-only branches of the graph
early, so each chunk's product is evaluated at once: at most one float32 chunk is alive, and peak memory stays
close to the quantized weights'. Much smaller chunks make the prefill's GEMMs too small for BLAS to run at speed
(the quality gate's measurement is all prefill)."""


class HostQuantizedLinear(nn.Module):
    def __init__(self, q: nn.QuantizedLinear, *, eager: bool = True) -> None:
        super().__init__()
        self.eager = eager
        self.weight, self.scales = q.weight, q.scales
        self.biases = q.get("biases")
        if "bias" in q:
            self.bias = q.bias
        self.group_size, self.bits, self.mode = q.group_size, q.bits, q.mode
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        x = x.astype(COMPUTE_DTYPE)
        if x.size // x.shape[-1] >= MANY_ROWS:
            y = _dequantized_matmul(
                x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.mode, eager=self.eager
            )
        else:
            y = _qmv(x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.mode)
        if "bias" in self:
            y = y + self.bias.astype(COMPUTE_DTYPE)
        return y


class HostQuantizedEmbedding(nn.Module):
    def __init__(self, q: nn.QuantizedEmbedding) -> None:
        super().__init__()
        self.weight, self.scales = q.weight, q.scales
        self.biases = q.get("biases")
        self.group_size, self.bits, self.mode = q.group_size, q.bits, q.mode
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        biases = None if self.biases is None else self.biases[ids].astype(COMPUTE_DTYPE)
        return mx.dequantize(
            self.weight[ids], self.scales[ids].astype(COMPUTE_DTYPE), biases, self.group_size, self.bits, self.mode
        )

    def as_linear(self, x: mx.array) -> mx.array:
        x = x.astype(COMPUTE_DTYPE)
        if x.size // x.shape[-1] < MANY_ROWS:
            return _qmv(x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.mode)
        # Output layer on many rows (only when every position's logits are wanted): kept lazy, so the
        # logits of prefill chunks, which nobody reads, are never computed.
        return _dequantized_matmul(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.mode, eager=False
        )


class HostLinear(nn.Module):
    """An unquantized (float16) layer computed in float32, keeping the float16 copy at rest."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight = lin.weight
        if "bias" in lin:
            self.bias = lin.bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(COMPUTE_DTYPE) @ self.weight.astype(COMPUTE_DTYPE).T
        return y + self.bias.astype(COMPUTE_DTYPE) if "bias" in self else y


class HostEmbedding(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.weight = emb.weight
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        return self.weight[ids].astype(COMPUTE_DTYPE)

    def as_linear(self, x: mx.array) -> mx.array:
        return x.astype(COMPUTE_DTYPE) @ self.weight.astype(COMPUTE_DTYPE).T


def _dequantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
    *,
    eager: bool = True,
) -> mx.array:
    """x @ dequantize(w).T, one chunk of output rows at a time (one BLAS GEMM per chunk). Eager: each chunk is
    evaluated at once so at most one float32 chunk is alive."""
    in_features = scales.shape[-1] * group_size
    rows = max(1, DEQUANT_CHUNK_ELEMENTS // in_features)
    if eager:
        mx.eval(x)
    parts = []
    for start in range(0, w.shape[0], rows):
        sl = slice(start, start + rows)
        # Float32 scales: with float16 ones MLX's CPU dequantize runs in emulated float16, several times slower.
        chunk = mx.dequantize(
            w[sl],
            scales[sl].astype(COMPUTE_DTYPE),
            None if biases is None else biases[sl].astype(COMPUTE_DTYPE),
            group_size,
            bits,
            mode,
        )
        part = x @ chunk.T
        if eager:
            mx.eval(part)
        parts.append(part)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _qmv(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str
) -> mx.array:
    # Float16 scales would make the kernel run in emulated float16 (far slower on x86).
    return mx.quantized_matmul(
        x,
        w,
        scales.astype(COMPUTE_DTYPE),
        None if biases is None else biases.astype(COMPUTE_DTYPE),
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def prepare_for_host(model: nn.Module) -> nn.Module:
    """Swaps linear/embedding layers for the host versions above; small float parameters (norms) go to
    float32. Weights stay quantized."""
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            # The output layer stays lazy: prefill chunks build logits that are never evaluated.
            swaps.append((name, HostQuantizedLinear(module, eager=name.split(".")[-1] != "lm_head")))
        elif isinstance(module, nn.QuantizedEmbedding):
            swaps.append((name, HostQuantizedEmbedding(module)))
        elif type(module) is nn.Linear:
            swaps.append((name, HostLinear(module)))
        elif type(module) is nn.Embedding:
            swaps.append((name, HostEmbedding(module)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    swapped = {n for n, _ in swaps}
    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    small = [
        (k, v.astype(COMPUTE_DTYPE))
        for k, v in params
        if mx.issubdtype(v.dtype, mx.floating) and v.ndim <= 1 and not any(k.startswith(s + ".") for s in swapped)
    ]
    if small:
        model.update(tree_unflatten(small))
    mx.eval(model.parameters())
    return model


def load_bundle_model(bundle: str | Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """mlx-lm loads the bundle (model, tokenizer, config) as its `load` does; the model is then prepared for the
    host. A tokenizer mlx-lm cannot load is ModelConfigError naming it."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(bundle))
    tokenizer = read_tokenizer(Path(bundle), eos_token_ids=config.get("eos_token_id"))
    return prepare_for_host(model), tokenizer, config
