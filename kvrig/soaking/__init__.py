"""Soak tests over the device layer: grow the app's context until it completes, is killed by jetsam, crashes,
hangs or the phone goes away; pull telemetry and JetsamEvent reports; write results.json as it goes."""
