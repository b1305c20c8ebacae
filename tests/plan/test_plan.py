"""The memory plan end to end: the real SmolLM2 config, the device limit, max context and recommendation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_configs import TINY_CONFIGS

from kvrig.compat.mlx_lm_classes import model_classes
from kvrig.exceptions import ModelConfigError, PlanInputError, QuantizationError, UnsupportedArchitectureError
from kvrig.models import load_model_spec, spec_from_config
from kvrig.planner import plan
from kvrig.planner.kv import context_schedule, kv_bytes
from kvrig.planner.memory import _peak_bytes, recommend
from kvrig.profiles import load_profile
from kvrig.quality.schemes import make_kv_caches
from kvrig.recipes import parse_kv


@pytest.fixture(scope="module")
def smollm2_plan():
    return plan(None, "iPhone16,1", contexts=[40, 2048])


def test_real_smollm2_kv_bytes_match_mlx(smollm2_plan) -> None:
    """The full-size SmolLM2 architecture (from the GGUF's metadata), random weights, real tokens: MLX's
    nbytes at 40 tokens (prompt then one decode step, as mlx-lm feeds them) equals the plan's listed bytes."""
    spec = load_model_spec(None)
    model_cls, args_cls = model_classes(spec.config)
    model = model_cls(args_cls.from_dict(spec.config))
    model.set_dtype(mx.float16)
    for name in ("fp16", "k8v8", "k8v4"):
        scheme = parse_kv(name)
        caches = make_kv_caches(model, spec, scheme)
        for chunk in context_schedule(40, 512):
            model(mx.array([[7] * chunk]), cache=caches)
            mx.eval([c.state for c in caches])  # only the caches: the logits are not needed
        assert smollm2_plan.kv_bytes[name]["40"] == sum(c.nbytes for c in caches), name


def test_the_planners_cache_step_is_mlx_lms() -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from kvrig.kvcache.kv_cache import SchemeKVCache
    from kvrig.planner.kv import MLX_STEP

    assert MLX_STEP == KVCache.step == QuantizedKVCache.step == SchemeKVCache.step


def test_plan_json_carries_the_contract_keys() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrig",
            "plan",
            "--device",
            "iphone-15-pro",
            "--json",
            "--schemes",
            "fp16,k8v4",
            "--contexts",
            "1024,4096",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    for key in (
        "weights_bytes",
        "kv_bytes_per_token",
        "kv_bytes",
        "max_context",
        "limit_bytes",
        "decode_tps_ceiling",
        "recommendation",
    ):
        assert key in data, key
    assert set(data["kv_bytes_per_token"]) == {"fp16", "k8v4"}
    assert set(data["kv_bytes"]["k8v4"]) == {"1024", "4096"}
    # iPhone 15 Pro's entitled limit comes from its profile (the CSV's number), not from the planner.
    profile = load_profile("iPhone16,1")
    assert data["limit_bytes"] == profile.limit_entitled
    assert data["recommendation"]["scheme"] in data["max_context"]
    # the entitled limit names what the app must declare: the key kvrig app's entitlements template declares
    template = Path(__file__).resolve().parents[2] / "templates" / "swift" / "App" / "App.entitlements.j2"
    assert data["limit_kind"] == "entitled" and f"<key>{data['limit_requires']}</key>" in template.read_text()
    assert data["limit_requires"].endswith("increased-memory-limit")


def test_max_context_is_the_largest_that_fits() -> None:
    spec = load_model_spec(None)
    p = plan(None, "iPhone13,1", limit="default", max_context_cap=1 << 22, schemes=["fp16", "k8v4"])
    fixed = p.weights_bytes + p.runtime.buffer_cache_bytes + p.runtime.baseline_bytes
    for name in ("fp16", "k8v4"):
        scheme = parse_kv(name)
        n = p.max_context[name]
        assert p.limited_by[name] == "memory"
        assert _peak_bytes(spec, scheme, n, fixed, 512, "float16").total_bytes <= p.budget_bytes
        assert _peak_bytes(spec, scheme, n + 1, fixed, 512, "float16").total_bytes > p.budget_bytes
    # The smaller cache holds more; the allocated KV alone is below the budget at max context.
    assert p.max_context["k8v4"] > p.max_context["fp16"]
    assert kv_bytes(spec, parse_kv("fp16"), context_schedule(p.max_context["fp16"], 512)) < p.budget_bytes


def test_margin_and_entitlement_move_max_context() -> None:
    # A 4 GB phone (iPhone 12 mini): SmolLM2 reaches ~200k tokens there against ~570k on an iPhone 15 Pro, and
    # the planner replays its caches chunk by chunk up to the context it tries.
    wide = plan(None, "iPhone13,1", schemes=["k8v4"], max_context_cap=1 << 22, margin=0.05)
    narrow = plan(None, "iPhone13,1", schemes=["k8v4"], max_context_cap=1 << 22, margin=0.30)
    assert wide.max_context["k8v4"] > narrow.max_context["k8v4"]
    assert wide.max_context_default_limit["k8v4"] < wide.max_context["k8v4"]  # default limit < entitled


def test_trained_context_caps_max_context() -> None:
    p = plan(None, "iPhone16,1", schemes=["fp16"])
    assert p.max_context["fp16"] == 8192 and p.limited_by["fp16"] == "model"
    assert p.recommendation.scheme == "fp16"  # nothing is gained by quantizing when fp16 holds it all


def test_decode_ceiling_falls_with_context_and_rises_with_smaller_kv() -> None:
    p = plan(None, "iPhone16,1", contexts=[1024, 8192], schemes=["fp16", "k8v4"])
    assert p.decode_tps_ceiling["fp16"]["8192"] < p.decode_tps_ceiling["fp16"]["1024"]
    assert p.decode_tps_ceiling["k8v4"]["8192"] > p.decode_tps_ceiling["fp16"]["8192"]


def test_recommendation_rules() -> None:
    spec = spec_from_config(TINY_CONFIGS["llama"])
    schemes = {n: parse_kv(n) for n in ("fp16", "k8v8", "k8v4", "k4v8", "k4v4")}
    mc = {"fp16": 1000, "k8v8": 2000, "k8v4": 2500, "k4v8": 2500, "k4v4": 3500}
    memory = dict.fromkeys(mc, "memory")
    small = recommend(schemes, mc, memory, 135_000_000, None, spec)
    assert small.scheme == "k8v4"  # longest context without 4-bit keys on a small model
    assert recommend(schemes, mc, memory, 135_000_000, 1800, spec).scheme == "k8v8"  # best quality at target
    assert recommend(schemes, mc, memory, 135_000_000, 3000, spec).scheme == "k4v4"  # only it reaches
    assert recommend(schemes, mc, memory, 8_000_000_000, None, spec).scheme == "k4v4"
    none = recommend(schemes, dict.fromkeys(mc, 0), memory, 135_000_000, None, spec)
    assert none.scheme == "none"


@pytest.mark.parametrize("given", ["k6v4g32", "k8v4+rot", "k8v5", "k4v4+rot+s4+w64"])
def test_any_kv_spec_given_alone_is_recommended(given: str) -> None:
    """A spec outside the five plain names read "No scheme fits: the weights and baseline alone exceed the
    budget" beside its own max context: only those names were candidates."""
    p = plan(None, "iPhone16,1", schemes=[given])
    assert p.max_context[given] > 0
    assert (p.recommendation.scheme, p.recommendation.max_context) == (given, p.max_context[given])


def test_extras_rank_above_their_plain_scheme_at_the_same_bytes() -> None:
    """Rotation, sinks and a recent window only add quality (docs/quality.md's KV rows); at equal max context the
    spec with them is chosen, and 4-bit keys on a small model stay last whatever extras they carry."""
    spec = spec_from_config(TINY_CONFIGS["llama"])
    names = ("k8v4", "k8v4+rot", "k4v4+rot+s4+w64", "k4v8")
    schemes = {n: parse_kv(n) for n in names}
    memory = dict.fromkeys(names, "memory")
    mc = {"k8v4": 2500, "k8v4+rot": 2500, "k4v4+rot+s4+w64": 3400, "k4v8": 2500}
    assert recommend(schemes, mc, memory, 135_000_000, None, spec).scheme == "k8v4+rot"
    assert recommend(schemes, mc, memory, 135_000_000, 3000, spec).scheme == "k4v4+rot+s4+w64"  # only it reaches
    assert recommend(schemes, mc, memory, 8_000_000_000, None, spec).scheme == "k4v4+rot+s4+w64"
    # Narrower keys in some layers take quality away: never ranked above the plain spec, and 4-bit keys in any
    # layer count as 4-bit keys on a small model.
    lowered = {n: parse_kv(n) for n in ("k8v4", "k8v4+k4@0.1.2+rot")}
    same = dict.fromkeys(lowered, 2500)
    assert recommend(lowered, same, memory, 8_000_000_000, None, spec).scheme == "k8v4"
    widened = {n: parse_kv(n) for n in ("k4v4+rot", "k4v4+k8@0.1")}
    assert recommend(widened, dict.fromkeys(widened, 2500), memory, 8_000_000_000, None, spec).scheme == "k4v4+k8@0.1"
    small = {n: parse_kv(n) for n in ("k8v4+k4@0.1", "k8v8")}
    reach = {"k8v4+k4@0.1": 3000, "k8v8": 2000}
    assert recommend(small, reach, memory, 135_000_000, None, spec).scheme == "k8v8"
    # k4v8 has k8v4's bytes and the sensitive half at 4 bits: never chosen over it.
    assert recommend({n: schemes[n] for n in ("k4v8", "k8v4")}, mc, memory, 8_000_000_000, None, spec).scheme == "k8v4"


def test_head_dim_not_divisible_by_group_is_refused() -> None:
    config = {**TINY_CONFIGS["llama"], "head_dim": 96}
    spec = spec_from_config(config)
    from kvrig.planner.kv import check_dims

    with pytest.raises(QuantizationError, match=r"head dim 96 is not divisible by KV group size 64.*group size 32"):
        check_dims(spec, parse_kv("k8v4"))
    check_dims(spec, parse_kv("k8v4g32"))  # a smaller group works


def test_missing_config_field_names_it(tmp_path: Path) -> None:
    config = dict(TINY_CONFIGS["qwen3"])
    del config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(path)
    assert str(path) in str(err.value) and "num_hidden_layers" in str(err.value)


def test_an_incomplete_config_names_every_missing_field_not_a_type_error(tmp_path: Path) -> None:
    """The papercut: `{"model_type": "llama", "hidden_size": 64}` leaked mlx-lm's "TypeError ... missing 5 ...".
    The five are the fields of mlx-lm's llama ModelArgs without a default."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(path)
    message = str(err.value)
    assert message.startswith(f"{path}: missing ") and "TypeError" not in message
    for field in ("num_hidden_layers", "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size"):
        assert field in message


def test_multimodal_layer_types_length_mismatch(tmp_path: Path) -> None:
    config = json.loads(json.dumps(TINY_CONFIGS["gemma3n"]))
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:-1]
    # mlx-lm itself refuses the config; the error names the file and mlx-lm's reason.
    with pytest.raises(ModelConfigError, match=r"^x/config\.json: mlx-lm cannot build a gemma3n model.*IndexError"):
        spec_from_config(config, "x/config.json")


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        spec_from_config({**TINY_CONFIGS["llama"], "model_type": "mamba9"})
    assert "mamba9" in str(err.value) and "qwen3_next" in str(err.value)


def test_bad_margin_is_a_clear_error() -> None:
    with pytest.raises(PlanInputError, match="margin"):
        plan(None, "iPhone16,1", margin=1.5)


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["plan", "--device", "iPhone99,9"], 3, "iPhone99,9"),
        (["plan", "--device", "iPhone16,1", "--schemes", "k7v9"], 5, "k7v9"),
        (["plan", "no/such/model", "--device", "iPhone16,1"], 3, "no/such/model"),
    ],
)
def test_cli_errors_have_distinct_exit_codes(args: list[str], code: int, needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)
    assert proc.returncode == code, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_cli_unknown_gguf_architecture(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from gguf_writer import write_gguf  # type: ignore[import-not-found]

    path = tmp_path / "odd.gguf"
    write_gguf(path, {"general.architecture": "rwkv9"}, {})
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "plan", str(path), "--device", "iPhone16,1"], capture_output=True, text=True
    )
    assert proc.returncode == 4 and "rwkv9" in proc.stderr


def test_prefill_scores_counted_only_without_fused_attention() -> None:
    from kvrig.planner.runtime import prefill_activation_bytes

    fused = spec_from_config(TINY_CONFIGS["llama"])  # head dim 64: MLX's fused kernel
    plain = spec_from_config({**TINY_CONFIGS["llama"], "head_dim": 96})
    assert prefill_activation_bytes(fused, 512, 8192) == prefill_activation_bytes(fused, 512, 1024)
    assert prefill_activation_bytes(plain, 512, 8192) > prefill_activation_bytes(plain, 512, 1024)
    # a smaller prefill step lowers the peak either way
    assert prefill_activation_bytes(plain, 128, 8192) < prefill_activation_bytes(plain, 512, 8192)


def test_the_weights_group_size_leaves_the_kv_group_alone() -> None:
    """kvrig package quantizes KV in groups of 64 whatever the weights' group size; the plan counts the same."""

    def planned(*args: str) -> dict:
        cmd = [sys.executable, "-m", "kvrig", "plan", "-d", "iPhone16,1", "--schemes", "k8v4", "--json", *args]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    g32, default = planned("--group-size", "32"), planned()
    assert g32["kv_group_size"] == default["kv_group_size"] == 64
    assert g32["kv_bytes_per_token"] == default["kv_bytes_per_token"]
    assert g32["weights_bytes"] != default["weights_bytes"]  # the weights did change
    assert planned("--kv-group-size", "32")["kv_bytes_per_token"]["k8v4g32"] > default["kv_bytes_per_token"]["k8v4"]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_top_layers_are_planned_at_the_bytes_of_the_layers_the_measurement_picks(family: str, tmp_path: Path) -> None:
    """`+kN@topM` in a plan, where nothing is measured: its bytes are MLX's nbytes of the caches kvrig package
    makes once the sensitivity measurement has picked the layers (and more than the spec without them)."""
    from kvrig.quality.kv_sensitivity import resolve_variant

    config = TINY_CONFIGS[family]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float16)
    spec = spec_from_config(config)
    name = "k4v4+k8@top1"
    planned = plan(tmp_path, "iPhone16,1", schemes=[name, "k4v4"], contexts=[300], weights="fp16")
    resolved = resolve_variant(model, spec, parse_kv(name), list(range(1, 65)))
    assert resolved.promote_keys is None and len(resolved.layer_key_bits) == 1
    caches = make_kv_caches(model, spec, resolved)
    for chunk in context_schedule(300, 512):
        model(mx.array([[7] * chunk]), cache=caches)
        mx.eval([c.state for c in caches])
    assert planned.kv_bytes[name]["300"] == sum(c.nbytes for c in caches)
    assert planned.kv_bytes[name]["300"] > planned.kv_bytes["k4v4"]["300"]
    assert any(name in note and "exact here" in note for note in planned.notes)


