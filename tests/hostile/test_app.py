"""`kvrig app` against folders and names it must not trust (defects 7, 10, 11 of issue 24): `--replace` replaces
only a project kvrig generated (its marker file), a project is written whole or not at all, an app name that is
not UTF-8 is exit 3 with nothing touched, and `$(...)` in a name stays text in Info.plist."""

from __future__ import annotations

import json
import os
import plistlib
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tests.appgen.conftest import write_bundle
from tests.hostile.conftest import ROOT, kvrig
from tests.hostile_suite import hostile

APP = ["--bundle-id", "com.example.hostile"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _project(tmp_path: Path, name: str = "Mine") -> tuple[Path, Path]:
    bundle = write_bundle(tmp_path / "bundle")
    out = tmp_path / "work" / "App"
    ran = kvrig("app", str(bundle), "--name", name, *APP, "-o", str(out))
    assert ran.code == 0, ran.stderr
    return bundle, out


@hostile(7, "kvrig app --replace into a folder holding thesis.tex and .git", "exit 35; every file kept")
def test_replace_never_deletes_a_folder_kvrig_did_not_make(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    thesis = tmp_path / "thesis"
    (thesis / ".git" / "objects").mkdir(parents=True)
    (thesis / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (thesis / "thesis.tex").write_text("\\documentclass{book}\n")
    before = _snapshot(thesis)
    ran = kvrig("app", str(bundle), "--name", "X", *APP, "-o", str(thesis), "--replace")
    assert ran.code == 35, ran.stderr
    assert "not a project kvrig generated (no .kvrig-app.json)" in ran.stderr
    assert _snapshot(thesis) == before and (thesis / ".git" / "objects").is_dir()
    assert _leftovers(tmp_path) == []


@hostile(7, "kvrig app --replace over its own project", "replaced whole in one rename; the old files gone")
def test_replace_replaces_a_generated_project_whole(tmp_path: Path) -> None:
    bundle, out = _project(tmp_path)
    # a file an older render wrote (and listed in its marker) that the new project does not have
    (out / "App" / "Sources" / "Stale.swift").write_text("// a file the new project does not have")
    marker = json.loads((out / ".kvrig-app.json").read_text())
    marker["files"].append("App/Sources/Stale.swift")
    (out / ".kvrig-app.json").write_text(json.dumps(marker))
    ran = kvrig("app", str(bundle), "--name", "Renamed", *APP, "-o", str(out), "--replace")
    assert ran.code == 0, ran.stderr
    assert not (out / "App" / "Sources" / "Stale.swift").exists()
    info = plistlib.loads((out / "App" / "Info.plist").read_bytes())
    assert info["CFBundleDisplayName"] == "Renamed"
    assert _leftovers(out.parent) == []


@hostile(7, "kvrig app --replace over its own project holding the user's code and the bundle", "exit 35; all kept")
def test_replace_keeps_a_generated_project_the_user_added_to(tmp_path: Path) -> None:
    bundle, out = _project(tmp_path)
    shutil.copytree(bundle, out / "mybundle")
    (out / "App" / "Sources" / "MyCode.swift").write_text("// the user's own code")
    before = _snapshot(out)
    ran = kvrig("app", str(out / "mybundle"), "--name", "X", *APP, "-o", str(out), "--replace")
    assert ran.code == 35, ran.stderr
    assert "holds files kvrig app did not write" in ran.stderr and "App/Sources/MyCode.swift" in ran.stderr
    assert _snapshot(out) == before and _leftovers(out.parent) == []


@hostile(10, "an app name that is not UTF-8, --replace over a project", "exit 3 naming --name; the project untouched")
def test_a_name_that_is_not_utf8_touches_nothing(tmp_path: Path) -> None:
    bundle, out = _project(tmp_path)
    before = _snapshot(out)
    assert len(before) > 30
    argv = [sys.executable, "-m", "kvrig", "app", str(bundle), "--name", "Caf\udce9 \udcff", *APP]
    done = subprocess.run(
        [os.fsencode(a) for a in [*argv, "-o", str(out), "--replace"]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert "field '--name'" in done.stderr and "UTF-8" in done.stderr and "Traceback" not in done.stderr
    assert _snapshot(out) == before
    assert _leftovers(out.parent) == []


@hostile(7, "the disk fills while kvrig app --replace renders", "exit 15; the old project whole, nothing left over")
def test_a_render_that_fails_leaves_the_old_project_whole(tmp_path: Path) -> None:
    bundle, out = _project(tmp_path)
    before = _snapshot(out)

    def small_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # larger template files cannot be written

    done = subprocess.run(
        [sys.executable, "-m", "kvrig", "app", str(bundle), "--name", "New", *APP, "-o", str(out), "--replace"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=small_disk,
    )
    assert done.returncode == 15, done.stderr
    assert "cannot write the project" in done.stderr and "Traceback" not in done.stderr
    assert _snapshot(out) == before
    assert _leftovers(out.parent) == []


@hostile(11, "an app folder a SIGKILLed kvrig app left (.App.partial-*)", "removed by the next kvrig app beside it")
def test_the_next_render_removes_what_a_killed_one_left(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    work = tmp_path / "work"
    work.mkdir()
    # What SIGKILL leaves: the folder and its lock file, the lock no longer held by anyone.
    (work / ".App.partial-0badf00d" / "App").mkdir(parents=True)
    (work / ".App.partial-0badf00d.lock").touch()
    ran = kvrig("app", str(bundle), "--name", "X", *APP, "-o", str(work / "App"))
    assert ran.code == 0, ran.stderr
    assert _leftovers(work) == []


@hostile(11, "$(HOME) and ${USER} in the app name", "Info.plist holds the name as text; Xcode told not to expand")
def test_build_settings_in_a_name_stay_text(tmp_path: Path) -> None:
    name = "Chat $(HOME) ${USER} $(PRODUCT_NAME:rfc1034identifier)"
    _, out = _project(tmp_path, name)
    info = plistlib.loads((out / "App" / "Info.plist").read_bytes())
    assert info["CFBundleDisplayName"] == name
    others = [v for k, v in info.items() if isinstance(v, str) and k != "CFBundleDisplayName"]
    assert not [v for v in others if "$(" in v or "${" in v]  # nothing left for Xcode to expand
    spec = yaml.safe_load((out / "project.yml").read_text())
    (target,) = spec["targets"].values()
    assert target["settings"]["base"]["INFOPLIST_EXPAND_BUILD_SETTINGS"] == "NO"
    ran = kvrig("build", str(out), "--virtual", "-o", str(tmp_path / "ipa"))
    assert ran.code == 0, ran.stderr
    (ipa,) = (tmp_path / "ipa").glob("*.ipa")
    with zipfile.ZipFile(ipa) as archive:
        (plist,) = [n for n in archive.namelist() if n.endswith(".app/Info.plist")]
        assert plistlib.loads(archive.read(plist))["CFBundleDisplayName"] == name
