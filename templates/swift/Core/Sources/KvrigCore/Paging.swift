import Foundation

/// Page and budget arithmetic shared by the cache, the pressure policy and the metrics strip.
public enum Paging {
    /// Bytes per stored value: affine quantization keeps `bits` per value plus one scale and one bias per group
    /// in the activation dtype (8 bits at group 64 in fp16: 8.5 bits). nil bits: the activation dtype itself.
    public static func bitsPerValue(bits: Int?, groupSize: Int, activationBytes: Int = 2) -> Double {
        guard let bits else { return Double(activationBytes * 8) }
        return Double(bits) + Double(2 * activationBytes * 8) / Double(groupSize)
    }

    /// KV bytes one token costs in one layer with `kvHeads` heads of `headDim`.
    public static func bytesPerToken(
        kvHeads: Int, headDim: Int, keyBits: Int?, valueBits: Int?, groupSize: Int, activationBytes: Int = 2
    ) -> Double {
        let values = Double(kvHeads * headDim)
        let k = bitsPerValue(bits: keyBits, groupSize: groupSize, activationBytes: activationBytes)
        let v = bitsPerValue(bits: valueBits, groupSize: groupSize, activationBytes: activationBytes)
        return values * (k + v) / 8
    }

    /// Tokens a cache holds storage for: MLX grows caches in whole steps.
    public static func allocatedTokens(context: Int, step: Int) -> Int {
        guard context > 0 else { return 0 }
        return (context + step - 1) / step * step
    }

    /// Tokens to evict for `pages` pages, never touching the first `keep` tokens (kvcache.json keep_tokens).
    public static func tokensToEvict(context: Int, keep: Int, pageTokens: Int, pages: Int) -> Int {
        let evictable = max(0, context - keep)
        let wanted = max(0, pages) * pageTokens
        // Whole pages only, so eviction boundaries stay page aligned.
        return min(wanted, evictable / pageTokens * pageTokens)
    }
}

/// Memory budget on the phone: MLX's limit sits below the jetsam limit. MLX treats it as a guideline (past it,
/// it waits for scheduled work and empties its buffer cache before allocating more); it does not make an
/// allocation fail, so the app's own stop comes from memory pressure and the soak's stop conditions.
public enum Budget {
    /// The limit to give MLX: the configured one, lowered when the phone reports less room than expected.
    /// - Parameters:
    ///   - configured: memory_limit_bytes from kvcache.json (0: not set).
    ///   - footprint: current phys_footprint.
    ///   - available: os_proc_available_memory() now, bytes the app may still grow before jetsam.
    ///   - headroom: bytes kept free for the UI, Metal and the runtime outside MLX.
    ///   - mlxActive: bytes MLX holds now (part of the footprint).
    public static func mlxMemoryLimit(
        configured: Int, footprint: Int, available: Int?, headroom: Int, mlxActive: Int = 0
    ) -> Int {
        guard let available else { return configured }
        // MLX's limit counts MLX bytes only: what MLX has now plus what may still be allocated.
        let fromDevice = max(0, mlxActive + available - headroom)
        return configured > 0 ? min(configured, fromDevice) : fromDevice
    }

    /// Tokens the context can still grow before MLX's limit, given the measured cost of one token.
    public static func tokensLeft(limit: Int, mlxActive: Int, bytesPerToken: Double, step: Int) -> Int {
        guard bytesPerToken > 0 else { return Int.max }
        let tokens = Int(Double(max(0, limit - mlxActive)) / bytesPerToken)
        return tokens / step * step
    }
}
