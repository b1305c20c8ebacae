import Foundation
import MLX
import MLXLMCommon

/// A KV cache whose keys and values are quantized at rest with their own bit widths (MLX's QuantizedKVCache
/// and quantized attention take one width for both), dequantized when attention reads them. The dequantized
/// copy of one layer is transient: the planner counts it. nil bits keep that side in the activation dtype.
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
    static let step = 256

    init(keyBits: Int?, valueBits: Int?, groupSize: Int, quantizedStart: Int) {
        self.keyBits = keyBits
        self.valueBits = valueBits
        self.groupSize = groupSize
        self.quantizedStart = quantizedStart
        // Below quantized_kv_start both sides stay in the activation dtype, as MLX's own cache does.
        let quantizeNow = quantizedStart == 0
        keyStore = QuantizedStore(bits: quantizeNow ? keyBits : nil, groupSize: groupSize)
        valueStore = QuantizedStore(bits: quantizeNow ? valueBits : nil, groupSize: groupSize)
    }

    var maxSize: Int? { nil }

    func innerState() -> [MLXArray] { keyStore.parts + valueStore.parts }

    func update(keys: MLXArray, values: MLXArray) -> (MLXArray, MLXArray) {
        let previous = offset
        keyStore.append(keys, at: previous)
        valueStore.append(values, at: previous)
        offset = previous + keys.dim(2)
        if offset > quantizedStart, keyStore.bits != keyBits || valueStore.bits != valueBits {
            keyStore = keyStore.requantized(bits: keyBits, dtype: keys.dtype)
            valueStore = valueStore.requantized(bits: valueBits, dtype: values.dtype)
        }
        return (keyStore.read(count: offset, dtype: keys.dtype), valueStore.read(count: offset, dtype: values.dtype))
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
            keyBits: keyBits, valueBits: valueBits, groupSize: groupSize, quantizedStart: quantizedStart)
        new.keyStore = keyStore.copied()
        new.valueStore = valueStore.copied()
        new.offset = offset
        return new
    }

    /// Drops `count` tokens after the first `keep`; returns how many went.
    func evictFront(keep: Int, count: Int) -> Int {
        let n = min(count, max(0, offset - keep))
        guard n > 0 else { return 0 }
        keyStore.dropFront(keep: keep, count: n, offset: offset)
        valueStore.dropFront(keep: keep, count: n, offset: offset)
        offset -= n
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
