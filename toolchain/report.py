"""The HTML report of a results file: a summary table and, per run, footprint vs context and decode tok/s vs
context (PNG, matplotlib), with the limit from the jetsam report and the planner's prediction as lines.

Everything it shows comes from results.json, so `kvrig lab report` can render it again anywhere.
"""

from __future__ import annotations

import html
from pathlib import Path

from toolchain.exceptions import ReportError
from toolchain.gates import failures, prediction_error
from toolchain.schemas.lab import slug
from toolchain.schemas.results import ResultsFile, SoakResult

REPORT_FILE = "report.html"
IMAGES_DIR = "report"
MIB = 1024 * 1024

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 2em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f0f0f0; } td.l { text-align: left; }
.ok { color: #1a7f37; } .bad { color: #cf222e; font-weight: bold; } .na { color: #888; }
figure { display: inline-block; margin: 0 1em 1em 0; } img { max-width: 560px; }
"""


def _mib(n: int | None) -> str:
    return f"{n / MIB:.1f} MiB" if n is not None else ""


def _cell(value: object, cls: str = "") -> str:
    text = "" if value is None else str(value)
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{html.escape(text)}</td>"


def run_name(r: SoakResult) -> str:
    return f"{r.device.udid[:12]} {r.entry or r.app_id} [{r.scheme}]"


def _plot_footprint(r: SoakResult, path: Path) -> bool:
    points = [(p.context_tokens, p.phys_footprint_bytes) for p in r.tps_curve if p.phys_footprint_bytes is not None]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax.plot([c for c, _ in points], [b / MIB for _, b in points], "o-", label="phys_footprint (app telemetry)")
    if r.limit_bytes is not None:
        ax.axhline(r.limit_bytes / MIB, color="tab:red", label="limit (jetsam report)")
    elif r.app_limit_bytes is not None:
        ax.axhline(r.app_limit_bytes / MIB, color="tab:red", linestyle="--", label="limit (app)")
    if r.footprint_at_kill_bytes is not None and points:
        # Killed while growing to the next step: plotted one step past the last context that survived.
        contexts = [c for c, _ in points]
        kill_at = contexts[-1] + (contexts[-1] - contexts[-2] if len(contexts) > 1 else 0)
        ax.plot([kill_at], [r.footprint_at_kill_bytes / MIB], "x", color="tab:red", ms=10, label="footprint at kill")
    p = r.predicted
    if p is not None and p.limit_bytes is not None:
        ax.axhline(p.limit_bytes / MIB, color="tab:purple", linestyle=":", label="predicted limit (plan)")
    if p is not None and p.max_context:
        ax.axvline(p.max_context, color="tab:purple", linestyle="-.", label=f"predicted max context {p.max_context}")
    if r.max_safe_context:
        tag = "confirmed" if r.max_safe_context_confirmed else "measured"
        ax.axvline(r.max_safe_context, color="tab:green", linestyle="--", label=f"max safe context ({tag})")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("MiB")
    ax.set_title(f"footprint: {run_name(r)}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_tps(r: SoakResult, path: Path) -> bool:
    points = [(p.context_tokens, p.decode_tps) for p in r.tps_curve if p.decode_tps is not None]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    ax.plot([c for c, _ in points], [t for _, t in points], "o-", label="decode tok/s")
    gates = [c for c in r.gates if c.gate.startswith("min_decode_tps_at[")]
    for i, check in enumerate(gates):
        context = int(check.gate[len("min_decode_tps_at[") : -1])
        ax.plot([context], [check.threshold], "v", color="tab:red", ms=9, label="gate minimum" if i == 0 else None)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"decode: {run_name(r)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _row(r: SoakResult) -> str:
    found = failures(r)
    status = ("FAIL", "bad") if found or r.outcome is None else ("pass", "ok")
    safe = "" if r.max_safe_context is None else f"{r.max_safe_context}{' ✓' if r.max_safe_context_confirmed else ''}"
    error = prediction_error(r)
    cells = [
        _cell(status[0], status[1]),
        _cell(r.device.udid[:12], "l"),
        _cell(r.device.profile or r.device.product_type, "l"),
        _cell(r.entry or r.app_id, "l"),
        _cell(r.scheme, "l"),
        _cell(r.outcome or f"error: {r.error}", "l"),
        _cell(r.max_context_reached),
        _cell(safe),
        _cell(_mib(r.footprint_at_kill_bytes)),
        _cell(_mib(r.limit_bytes)),
        _cell(r.predicted.max_context if r.predicted else None),
        _cell(f"{error:+.1%}" if error is not None else None),
        _cell("; ".join(m for _, m in found), "l"),
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def write_report(results: ResultsFile, out_dir: str | Path, *, title: str = "kvrig results") -> Path:
    """Writes report.html and its PNGs (in report/) into out_dir; returns the HTML path."""
    out = Path(out_dir)
    images = out / IMAGES_DIR
    try:
        images.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot create the report folder: {exc}", file=images) from None
    head = [
        "State", "Device", "Profile", "Entry", "Scheme", "Outcome", "Max context", "Max safe context",
        "Footprint at kill", "Limit (report)", "Predicted max", "Predicted error", "Failures",
    ]  # fmt: skip
    parts = [
        "<!doctype html>",
        f'<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>',
        f"<h1>{html.escape(title)}</h1>",
        f"<p>kvrig {html.escape(results.tool_version)}; {len(results.runs)} runs; ✓ = confirmed by a repeat run.</p>",
        "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>",
        *(_row(r) for r in results.runs),
        "</table>",
    ]
    used: set[str] = set()
    for r in results.runs:
        base = slug(f"{r.device.udid[:12]}-{r.entry or r.app_id}-{r.scheme}")
        while base in used:
            base += "-x"
        used.add(base)
        figures = []
        for kind, plot in (("footprint", _plot_footprint), ("tps", _plot_tps)):
            name = f"{base}-{kind}.png"
            if plot(r, images / name):
                figures.append(f'<figure><img src="{IMAGES_DIR}/{html.escape(name)}" alt="{kind}"></figure>')
        parts.append(f"<h2>{html.escape(run_name(r))}</h2>")
        detail = r.outcome_detail or r.error or "not run"
        parts.append(f"<p>{html.escape(str(r.outcome))}: {html.escape(detail)}</p>")
        if r.gates:
            items = "".join(
                f'<li class="{ {"passed": "ok", "failed": "bad"}.get(c.status, "na") }">'
                f"{html.escape(c.gate)}: {html.escape(c.status)}: {html.escape(c.message)}</li>"
                for c in r.gates
            )
            parts.append(f"<ul>{items}</ul>")
        if r.confirmations:
            items = "".join(
                f"<li>{html.escape(c.run_id)}: {html.escape(str(c.outcome))} at {c.max_tokens} tokens</li>"
                for c in r.confirmations
            )
            parts.append(f"<p>Threshold search:</p><ul>{items}</ul>")
        parts.extend(figures or ["<p class='na'>no measurements</p>"])
    parts.append("</body></html>")
    path = out / REPORT_FILE
    path.write_text("\n".join(parts) + "\n")
    return path
