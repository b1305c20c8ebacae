"""The test app: a launched-app runtime that grows memory the way the LLM app does, with real MLX.

It holds "weights" (an fp16 MLX array) and per-layer K and V caches that grow in 256-token steps by
concatenating a new chunk, as mlx-lm's KVCache does; each step runs attention scores of one query over the
cache, then reports MLX's own allocator numbers and the caches' nbytes to the emulator (see `apprun`) and,
if the emulator lets it live, writes a telemetry step into Documents/telemetry.jsonl and mirrors it to the
device log. Run with `python -m kvrig.virtual.testapp [options]` (the emulator does, on launch).

Launched with `--kvrig-soak-plan PATH` (PATH inside Documents, as the Swift app takes it), it follows the
plan: run id, scheme, step and max tokens, decode tokens per measurement, telemetry file, the footprint and
time stop conditions.

Foreground and background as the generated app handles them (templates/swift/App/Sources/Backgrounding.swift,
`kvrig.virtual.background`): before each forward pass it checks its scene; sent to the background, it pauses
its GPU work (a `scene` record: paused, during prefill or decode) until it is active again (`resumed`), unless
a continued-processing task holds the GPU (it asks for one at start where `KVRIG_SUPPORTED_RESOURCES` has
`gpu`; then it goes on, `continued`); when that task expires in the background it ends the run cleanly (end
record `background_task_expired`). `--ignore-scene` makes an app that never looks (the kernel aborts it for GPU
work from the background), `--phase-s` holds each phase that long (so a soak can aim at prefill or decode).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from kvrig.schemas.soakplan import SOAKPLAN_LAUNCH_ARGUMENT, SoakPlan
from kvrig.schemas.telemetry import (
    TELEMETRY_FILE,
    EndEvent,
    MemoryPressureEvent,
    SceneEvent,
    StartEvent,
    StepEvent,
    TelemetryEvent,
)

MLX_CACHE_LIMIT = 20 * 1024 * 1024  # the buffer-cache cap the generated app sets
_EVENT = TypeAdapter(TelemetryEvent)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="testapp")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=256, help="tokens added per step (the cache step)")
    p.add_argument("--weights-mb", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=0, help="stop growing here (0: grow until killed)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds to wait between steps")
    p.add_argument("--run-id", default=None)
    p.add_argument("--exit-when-done", action="store_true")
    p.add_argument("--decode-tokens", type=int, default=0, help="one-query passes timed per step (0: none)")
    p.add_argument("--transient-mb", type=float, default=0.0, help="allocated and freed inside every step")
    p.add_argument("--ignore-scene", action="store_true", help="never pause GPU work in the background")
    p.add_argument("--phase-s", type=float, default=0.0, help="seconds each prefill and decode phase lasts at least")
    p.add_argument(SOAKPLAN_LAUNCH_ARGUMENT, dest="soak_plan", default=None, help="soak plan inside Documents")
    return p.parse_args(argv)


def load_plan(documents: Path, name: str) -> SoakPlan:
    """The plan file, confined to Documents like the Swift app's ContainerPath.resolve."""
    path = (documents / name).resolve()
    if not path.is_relative_to(documents.resolve()):
        raise SystemExit(f"soak plan {name!r} is outside Documents")
    return SoakPlan.model_validate_json(path.read_text())


class Channel:
    """The JSON-line channel to the emulator: measurements out, the kernel's verdict in, and the scene news it
    sends at any time (read on a thread, so news arrives while the app computes or waits)."""

    def __init__(self) -> None:
        self.out = sys.stdout
        self.verdicts: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.changed = threading.Condition()
        self.scene = "active"
        self.gpu_task = False  # a continued-processing task holds the GPU
        self.expired = False  # that task expired in the background
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            message = json.loads(line)
            if "scene" in message or "continued_processing" in message:
                with self.changed:
                    if "scene" in message:
                        self.scene = str(message["scene"])
                    if message.get("continued_processing") == "expired":
                        self.gpu_task, self.expired = False, True
                    self.changed.notify_all()
            else:
                self.verdicts.put(message)
        self.verdicts.put(None)
        with self.changed:
            self.scene = "gone"
            self.changed.notify_all()

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def measure(self, measurement: dict[str, int]) -> dict[str, Any] | None:
        self.send({"measure": measurement})
        return self.verdicts.get()


