import Foundation

/// Telemetry, schema 4: mirrors kvrig/schemas/telemetry.py. One JSON object per line, `event` says which.
/// Schema 2 added `backend` to `start`: which runtime ran the soak (MLX, or the Core ML program); schema 3
/// added it to `step`; schema 4 added how the weights are held to `start` (loaded, or mapped from the file).

public enum ThermalState: String, Codable, Sendable {
    case nominal, fair, serious, critical
}

public enum TelemetryBackend: String, Codable, Sendable {
    case mlx, coreml
}

/// How the app holds its weights: in memory MLX allocated (counted in the footprint), or mapped from the bundle's
/// file (clean pages iOS can drop and read back, outside the footprint).
public enum WeightsResidency: String, Codable, Sendable {
    case loaded, mapped
}

public enum PressureLevel: String, Codable, Sendable {
    case normal, warning, critical
}

public enum EndReason: String, Codable, Sendable {
    case completed
    case stopCondition = "stop_condition"
    case memoryCritical = "memory_critical"
    case allocationFailed = "allocation_failed"
    case error
    /// The continued-processing task ended (expired, or the person cancelled it) while the app was in the
    /// background: GPU work stopped, the run saved and ended.
    case backgroundTaskExpired = "background_task_expired"
}

/// The scene's phase as the app acts on it: in front, or not (SwiftUI's inactive and background alike).
public enum SceneState: String, Codable, Sendable {
    case active, background
}

/// The phase of the run whose next forward pass the scene change met.
public enum GPUPhase: String, Codable, Sendable {
    case prefill, decode, idle
}

/// What the app's GPU work did: paused in the background, continued under a continued-processing task that
/// holds the GPU, resumed in the foreground.
public enum SceneGPU: String, Codable, Sendable {
    case paused, continued, resumed
}

public enum TelemetryPayload: Equatable, Sendable {
    case start(
        model: String, scheme: String, productType: String, osVersion: String, limitBytes: Int?,
        converted: [String], backend: TelemetryBackend = .mlx, weightsResidency: WeightsResidency? = nil,
        mappedWeightBytes: Int? = nil, residencyNote: String? = nil)
    case step(StepMetrics)
    case memoryPressure(level: PressureLevel, contextTokens: Int, physFootprintBytes: Int?)
    case evict(tokensEvicted: Int, contextTokens: Int, kvBytes: Int?)
    case scene(phase: SceneState, contextTokens: Int, during: GPUPhase, gpu: SceneGPU)
    case end(reason: EndReason, contextTokens: Int, message: String?)

    public var name: String {
        switch self {
        case .start: "start"
        case .step: "step"
        case .memoryPressure: "memory_pressure"
        case .evict: "evict"
        case .scene: "scene"
        case .end: "end"
        }
    }
}

public struct StepMetrics: Equatable, Sendable {
    public var contextTokens: Int
    public var decodeTps: Double?
    public var prefillTps: Double?
    public var physFootprintBytes: Int
    public var availableBytes: Int?
    public var mlxActiveBytes: Int?
    public var mlxCacheBytes: Int?
    public var mlxPeakBytes: Int?
    public var kvBytes: Int?
    public var thermalState: ThermalState?
    /// The runtime that measured the step (nil: not recorded).
    public var backend: TelemetryBackend?

    public init(
        contextTokens: Int, decodeTps: Double? = nil, prefillTps: Double? = nil, physFootprintBytes: Int,
        availableBytes: Int? = nil, mlxActiveBytes: Int? = nil, mlxCacheBytes: Int? = nil,
        mlxPeakBytes: Int? = nil, kvBytes: Int? = nil, thermalState: ThermalState? = nil,
        backend: TelemetryBackend? = nil
    ) {
        self.contextTokens = contextTokens
        self.decodeTps = decodeTps
        self.prefillTps = prefillTps
        self.physFootprintBytes = physFootprintBytes
        self.availableBytes = availableBytes
        self.mlxActiveBytes = mlxActiveBytes
        self.mlxCacheBytes = mlxCacheBytes
        self.mlxPeakBytes = mlxPeakBytes
        self.kvBytes = kvBytes
        self.thermalState = thermalState
        self.backend = backend
    }
}

public struct TelemetryEvent: Encodable, Equatable, Sendable {
    public static let schemaVersion = 5

    public var runId: String
    public var seq: Int
    public var t: Double
    public var payload: TelemetryPayload

    public init(runId: String, seq: Int, t: Double, payload: TelemetryPayload) {
        self.runId = runId
        self.seq = seq
        self.t = t
        self.payload = payload
    }

    enum Key: String, CodingKey {
        case schema, event, seq, t, model, scheme, converted, level, reason, message, backend, phase, during, gpu
        case runId = "run_id"
        case productType = "product_type"
        case osVersion = "os_version"
        case limitBytes = "limit_bytes"
        case contextTokens = "context_tokens"
        case decodeTps = "decode_tps"
        case prefillTps = "prefill_tps"
        case physFootprintBytes = "phys_footprint_bytes"
        case availableBytes = "available_bytes"
        case mlxActiveBytes = "mlx_active_bytes"
        case mlxCacheBytes = "mlx_cache_bytes"
        case mlxPeakBytes = "mlx_peak_bytes"
        case kvBytes = "kv_bytes"
        case thermalState = "thermal_state"
        case tokensEvicted = "tokens_evicted"
        case weightsResidency = "weights_residency"
        case mappedWeightBytes = "mapped_weight_bytes"
        case residencyNote = "residency_note"
    }

