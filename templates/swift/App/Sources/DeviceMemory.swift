import Darwin
import Foundation
import KvrigCore
import os

/// What jetsam looks at (phys_footprint, not RSS) and how much the process may still grow.
enum DeviceMemory {
    static func footprint() -> Int {
        var info = task_vm_info_data_t()
        var count = mach_msg_type_number_t(MemoryLayout<task_vm_info_data_t>.size / MemoryLayout<natural_t>.size)
        let result = withUnsafeMutablePointer(to: &info) { pointer in
            pointer.withMemoryRebound(to: integer_t.self, capacity: Int(count)) { raw in
                task_info(mach_task_self_, task_flavor_t(TASK_VM_INFO), raw, &count)
            }
        }
        return result == KERN_SUCCESS ? Int(info.phys_footprint) : 0
    }

    /// os_proc_available_memory(): bytes before the app reaches its jetsam limit (0 when unknown).
    static func available() -> Int? {
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

    /// The model identifier, e.g. iPhone16,1 (what device profiles are keyed by).
    static func productType() -> String {
        var system = utsname()
        uname(&system)
        return withUnsafeBytes(of: &system.machine) { bytes in
            String(decoding: bytes.prefix { $0 != 0 }, as: UTF8.self)
        }
    }

    static func osVersion() -> String {
        let v = ProcessInfo.processInfo.operatingSystemVersion
        return "\(v.majorVersion).\(v.minorVersion).\(v.patchVersion)"
    }
}

/// Memory-pressure notifications from the kernel, delivered on the main queue.
final class PressureMonitor {
    private let source: DispatchSourceMemoryPressure

    init(handler: @escaping (PressureLevel) -> Void) {
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
}

enum Log {
    static let app = Logger(subsystem: Bundle.main.bundleIdentifier ?? "kvrig", category: "app")
    /// Telemetry lines, the same bytes as the JSONL file, for `kvrig` reading syslog.
    static let telemetry = Logger(subsystem: Bundle.main.bundleIdentifier ?? "kvrig", category: "telemetry")
}
