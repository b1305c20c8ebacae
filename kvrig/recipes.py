"""The two choices a user makes, with one grammar everywhere (plan, package, bench, lab YAML, demo, the bundle's
manifest and kvcache.json): a weight recipe and a KV spec. Parse and print only; what they cost and how they are
applied live with the planner, the quantizers and the caches.

Weight recipes::

    fp16 | bf16 | fp32                      not quantized
    qN[gG]                                  round-to-nearest, N bits in groups of G (default 64)
    mixed_X_Y                               mlx-lm's mixed recipes (X bits, Y for the layers it picks)
    awq-qN[gG] | gptq-qN[gG]                mlx-lm's calibrated quantizers, qN's layout
    imx-qN[gG] | gpx-qN[gG]                 importance-weighted grids (gpx: with error feedback), qN's layout
    imx-BPW | gpx-BPW | dq-BPW              a target bits per weight (imx/gpx from 4.5: 4-bit, k/v projections
                                            then MLP down/up of the last layers at group 32; below 4.5: 3-bit,
                                            the embedding and head, then those, at 4 bits; dq: mlx-lm's dynamic
                                            4/6-bit, from 4.5)
    ... +kd[N]                              any quantized recipe, its scales and biases then distilled against
                                            the float model for N steps (default 40); same layout and bytes

KV specs::

    fp16 | bf16 | fp32                      the cache in that dtype
    kXvY[gZ]                                keys at X bits, values at Y, groups of Z (default 64)
    ... +kN@L1.L2                           keys of layers L1, L2 at N bits
    ... +kN@topM                            keys of the M layers that suffer most at N bits (measured on the model)
    ... +rot | +rotk                        Hadamard rotation of keys and values | keys only
    ... +sN | +wN                           N sink tokens | a recent window of N tokens kept unquantized
    auto                                    the package default for the model (resolved on it)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal, cast

from kvrig.exceptions import KVSchemeError, QuantizationError, SchemaError
from kvrig.schemas.bundle import Recipe
from kvrig.schemas.kvcache import (  # what kvcache.json may carry
    GROUP_SIZES,
    KV_BITS,
    ROTATION_PARTS,
    KVCacheConfig,
    Rotation,
)

DEFAULT_GROUP_SIZE: Final = 64
UNQUANTIZED: Final = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

# --- weight recipes ----------------------------------------------------------------------------------------

WeightMethod = Literal["none", "rtn", "awq", "gptq", "imx", "gpx", "dq"]
RTN_BITS: Final = (2, 3, 4, 5, 6, 8)
PACKED_BITS: Final = (2, 3, 4, 5, 6, 8)  # what kvrig's importance-weighted grids pack
GPTQ_BITS: Final = (2, 4, 8)  # what mlx-lm's GPTQ packs
MIXED_RECIPES: Final = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
TARGET_BITS: Final = 4  # the low width of the target-bpw recipes from 4.5 bits per weight (4 bits at group 64)
LOW_TARGET_BITS: Final = 3  # imx-/gpx-BPW's low width below 4.5 (their layers upgraded to TARGET_BITS)
DISTILL_STEPS: Final = 40  # `+kd` without a count
_DISTILL = re.compile(r"^kd(\d*)$", re.ASCII)
_WEIGHTS = re.compile(
    r"^(?:(?P<method>awq|gptq|imx|gpx)-)?q(?P<bits>\d)(?:g(?P<group>\d+))?$"
    r"|^(?P<target_method>dq|imx|gpx)-(?P<bpw>\d+(?:\.\d+)?)$"
    r"|^(?P<plain>fp16|bf16|fp32|mixed_\d_\d)$",
    re.ASCII,  # \d would take other scripts' digits too, which int() reads
)


@dataclass(frozen=True)
class WeightRecipe:
    """A weight recipe, parsed: `str(recipe)` prints it back in canonical form (`q4g64` prints as `q4`)."""

    method: WeightMethod
    bits: int | None
    """Uniform bits for a qN layout; the low width for mixed_X_Y and target-bpw recipes; None unquantized."""
    group_size: int = DEFAULT_GROUP_SIZE
    mixed: str | None = None
    """mlx-lm's mixed recipe name (mixed_X_Y), or None."""
    target_bpw: float | None = None
    dtype: str | None = None
    """fp16/bf16/fp32: the dtype the weights keep."""
    distill_steps: int = 0
    """`+kdN`: steps of distillation after the method's own fit (0: none)."""

    @property
    def name(self) -> str:
        if not self.distill_steps:
            return self._base_name
        return f"{self._base_name}+kd{'' if self.distill_steps == DISTILL_STEPS else self.distill_steps}"

    @property
    def _base_name(self) -> str:
        if self.dtype is not None:
            return next(short for short, long in UNQUANTIZED.items() if long == self.dtype)
        if self.mixed is not None:
            return self.mixed
        if self.target_bpw is not None:
            bpw = f"{self.target_bpw:g}"
            return f"{self.method}-{bpw if '.' in bpw else bpw + '.0'}"  # gpx-4.0: read as bits per weight
        group = "" if self.group_size == DEFAULT_GROUP_SIZE else f"g{self.group_size}"
        prefix = "" if self.method == "rtn" else f"{self.method}-"
        return f"{prefix}q{self.bits}{group}"

    def __str__(self) -> str:
        return self.name

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def calibrated(self) -> bool:
        """Needs calibration tokens (and the float model) to be applied."""
        return self.method not in ("none", "rtn") or self.distill_steps > 0

    @property
    def layout(self) -> WeightRecipe | None:
        """The round-to-nearest recipe with the same arrays and bytes (awq-q4 → q4, q4+kd → q4), None for a
        target-bpw recipe (its layout depends on the model)."""
        if self.target_bpw is not None:
            return None
        return replace(self, method="none" if self.dtype else "rtn", distill_steps=0)

    @property
    def undistilled(self) -> WeightRecipe:
        """The recipe without its `+kd` (what is fitted before the distillation starts)."""
        return replace(self, distill_steps=0)