    /// Rates that are not finite (a zero-length interval) are written as null, which JSON can carry.
    private static func finite(_ x: Double?) -> Double? {
        guard let x, x.isFinite, x >= 0 else { return nil }
        return x
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: Key.self)
        try c.encode(Self.schemaVersion, forKey: .schema)
        try c.encode(payload.name, forKey: .event)
        try c.encode(runId, forKey: .runId)
        try c.encode(seq, forKey: .seq)
        try c.encode(t, forKey: .t)
        switch payload {
        case .start(
            let model, let scheme, let productType, let osVersion, let limitBytes, let converted, let backend,
            let weightsResidency, let mappedWeightBytes, let residencyNote):
            try c.encode(model, forKey: .model)
            try c.encode(scheme, forKey: .scheme)
            try c.encode(productType, forKey: .productType)
            try c.encode(osVersion, forKey: .osVersion)
            try c.encode(limitBytes, forKey: .limitBytes)
            try c.encode(converted, forKey: .converted)
            try c.encode(backend, forKey: .backend)
            try c.encode(weightsResidency, forKey: .weightsResidency)
            try c.encode(mappedWeightBytes, forKey: .mappedWeightBytes)
            try c.encode(residencyNote, forKey: .residencyNote)
        case .step(let m):
            try c.encode(m.contextTokens, forKey: .contextTokens)
            try c.encode(Self.finite(m.decodeTps), forKey: .decodeTps)
            try c.encode(Self.finite(m.prefillTps), forKey: .prefillTps)
            try c.encode(m.physFootprintBytes, forKey: .physFootprintBytes)
            try c.encode(m.availableBytes, forKey: .availableBytes)
            try c.encode(m.mlxActiveBytes, forKey: .mlxActiveBytes)
            try c.encode(m.mlxCacheBytes, forKey: .mlxCacheBytes)
            try c.encode(m.mlxPeakBytes, forKey: .mlxPeakBytes)
            try c.encode(m.kvBytes, forKey: .kvBytes)
            try c.encode(m.thermalState, forKey: .thermalState)
            try c.encode(m.backend, forKey: .backend)
        case .memoryPressure(let level, let contextTokens, let footprint):
            try c.encode(level, forKey: .level)
            try c.encode(contextTokens, forKey: .contextTokens)
            try c.encode(footprint, forKey: .physFootprintBytes)
        case .evict(let tokensEvicted, let contextTokens, let kvBytes):
            try c.encode(tokensEvicted, forKey: .tokensEvicted)
            try c.encode(contextTokens, forKey: .contextTokens)
            try c.encode(kvBytes, forKey: .kvBytes)
        case .scene(let phase, let contextTokens, let during, let gpu):
            try c.encode(phase, forKey: .phase)
            try c.encode(contextTokens, forKey: .contextTokens)
            try c.encode(during, forKey: .during)
            try c.encode(gpu, forKey: .gpu)
        case .end(let reason, let contextTokens, let message):
            try c.encode(reason, forKey: .reason)
            try c.encode(contextTokens, forKey: .contextTokens)
            try c.encode(message, forKey: .message)
        }
    }

    /// One JSONL line, newline included.
    public func line() throws -> String {
        let data = try ContractJSON.encoder().encode(self)
        return String(decoding: data, as: UTF8.self) + "\n"
    }
}

/// Numbers records in order and writes each as one line with a single write, so a kill mid-write tears at
/// most the last line (the reader tolerates that).
public final class TelemetryLog: @unchecked Sendable {
    public let runId: String
    private var seq = 0
    private let handle: FileHandle?
    private let clock: () -> Double
    private let mirror: (String) -> Void
    private let lock = NSLock()

    /// - Parameters:
    ///   - url: the JSONL file (appended to); nil: mirror only.
    ///   - mirror: receives every line too (the app sends it to os_log).
    public init(
        runId: String, url: URL?, clock: @escaping () -> Double = { Date().timeIntervalSince1970 },
        mirror: @escaping (String) -> Void = { _ in }
    ) throws {
        self.runId = runId
        self.clock = clock
        self.mirror = mirror
        if let url {
            if !FileManager.default.fileExists(atPath: url.path) {
                _ = FileManager.default.createFile(atPath: url.path, contents: nil)
            }
            let handle = try FileHandle(forWritingTo: url)
            handle.seekToEndOfFile()
            self.handle = handle
        } else {
            self.handle = nil
        }
    }

    deinit { try? handle?.close() }

    @discardableResult
    public func record(_ payload: TelemetryPayload) throws -> TelemetryEvent {
        lock.lock()
        defer { lock.unlock() }
        let event = TelemetryEvent(runId: runId, seq: seq, t: clock(), payload: payload)
        let line = try event.line()
        handle?.write(Data(line.utf8))
        seq += 1
        mirror(line)
        return event
    }
}
