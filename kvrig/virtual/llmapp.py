"""The LLM app runtime: what the virtual iPhone runs for an app built with `kvrig build --virtual`.

It does what the generated Swift app does (templates/swift/App/Sources/Engine.swift), with real MLX on the
host: finds the bundle pushed into Documents, loads it with the host runtime (kvrig.runtime), builds the
caches kvcache.json asks for, and runs the soak plan named by `--kvrig-soak-plan PATH`: feeds the plan's text
up to each context target in prefill steps, decodes `decode_tokens` greedily, and writes a telemetry step.
After every forward pass it reports its memory to the emulator over the channel of `kvrig.virtual.apprun`
(which may kill it there: jetsam) and reacts to the pressure level in the reply as kvcache.json's policy says.
Numbers are reported in the phone's format (see llm_memory); the start event lists which were converted.
That includes the weights' residency: when the phone's app would map them (kvcache.json's layout, or the soak
plan's `weights_residency`), this runtime still loads them (the host cannot map without a copy) and reports
`mapped` with the bytes the phone maps, which the kernel leaves out of the footprint.
The soak plan's `buffer_cache` chooses the app: capped at kvcache.json's `buffer_cache_limit_bytes` (kvrig's app,
the default), or `uncapped`: the app never sets MLX's cache limit nor empties the cache (mlx-lm's loop's
`mx.clear_cache` calls do nothing), as an app grown from mlx-swift-lm's generation loop runs. Whatever loading
the bundle freed on this host (its float32 conversions) is emptied once before the run: the phone loads without
them. The cache is reported as the host holds it, which is the phone's format for a float32 bundle.

The virtual iPhone starts it through `python -m kvrig.virtual.llmlaunch [--kvrig-soak-plan FILE] [--kvrig-bundle
FOLDER]`, which preloads OpenBLAS before this module imports MLX.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.kvcache.caches import make_caches
from kvrig.runtime.blas import openblas_loaded
from kvrig.runtime.generate import UNCAPPED_CACHE_LIMIT, GenerationStats, generate_tokens, uncapped_cache
from kvrig.runtime.host import load_bundle_model
from kvrig.schemas import load_model_file
from kvrig.schemas.bundle import MANIFEST_NAME
from kvrig.schemas.kvcache import KVCACHE_NAME, KVCacheConfig
from kvrig.schemas.soakplan import SOAKPLAN_LAUNCH_ARGUMENT, BufferCacheMode, SoakPlan
from kvrig.schemas.telemetry import (
    TELEMETRY_FILE,
    EndEvent,
    EvictEvent,
    MemoryPressureEvent,
    StartEvent,
    StepEvent,
)
from kvrig.virtual.llm_memory import (
    CONVERTED_FIELDS,
    RESIDENCY_FIELDS,
    PhoneAccount,
    Residency,
    evict_oldest,
    kv_bytes,
    phone_active_bytes,
    phone_residency,
    respond,
    stored_weight_bytes,
)
from kvrig.virtual.testapp import Channel, SceneGate, Telemetry, load_plan, stay_until_killed

BUNDLE_ARGUMENT = "--kvrig-bundle"
CHECKPOINT_FILE = "checkpoint.json"


class AppError(Exception):
    """A failure the app reports in its end record (and the device log) instead of a traceback."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llmapp")
    p.add_argument(SOAKPLAN_LAUNCH_ARGUMENT, dest="soak_plan", default=None, help="soak plan inside Documents")
    p.add_argument(BUNDLE_ARGUMENT, dest="bundle", default=None, help="bundle folder inside Documents")
    p.add_argument("--exit-when-done", action="store_true", help="exit after the end record (default: stay)")
    return p.parse_args(argv)


def find_bundle(documents: Path, name: str | None = None) -> Path:
    """The bundle folder: the one named (inside Documents), else the single folder holding kvcache.json and
    manifest.json."""

    if name:
        path = (documents / name).resolve()
        if not path.is_relative_to(documents.resolve()):
            raise AppError(f"bundle {name!r} is outside Documents")
        if not (path / KVCACHE_NAME).is_file():
            raise AppError(f"no bundle at Documents/{name} (no {KVCACHE_NAME}): push it with `kvrig deploy`")
        return path
    found = sorted(
        d
        for d in (documents.iterdir() if documents.is_dir() else [])
        if d.is_dir() and (d / KVCACHE_NAME).is_file() and (d / MANIFEST_NAME).is_file()
    )
    if not found:
        raise AppError(
            f"no model bundle in Documents (a folder with {KVCACHE_NAME} and {MANIFEST_NAME}): "
            "push one with `kvrig deploy`"
        )
    if len(found) > 1:
        names = ", ".join(d.name for d in found)
        raise AppError(f"several bundles in Documents ({names}): name one with {BUNDLE_ARGUMENT}")
    return found[0]


