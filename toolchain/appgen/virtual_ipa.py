"""An .ipa of a generated project for the virtual iPhone, built on any OS.

It carries the project's real Info.plist (build variables filled in as Xcode would) and no Swift binary:
the key `KvrigVirtualRuntime` tells the virtual iPhone to run kvrig's host app runtime, which implements the
same soak protocol as the generated Swift app. A phone would refuse this .ipa (it is unsigned, with no
executable); `kvrig build` makes the real one on a Mac.
"""

from __future__ import annotations

import plistlib
import zipfile
from pathlib import Path
from typing import Any

import yaml

from toolchain.exceptions import InputError

VIRTUAL_RUNTIME_KEY = "KvrigVirtualRuntime"
VIRTUAL_RUNTIME_LLM = "llm"


def _project_settings(project: Path) -> tuple[str, str]:
    spec_file = project / "project.yml"
    try:
        spec: Any = yaml.safe_load(spec_file.read_text())
    except FileNotFoundError:
        raise InputError("not a generated project (no project.yml)", file=project) from None
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {exc}", file=spec_file) from None
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not name:
        raise InputError("missing", file=spec_file, field="name", expected="the product name")
    try:
        settings = spec["targets"][name]["settings"]["base"]
        bundle_id = settings["PRODUCT_BUNDLE_IDENTIFIER"]
    except (KeyError, TypeError):
        raise InputError(
            "missing", file=spec_file, field=f"targets.{name}.settings.base.PRODUCT_BUNDLE_IDENTIFIER"
        ) from None
    return name, str(bundle_id)


def build_virtual_ipa(
    project: str | Path, output: str | Path | None = None, runtime: str = VIRTUAL_RUNTIME_LLM
) -> Path:
    """Writes `<Name>-virtual.ipa` (Payload/<Name>.app/Info.plist) for the project; returns its path."""
    project = Path(project)
    name, bundle_id = _project_settings(project)
    info_file = project / "App" / "Info.plist"
    try:
        info = plistlib.loads(info_file.read_bytes())
    except FileNotFoundError:
        raise InputError("missing from the generated project", file=info_file) from None
    except plistlib.InvalidFileException as exc:
        raise InputError(f"not a property list: {exc}", file=info_file) from None
    variables = {"$(EXECUTABLE_NAME)": name, "$(PRODUCT_NAME)": name, "$(PRODUCT_BUNDLE_IDENTIFIER)": bundle_id}
    info = {k: variables.get(v, v) if isinstance(v, str) else v for k, v in info.items()}
    info[VIRTUAL_RUNTIME_KEY] = runtime
    out = Path(output) if output else project / "build" / f"{name}-virtual.ipa"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as ipa:
        ipa.writestr(f"Payload/{name}.app/Info.plist", plistlib.dumps(info, fmt=plistlib.FMT_BINARY))
        ipa.writestr(
            f"Payload/{name}.app/{name}",
            "kvrig virtual build: the virtual iPhone runs kvrig's host app runtime for this app.\n",
        )
    tmp.replace(out)
    return out
