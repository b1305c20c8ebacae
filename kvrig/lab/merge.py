"""Merging the output folders of a lab's shards (or of labs run on several hosts) into one folder.

Each run is keyed by phone × entry × scheme (and the weights' residency it asked for). The same run found
twice (the same folder given twice, a re-uploaded artifact) is kept once and reported as a duplicate; the same
key with different results is a conflict: both are kept and reported. The gates each folder recorded are
evaluated again on the merged runs, and the shards named by the folders (`K/N`) must all be there. The files of
each folder's runs are copied under OUT/shards/<n>-<folder>/ so every path in the merged results.json resolves.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvrig.exceptions import LabOutputExistsError, LabShardError
from kvrig.fileio import make_folder
from kvrig.lab.model import RUNS_DIR, fails
from kvrig.lab.report import write_report
from kvrig.lab.save import save_results
from kvrig.schemas import load_model_file
from kvrig.schemas.lab import Gates, LabRecord, slug
from kvrig.schemas.results import BAD_OUTCOMES, RESULTS_FILE, Confirmation, ResultsFile, SoakFiles, SoakResult, udid_key
from kvrig.version import __version__

SHARDS_DIR = "shards"


@dataclass
class Merged:
    results: ResultsFile
    duplicates: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    missing_shards: list[str] = field(default_factory=list)

    def failed_by_host(self) -> dict[str, list[str]]:
        """host -> the failed runs on it (phone, entry[scheme]: why), so a phone lost on one host is named."""
        found: dict[str, list[str]] = {}
        for r in self.results.runs:
            if fails(r):
                bad = r.outcome if r.outcome in BAD_OUTCOMES else None
                if r.outcome is None and r.error is None:
                    why = "not run"
                else:
                    why = bad or (f"error: {r.error}" if r.error else "gate failed")
                found.setdefault(r.device.host or "?", []).append(f"{r.device.udid} {r.entry}[{r.variant}]: {why}")
        return found

    def merge_problems(self) -> list[str]:
        lines = [f"duplicate: {d}" for d in self.duplicates]
        lines += [f"conflict: {c}" for c in self.conflicts]
        return lines + [f"missing shard: {s}" for s in self.missing_shards]

    def problems(self) -> list[str]:
        """What the merge found, then every failed run by host (gates as evaluated on the merged set)."""
        lines = self.merge_problems()
        for host, runs in self.failed_by_host().items():
            lines += [f"failed on host {host}: {run}" for run in runs]
        return lines


def _key(r: SoakResult) -> tuple[str, str, str]:
    return (udid_key(r.device.udid), r.entry or r.app_id, r.variant)


def _same(a: SoakResult, b: SoakResult) -> bool:
    ignore = {"gates": True, "files": True}
    return a.model_dump(exclude=ignore) == b.model_dump(exclude=ignore)


def _moved(r: SoakResult, prefix: str) -> SoakResult:
    f = r.files
    files = SoakFiles(
        telemetry=f"{prefix}/{f.telemetry}" if f.telemetry else None,
        jetsam_reports=[f"{prefix}/{p}" for p in f.jetsam_reports],
        crash_reports=[f"{prefix}/{p}" for p in f.crash_reports],
        skipped_reports=f.skipped_reports,
    )
    confirmations = [
        Confirmation(**{**c.model_dump(), "folder": f"{prefix}/{c.folder}" if c.folder else None})
        for c in r.confirmations
    ]
    return r.model_copy(update={"files": files, "confirmations": confirmations}, deep=True)


def _describe(r: SoakResult, folder: Path) -> str:
    where = f" on {r.device.host}" if r.device.host else ""
    what = r.outcome or f"no outcome ({r.error})"
    return f"{folder}{where}: {what}, max safe context {r.max_safe_context}"


def _load(folder: Path) -> ResultsFile:
    path = folder / RESULTS_FILE
    if not path.is_file():
        raise LabShardError("not a lab output folder: no results.json", file=folder)
    results = load_model_file(ResultsFile, path)
    if results.lab is None:
        raise LabShardError("results.json has no `lab` record (not written by `kvrig lab run`)", file=path)
    return results


def merge_folders(folders: list[Path], out: Path) -> Merged:
    """Merges the folders into `out` (results.json, junit.xml, report.html, shards/); returns what was merged
    and what was found wrong."""
    loaded = [(folder, _load(folder)) for folder in folders]
    _check_merge_folder(out, folders)
    merged = Merged(ResultsFile(tool_version=__version__, runs=[]))
    make_folder(out)

    records = [(folder, r.lab) for folder, r in loaded if r.lab is not None]
    names = {rec.name for _, rec in records}
    if len(names) > 1:
        merged.conflicts.append(f"the folders come from different labs: {sorted(names)}")
    gates: dict[str, Gates] = {}
    for folder, rec in records:
        for entry, g in rec.gates.items():
            if entry in gates and gates[entry] != g:
                merged.conflicts.append(f"entry {entry}: {folder} has other gates ({g}) than an earlier folder")
            gates.setdefault(entry, g)
    merged.missing_shards = _missing_shards([rec.shard for _, rec in records])

    kept: dict[tuple[str, str, str], tuple[Path, SoakResult]] = {}
    for n, (folder, results) in enumerate(loaded, start=1):
        prefix = f"{SHARDS_DIR}/{n}-{slug(folder.resolve().name)}"
        if (folder / RUNS_DIR).is_dir():
            shutil.copytree(folder / RUNS_DIR, out / prefix / RUNS_DIR, dirs_exist_ok=True)
        for run in results.runs:
            key = _key(run)
            if key in kept:
                first_folder, first = kept[key]
                label = f"{run.device.udid} {key[1]}[{key[2]}]"
                if _same(first, run):
                    merged.duplicates.append(f"{label} is in {first_folder} and {folder} (the same run, kept once)")
                    continue
                merged.conflicts.append(
                    f"{label}: {_describe(first, first_folder)}; {_describe(run, folder)} (both kept)"
                )
            else:
                kept[key] = (folder, run)
            merged.results.runs.append(_moved(run, prefix))

    merged.results.runs.sort(key=lambda r: (r.device.host or "", r.device.udid))  # stable: matrix order kept
    hosts = sorted({h for _, rec in records for h in rec.hosts})
    notes = [note for _, rec in records for note in rec.notes]
    notes += merged.merge_problems()
    name = next(iter(sorted(names)), "lab")
    merged.results.lab = LabRecord(name=name, hosts=hosts, gates=gates, notes=notes)
    problems = [("conflict", c) for c in merged.conflicts] + [("missing-shard", m) for m in merged.missing_shards]
    save_results(merged.results, out, problems=problems)  # evaluates the gates again on the merged runs

    write_report(merged.results, out, title=f"kvrig lab: {name} (merged)")
    return merged


def _check_merge_folder(out: Path, folders: list[Path]) -> None:
    """`out` may take the merge when it is new, empty or an earlier merge's output: never one of the folders
    merged (its shard record would be lost) and never a folder of other files."""
    target = out.resolve()
    for folder in folders:
        if target == folder.resolve() or folder.resolve() in target.parents:
            raise LabOutputExistsError(f"{out}: is (or is inside) {folder}, a folder being merged; give another -o")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not (out / SHARDS_DIR).is_dir() or not (out / RESULTS_FILE).is_file():
        raise LabOutputExistsError(
            f"{out}: holds other files, not an earlier merge; give an empty folder, a new one or an earlier merge's"
        )


def _missing_shards(shards: list[str | None]) -> list[str]:
    """Shards K/N that none of the folders holds (for every N the folders name)."""
    have: dict[int, set[int]] = {}
    for text in shards:
        if text:
            k, n = (int(x) for x in text.split("/"))
            have.setdefault(n, set()).add(k)
    return [f"{k}/{n}" for n, ks in sorted(have.items()) for k in range(1, n + 1) if k not in ks]
