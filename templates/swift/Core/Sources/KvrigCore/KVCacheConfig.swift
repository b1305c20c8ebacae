import Foundation

/// kvcache.json, schema 3: mirrors kvrig/schemas/kvcache.py field for field (snake_case on disk).

public enum CacheKind: String, Codable, Sendable, CaseIterable {
    case full, sliding, shared, linear, latent
}

public enum ActivationDType: String, Codable, Sendable {
    case float16, bfloat16, float32

    public var bytes: Int {
        switch self {
        case .float16, .bfloat16: 2
        case .float32: 4
        }
    }
}

/// Walsh-Hadamard rotation before KV quantization (schema 2): `hadamardKeys` stores H·k and attention uses H·q;
/// `hadamard` also stores H·v and applies H to the attention output (H is orthonormal and its own inverse for the
/// power-of-two head dims kvrig allows).
public enum Rotation: String, Codable, Sendable {
    case none
    case hadamardKeys = "hadamard_keys"
    case hadamard

    public var rotatesKeys: Bool { self != .none }
    public var rotatesValues: Bool { self == .hadamard }
    /// How a KV spec writes it (`k8v4+rot`), as kvrig's `--kv` takes it.
    public var specPart: String {
        switch self {
        case .none: ""
        case .hadamardKeys: "+rotk"
        case .hadamard: "+rot"
        }
    }
}

/// How the app holds the weights (schema 3): `loaded` into memory MLX allocates, or `mapped` from the bundle's file,
/// read-only, every tensor on a `weightsAlignmentBytes` boundary, its pages handed to MLX without a copy.
public enum WeightsLayout: String, Codable, Sendable {
    case loaded, mapped
}

public struct LayerCache: Codable, Equatable, Sendable {
    public var layer: Int
    public var kind: CacheKind
    public var window: Int?
    public var sourceLayer: Int?
    public var keyBits: Int?
    public var valueBits: Int?

    enum CodingKeys: String, CodingKey, CaseIterable {
        case layer, kind, window
        case sourceLayer = "source_layer"
        case keyBits = "key_bits"
        case valueBits = "value_bits"
    }

    public init(
        layer: Int, kind: CacheKind, window: Int? = nil, sourceLayer: Int? = nil, keyBits: Int? = nil,
        valueBits: Int? = nil
    ) {
        self.layer = layer
        self.kind = kind
        self.window = window
        self.sourceLayer = sourceLayer
        self.keyBits = keyBits
        self.valueBits = valueBits
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        layer = try c.decode(Int.self, forKey: .layer)
        kind = try c.decode(CacheKind.self, forKey: .kind)
        window = try c.decodeIfPresent(Int.self, forKey: .window)
        sourceLayer = try c.decodeIfPresent(Int.self, forKey: .sourceLayer)
        keyBits = try c.decodeIfPresent(Int.self, forKey: .keyBits)
        valueBits = try c.decodeIfPresent(Int.self, forKey: .valueBits)
        try validate()
    }

    public func encode(to encoder: Encoder) throws {
        // Nulls are written out, as Python's model_dump does, so a round trip gives the same document.
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encode(layer, forKey: .layer)
        try c.encode(kind, forKey: .kind)
        try c.encode(window, forKey: .window)
        try c.encode(sourceLayer, forKey: .sourceLayer)
        try c.encode(keyBits, forKey: .keyBits)
        try c.encode(valueBits, forKey: .valueBits)
    }

    public func validate() throws {
        try require(layer >= 0, "layers.\(layer).layer", "must be >= 0")
        if kind == .sliding {
            try require(window != nil, "layers.\(layer).window", "sliding layers need 'window'")
        }
        if let window { try require(window >= 1, "layers.\(layer).window", "must be >= 1") }
        if kind == .shared {
            try require(sourceLayer != nil, "layers.\(layer).source_layer", "shared layers need 'source_layer'")
        }
        if let sourceLayer { try require(sourceLayer >= 0, "layers.\(layer).source_layer", "must be >= 0") }
    }

