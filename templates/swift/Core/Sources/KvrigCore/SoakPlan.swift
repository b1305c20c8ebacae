import Foundation

/// Soak plan, schema 4: mirrors kvrig/schemas/soakplan.py. Handed to the app with a launch argument.
/// Schema 2 added `backend`: which runtime the soak runs on (MLX, or the shipped Core ML program); schema 3
/// `weights_residency`: how this run holds the weights (nil: as kvcache.json says); schema 4 `buffer_cache`.
/// Schema-2 and -3 plans still read.

public struct GrowthSchedule: Codable, Equatable, Sendable {
    public var startTokens: Int
    public var stepTokens: Int
    public var maxTokens: Int
    public var decodeTokens: Int

    enum CodingKeys: String, CodingKey, CaseIterable {
        case startTokens = "start_tokens"
        case stepTokens = "step_tokens"
        case maxTokens = "max_tokens"
        case decodeTokens = "decode_tokens"
    }

    public init(startTokens: Int, stepTokens: Int, maxTokens: Int, decodeTokens: Int = 16) {
        self.startTokens = startTokens
        self.stepTokens = stepTokens
        self.maxTokens = maxTokens
        self.decodeTokens = decodeTokens
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        startTokens = try c.decode(Int.self, forKey: .startTokens)
        stepTokens = try c.decode(Int.self, forKey: .stepTokens)
        maxTokens = try c.decode(Int.self, forKey: .maxTokens)
        decodeTokens = try c.decodeIfPresent(Int.self, forKey: .decodeTokens) ?? 16
        try require(startTokens >= 1, "schedule.start_tokens", "must be >= 1")
        try require(stepTokens >= 1, "schedule.step_tokens", "must be >= 1")
        try require(maxTokens >= 1, "schedule.max_tokens", "must be >= 1")
        try require(decodeTokens >= 1, "schedule.decode_tokens", "must be >= 1")
    }

    /// Context lengths at which the soak measures: start, start + step, ... up to max (inclusive).
    public var targets: [Int] {
        guard startTokens <= maxTokens else { return [maxTokens] }
        return Array(stride(from: startTokens, through: maxTokens, by: stepTokens))
    }
}

public struct StopConditions: Codable, Equatable, Sendable {
    public var minDecodeTps: Double?
    public var maxFootprintBytes: Int?
    public var maxSeconds: Double?

    enum CodingKeys: String, CodingKey, CaseIterable {
        case minDecodeTps = "min_decode_tps"
        case maxFootprintBytes = "max_footprint_bytes"
        case maxSeconds = "max_seconds"
    }

    public init(minDecodeTps: Double? = nil, maxFootprintBytes: Int? = nil, maxSeconds: Double? = nil) {
        self.minDecodeTps = minDecodeTps
        self.maxFootprintBytes = maxFootprintBytes
        self.maxSeconds = maxSeconds
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        minDecodeTps = try c.decodeIfPresent(Double.self, forKey: .minDecodeTps)
        maxFootprintBytes = try c.decodeIfPresent(Int.self, forKey: .maxFootprintBytes)
        maxSeconds = try c.decodeIfPresent(Double.self, forKey: .maxSeconds)
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encode(minDecodeTps, forKey: .minDecodeTps)
        try c.encode(maxFootprintBytes, forKey: .maxFootprintBytes)
        try c.encode(maxSeconds, forKey: .maxSeconds)
    }

    /// The first stop condition a measurement meets, as a message; nil: keep going.
    public func check(decodeTps: Double?, footprint: Int, elapsed: Double) -> String? {
        if let minDecodeTps, let decodeTps, decodeTps < minDecodeTps {
            return "decode \(decodeTps) tok/s below \(minDecodeTps)"
        }
        if let maxFootprintBytes, footprint > maxFootprintBytes {
            return "footprint \(footprint) above \(maxFootprintBytes) bytes"
        }
        if let maxSeconds, elapsed > maxSeconds {
            return "ran \(Int(elapsed)) s, limit \(Int(maxSeconds)) s"
        }
        return nil
    }
}

public enum CriticalBehaviour: String, Codable, Sendable {
    case stopAndSave = "stop_and_save"
    case `continue`
}

/// MLX's buffer cache in a soak (schema 4): capped at kvcache.json's `buffer_cache_limit_bytes` (kvrig's app), or
/// never capped nor emptied, as an app grown from mlx-swift-lm's generation loop runs (`kvrig plan --app uncapped`).
public enum BufferCacheMode: String, Codable, Sendable {
    case capped
    case uncapped
}

public struct SoakPlan: Codable, Equatable, Sendable {
    public static let schemaVersion = 4
    public static let readableSchemas = 2...4
    public static let launchArgument = "--kvrig-soak-plan"
    public static let defaultFile = "soakplan.json"

