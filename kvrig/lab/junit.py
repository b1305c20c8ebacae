"""JUnit XML for CI from a results file: one testsuite per host × device, one testcase per run (entry ×
scheme), named with its host and phone so the cases of a merged multi-host lab stay apart.

A run fails (one `<failure>`, naming every reason: Jenkins and dorny/test-reporter show a case's first only) on a
bad outcome (crash, hang, device lost), a failed confirmation run or a failed gate; a run that could not be made,
or was never run (the lab stopped, its shard was killed), is an `<error>`, as `kvrig lab` counts it failed. What a
merge finds wrong (a missing shard, a conflict) is a case of its own in a `kvrig lab merge` suite. The numbers go
in `<properties>` so CI dashboards can chart them. Text is stripped of the characters XML 1.0 cannot carry (an
app's error message can hold an escape sequence): one of them makes Jenkins and GitLab drop the whole file.
"""

from __future__ import annotations

import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from kvrig.appgen.escape import xml_chars
from kvrig.fileio import atomic_write
from kvrig.lab.gates import decode_tps_at, failures, prediction_error
from kvrig.schemas.results import ResultsFile, SoakResult


def _properties(parent: ET.Element, values: dict[str, object]) -> None:
    props = ET.SubElement(parent, "properties")
    for name, value in values.items():
        if value is not None:
            ET.SubElement(props, "property", name=name, value=str(value))


def _numbers(r: SoakResult) -> dict[str, object]:
    values: dict[str, object] = {
        "run_id": r.run_id,
        "app_id": r.app_id,
        "bundle": r.bundle,
        "scheme": r.scheme,
        "weights_residency": r.weights_residency,
        "mapped_weight_bytes": r.mapped_weight_bytes,
        "outcome": r.outcome,
        "max_context_reached": r.max_context_reached,
        "max_safe_context": r.max_safe_context,
        "max_safe_context_confirmed": str(r.max_safe_context_confirmed).lower(),
        "confirmation_runs": len(r.confirmations),
        "footprint_at_kill_bytes": r.footprint_at_kill_bytes,
        "limit_bytes": r.limit_bytes,
        "app_limit_bytes": r.app_limit_bytes,
    }
    if r.predicted is not None:
        values["predicted_max_context"] = r.predicted.max_context
        values["predicted_limit_bytes"] = r.predicted.limit_bytes
    error = prediction_error(r)
    if error is not None:
        values["predicted_error"] = f"{error:.4f}"
    for check in r.gates:
        if check.gate.startswith("min_decode_tps_at[") and check.measured is not None:
            values[f"decode_tps_at_{check.gate[len('min_decode_tps_at[') : -1]}"] = f"{check.measured:.2f}"
    if r.tps_curve:
        top = max(p.context_tokens for p in r.tps_curve)
        tps = decode_tps_at(r.tps_curve, top)
        if tps is not None:
            values["decode_tps_at_max_context"] = f"{tps:.2f}"
    for check in r.gates:
        values[f"gate.{check.gate}"] = check.status
    return values


def case_name(r: SoakResult) -> str:
    """`entry[scheme] on UDID @ host`: unique per run across the hosts of a merged lab."""
    host = f" @ {r.device.host}" if r.device.host else ""
    return f"{r.entry or r.app_id}[{r.variant}] on {r.device.udid}{host}"


def _elapsed(r: SoakResult) -> float:
    return max(0.0, (r.finished or r.started or 0) - (r.started or 0))