def test_top_layers_beyond_the_models_or_none_are_refused() -> None:
    from kvrig.exceptions import KVSchemeError

    with pytest.raises(KVSchemeError, match=r"promotes more layers than the 30 with a quantized cache"):
        plan(None, "iPhone16,1", schemes=["k4v4+k8@top31"], contexts=[256])
    with pytest.raises(QuantizationError, match=r"promotes no layer \(expected M >= 1\)"):
        parse_kv("k4v4+k8@top0")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_hidden_layers": -5}, "field 'num_hidden_layers': claims -5, not a size"),
        ({"num_attention_heads": 7, "num_key_value_heads": 8}, "mlx-lm's mlx_lm.models.llama cannot run a step"),
    ],
)
def test_a_config_mlx_lm_cannot_run_is_refused_naming_its_file(change: dict, words: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIGS["llama"], **change}))
    with pytest.raises(ModelConfigError) as caught:
        plan(tmp_path, "iPhone16,1", schemes=["fp16"], contexts=[256])
    assert str(caught.value).startswith(str(tmp_path / "config.json")) and words in str(caught.value)


def test_a_family_the_app_keeps_unquantized_says_so_in_the_plan(tmp_path: Path) -> None:
    """gemma3n plans its quantized rows as for any model, with a note that kvrig's app holds only the fp16 one."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["gemma3n"]))
    planned = plan(tmp_path, "iPhone16,1", schemes=["fp16", "k8v4"], contexts=[256], weights="fp16")
    assert any(n.startswith("gemma3n: the MLX Swift app keeps") for n in planned.notes)
    alone = plan(tmp_path, "iPhone16,1", schemes=["fp16"], contexts=[256], weights="fp16")
    assert not any("keeps this family's KV unquantized" in n for n in alone.notes)


def test_the_default_kv_of_a_family_the_app_keeps_unquantized_is_fp16(tmp_path: Path) -> None:
    """What `kvrig package --no-quality-gate` (and bench quality's factual check) resolve `--kv auto` to."""
    from kvrig.bundle.options import package_default_kv

    for name, expected in (("gemma3n", "fp16"), ("llama", "k8v4+rot")):
        (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS[name]))
        assert package_default_kv(tmp_path) == expected, name


def test_a_bundle_plans_its_own_kv_spec(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`kvrig plan BUNDLE` plans the KV spec the bundle's app runs beside the named ones, marked, and recommends
    among them all: before, a k8v4+rot bundle's own spec had no row."""
    from kvrig.packaging import PackageOptions
    from tests.bundle_fixtures import packaged

    bundle = packaged(tmp_path_factory, "smollm2-q4-k8v4rot", PackageOptions(weights="q4", kv="k8v4+rot"))
    run = [sys.executable, "-m", "kvrig", "plan", str(bundle), "--device", "iPhone16,1", "--contexts", "1024"]
    shown = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "k8v4+rot ◀ bundle" in shown
    planned = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert planned["kv_bytes_per_token"]["k8v4+rot"] == planned["kv_bytes_per_token"]["k8v4"]  # rotation is free
    assert planned["max_context"]["k8v4+rot"] == planned["max_context"]["k8v4"] > 0
