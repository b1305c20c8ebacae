import Foundation
import KvrigCore
import MLX
import MLXLMCommon

/// A KV cache whose keys and values are quantized at rest with their own bit widths (MLX's QuantizedKVCache
/// and quantized attention take one width for both), dequantized when attention reads them. The dequantized
/// copy of one layer is transient: the planner counts it. nil bits keep that side in the activation dtype.
///
/// kvcache.json's extras (``KVExtras``) mean what they mean on the host (kvrig/kvcache/kv_cache.py):
/// - rotation: H·k (and H·v) are quantized; attention gets H·dequant(H·k), i.e. (H·q)·dequant(H·k) as the
///   host computes it (H is the orthonormal Walsh-Hadamard matrix, symmetric and its own inverse for the
///   power-of-two head dims kvrig packages), and likewise H·(p·dequant(H·v)) for the output;
/// - sink_tokens: the first tokens also kept in the activation dtype, read instead of their quantized rows;
/// - recent_tokens: a ring of the latest tokens in the activation dtype, read instead of theirs.
/// The quantized store holds every token either way, so its bytes grow as the planner counts; the sink and
/// ring are fixed buffers allocated with the first quantized update, as the host allocates them.
///
/// It conforms to mlx-swift-lm's `KVCache` protocol directly: `BaseKVCache` is `open` but its initializer
/// is internal, so no other module can subclass it (and `KVCacheSimple` is not `open`).
final class MixedBitsKVCache: KVCache, @unchecked Sendable {
    private(set) var offset = 0
    private var keyStore: QuantizedStore
    private var valueStore: QuantizedStore
    private let keyBits: Int?
    private let valueBits: Int?
    private let groupSize: Int
    private let quantizedStart: Int
    private let extras: KVExtras
    /// [keys, values] of the first `sinkTokens` tokens, and of the ring slot `position % recentTokens`.
    private var sink: [MLXArray] = []
    private var recent: [MLXArray] = []
    static let step = 256

    init(keyBits: Int?, valueBits: Int?, groupSize: Int, quantizedStart: Int, extras: KVExtras = KVExtras()) {
        self.keyBits = keyBits
        self.valueBits = valueBits
        self.groupSize = groupSize
        self.quantizedStart = quantizedStart
        self.extras = extras
        // Below quantized_kv_start both sides stay in the activation dtype, as MLX's own cache does.
        let quantizeNow = quantizedStart == 0
        keyStore = QuantizedStore(bits: quantizeNow ? keyBits : nil, groupSize: groupSize)
        valueStore = QuantizedStore(bits: quantizeNow ? valueBits : nil, groupSize: groupSize)
    }

    var maxSize: Int? { nil }

    private var quantizing: Bool { keyStore.bits == keyBits && valueStore.bits == valueBits }

    func innerState() -> [MLXArray] { keyStore.parts + valueStore.parts + sink + recent }

    func update(keys: MLXArray, values: MLXArray) -> (MLXArray, MLXArray) {
        if quantizing {
            enter(keys: keys, values: values)
        } else {
            keyStore.append(keys, at: offset)
            valueStore.append(values, at: offset)
            offset += keys.dim(2)
            if offset > quantizedStart {
                if extras.any {
                    // As the host's SchemeKVCache.from_kv_cache: the float tokens enter the quantized cache anew.
                    let (k, v) = (keyStore.read(count: offset, dtype: keys.dtype), valueStore.read(count: offset, dtype: values.dtype))
                    keyStore = QuantizedStore(bits: keyBits, groupSize: groupSize)
                    valueStore = QuantizedStore(bits: valueBits, groupSize: groupSize)
                    offset = 0
                    enter(keys: k, values: v)
                } else {
                    keyStore = keyStore.requantized(bits: keyBits, dtype: keys.dtype)
                    valueStore = valueStore.requantized(bits: valueBits, dtype: values.dtype)
                }
            }
        }
        return read(keyDType: keys.dtype, valueDType: values.dtype)
    }

    /// Appends tokens to the quantized store (rotated first when asked) and to the sink and recent copies.
    private func enter(keys: MLXArray, values: MLXArray) {
        let previous = offset
        keyStore.append(extras.rotation.rotatesKeys ? hadamardTransform(keys) : keys, at: previous)
        valueStore.append(extras.rotation.rotatesValues ? hadamardTransform(values) : values, at: previous)
        offset = previous + keys.dim(2)
        let sinks = extras.sinkTokens
        if sinks > 0 {
            if sink.isEmpty { sink = [keys, values].map { Self.buffer(like: $0, tokens: sinks) } }
            if previous < sinks {
                let m = min(sinks, offset) - previous
                // Copied out first: written as slices of the update, each layer's whole chunk stayed allocated
                // until the forward pass was evaluated (kvrig's host cache measured it; MLX's graph is the same).
                sink[0][.ellipsis, previous ..< (previous + m), 0...] = keys[.ellipsis, ..<m, 0...].contiguous()
                sink[1][.ellipsis, previous ..< (previous + m), 0...] = values[.ellipsis, ..<m, 0...].contiguous()
            }
        }
        let w = extras.recentTokens
        if w > 0 {
            if recent.isEmpty { recent = [keys, values].map { Self.buffer(like: $0, tokens: w) } }
            // Only the last w tokens of this update survive in the ring; write them in at most two runs.
            for (slots, rows) in Self.ringRuns(from: max(previous, offset - w), to: offset, window: w) {
                let source = (rows.lowerBound - previous) ..< (rows.upperBound - previous)
                recent[0][.ellipsis, slots, 0...] = keys[.ellipsis, source, 0...].contiguous()
                recent[1][.ellipsis, slots, 0...] = values[.ellipsis, source, 0...].contiguous()
            }
        }
    }