def build_junit(
    results: ResultsFile, *, name: str = "kvrig lab", problems: list[tuple[str, str]] | None = None
) -> ET.Element:
    """`problems`: (kind, message) pairs about the lab as a whole (a merge's missing shards, conflicts), each an
    erroring case."""
    root = ET.Element("testsuites", name=name)
    devices: dict[str, list[SoakResult]] = {}
    for run in results.runs:
        devices.setdefault(f"{run.device.host or ''}\0{run.device.udid}", []).append(run)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for runs in devices.values():
        first = runs[0].device
        udid, host = first.udid, first.host
        label = " ".join(x for x in (udid, first.product_type, first.profile) if x)
        if host:
            label += f" @ {host}"
        suite = ET.SubElement(root, "testsuite", name=label, hostname=host or socket.gethostname())
        phone = {
            "host": host,
            "udid": udid,
            "product_type": first.product_type,
            "os_version": first.os_version,
            "profile": first.profile,
        }
        _properties(suite, {**phone, "tool_version": results.tool_version})
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        suite_time = 0.0
        seen: dict[str, int] = {}
        for r in runs:
            counts["tests"] += 1
            elapsed = _elapsed(r)
            suite_time += elapsed
            named = case_name(r)
            seen[named] = seen.get(named, 0) + 1
            if seen[named] > 1:  # a merge keeps both runs of a conflict; GitLab keys cases by name
                named += f" (#{seen[named]})"
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"kvrig.lab.{first.profile or first.product_type or 'device'}.{udid}",
                name=named,
                time=f"{elapsed:.3f}",
            )
            _properties(case, {**phone, **_numbers(r)})
            if r.outcome is None and r.error is None:
                counts["errors"] += 1  # `kvrig lab` fails it: a skipped case would read as passed in CI
                why = "not run: the lab ended before this run (stopped, or its shard killed)"
                ET.SubElement(case, "error", message=why, type="not-run").text = why
            elif r.outcome is None:
                counts["errors"] += 1
                err = ET.SubElement(case, "error", message=r.error or "no outcome", type="lab")
                err.text = r.error
            found = failures(r)
            if found:
                counts["failures"] += 1
                kinds = sorted({kind for kind, _ in found})
                fail = ET.SubElement(
                    case,
                    "failure",
                    message="; ".join(message for _, message in found),
                    type=kinds[0] if len(kinds) == 1 else "+".join(kinds),
                )
                fail.text = "\n".join(f"{kind}: {message}" for kind, message in found)
            out = [f"outcome: {r.outcome} ({r.outcome_detail})"] if r.outcome else []
            if r.error and r.outcome is not None:
                out.append(f"error: {r.error}")
            out += [f"{c.gate}: {c.status}: {c.message}" for c in r.gates]
            out += [f"confirmation {c.run_id}: {c.outcome} at {c.max_tokens} tokens" for c in r.confirmations]
            if r.files.telemetry:
                out.append(f"telemetry: {r.files.telemetry}")
            out += [f"jetsam report: {p}" for p in r.files.jetsam_reports]
            out += [f"crash report: {p}" for p in r.files.crash_reports]
            if out:
                ET.SubElement(case, "system-out").text = "\n".join(out)
        suite.set("tests", str(counts["tests"]))
        suite.set("failures", str(counts["failures"]))
        suite.set("errors", str(counts["errors"]))
        suite.set("skipped", str(counts["skipped"]))
        suite.set("time", f"{suite_time:.3f}")
        started = min((r.started for r in runs if r.started), default=None)
        if started is not None:  # UTC without an offset: Jenkins reads it as UTC, junit-10.xsd takes no offset
            suite.set("timestamp", time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)))
        for key in totals:
            totals[key] += counts[key]
        total_time += suite_time
    if problems:
        suite = ET.SubElement(root, "testsuite", name="kvrig lab merge", hostname=socket.gethostname())
        for i, (kind, message) in enumerate(problems, start=1):
            case = ET.SubElement(suite, "testcase", classname="kvrig.lab.merge", name=f"{kind} {i}", time="0.000")
            ET.SubElement(case, "error", message=message, type=kind).text = message
        for key, value in (("tests", len(problems)), ("failures", 0), ("errors", len(problems)), ("skipped", 0)):
            suite.set(key, str(value))
        suite.set("time", "0.000")
        totals["tests"] += len(problems)
        totals["errors"] += len(problems)
    # junit-10.xsd gives <testsuites> no `skipped` (the xUnit plugin refuses a file that has one)
    for key in ("tests", "failures", "errors"):
        root.set(key, str(totals[key]))
    root.set("time", f"{total_time:.3f}")
    for element in root.iter():
        if element.text:
            element.text = xml_chars(element.text)
        for attribute, text in element.attrib.items():
            element.set(attribute, xml_chars(text))
    return root


def write_junit(
    results: ResultsFile, path: str | Path, *, name: str = "kvrig lab", problems: list[tuple[str, str]] | None = None
) -> Path:
    path = Path(path)
    root = build_junit(results, name=name, problems=problems)
    ET.indent(root)
    atomic_write(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))
    return path
