"""The HTML report of a results file: a summary table and, per run, footprint vs context, decode tok/s vs
context and, where the soak read the battery, its temperature beside tok/s over time (PNG, matplotlib), with
the limit from the jetsam report and the planner's prediction as lines. Where a phone ran the same entry and
scheme with the weights loaded and with them mapped (the lab entry's `residencies`), a table sets the two
footprints side by side at the largest context both reached, per device, with both curves in one plot. The
page is the jinja2 template templates/report/report.html.j2 (autoescaped); this module plots and formats.

Everything it shows comes from results.json, so `kvrig lab report` can render it again anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrig.appgen.escape import xml_chars
from kvrig.exceptions import ReportError, ReportFolderError
from kvrig.fileio import atomic_output, atomic_write, make_folder
from kvrig.lab.gates import failures, prediction_error
from kvrig.schemas.lab import slug
from kvrig.schemas.results import RESULTS_FILE, Evidence, ResultsFile, SoakResult, short_udid

REPORT_FILE = "report.html"
IMAGES_DIR = "report"
MIB = 1024 * 1024

TEMPLATE = "report.html.j2"


def _mib(n: int | None) -> str:
    return f"{n / MIB:.1f} MiB" if n is not None else ""


def run_name(r: SoakResult) -> str:
    host = f" @ {r.device.host}" if r.device.host else ""
    return f"{short_udid(r.device.udid)}{host} {r.entry or r.app_id} [{r.variant}]"


def _footprints(r: SoakResult) -> dict[int, int]:
    """Footprint by context from the app's step records (the last record at a context, after an eviction)."""
    return {p.context_tokens: p.phys_footprint_bytes for p in r.tps_curve if p.phys_footprint_bytes is not None}


@dataclass(frozen=True)
class ResidencyPair:
    """One phone's runs of one entry and scheme with the weights loaded and with them mapped."""

    loaded: SoakResult
    mapped: SoakResult

    @property
    def contexts(self) -> list[int]:
        """Contexts both runs measured, in order."""
        return sorted(set(_footprints(self.loaded)) & set(_footprints(self.mapped)))

    def at(self, context: int) -> tuple[int, int]:
        """(loaded, mapped) footprint at a context both measured."""
        return _footprints(self.loaded)[context], _footprints(self.mapped)[context]


def residency_pairs(results: ResultsFile) -> list[ResidencyPair]:
    """The loaded and mapped runs of the same phone, entry and scheme, paired (by what each run asked for)."""
    groups: dict[tuple[str, str, str, str], dict[str, SoakResult]] = {}
    for r in results.runs:
        if r.weights_residency_requested is not None:
            key = (r.device.host or "", r.device.udid, r.entry or r.app_id, r.scheme)
            groups.setdefault(key, {})[r.weights_residency_requested] = r
    return [ResidencyPair(g["loaded"], g["mapped"]) for g in groups.values() if {"loaded", "mapped"} <= set(g)]


def _residency_text(r: SoakResult) -> str:
    """How the run held its weights, in the app's words (a fallback names its reason)."""
    if r.weights_residency is None:
        return "" if r.weights_residency_requested is None else f"asked {r.weights_residency_requested}"
    text: str = r.weights_residency
    if r.weights_residency == "mapped" and r.mapped_weight_bytes is not None:
        text += f" ({_mib(r.mapped_weight_bytes)})"
    if r.residency_note:
        text += f": {r.residency_note}"
    return text