    /// Bits the layer's keys and values are stored with, falling back to the file-wide setting.
    public func effectiveBits(default config: KVCacheConfig) -> (key: Int?, value: Int?) {
        (keyBits ?? config.keyBits, valueBits ?? config.valueBits)
    }
}

public enum PressureAction: String, Codable, Sendable {
    case evictOldestPages = "evict_oldest_pages"
    case stopAndSave = "stop_and_save"
    case none
}

public struct PressurePolicy: Codable, Equatable, Sendable {
    public var warning: PressureAction
    public var warningEvictPages: Int
    public var critical: PressureAction

    enum CodingKeys: String, CodingKey, CaseIterable {
        case warning
        case warningEvictPages = "warning_evict_pages"
        case critical
    }

    public init(
        warning: PressureAction = .evictOldestPages, warningEvictPages: Int = 1,
        critical: PressureAction = .stopAndSave
    ) {
        self.warning = warning
        self.warningEvictPages = warningEvictPages
        self.critical = critical
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        let defaults = PressurePolicy()
        warning = try c.decodeIfPresent(PressureAction.self, forKey: .warning) ?? defaults.warning
        warningEvictPages =
            try c.decodeIfPresent(Int.self, forKey: .warningEvictPages) ?? defaults.warningEvictPages
        critical = try c.decodeIfPresent(PressureAction.self, forKey: .critical) ?? defaults.critical
        // Python allows only these: warning never stops, and the evict count is not negative.
        try require(warning != .stopAndSave, "pressure.warning", "expected evict_oldest_pages or none")
        try require(warningEvictPages >= 0, "pressure.warning_evict_pages", "must be >= 0")
    }
}

public struct KVCacheConfig: Codable, Equatable, Sendable {
    public static let schemaVersion = 3
    public static let readableSchemas = 2...3
    /// What MLX quantizes with (mx.quantize / MLX.quantized): anything else would stop the app at its first
    /// quantized cache write, so the file is refused where it is read (kvrig/schemas/kvcache.py holds the same).
    public static let groupSizes = [32, 64, 128]
    public static let kvBits = [2, 3, 4, 5, 6, 8]

    public var schema: Int
    public var scheme: String
    public var dtype: ActivationDType
    public var keyBits: Int?
    public var valueBits: Int?
    public var groupSize: Int
    public var quantizedKVStart: Int
    public var rotation: Rotation
    /// First tokens also kept in the activation dtype; attention reads those copies (schema 2).
    public var sinkTokens: Int
    /// A ring of the latest tokens kept in the activation dtype, read instead of their quantized rows (schema 2).
    public var recentTokens: Int
    public var step: Int
    public var pageTokens: Int
    public var maxContext: Int
    public var keepTokens: Int
    public var prefillStepSize: Int
    public var bufferCacheLimitBytes: Int
    public var memoryLimitBytes: Int
    public var pressure: PressurePolicy
    /// Schema 3: `mapped` asks the app to map the weights from the file (it falls back to loading, and says so).
    public var weightsLayout: WeightsLayout
    public var weightsAlignmentBytes: Int?
    public var layers: [LayerCache]

    /// The KV spec in full (`k8v4+rot+s4+w64`), as `kvrig package --kv` takes it and the manifest records it:
    /// `scheme` names the widths only, and two runs that differ in their extras must not read alike.
    public var spec: String {
        scheme + rotation.specPart + (sinkTokens > 0 ? "+s\(sinkTokens)" : "")
            + (recentTokens > 0 ? "+w\(recentTokens)" : "")
    }

