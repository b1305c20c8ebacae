"""The reliability suite (issue 24): `pytest -m hostile` runs every hostile case and prints one table, each case
with its bound and its verdict.

A case is a test marked `@hostile(defect, case, bound)`: the defect it belongs to (the issue's numbering), what
hostile input or interruption it is, and the bound it must keep (its exit code, time, memory, what survives).
The marks travel as user properties, so the table is the same under pytest-xdist's workers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

MARK = "hostile"


def hostile(defect: int, case: str, bound: str) -> pytest.MarkDecorator:
    """Marks a test as a case of the reliability suite."""
    return pytest.mark.hostile(defect=defect, case=case, bound=bound)


@dataclass
class Row:
    defect: int
    case: str
    bound: str
    verdict: str
    seconds: float


class Table:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def add_properties(self, item: pytest.Item) -> None:
        mark = item.get_closest_marker(MARK)
        if mark is not None and mark.kwargs:
            case = dict(mark.kwargs)
            callspec = getattr(item, "callspec", None)
            if callspec is not None:  # a parametrized case: which of its inputs
                case["case"] += f": {callspec.id}"
            item.user_properties.append(("hostile", case))

    def record(self, report: pytest.TestReport) -> None:
        case = next((value for key, value in report.user_properties if key == "hostile"), None)
        if case is None:
            return
        row = self.rows.get(report.nodeid)
        if row is None:
            row = self.rows[report.nodeid] = Row(case["defect"], case["case"], case["bound"], "", 0.0)
        row.seconds += report.duration
        if report.failed:
            row.verdict = "FAILED" if report.when == "call" else f"ERROR ({report.when})"
        elif report.skipped and not row.verdict:
            row.verdict = "skipped"
        elif report.when == "call" and report.passed and not row.verdict:
            row.verdict = "held"

    def lines(self) -> list[str]:
        rows = sorted(self.rows.values(), key=lambda r: (r.defect, r.case))
        head = ("#", "case", "bound", "verdict", "s")
        cells = [(str(r.defect), r.case, r.bound, r.verdict or "?", f"{r.seconds:.1f}") for r in rows]
        widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
        out = [" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
        out.append("-+-".join("-" * w for w in widths))
        out += [" | ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
        held = sum(r.verdict == "held" for r in rows)
        out.append(f"{held} of {len(rows)} cases held")
        return out