@dataclass
class Timing:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None


class Stop(Exception):
    """Raised between forward passes when the app must stop (critical pressure with stop_and_save)."""


class BackgroundEnded(Exception):
    """Raised between forward passes when the continued-processing task ended while the app is in the background
    (the generated app's GPUGate: the run ends cleanly)."""


class Engine:
    """The loaded bundle, its caches, and the loop that grows them while reporting to the emulator."""

    def __init__(
        self,
        bundle: Path,
        kv: KVCacheConfig,
        channel: Channel,
        telemetry: Telemetry,
        residency: Residency | None = None,
        buffer_cache: BufferCacheMode | None = None,
    ) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        self.kv, self.channel, self.telemetry = kv, channel, telemetry
        self.residency = residency or Residency("loaded")
        self.uncapped = buffer_cache == "uncapped"
        mx.set_cache_limit(kv.buffer_cache_limit_bytes)
        self.model, self.tokenizer, config = load_bundle_model(bundle)
        if self.uncapped:
            mx.clear_cache()  # what loading freed here (float32 conversions) the phone's load never allocates
            mx.set_cache_limit(UNCAPPED_CACHE_LIMIT)
        self.model_type = str(config.get("model_type", ""))
        self.caches = make_caches(self.model, kv, self.model_type)
        params: list[tuple[str, Any]] = tree_flatten(self.model.parameters())  # type: ignore[assignment]
        host_weights = sum(int(v.nbytes) for _, v in params if isinstance(v, mx.array))
        self.account = PhoneAccount(
            host_weights, stored_weight_bytes(bundle), kv.dtype, self.residency.mapped_weight_bytes, self.uncapped
        )
        self.on_critical: str = "stop_and_save"
        self.pressure = "normal"
        self.stop_requested = False
        # Before the next forward pass: may it be submitted? (the scene, as the generated app follows it)
        self.gate = SceneGate(channel, telemetry, ignore=False)
        self.prefill_end = 0  # the context at which the current feed's prefill ends and decoding starts
        self.last_verdict: dict[str, Any] = {}
        self.eos = set(getattr(self.tokenizer, "eos_token_ids", None) or [])

    @property
    def context_tokens(self) -> int:
        return max((int(getattr(c, "offset", 0)) for c in self.caches), default=0)

    def measure(self, *, react: bool = True) -> dict[str, Any]:
        """Reports memory to the emulator; returns its verdict (with our measurement) after reacting to a
        change of pressure level. The emulator may kill us inside this call."""
        measurement = self.account.measure(self.caches, self.context_tokens)
        verdict = self.channel.measure(measurement)
        if verdict is None:
            raise SystemExit(0)  # the emulator went away
        self.last_verdict = {**verdict, "measurement": measurement}
        if react:
            self.react(self.last_verdict)
        return self.last_verdict

    def react(self, verdict: dict[str, Any]) -> None:
        if verdict["pressure"] != self.pressure:
            self.pressure = verdict["pressure"]
            self.on_pressure(self.pressure, int(verdict["footprint"]))

    def on_pressure(self, level: Any, footprint: int) -> None:
        import mlx.core as mx

        context = self.context_tokens
        self.telemetry.write(MemoryPressureEvent, level=level, context_tokens=context, phys_footprint_bytes=footprint)
        self.channel.send({"log": f"memory pressure {level} at {context} tokens"})
        action, tokens = respond(level, context, self.kv, self.on_critical)  # type: ignore[arg-type]
        if action == "stop":
            self.stop_requested = True
        elif action == "evict":
            dropped, skipped = evict_oldest(self.caches, self.kv.keep_tokens, tokens)
            if skipped:
                self.channel.send({"log": f"{skipped} caches cannot evict (rings, recurrent or shared state)"})
            if dropped:
                if not self.uncapped:  # an app that never empties MLX's cache does not after an eviction either
                    mx.clear_cache()
                self.telemetry.write(
                    EvictEvent,
                    tokens_evicted=dropped,
                    context_tokens=self.context_tokens,
                    kv_bytes=kv_bytes(self.caches, self.kv.dtype)[1],
                )

    def after_step(self) -> None:
        """kvrig's memory hook in the generation loop: report the step (the kernel may kill us here), react."""
        self.measure()
        if self.stop_requested:
            raise Stop
        context = self.context_tokens
        if not self.gate.submit("prefill" if context < self.prefill_end else "decode", context):
            raise BackgroundEnded

    def feed(self, tokens: list[int], decode_tokens: int, prefill: Timing, decode: Timing) -> None:
        """Feeds `tokens` in prefill steps, then decodes up to `decode_tokens` greedily (stopping at end of
        sequence), in the runtime's generation loop (mlx-lm's generate_step) with the memory hook."""

        stats = GenerationStats()
        self.prefill_end = self.context_tokens + len(tokens)
        if not self.gate.submit("prefill", self.context_tokens):
            raise BackgroundEnded
        with uncapped_cache() if self.uncapped else contextlib.nullcontext():
            for _ in generate_tokens(
                self.model,
                tokens,
                self.caches,
                self.kv,
                max_tokens=decode_tokens,
                stop_tokens=self.eos,
                stats=stats,
                model_type=self.model_type,
                on_step=self.after_step,
            ):
                pass
        prefill.tokens += stats.prompt_tokens
        prefill.seconds += stats.prefill_seconds
        # The first generated token comes out of the prefill; decode speed counts the steps after it.
        decode.tokens += max(0, stats.generated_tokens - 1)
        decode.seconds += stats.decode_seconds


