import Foundation
import KvrigCore

#if canImport(Darwin)
import Darwin
#endif
#if canImport(os)
import os
#endif

/// What jetsam looks at (phys_footprint, not RSS) and how much the process may still grow. When a host plays
/// the phone's kernel (the virtual iPhone, see ``HostKernel``) its answers are the numbers, as the phone's
/// would be; otherwise the OS is asked: Darwin on the phone, /proc on Linux (which has no phys_footprint).
enum DeviceMemory {
    static func footprint() -> Int {
        if let verdict = KernelHub.shared.lastVerdict { return verdict.footprint }
        return osFootprint()
    }

    /// Bytes before the app reaches its jetsam limit (nil when unknown).
    static func available() -> Int? {
        if let verdict = KernelHub.shared.lastVerdict { return verdict.available }
        return osAvailable()
    }

    #if canImport(Darwin)
    static func osFootprint() -> Int {
        var info = task_vm_info_data_t()
        var count = mach_msg_type_number_t(MemoryLayout<task_vm_info_data_t>.size / MemoryLayout<natural_t>.size)
        let result = withUnsafeMutablePointer(to: &info) { pointer in
            pointer.withMemoryRebound(to: integer_t.self, capacity: Int(count)) { raw in
                task_info(mach_task_self_, task_flavor_t(TASK_VM_INFO), raw, &count)
            }
        }
        return result == KERN_SUCCESS ? Int(info.phys_footprint) : 0
    }

    /// os_proc_available_memory(): 0 when the process has no jetsam limit (e.g. on a Mac).
    static func osAvailable() -> Int? {
        let bytes = Int(os_proc_available_memory())
        return bytes > 0 ? bytes : nil
    }

    static func thermalState() -> ThermalState {
        switch ProcessInfo.processInfo.thermalState {
        case .nominal: return .nominal
        case .fair: return .fair
        case .serious: return .serious
        case .critical: return .critical
        @unknown default: return .critical
        }
    }
    #else
    /// Linux has no phys_footprint: resident set size (VmRSS of /proc/self/status) is the closest it counts.
    static func osFootprint() -> Int {
        procStatusKilobytes("VmRSS").map { $0 * 1024 } ?? 0
    }

    /// Linux has no per-process jetsam limit; a cgroup memory limit is the nearest thing, else unknown.
    static func osAvailable() -> Int? {
        let base = URL(fileURLWithPath: "/sys/fs/cgroup")
        guard let max = readInt(base.appendingPathComponent("memory.max")),
            let current = readInt(base.appendingPathComponent("memory.current"))
        else { return nil }
        return Swift.max(0, max - current)
    }

    /// Linux reports no thermal state to applications; the phone's "nominal" is the honest default here.
    static func thermalState() -> ThermalState { .nominal }

    private static func procStatusKilobytes(_ key: String) -> Int? {
        guard let text = try? String(contentsOfFile: "/proc/self/status", encoding: .utf8) else { return nil }
        for line in text.split(separator: "\n") where line.hasPrefix(key + ":") {
            return Int(line.dropFirst(key.count + 1).split(whereSeparator: { $0 == " " || $0 == "\t" }).first ?? "")
        }
        return nil
    }

    private static func readInt(_ url: URL) -> Int? {
        guard let text = try? String(contentsOf: url, encoding: .utf8) else { return nil }
        return Int(text.trimmingCharacters(in: .whitespacesAndNewlines))
    }
    #endif

    /// The model identifier, e.g. iPhone16,1 (what device profiles are keyed by); a host kernel names the
    /// phone it plays.
    static func productType() -> String {
        if let product = ProcessInfo.processInfo.environment["KVRIG_PRODUCT_TYPE"], KernelHub.shared.attached {
            return product
        }
        var system = utsname()
        uname(&system)
        return withUnsafeBytes(of: &system.machine) { bytes in
            String(decoding: bytes.prefix { $0 != 0 }, as: UTF8.self)
        }
    }

    static func osVersion() -> String {
        if let version = ProcessInfo.processInfo.environment["KVRIG_OS_VERSION"], KernelHub.shared.attached {
            return version
        }
        let v = ProcessInfo.processInfo.operatingSystemVersion
        return "\(v.majorVersion).\(v.minorVersion).\(v.patchVersion)"
    }
}

/// Memory-pressure notifications from the kernel, delivered on the main queue.
final class PressureMonitor {
    #if canImport(Darwin)
    private let source: DispatchSourceMemoryPressure

    init(handler: @escaping @Sendable (PressureLevel) -> Void) {
        let source = DispatchSource.makeMemoryPressureSource(eventMask: [.normal, .warning, .critical], queue: .main)
        source.setEventHandler { [weak source] in
            guard let event = source?.data else { return }
            if event.contains(.critical) {
                handler(.critical)
            } else if event.contains(.warning) {
                handler(.warning)
            } else {
                handler(.normal)
            }
        }
        source.activate()
        self.source = source
    }

