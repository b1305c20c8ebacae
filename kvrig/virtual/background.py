"""Foreground and background on the virtual iPhone: which app is in front, and the kernel's rule for GPU work.

Launching an app through process control brings it to the foreground, as on a phone: the app that was there
goes to the background (launching Settings, `com.apple.Preferences`, is how a soak sends the app away), and
launching an app that already runs, without KillExisting, brings it back. The running app hears of it on its
channel (see `apprun`):

    emulator -> app   {"scene": "background"} / {"scene": "active"}
                      {"continued_processing": "expired"}   (its continued-processing task ran out)
    app -> emulator   {"continued_processing": {"gpu": true}}   (it submitted a BGContinuedProcessingTaskRequest
                                                                  with the GPU resource, iOS 26+)

At launch the app finds `KVRIG_SUPPORTED_RESOURCES` in its environment: `gpu` where the phone supports GPU work
in a continued-processing task (`BGTaskScheduler.supportedResources`: from iOS 26, on a phone that has it), else
empty. A measurement is what the app sends after each forward pass, so it stands for GPU work: one that arrives
while the app is in the background, without a continued-processing task holding the GPU, after the one that
was in flight when the app was told, gets the app aborted as Metal aborts it on a phone: the command buffer
fails with "Insufficient Permission (to submit GPU work from background)", MLX raises, libc++abi terminates
the process (SIGABRT), and a crash report carries the message (`AppRunner._gpu_background`, the same end the
`gpu_background_at_tokens` fault makes).
"""

from __future__ import annotations

from kvrig.virtual.state import Identity

IN_FLIGHT_MEASUREMENTS = 1  # the step already submitted when the app was sent away finishes without harm


def supported_resources(identity: Identity, background_gpu: bool) -> str:
    """What `BGTaskScheduler.supportedResources` answers on this phone, as the app's environment carries it."""
    major = int(identity.product_version.split(".")[0])
    return "gpu" if background_gpu and major >= 26 else ""