def _targets(plan: SoakPlan) -> list[int]:
    s = plan.schedule
    if s.start_tokens > s.max_tokens:
        return [s.max_tokens]
    return list(range(s.start_tokens, s.max_tokens + 1, s.step_tokens))


def _stop_reason(plan: SoakPlan, decode_tps: float | None, footprint: int, elapsed: float) -> str | None:
    stop = plan.stop
    if stop.min_decode_tps is not None and decode_tps is not None and decode_tps < stop.min_decode_tps:
        return f"decode {decode_tps:.2f} tok/s below {stop.min_decode_tps}"
    if stop.max_footprint_bytes is not None and footprint > stop.max_footprint_bytes:
        return f"footprint {footprint} above {stop.max_footprint_bytes} bytes"
    if stop.max_seconds is not None and elapsed > stop.max_seconds:
        return f"ran {int(elapsed)} s, limit {int(stop.max_seconds)} s"
    return None


def run_soak(engine: Engine, plan: SoakPlan) -> tuple[str, str | None]:
    """Grows the context target by target; returns the end reason and message."""

    engine.on_critical = plan.on_critical
    engine.gate.request_gpu_task()  # where the phone supports it: the GPU held in the background (iOS 26+)
    text = list(engine.tokenizer.encode(plan.text, add_special_tokens=False))
    if not text:
        return "error", "the soak text encodes to no tokens"
    began = time.monotonic()
    cursor = 0
    try:
        for target in _targets(plan):
            prefill, decode = Timing(), Timing()
            # At least one token: the loop starts from a prompt (decoding may have passed the target already).
            needed = max(1, target - engine.context_tokens)
            feed = [text[(cursor + i) % len(text)] for i in range(needed)]
            cursor += needed
            engine.feed(feed, plan.schedule.decode_tokens, prefill, decode)
            verdict = engine.measure()
            m = verdict["measurement"]
            footprint = int(verdict["footprint"])
            engine.telemetry.write(
                StepEvent,
                context_tokens=engine.context_tokens,
                decode_tps=decode.rate,
                prefill_tps=prefill.rate,
                phys_footprint_bytes=footprint,
                available_bytes=int(verdict["available"]),
                mlx_active_bytes=phone_active_bytes(m),
                mlx_cache_bytes=m["mlx_cache_bytes"],
                kv_bytes=m["kv_bytes"],
                thermal_state="nominal",
                backend="mlx",
            )
            why = _stop_reason(plan, decode.rate, footprint, time.monotonic() - began)
            if why is not None:
                return "stop_condition", why
            if engine.stop_requested:
                raise Stop
    except Stop:
        return "memory_critical", f"critical memory pressure at {engine.context_tokens} tokens"
    except BackgroundEnded:
        return "background_task_expired", (
            f"the continued-processing task ended in the background at {engine.context_tokens} tokens"
        )
    return "completed", None


