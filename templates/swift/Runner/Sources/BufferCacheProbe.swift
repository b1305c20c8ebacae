import Foundation
import MLX

/// What this build's MLX allocator keeps in its buffer cache once arrays are freed, with the cache capped at
/// `limit`: the buffer-cache term a plan for this host must count (`kvrig demo` asks before planning the
/// virtual iPhone). Metal's allocator keeps freed buffers up to the cap; MLX 0.31's CPU allocator keeps none.
enum BufferCacheProbe {
    static func run(limit: Int) -> [String: Int] {
        Memory.cacheLimit = limit
        Memory.clearCache()
        let freed = allocateAndFree(bytes: 2 * limit)
        return ["cache_limit_bytes": limit, "freed_bytes": freed, "cache_bytes": Memory.cacheMemory]
    }

    /// Evaluates 64 float32 arrays of `bytes` in all (twice the cap, in pieces, as a forward pass frees many)
    /// and drops them.
    private static func allocateAndFree(bytes: Int) -> Int {
        let count = max(1, bytes / 4 / 64)
        var arrays: [MLXArray] = []
        for i in 0 ..< 64 {
            arrays.append(MLXArray.ones([count], type: Float.self) * Float(i + 1))
        }
        eval(arrays)
        let freed = arrays.reduce(0) { $0 + $1.nbytes }
        arrays.removeAll()
        return freed
    }
}