    private static func buffer(like x: MLXArray, tokens: Int) -> MLXArray {
        MLXArray.zeros([x.dim(0), x.dim(1), tokens, x.dim(3)], dtype: x.dtype)
    }

    /// Positions `from ..< to` of a ring of `window` slots, as (slot range, position range) runs.
    private static func ringRuns(from: Int, to: Int, window: Int) -> [(Range<Int>, Range<Int>)] {
        var runs: [(Range<Int>, Range<Int>)] = []
        var p = from
        while p < to {
            let slot = p % window
            let length = min(to - p, window - slot)
            runs.append((slot ..< (slot + length), p ..< (p + length)))
            p += length
        }
        return runs
    }

    /// Every cached token as attention reads it: dequantized and un-rotated, with the sink and recent tokens
    /// taken from their float copies.
    private func read(keyDType: DType, valueDType: DType) -> (MLXArray, MLXArray) {
        let (k, v) = dequantized(keyDType: keyDType, valueDType: valueDType)
        guard quantizing, !sink.isEmpty || !recent.isEmpty else { return (k, v) }
        let sinkEnd = min(extras.sinkTokens, offset)
        let recentStart = recent.isEmpty ? offset : max(sinkEnd, offset - extras.recentTokens)

        func pieces(_ x: MLXArray, side: Int) -> MLXArray {
            var parts: [MLXArray] = []
            if sinkEnd > 0 { parts.append(sink[side][.ellipsis, ..<sinkEnd, 0...]) }
            if recentStart > sinkEnd { parts.append(x[.ellipsis, sinkEnd ..< recentStart, 0...]) }
            for (slots, _) in Self.ringRuns(from: recentStart, to: offset, window: max(1, extras.recentTokens)) {
                parts.append(recent[side][.ellipsis, slots, 0...])
            }
            return parts.count == 1 ? parts[0] : concatenated(parts, axis: 2)
        }
        return (pieces(k, side: 0), pieces(v, side: 1))
    }

    /// The quantized store's tokens dequantized and un-rotated.
    private func dequantized(keyDType: DType, valueDType: DType) -> (MLXArray, MLXArray) {
        var k = keyStore.read(count: offset, dtype: keyDType)
        var v = valueStore.read(count: offset, dtype: valueDType)
        if quantizing, extras.rotation.rotatesKeys { k = hadamardTransform(k) }
        if quantizing, extras.rotation.rotatesValues { v = hadamardTransform(v) }
        return (k, v)
    }

    var state: [MLXArray] {
        get { keyStore.slices(count: offset) + valueStore.slices(count: offset) }
        set {
            let half = newValue.count / 2
            keyStore.parts = Array(newValue[..<half])
            valueStore.parts = Array(newValue[half...])
            offset = keyStore.capacity
        }
    }

    var metaState: [String] {
        get { [String(offset)] }
        set { offset = newValue.first.flatMap { Int($0) } ?? offset }
    }

    var isTrimmable: Bool { true }

    @discardableResult
    func trim(_ n: Int) -> Int {
        let trimmed = min(offset, n)
        offset -= trimmed
        return trimmed
    }

    /// Same masks as mlx-swift-lm's base cache: none for one token, causal (or an array) otherwise.
    func makeMask(n: Int, windowSize: Int?, returnArray: Bool) -> MLXFast.ScaledDotProductAttentionMaskMode {
        if n == 1 { return .none }
        if returnArray || (windowSize.map { n > $0 } ?? false) {
            return .array(createCausalMask(n: n, offset: offset, windowSize: windowSize))
        }
        return .causal
    }

    func copy() -> any KVCache {
        let new = MixedBitsKVCache(
            keyBits: keyBits, valueBits: valueBits, groupSize: groupSize, quantizedStart: quantizedStart,
            extras: extras)
        new.keyStore = keyStore.copied()
        new.valueStore = valueStore.copied()
        new.sink = sink.map { $0[.ellipsis] }
        new.recent = recent.map { $0[.ellipsis] }
        new.offset = offset
        return new
    }

