import Foundation
import KvrigCore
import MLX
import MLXLMCommon

/// Attention through the app's own KV cache on given inputs, so the host can compare it with its Python
/// cache (tests/appgen/test_engine_attention.py): kvrig's cache for kvcache.json's bits and extras, fed
/// `keys`/`values` in the update sizes `chunks`, each update's `queries` attending as the app's models attend
/// (mlx-swift-lm's `attentionWithCacheUpdate`, with the mask the cache makes before the update).
///
/// Input safetensors: queries [1, Hq, T, D], keys and values [1, Hkv, T, D] (float32), chunks [n] (int32,
/// summing to T), scale [1]. Output safetensors: `output` [1, Hq, T, D].
enum AttentionProbe {
    struct InputError: Error, CustomStringConvertible {
        let description: String
    }

    static func run(config: URL, input: URL, output: URL) throws {
        let kv = try ContractJSON.load(KVCacheConfig.self, from: config)
        let arrays = try loadArrays(url: input)
        func array(_ name: String) throws -> MLXArray {
            guard let a = arrays[name] else { throw InputError(description: "\(input.path): no array '\(name)'") }
            return a
        }
        let (queries, keys, values) = (try array("queries"), try array("keys"), try array("values"))
        let chunks = try array("chunks").asArray(Int32.self).map(Int.init)
        let scale = try array("scale").asArray(Float.self)[0]
        guard chunks.reduce(0, +) == keys.dim(2) else {
            throw InputError(description: "\(input.path): chunks sum to \(chunks.reduce(0, +)), not \(keys.dim(2))")
        }
        let cache = MixedBitsKVCache(
            keyBits: kv.keyBits, valueBits: kv.valueBits, groupSize: kv.groupSize, quantizedStart: 0,
            extras: KVExtras(rotation: kv.rotation, sinkTokens: kv.sinkTokens, recentTokens: kv.recentTokens))
        var outputs: [MLXArray] = []
        var start = 0
        for n in chunks {
            let rows = start ..< (start + n)
            let mask = cache.makeMask(n: n, windowSize: nil, returnArray: false)
            let out = attentionWithCacheUpdate(
                queries: queries[.ellipsis, rows, 0...], keys: keys[.ellipsis, rows, 0...],
                values: values[.ellipsis, rows, 0...], cache: cache, scale: scale, mask: mask)
            eval(out)
            outputs.append(out)
            start += n
        }
        try save(arrays: ["output": concatenated(outputs, axis: 2)], url: output)
    }
}