class SceneGate:
    """Before each forward pass: may the app submit GPU work now? (Backgrounding.swift's GPUGate.)"""

    def __init__(self, channel: Channel, telemetry: Telemetry, ignore: bool) -> None:
        self.channel, self.telemetry, self.ignore = channel, telemetry, ignore
        self.announced = "active"

    def request_gpu_task(self) -> None:
        if os.environ.get("KVRIG_SUPPORTED_RESOURCES", "") == "gpu":
            self.channel.gpu_task = True
            self.channel.send({"continued_processing": {"gpu": True}})

    def submit(self, during: str, tokens: int) -> bool:
        """True: go on; False: the run ends here (the continued-processing task expired in the background)."""
        if self.ignore:
            return True
        ch = self.channel
        with ch.changed:
            if ch.scene == "background" and self.announced != "background":
                self.announced = "background"
                gpu = "continued" if ch.gpu_task else "paused"
                self._record("background", during, tokens, gpu)
            while ch.scene == "background" and not ch.gpu_task and not ch.expired:
                ch.changed.wait()
            if ch.expired and ch.scene == "background":
                return False
            if ch.scene == "active" and self.announced == "background":
                self.announced = "active"
                ch.expired = False
                self._record("active", during, tokens, "resumed")
        return True

    def _record(self, phase: str, during: str, tokens: int, gpu: str) -> None:
        self.channel.send({"log": f"scene {phase}: GPU work {gpu} before {during} at {tokens} tokens"})
        self.telemetry.write(SceneEvent, phase=phase, context_tokens=tokens, during=during, gpu=gpu)


