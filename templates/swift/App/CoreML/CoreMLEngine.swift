// Rendered only with `kvrig app --coreml Model.mlpackage`; Linux builds of the engine compile it to nothing.
#if canImport(CoreML)
import CoreML
import Foundation
import KvrigCore

enum CoreMLEngineError: Error {
    case missingModel
    case contextFull(position: Int, tokens: Int, context: Int)
    case noLogits
}

/// The Core ML backend: the stateful program from `kvrig export coreml`, shipped as KvrigModel.mlpackage.
/// One function with a dynamic token count: prefill passes the prompt (or chunks of it), decode one token;
/// the KV cache lives in the model's MLState, [1, kv_heads, context, head_dim] fp16 per layer.
@available(iOS 18.0, macOS 15.0, *)
final class CoreMLEngine {
    let model: MLModel
    let context: Int
    private(set) var state: MLState
    private(set) var position = 0

    init(computeUnits: MLComputeUnits = .cpuAndGPU) throws {
        guard let url = Bundle.main.url(forResource: "KvrigModel", withExtension: "mlmodelc") else {
            throw CoreMLEngineError.missingModel
        }
        let configuration = MLModelConfiguration()
        configuration.computeUnits = computeUnits
        model = try MLModel(contentsOf: url, configuration: configuration)
        state = model.makeState()
        // The export writes the state's length into the metadata; the state's shape says the same.
        let metadata = model.modelDescription.metadata[.creatorDefinedKey] as? [String: String]
        context = Int(metadata?["kvrig.context"] ?? "") ?? 0
    }

    /// Forgets the conversation: a fresh, zeroed state.
    func reset() {
        state = model.makeState()
        position = 0
    }

    /// Runs `tokens` at the current position and returns the last token's logits ([1, vocab], fp16).
    func forward(_ tokens: [Int32]) throws -> MLMultiArray {
        guard !tokens.isEmpty, position + tokens.count <= context else {
            throw CoreMLEngineError.contextFull(position: position, tokens: tokens.count, context: context)
        }
        let ids = try MLMultiArray(shape: [1, NSNumber(value: tokens.count)], dataType: .int32)
        for (i, token) in tokens.enumerated() { ids[i] = NSNumber(value: token) }
        let start = try MLMultiArray(shape: [1], dataType: .int32)
        start[0] = NSNumber(value: position)
        let inputs = try MLDictionaryFeatureProvider(dictionary: ["input_ids": ids, "position": start])
        let output = try model.prediction(from: inputs, using: state)
        position += tokens.count
        guard let logits = output.featureValue(for: "logits")?.multiArrayValue else { throw CoreMLEngineError.noLogits }
        return logits
    }

    /// Greedy next token from a logits array.
    static func argmax(_ logits: MLMultiArray) -> Int32 {
        var best = 0
        var bestValue = -Float.infinity
        for i in 0 ..< logits.count where logits[i].floatValue > bestValue {
            best = i
            bestValue = logits[i].floatValue
        }
        return Int32(best)
    }

    /// The telemetry `start` record for a run on this backend (telemetry schema 2).
    func recordStart(_ log: TelemetryLog, model name: String, limitBytes: Int?) throws {
        try log.record(
            .start(
                model: name, scheme: "fp16", productType: DeviceMemory.productType(),
                osVersion: DeviceMemory.osVersion(), limitBytes: limitBytes, converted: [], backend: .coreml))
    }
}
#endif
