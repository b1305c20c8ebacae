"""pymobiledevice3's exceptions for a locked, untrusted or not-yet-developer phone become kvrig's typed errors,
each with its own exit code (told apart by type, never by message text)."""

from __future__ import annotations

from pymobiledevice3 import exceptions as pmd3

from kvrig.device.errors import translate
from kvrig.exceptions import DeveloperModeOffError, DeviceLockedError, DeviceLostError, ServiceRefusedError


def test_locked_and_untrusted_phones_are_device_locked() -> None:
    for raised in (
        pmd3.PasscodeRequiredError("PasscodeRequired", "UDID", "18.6"),
        pmd3.NotTrustedError(),
        pmd3.PasswordRequiredError(),
        pmd3.UserDeniedPairingError(),
    ):
        error = translate(raised, "connecting", udid="UDID", os_version="18.6")
        assert isinstance(error, DeviceLockedError) and error.exit_code == 26
        assert "unlock" in str(error) and "Trust" in str(error)


def test_developer_mode_off_is_its_own_cause() -> None:
    error = translate(pmd3.DeveloperModeIsNotEnabledError(), "mounting", udid="UDID", os_version="18.6")
    assert isinstance(error, DeveloperModeOffError) and error.exit_code == 23
    assert "Settings" in str(error) and "--enable-developer-mode" in str(error)


def test_refused_developer_service_on_ios17_says_a_tunnel_is_needed() -> None:
    refused = pmd3.InvalidServiceError("InvalidService", "UDID", "17.4")
    error = translate(refused, "starting process control", udid="UDID", os_version="17.4")
    assert isinstance(error, ServiceRefusedError) and "tunnel" in str(error)


def test_a_timeout_reads_as_a_phone_that_stopped_answering() -> None:
    """TimeoutError is an OSError: it read "lost the connection" (the exit code is the same, the cause is not)."""
    error = translate(TimeoutError(), "reading", udid="UDID", os_version="18.6")
    assert isinstance(error, DeviceLostError) and "stopped answering" in str(error)
    lost = translate(ConnectionResetError(104, "Connection reset by peer"), "reading", udid="UDID")
    assert isinstance(lost, DeviceLostError) and "lost the connection" in str(lost)