    deinit { source.cancel() }
    #else
    // Linux has no memory-pressure dispatch source: levels come only from a host playing the kernel.
    init(handler: @escaping @Sendable (PressureLevel) -> Void) {
        KernelHub.shared.onPressure = handler
    }

    deinit { KernelHub.shared.onPressure = nil }
    #endif
}

/// The app's memory after a step, in the phone's format, as a host kernel accounts it (the virtual iPhone's
/// channel: see kvrig's kvrig/virtual/apprun.py).
struct MemorySample: Sendable {
    var mlxActiveBytes: Int
    var mlxCacheBytes: Int
    var mlxPeakBytes: Int
    var kvBytes: Int
    var weightBytes: Int
    var contextTokens: Int
    var phoneFormatDeltaBytes: Int
    var phoneFormatPeakDeltaBytes: Int
    /// Weight bytes mapped from the bundle's file: in the MLX numbers, left out of the footprint by the kernel.
    var mappedWeightBytes: Int
    /// The app never caps nor empties MLX's buffer cache (the soak plan's `buffer_cache: uncapped`).
    var cacheUncapped: Bool = false
}

struct KernelVerdict: Sendable, Equatable {
    var footprint: Int
    var available: Int
    var pressure: PressureLevel
}

/// A host that plays the phone's kernel: told the app's memory after every step, it answers with the
/// footprint it charges, what is left and the pressure level, or kills the process (jetsam). On a phone
/// there is none; the real kernel watches by itself.
protocol HostKernel: AnyObject, Sendable {
    func report(_ sample: MemorySample) -> KernelVerdict?
}

/// Where the engine meets a host kernel, if one is attached: the last verdict (the numbers DeviceMemory
/// returns) and level changes, handed to the pressure handler on the main queue as the OS would.
final class KernelHub: @unchecked Sendable {
    static let shared = KernelHub()
    private let lock = NSLock()
    private var kernel: HostKernel?
    private var verdict: KernelVerdict?
    private var level = PressureLevel.normal
    private var handler: (@Sendable (PressureLevel) -> Void)?

    func attach(_ kernel: HostKernel) {
        lock.lock()
        self.kernel = kernel
        lock.unlock()
    }

    var attached: Bool {
        lock.lock()
        defer { lock.unlock() }
        return kernel != nil
    }

    var lastVerdict: KernelVerdict? {
        lock.lock()
        defer { lock.unlock() }
        return verdict
    }

    var onPressure: (@Sendable (PressureLevel) -> Void)? {
        get {
            lock.lock()
            defer { lock.unlock() }
            return handler
        }
        set {
            lock.lock()
            handler = newValue
            lock.unlock()
        }
    }

    /// Reports a sample when a kernel is attached (`make` runs only then); a changed level reaches the
    /// pressure handler on the main queue. Returns the verdict.
    @discardableResult
    func report(_ make: () -> MemorySample) -> KernelVerdict? {
        lock.lock()
        let kernel = self.kernel
        lock.unlock()
        guard let kernel, let answer = kernel.report(make()) else { return nil }
        lock.lock()
        verdict = answer
        let changed = answer.pressure != level
        level = answer.pressure
        let handler = self.handler
        lock.unlock()
        if changed, let handler {
            DispatchQueue.main.async { handler(answer.pressure) }
        }
        return answer
    }
}

/// Log lines: the unified log (os.Logger) on Apple platforms; standard error elsewhere (where the virtual
/// iPhone's channel and a terminal see them).
struct AppLog: Sendable {
    let category: String

    #if canImport(os)
    private var logger: Logger { Logger(subsystem: Bundle.main.bundleIdentifier ?? "kvrig", category: category) }
    func log(_ text: String) { logger.log("\(text, privacy: .public)") }
    func notice(_ text: String) { logger.notice("\(text, privacy: .public)") }
    func error(_ text: String) { logger.error("\(text, privacy: .public)") }
    #else
    func log(_ text: String) { LogSink.shared.write(category, text) }
    func notice(_ text: String) { LogSink.shared.write(category, text) }
    func error(_ text: String) { LogSink.shared.write(category, "error: " + text) }
    #endif
}

#if !canImport(os)
/// Where log lines go without os.Logger: standard error, or a host's channel when one takes them.
final class LogSink: @unchecked Sendable {
    static let shared = LogSink()
    private let lock = NSLock()
    private var sink: (@Sendable (String, String) -> Void)?

    func redirect(_ sink: @escaping @Sendable (String, String) -> Void) {
        lock.lock()
        self.sink = sink
        lock.unlock()
    }

    func write(_ category: String, _ text: String) {
        lock.lock()
        let sink = self.sink
        lock.unlock()
        if let sink {
            sink(category, text)
        } else {
            FileHandle.standardError.write(Data("[\(category)] \(text)\n".utf8))
        }
    }
}
#endif

enum Log {
    static let app = AppLog(category: "app")
    /// Telemetry lines, the same bytes as the JSONL file, for `kvrig` reading syslog.
    static let telemetry = AppLog(category: "telemetry")
}
