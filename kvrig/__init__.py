"""kvrig: plan, package, deploy and soak-test quantized LLMs on iPhone, for the longest context iOS will not kill.

The library behind the `kvrig` command, one function per job (each command parses its options, calls one of
these and renders the result)::

    import kvrig

    plan = kvrig.planner(None, "iPhone16,1", schemes=("k8v4",))        # None: the embedded SmolLM2-135M
    print(plan.max_context["k8v4"])
    bundle = kvrig.package(None, "out/smollm2", kvrig.PackageOptions(device="iPhone16,1"))
    kvrig.verify_bundle("out/smollm2")

Names load on first use, so `import kvrig` (and `kvrig --help`) loads neither MLX nor pymobiledevice3.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvrig.version import __version__

# name -> the module that defines it (the one place each lives).
_API: dict[str, str] = {
    # choices: the one grammar for weight recipes and KV specs
    "WeightRecipe": "kvrig.recipes",
    "KVSpec": "kvrig.recipes",
    "parse_weights": "kvrig.recipes",
    "parse_kv": "kvrig.recipes",
    # devices and planning
    "load_profile": "kvrig.profiles",
    "list_profiles": "kvrig.profiles",
    "plan": "kvrig.planner",
    "plan_memory": "kvrig.planner.memory",
    "PlanRequest": "kvrig.planner.memory",
    "MemoryPlan": "kvrig.planner.memory",
    "load_model_spec": "kvrig.models",
    # bundles
    "PackageOptions": "kvrig.bundle.options",
    "package": "kvrig.packaging",
    "PackageResult": "kvrig.packaging",
    "check_bundle": "kvrig.bundle.manifest",
    "verify_bundle": "kvrig.bundle.manifest",
    "load_manifest": "kvrig.bundle.manifest",
    "run_bundle": "kvrig.runtime.generate",
    "load_bundle": "kvrig.runtime.generate",
    "run_quality_bench": "kvrig.quality.bench",
    # the app
    "AppOptions": "kvrig.appgen.render",
    "render_app": "kvrig.appgen.render",
    "build_engine": "kvrig.appgen.linux",
    "export_coreml": "kvrig.coreml.export",
    # phones, soaks, the lab
    "list_devices": "kvrig.device.discovery",
    "open_session": "kvrig.device.session",
    "deploy": "kvrig.device.deploy",
    "SoakOptions": "kvrig.soaking.driver",
    "soak": "kvrig.soaking.driver",
    "make_plan": "kvrig.soaking.plan",
    "run_lab": "kvrig.lab.schedule",
    "calibrate": "kvrig.calibration",
    "DemoOptions": "kvrig.demo",
    "run_demo": "kvrig.demo",
    "run_demos": "kvrig.demo",
    # reading what phones report
    "read_report": "kvrig.reports.jetsam",
    "verdict": "kvrig.reports.jetsam",
    "read_telemetry": "kvrig.reports.telemetry",
    # errors: every one is a KvrigError with its exit code
    "KvrigError": "kvrig.exceptions",
}

__all__ = [
    "AppOptions",
    "DemoOptions",
    "KVSpec",
    "KvrigError",
    "MemoryPlan",
    "PackageOptions",
    "PackageResult",
    "PlanRequest",
    "SoakOptions",
    "WeightRecipe",
    "__version__",
    "build_engine",
    "calibrate",
    "check_bundle",
    "deploy",
    "export_coreml",
    "list_devices",
    "list_profiles",
    "load_bundle",
    "load_manifest",
    "load_model_spec",
    "load_profile",
    "make_plan",
    "open_session",
    "package",
    "parse_kv",
    "parse_weights",
    "plan",
    "plan_memory",
    "read_report",
    "read_telemetry",
    "render_app",
    "run_bundle",
    "run_demo",
    "run_demos",
    "run_lab",
    "run_quality_bench",
    "soak",
    "verdict",
    "verify_bundle",
]

if TYPE_CHECKING:
    from kvrig.appgen.linux import build_engine
    from kvrig.appgen.render import AppOptions, render_app
    from kvrig.bundle.manifest import check_bundle, load_manifest, verify_bundle
    from kvrig.bundle.options import PackageOptions
    from kvrig.calibration import calibrate
    from kvrig.coreml.export import export_coreml
    from kvrig.demo import DemoOptions, run_demo, run_demos
    from kvrig.device.deploy import deploy
    from kvrig.device.discovery import list_devices
    from kvrig.device.session import open_session
    from kvrig.exceptions import KvrigError
    from kvrig.lab.schedule import run_lab
    from kvrig.models import load_model_spec
    from kvrig.packaging import PackageResult, package
    from kvrig.planner import plan
    from kvrig.planner.memory import MemoryPlan, PlanRequest, plan_memory
    from kvrig.profiles import list_profiles, load_profile
    from kvrig.quality.bench import run_quality_bench
    from kvrig.recipes import KVSpec, WeightRecipe, parse_kv, parse_weights
    from kvrig.reports.jetsam import read_report, verdict
    from kvrig.reports.telemetry import read_telemetry
    from kvrig.runtime.generate import load_bundle, run_bundle
    from kvrig.soaking.driver import SoakOptions, soak
    from kvrig.soaking.plan import make_plan


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrig' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
