"""Every error kvrig raises on purpose. The CLI maps each class to a message and an exit code.

Exit codes: 1 a kvrig error of no narrower class, 2 command-line usage (click), 70 a bug (an exception kvrig
did not raise on purpose), then one per family below so scripts and CI can tell "your input file is wrong" from
"it does not fit" from "the phone went away".
"""

from __future__ import annotations

from pathlib import Path


class KvrigError(Exception):
    """Root of all kvrig errors."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM asked kvrig to stop: what was in progress was cancelled and cleaned up (apps stopped, partial files
    removed). Like Ctrl-C, not an error: no `except Exception` (nor `except KvrigError`) swallows it. Exit 143."""

    exit_code = 143


# --- input files: configs, profiles, schemas (exit 3) ---------------------------------------------------


class InputError(KvrigError):
    """A file we read is wrong: names the file, the field and what was expected."""

    exit_code = 3

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        field: str | None = None,
        expected: str | None = None,
    ) -> None:
        self.file = str(file) if file is not None else None
        self.field = field
        self.expected = expected
        parts = []
        if self.file:
            parts.append(self.file)
        if field:
            parts.append(f"field '{field}'")
        prefix = ": ".join(parts)
        text = f"{prefix}: {message}" if prefix else message
        if expected:
            text += f" (expected {expected})"
        super().__init__(text)


class ProfileError(InputError):
    """A device profile is missing, unknown or malformed."""


class ModelConfigError(InputError):
    """A model's config.json or GGUF metadata is missing fields or inconsistent."""


class PlanInputError(InputError):
    """A planning option is out of range."""


class SchemaError(InputError):
    """A contract file (kvcache.json, manifest.json, soak plan, results) does not match its schema."""


# --- models and planning (exit 4, 5) ---------------------------------------------------------------------


class UnsupportedArchitectureError(KvrigError):
    """The model's architecture is not one kvrig knows how to account for."""

    exit_code = 4

    def __init__(
        self, architecture: str, supported: list[str], *, file: str | Path | None = None, reason: str | None = None
    ) -> None:
        self.architecture = architecture
        self.supported = supported
        self.reason = reason
        where = f"{file}: " if file else ""
        if reason:  # a module mlx-lm ships that kvrig cannot plan here, and why
            super().__init__(f"{where}cannot plan architecture '{architecture}': {reason}")
        else:
            super().__init__(
                f"{where}unsupported architecture '{architecture}'; supported: {', '.join(sorted(supported))}"
            )


class QuantizationError(KvrigError):
    """A quantization setting cannot be applied (e.g. head dim not divisible by the group size)."""

    exit_code = 5


class DoesNotFitError(KvrigError):
    """The plan says this configuration exceeds the device's memory limit."""

    exit_code = 6


# --- bundles (exit 7, 8) -----------------------------------------------------------------------------------


class BundleError(KvrigError):
    """A bundle cannot be written or read."""

    exit_code = 7


class VerifyError(BundleError):
    """A bundle file does not match its manifest (missing, truncated, edited)."""

    exit_code = 8


class BundleExistsError(BundleError):
    """The output folder exists (replace a bundle only with --replace; never a folder that is not a bundle)."""

    exit_code = 36


class BundleWriteError(BundleError):
    """Writing the bundle failed (disk full, no permission); nothing was kept."""

    exit_code = 37


# --- platform (exit 9) -------------------------------------------------------------------------------------


class PlatformNotSupportedError(KvrigError):
    """A step needs another platform (xcodebuild needs macOS)."""

    exit_code = 9


# --- app generation (exit 15) ------------------------------------------------------------------------------


class AppGenError(KvrigError):
    """The Xcode project cannot be generated or built (output folder in the way, xcodebuild failed)."""

    exit_code = 15


class AppExistsError(AppGenError):
    """The output folder holds files and is not a project kvrig generated (no marker file): `--replace` replaces
    only what `kvrig app` made."""

    exit_code = 35


class SwiftDepsNotFoundError(AppGenError):
    """The Linux build of the engine needs MLX Swift's sources (KVRIG_SWIFT_DEPS) and a Swift toolchain."""

    exit_code = 30


class EngineNotForThisHostError(SwiftDepsNotFoundError):
    """The headless engine is the app's Linux (CPU) build; on macOS Xcode builds the app itself (`kvrig build`).
    Skipped as an unresolvable build is (`kvrig engine --skip-unresolvable`, the demo's `auto` runtime)."""


class SwiftBuildError(AppGenError):
    """`swift build` of the engine failed: the compiler's errors are in the message."""

    exit_code = 31


class EngineRunError(AppGenError):
    """The headless Swift engine (kvrig-engine) exited with an error."""

    exit_code = 32


# --- devices (exit 10-14) ----------------------------------------------------------------------------------