def parse_weights(text: str, group_size: int = DEFAULT_GROUP_SIZE) -> WeightRecipe:
    """A weight recipe from its text; `group_size` applies where the text names none (`q4` vs `q4g32`)."""
    base, *parts = text.strip().lower().split("+")
    steps = 0
    for part in parts:
        kd = _DISTILL.match(part)
        if kd is None or steps:
            raise QuantizationError(
                f"weight recipe '{text}': unexpected part '+{part}' (expected one +kd or +kdN, N distillation steps)"
            )
        steps = int(kd[1]) if kd[1] else DISTILL_STEPS
        if steps < 1:
            raise QuantizationError(f"weight recipe '{text}': +kd{kd[1]} distils for no step (N >= 1)")
    recipe = _parse_base_weights(base, text, group_size)
    if steps and not recipe.quantized:
        raise QuantizationError(f"weight recipe '{text}': +kd distils a quantized recipe's scales; {base} has none")
    return replace(recipe, distill_steps=steps)


def _parse_base_weights(name: str, text: str, group_size: int) -> WeightRecipe:
    m = _WEIGHTS.match(name)
    if not m:
        raise QuantizationError(
            f"unknown weight recipe '{text}': expected fp16, bf16, fp32, qN[gG], mixed_X_Y, awq-qN[gG], "
            "gptq-qN[gG], imx-qN[gG], gpx-qN[gG], imx-BPW, gpx-BPW or dq-BPW, each quantized one optionally "
            "with +kd[N] (e.g. q4, q4g32, gpx-4.6, gpx-4.6+kd)"
        )
    if m["plain"] in UNQUANTIZED:
        return WeightRecipe("none", None, _group(group_size, text), dtype=UNQUANTIZED[m["plain"]])
    if m["plain"]:
        if m["plain"] not in MIXED_RECIPES:
            raise QuantizationError(f"unknown weight recipe '{text}': mlx-lm's mixed recipes are {MIXED_RECIPES}")
        return WeightRecipe("rtn", int(m["plain"].split("_")[1]), _group(group_size, text), mixed=m["plain"])
    if m["bpw"]:
        bpw, method = float(m["bpw"]), cast(WeightMethod, m["target_method"])
        # mlx-lm's dynamic quantization mixes 4 and 6 bits only; kvrig's grids go down to 3 bits (3.5 per weight)
        lowest = TARGET_BITS if method == "dq" else LOW_TARGET_BITS + 0.5
        if not lowest <= bpw <= 8:
            raise QuantizationError(f"recipe '{text}': target bits per weight {bpw:g} outside [{lowest:g}, 8]")
        bits = TARGET_BITS if method == "dq" or bpw >= TARGET_BITS + 0.5 else LOW_TARGET_BITS
        return WeightRecipe(method, bits, DEFAULT_GROUP_SIZE, target_bpw=bpw)
    method = cast(WeightMethod, m["method"] or "rtn")
    bits = int(m["bits"])
    allowed = {"rtn": RTN_BITS, "awq": RTN_BITS, "gptq": GPTQ_BITS, "imx": PACKED_BITS, "gpx": PACKED_BITS}[method]
    if bits not in allowed:
        raise QuantizationError(f"recipe '{text}': {method} packs {', '.join(map(str, allowed))} bits, not {bits}")
    group = _group(int(m["group"]), text) if m["group"] else _group(group_size, text)
    return WeightRecipe(method, bits, group)