@contextlib.contextmanager
def _figure(path: Path, title: str) -> Iterator[Any]:
    """One report plot: an Agg figure of the report's size; titled, gridded and saved to `path` once drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    try:
        yield ax
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        with atomic_output(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)


def _plot_footprint(r: SoakResult, path: Path) -> bool:
    points = [(p.context_tokens, p.phys_footprint_bytes) for p in r.tps_curve if p.phys_footprint_bytes is not None]
    if not points:
        return False
    with _figure(path, f"footprint: {run_name(r)}") as ax:
        ax.plot([c for c, _ in points], [b / MIB for _, b in points], "o-", label="phys_footprint (app telemetry)")
        if r.limit_bytes is not None:
            ax.axhline(r.limit_bytes / MIB, color="tab:red", label="limit (jetsam report)")
        elif r.app_limit_bytes is not None:
            ax.axhline(r.app_limit_bytes / MIB, color="tab:red", linestyle="--", label="limit (app)")
        if r.footprint_at_kill_bytes is not None and points:
            # Killed while growing to the next step: plotted one step past the last context that survived.
            contexts = [c for c, _ in points]
            kill_at = contexts[-1] + (contexts[-1] - contexts[-2] if len(contexts) > 1 else 0)
            ax.plot(
                [kill_at], [r.footprint_at_kill_bytes / MIB], "x", color="tab:red", ms=10, label="footprint at kill"
            )
        p = r.predicted
        if p is not None and p.limit_bytes is not None:
            ax.axhline(p.limit_bytes / MIB, color="tab:purple", linestyle=":", label="predicted limit (plan)")
        if p is not None and p.max_context:
            ax.axvline(
                p.max_context, color="tab:purple", linestyle="-.", label=f"predicted max context {p.max_context}"
            )
        if r.max_safe_context:
            tag = "confirmed" if r.max_safe_context_confirmed else "measured"
            ax.axvline(r.max_safe_context, color="tab:green", linestyle="--", label=f"max safe context ({tag})")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, loc="lower right")
    return True


def _plot_tps(r: SoakResult, path: Path) -> bool:
    points = [(p.context_tokens, p.decode_tps) for p in r.tps_curve if p.decode_tps is not None]
    if not points:
        return False
    with _figure(path, f"decode: {run_name(r)}") as ax:
        ax.plot([c for c, _ in points], [t for _, t in points], "o-", label="decode tok/s")
        gates = [c for c in r.gates if c.gate.startswith("min_decode_tps_at[")]
        for i, check in enumerate(gates):
            context = int(check.gate[len("min_decode_tps_at[") : -1])
            ax.plot([context], [check.threshold], "v", color="tab:red", ms=9, label="gate minimum" if i == 0 else None)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("tokens / s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    return True


def _plot_thermal(r: SoakResult, path: Path) -> bool:
    """Decode tok/s and the battery's temperature over the run's time (one epoch axis: telemetry `t` and the
    diagnostics relay's samples), so a speed that falls as the phone heats up is not read as a context cost."""
    temps = [(b.t, b.temperature_c) for b in r.battery if b.temperature_c is not None]
    if not temps:
        return False
    t0 = min(t for t, _ in temps)
    tps = [(p.t, p.decode_tps) for p in r.tps_curve if p.t is not None and p.decode_tps is not None]
    if tps:
        t0 = min(t0, min(t for t, _ in tps))
    with _figure(path, f"heat: {run_name(r)}") as ax:
        ax.plot([t - t0 for t, _ in temps], [c for _, c in temps], "-", color="tab:orange", label="battery °C")
        ax.set_xlabel("seconds since the run started")
        ax.set_ylabel("battery temperature (°C)")
        if tps:
            ax2 = ax.twinx()
            ax2.plot([t - t0 for t, _ in tps], [v for _, v in tps], "o-", color="tab:blue", label="decode tok/s")
            ax2.set_ylabel("tokens / s")
            ax2.set_ylim(bottom=0)
            ax2.legend(fontsize=7, loc="lower right")
        ax.legend(fontsize=7, loc="upper left")
    return True


def _plot_residency(pair: ResidencyPair, path: Path) -> bool:
    curves = {"loaded": pair.loaded, "mapped": pair.mapped}
    if not pair.contexts:
        return False
    with _figure(
        path, f"loaded vs mapped weights: {run_name(pair.loaded).rsplit(' [', 1)[0]} [{pair.loaded.scheme}]"
    ) as ax:
        for residency, r in curves.items():
            points = sorted(_footprints(r).items())
            ax.plot([c for c, _ in points], [b / MIB for _, b in points], "o-", label=f"footprint, {residency}")
        limit = pair.loaded.limit_bytes or pair.mapped.limit_bytes
        if limit is not None:
            ax.axhline(limit / MIB, color="tab:red", label="limit (jetsam report)")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, loc="lower right")
    return True


def _pair_view(pair: ResidencyPair, figure: str | None) -> dict[str, object]:
    """The side-by-side row: both footprints at the largest context both runs measured."""
    context = pair.contexts[-1] if pair.contexts else None
    loaded, mapped = pair.at(context) if context is not None else (None, None)
    return {
        "host": pair.loaded.device.host or "",
        "device": short_udid(pair.loaded.device.udid),
        "profile": pair.loaded.device.profile or pair.loaded.device.product_type or "",
        "entry": pair.loaded.entry or pair.loaded.app_id,
        "scheme": pair.loaded.scheme,
        "context": "" if context is None else context,
        "loaded": _mib(loaded),
        "mapped": _mib(mapped),
        "saved": _mib(loaded - mapped) if loaded is not None and mapped is not None else "",
        "ran": f"{_residency_text(pair.loaded)} / {_residency_text(pair.mapped)}",
        "safe": " / ".join(
            "" if r.max_safe_context is None else str(r.max_safe_context) for r in (pair.loaded, pair.mapped)
        ),
        "figure": figure,
    }


def _template_dir() -> Path:
    here = Path(__file__).resolve().parents[1]  # the kvrig package
    for candidate in (here / "_data" / "templates" / "report", here.parent / "templates" / "report"):
        if (candidate / TEMPLATE).is_file():
            return candidate
    raise ReportError(f"the report template {TEMPLATE} is not installed", file=here)


