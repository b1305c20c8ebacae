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

    init(model: any LanguageModel, config: KVCacheConfig) {
        let plan = config.cachePlan
        // GenerateParameters carries MLX's own KV quantization (one width for K and V); the loop hands the same
        // values to maybeQuantizeKVCache so MLX's QuantizedKVCache replaces the plain caches at the start point.
        let parameters = GenerateParameters(
            kvBits: plan.kvBits, kvGroupSize: plan.kvGroupSize, quantizedKVStart: plan.quantizedKVStart,
            temperature: 0.6, prefillStepSize: config.prefillStepSize)
        var caches = model.newCache(parameters: parameters)
        if plan.needsCustomCache {
            if caches.count == config.layers.count {
                for index in caches.indices {
                    guard case .mixed(let k, let v, let g)? = plan.layers[index], caches[index] is KVCacheSimple
                    else { continue }
                    caches[index] = MixedBitsKVCache(
                        keyBits: k, valueBits: v, groupSize: g, quantizedStart: plan.quantizedKVStart)
                }
            } else {
                Log.app.error(
                    "model has \(caches.count) caches, kvcache.json lists \(config.layers.count) layers: KV left unquantized")
            }
        }
        for note in plan.notes {
            Log.app.notice("\(note, privacy: .public)")
        }
        self.caches = caches
        self.plan = plan
        self.parameters = parameters
        self.keepTokens = config.keepTokens
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

    /// Bytes the caches hold now.
    var kvBytes: Int {
        caches.reduce(0) { total, cache in
            if let own = cache as? MixedBitsKVCache { return total + own.storedBytes }
            return total + cache.state.reduce(0) { $0 + $1.nbytes }
        }
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

    /// Applies MLX's KV quantization once a cache passes quantized_kv_start (equal K and V bits only).
    func quantizeIfDue() {
        maybeQuantizeKVCache(
            cache: &caches, kvBits: plan.kvBits, kvGroupSize: plan.kvGroupSize,
            quantizedKVStart: plan.quantizedKVStart)
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