class DeviceError(KvrigError):
    """Talking to a phone (real or virtual) failed."""

    exit_code = 10


class DeviceNotFoundError(DeviceError):
    exit_code = 11


class ServiceRefusedError(DeviceError):
    """The device refused a service (e.g. developer services on iOS 17+ without a tunnel). `tunnel_hint`: the
    message already says how iOS 17+ reaches developer services."""

    exit_code = 12

    def __init__(self, message: str, *, tunnel_hint: bool = False) -> None:
        super().__init__(message)
        self.tunnel_hint = tunnel_hint


class DeviceLostError(DeviceError):
    """The device went away mid-operation (unplugged)."""

    exit_code = 13


class AppError(DeviceError):
    """The phone refused an app operation: install failed, app not installed, launch failed."""

    exit_code = 14


class DeviceFileError(DeviceError):
    """A file on the phone cannot be pulled as it is: not a regular file, gone, larger than kvrig pulls, or not
    read within its deadline (a phone that claims a 2^50-byte file, or whose reads never end)."""

    exit_code = 19


class DeviceAnswerError(DeviceError):
    """The phone answered something that is not the protocol: a value of the wrong type or size (a ProductType
    that is a number, a 5000-digit iOS version), a plist cut off or not a dictionary."""

    exit_code = 33


# --- soak (exit 16, 53) ------------------------------------------------------------------------------------


class SoakOutputExistsError(KvrigError):
    """`kvrig soak -o OUT` into a folder that already holds a soak's results: a second run never overwrites the
    first (checked before the phone is reached)."""

    exit_code = 53


class SoakFailedError(KvrigError):
    """A soak run ended in a hang, a lost device or the app's own error end (results were still written). The
    other ways an app ends each have their own code (60-64), subclasses of this one."""

    exit_code = 16


# --- how a soaked app ended, each kind with its evidence (exit 60-64) ---------------------------------------


class JetsamWithoutReportError(SoakFailedError):
    """Jetsam killed the app as the device log says, but the phone filed no JetsamEvent report (an app killed
    while suspended): the context it survived stands, the footprint at the kill is unknown."""

    exit_code = 60


class GpuBackgroundError(SoakFailedError):
    """The app was aborted for submitting GPU work from the background ("Insufficient Permission (to submit GPU
    work from background)")."""

    exit_code = 61


class WatchdogKillError(SoakFailedError):
    """The watchdog killed the app (0x8badf00d): it overran a launch or scene-update time allowance."""

    exit_code = 62


class AppCrashError(SoakFailedError):
    """The app crashed; its crash report was pulled."""

    exit_code = 63


class AppVanishedError(SoakFailedError):
    """The app ended with no trace: no end record, no report, nothing in the device log."""

    exit_code = 64


# --- lab (exit 17-18) --------------------------------------------------------------------------------------


class GateFailedError(KvrigError):
    """A lab run failed a gate or ended badly (crash, hang, device lost); results and JUnit were written."""

    exit_code = 17


class LabError(KvrigError):
    """The lab could not run: no device matched, or no run could start (partial results were written)."""

    exit_code = 18


class LabOutputExistsError(LabError):
    """`kvrig lab run -o OUT` into a folder that already holds a lab's results (or one running there now): a
    second run never overwrites the first. `kvrig lab merge -o OUT` into a folder it merges, or of other files."""

    exit_code = 34


class OutputWriteError(KvrigError):
    """An output file (results, JUnit, report) could not be written: the disk is full or not writable. What was
    written before stays as it was; nothing half-written is left."""

    exit_code = 38


# --- reports and telemetry (exit 20-22, 55) -----------------------------------------------------------------


class ReportError(InputError):
    """A jetsam report or telemetry file cannot be read."""

    exit_code = 20


class NotAJetsamReportError(ReportError):
    """The file is a crash report of another kind, or not a crash report at all."""

    exit_code = 21


class ProcessNotInReportsError(KvrigError):
    """`kvrig jetsam --process NAME`: NAME is in none of the reports read (misspelt, a bundle id, or not running
    at any of the events), so no report gives a verdict on it; each report's is still printed."""

    exit_code = 55


class CalibrationError(InputError):
    """Results cannot be calibrated from (no telemetry footprints, no bundle), or a calibration file lacks the
    device profile asked for."""

    exit_code = 22


# --- iOS 17+ developer services: preflight, tunnels, launch (exit 23-29) -----------------------------------


class DeveloperModeOffError(DeviceError):
    """Developer Mode is off: the phone offers no developer services (process control) until it is on."""

    exit_code = 23


class ImageNotMountedError(DeviceError):
    """The developer disk image is not mounted, so the instruments service (process control) is missing."""

    exit_code = 24


