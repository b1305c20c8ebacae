"""Choosing by measurement: what `--kv auto`, `--weights auto` and `--fit N` try, and how they rank it.

- `--kv auto`: k8v4 and k8v4 with the Hadamard rotation hold the same bytes; the one whose perplexity on the
  gate's texts (source weights) rises least wins, if within `KV_LIMIT_PCT`; else k8v8, else fp16. The rotation
  helps on prose and can hurt on code, so it is measured on the model, not assumed. Larger specs are measured
  only when no smaller one passes.
- `--weights auto`: the smallest recipe of `WEIGHT_CANDIDATES` whose bundle passes the quality gate (the
  packager writes and gates each in turn).
- `--fit N`: every weights × KV pair the plan says holds N tokens on the device, ranked by measured quality:
  each weight recipe and each KV spec measured on its own against the source, a pair ranked by the sum, and the
  packager's gate measures the winner's combination.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from kvrig.bundle.kvcache_json import host_config
from kvrig.exceptions import QuantizationError
from kvrig.models.spec import ModelSpec
from kvrig.planner.kv import check_dims, context_schedule, kv_bytes
from kvrig.quality.gate import Enough, GateTexts, judge, over_limit, unmeasured
from kvrig.recipes import KVSpec, parse_kv
from kvrig.schemas.bundle import Candidate
from kvrig.schemas.kvcache import KVCacheConfig

KV_AUTO = ("k8v4", "k8v4+rot")
KV_FALLBACK = ("k8v8", "fp16")
KV_LIMIT_PCT = 2.0
"""`--kv auto` takes a KV spec at most this much worse than an unquantized cache on any gate text: the quality
bench's KV goal (on 320-token gate texts k8v4's change moves by about a point from one kind to another)."""
FIT_KV = (
    "fp16",
    "k8v8",
    "k8v4",
    "k8v4+rot",
    "k5v3+rot+s4+w64",
    "k4v4+rot",
    "k4v4+rot+s4+w64",
    "k3v3+rot+s4+w64",
    "k3v3+rot+s4+w112",
)
REFERENCE_CONTEXT = 4096
"""KV specs are compared by their bytes at this context (sink and window copies included)."""


def kv_reference_bytes(spec: ModelSpec, kv: KVSpec) -> int:
    return kv_bytes(spec, replace(kv, dtype="float16"), context_schedule(REFERENCE_CONTEXT, 512))


SourceWithKV = Callable[[KVCacheConfig, Enough | None], dict[str, float]]
"""The unquantized source's perplexity per gate kind through the caches a KV configuration makes, kind by kind
until `enough` says so (gate.kind_perplexities; the packager measures it, or reads what it measured before:
quality/measured.py)."""


def measure_kv(
    source: SourceWithKV, spec: ModelSpec, texts: GateTexts, names: tuple[str, ...], *, limit_pct: float | None = None
) -> list[Candidate]:
    """Each KV spec with the source weights: its bytes and its worst-kind perplexity change, or why the model
    cannot take it (head dims the group does not divide, a rotation that needs a power-of-two head dim). With
    `limit_pct`, a spec's measurement stops at its first text above it (its change is that text's, and its reason
    names the texts left unmeasured); without, every text is measured (`--fit` ranks by the full change)."""
    enough = over_limit(texts, limit_pct) if limit_pct is not None else None
    out = []
    for name in names:
        kv = parse_kv(name)
        try:
            check_dims(spec, kv)
            ppl = source(host_config(spec, kv), enough)
        except QuantizationError as exc:
            out.append(Candidate(weights="source", kv=name, verdict="unavailable", reason=str(exc)))
            continue
        check = judge(ppl, texts, max_increase_pct=100.0)
        left = unmeasured(texts, ppl)
        out.append(
            Candidate(
                weights="source",
                kv=name,
                kv_bytes=kv_reference_bytes(spec, kv),
                ppl_delta_pct=check.ppl_delta_pct,
                verdict="passed",
                reason=f"{', '.join(left)} not measured" if left else "",
            )
        )
    return out


def choose_kv(source: SourceWithKV, spec: ModelSpec, texts: GateTexts) -> tuple[KVSpec, list[Candidate], str]:
    """`--kv auto`: the measured choice, every candidate considered, and why the winner won. Groups are
    measured smallest first and the first with a passing spec ends the search: a larger group cannot win, and
    each measurement is a pass over every gate text."""
    began = time.perf_counter()
    groups = (KV_AUTO, KV_FALLBACK[:1], KV_FALLBACK[1:])
    candidates: list[Candidate] = []
    for i, group in enumerate(groups):
        measured = [
            c
            if c.verdict == "unavailable" or (c.ppl_delta_pct or 0.0) <= KV_LIMIT_PCT
            else c.model_copy(
                update={
                    "verdict": "over the limit",
                    "reason": "; ".join(filter(None, [f"above +{KV_LIMIT_PCT:g} %", c.reason])),
                }
            )
            for c in measure_kv(source, spec, texts, group, limit_pct=KV_LIMIT_PCT)
        ]
        passing = [c for c in measured if c.verdict == "passed"]
        if not passing:
            candidates += measured
            continue
        # Same bytes within a group: the smaller change wins (a tie keeps the plainer spec, listed first).
        best = min(passing, key=lambda c: (c.kv_bytes or 0, c.ppl_delta_pct or 0.0))
        candidates += [c.model_copy(update={"verdict": "chosen"}) if c is best else c for c in measured]
        candidates += [_not_tried(spec, name) for later in groups[i + 1 :] for name in later]
        why = (
            f"{best.kv}: {best.ppl_delta_pct:+.2f} % on its worst gate text, the least among the smallest KV specs "
            f"within +{KV_LIMIT_PCT:g} % of an unquantized cache (source weights, {time.perf_counter() - began:.0f} s)"
        )
        return parse_kv(best.kv), candidates, why
    return parse_kv("fp16"), candidates, "no KV spec could be measured on this model: fp16"


def _not_tried(spec: ModelSpec, name: str) -> Candidate:
    kv = parse_kv(name)
    return Candidate(
        weights="source",
        kv=name,
        kv_bytes=kv_reference_bytes(spec, kv),
        verdict="not tried",
        reason="a smaller KV spec passed",
    )


def rank_fit(pairs: list[Candidate], weights_delta: dict[str, float], kv_delta: dict[str, float]) -> list[Candidate]:
    """The pairs that fit, best estimated quality first: weights change + KV change, each measured against the
    source on the gate's texts; ties to the smaller footprint."""
    fitting = [p for p in pairs if p.verdict == "passed" and p.weights in weights_delta and p.kv in kv_delta]
    scored = [
        p.model_copy(update={"ppl_delta_pct": round(weights_delta[p.weights] + kv_delta[p.kv], 3)}) for p in fitting
    ]
    return sorted(scored, key=lambda p: (p.ppl_delta_pct or 0.0, (p.weights_bytes or 0) + (p.kv_bytes or 0)))
