import XCTest

@testable import KvrigCore

final class PagingTests: XCTestCase {
    func testAffineBitsPerValueMatchesMLXStorage() {
        // MLX stores one fp16 scale and one fp16 bias per group: 8-bit at group 64 costs 8.5 bits, 4-bit 4.5.
        XCTAssertEqual(Paging.bitsPerValue(bits: 8, groupSize: 64), 8.5)
        XCTAssertEqual(Paging.bitsPerValue(bits: 4, groupSize: 64), 4.5)
        XCTAssertEqual(Paging.bitsPerValue(bits: 4, groupSize: 32), 5.0)
        XCTAssertEqual(Paging.bitsPerValue(bits: nil, groupSize: 64), 16)
    }

    func testBytesPerTokenK8V4() {
        // 8 heads x 64 dims: keys 512 x 8.5 bits + values 512 x 4.5 bits = 832 bytes.
        XCTAssertEqual(
            Paging.bytesPerToken(kvHeads: 8, headDim: 64, keyBits: 8, valueBits: 4, groupSize: 64), 832)
        // Unquantized fp16: 2 x 512 x 2 bytes.
        XCTAssertEqual(
            Paging.bytesPerToken(kvHeads: 8, headDim: 64, keyBits: nil, valueBits: nil, groupSize: 64), 2048)
    }

    func testAllocationGrowsInSteps() {
        XCTAssertEqual(Paging.allocatedTokens(context: 0, step: 256), 0)
        XCTAssertEqual(Paging.allocatedTokens(context: 1, step: 256), 256)
        XCTAssertEqual(Paging.allocatedTokens(context: 256, step: 256), 256)
        XCTAssertEqual(Paging.allocatedTokens(context: 257, step: 256), 512)
    }

    func testEvictionKeepsTheSinkAndWholePages() {
        XCTAssertEqual(Paging.tokensToEvict(context: 1000, keep: 4, pageTokens: 256, pages: 1), 256)
        XCTAssertEqual(Paging.tokensToEvict(context: 1000, keep: 4, pageTokens: 256, pages: 2), 512)
        // 996 evictable tokens hold three whole pages.
        XCTAssertEqual(Paging.tokensToEvict(context: 1000, keep: 4, pageTokens: 256, pages: 9), 768)
        XCTAssertEqual(Paging.tokensToEvict(context: 200, keep: 4, pageTokens: 256, pages: 1), 0)
        XCTAssertEqual(Paging.tokensToEvict(context: 3, keep: 4, pageTokens: 1, pages: 1), 0)
    }

    func testMLXLimitStaysBelowWhatTheDeviceAllows() {
        let gib = 1 << 30
        // The device says 1 GiB more may be allocated; MLX holds 2 GiB; 256 MiB headroom.
        let limit = Budget.mlxMemoryLimit(
            configured: 5 * gib, footprint: 3 * gib, available: gib, headroom: gib / 4, mlxActive: 2 * gib)
        XCTAssertEqual(limit, 2 * gib + gib - gib / 4)
        // A configured limit below that wins.
        XCTAssertEqual(
            Budget.mlxMemoryLimit(
                configured: gib, footprint: 3 * gib, available: gib, headroom: 0, mlxActive: 2 * gib), gib)
        // Without a reading from the device the configured limit stands.
        XCTAssertEqual(Budget.mlxMemoryLimit(configured: gib, footprint: 0, available: nil, headroom: 0), gib)
    }

    func testTokensLeftRoundsDownToSteps() {
        XCTAssertEqual(Budget.tokensLeft(limit: 1_000_000, mlxActive: 0, bytesPerToken: 832, step: 256), 1024)
        XCTAssertEqual(Budget.tokensLeft(limit: 100, mlxActive: 200, bytesPerToken: 832, step: 256), 0)
    }
}

final class CachePlanTests: XCTestCase {
    private func config(key: Int?, value: Int?, layers: [LayerCache]) -> KVCacheConfig {
        KVCacheConfig(
            scheme: "test", keyBits: key, valueBits: value, groupSize: 64, quantizedKVStart: 0, pageTokens: 256,
            maxContext: 4096, keepTokens: 4, prefillStepSize: 256, bufferCacheLimitBytes: 20 << 20,
            memoryLimitBytes: 1 << 30, layers: layers)
    }