    public var schema: Int
    public var runId: String
    public var scheme: String
    public var schedule: GrowthSchedule
    public var stop: StopConditions
    public var text: String
    public var telemetryFile: String
    public var onCritical: CriticalBehaviour
    public var backend: TelemetryBackend
    /// Overrides kvcache.json's `weights_layout` for this run (the lab soaks one bundle loaded and mapped).
    public var weightsResidency: WeightsResidency?
    /// MLX's buffer cache this run (schema 4); nil: capped, as kvcache.json says.
    public var bufferCache: BufferCacheMode?

    enum CodingKeys: String, CodingKey, CaseIterable {
        case schema
        case runId = "run_id"
        case scheme, schedule, stop, text
        case telemetryFile = "telemetry_file"
        case onCritical = "on_critical"
        case backend
        case weightsResidency = "weights_residency"
        case bufferCache = "buffer_cache"
    }

    public init(
        runId: String, scheme: String, schedule: GrowthSchedule, stop: StopConditions = StopConditions(),
        text: String, telemetryFile: String = "telemetry.jsonl", onCritical: CriticalBehaviour = .stopAndSave,
        backend: TelemetryBackend = .mlx, weightsResidency: WeightsResidency? = nil,
        bufferCache: BufferCacheMode? = nil
    ) {
        self.schema = Self.schemaVersion
        self.runId = runId
        self.scheme = scheme
        self.schedule = schedule
        self.stop = stop
        self.text = text
        self.telemetryFile = telemetryFile
        self.onCritical = onCritical
        self.backend = backend
        self.weightsResidency = weightsResidency
        self.bufferCache = bufferCache
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        schema = try c.decodeIfPresent(Int.self, forKey: .schema) ?? Self.schemaVersion
        runId = try c.decode(String.self, forKey: .runId)
        scheme = try c.decode(String.self, forKey: .scheme)
        schedule = try c.decode(GrowthSchedule.self, forKey: .schedule)
        stop = try c.decodeIfPresent(StopConditions.self, forKey: .stop) ?? StopConditions()
        text = try c.decode(String.self, forKey: .text)
        telemetryFile = try c.decodeIfPresent(String.self, forKey: .telemetryFile) ?? "telemetry.jsonl"
        onCritical = try c.decodeIfPresent(CriticalBehaviour.self, forKey: .onCritical) ?? .stopAndSave
        backend = try c.decodeIfPresent(TelemetryBackend.self, forKey: .backend) ?? .mlx
        weightsResidency = try c.decodeIfPresent(WeightsResidency.self, forKey: .weightsResidency)
        bufferCache = try c.decodeIfPresent(BufferCacheMode.self, forKey: .bufferCache)
        try require(Self.readableSchemas.contains(schema), "schema", "expected 2 to 4, got \(schema)")
        try require(schema >= 3 || weightsResidency == nil, "weights_residency", "a schema-3 field")
        try require(schema >= 4 || bufferCache == nil, "buffer_cache", "a schema-4 field")
        try require(!runId.isEmpty, "run_id", "must not be empty")
    }

    /// Every key, nil as null (as Python writes the plan), so a plan round-trips unchanged.
    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encode(schema, forKey: .schema)
        try c.encode(runId, forKey: .runId)
        try c.encode(scheme, forKey: .scheme)
        try c.encode(schedule, forKey: .schedule)
        try c.encode(stop, forKey: .stop)
        try c.encode(text, forKey: .text)
        try c.encode(telemetryFile, forKey: .telemetryFile)
        try c.encode(onCritical, forKey: .onCritical)
        try c.encode(backend, forKey: .backend)
        try c.encode(weightsResidency, forKey: .weightsResidency)
        try c.encode(bufferCache, forKey: .bufferCache)
    }

    /// The plan file named by `--kvrig-soak-plan PATH` in the launch arguments; a relative path is taken
    /// inside `base` (the app's Documents), and a path that climbs out of it is refused.
    public static func planURL(arguments: [String], base: URL) -> URL? {
        guard let index = arguments.firstIndex(of: launchArgument), index + 1 < arguments.count else {
            return nil
        }
        return ContainerPath.resolve(arguments[index + 1], in: base)
    }

    /// The telemetry file inside `base`, the same containment rule as the plan.
    public func telemetryURL(base: URL) -> URL? {
        ContainerPath.resolve(telemetryFile, in: base)
    }
}

/// Paths handed in from outside stay inside the app's container.
public enum ContainerPath {
    public static func resolve(_ path: String, in base: URL) -> URL? {
        guard !path.isEmpty else { return nil }
        let root = base.standardizedFileURL
        let url = path.hasPrefix("/")
            ? URL(fileURLWithPath: path).standardizedFileURL
            : root.appendingPathComponent(path).standardizedFileURL
        let rootPath = root.path.hasSuffix("/") ? root.path : root.path + "/"
        return url.path.hasPrefix(rootPath) ? url : nil
    }
}
