"""Issue 27, item 4: the virtual iPhone charges the residency the app reports.

One SmolLM2 bundle laid out for mapping (2-bit weights, fp16 KV, no eviction), its app built for the virtual
iPhone, soaked into jetsam twice on the same phone: once told to load the weights, once to map them. The host
cannot map without a copy (MLX's CPU allocator copies any buffer it is handed), so both runs hold the same
memory here and nothing below claims a saving on this host: the mapped run REPORTS the phone's residency, and
the kernel leaves those bytes out of what it charges, as iOS leaves clean file-backed pages out of the footprint.

Expected numbers come from elsewhere: the weights' bytes from MLX's own `nbytes` of the bundle's tensors; the
kill contexts from the planner's plan of each residency (`kvrig plan --weights-residency`); the footprint at the
kill from the raw JetsamEvent report.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import build_virtual_ipa
from kvrig.device.deploy import deploy
from kvrig.models import load_model_spec
from kvrig.planner import PlanRequest, plan_memory
from kvrig.profiles import AppMemoryLimit, SourcedInt, load_profile
from kvrig.schemas import load_model_file
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.schemas.results import SoakResult
from kvrig.soaking.driver import SoakOptions, soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.host import EmulatorHost
from kvrig.virtual.swiftapp import buffer_cache_held
from tests.bundle_fixtures import MAPPED, MAPPED_NAME, MAPPED_RECIPE, packaged
from tests.raw_telemetry import raw_kill_footprint, raw_steps

PROFILE = "iPhone16,1"
APP_ID = "dev.kvrig.mapped"
BASELINE = 48 * 1024 * 1024
SOAK_STEP = 512
ROOM_TOKENS = 768  # the loaded run is killed in its second step; the mapped one ~1,800 tokens later (fp16 KV)


@dataclass
class Run:
    result: SoakResult
    out: Path
    predicted_max_context: int

    @property
    def start(self) -> dict:
        return json.loads((self.out / "telemetry.jsonl").read_text().splitlines()[0])

    @property
    def steps(self) -> dict[int, dict]:
        return {s["context_tokens"]: s for s in raw_steps(self.out / "telemetry.jsonl")}


@dataclass
class Soaked:
    bundle: Path
    limit: int
    weight_bytes: int
    loaded: Run
    mapped: Run


def _weight_bytes(bundle: Path) -> int:
    """The independent number: MLX's nbytes of every tensor of the bundle, as MLX loads them."""
    return sum(int(a.nbytes) for f in sorted(bundle.glob("*.safetensors")) for a in mx.load(str(f)).values())


@pytest.fixture(scope="module")
def soaked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Soaked]:
    bundle = packaged(tmp_path_factory, MAPPED_NAME, MAPPED)
    root = tmp_path_factory.mktemp("mapped")
    kv = load_model_file(KVCacheConfig, bundle / KVCACHE_NAME)
    assert kv.weights_layout == "mapped"
    weight_bytes = _weight_bytes(bundle)
    spec, profile = load_model_spec(bundle), load_profile(PROFILE)
    common = PlanRequest(
        schemes=(kv.scheme,),
        weights=MAPPED_RECIPE,
        prefill_step=min(kv.prefill_step_size, SOAK_STEP),
        buffer_cache_bytes=buffer_cache_held("python", kv.buffer_cache_limit_bytes),
        baseline_bytes=BASELINE,
        margin=0.0,
        backend="cpu",  # the virtual iPhone runs MLX on this host's CPU
    )
    # The limit: the loaded plan's own peak footprint at ROOM_TOKENS, as `kvrig demo` sizes it.
    sizing = plan_memory(spec, profile, common.model_copy(update={"max_context_cap": ROOM_TOKENS}))
    limit = sizing.budget_at_max_context[kv.scheme].total_bytes

    def planned(residency: str) -> int:
        given = SourcedInt(value=limit, basis="reported", source="test: the virtual iPhone's limit")
        small = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
        request = common.model_copy(update={"limit": "default", "weights_residency": residency})
        return plan_memory(spec, small, request).max_context[kv.scheme]

    # What `kvrig plan --weights-residency loaded|mapped` predicts on this phone.
    predicted = {residency: planned(residency) for residency in ("loaded", "mapped")}

    project = render_app(bundle, root / "project", AppOptions(name="Mapped", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root)
    address = f"/tmp/kvrig-mapped-{os.getpid()}.sock"
    runs = {}
    with EmulatorHost(address) as host:
        device = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit, baseline_bytes=BASELINE)
        udid = device.identity.udid
        asyncio.run(deploy(bundle, ipa=ipa, udid=udid, usbmux_address=address))
        # A step may take minutes on a loaded 2-core host (the mapped run prefills ~2,500 tokens in float32).
        options = SoakOptions(poll_interval_s=0.2, hang_after_s=600, report_wait_s=10, bundle=bundle.name)
        try:
            for residency in ("loaded", "mapped"):
                plan = make_plan(max_tokens=16384, step_tokens=SOAK_STEP, decode_tokens=1, scheme=kv.scheme)
                plan = plan.model_copy(update={"on_critical": "continue", "weights_residency": residency})
                out = root / residency
                result = asyncio.run(soak(APP_ID, plan, out, udid=udid, options=options, usbmux_address=address))
                runs[residency] = Run(result, out, predicted[residency])
        finally:
            host.run(device.apps.kill_all())
    yield Soaked(bundle, limit, weight_bytes, runs["loaded"], runs["mapped"])