class Telemetry:
    def __init__(self, path: Path, run_id: str, channel: Channel) -> None:
        self.path, self.run_id, self.channel, self.seq = path, run_id, channel, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, kind: type, **fields: Any) -> None:
        event = kind(run_id=self.run_id, seq=self.seq, t=time.time(), **fields)
        _EVENT.validate_python(event.model_dump(by_alias=True))
        line = event.model_dump_json(by_alias=True, exclude_none=True)
        os.write(self.fd, (line + "\n").encode())  # one write per record: a kill tears at most the last line
        self.channel.send({"log": f"telemetry {line}"})
        self.seq += 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import mlx.core as mx

    mx.set_cache_limit(MLX_CACHE_LIMIT)
    container = Path(os.environ.get("KVRIG_CONTAINER", "."))
    channel = Channel()
    run_id = args.run_id or os.environ.get("KVRIG_RUN_ID") or uuid.uuid4().hex[:12]
    scheme, telemetry_file, max_footprint, max_seconds = "fp16", TELEMETRY_FILE, None, None
    if args.soak_plan:
        plan = load_plan(container / "Documents", args.soak_plan)
        run_id, scheme, telemetry_file = plan.run_id, plan.scheme, plan.telemetry_file
        args.step_tokens, args.max_tokens = plan.schedule.step_tokens, plan.schedule.max_tokens
        args.decode_tokens = plan.schedule.decode_tokens
        max_footprint, max_seconds = plan.stop.max_footprint_bytes, plan.stop.max_seconds
    started = time.monotonic()
    telemetry = Telemetry(container / "Documents" / telemetry_file, run_id, channel)
    limit = os.environ.get("KVRIG_LIMIT_BYTES")
    telemetry.write(
        StartEvent,
        model="testapp",
        scheme=scheme,
        product_type=os.environ.get("KVRIG_PRODUCT_TYPE", "host"),
        os_version=os.environ.get("KVRIG_OS_VERSION", "host"),
        limit_bytes=int(limit) if limit else None,
    )

    weights = mx.zeros((int(args.weights_mb * 1024 * 1024) // 2,), dtype=mx.float16)
    mx.eval(weights)
    shape = (1, args.kv_heads, 0, args.head_dim)
    keys = [mx.zeros(shape, dtype=mx.float16) for _ in range(args.layers)]
    values = [mx.zeros(shape, dtype=mx.float16) for _ in range(args.layers)]
    query = mx.ones((1, args.kv_heads, 1, args.head_dim), dtype=mx.float16)
    tokens, pressure, end_reason = 0, "normal", "completed"
    gate = SceneGate(channel, telemetry, args.ignore_scene)
    gate.request_gpu_task()
    while not args.max_tokens or tokens < args.max_tokens:
        if not gate.submit("prefill", tokens):
            end_reason = "background_task_expired"
            break
        start = time.perf_counter()
        chunk = (1, args.kv_heads, args.step_tokens, args.head_dim)
        for i in range(args.layers):
            # mlx-lm's KVCache grows by concatenating a zeroed step and writing the new tokens into it, one layer
            # after another: one layer's old buffer is alive beside its new one, the others are already freed.
            # (Evaluating every layer at once would hold all old and new buffers together: a peak of twice the
            # KV that no model's forward pass makes.)
            # New tokens as a materialized chunk beside the cache, as a model's K/V projections are: uniform draws
            # allocate what normal ones do (MLX's peak for a step equal to the byte) at half the CPU time
            # (normal's erfinv is most of this app's work); constants would be fused into the copy, a lower peak.
            keys[i] = mx.concatenate([keys[i], mx.random.uniform(shape=chunk, dtype=mx.float16)], axis=2)
            values[i] = mx.concatenate([values[i], mx.random.uniform(shape=chunk, dtype=mx.float16)], axis=2)
            mx.eval(keys[i], values[i])
        scores = mx.softmax((query @ keys[-1].transpose(0, 1, 3, 2)).astype(mx.float32), axis=-1)
        out = scores.astype(mx.float16) @ values[-1]
        mx.eval(*keys, *values, out)
        if args.transient_mb:
            # Like prefill activations: alive only inside the step, gone before the measurement.
            transient = mx.ones((int(args.transient_mb * 1024 * 1024) // 2,), dtype=mx.float16)
            mx.eval(transient)
            del transient
        if not hold(gate, "prefill", tokens, args.phase_s):
            end_reason = "background_task_expired"
            break
        tokens += args.step_tokens
        elapsed = time.perf_counter() - start
        decode_tps = None
        if args.decode_tokens and not gate.submit("decode", tokens):
            end_reason = "background_task_expired"
            break
        if args.decode_tokens:
            # Decoding one token reads every layer's whole cache once: one query over each layer's K and V.
            t0 = time.perf_counter()
            for _ in range(args.decode_tokens):
                outs = [
                    mx.softmax((query @ k.transpose(0, 1, 3, 2)).astype(mx.float32), axis=-1).astype(mx.float16) @ v
                    for k, v in zip(keys, values, strict=True)
                ]
                mx.eval(*outs)
            if not hold(gate, "decode", tokens, args.phase_s):
                end_reason = "background_task_expired"
                break
            decode_tps = args.decode_tokens / max(time.perf_counter() - t0, 1e-9)
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values, strict=True))
        peak = mx.get_peak_memory()  # the step's transients: the old buffers each growing cache copied from
        mx.reset_peak_memory()
        measured = {
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": peak,
            "kv_bytes": kv_bytes,
            "weight_bytes": weights.nbytes,
            "context_tokens": tokens,
        }
        verdict = channel.measure(measured)
        if verdict is None:
            return 0  # the emulator went away
        if verdict["pressure"] != pressure:
            pressure = verdict["pressure"]
            telemetry.write(
                MemoryPressureEvent,
                level=pressure,
                context_tokens=tokens,
                phys_footprint_bytes=verdict["footprint"],
            )
        telemetry.write(
            StepEvent,
            context_tokens=tokens,
            decode_tps=decode_tps,
            prefill_tps=args.step_tokens / elapsed if elapsed > 0 else None,
            phys_footprint_bytes=verdict["footprint"],
            available_bytes=verdict["available"],
            mlx_active_bytes=measured["mlx_active_bytes"],
            mlx_cache_bytes=measured["mlx_cache_bytes"],
            mlx_peak_bytes=peak,
            kv_bytes=kv_bytes,
            thermal_state="nominal",
        )
        if (max_footprint is not None and verdict["footprint"] >= max_footprint) or (
            max_seconds is not None and time.monotonic() - started >= max_seconds
        ):
            end_reason = "stop_condition"
            break
        if args.interval:
            time.sleep(args.interval)
    telemetry.write(EndEvent, reason=end_reason, context_tokens=tokens)
    return stay_until_killed(args, channel)


HOLD_PASSES = 4


def hold(gate: SceneGate, phase: str, tokens: int, seconds: float) -> bool:
    """Makes a phase last `seconds` more, as HOLD_PASSES forward passes of it would, each behind the gate."""
    if not seconds:
        return True
    for _ in range(HOLD_PASSES):
        if not gate.submit(phase, tokens):
            return False
        time.sleep(seconds / HOLD_PASSES)
    return True


def stay_until_killed(args: argparse.Namespace, channel: Channel) -> int:
    """A finished app stays in the foreground until it is killed (or the emulator closes the channel)."""
    if not args.exit_when_done:
        while channel.verdicts.get() is not None:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