class NoTunnelError(DeviceError):
    """iOS 17+ developer services need a tunnel and none can be opened (17.0-17.3 without tunneld, tunneld
    unreachable, or a second userspace tunnel in one process)."""

    exit_code = 25


class DeviceLockedError(DeviceError):
    """The phone is locked (passcode needed) or does not trust this computer."""

    exit_code = 26


class TunnelHandshakeTimeoutError(NoTunnelError):
    """The phone accepted the tunnel (CoreDeviceProxy or RSD) but never finished the handshake."""

    exit_code = 27


class LaunchError(AppError):
    """Process control kept refusing to launch the app (transient device errors, retried) or returned no pid."""

    exit_code = 28


class TunnelLostError(DeviceLostError):
    """The tunnel to an iOS 17+ phone dropped and could not be reopened within the reconnect window."""

    exit_code = 29


# --- lab shards and merge (exit 42-44) ---------------------------------------------------------------------


class LabShardError(InputError):
    """`--shard` is not what was expected, a `--usbmuxd` host is named twice or has no name, or a folder to merge is
    not a lab's."""

    exit_code = 42


class ReportFolderError(LabError):
    """`kvrig lab report -o DIR` into a folder that holds other files: only an empty folder, a lab's own output or
    an earlier report is written into, so nothing else is overwritten."""

    exit_code = 52


class UsbmuxAddressError(InputError):
    """`USBMUXD_SOCKET_ADDRESS` or `--usbmuxd` names no usbmuxd: neither `UNIX:/path`, a path nor HOST:PORT."""

    exit_code = 51


class MergeConflictError(KvrigError):
    """Shards disagree: the same phone × entry × scheme ran with different results, or the shards come from
    different labs or gates (every run is kept in the merged files and the conflicts are listed)."""

    exit_code = 43


class MissingShardError(KvrigError):
    """The merged folders do not cover every shard of the lab (the merged files were written anyway)."""

    exit_code = 44


# --- the virtual iPhone (exit 48-49) -----------------------------------------------------------------------


class VirtualPhoneError(KvrigError):
    """The virtual iPhone server cannot run: its socket is taken by another server, or it did not start."""

    exit_code = 48


class VirtualFaultError(InputError):
    """A fault the virtual iPhone cannot have at its iOS version (a tunnel fault on a phone without
    CoreDeviceProxy, Developer Mode before iOS 16)."""

    exit_code = 49


# --- quality (exit 45-47) ----------------------------------------------------------------------------------


class QualityGateError(KvrigError):
    """The bundle's perplexity is too far above its source's (`kvrig package` refuses it unless forced)."""

    exit_code = 45


class QualityInputError(InputError):
    """A quality measurement cannot run: the evaluation or calibration text is missing, too short or no UTF-8
    text, or a text asked to judge recipes is (or holds) calibration text."""

    exit_code = 46


class KVSchemeError(QuantizationError):
    """A kvcache.json scheme option cannot be applied (rotation on a head dim that is not a power of two,
    sinks or a recent window on a model whose attention kvrig cannot route)."""

    exit_code = 47


# --- Core ML export (exit 39–41) -------------------------------------------------------------------------


class CoreMLUnsupportedError(KvrigError):
    """The bundle cannot be expressed as a stateful Core ML program as it is: its family, its quantization
    (only 4- and 8-bit affine groups map onto Core ML's block-wise ops), its dtype, the target or the context."""

    exit_code = 39

    def __init__(self, message: str, *, file: str | Path | None = None, field: str | None = None) -> None:
        self.file = str(file) if file is not None else None
        self.field = field
        where = ": ".join(p for p in (self.file, f"field '{field}'" if field else None) if p)
        super().__init__(f"{where}: {message}" if where else message)


class CoreMLToolsMissingError(KvrigError):
    """coremltools is not installed, or its version is outside the range kvrig's exporter was written for."""

    exit_code = 40


class CoreMLExportError(KvrigError):
    """The export could not be written (output exists, disk) or the saved package does not read back as the
    program promised (specs, weight bytes against the plan)."""

    exit_code = 41


# --- Core ML soaks (exit 50; 39-41 are the export's) ------------------------------------------------------


class CoreMLBackendError(KvrigError):
    """A soak asks for the Core ML backend but the installed app does not carry KvrigModel.mlpackage
    (`kvrig app --coreml` adds it)."""

    exit_code = 50


class CoreMLVirtualPhoneError(CoreMLBackendError):
    """A soak asks for the Core ML backend on the virtual iPhone, which runs MLX on Linux and has no Core ML."""


# --- the docs' generated records (exit 54) ----------------------------------------------------------------


class DocsStaleError(KvrigError):
    """`kvrig docs render --check`: a page differs from its render, or a measurement from the benchmark
    docs/benchmarks.yaml names."""

    exit_code = 54