def _group(group_size: int, text: str) -> int:
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"recipe '{text}': group size {group_size} is not one MLX supports {GROUP_SIZES}")
    return group_size


# --- KV specs ----------------------------------------------------------------------------------------------

AUTO: Final = "auto"
WEIGHT_CANDIDATES: Final = ("gpx-q4", "gpx-4.6", "q5", "q6", "q8")
"""What `--weights auto` tries, smallest first on every model: 4.5, ~4.6, 5.5, 6.5, 8.5 bits per weight. kvrig
package keeps the first whose bundle passes the quality gate; a plan, which measures nothing, counts the first."""
_BASE = re.compile(r"^k(\d+)v(\d+)(?:g(\d+))?$", re.ASCII)
_LAYER_KEYS = re.compile(r"^k(\d+)@(\d+(?:\.\d+)*)$", re.ASCII)
_TOP_KEYS = re.compile(r"^k(\d+)@top(\d+)$", re.ASCII)
_EXTRA = re.compile(r"^(rot|rotk|s(\d+)|w(\d+))$", re.ASCII)


@dataclass(frozen=True)
class KVSpec:
    """How the KV cache is stored: unquantized in `dtype` (bits None) or affine-quantized (one scale and one bias
    per group in the activation dtype), with per-layer key widths and the extras kvrig's own cache applies
    (rotation, sink tokens, a recent window). `str(spec)` prints it back in canonical form."""

    key_bits: int | None
    value_bits: int | None
    group_size: int = DEFAULT_GROUP_SIZE
    dtype: str = "float16"
    layer_key_bits: tuple[tuple[int, int], ...] = ()
    """(layer index, key bits) for layers whose keys differ from `key_bits` (`+k8@1.3`)."""
    promote_keys: tuple[int, int] | None = None
    """`+kN@topM` not yet resolved to layers: (bits, count)."""
    rotation: Rotation = "none"
    sink_tokens: int = 0
    recent_tokens: int = 0

    @property
    def base(self) -> str:
        """The storage format without per-layer widths or extras: fp16, k8v4, k6v4g32."""
        if self.key_bits is None:
            return next(short for short, long in UNQUANTIZED.items() if long == self.dtype)
        group = "" if self.group_size == DEFAULT_GROUP_SIZE else f"g{self.group_size}"
        return f"k{self.key_bits}v{self.value_bits}{group}"

    @property
    def scheme(self) -> str:
        """What the planner's bytes depend on: the base with its per-layer key widths (`k4v4+k8@1.3`)."""
        by_bits: dict[int, list[int]] = {}
        for layer, bits in self.layer_key_bits:
            by_bits.setdefault(bits, []).append(layer)
        layers = "".join(f"+k{b}@{'.'.join(map(str, ls))}" for b, ls in sorted(by_bits.items()))
        top = f"+k{self.promote_keys[0]}@top{self.promote_keys[1]}" if self.promote_keys else ""
        return self.base + layers + top

    @property
    def name(self) -> str:
        sinks = f"+s{self.sink_tokens}" if self.sink_tokens else ""
        recent = f"+w{self.recent_tokens}" if self.recent_tokens else ""
        return self.scheme + ROTATION_PARTS[self.rotation] + sinks + recent

    def __str__(self) -> str:
        return self.name

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    @property
    def mixed(self) -> bool:
        """K and V at different bits in some layer: needs kvrig's own cache (mlx-lm's takes one bit width)."""
        return self.quantized and any(
            k != self.value_bits for k in (self.key_bits, *dict(self.layer_key_bits).values())
        )

    @property
    def has_extras(self) -> bool:
        return self.rotation != "none" or bool(self.sink_tokens or self.recent_tokens)

    def key_bits_for(self, layer: int) -> int | None:
        return dict(self.layer_key_bits).get(layer, self.key_bits)

    def with_layer_key_bits(self, by_layer: dict[int, int]) -> KVSpec:
        """This spec with keys of the given layers at their own widths (`+kN@topM` resolved, if it was)."""
        pairs = tuple(sorted((i, b) for i, b in by_layer.items() if b != self.key_bits))
        return replace(self, layer_key_bits=pairs, promote_keys=None)


