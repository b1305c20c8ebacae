import Foundation
import KvrigCore
import MLX
import MLXLMCommon

/// The per-layer caches of one conversation, built from kvcache.json, plus requests from the pressure handler
/// (main queue) that the generation loop applies between tokens, on its own thread.
final class CacheSet: @unchecked Sendable {
    private(set) var caches: [KVCache]
    let plan: CachePlan
    let parameters: GenerateParameters
    let keepTokens: Int
    private let lock = NSLock()
    private var pendingEviction = 0
    private var stopRequested = false

    /// Set only by a host computing in float32 (see the Linux runner): the element size the phone stores
    /// those buffers at. nil on the phone, where buffers are already in its format.
    let phoneElementBytes: Int?

    init(
        model: any LanguageModel, config: KVCacheConfig, modelType: String? = nil, temperature: Float = 0.6,
        phoneElementBytes: Int? = nil
    ) {
        let plan = CachePlan(config: config, modelType: modelType)
        // GenerateParameters carries MLX's own KV quantization (one width for K and V); the loop converts plain
        // caches to MLX's QuantizedKVCache once they pass the start point (see quantizeIfDue).
        let parameters = GenerateParameters(
            kvBits: plan.kvBits, kvGroupSize: plan.kvGroupSize, quantizedKVStart: plan.quantizedKVStart,
            temperature: temperature, prefillStepSize: config.prefillStepSize)
        var caches = model.newCache(parameters: parameters)
        // One cache per cache-holding layer: shared layers read another layer's (as mlx-lm pairs them).
        let owners = config.layers.filter { $0.kind != .shared }
        if caches.count == owners.count {
            for (index, entry) in owners.enumerated() where caches[index] is KVCacheSimple {
                switch plan.layers[entry.layer] {
                case .mixed(let k, let v, let g)?:
                    caches[index] = MixedBitsKVCache(
                        keyBits: k, valueBits: v, groupSize: g, quantizedStart: plan.quantizedKVStart,
                        extras: plan.extras)
                case .mlxAffine(let bits, let g)? where plan.quantizedKVStart == 0:
                    // Quantized from the first token, as mlx-lm builds it: no float copy to convert later.
                    caches[index] = QuantizedKVCache(groupSize: g, bits: bits)
                default:
                    break
                }
            }
        } else {
            Log.app.error(
                "model has \(caches.count) caches, kvcache.json lists \(owners.count) cache-holding layers: "
                    + "KV left unquantized")
        }
        for note in plan.notes {
            Log.app.notice(note)
        }
        self.caches = caches
        self.plan = plan
        self.parameters = parameters
        self.keepTokens = config.keepTokens
        self.phoneElementBytes = phoneElementBytes
    }

    /// Tokens in the context: the longest growing cache (sliding rings stop at their window).
    /// Read on the generation thread; the UI reads ``snapshot`` instead.
    var contextTokens: Int { caches.map(\.offset).max() ?? 0 }

    private var lastSnapshot = (contextTokens: 0, kvBytes: 0)

    /// Context length and KV bytes as of the last forward pass, safe to read from the main thread.
    var snapshot: (contextTokens: Int, kvBytes: Int) {
        lock.lock()
        defer { lock.unlock() }
        return lastSnapshot
    }

    /// Called on the generation thread after each step.
    func recordSnapshot() {
        let current = (contextTokens: contextTokens, kvBytes: kvBytes)
        lock.lock()
        lastSnapshot = current
        lock.unlock()
    }

    /// Bytes the caches have allocated (whole buffers, not the filled part `state` returns), in the phone's
    /// format: what MLX's nbytes sums to on the phone, and what kvrig's planner counts.
    var kvBytes: Int {
        caches.flatMap { $0.innerState() }.reduce(0) { total, a in
            if let phoneElementBytes, a.dtype == .float32 { return total + a.size * phoneElementBytes }
            return total + a.nbytes
        }
    }

    /// The same buffers as the host holds them.
    var hostKVBytes: Int {
        caches.flatMap { $0.innerState() }.reduce(0) { $0 + $1.nbytes }
    }

    func requestEviction(tokens: Int) {
        lock.lock()
        pendingEviction += tokens
        lock.unlock()
    }

    func requestStop() {
        lock.lock()
        stopRequested = true
        lock.unlock()
    }

    var isStopRequested: Bool {
        lock.lock()
        defer { lock.unlock() }
        return stopRequested
    }

    func clearStop() {
        lock.lock()
        stopRequested = false
        lock.unlock()
    }

    /// Converts plain caches to MLX's QuantizedKVCache once they pass quantized_kv_start (equal K and V bits
    /// only; mixed widths convert inside MixedBitsKVCache). The whole buffer is quantized, capacity kept, as
    /// mlx-lm's `to_quantized` does (MLX Swift's `toQuantized` drops the unfilled tail: the bytes would then
    /// depend on where the start point fell, and differ from what the planner counts).
    /// Returns whether a cache was converted.
    @discardableResult
    func quantizeIfDue() -> Bool {
        guard let bits = plan.kvBits else { return false }
        var converted = false
        for index in caches.indices {
            guard let simple = caches[index] as? KVCacheSimple, !(simple is ChunkedKVCache),
                simple.offset > plan.quantizedKVStart
            else { continue }
            caches[index] = Self.quantizedKeepingCapacity(simple, bits: bits, groupSize: plan.kvGroupSize)
            converted = true
        }
        return converted
    }

    static func quantizedKeepingCapacity(_ cache: KVCacheSimple, bits: Int, groupSize: Int) -> QuantizedKVCache {
        let out = QuantizedKVCache(groupSize: groupSize, bits: bits)
        let buffers = cache.innerState()
        guard buffers.count == 2 else { return out }
        let k = quantized(buffers[0], groupSize: groupSize, bits: bits)
        let v = quantized(buffers[1], groupSize: groupSize, bits: bits)
        out.state = [k.wq, k.scales, k.biases, v.wq, v.scales, v.biases].compactMap { $0 }
        out.offset = cache.offset
        return out
    }

    /// Runs a pending eviction; returns the tokens dropped (0 when none was asked for or possible).
    func applyPendingEviction() -> Int {
        lock.lock()
        let wanted = pendingEviction
        pendingEviction = 0
        lock.unlock()
        guard wanted > 0 else { return 0 }
        var dropped = 0
        for cache in caches {
            dropped = max(dropped, Self.evictFront(cache, keep: keepTokens, count: wanted))
        }
        return dropped
    }

    /// Drops the oldest tokens after the first `keep` from a growing cache. Sliding rings are bounded already
    /// and shared or recurrent state has no tokens to drop, so those are left alone.
    static func evictFront(_ cache: KVCache, keep: Int, count: Int) -> Int {
        if let own = cache as? MixedBitsKVCache {
            return own.evictFront(keep: keep, count: count)
        }
        guard cache is KVCacheSimple || cache is QuantizedKVCache, let base = cache as? BaseKVCache else {
            return 0
        }
        let offset = base.offset
        let n = min(count, max(0, offset - keep))
        guard n > 0 else { return 0 }
        let kept = base.state.map {
            concatenated([$0[.ellipsis, ..<keep, 0...], $0[.ellipsis, (keep + n) ..< offset, 0...]], axis: 2)
        }
        base.state = kept
        base.offset = offset - n
        return n
    }
}