def _run_view(r: SoakResult, figures: list[dict[str, str]]) -> dict[str, object]:
    """What the template shows of one run, formatted; the template only lays it out."""
    found = failures(r)
    error = prediction_error(r)
    safe = "" if r.max_safe_context is None else f"{r.max_safe_context}{' ✓' if r.max_safe_context_confirmed else ''}"
    return {
        "name": run_name(r),
        "failed": bool(found) or r.outcome is None,
        "host": r.device.host or "",
        "device": short_udid(r.device.udid),
        "profile": r.device.profile or r.device.product_type or "",
        "entry": r.entry or r.app_id,
        "scheme": r.variant,
        "weights": _residency_text(r),
        "outcome": r.outcome or f"error: {r.error}",
        "outcome_raw": str(r.outcome),
        "detail": r.outcome_detail or r.error or "not run",
        "max_context": "" if r.max_context_reached is None else r.max_context_reached,
        "safe": safe,
        "footprint_at_kill": _mib(r.footprint_at_kill_bytes),
        "limit": _mib(r.limit_bytes),
        "predicted": r.predicted.max_context if r.predicted and r.predicted.max_context is not None else "",
        "predicted_error": f"{error:+.1%}" if error is not None else "",
        "failures": "; ".join(m for _, m in found),
        "gates": r.gates,
        "confirmations": r.confirmations,
        "evidence": [_evidence_text(e) for e in r.evidence],
        "stated_limit": _stated_text(r),
        "figures": figures,
    }


def _evidence_text(e: Evidence) -> str:
    where = e.file or e.line
    return f"{e.kind}: {e.detail}" + (f": {where}" if where else "")


def _stated_text(r: SoakResult) -> str:
    """The limit the phone stated in its log, with what keys it in the limits registry."""
    s = r.stated_limit
    if s is None or s.limit_bytes is None:
        return ""
    entitled = {True: "entitled", False: "not entitled", None: "entitlement unknown"}[s.entitled]
    return f"{_mib(s.limit_bytes)} ({s.product_type}, build {s.build_version}, {entitled})"


def _stem(r: SoakResult, variant: str) -> str:
    return slug(f"{r.device.host or ''}-{short_udid(r.device.udid)}-{r.entry or r.app_id}-{variant}")


def _unique(base: str, used: set[str]) -> str:
    """A file-name stem no other figure of this report has."""
    base = base.lstrip("-")
    while base in used:
        base += "-x"
    used.add(base)
    return base


def _check_report_folder(out: Path) -> None:
    """An empty or new folder, a lab's output (its results.json) or an earlier report (report.html) may take the
    report; a folder of other files is refused before anything is written."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    if (out / RESULTS_FILE).is_file() or (out / REPORT_FILE).is_file():
        return
    raise ReportFolderError(
        f"{out}: the folder holds other files; give an empty folder, the lab's output folder or an earlier report's"
    )


def _html_chars(value: object) -> object:
    """Every value the page prints, without the control characters HTML forbids (an app's message can hold an
    escape sequence); markup the template made stays markup."""
    from markupsafe import Markup  # jinja2's, loaded with it

    if isinstance(value, Markup):
        return Markup(xml_chars(str(value)))
    return xml_chars(value) if isinstance(value, str) else value


def write_report(results: ResultsFile, out_dir: str | Path, *, title: str = "kvrig results") -> Path:
    """Writes report.html (from templates/report/report.html.j2) and its PNGs (in report/) into out_dir;
    returns the HTML path."""
    import jinja2

    out = Path(out_dir)
    _check_report_folder(out)
    images = out / IMAGES_DIR
    make_folder(images, "the report folder")
    views = []
    used: set[str] = set()
    for r in results.runs:
        base = _unique(_stem(r, r.variant), used)
        figures = []
        for kind, plot in (("footprint", _plot_footprint), ("tps", _plot_tps), ("thermal", _plot_thermal)):
            name = f"{base}-{kind}.png"
            if plot(r, images / name):
                figures.append({"src": f"{IMAGES_DIR}/{name}", "kind": kind})
        views.append(_run_view(r, figures))
    pairs = []
    for pair in residency_pairs(results):
        name = f"{_unique(_stem(pair.loaded, pair.loaded.scheme), used)}-residency.png"
        pairs.append(_pair_view(pair, f"{IMAGES_DIR}/{name}" if _plot_residency(pair, images / name) else None))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_template_dir()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        finalize=_html_chars,
    )
    html = env.get_template(TEMPLATE).render(
        title=title,
        tool_version=results.tool_version,
        hosts=results.lab.hosts if results.lab else [],
        notes=results.lab.notes if results.lab else [],
        ends=results.lab.outcomes if results.lab else {},
        runs=views,
        pairs=pairs,
    )
    path = out / REPORT_FILE
    atomic_write(path, html)
    return path
