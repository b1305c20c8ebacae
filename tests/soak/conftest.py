"""Soak runs against the virtual iPhone (160 MiB app limit), with the test app installed from an .ipa."""

from __future__ import annotations

from tests.device.conftest import BUNDLE_ID, Emulator, emulator, installed, ipa, on_device, run

__all__ = ["BUNDLE_ID", "Emulator", "emulator", "installed", "ipa", "on_device", "run"]
