// Rendered only with `kvrig app --coreml`; compiled only where Core ML exists (Engine calls it under
// KVRIG_COREML, which project.yml sets for such apps). Linux builds of the engine never see this file.
#if canImport(CoreML)
import CoreML
import Foundation
import KvrigCore
import MLXLMCommon

/// Runs soak plans and chat turns on the Core ML program (CoreMLEngine): the same schedule, stop conditions
/// and step records as the MLX soak, so a lab compares the two backends on one phone.
@available(iOS 18.0, macOS 15.0, *)
final class CoreMLRunner: AlternateBackend, @unchecked Sendable {
    // One generation at a time (the Engine runs soak and chat on one detached task); the lock guards the
    // fields the UI and the pressure handler read from the main thread.
    private let engine: CoreMLEngine
    private let lock = NSLock()
    private var stopRequested = false
    private var lastContext = 0
    /// Prompt tokens per forward pass, as MLX's prefill step: bounds the activations of one call.
    let prefillChunk = 512
    let stateBytes: Int

    init() throws {
        let engine = try CoreMLEngine()
        self.engine = engine
        // The state buffers' own shapes and types (fp16 K and V per layer), as loaded.
        stateBytes = engine.model.modelDescription.stateDescriptionsByName.values.reduce(0) { total, description in
            guard let constraint = description.stateConstraint else { return total }
            let elements = constraint.bufferShape.reduce(1) { $0 * $1.intValue }
            return total + elements * (constraint.dataType == .float16 ? 2 : 4)
        }
    }

    var contextTokens: Int {
        lock.lock()
        defer { lock.unlock() }
        return lastContext
    }

    private var isStopRequested: Bool {
        lock.lock()
        defer { lock.unlock() }
        return stopRequested
    }

    func requestStop() {
        lock.lock()
        stopRequested = true
        lock.unlock()
    }

    func reset() {
        engine.reset()
        lock.lock()
        stopRequested = false
        lastContext = 0
        lock.unlock()
    }

    func recordStart(_ log: TelemetryLog, model: String, limitBytes: Int?) throws {
        try engine.recordStart(log, model: model, limitBytes: limitBytes)
    }

    private func forward(_ tokens: [Int]) throws -> MLMultiArray {
        let logits = try engine.forward(tokens.map { Int32($0) })
        lock.lock()
        lastContext = engine.position
        lock.unlock()
        return logits
    }

    /// Prompt tokens in chunks; returns the last chunk's logits and the seconds spent.
    private func prefill(_ tokens: [Int]) throws -> (logits: MLMultiArray?, seconds: Double) {
        var logits: MLMultiArray?
        var seconds = 0.0
        var start = 0
        while start < tokens.count, !isStopRequested {
            let chunk = Array(tokens[start ..< min(start + prefillChunk, tokens.count)])
            let began = Date()
            logits = try forward(chunk)
            seconds += Date().timeIntervalSince(began)
            start += chunk.count
        }
        return (logits, seconds)
    }

    /// Greedy decode of up to `count` tokens (the state must have room); returns the tokens made and seconds.
    private func decode(
        from logits: MLMultiArray, count: Int, stop: Set<Int>, onToken: (Int) -> Void
    ) throws -> (tokens: Int, seconds: Double, logits: MLMultiArray) {
        var logits = logits
        var made = 0
        var seconds = 0.0
        while made < count, engine.position < engine.context, !isStopRequested {
            let began = Date()
            let id = Int(CoreMLEngine.argmax(logits))
            if stop.contains(id) { break }
            onToken(id)
            logits = try forward([id])
            made += 1
            seconds += Date().timeIntervalSince(began)
        }
        return (made, seconds, logits)
    }

    private static func rate(_ tokens: Int, _ seconds: Double) -> Double? {
        seconds > 0 ? Double(tokens) / seconds : nil
    }

    private func step(prefill: (Int, Double), decode: (Int, Double)) -> StepMetrics {
        StepMetrics(
            contextTokens: engine.position, decodeTps: Self.rate(decode.0, decode.1),
            prefillTps: Self.rate(prefill.0, prefill.1), physFootprintBytes: DeviceMemory.footprint(),
            availableBytes: DeviceMemory.available(), kvBytes: stateBytes, thermalState: DeviceMemory.thermalState(),
            backend: .coreml)
    }

    func soak(_ plan: SoakPlan, tokenizer: any MLXLMCommon.Tokenizer, telemetry: TelemetryLog) -> (
        reason: EndReason, message: String?
    ) {
        reset()
        let text = tokenizer.encode(text: plan.text, addSpecialTokens: false)
        guard !text.isEmpty else { return (.error, "the soak text encodes to no tokens") }
        let began = Date()
        var cursor = 0
        var logits: MLMultiArray?
        do {
            for target in plan.schedule.targets {
                // The state was sized at export (`kvrig export coreml --context`): the soak cannot grow past it.
                guard target + plan.schedule.decodeTokens <= engine.context else {
                    return (
                        .stopCondition,
                        "the Core ML state holds \(engine.context) tokens; the next step needs "
                            + "\(target + plan.schedule.decodeTokens) (export with a larger --context)"
                    )
                }
                var feed: [Int] = []
                while engine.position + feed.count < target {
                    feed.append(text[cursor % text.count])
                    cursor += 1
                }
                let prefilled = try prefill(feed)
                logits = prefilled.logits ?? logits
                if isStopRequested {
                    return (.memoryCritical, "critical memory pressure at \(engine.position) tokens")
                }
                var decoded = (tokens: 0, seconds: 0.0)
                if let current = logits {
                    let result = try decode(from: current, count: plan.schedule.decodeTokens, stop: []) { _ in }
                    decoded = (result.tokens, result.seconds)
                    logits = result.logits
                }
                let metrics = step(prefill: (feed.count, prefilled.seconds), decode: decoded)
                try telemetry.record(.step(metrics))
                if let why = plan.stop.check(
                    decodeTps: metrics.decodeTps, footprint: metrics.physFootprintBytes,
                    elapsed: Date().timeIntervalSince(began))
                {
                    return (.stopCondition, why)
                }
                if isStopRequested {
                    return (.memoryCritical, "critical memory pressure at \(engine.position) tokens")
                }
            }
            return (.completed, nil)
        } catch {
            return (.error, String(describing: error))
        }
    }

    func reply(to tokens: [Int], maxTokens: Int, stop: Set<Int>, onToken: (Int) -> Void) throws -> StepMetrics {
        lock.lock()
        stopRequested = false
        lock.unlock()
        let prefilled = try prefill(tokens)
        guard let logits = prefilled.logits else { throw CoreMLEngineError.noLogits }
        let decoded = try decode(from: logits, count: maxTokens, stop: stop, onToken: onToken)
        return step(prefill: (tokens.count, prefilled.seconds), decode: (decoded.tokens, decoded.seconds))
    }
}
#endif