def parse_kv(text: str, *, group_size: int = DEFAULT_GROUP_SIZE, dtype: str = "float16") -> KVSpec:
    """A KV spec from its text; `group_size` applies where the text names none, `dtype` is the activation
    dtype (what an unquantized cache, scales and biases are stored in)."""
    if text.strip().lower() == AUTO:
        raise KVSchemeError(f"KV spec '{text}' is resolved on a model first (kvrig package does)")
    base, *parts = text.strip().lower().split("+")
    spec = _parse_base(base, text, group_size=group_size, dtype=dtype)
    by_layer: dict[int, int] = {}
    rotation: Rotation = "none"
    sinks = recent = 0
    promote = None
    given: dict[str, str] = {}  # kind of extra -> the part that set it: each kind once
    for part in parts:
        kind = _extra_kind(part)
        if kind is not None:
            if kind in given:
                raise QuantizationError(
                    f"KV spec '{text}': '+{part}' after '+{given[kind]}' (expected each extra once)"
                )
            given[kind] = part
        if layer_keys := _LAYER_KEYS.match(part):
            by_layer |= dict.fromkeys((int(i) for i in layer_keys[2].split(".")), _kv_bits(layer_keys[1], "key", text))
        elif top := _TOP_KEYS.match(part):
            promote = (_kv_bits(top[1], "key", text), int(top[2]))
            if not promote[1]:
                raise QuantizationError(f"KV spec '{text}': +k{top[1]}@top0 promotes no layer (expected M >= 1)")
        elif extra := _EXTRA.match(part):
            if extra[1] in ("rot", "rotk"):
                rotation = "hadamard" if extra[1] == "rot" else "hadamard_keys"
            elif extra[2]:
                sinks = int(extra[2])
            else:
                recent = int(extra[3])
        else:  # a misspelling, as an unknown base is: the grammar's errors are QuantizationError's (exit 5)
            raise QuantizationError(
                f"KV spec '{text}': unknown part '+{part}' (expected +kN@L1.L2, +kN@topM, +rot, +rotk, +sN, +wN)"
            )
    if parts and not spec.quantized:
        raise KVSchemeError(f"KV spec '{text}': per-layer widths and extras apply to quantized caches only")
    spec = replace(spec, rotation=rotation, sink_tokens=sinks, recent_tokens=recent)
    return replace(spec.with_layer_key_bits(by_layer), promote_keys=promote)


def _extra_kind(part: str) -> str | None:
    """What a part of a KV spec sets that a spec has one of: the rotation, sinks, window or top layers."""
    if _TOP_KEYS.match(part):
        return "top"
    extra = _EXTRA.match(part)
    if extra is None:
        return None
    return "sinks" if extra[2] else "window" if extra[3] else "rotation"


def _parse_base(base: str, text: str, *, group_size: int, dtype: str) -> KVSpec:
    if base in UNQUANTIZED:
        return KVSpec(None, None, group_size, UNQUANTIZED[base])
    m = _BASE.match(base)
    if not m:
        raise QuantizationError(f"unknown KV spec '{text}': expected fp16, bf16, fp32 or kXvY[gZ] (e.g. k8v4, k6v4g32)")
    group = int(m[3]) if m[3] else group_size
    if group not in GROUP_SIZES:
        raise QuantizationError(f"KV spec '{text}': group size {group} not in {GROUP_SIZES}")
    return KVSpec(_kv_bits(m[1], "key", text), _kv_bits(m[2], "value", text), group, dtype)


def _kv_bits(digits: str, what: str, text: str) -> int:
    bits = int(digits)
    if bits not in KV_BITS:
        raise QuantizationError(f"KV spec '{text}': {what} bits {bits} not in {KV_BITS}")
    return bits


def manifest_kv_problem(recipe: Recipe, kv: KVCacheConfig, manifest_file: Path) -> str | None:
    """A bundle's manifest recipe (`recipe`, read from `manifest_file`) against its kvcache.json (`kv`): the
    recipe's strings must be in the grammar `--weights` and `--kv` take (SchemaError naming the field), and the KV
    spec the manifest records must be the one kvcache.json holds, which is what the app runs; returns what
    differs, or None."""
    for field, value, parse in (("recipe.weights", recipe.weights, parse_weights), ("recipe.kv", recipe.kv, parse_kv)):
        if value:  # recipe.kv is empty in manifests written before it was recorded
            try:
                parse(value)
            except QuantizationError as exc:
                raise SchemaError(str(exc), file=manifest_file, field=field) from None
    if not recipe.kv:
        return None
    spec = parse_kv(recipe.kv)
    if (spec.scheme, spec.rotation, spec.sink_tokens, spec.recent_tokens) == (
        kv.scheme,
        kv.rotation,
        kv.sink_tokens,
        kv.recent_tokens,
    ):
        return None
    return f"holds {kv.spec}, where the manifest's recipe.kv says {recipe.kv}"