    enum CodingKeys: String, CodingKey, CaseIterable {
        case schema, scheme, dtype
        case keyBits = "key_bits"
        case valueBits = "value_bits"
        case groupSize = "group_size"
        case quantizedKVStart = "quantized_kv_start"
        case rotation
        case sinkTokens = "sink_tokens"
        case recentTokens = "recent_tokens"
        case step
        case pageTokens = "page_tokens"
        case maxContext = "max_context"
        case keepTokens = "keep_tokens"
        case prefillStepSize = "prefill_step_size"
        case bufferCacheLimitBytes = "buffer_cache_limit_bytes"
        case memoryLimitBytes = "memory_limit_bytes"
        case pressure
        case weightsLayout = "weights_layout"
        case weightsAlignmentBytes = "weights_alignment_bytes"
        case layers
    }

    public init(
        scheme: String, dtype: ActivationDType = .float16, keyBits: Int?, valueBits: Int?, groupSize: Int,
        quantizedKVStart: Int, rotation: Rotation = .none, sinkTokens: Int = 0, recentTokens: Int = 0,
        step: Int = 256, pageTokens: Int, maxContext: Int,
        keepTokens: Int, prefillStepSize: Int, bufferCacheLimitBytes: Int, memoryLimitBytes: Int,
        pressure: PressurePolicy = PressurePolicy(), weightsLayout: WeightsLayout = .loaded,
        weightsAlignmentBytes: Int? = nil, layers: [LayerCache]
    ) {
        self.schema = Self.schemaVersion
        self.scheme = scheme
        self.dtype = dtype
        self.keyBits = keyBits
        self.valueBits = valueBits
        self.groupSize = groupSize
        self.quantizedKVStart = quantizedKVStart
        self.rotation = rotation
        self.sinkTokens = sinkTokens
        self.recentTokens = recentTokens
        self.step = step
        self.pageTokens = pageTokens
        self.maxContext = maxContext
        self.keepTokens = keepTokens
        self.prefillStepSize = prefillStepSize
        self.bufferCacheLimitBytes = bufferCacheLimitBytes
        self.memoryLimitBytes = memoryLimitBytes
        self.pressure = pressure
        self.weightsLayout = weightsLayout
        self.weightsAlignmentBytes = weightsAlignmentBytes
        self.layers = layers
    }

    public init(from decoder: Decoder) throws {
        try rejectUnknownKeys(decoder, known: CodingKeys.self)
        let c = try decoder.container(keyedBy: CodingKeys.self)
        schema = try c.decodeIfPresent(Int.self, forKey: .schema) ?? Self.schemaVersion
        scheme = try c.decode(String.self, forKey: .scheme)
        dtype = try c.decodeIfPresent(ActivationDType.self, forKey: .dtype) ?? .float16
        // Required but nullable, as in the Python model: the key must be present.
        guard c.contains(.keyBits) else {
            throw DecodingError.keyNotFound(
                CodingKeys.keyBits, .init(codingPath: c.codingPath, debugDescription: "key_bits is required"))
        }
        guard c.contains(.valueBits) else {
            throw DecodingError.keyNotFound(
                CodingKeys.valueBits,
                .init(codingPath: c.codingPath, debugDescription: "value_bits is required"))
        }
        keyBits = try c.decodeIfPresent(Int.self, forKey: .keyBits)
        valueBits = try c.decodeIfPresent(Int.self, forKey: .valueBits)
        groupSize = try c.decode(Int.self, forKey: .groupSize)
        quantizedKVStart = try c.decode(Int.self, forKey: .quantizedKVStart)
        rotation = try c.decodeIfPresent(Rotation.self, forKey: .rotation) ?? .none
        sinkTokens = try c.decodeIfPresent(Int.self, forKey: .sinkTokens) ?? 0
        recentTokens = try c.decodeIfPresent(Int.self, forKey: .recentTokens) ?? 0
        step = try c.decodeIfPresent(Int.self, forKey: .step) ?? 256
        pageTokens = try c.decode(Int.self, forKey: .pageTokens)
        maxContext = try c.decode(Int.self, forKey: .maxContext)
        keepTokens = try c.decode(Int.self, forKey: .keepTokens)
        prefillStepSize = try c.decode(Int.self, forKey: .prefillStepSize)
        bufferCacheLimitBytes = try c.decode(Int.self, forKey: .bufferCacheLimitBytes)
        memoryLimitBytes = try c.decode(Int.self, forKey: .memoryLimitBytes)
        pressure = try c.decodeIfPresent(PressurePolicy.self, forKey: .pressure) ?? PressurePolicy()
        weightsLayout = try c.decodeIfPresent(WeightsLayout.self, forKey: .weightsLayout) ?? .loaded
        weightsAlignmentBytes = try c.decodeIfPresent(Int.self, forKey: .weightsAlignmentBytes)
        layers = try c.decode([LayerCache].self, forKey: .layers)
        try validate()
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encode(schema, forKey: .schema)
        try c.encode(scheme, forKey: .scheme)
        try c.encode(dtype, forKey: .dtype)
        try c.encode(keyBits, forKey: .keyBits)
        try c.encode(valueBits, forKey: .valueBits)
        try c.encode(groupSize, forKey: .groupSize)
        try c.encode(quantizedKVStart, forKey: .quantizedKVStart)
        try c.encode(rotation, forKey: .rotation)
        try c.encode(sinkTokens, forKey: .sinkTokens)
        try c.encode(recentTokens, forKey: .recentTokens)
        try c.encode(step, forKey: .step)
        try c.encode(pageTokens, forKey: .pageTokens)
        try c.encode(maxContext, forKey: .maxContext)
        try c.encode(keepTokens, forKey: .keepTokens)
        try c.encode(prefillStepSize, forKey: .prefillStepSize)
        try c.encode(bufferCacheLimitBytes, forKey: .bufferCacheLimitBytes)
        try c.encode(memoryLimitBytes, forKey: .memoryLimitBytes)
        try c.encode(pressure, forKey: .pressure)
        try c.encode(weightsLayout, forKey: .weightsLayout)
        try c.encode(weightsAlignmentBytes, forKey: .weightsAlignmentBytes)
        try c.encode(layers, forKey: .layers)
    }

