import Foundation

/// What the app builds for one layer. MLX-Swift's own quantized cache takes one bit width for keys and values
/// and cannot quantize a rotating (sliding) cache, so those cases are decided here, where they can be tested.
public enum LayerCacheChoice: Equatable, Sendable {
    /// The model's own cache, in the activation dtype.
    case unquantized
    /// MLX's affine QuantizedKVCache, reached through GenerateParameters.kvBits.
    case mlxAffine(bits: Int, groupSize: Int)
    /// Our cache: keys and values quantized at rest with their own widths (nil: kept in the activation dtype),
    /// with the plan's ``KVExtras`` (rotation, sink tokens, recent window) applied.
    case mixed(keyBits: Int?, valueBits: Int?, groupSize: Int)
    /// A sliding-window ring, left in the activation dtype.
    case slidingUnquantized(window: Int)
    /// Shared or linear-state layers: the model decides; nothing grows with context here.
    case modelManaged
}

/// kvcache.json's schema-2 options beyond bit widths, applied by kvrig's own cache (MLX's takes none of them).
public struct KVExtras: Equatable, Sendable {
    public let rotation: Rotation
    public let sinkTokens: Int
    public let recentTokens: Int

    public init(rotation: Rotation = .none, sinkTokens: Int = 0, recentTokens: Int = 0) {
        self.rotation = rotation
        self.sinkTokens = sinkTokens
        self.recentTokens = recentTokens
    }

    public var any: Bool { rotation != .none || sinkTokens > 0 || recentTokens > 0 }
}

public struct CachePlan: Equatable, Sendable {
    /// Families whose attention cannot read MLX's quantized cache, so their quantized layers use kvrig's cache,
    /// which hands attention dequantized keys and values: MLX Swift's own attention calls `cache.update` itself
    /// for some (mlx-swift-lm 3.31.4; MLX's QuantizedKVCache answers that with fatalError), mlx-lm's cannot read
    /// it for the others, and the plan counts the same cache for all (kvrig/kvcache/families.py).
    public static let readsDequantized: Set<String> = [
        "apertus", "baichuan_m1", "bitnet", "gemma2", "gemma4_text", "gpt_oss",
    ]
    /// Families whose KV-shared layers read their owner's `cache.state` as float keys and values (Gemma3nText.swift):
    /// only MLX's plain cache holds them so. kvrig packages these with fp16 KV (kvrig/kvcache/families.py).
    public static let keepsKVUnquantized: Set<String> = ["gemma3n"]

    /// For GenerateParameters.kvBits: set only when MLX's single-width cache covers every quantized layer.
    public let kvBits: Int?
    public let kvGroupSize: Int
    public let quantizedKVStart: Int
    public let extras: KVExtras
    public let layers: [Int: LayerCacheChoice]
    /// Lines the app logs at load so a reader sees what was and was not applied.
    public let notes: [String]

    public var needsCustomCache: Bool {
        layers.values.contains { if case .mixed = $0 { true } else { false } }
    }

    /// - Parameter modelType: config.json's model_type; families above change what the layers get.
    public init(config: KVCacheConfig, modelType: String? = nil) {
        var choices: [Int: LayerCacheChoice] = [:]
        var notes: [String] = []
        let family = modelType ?? ""
        var keptUnquantized = false
        for entry in config.layers {
            let (k, v) = entry.effectiveBits(default: config)
            switch entry.kind {
            case .full, .latent:
                if k == nil && v == nil {
                    choices[entry.layer] = .unquantized
                } else if Self.keepsKVUnquantized.contains(family) {
                    choices[entry.layer] = .unquantized
                    keptUnquantized = true
                } else if k == v, let bits = k {
                    choices[entry.layer] = .mlxAffine(bits: bits, groupSize: config.groupSize)
                } else {
                    choices[entry.layer] = .mixed(keyBits: k, valueBits: v, groupSize: config.groupSize)
                }
            case .sliding:
                let window = entry.window ?? 0
                choices[entry.layer] = .slidingUnquantized(window: window)
                if k != nil || v != nil {
                    notes.append(
                        "layer \(entry.layer): sliding window \(window) left unquantized "
                            + "(MLX cannot quantize a rotating cache)")
                }
            case .shared, .linear:
                choices[entry.layer] = .modelManaged
            }
        }
        if keptUnquantized {
            notes.append(
                "\(family): KV left unquantized (its KV-shared layers read their owner's cache as float keys and "
                    + "values); kvrig packages this family with fp16 KV")
        }
        let affineWidths = Set(choices.values.compactMap { if case .mlxAffine(let b, _) = $0 { b } else { nil } })
        let extras = KVExtras(
            rotation: config.rotation, sinkTokens: config.sinkTokens, recentTokens: config.recentTokens)
        let hasMixed = choices.values.contains { if case .mixed = $0 { true } else { false } }
        // MLX's cache takes one width for every layer and none of the extras: otherwise every quantized layer
        // uses kvrig's cache (as the host does, runtime/caches.py).
        let ownCacheReason: String? =
            if Self.readsDequantized.contains(family) && !affineWidths.isEmpty {
                "\(family)'s attention cannot read MLX's quantized cache: using kvrig's quantized cache "
                    + "(dequantized when read)"
            } else if extras.any {
                "rotation \(config.rotation.rawValue), sink_tokens \(config.sinkTokens), recent_tokens "
                    + "\(config.recentTokens): using kvrig's quantized cache"
            } else if hasMixed {
                "key bits differ from value bits: using kvrig's quantized cache (dequantized when read)"
            } else if affineWidths.count > 1 {
                "layers use several bit widths: using kvrig's quantized cache for all quantized layers"
            } else {
                nil
            }
        if let ownCacheReason {
            for (layer, choice) in choices {
                if case .mlxAffine(let b, let g) = choice { choices[layer] = .mixed(keyBits: b, valueBits: b, groupSize: g) }
            }
            notes.append(ownCacheReason)
        }
        let onlyAffine = choices.values.allSatisfy {
            switch $0 {
            case .mixed: false
            default: true
            }
        }
        self.kvBits = onlyAffine ? affineWidths.first : nil
        self.kvGroupSize = config.groupSize
        self.quantizedKVStart = config.quantizedKVStart
        self.extras = extras
        self.layers = choices
        self.notes = notes
    }
}
