"""Soak tests over the device layer: grow the app's context until it completes, is killed by jetsam, crashes,
hangs or the phone goes away; pull telemetry and JetsamEvent reports; write results.json as it goes."""

from kvrig.soak.driver import SoakOptions, run_soak, soak
from kvrig.soak.plan import make_plan

__all__ = ["SoakOptions", "make_plan", "run_soak", "soak"]