    public func validate() throws {
        // Schema 2 files (bundles written before weights could be mapped) read as loaded.
        try require(Self.readableSchemas.contains(schema), "schema", "expected 2 or 3, got \(schema)")
        if weightsLayout == .mapped || weightsAlignmentBytes != nil {
            try require(schema >= 3, "weights_layout", "a schema-3 field")
        }
        if weightsLayout == .mapped {
            try require((weightsAlignmentBytes ?? 0) >= 1, "weights_alignment_bytes", "a mapped layout names it")
        }
        try require(Self.groupSizes.contains(groupSize), "group_size", "one of \(Self.groupSizes), got \(groupSize)")
        for (field, bits) in [("key_bits", keyBits), ("value_bits", valueBits)] + layers.flatMap({ entry in
            [("layers.\(entry.layer).key_bits", entry.keyBits), ("layers.\(entry.layer).value_bits", entry.valueBits)]
        }) {
            if let bits { try require(Self.kvBits.contains(bits), field, "one of \(Self.kvBits), got \(bits)") }
        }
        try require(quantizedKVStart >= 0, "quantized_kv_start", "must be >= 0")
        try require(sinkTokens >= 0, "sink_tokens", "must be >= 0")
        try require(recentTokens >= 0, "recent_tokens", "must be >= 0")
        try require(step >= 1, "step", "must be >= 1")
        try require(pageTokens >= 1, "page_tokens", "must be >= 1")
        try require(maxContext >= 1, "max_context", "must be >= 1")
        try require(keepTokens >= 0, "keep_tokens", "must be >= 0")
        try require(prefillStepSize >= 1, "prefill_step_size", "must be >= 1")
        try require(bufferCacheLimitBytes >= 0, "buffer_cache_limit_bytes", "must be >= 0")
        try require(memoryLimitBytes >= 0, "memory_limit_bytes", "must be >= 0")
        for layer in layers { try layer.validate() }
    }

    /// How the app builds the cache for each layer; see ``CachePlan``.
    public var cachePlan: CachePlan { CachePlan(config: self) }
}