def _save_checkpoint(documents: Path, run_id: str, context: int, reason: str) -> None:
    import json

    data = {"run_id": run_id, "context_tokens": context, "reason": reason, "t": time.time()}
    (documents / CHECKPOINT_FILE).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    # The plans the virtual iPhone is held to are the CPU's (demo.py: backend="cpu"); on a Mac MLX would take Metal.
    mx.set_default_device(mx.cpu)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    container = Path(os.environ.get("KVRIG_CONTAINER", "."))
    documents = container / "Documents"
    channel = Channel()
    plan = load_plan(documents, args.soak_plan) if args.soak_plan else None
    run_id = plan.run_id if plan else os.environ.get("KVRIG_RUN_ID") or f"chat-{uuid.uuid4().hex[:8]}"
    telemetry = Telemetry(documents / (plan.telemetry_file if plan else TELEMETRY_FILE), run_id, channel)
    reason, message = "error", None
    engine: Engine | None = None
    try:
        if plan is not None and plan.backend == "coreml":
            # `kvrig soak` refuses this before launch; a plan written by hand ends here, not on MLX instead.
            raise AppError("the virtual iPhone runs MLX on Linux and has no Core ML: this soak needs a real iPhone")
        bundle = find_bundle(documents, args.bundle)
        kv = load_model_file(KVCacheConfig, bundle / "kvcache.json")
        residency = phone_residency(bundle, kv, plan.weights_residency if plan is not None else None)
        channel.send({"log": f"loading {bundle.name} (KV {kv.spec}, weights {residency.residency})"})
        if residency.note:
            channel.send({"log": f"weights loaded, not mapped: {residency.note}"})
        elif residency.residency == "mapped":
            channel.send(
                {
                    "log": f"weights mapped on the phone ({residency.mapped_weight_bytes} B, outside the footprint); "
                    "this host loads them (MLX's CPU allocator copies any buffer it is handed)"
                }
            )
        buffer_cache = plan.buffer_cache if plan is not None else None
        if buffer_cache == "uncapped":
            channel.send({"log": "MLX's buffer cache uncapped and never emptied (an app kvrig did not write)"})
        engine = Engine(bundle, kv, channel, telemetry, residency, buffer_cache)

        first = engine.measure(react=False)  # the loaded weights: jetsam can strike before any token
        mapped = residency.residency == "mapped"
        telemetry.write(
            StartEvent,
            model=bundle.name,
            scheme=kv.spec,
            product_type=os.environ.get("KVRIG_PRODUCT_TYPE", "host"),
            os_version=os.environ.get("KVRIG_OS_VERSION", "host"),
            limit_bytes=int(first["footprint"]) + int(first["available"]),
            converted=[*CONVERTED_FIELDS, *(RESIDENCY_FIELDS if mapped else ())],
            weights_residency=residency.residency,
            mapped_weight_bytes=residency.mapped_weight_bytes,
            residency_note=residency.note,
        )
        channel.send(
            {
                "log": f"ready: {engine.model_type}, KV {kv.spec}, OpenBLAS {'on' if openblas_loaded() else 'off'}; "
                f"host computes in float32, footprint counts {kv.dtype} for the same shapes"
            }
        )
        engine.react(first)
        if plan is None:
            return stay_until_killed(args, channel)
        reason, message = run_soak(engine, plan)
    except Stop:
        reason, message = "memory_critical", "critical memory pressure while loading"
    except AppError as exc:
        message = str(exc)
    except MemoryError as exc:  # what an allocator that refuses raises (bad_alloc through nanobind)
        reason, message = "allocation_failed", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # the end record names any other failure; the soak driver reads it
        message = f"{type(exc).__name__}: {exc}"
    context = engine.context_tokens if engine is not None else 0
    if reason in ("memory_critical", "allocation_failed"):
        _save_checkpoint(documents, run_id, context, reason)
    if message:
        channel.send({"log": f"soak {run_id}: {reason}: {message}"})
    telemetry.write(EndEvent, reason=reason, context_tokens=context, message=message)
    return stay_until_killed(args, channel)


if __name__ == "__main__":
    sys.exit(main())
