"""`kvrig build --virtual`: an .ipa of the generated project that the virtual iPhone installs and runs."""

from __future__ import annotations

import json
import os
import plistlib
import subprocess
import sys
import zipfile
from pathlib import Path

from kvrig.appgen.build import read_project
from kvrig.appgen.entitlements import app_entitlements
from kvrig.appgen.virtual_ipa import VIRTUAL_RUNTIME_KEY, build_virtual_ipa
from kvrig.device import apps
from kvrig.virtual import swiftapp
from kvrig.virtual.apprun import APP_RUNTIMES
from tests.device.conftest import Emulator, emulator, on_device, run  # noqa: F401 (fixture)


def _info(ipa: Path) -> dict:
    with zipfile.ZipFile(ipa) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".app/Info.plist")]
        return plistlib.loads(archive.read(name))


def test_ipa_carries_the_projects_info_plist(reference_project: Path, tmp_path: Path) -> None:
    ipa = build_virtual_ipa(reference_project, tmp_path)
    assert ipa == tmp_path / f"{read_project(reference_project)[1]}-virtual.ipa"  # into the folder, by its product
    info = _info(ipa)
    source = plistlib.loads((reference_project / "App" / "Info.plist").read_bytes())
    assert info["UIFileSharingEnabled"] is True and source["UIFileSharingEnabled"] is True
    assert info["CFBundleIdentifier"] == "com.example.smollm2"  # the build variable, filled in
    assert info["CFBundleExecutable"] == info["CFBundleName"] == "SmolLM2Chat"
    assert info[VIRTUAL_RUNTIME_KEY] in {*APP_RUNTIMES, swiftapp.RUNTIME}


def test_an_ipa_under_a_file_is_the_generators_error(reference_project: Path, tmp_path: Path) -> None:
    """Its folder cannot be made: the clean-up of the part file raised again inside the handler (exit 70)."""
    import pytest

    from kvrig.exceptions import AppGenError

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(AppGenError, match=r"cannot write the \.ipa"):
        build_virtual_ipa(reference_project, tmp_path / "afile" / "sub")
    assert (tmp_path / "afile").read_text() == "mine"


def test_virtual_iphone_installs_it_through_pymobiledevice3(
    reference_project: Path,
    tmp_path: Path,
    emulator: Emulator,  # noqa: F811
) -> None:
    ipa = build_virtual_ipa(reference_project, tmp_path, "llm")

    async def job(device):  # type: ignore[no-untyped-def]
        await apps.install(device, ipa)
        return await apps.get_app(device, "com.example.smollm2")

    app = run(on_device(emulator.udid, job))
    assert app.executable == "SmolLM2Chat"
    installed = emulator.device.state.user_apps()["com.example.smollm2"]
    assert installed[VIRTUAL_RUNTIME_KEY] == "llm"
    # the project's entitlements, as a signed app carries them: the phone then states the increased limit, and
    # kvrig's own reader of the .ipa (the lab predicts with the limit it gives) reads the same
    assert installed["Entitlements"]["com.apple.developer.kernel.increased-memory-limit"] is True
    assert app.entitled is True and app_entitlements(ipa) == installed["Entitlements"]


def test_cli_build_virtual_works_on_linux(reference_project: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "build", str(reference_project), "--virtual", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    product = read_project(reference_project)[1]
    assert [p.name for p in tmp_path.iterdir()] == [f"{product}-virtual.ipa"]  # named by its product


def test_not_a_project_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "build", str(tmp_path), "--virtual"], capture_output=True, text=True
    )
    assert proc.returncode == 3 and "project.yml" in proc.stderr and "Traceback" not in proc.stderr


def test_app_runtime_option_names_what_the_virtual_iphone_runs(reference_project: Path, tmp_path: Path) -> None:
    for choice, value in (("swift", "swift"), ("python", "llm")):
        out = tmp_path / choice
        cmd = [sys.executable, "-m", "kvrig", "build", str(reference_project), "--virtual", "-o", str(out)]
        proc = subprocess.run(
            [*cmd, "--app-runtime", choice],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert _info(out / f"{reference_project.name}-virtual.ipa")[VIRTUAL_RUNTIME_KEY] == value


def test_auto_app_runtime_falls_back_to_python_saying_why(reference_project: Path, tmp_path: Path) -> None:
    """`--app-runtime auto` chooses as `kvrig demo` does: here no Swift toolchain, so Python, and it says why."""
    env = {**os.environ, "PATH": "/nonexistent"}
    env.pop("KVRIG_SWIFT_DEPS", None)
    cmd = [sys.executable, "-m", "kvrig", "build", str(reference_project), "--virtual", "-o", str(tmp_path)]
    proc = subprocess.run([*cmd, "--app-runtime", "auto", "--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["app_runtime"] == "python"
    assert "cannot be built here (MLX Swift packages not resolvable: no `swift` on PATH" in proc.stderr
    assert _info(tmp_path / f"{reference_project.name}-virtual.ipa")[VIRTUAL_RUNTIME_KEY] == "llm"


def test_a_signed_apps_entitlements_are_read_from_its_code_signature(tmp_path: Path) -> None:
    """A phone lists what the signature's entitlements blob says, whatever an .xcent beside it says."""
    app = tmp_path / "Signed.app"
    app.mkdir()
    (app / "Info.plist").write_bytes(plistlib.dumps({"CFBundleExecutable": "Signed"}, fmt=plistlib.FMT_BINARY))
    signed = plistlib.dumps({"com.apple.developer.kernel.increased-memory-limit": True})
    blob = bytes.fromhex("fade7171") + (8 + len(signed)).to_bytes(4, "big") + signed
    (app / "Signed").write_bytes(b"\xcf\xfa\xed\xfe" + bytes(64) + blob + bytes(16))
    (app / "archived-expanded-entitlements.xcent").write_bytes(plistlib.dumps({"get-task-allow": True}))
    assert app_entitlements(app) == {"com.apple.developer.kernel.increased-memory-limit": True}
    (app / "Signed").write_bytes(b"\xcf\xfa\xed\xfe" + bytes(64))  # unsigned: the .xcent, as Xcode left it
    assert app_entitlements(app) == {"get-task-allow": True}
    assert app_entitlements(tmp_path / "missing.ipa") is None


def test_an_edited_project_or_a_blocked_output_is_named_and_leaves_nothing(
    reference_project: Path, tmp_path: Path
) -> None:
    import shutil

    project = tmp_path / "p"
    shutil.copytree(reference_project, project)
    info = project / "App" / "Info.plist"
    for text, words in (("<plist><dict><key>x", "not a property list"), (plistlib.dumps([1]).decode(), "a list")):
        info.write_text(text)
        proc = subprocess.run(
            [sys.executable, "-m", "kvrig", "build", str(project), "--virtual"], capture_output=True, text=True
        )
        assert proc.returncode == 3 and str(info) in proc.stderr and words in proc.stderr, proc.stderr
    shutil.copy(reference_project / "App" / "Info.plist", info)
    # a folder where the .ipa goes: exit 15 naming it, and no .part left behind
    ipa = build_virtual_ipa(project)
    ipa.unlink()
    ipa.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "kvrig", "build", str(project), "--virtual"], capture_output=True, text=True
    )
    assert proc.returncode == 15 and "cannot write the .ipa" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in ipa.parent.iterdir()] == [ipa.name]