def test_each_run_reports_its_residency(soaked: Soaked) -> None:
    loaded, mapped = soaked.loaded.start, soaked.mapped.start
    assert (loaded["weights_residency"], loaded["mapped_weight_bytes"]) == ("loaded", 0)
    assert (mapped["weights_residency"], mapped["mapped_weight_bytes"]) == ("mapped", soaked.weight_bytes)
    # The host loads either way: the mapped residency is the phone's, and the start record says it converted it.
    assert {"weights_residency", "mapped_weight_bytes"} <= set(mapped["converted"])
    assert not {"weights_residency", "mapped_weight_bytes"} & set(loaded["converted"])
    # results.json records what ran, in the app's own words.
    assert (soaked.loaded.result.weights_residency, soaked.loaded.result.mapped_weight_bytes) == ("loaded", 0)
    assert (soaked.loaded.result.weights_residency_requested, soaked.mapped.result.weights_residency_requested) == (
        "loaded",
        "mapped",
    )
    assert soaked.mapped.result.weights_residency == "mapped"
    assert soaked.mapped.result.mapped_weight_bytes == soaked.weight_bytes


def test_the_mapped_footprint_is_lower_by_the_mapped_weights(soaked: Soaked) -> None:
    loaded, mapped = soaked.loaded.steps, soaked.mapped.steps
    common = sorted(set(loaded) & set(mapped))
    assert common, (sorted(loaded), sorted(mapped))
    for context in common:
        a, b = loaded[context], mapped[context]
        # The same memory on this host, step for step (MLX's own numbers, as the app reported them) ...
        assert (a["mlx_active_bytes"], a["mlx_cache_bytes"], a["kv_bytes"]) == (
            b["mlx_active_bytes"],
            b["mlx_cache_bytes"],
            b["kv_bytes"],
        ), context
        # ... charged lower by exactly the weights' bytes.
        assert a["phys_footprint_bytes"] - b["phys_footprint_bytes"] == soaked.weight_bytes, context
    # MLX still counts the mapped weights (Metal counts a no-copy buffer as active memory): the footprint
    # leaves them out, MLX's active bytes do not.
    last = mapped[common[-1]]
    assert last["mlx_active_bytes"] >= soaked.weight_bytes + last["kv_bytes"]
    assert last["phys_footprint_bytes"] < BASELINE + last["mlx_active_bytes"]


@pytest.mark.parametrize("residency", ["loaded", "mapped"])
def test_each_run_is_killed_where_its_footprint_crosses_the_limit(soaked: Soaked, residency: str) -> None:
    run: Run = getattr(soaked, residency)
    result = run.result
    assert result.outcome == "jetsam", result.outcome_detail
    at_kill, page = raw_kill_footprint(run.out)
    assert soaked.limit < at_kill <= soaked.limit + page
    assert result.footprint_at_kill_bytes == at_kill
    steps = run.steps
    assert max(steps) == result.max_safe_context
    assert steps[max(steps)]["phys_footprint_bytes"] < soaked.limit
    killed = (result.max_safe_context, (result.max_safe_context or 0) + SOAK_STEP)
    summary = f"{residency}: planned {run.predicted_max_context}, killed growing {killed[0]} -> {killed[1]}"
    assert result.max_safe_context is not None and abs(run.predicted_max_context - killed[0]) <= SOAK_STEP, summary


def test_mapping_buys_the_context_its_weights_would_hold(soaked: Soaked) -> None:
    """Same phone, same limit: the mapped run outlives the loaded one by about the weights' bytes of KV."""
    loaded, mapped = soaked.loaded.result.max_safe_context, soaked.mapped.result.max_safe_context
    assert loaded is not None and mapped is not None
    config = json.loads((soaked.bundle / "config.json").read_text())
    # fp16 keys and values of every layer, from the model's own config.
    kv_per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 * 2
    extra = soaked.weight_bytes / kv_per_token
    assert abs((mapped - loaded) - extra) <= 2 * SOAK_STEP, (loaded, mapped, extra)
