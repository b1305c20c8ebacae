import Foundation
import KvrigCore
import MLX
import MLXLMCommon

/// Prefill and decode written against the model and our CacheSet directly (not TokenIterator), so the caches
/// the pressure handler evicts from are the ones the model reads, and MLX errors surface as Swift errors.
struct TokenLoop {
    let context: ModelContext
    let caches: CacheSet
    /// Runs after every forward pass, on the generation thread: where pending evictions are applied.
    var betweenSteps: () -> Void = {}
    /// Hears each scene change the loop acts on (GPUGate): the scene, the phase it met, what the GPU work did.
    var onScene: (SceneState, GPUPhase, SceneGPU) -> Void = { _, _, _ in }

    struct Timing {
        var tokens = 0
        var seconds = 0.0
        var rate: Double? { seconds > 0 ? Double(tokens) / seconds : nil }
    }

    /// Feeds `tokens` and returns the logits after the last one. As mlx-lm's generate_step: all but the last
    /// token in prefill steps that evaluate only the caches, then the last token alone, so a chunk's logits
    /// (chunk × vocabulary, 25 MB for SmolLM2 at 256 tokens in float16) are never materialized or kept.
    func prefill(_ tokens: [Int], timing: inout Timing) throws -> MLXArray? {
        guard let lastToken = tokens.last else { return nil }
        let stepSize = max(1, caches.parameters.prefillStepSize)
        let body = tokens.count - 1
        var start = 0
        while start < body {
            if caches.isStopRequested || !admitted(.prefill) { return nil }
            let chunk = Array(tokens[start ..< min(start + stepSize, body)])
            let began = Date()
            try fill(chunk)
            timing.tokens += chunk.count
            timing.seconds += Date().timeIntervalSince(began)
            start += chunk.count
        }
        if caches.isStopRequested || !admitted(.prefill) { return nil }
        let began = Date()
        let logits = try forward([lastToken])
        timing.tokens += 1
        timing.seconds += Date().timeIntervalSince(began)
        return logits
    }

    /// Generates up to `count` tokens after `logits`, stopping at end of sequence; `onToken` sees each one.
    func decode(
        from logits: MLXArray, count: Int, timing: inout Timing, onToken: (Int) -> Bool
    ) throws -> MLXArray {
        let sampler = caches.parameters.sampler()
        let stop = Self.stopTokenIds(context)
        let unknown = context.tokenizer.unknownTokenId
        var logits = logits
        for _ in 0 ..< count {
            // Sampling evaluates on the GPU too: the gate comes before it.
            if caches.isStopRequested || !admitted(.decode) { break }
            let began = Date()
            // Inside withError as every evaluation here: an MLX error (an allocation refused) is the soak's end, not
            // MLX's default handler's fatalError.
            let id = try withError { sampler.sample(logits: logits).item(Int.self) }
            if stop.contains(id) || id == unknown || !onToken(id) { break }
            logits = try forward([id])
            timing.tokens += 1
            timing.seconds += Date().timeIntervalSince(began)
        }
        return logits
    }

    /// Every id that ends a reply, as MLXLMCommon's own generate loop stops (Evaluate.swift, mlx-swift-lm 3.31):
    /// config.json's and generation_config.json's eos_token_id (Gemma's <end_of_turn>, Llama 3's <|eot_id|> are
    /// only there), the tokenizer's end token, and the configuration's extra end tokens.
    static func stopTokenIds(_ context: ModelContext) -> Set<Int> {
        var ids = context.configuration.eosTokenIds
        if let eos = context.tokenizer.eosTokenId {
            ids.insert(eos)
        }
        for token in context.configuration.extraEOSTokens {
            if let id = context.tokenizer.convertTokenToId(token) {
                ids.insert(id)
            }
        }
        return ids
    }

    /// Asks GPUGate before GPU work is submitted; false (and the loop stops) when the run is to end because its
    /// continued-processing task ended while the app is in the background.
    private func admitted(_ phase: GPUPhase) -> Bool {
        let verdict = GPUGate.shared.admit(phase) { state, gpu in onScene(state, phase, gpu) }
        if verdict == .end {
            caches.requestStop()
            return false
        }
        return true
    }

    /// One forward pass of a prefill chunk that evaluates the caches only (the logits stay unevaluated).
    private func fill(_ ids: [Int]) throws {
        try withError {
            let text = LMInput.Text(tokens: MLXArray(ids.map { Int32($0) }))
            _ = context.model(text[text: .newAxis], cache: caches.caches, state: nil)
            eval(caches.caches)
            caches.quantizeIfDue()
            betweenSteps()
        }
    }

    /// One forward pass; returns the last position's logits, evaluated. An allocation Metal refuses (a buffer past
    /// its maximum length, or none left to give) throws here; MLX's memory limit only makes it wait and free its
    /// cache first, so jetsam, not an error, ends a context that outgrows the phone.
    private func forward(_ ids: [Int]) throws -> MLXArray {
        try withError {
            let text = LMInput.Text(tokens: MLXArray(ids.map { Int32($0) }))
            let output = context.model(text[text: .newAxis], cache: caches.caches, state: nil)
            let logits = output.logits[0..., -1, 0...]
            eval(logits)
            caches.quantizeIfDue()
            betweenSteps()
            return logits
        }
    }
}
