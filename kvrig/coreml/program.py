"""The stateful Core ML program for a llama-family bundle, built op by op with coremltools' MIL builder.

One function, `main`, with a dynamic token count: prefill passes the prompt (or a chunk of it) and decode one
token, both against the same KV states. coremltools 8/9 can also write multifunction packages, but each
function's fixed shapes would need a copy of the deduplication logic to keep the weights written once; a
RangeDim input keeps one program, one copy of the weights and exact bytes. (Fixed shapes would suit the Neural
Engine better; that is a later option — see docs/coreml.md.)

Inputs: `input_ids` int32 [1, T] (1 ≤ T ≤ context) and `position` int32 [1] (tokens already in the cache).
States: `keys_{i}` / `values_{i}` fp16 [1, kv_heads, context, head_dim] per layer. Output: `logits` fp16
[1, vocab] of the last token.

Quantized matrices keep MLX's form w = s·q + b per group: `constexpr_blockwise_shift_scale(q, s)` gives s·q,
and the group biases enter as a second small matmul, x·wᵀ = x·(s·q)ᵀ + (Σ_group x)·bᵀ — what MLX's own
quantized matmul computes. (The op's `offset` would need b/s, which is not exact in fp16.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvrig.coreml.weights import BundleWeights, Quantized
from kvrig.planner.coreml import CoreMLArch

INPUT_IDS, POSITION, LOGITS = "input_ids", "position", "logits"


def state_names(arch: CoreMLArch) -> list[str]:
    return [f"{kind}_{i}" for i in range(arch.layers) for kind in ("keys", "values")]


def inv_freq(arch: CoreMLArch) -> np.ndarray:
    exponents = np.arange(0, arch.head_dim, 2, dtype=np.float64) / arch.head_dim
    return (1.0 / (arch.rope_theta**exponents) / arch.rope_scale).astype(np.float32)


def build_program(weights: BundleWeights, arch: CoreMLArch, context: int, target: Any) -> Any:
    """The pymil Program; nothing is written."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import get_new_symbol, types

    a = arch
    n_rep = a.heads // a.kv_heads
    tokens = get_new_symbol()
    state_shape = (1, a.kv_heads, context, a.head_dim)
    specs = [mb.TensorSpec((1, tokens), dtype=types.int32), mb.TensorSpec((1,), dtype=types.int32)]
    specs += [mb.StateTensorSpec(state_shape, dtype=types.fp16) for _ in state_names(a)]
    fp16 = np.float16

    def const(name: str, value: np.ndarray) -> Any:
        return mb.const(val=value, name=name)

    def vector(name: str) -> Any:
        return const(name, weights.vector(name))

    def matrix(name: str) -> tuple[Any, Any | None]:
        """(dequantized s·q or the fp16 matrix, group biases or None): weight constants created here, once."""
        t = weights.get(f"{name}.weight")
        if not isinstance(t, Quantized):
            return const(f"{name}.weight", t.astype(fp16)), None
        dtype = types.np_uint4_dtype if t.bits == 4 else np.uint8
        data = const(f"{name}.weight", t.q.astype(dtype))
        scales = const(f"{name}.scales", t.scales)
        sq = mb.constexpr_blockwise_shift_scale(data=data, scale=scales, name=f"{name}.dequantized")
        return sq, const(f"{name}.biases", t.biases)

    def linear(x: Any, name: str, loaded: tuple[Any, Any | None], bias: Any | None = None) -> Any:
        w, group_bias = loaded
        # matmul, not linear: linear would add an all-zero bias constant per matrix.
        y = mb.matmul(x=x, y=w, transpose_y=True, name=f"{name}.matmul")
        if group_bias is not None:
            in_dim = x.shape[-1]
            groups = group_bias.shape[1]
            grouped = mb.reshape(x=x, shape=[*([1, -1] if x.rank == 3 else [1]), groups, in_dim // groups])
            sums = mb.reduce_sum(x=grouped, axes=[-1], keep_dims=False)
            y = mb.add(x=y, y=mb.matmul(x=sums, y=group_bias, transpose_y=True), name=f"{name}.out")
        if bias is not None:
            y = mb.add(x=y, y=bias)
        return y

    def rms_norm(x: Any, weight: Any, eps: float) -> Any:
        # fp32 inside: a square of an fp16 activation above 256 would overflow.
        x32 = mb.cast(x=x, dtype="fp32")
        mean = mb.reduce_mean(x=mb.mul(x=x32, y=x32), axes=[-1], keep_dims=True)
        normed = mb.mul(x=x32, y=mb.rsqrt(x=mean, epsilon=np.float32(eps)))
        return mb.mul(x=mb.cast(x=normed, dtype="fp16"), y=weight)

    def rope(x: Any, cos: Any, sin: Any) -> Any:
        half = a.head_dim // 2
        x1 = mb.slice_by_size(x=x, begin=[0, 0, 0, 0], size=[-1, -1, -1, half])
        x2 = mb.slice_by_size(x=x, begin=[0, 0, 0, half], size=[-1, -1, -1, half])
        rotated = mb.concat(values=[mb.mul(x=x2, y=fp16(-1)), x1], axis=-1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))

    def heads(x: Any, count: int, norm: Any | None) -> Any:
        """[1, T, count·D] -> [1, count, T, D] (with the per-head RMSNorm of qwen3)."""
        x = mb.reshape(x=x, shape=[1, -1, count, a.head_dim])
        if norm is not None:
            x = rms_norm(x, norm, a.norm_eps)
        return mb.transpose(x=x, perm=[0, 2, 1, 3])

    def program(input_ids: Any, position: Any, *states: Any) -> Any:
        embed_w, embed_b = matrix("model.embed_tokens")
        h = mb.gather(x=embed_w, indices=input_ids, axis=0)
        if embed_b is not None:
            groups = embed_b.shape[1]
            rows = mb.expand_dims(x=mb.gather(x=embed_b, indices=input_ids, axis=0), axes=[-1])
            rows = mb.tile(x=rows, reps=[1, 1, 1, a.hidden // groups])
            h = mb.add(x=h, y=mb.reshape(x=rows, shape=[1, -1, a.hidden]))
        freqs = const("rope.inv_freq", inv_freq(a))

        # Positions of the new tokens, RoPE tables and the causal mask over the whole state.
        count = mb.slice_by_index(x=mb.shape(x=input_ids), begin=[1], end=[2])
        start = mb.squeeze(x=position, axes=[0])
        end = mb.squeeze(x=mb.add(x=position, y=count), axes=[0])
        pos = mb.range_1d(start=start, end=end, step=np.int32(1))
        angles = mb.mul(x=mb.expand_dims(x=mb.cast(x=pos, dtype="fp32"), axes=[-1]), y=freqs)
        cos = mb.cast(x=mb.concat(values=[mb.cos(x=angles)] * 2, axis=-1), dtype="fp16")
        sin = mb.cast(x=mb.concat(values=[mb.sin(x=angles)] * 2, axis=-1), dtype="fp16")
        cos, sin = (mb.expand_dims(x=t, axes=[0, 1]) for t in (cos, sin))
        key_pos = mb.range_1d(start=np.int32(0), end=np.int32(context), step=np.int32(1))
        visible = mb.less_equal(x=mb.expand_dims(x=key_pos, axes=[0]), y=mb.expand_dims(x=pos, axes=[-1]))
        mask = mb.select(cond=visible, a=fp16(0), b=fp16(-np.inf))
        mask = mb.expand_dims(x=mask, axes=[0, 1, 2])  # [1, 1, 1, T, context]
        write_begin = mb.concat(values=[np.zeros(2, np.int32), position, np.zeros(1, np.int32)], axis=0)
        write_end = mb.concat(
            values=[np.array([1, a.kv_heads], np.int32), mb.add(x=position, y=count), np.array([a.head_dim], np.int32)],
            axis=0,
        )
        scale = fp16(a.head_dim**-0.5)

        for i in range(a.layers):
            p = f"model.layers.{i}"
            x = rms_norm(h, vector(f"{p}.input_layernorm.weight"), a.norm_eps)
            projected = []
            for proj in ("q_proj", "k_proj", "v_proj"):
                loaded = matrix(f"{p}.self_attn.{proj}")
                bias = None
                if a.attention_bias:
                    bias = vector(f"{p}.self_attn.{proj}.bias")
                projected.append(linear(x, f"{p}.self_attn.{proj}", loaded, bias))
            q_norm = k_norm = None
            if a.qk_norm:
                q_norm = vector(f"{p}.self_attn.q_norm.weight")
                k_norm = vector(f"{p}.self_attn.k_norm.weight")
            q = rope(heads(projected[0], a.heads, q_norm), cos, sin)
            k = rope(heads(projected[1], a.kv_heads, k_norm), cos, sin)
            v = heads(projected[2], a.kv_heads, None)

            cached = []
            for state, new in ((states[2 * i], k), (states[2 * i + 1], v)):
                full = mb.slice_update(x=mb.read_state(input=state), update=new, begin=write_begin, end=write_end)
                mb.coreml_update_state(state=state, value=full)
                cached.append(mb.expand_dims(x=full, axes=[2]))  # [1, kv_heads, 1, context, D]

            # Grouped-query attention: the n_rep query heads of one KV head share its cache by broadcasting.
            q = mb.reshape(x=mb.mul(x=q, y=scale), shape=[1, a.kv_heads, n_rep, -1, a.head_dim])
            scores = mb.add(x=mb.matmul(x=q, y=cached[0], transpose_y=True), y=mask)
            attn = mb.matmul(x=mb.softmax(x=scores, axis=-1), y=cached[1])
            attn = mb.transpose(x=mb.reshape(x=attn, shape=[1, a.heads, -1, a.head_dim]), perm=[0, 2, 1, 3])
            attn = mb.reshape(x=attn, shape=[1, -1, a.heads * a.head_dim])
            h = mb.add(x=h, y=linear(attn, f"{p}.self_attn.o_proj", matrix(f"{p}.self_attn.o_proj")))

            x = rms_norm(h, vector(f"{p}.post_attention_layernorm.weight"), a.norm_eps)
            gate = linear(x, f"{p}.mlp.gate_proj", matrix(f"{p}.mlp.gate_proj"))
            up = linear(x, f"{p}.mlp.up_proj", matrix(f"{p}.mlp.up_proj"))
            down = linear(mb.mul(x=mb.silu(x=gate), y=up), f"{p}.mlp.down_proj", matrix(f"{p}.mlp.down_proj"))
            h = mb.add(x=h, y=down)

        h = rms_norm(h, vector("model.norm.weight"), a.norm_eps)
        last = mb.gather(x=h, indices=mb.sub(x=count, y=np.int32(1)), axis=1)
        last = mb.reshape(x=last, shape=[1, a.hidden])
        head = (embed_w, embed_b) if a.tied else matrix("lm_head")
        logits = linear(last, "lm_head", head)
        return mb.identity(x=logits, name=LOGITS)

    from coremltools.converters.mil.mil import Function, Program

    inputs = dict(zip([INPUT_IDS, POSITION, *state_names(a)], specs, strict=True))
    with Function(inputs, opset_version=target) as function:
        args = [function.inputs[name] for name in inputs]
        function.set_outputs([program(*args)])
    prog = Program()
    prog.add_function("main", function)
    return prog
