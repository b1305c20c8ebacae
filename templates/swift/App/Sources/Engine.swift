import Foundation
import KvrigCore
import MLX
import MLXLLM
import MLXLMCommon
import Observation

struct ChatMessage: Identifiable, Equatable {
    enum Role { case user, assistant }
    let id = UUID()
    let role: Role
    var text: String
}

struct LiveMetrics: Equatable {
    var decodeTps: Double?
    var footprintBytes = 0
    var availableBytes: Int?
    var contextTokens = 0
    var kvBytes = 0
}

/// Loads the pushed bundle, applies kvcache.json (caches, MLX limits, pressure policy), runs chat turns and
/// soak plans, and writes telemetry.
@MainActor
@Observable
final class Engine {
    var messages: [ChatMessage] = []
    var metrics = LiveMetrics()
    var status = "Starting…"
    var isReady = false
    var isGenerating = false

    @ObservationIgnored private var container: ModelContainer?
    @ObservationIgnored private var config: KVCacheConfig?
    @ObservationIgnored private var caches: CacheSet?
    @ObservationIgnored private var telemetry: TelemetryLog?
    @ObservationIgnored private var pressure: PressureMonitor?
    @ObservationIgnored private var decider: PressureDecider?
    @ObservationIgnored private var metricsTimer: Timer?

    static var documents: URL {
        FileManager.default.urls(for: .documentDirectory, in: .userDomainMask)[0]
    }

    func start(arguments: [String]) async {
        let bundleURL = Self.documents.appendingPathComponent(AppConfig.bundleFolder, isDirectory: true)
        do {
            let config = try ContractJSON.load(
                KVCacheConfig.self, from: bundleURL.appendingPathComponent("kvcache.json"))
            self.config = config
            var plan: SoakPlan?
            if let planURL = SoakPlan.planURL(arguments: arguments, base: Self.documents) {
                plan = try ContractJSON.load(SoakPlan.self, from: planURL)
            }
            let runId = plan?.runId ?? "chat-\(Int(Date().timeIntervalSince1970))"
            let telemetryURL =
                plan?.telemetryURL(base: Self.documents) ?? Self.documents.appendingPathComponent("telemetry.jsonl")
            telemetry = try TelemetryLog(runId: runId, url: telemetryURL) { line in
                Log.telemetry.log("\(line, privacy: .public)")
            }
            decider = PressureDecider(config: config, onCritical: plan?.onCritical ?? .stopAndSave)
            let believedLimit = configureMemory(config)
            pressure = PressureMonitor { [weak self] level in
                MainActor.assumeIsolated { self?.onPressure(level) }
            }

            status = "Loading \(AppConfig.bundleFolder)…"
            let container = try await LLMModelFactory.shared.loadContainer(
                from: bundleURL, using: TransformersTokenizerLoader())
            self.container = container
            try telemetry?.record(
                .start(
                    model: AppConfig.bundleFolder, scheme: config.scheme, productType: DeviceMemory.productType(),
                    osVersion: DeviceMemory.osVersion(), limitBytes: believedLimit, converted: []))
            await newChat()
            isReady = true
            status = "Ready: \(AppConfig.modelType), KV \(config.scheme)"
            startMetricsTimer()
            if let plan {
                await runSoak(plan)
            }
        } catch {
            status = "Error: \(error)"
            Log.app.error("start failed: \(String(describing: error), privacy: .public)")
        }
    }

    /// Caps MLX's buffer cache and sets its memory limit below what jetsam allows, so an allocation past it
    /// fails inside the app (which stops and saves) instead of the process being killed. Returns the app's
    /// memory limit as the device reports it (footprint + available), for the start event.
    private func configureMemory(_ config: KVCacheConfig) -> Int? {
        Memory.cacheLimit = config.bufferCacheLimitBytes
        let footprint = DeviceMemory.footprint()
        let available = DeviceMemory.available()
        let limit = Budget.mlxMemoryLimit(
            configured: config.memoryLimitBytes, footprint: footprint, available: available,
            headroom: AppConfig.mlxHeadroomBytes, mlxActive: Memory.activeMemory)
        if limit > 0 {
            Memory.memoryLimit = limit
        }
        Log.app.notice(
            "MLX cache limit \(config.bufferCacheLimitBytes) B, memory limit \(limit) B, available \(available ?? -1) B")
        return available.map { footprint + $0 }
    }

