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

/// Loads the pushed bundle (its weights mapped from the file when kvcache.json or the soak plan asks and the
/// bundle allows: see BundleLoader), applies kvcache.json (caches, MLX limits, pressure policy), runs chat turns
/// and soak plans, and writes telemetry.
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
    @ObservationIgnored private let host: EngineHost?
    @ObservationIgnored private var phoneElementBytes: Int?
    /// config.json's model_type of the bundle this app runs, which picks the cache for some families (CachePlan):
    /// the bundle pushed may not be the one the app was generated for (AppConfig.modelType).
    @ObservationIgnored private var bundleModelType: String?
    /// MLX's memory limit as configureMemory set it (0: left at MLX's default).
    @ObservationIgnored private var mlxLimitBytes = 0
    /// Set when this run uses the Core ML program instead of MLX (the soak plan's or the launch argument's
    /// backend); chat and soak then go through it, with the bundle's tokenizer.
    /// The Core ML backend, the bundle's tokenizer, and the ids that end a reply (it has no ModelConfiguration).
    @ObservationIgnored private var alternate:
        (backend: any AlternateBackend, tokenizer: any MLXLMCommon.Tokenizer, stop: Set<Int>)?
    /// Sampling temperature of chat turns and soaks (0: greedy) and the longest reply.
    @ObservationIgnored var chatTemperature: Float = 0.6
    @ObservationIgnored var chatMaxTokens = 2048
    /// The soak plan's `buffer_cache: uncapped`: MLX's buffer cache is never capped nor emptied, as an app grown
    /// from mlx-swift-lm's generation loop runs (what `kvrig plan --app uncapped` plans). Set once before a run.
    nonisolated(unsafe) static var cacheUncapped = false
    let documents: URL

    /// `host`: set only when a host runs the engine in place of the phone (kvrig's headless runner).
    init(host: EngineHost? = nil) {
        self.host = host
        documents = host?.documents ?? FileManager.default.urls(for: .documentDirectory, in: .userDomainMask)[0]
    }

    func start(arguments: [String]) async {
        let bundleURL =
            host?.bundle ?? documents.appendingPathComponent(AppConfig.bundleFolder, isDirectory: true)
        do {
            var plan: SoakPlan?
            if let planURL = SoakPlan.planURL(arguments: arguments, base: documents) {
                plan = try ContractJSON.load(SoakPlan.self, from: planURL)
            }
            let runId = plan?.runId ?? "chat-\(Int(Date().timeIntervalSince1970))"
            let telemetryURL =
                plan?.telemetryURL(base: documents) ?? documents.appendingPathComponent("telemetry.jsonl")
            // @Sendable: records are written on the generation thread, so the mirror must not be main-actor
            // isolated (Swift 6 checks that at run time and traps).
            telemetry = try TelemetryLog(
                runId: runId, url: telemetryURL, mirror: { @Sendable line in Log.telemetry.log(line) })
            if (plan?.backend ?? Self.backend(arguments: arguments)) == .coreml {
                try await startCoreML(plan: plan, bundleURL: bundleURL)
                return
            }
            let configURL = bundleURL.appendingPathComponent("kvcache.json")
            guard FileManager.default.fileExists(atPath: configURL.path) else {
                throw EngineError.noBundle(bundleURL.lastPathComponent)
            }
            let config = try ContractJSON.load(KVCacheConfig.self, from: configURL)
            self.config = config
            decider = PressureDecider(config: config, onCritical: plan?.onCritical ?? .stopAndSave)
            let believedLimit = configureMemory(config, bufferCache: plan?.bufferCache)
            pressure = PressureMonitor { [weak self] level in
                MainActor.assumeIsolated { self?.onPressure(level) }
            }

            status = "Loading \(AppConfig.bundleFolder)…"
            // Progress on the log while nothing else is written (loading may take a while on a busy host).
            Log.app.notice("loading \(AppConfig.bundleFolder) (weights, tokenizer) ...")
            let loadBegan = Date()
            let loaded = try await BundleLoader.load(
                bundle: bundleURL, config: config, requested: plan?.weightsResidency)
            let container = loaded.container
            self.container = container
            bundleModelType = Self.modelType(in: bundleURL)
            Log.app.notice("loaded in \(String(format: "%.1f", Date().timeIntervalSince(loadBegan))) s")
            raiseMemoryLimit(mappedBytes: loaded.weights.mappedBytes)
            var converted: [String] = []
            var weights = loaded.weights
            if let host {
                // A host that plays the phone reports the phone's residency (it may not map as the phone does).
                let phone = host.phoneWeights(held: weights, bundle: bundleURL, requested: plan?.weightsResidency)
                weights = phone.weights
                converted = phone.converted
                let prepared = try await container.perform { context in
                    try host.prepare(model: context.model, bundle: bundleURL)
                }
                phoneElementBytes = prepared.phoneElementBytes
                converted += prepared.converted
            }
            await newChat()
            // With a host kernel, the first report (weights loaded) may already be fatal, as on the phone.
            var limit = believedLimit
            if let host, let caches, let verdict = KernelHub.shared.report({ host.sample(caches: caches) }) {
                limit = verdict.footprint + verdict.available
            }
            try telemetry?.record(
                .start(
                    model: bundleURL.lastPathComponent, scheme: config.spec,
                    productType: DeviceMemory.productType(), osVersion: DeviceMemory.osVersion(), limitBytes: limit,
                    converted: converted, weightsResidency: weights.residency, mappedWeightBytes: weights.mappedBytes,
                    residencyNote: weights.note))
            isReady = true
            status = "Ready: \(AppConfig.modelType), KV \(config.spec)"
            startMetricsTimer()
            if let plan {
                await runSoak(plan)
            }
        } catch {
            status = "Error: \(error)"
            Log.app.error("start failed: \(String(describing: error))")
            // The soak driver reads why the run ended from the telemetry file.
            try? telemetry?.record(.end(reason: .error, contextTokens: 0, message: String(describing: error)))
        }
    }

    /// Caps MLX's buffer cache and sets its memory limit below what jetsam allows. The limit is MLX's guideline,
    /// not a wall: past it MLX waits for scheduled work and frees its cache before allocating (mlx/memory.h), so
    /// the buffers it keeps stay under jetsam's line; an allocation still fails only when Metal refuses it, and
    /// memory pressure (PressureResponse), not the limit, is what stops and saves in time. Returns the app's
    /// memory limit as the device reports it (footprint + available), for the start event.
    private func configureMemory(_ config: KVCacheConfig, bufferCache: BufferCacheMode? = nil) -> Int? {
        Self.cacheUncapped = bufferCache == .uncapped
        if Self.cacheUncapped {
            Log.app.notice("MLX cache uncapped and never emptied (an app kvrig did not write)")
        } else {
            Memory.cacheLimit = config.bufferCacheLimitBytes
        }
        let footprint = DeviceMemory.footprint()
        let available = DeviceMemory.available()
        let limit = Budget.mlxMemoryLimit(
            configured: config.memoryLimitBytes, footprint: footprint, available: available,
            headroom: AppConfig.mlxHeadroomBytes, mlxActive: Memory.activeMemory)
        if limit > 0 {
            Memory.memoryLimit = limit
            mlxLimitBytes = limit
        }
        Log.app.notice(
            "MLX cache limit \(config.bufferCacheLimitBytes) B, memory limit \(limit) B, available \(available ?? -1) B")
        return available.map { footprint + $0 }
    }

    /// The end-of-sequence ids config.json and generation_config.json name (`eos_token_id`: one id or a list), as
    /// mlx-swift-lm's model factory collects them for ModelConfiguration.eosTokenIds.
    static func endTokenIds(in bundle: URL) -> Set<Int> {
        var ids = Set<Int>()
        for name in ["config.json", "generation_config.json"] {
            guard let data = try? Data(contentsOf: bundle.appendingPathComponent(name)),
                let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any]
            else { continue }
            if let one = object["eos_token_id"] as? Int {
                ids.insert(one)
            } else if let many = object["eos_token_id"] as? [Int] {
                ids.formUnion(many)
            }
        }
        return ids
    }

    /// The model_type a bundle's config.json names (nil when it names none or cannot be read).
    static func modelType(in bundle: URL) -> String? {
        guard let data = try? Data(contentsOf: bundle.appendingPathComponent("config.json")),
            let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any]
        else { return nil }
        return object["model_type"] as? String
    }

    /// MLX counts mapped weights as active memory (Metal's allocator adds a no-copy buffer's length), the footprint
    /// does not: the limit, set for weights in the footprint, moves up by them, else MLX would refuse allocations
    /// jetsam still allows.
    private func raiseMemoryLimit(mappedBytes: Int) {
        guard mlxLimitBytes > 0, mappedBytes > 0 else { return }
        Memory.memoryLimit = mlxLimitBytes + mappedBytes
        Log.app.notice("MLX memory limit \(mlxLimitBytes + mappedBytes) B (mapped weights counted by MLX, not jetsam)")
    }

    func newChat() async {
        if let alternate {
            messages = []
            alternate.backend.reset()
            refreshMetrics()
            return
        }
        guard let container, let config else { return }
        let temperature = chatTemperature
        let phoneElementBytes = self.phoneElementBytes
        let modelType = bundleModelType ?? AppConfig.modelType
        messages = []
        caches = await container.perform { context in
            CacheSet(
                model: context.model, config: config, modelType: modelType, temperature: temperature,
                phoneElementBytes: phoneElementBytes)
        }
        Memory.clearCache()
        refreshMetrics()
    }

    /// The scene left the foreground or came back (KvrigApp's scenePhase): GPU work pauses before the next
    /// forward pass while the app is away, unless a continued-processing task holds the GPU (GPUGate).
    func sceneChanged(active: Bool) {
        GPUGate.shared.setForeground(active)
        let gpu = active ? "may run" : "stops before the next forward pass"
        Log.app.notice("scene \(active ? "active" : "not active"): GPU work \(gpu)")
    }

    func stop() {
        caches?.requestStop()
        alternate?.backend.requestStop()
    }

    /// One chat turn; `onToken` (on the generation thread) sees each generated token id.
    func send(_ prompt: String, onToken: (@Sendable (Int) -> Void)? = nil) async {
        if let alternate {
            await sendAlternate(prompt, alternate.backend, alternate.tokenizer, alternate.stop, onToken: onToken)
            return
        }
        guard let container, let caches, !prompt.isEmpty else { return }
        messages.append(ChatMessage(role: .user, text: prompt))
        messages.append(ChatMessage(role: .assistant, text: ""))
        let index = messages.count - 1
        isGenerating = true
        caches.clearStop()
        let telemetry = self.telemetry
        let host = self.host
        let maxTokens = chatMaxTokens
        do {
            let rate = try await container.perform { context in
                let tokens = try context.tokenizer.applyChatTemplate(messages: [["role": "user", "content": prompt]])
                var loop = TokenLoop(context: context, caches: caches)
                loop.betweenSteps = { Self.afterStep(caches: caches, telemetry: telemetry, host: host) }
                var prefill = TokenLoop.Timing()
                var decode = TokenLoop.Timing()
                guard let logits = try loop.prefill(tokens, timing: &prefill) else { return nil as Double? }
                var detokenizer = NaiveStreamingDetokenizer(tokenizer: context.tokenizer)
                _ = try loop.decode(from: logits, count: maxTokens, timing: &decode) { id in
                    onToken?(id)
                    detokenizer.append(token: id)
                    if let piece = detokenizer.next() {
                        Task { @MainActor in self.append(piece, to: index) }
                    }
                    return true
                }
                // One step record per turn: a chat's context and KV bytes, as a soak writes them.
                try telemetry?.record(.step(Self.stepMetrics(caches: caches, prefill: prefill, decode: decode, host: host)))
                return decode.rate
            }
            metrics.decodeTps = rate
        } catch {
            status = "Generation failed: \(error)"
            Log.app.error("generation failed: \(String(describing: error))")
        }
        isGenerating = false
        refreshMetrics()
    }

    private func append(_ piece: String, to index: Int) {
        guard messages.indices.contains(index) else { return }
        messages[index].text += piece
    }

    /// On the generation thread, after every forward pass: pending evictions, then the metrics snapshot.
    /// With a host kernel attached (the virtual iPhone), it is told the memory after every step, as the
    /// phone's kernel watches it; it may end the process right there.
    nonisolated private static func afterStep(caches: CacheSet, telemetry: TelemetryLog?, host: EngineHost?) {
        let dropped = caches.applyPendingEviction()
        if dropped > 0 {
            if !cacheUncapped { Memory.clearCache() }
            try? telemetry?.record(
                .evict(tokensEvicted: dropped, contextTokens: caches.contextTokens, kvBytes: caches.kvBytes))
        }
        caches.recordSnapshot()
        if let host {
            KernelHub.shared.report { host.sample(caches: caches) }
        }
    }

    /// A step record; MLX's numbers in the phone's format when a host converted the model.
    nonisolated private static func stepMetrics(
        caches: CacheSet, prefill: TokenLoop.Timing, decode: TokenLoop.Timing, host: EngineHost?
    ) -> StepMetrics {
        let memory = Memory.snapshot()
        let active = host?.phoneBytes(mlxBytes: memory.activeMemory, caches: caches) ?? memory.activeMemory
        // A host kernel resets MLX's peak after every forward pass: the step's peak is the largest of those.
        let stepPeak = max(memory.peakMemory, host?.takeStepPeak() ?? 0)
        let peak = host?.phoneBytes(mlxBytes: stepPeak, caches: caches) ?? stepPeak
        return StepMetrics(
            contextTokens: caches.contextTokens, decodeTps: decode.rate, prefillTps: prefill.rate,
            physFootprintBytes: DeviceMemory.footprint(), availableBytes: DeviceMemory.available(),
            mlxActiveBytes: active, mlxCacheBytes: memory.cacheMemory, mlxPeakBytes: peak,
            kvBytes: caches.kvBytes, thermalState: DeviceMemory.thermalState(), backend: .mlx)
    }

    private func onPressure(_ level: PressureLevel) {
        if let alternate {
            // The Core ML state is allocated whole at load: nothing to evict, so critical pressure stops the run.
            let contextTokens = alternate.backend.contextTokens
            try? telemetry?.record(
                .memoryPressure(
                    level: level, contextTokens: contextTokens, physFootprintBytes: DeviceMemory.footprint()))
            if level == .critical { alternate.backend.requestStop() }
            return
        }
        let contextTokens = caches?.snapshot.contextTokens ?? 0
        try? telemetry?.record(
            .memoryPressure(level: level, contextTokens: contextTokens, physFootprintBytes: DeviceMemory.footprint()))
        Log.app.notice("memory pressure \(level.rawValue) at \(contextTokens) tokens")
        guard let decider, let caches else { return }
        switch decider.respond(to: level, contextTokens: contextTokens) {
        case .nothing:
            break
        case .evict(let tokens):
            caches.requestEviction(tokens: tokens)
            if !isGenerating {
                Self.afterStep(caches: caches, telemetry: telemetry, host: host)
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
        let url = ContainerPath.resolve("checkpoint.json", in: documents)
        if let url {
            do {
                try checkpoint.write(to: url)
            } catch {
                Log.app.error("checkpoint not written: \(String(describing: error))")
            }
        }
    }

    func runSoak(_ plan: SoakPlan) async {
        guard let container, let caches, let telemetry else { return }
        status = "Soak \(plan.runId)…"
        isGenerating = true
        caches.clearStop()
        GPUGate.shared.reset()
        // Started from the foreground, as iOS requires: with the GPU where the device supports it, the soak
        // goes on if the app is sent away; elsewhere the gate pauses it there until it is back.
        let continued = ContinuedProcessing.begin(runId: plan.runId, steps: plan.schedule.targets.count)
        let gpu = ContinuedProcessing.supportsBackgroundGPU ? "supported" : "not supported"
        Log.app.notice(
            "soak \(plan.runId): continued-processing task \(continued ? "submitted" : "not available"), "
                + "background GPU \(gpu)")
        let began = Date()
        let host = self.host
        let outcome: (reason: EndReason, message: String?) = await container.perform { context in
            var loop = TokenLoop(context: context, caches: caches)
            loop.betweenSteps = { Self.afterStep(caches: caches, telemetry: telemetry, host: host) }
            loop.onScene = { state, phase, gpu in
                Log.app.notice("scene \(state.rawValue): GPU work \(gpu.rawValue) before \(phase.rawValue)")
                try? telemetry.record(
                    .scene(phase: state, contextTokens: caches.contextTokens, during: phase, gpu: gpu))
            }
            /// Why the loop stopped: its continued-processing task ended in the background, or memory.
            func stopped() -> (reason: EndReason, message: String?) {
                if GPUGate.shared.endedInBackground {
                    return (
                        .backgroundTaskExpired,
                        "the continued-processing task ended in the background at \(caches.contextTokens) tokens"
                    )
                }
                return (.memoryCritical, "critical memory pressure at \(caches.contextTokens) tokens")
            }
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
                        return stopped()
                    }
                    var decode = TokenLoop.Timing()
                    if let current = logits {
                        logits = try loop.decode(
                            from: current, count: plan.schedule.decodeTokens, timing: &decode) { _ in true }
                    }
                    let step = Self.stepMetrics(caches: caches, prefill: prefill, decode: decode, host: host)
                    let footprint = step.physFootprintBytes
                    try telemetry.record(.step(step))
                    ContinuedProcessing.advance()
                    if let why = plan.stop.check(
                        decodeTps: decode.rate, footprint: footprint, elapsed: Date().timeIntervalSince(began))
                    {
                        return (.stopCondition, why)
                    }
                    if caches.isStopRequested {
                        return stopped()
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
        ContinuedProcessing.finish(success: outcome.reason == .completed || outcome.reason == .stopCondition)
        isGenerating = false
        status = "Soak \(plan.runId): \(outcome.reason.rawValue)"
        refreshMetrics()
    }

    /// `--kvrig-backend coreml` in the launch arguments runs chat on the Core ML program (a soak plan names its
    /// own backend).
    nonisolated static func backend(arguments: [String]) -> TelemetryBackend {
        guard let index = arguments.firstIndex(of: "--kvrig-backend"), index + 1 < arguments.count else {
            return .mlx
        }
        return TelemetryBackend(rawValue: arguments[index + 1]) ?? .mlx
    }

    /// The Core ML backend, when this build carries it (apps rendered with `kvrig app --coreml`; Linux builds
    /// and apps without the flag never compile App/CoreML, so they refuse here instead of running MLX).
    private static func makeCoreMLBackend() throws -> any AlternateBackend {
        #if KVRIG_COREML && canImport(CoreML)
            if #available(iOS 18.0, macOS 15.0, *) {
                return try CoreMLRunner()
            }
            throw EngineError.noCoreML("the Core ML program keeps its KV cache as model state, which needs iOS 18")
        #else
            throw EngineError.noCoreML(
                "this build carries no Core ML model: render the app with `kvrig app --coreml Model.mlpackage`")
        #endif
    }

    /// Loads the Core ML program and the bundle's tokenizer (not the MLX weights: the soak measures Core ML
    /// alone), writes the `start` record with backend coreml, then runs the plan if there is one.
    private func startCoreML(plan: SoakPlan?, bundleURL: URL) async throws {
        status = "Loading the Core ML model…"
        let backend = try Self.makeCoreMLBackend()
        let tokenizer = try await TransformersTokenizerLoader().load(from: bundleURL)
        // the ids MLXLMCommon's loop would stop at (TokenLoop.stopTokenIds), read from the bundle's configs
        var stop = Self.endTokenIds(in: bundleURL)
        if let eos = tokenizer.eosTokenId {
            stop.insert(eos)
        }
        alternate = (backend, tokenizer, stop)
        pressure = PressureMonitor { [weak self] level in
            MainActor.assumeIsolated { self?.onPressure(level) }
        }
        let limit = DeviceMemory.available().map { DeviceMemory.footprint() + $0 }
        if let telemetry {
            try backend.recordStart(telemetry, model: bundleURL.lastPathComponent, limitBytes: limit)
        }
        isReady = true
        status = "Ready: \(AppConfig.modelType) on Core ML"
        startMetricsTimer()
        if let plan, let telemetry {
            status = "Soak \(plan.runId) on Core ML…"
            isGenerating = true
            let outcome = await Task.detached { backend.soak(plan, tokenizer: tokenizer, telemetry: telemetry) }.value
            if outcome.reason == .memoryCritical || outcome.reason == .allocationFailed {
                save(reason: outcome.reason, runId: plan.runId, contextTokens: backend.contextTokens)
            }
            try? telemetry.record(
                .end(reason: outcome.reason, contextTokens: backend.contextTokens, message: outcome.message))
            isGenerating = false
            status = "Soak \(plan.runId): \(outcome.reason.rawValue)"
            refreshMetrics()
        }
    }

    /// One chat turn on the Core ML program, continuing its state; one step record per turn, as MLX's chat.
    private func sendAlternate(
        _ prompt: String, _ backend: any AlternateBackend, _ tokenizer: any MLXLMCommon.Tokenizer, _ stop: Set<Int>,
        onToken: (@Sendable (Int) -> Void)?
    ) async {
        guard !prompt.isEmpty else { return }
        messages.append(ChatMessage(role: .user, text: prompt))
        messages.append(ChatMessage(role: .assistant, text: ""))
        let index = messages.count - 1
        isGenerating = true
        let telemetry = self.telemetry
        let maxTokens = chatMaxTokens
        do {
            let step = try await Task.detached {
                let tokens = try tokenizer.applyChatTemplate(messages: [["role": "user", "content": prompt]])
                var detokenizer = NaiveStreamingDetokenizer(tokenizer: tokenizer)
                let step = try backend.reply(to: tokens, maxTokens: maxTokens, stop: stop) { id in
                    onToken?(id)
                    detokenizer.append(token: id)
                    if let piece = detokenizer.next() {
                        Task { @MainActor in self.append(piece, to: index) }
                    }
                }
                try telemetry?.record(.step(step))
                return step
            }.value
            metrics.decodeTps = step.decodeTps
        } catch {
            status = "Generation failed: \(error)"
            Log.app.error("generation failed: \(String(describing: error))")
        }
        isGenerating = false
        refreshMetrics()
    }

    private func startMetricsTimer() {
        metricsTimer = Timer.scheduledTimer(withTimeInterval: 1, repeats: true) { [weak self] _ in
            MainActor.assumeIsolated { self?.refreshMetrics() }
        }
    }

    private func refreshMetrics() {
        let snapshot =
            alternate.map { (contextTokens: $0.backend.contextTokens, kvBytes: $0.backend.stateBytes) }
            ?? caches?.snapshot ?? (contextTokens: 0, kvBytes: 0)
        metrics.footprintBytes = DeviceMemory.footprint()
        metrics.availableBytes = DeviceMemory.available()
        metrics.contextTokens = snapshot.contextTokens
        metrics.kvBytes = snapshot.kvBytes
    }
}

/// A host running the engine in place of the phone (kvrig's headless runner on Linux): where the bundle and
/// Documents are, what it converts after loading, and what its kernel is told after each step. The phone has
/// none: these are the phone's own folders, formats and kernel.
protocol EngineHost: AnyObject, Sendable {
    var documents: URL { get }
    var bundle: URL { get }
    /// How the phone holds the weights when this host holds them as `held` (a host that cannot map reports the
    /// phone's mapping to its kernel), and the telemetry fields that then carry the phone's residency.
    func phoneWeights(held: WeightsReport, bundle: URL, requested: WeightsResidency?) -> (
        weights: WeightsReport, converted: [String]
    )
    /// Converts the loaded model for the host. Returns the element size the phone stores the host's float32
    /// buffers at (nil: no conversion) and the telemetry fields that then carry the phone's format.
    func prepare(model: any LanguageModel, bundle: URL) throws -> (phoneElementBytes: Int?, converted: [String])
    /// The memory sample a host kernel is told after a step.
    func sample(caches: CacheSet) -> MemorySample
    /// `mlxBytes` of MLX memory (weights, caches, activations) as the phone would hold them.
    func phoneBytes(mlxBytes: Int, caches: CacheSet) -> Int
    /// The largest MLX peak the samples since the previous call saw (host bytes; 0 without samples).
    func takeStepPeak() -> Int
}

/// A runtime other than MLX that runs the same soak plans and chat turns: the Core ML program (App/CoreML,
/// compiled only into apps rendered with `--coreml`). Declared here, free of Core ML types, so the Linux
/// engine build compiles Engine without it.
protocol AlternateBackend: AnyObject, Sendable {
    var contextTokens: Int { get }
    /// Bytes of the KV state (allocated whole when the model loads).
    var stateBytes: Int { get }
    func reset()
    func requestStop()
    /// The telemetry `start` record naming this backend.
    func recordStart(_ log: TelemetryLog, model: String, limitBytes: Int?) throws
    /// Runs `plan` from an empty state, writing one step record per target; the end record is the caller's.
    func soak(_ plan: SoakPlan, tokenizer: any MLXLMCommon.Tokenizer, telemetry: TelemetryLog) -> (
        reason: EndReason, message: String?
    )
    /// Feeds `tokens` and generates up to `maxTokens` greedily, stopping at any id in `stop`; returns the turn's step.
    func reply(to tokens: [Int], maxTokens: Int, stop: Set<Int>, onToken: (Int) -> Void) throws -> StepMetrics
}

enum EngineError: Error, CustomStringConvertible {
    case noBundle(String)
    case noCoreML(String)

    var description: String {
        switch self {
        case .noBundle(let folder):
            "no model bundle in Documents/\(folder) (no kvcache.json): push it with `kvrig deploy`"
        case .noCoreML(let why):
            "the soak asks for the Core ML backend, which this app cannot run: \(why)"
        }
    }
}
