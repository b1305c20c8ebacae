"""An .ipa of a generated project for the virtual iPhone, built on any OS.

It carries the project's real Info.plist (build variables filled in as Xcode would) and no binary: the key
`KvrigVirtualRuntime` tells the virtual iPhone what to run: `swift`, the app's engine compiled for this host
(`kvrig engine`, kvrig.appgen.linux), or `llm`, kvrig's Python runtime implementing the same protocol.
A phone would refuse this .ipa (it is unsigned, with no executable); `kvrig build` makes the real one on a Mac.
"""

from __future__ import annotations

import contextlib
import plistlib
import zipfile
from pathlib import Path

from kvrig.appgen.build import read_project
from kvrig.exceptions import AppGenError, InputError
from kvrig.fileio import plist_dict
from kvrig.schemas.keys import ENTITLEMENTS_FILE, VIRTUAL_RUNTIME_KEY

VIRTUAL_RUNTIME_LLM = "llm"
VIRTUAL_RUNTIME_SWIFT = "swift"
APP_RUNTIMES = {"swift": VIRTUAL_RUNTIME_SWIFT, "python": VIRTUAL_RUNTIME_LLM}
APP_RUNTIME_ENV = "KVRIG_APP_RUNTIME"
"""--app-runtime choices -> Info.plist values (the virtual iPhone's kvrig.virtual.apprun reads them)."""


def default_app_runtime() -> str:
    """$KVRIG_APP_RUNTIME (`swift` or `python`), else `python`: the Swift engine's debug build loads for minutes
    on this 2-core machine and its soaks on the virtual iPhone do not pass here yet, so it is opt-in."""
    import os

    choice = os.environ.get(APP_RUNTIME_ENV, "python")
    if choice not in APP_RUNTIMES:
        raise InputError(f"unknown app runtime {choice!r}", field=APP_RUNTIME_ENV, expected="swift or python")
    return choice


def _project_settings(project: Path) -> tuple[str, str, Path | None]:
    """The target's name, bundle id and entitlements file (None: the project declares none)."""
    spec_file = project / "project.yml"
    spec, name = read_project(project)
    try:
        settings = spec["targets"][name]["settings"]["base"]
        bundle_id = settings["PRODUCT_BUNDLE_IDENTIFIER"]
    except (KeyError, TypeError):
        raise InputError(
            "missing", file=spec_file, field=f"targets.{name}.settings.base.PRODUCT_BUNDLE_IDENTIFIER"
        ) from None
    entitlements = settings.get("CODE_SIGN_ENTITLEMENTS")
    return name, str(bundle_id), project / entitlements if entitlements else None


def build_virtual_ipa(project: str | Path, output: str | Path | None = None, runtime: str | None = None) -> Path:
    """Writes `<Name>-virtual.ipa` (Payload/<Name>.app/Info.plist) for the project into the folder `output`
    (default: the project's build/, as `build_app`'s .ipa); returns its path. `runtime`: an Info.plist value
    (`swift`, `llm`); default: see `default_app_runtime`."""
    project = Path(project)
    runtime = runtime or APP_RUNTIMES[default_app_runtime()]
    name, bundle_id, entitlements = _project_settings(project)
    info_file = project / "App" / "Info.plist"
    try:
        data = info_file.read_bytes()
    except FileNotFoundError:
        raise InputError("missing from the generated project", file=info_file) from None
    except IsADirectoryError:
        raise InputError("a folder, not a file", file=info_file, expected="the project's Info.plist") from None
    info = plist_dict(data, file=info_file, expected="the project's Info.plist, a dictionary")
    variables = {"$(EXECUTABLE_NAME)": name, "$(PRODUCT_NAME)": name, "$(PRODUCT_BUNDLE_IDENTIFIER)": bundle_id}
    info = {k: variables.get(v, v) if isinstance(v, str) else v for k, v in info.items()}
    info[VIRTUAL_RUNTIME_KEY] = runtime
    out = (Path(output) if output else project / "build") / f"{name}-virtual.ipa"
    tmp = out.with_name(out.name + ".part")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as ipa:
            ipa.writestr(f"Payload/{name}.app/Info.plist", plistlib.dumps(info, fmt=plistlib.FMT_BINARY))
            ipa.writestr(
                f"Payload/{name}.app/{name}",
                f"kvrig virtual build: the virtual iPhone runs this app with the {runtime!r} runtime.\n",
            )
            if entitlements is not None and entitlements.is_file():
                # a phone states the increased memory limit only for an app that declares it
                ipa.write(entitlements, f"Payload/{name}.app/{ENTITLEMENTS_FILE}")
        tmp.replace(out)
    except OSError as exc:  # a folder where the .ipa goes, a file where its folder goes, a full disk
        with contextlib.suppress(OSError):  # where the folder could not be made, there is nothing to remove
            tmp.unlink(missing_ok=True)
        raise AppGenError(f"{out}: cannot write the .ipa ({exc.strerror or exc}); nothing was written") from None
    return out