    func newChat() async {
        guard let container, let config else { return }
        messages = []
        caches = await container.perform { context in
            CacheSet(model: context.model, config: config)
        }
        Memory.clearCache()
        refreshMetrics()
    }

    func stop() {
        caches?.requestStop()
    }

    func send(_ prompt: String) async {
        guard let container, let caches, !prompt.isEmpty else { return }
        messages.append(ChatMessage(role: .user, text: prompt))
        messages.append(ChatMessage(role: .assistant, text: ""))
        let index = messages.count - 1
        isGenerating = true
        caches.clearStop()
        let telemetry = self.telemetry
        do {
            let rate = try await container.perform { context in
                let tokens = try context.tokenizer.applyChatTemplate(messages: [["role": "user", "content": prompt]])
                var loop = TokenLoop(context: context, caches: caches)
                loop.betweenSteps = { Self.afterStep(caches: caches, telemetry: telemetry) }
                var prefill = TokenLoop.Timing()
                var decode = TokenLoop.Timing()
                guard let logits = try loop.prefill(tokens, timing: &prefill) else { return nil as Double? }
                var detokenizer = NaiveStreamingDetokenizer(tokenizer: context.tokenizer)
                _ = try loop.decode(from: logits, count: 2048, timing: &decode) { id in
                    detokenizer.append(token: id)
                    if let piece = detokenizer.next() {
                        Task { @MainActor in self.append(piece, to: index) }
                    }
                    return true
                }
                return decode.rate
            }
            metrics.decodeTps = rate
        } catch {
            status = "Generation failed: \(error)"
            Log.app.error("generation failed: \(String(describing: error), privacy: .public)")
        }
        isGenerating = false
        refreshMetrics()
    }

    private func append(_ piece: String, to index: Int) {
        guard messages.indices.contains(index) else { return }
        messages[index].text += piece
    }

    /// On the generation thread, after every forward pass: pending evictions, then the metrics snapshot.
    nonisolated private static func afterStep(caches: CacheSet, telemetry: TelemetryLog?) {
        let dropped = caches.applyPendingEviction()
        if dropped > 0 {
            Memory.clearCache()
            try? telemetry?.record(
                .evict(tokensEvicted: dropped, contextTokens: caches.contextTokens, kvBytes: caches.kvBytes))
        }
        caches.recordSnapshot()
    }

    private func onPressure(_ level: PressureLevel) {
        let contextTokens = caches?.snapshot.contextTokens ?? 0
        try? telemetry?.record(
            .memoryPressure(level: level, contextTokens: contextTokens, physFootprintBytes: DeviceMemory.footprint()))
        Log.app.notice("memory pressure \(level.rawValue, privacy: .public) at \(contextTokens) tokens")
        guard let decider, let caches else { return }
        switch decider.respond(to: level, contextTokens: contextTokens) {
        case .nothing:
            break
        case .evict(let tokens):
            caches.requestEviction(tokens: tokens)
            if !isGenerating {
                Self.afterStep(caches: caches, telemetry: telemetry)
            }
        case .stopAndSave:
            caches.requestStop()
            if !isGenerating {
                save(reason: .memoryCritical, runId: telemetry?.runId ?? "chat", contextTokens: contextTokens)
            }
        }
        refreshMetrics()
    }

    private func save(reason: EndReason, runId: String, contextTokens: Int) {
        let checkpoint = SoakCheckpoint(
            runId: runId, contextTokens: contextTokens, reason: reason, t: Date().timeIntervalSince1970)
        let url = ContainerPath.resolve("checkpoint.json", in: Self.documents)
        if let url {
            do {
                try checkpoint.write(to: url)
            } catch {
                Log.app.error("checkpoint not written: \(String(describing: error), privacy: .public)")
            }
        }
    }