    func testEqualBitsUseMLXAffineCache() {
        let plan = config(key: 8, value: 8, layers: [.init(layer: 0, kind: .full), .init(layer: 1, kind: .full)])
            .cachePlan
        XCTAssertEqual(plan.kvBits, 8)
        XCTAssertFalse(plan.needsCustomCache)
        XCTAssertEqual(plan.layers[1], .mlxAffine(bits: 8, groupSize: 64))
    }

    func testDifferentBitsNeedOwnCacheForEveryQuantizedLayer() {
        let plan = config(
            key: 8, value: 4,
            layers: [.init(layer: 0, kind: .full, keyBits: 8, valueBits: 8), .init(layer: 1, kind: .full)]
        ).cachePlan
        XCTAssertNil(plan.kvBits)
        XCTAssertTrue(plan.needsCustomCache)
        XCTAssertEqual(plan.layers[0], .mixed(keyBits: 8, valueBits: 8, groupSize: 64))
        XCTAssertEqual(plan.layers[1], .mixed(keyBits: 8, valueBits: 4, groupSize: 64))
        XCTAssertTrue(plan.notes.contains { $0.contains("differ") })
    }

    func testRotationSinksAndWindowNeedOwnCacheEvenAtEqualBits() {
        var kv = config(key: 8, value: 8, layers: [.init(layer: 0, kind: .full), .init(layer: 1, kind: .sliding, window: 64)])
        kv.rotation = .hadamard
        kv.sinkTokens = 4
        kv.recentTokens = 32
        let plan = kv.cachePlan
        XCTAssertNil(plan.kvBits)
        XCTAssertEqual(plan.layers[0], .mixed(keyBits: 8, valueBits: 8, groupSize: 64))
        XCTAssertEqual(plan.layers[1], .slidingUnquantized(window: 64))
        XCTAssertEqual(plan.extras, KVExtras(rotation: .hadamard, sinkTokens: 4, recentTokens: 32))
        XCTAssertFalse(plan.notes.contains { $0.contains("not applied") })
    }

    func testNoExtrasKeepMLXCache() {
        let plan = config(key: 4, value: 4, layers: [.init(layer: 0, kind: .full)]).cachePlan
        XCTAssertFalse(plan.extras.any)
        XCTAssertEqual(plan.layers[0], .mlxAffine(bits: 4, groupSize: 64))
    }

    func testSlidingLayersStayUnquantizedWithANote() {
        let plan = config(
            key: 4, value: 4,
            layers: [.init(layer: 0, kind: .sliding, window: 512), .init(layer: 1, kind: .full)]
        ).cachePlan
        XCTAssertEqual(plan.layers[0], .slidingUnquantized(window: 512))
        XCTAssertEqual(plan.kvBits, 4)
        XCTAssertTrue(plan.notes.contains { $0.contains("layer 0") && $0.contains("unquantized") })
    }

    func testFamiliesWhoseAttentionCallsUpdateGetTheDequantizingCache() {
        // gemma2's MLX Swift attention calls cache.update itself: MLX's QuantizedKVCache would fatalError there.
        let kv = config(key: 8, value: 8, layers: [.init(layer: 0, kind: .full), .init(layer: 1, kind: .full)])
        let plan = CachePlan(config: kv, modelType: "gemma2")
        XCTAssertNil(plan.kvBits)  // nothing converts the model's caches to MLX's quantized one later either
        XCTAssertEqual(plan.layers[0], .mixed(keyBits: 8, valueBits: 8, groupSize: 64))
        XCTAssertTrue(plan.notes.contains { $0.contains("gemma2") && $0.contains("dequantized when read") })
        // a family whose attention takes MLX's quantized cache keeps it
        XCTAssertEqual(CachePlan(config: kv, modelType: "llama").layers[0], .mlxAffine(bits: 8, groupSize: 64))
        XCTAssertEqual(CachePlan(config: kv, modelType: "llama").kvBits, 8)
    }

    func testGemma3nKeepsItsKVUnquantizedWithANote() {
        let kv = config(key: 8, value: 4, layers: [.init(layer: 0, kind: .full), .init(layer: 1, kind: .shared)])
        let plan = CachePlan(config: kv, modelType: "gemma3n")
        XCTAssertEqual(plan.layers[0], .unquantized)
        XCTAssertEqual(plan.layers[1], .modelManaged)
        XCTAssertNil(plan.kvBits)
        XCTAssertTrue(plan.notes.contains { $0.contains("gemma3n") && $0.contains("unquantized") })
    }