    /// Drops `count` tokens after the first `keep`; returns how many went. Tokens after them move down by
    /// `count`: the recent ring is rolled to match. Float copies whose position now holds another token (sink
    /// rows past `keep`, ring slots of positions below `keep`) are refilled from the quantized store.
    func evictFront(keep: Int, count: Int) -> Int {
        let n = min(count, max(0, offset - keep))
        guard n > 0 else { return 0 }
        keyStore.dropFront(keep: keep, count: n, offset: offset)
        valueStore.dropFront(keep: keep, count: n, offset: offset)
        offset -= n
        guard !sink.isEmpty || !recent.isEmpty else { return n }
        let (k, v) = dequantized(keyDType: (sink.first ?? recent[0]).dtype, valueDType: (sink.last ?? recent[1]).dtype)
        let sinkEnd = min(extras.sinkTokens, offset)
        if !sink.isEmpty, keep < sinkEnd {
            sink[0][.ellipsis, keep ..< sinkEnd, 0...] = k[.ellipsis, keep ..< sinkEnd, 0...].contiguous()
            sink[1][.ellipsis, keep ..< sinkEnd, 0...] = v[.ellipsis, keep ..< sinkEnd, 0...].contiguous()
        }
        let w = extras.recentTokens
        if !recent.isEmpty {
            let s = n % w
            if s != 0 {
                recent = recent.map { concatenated([$0[.ellipsis, s..., 0...], $0[.ellipsis, ..<s, 0...]], axis: 2) }
            }
            // Positions below `keep` in the window did not move.
            for (slots, rows) in Self.ringRuns(from: max(sinkEnd, offset - w), to: min(keep, offset), window: w) {
                recent[0][.ellipsis, slots, 0...] = k[.ellipsis, rows, 0...].contiguous()
                recent[1][.ellipsis, slots, 0...] = v[.ellipsis, rows, 0...].contiguous()
            }
        }
        return n
    }
}

/// One side (keys or values) of a layer: [wq, scales, biases] when quantized, [raw] otherwise; each array is
/// [batch, heads, capacity, width], grown exactly as mlx-lm's and MLX Swift's caches grow (and so as kvrig's
/// planner counts): on overflow by n tokens, a ragged tail is trimmed to the offset, then ceil(n/256)*256
/// tokens are added.
struct QuantizedStore {
    let bits: Int?
    let groupSize: Int
    var parts: [MLXArray] = []

    var capacity: Int { parts.first?.dim(2) ?? 0 }

    func encode(_ x: MLXArray) -> [MLXArray] {
        guard let bits else { return [x] }
        let q = quantized(x, groupSize: groupSize, bits: bits)
        if let biases = q.biases { return [q.wq, q.scales, biases] }
        return [q.wq, q.scales]
    }

    func decode(_ p: [MLXArray], dtype: DType) -> MLXArray {
        guard let bits else { return p[0] }
        return dequantized(
            p[0], scales: p[1], biases: p.count > 2 ? p[2] : nil, groupSize: groupSize, bits: bits, dtype: dtype)
    }

    mutating func append(_ x: MLXArray, at offset: Int) {
        let step = MixedBitsKVCache.step
        let n = x.dim(2)
        let encoded = encode(x)
        if parts.isEmpty || offset + n > capacity {
            let grow = (n + step - 1) / step * step
            let fresh = encoded.map { MLXArray.zeros([$0.dim(0), $0.dim(1), grow, $0.dim(3)], dtype: $0.dtype) }
            if parts.isEmpty {
                parts = fresh
            } else {
                let kept = offset % step != 0 ? parts.map { $0[.ellipsis, ..<offset, 0...] } : parts
                parts = zip(kept, fresh).map { concatenated([$0, $1], axis: 2) }
            }
        }
        for i in parts.indices {
            parts[i][.ellipsis, offset ..< (offset + n), 0...] = encoded[i]
        }
    }

    func slices(count: Int) -> [MLXArray] {
        parts.map { $0[.ellipsis, ..<count, 0...] }
    }

    func read(count: Int, dtype: DType) -> MLXArray {
        decode(slices(count: count), dtype: dtype)
    }

    /// The whole buffer re-encoded at `newBits`, capacity kept (as mlx-lm's `to_quantized` keeps it).
    func requantized(bits newBits: Int?, dtype: DType) -> QuantizedStore {
        var store = QuantizedStore(bits: newBits, groupSize: groupSize)
        store.parts = store.encode(read(count: capacity, dtype: dtype))
        return store
    }

    mutating func dropFront(keep: Int, count: Int, offset: Int) {
        parts = parts.map {
            concatenated([$0[.ellipsis, ..<keep, 0...], $0[.ellipsis, (keep + count) ..< offset, 0...]], axis: 2)
        }
    }

    func copied() -> QuantizedStore {
        var store = QuantizedStore(bits: bits, groupSize: groupSize)
        store.parts = parts.map { $0[.ellipsis] }
        return store
    }
}
