"""Issue 23's check on the virtual iPhone: an app that never caps MLX's buffer cache (the soak plan's
`buffer_cache: uncapped`) is killed within one soak step of the uncapped plan (`kvrig plan --app uncapped`), and
kvrig's own app (capped) runs on past that point on the same phone.

A tiny float32 llama built from arguments (2 layers, a byte-level tokenizer of 256 symbols), so the host's numbers
are the phone's format (no float32-to-float16 conversion) and the whole soak takes seconds: the prefill chunks'
attention scores (their size grows with the context, so no later chunk takes them again) pile up in MLX's cache.
The measured side is independent of the planner: the kernel charges the app's own MLX peak, active and cache bytes
at each step, and the kill's footprint is read from the raw JetsamEvent report."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvrig.appgen.render import AppOptions, render_app
from kvrig.appgen.virtual_ipa import APP_RUNTIMES, build_virtual_ipa
from kvrig.bundle.options import PackageOptions
from kvrig.device.deploy import deploy
from kvrig.models import load_model_spec
from kvrig.packaging import package
from kvrig.planner import PlanRequest, plan_memory
from kvrig.profiles import AppMemoryLimit, SourcedInt, load_profile
from kvrig.schemas.kvcache import PressurePolicy
from kvrig.soaking.driver import SoakOptions, run_soak
from kvrig.soaking.plan import make_plan
from kvrig.virtual.device import VirtualDevice
from kvrig.virtual.footprint import Measurement, footprint_bytes, peak_footprint_bytes
from kvrig.virtual.host import EmulatorHost
from tests.bundle_fixtures import tiny_source
from tests.device.conftest import on_device, run
from tests.raw_telemetry import raw_kill_footprint
from tests.virtual.conftest import emulator_host

PROFILE = "iPhone16,1"
APP_ID = "dev.kvrig.uncapped"
STEP = 256  # soak step = prefill step: one chunk per step
DECODE = 2
ROOM = 2048  # the limit: the uncapped plan's peak at this context (a dozen seconds of soak)
OPTIONS = SoakOptions(poll_interval_s=0.2, hang_after_s=90, report_wait_s=10)


@dataclass
class Setup:
    host: EmulatorHost
    phone: VirtualDevice
    limit: int
    uncapped: int
    capped: int


def _byte_tokenizer(path: Path) -> Path:
    """A byte-level BPE without merges: every byte one of 256 tokens (what the tiny model's vocabulary holds)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("uncapped")
    tokenizer = _byte_tokenizer(root / "tokenizer.json")
    source = tiny_source(
        root / "src", tokenizer, "llama", vocab_size=256, torch_dtype="float32", max_position_embeddings=65536
    )
    packaged = package(
        source,
        root / "bundle",
        PackageOptions(
            weights="fp32",
            kv="fp32",
            prefill_step_size=STEP,
            quality_gate=False,
            pressure=PressurePolicy(warning="none", critical="none"),  # where jetsam strikes is the point
        ),
    )
    assert packaged.kvcache.dtype == "float32"  # the host's format is the phone's
    spec = load_model_spec(packaged.path)
    profile = load_profile(PROFILE)
    request = PlanRequest(
        schemes=("fp32",),
        weights="fp32",
        recipes=("fp32",),
        dtype="float32",
        prefill_step=STEP,
        backend="cpu",
        margin=0.0,
        limit="default",
        baseline_bytes=0,
        app="uncapped",
        generations=1,
        decode_tokens=DECODE,
        buffer_cache_bytes=packaged.kvcache.buffer_cache_limit_bytes,
    )
    sizing = plan_memory(spec, profile, request.model_copy(update={"max_context_cap": ROOM}))
    limit = sizing.budget_at_max_context["fp32"].total_bytes
    given = SourcedInt(value=limit, basis="reported", source="test: the uncapped plan's peak at ROOM tokens")
    small = profile.model_copy(update={"app_memory_limit": AppMemoryLimit(default_bytes=given)})
    uncapped = plan_memory(spec, small, request).max_context["fp32"]
    capped = plan_memory(spec, small, request.model_copy(update={"app": "kvrig"})).max_context["fp32"]
    project = render_app(packaged.path, root / "app", AppOptions(name="Uncapped", bundle_id=APP_ID)).project
    ipa = build_virtual_ipa(project, root, APP_RUNTIMES["python"])
    with emulator_host(root, "uncap") as host:
        phone = host.add_device(root / "phone", profile=PROFILE, limit_bytes=limit, baseline_bytes=0)
        run(deploy(packaged.path, ipa=ipa, udid=phone.identity.udid))
        yield Setup(host, phone, limit, uncapped, capped)


def _soak(setup: Setup, out: Path, buffer_cache: str, max_tokens: int):  # type: ignore[no-untyped-def]
    plan = make_plan(
        max_tokens=max_tokens,
        step_tokens=STEP,
        decode_tokens=DECODE,
        scheme="fp32",
        buffer_cache=buffer_cache,  # type: ignore[arg-type]
    ).model_copy(update={"on_critical": "continue"})
    try:
        return run(on_device(setup.phone.identity.udid, lambda d: run_soak(d, APP_ID, plan, out, OPTIONS)))
    finally:
        setup.host.run(setup.phone.apps.kill_all())


def test_uncapped_app_is_killed_within_one_step_of_the_uncapped_plan(setup: Setup, tmp_path: Path) -> None:
    # The plans differ by more than a step: the soak can tell them apart.
    assert setup.capped - setup.uncapped > 2 * STEP, (setup.uncapped, setup.capped)
    result = _soak(setup, tmp_path, "uncapped", max_tokens=4 * ROOM)
    assert result.outcome == "jetsam", result.outcome_detail
    at_kill, page = raw_kill_footprint(tmp_path)
    assert setup.limit < at_kill <= setup.limit + page
    survived = result.max_safe_context
    assert survived is not None
    summary = f"uncapped plan {setup.uncapped}, killed growing {survived} -> {survived + STEP}"
    assert abs(setup.uncapped - survived) <= STEP, summary


def test_capped_app_runs_past_the_uncapped_kill(setup: Setup, tmp_path: Path) -> None:
    target = (setup.uncapped // STEP + 2) * STEP  # two soak steps past the uncapped plan (targets are whole steps)
    result = _soak(setup, tmp_path, "capped", max_tokens=target)
    assert result.outcome == "completed", result.outcome_detail
    assert result.max_context_reached is not None and result.max_context_reached >= target


def test_the_kernel_counts_an_uncapped_step_once() -> None:
    """Uncapped, MLX never gives memory back: a step's transients end in the cache, so the step's highest footprint
    is the one at its measurement, not the active peak plus the cache again."""
    step = {"mlx_active_bytes": 100, "mlx_cache_bytes": 60, "mlx_peak_bytes": 150, "weight_bytes": 80, "kv_bytes": 20}
    capped, uncapped = Measurement(**step), Measurement(**step, mlx_cache_uncapped=1)
    assert peak_footprint_bytes(capped, 0) == 150 + 60  # the cache at the measurement stands in for the peak's
    assert peak_footprint_bytes(uncapped, 0) == footprint_bytes(uncapped, 0) == 160
    # A peak above active + cache (a phone-format correction) still counts.
    assert peak_footprint_bytes(Measurement(**{**step, "mlx_peak_bytes": 200}, mlx_cache_uncapped=1), 0) == 200
