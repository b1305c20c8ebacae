"""Names one side of a boundary writes and the other reads: the Info.plist keys kvrig writes into the generated
app and reads back from an installed one (installation_proxy lists them), so the device side can tell what an
app carries without importing the renderer; and the lockdown value by which the virtual iPhone says what it is,
which the device side reads without importing the emulator."""

from __future__ import annotations

VIRTUAL_RUNTIME_KEY = "KvrigVirtualRuntime"
"""The host runtime a virtual-iPhone app runs (appgen.virtual_ipa writes it; a phone's app has none)."""
COREML_MODEL_KEY = "KvrigCoreMLModel"
"""The Core ML resource an app rendered with `kvrig app --coreml` ships (checked by `kvrig soak --backend`)."""
VIRTUAL_KEY = "KvrigVirtualDevice"
"""A lockdown value only kvrig's virtual iPhone sends; real phones never have it."""
ENTITLEMENTS_FILE = "archived-expanded-entitlements.xcent"
"""Where Xcode leaves an app's signed entitlements in the .app: `kvrig build --virtual` writes the project's there
and the virtual iPhone, which runs no signed binary, reads them."""