    func testUnquantizedConfigHasNoBits() {
        let plan = config(key: nil, value: nil, layers: [.init(layer: 0, kind: .full)]).cachePlan
        XCTAssertNil(plan.kvBits)
        XCTAssertEqual(plan.layers[0], .unquantized)
        XCTAssertTrue(plan.notes.isEmpty)
    }
}

final class PressureTests: XCTestCase {
    private let config = KVCacheConfig(
        scheme: "k8v4", keyBits: 8, valueBits: 4, groupSize: 64, quantizedKVStart: 0, pageTokens: 128,
        maxContext: 4096, keepTokens: 4, prefillStepSize: 256, bufferCacheLimitBytes: 0, memoryLimitBytes: 0,
        pressure: PressurePolicy(warning: .evictOldestPages, warningEvictPages: 2, critical: .stopAndSave),
        layers: [])

    func testWarningEvictsWholePagesAfterTheSink() {
        let decider = PressureDecider(config: config)
        XCTAssertEqual(decider.respond(to: .warning, contextTokens: 1000), .evict(tokens: 256))
        XCTAssertEqual(decider.respond(to: .warning, contextTokens: 100), .nothing)
        XCTAssertEqual(decider.respond(to: .normal, contextTokens: 1000), .nothing)
    }

    func testCriticalStopsUnlessThePlanSaysContinue() {
        XCTAssertEqual(PressureDecider(config: config).respond(to: .critical, contextTokens: 1000), .stopAndSave)
        let soak = PressureDecider(config: config, onCritical: .continue)
        XCTAssertEqual(soak.respond(to: .critical, contextTokens: 1000), .evict(tokens: 256))
        XCTAssertEqual(soak.respond(to: .critical, contextTokens: 10), .nothing)
    }

    func testPolicyNoneDoesNothing() {
        var quiet = config
        quiet.pressure = PressurePolicy(warning: .none, warningEvictPages: 1, critical: .none)
        XCTAssertEqual(PressureDecider(config: quiet).respond(to: .warning, contextTokens: 1000), .nothing)
        XCTAssertEqual(PressureDecider(config: quiet).respond(to: .critical, contextTokens: 1000), .nothing)
    }
}

final class SoakPlanTests: XCTestCase {
    func testScheduleTargets() {
        XCTAssertEqual(GrowthSchedule(startTokens: 256, stepTokens: 512, maxTokens: 1500).targets, [256, 768, 1280])
        XCTAssertEqual(GrowthSchedule(startTokens: 256, stepTokens: 256, maxTokens: 768).targets, [256, 512, 768])
    }

    func testStopConditions() {
        let stop = StopConditions(minDecodeTps: 5, maxFootprintBytes: 1000, maxSeconds: 60)
        XCTAssertNil(stop.check(decodeTps: 10, footprint: 10, elapsed: 1))
        XCTAssertNotNil(stop.check(decodeTps: 4, footprint: 10, elapsed: 1))
        XCTAssertNotNil(stop.check(decodeTps: 10, footprint: 1001, elapsed: 1))
        XCTAssertNotNil(stop.check(decodeTps: nil, footprint: 10, elapsed: 61))
    }

    func testPlanPathStaysInsideTheContainer() {
        let docs = URL(fileURLWithPath: "/var/mobile/Containers/Data/X/Documents")
        let args = ["App", SoakPlan.launchArgument, "plans/run1.json"]
        XCTAssertEqual(SoakPlan.planURL(arguments: args, base: docs)?.path, docs.path + "/plans/run1.json")
        XCTAssertNil(SoakPlan.planURL(arguments: ["App", SoakPlan.launchArgument, "../../etc/x"], base: docs))
        XCTAssertNil(SoakPlan.planURL(arguments: ["App", SoakPlan.launchArgument, "/etc/passwd"], base: docs))
        XCTAssertNil(SoakPlan.planURL(arguments: ["App", SoakPlan.launchArgument], base: docs))
        XCTAssertNil(SoakPlan.planURL(arguments: ["App"], base: docs))
    }

    func testUnknownKeysAreRejected() {
        let json = #"{"run_id": "r", "scheme": "fp16", "text": "x", "colour": "red","#
            + #" "schedule": {"start_tokens": 1, "step_tokens": 1, "max_tokens": 2}}"#
        XCTAssertThrowsError(try ContractJSON.decoder().decode(SoakPlan.self, from: Data(json.utf8)))
    }
}