    func runSoak(_ plan: SoakPlan) async {
        guard let container, let caches, let telemetry else { return }
        status = "Soak \(plan.runId)…"
        isGenerating = true
        caches.clearStop()
        let began = Date()
        let outcome: (reason: EndReason, message: String?) = await container.perform { context in
            var loop = TokenLoop(context: context, caches: caches)
            loop.betweenSteps = { Self.afterStep(caches: caches, telemetry: telemetry) }
            let textTokens = context.tokenizer.encode(text: plan.text, addSpecialTokens: false)
            guard !textTokens.isEmpty else { return (.error, "the soak text encodes to no tokens") }
            var cursor = 0
            var logits: MLXArray?
            do {
                for target in plan.schedule.targets {
                    var prefill = TokenLoop.Timing()
                    let needed = target - caches.contextTokens
                    if needed > 0 {
                        var feed: [Int] = []
                        feed.reserveCapacity(needed)
                        for _ in 0 ..< needed {
                            feed.append(textTokens[cursor % textTokens.count])
                            cursor += 1
                        }
                        logits = try loop.prefill(feed, timing: &prefill) ?? logits
                    }
                    if caches.isStopRequested {
                        return (.memoryCritical, "critical memory pressure at \(caches.contextTokens) tokens")
                    }
                    var decode = TokenLoop.Timing()
                    if let current = logits {
                        logits = try loop.decode(
                            from: current, count: plan.schedule.decodeTokens, timing: &decode) { _ in true }
                    }
                    let footprint = DeviceMemory.footprint()
                    let memory = Memory.snapshot()
                    try telemetry.record(
                        .step(
                            StepMetrics(
                                contextTokens: caches.contextTokens, decodeTps: decode.rate,
                                prefillTps: prefill.rate, physFootprintBytes: footprint,
                                availableBytes: DeviceMemory.available(), mlxActiveBytes: memory.activeMemory,
                                mlxCacheBytes: memory.cacheMemory, mlxPeakBytes: memory.peakMemory,
                                kvBytes: caches.kvBytes, thermalState: DeviceMemory.thermalState())))
                    if let why = plan.stop.check(
                        decodeTps: decode.rate, footprint: footprint, elapsed: Date().timeIntervalSince(began))
                    {
                        return (.stopCondition, why)
                    }
                    if caches.isStopRequested {
                        return (.memoryCritical, "critical memory pressure at \(caches.contextTokens) tokens")
                    }
                }
                return (.completed, nil)
            } catch {
                let text = String(describing: error)
                let lowered = text.lowercased()
                let allocation = lowered.contains("alloc") || lowered.contains("memory")
                return (allocation ? .allocationFailed : .error, text)
            }
        }
        let contextTokens = caches.snapshot.contextTokens
        if outcome.reason == .memoryCritical || outcome.reason == .allocationFailed {
            save(reason: outcome.reason, runId: plan.runId, contextTokens: contextTokens)
        }
        try? telemetry.record(.end(reason: outcome.reason, contextTokens: contextTokens, message: outcome.message))
        isGenerating = false
        status = "Soak \(plan.runId): \(outcome.reason.rawValue)"
        refreshMetrics()
    }

    private func startMetricsTimer() {
        metricsTimer = Timer.scheduledTimer(withTimeInterval: 1, repeats: true) { [weak self] _ in
            MainActor.assumeIsolated { self?.refreshMetrics() }
        }
    }

    private func refreshMetrics() {
        let snapshot = caches?.snapshot ?? (contextTokens: 0, kvBytes: 0)
        metrics.footprintBytes = DeviceMemory.footprint()
        metrics.availableBytes = DeviceMemory.available()
        metrics.contextTokens = snapshot.contextTokens
        metrics.kvBytes = snapshot.kvBytes
    }
}
