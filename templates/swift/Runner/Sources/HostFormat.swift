import Foundation
import MLX
import MLXLMCommon
import MLXNN

/// What only a host does to run the engine at a usable speed, and how its numbers become the phone's.
/// MLX on an x86 CPU emulates float16 arithmetic, and its quantized matmul is a plain loop (with the MLX core
/// built in debug, SmolLM2-135M decodes well under 1 tok/s), so a host keeps a float32 copy of the weights:
/// quantized layers dequantized with their scales and biases in float32 (float16 arithmetic would be
/// emulated), then every floating parameter cast to float32, so matmuls go to the system BLAS (OpenBLAS). Activations and KV
/// buffers are then float32 too. kvrig's Python host runtime computes in float32 the same way (it dequantizes
/// per call instead of once), and counts the same way: weights as stored in the bundle, float32 buffers at
/// the phone's element size. The phone never builds one of these.
struct HostFormat: Sendable {
    /// Telemetry fields that carry the phone's format rather than the host's (the start event lists them).
    static let convertedFields = ["kv_bytes", "mlx_active_bytes", "mlx_peak_bytes"]
    static let hostElementBytes = 4

    let phoneElementBytes: Int
    let hostWeightBytes: Int
    let phoneWeightBytes: Int

    /// Converts `model` in place; `bundle` holds the weights as stored.
    static func convert(_ model: Module, bundle: URL, phoneDType: String) throws -> HostFormat {
        let dequantized = model.leafModules().flattened().compactMap { path, module -> (String, Module)? in
            if let q = module as? QuantizedLinear {
                let w = MLX.dequantized(
                    q.weight, scales: q.scales.asType(.float32), biases: q.biases?.asType(.float32),
                    groupSize: q.groupSize, bits: q.bits, mode: q.mode)
                return (path, Linear(weight: w, bias: q.bias))
            }
            if let q = module as? QuantizedEmbedding {
                let w = MLX.dequantized(
                    q.weight, scales: q.scales.asType(.float32), biases: q.biases?.asType(.float32),
                    groupSize: q.groupSize, bits: q.bits, mode: q.mode)
                return (path, Embedding(weight: w))
            }
            return nil
        }
        model.update(modules: ModuleChildren.unflattened(dequantized))
        let converted = model.parameters().flattened().map { name, array in
            (name, array.dtype.isFloatingPoint && array.dtype != .float32 ? array.asType(.float32) : array)
        }
        model.update(parameters: ModuleParameters.unflattened(converted))
        let parameters = model.parameters().flattenedValues()
        eval(parameters)
        return HostFormat(
            phoneElementBytes: phoneDType == "float32" ? 4 : 2,
            hostWeightBytes: parameters.reduce(0) { $0 + $1.nbytes },
            phoneWeightBytes: try storedWeightBytes(bundle))
    }

    /// Phone minus host bytes for `hostBytes` of MLX memory holding the weights, the KV buffers and float32
    /// activations (the rest), each at the phone's element size.
    func delta(hostBytes: Int, hostKV: Int, phoneKV: Int) -> Int {
        let hostActivations = max(0, hostBytes - hostWeightBytes - hostKV)
        let phoneActivations = hostActivations * phoneElementBytes / Self.hostElementBytes
        return (phoneWeightBytes - hostWeightBytes) + (phoneKV - hostKV) + (phoneActivations - hostActivations)
    }

    /// Bytes of every tensor in the bundle's safetensors files, read from their headers (no data loaded).
    static func storedWeightBytes(_ bundle: URL) throws -> Int {
        try SafetensorsFile.files(in: bundle).map { try SafetensorsFile(url: $0).byteCount }.reduce(0, +)
    }
}

