import Foundation
import XCTest

@testable import KvrigCore

/// Files the Python side wrote (rendered into Fixtures by `kvrig app`) must decode, and re-encode to the same
/// document; with KVRIG_CONTRACT_OUT set, the re-encoded files and a telemetry sample are written there so the
/// Python side can check the other direction.
final class ContractTests: XCTestCase {
    private let fixtures = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .appendingPathComponent("Fixtures")

    private var outDir: URL? {
        ProcessInfo.processInfo.environment["KVRIG_CONTRACT_OUT"].map { URL(fileURLWithPath: $0) }
    }

    private func fixture(_ name: String) -> URL {
        if let dir = ProcessInfo.processInfo.environment["KVRIG_CONTRACT_IN"] {
            return URL(fileURLWithPath: dir).appendingPathComponent(name)
        }
        return fixtures.appendingPathComponent(name)
    }

    private func jsonObject(_ data: Data) throws -> NSDictionary {
        try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? NSDictionary)
    }

    private func assertRoundTrip<T: Codable>(_ type: T.Type, file: String) throws -> T {
        let original = try Data(contentsOf: fixture(file))
        let decoded = try ContractJSON.decoder().decode(type, from: original)
        let encoded = try ContractJSON.encoder(pretty: true).encode(decoded)
        XCTAssertEqual(try jsonObject(encoded), try jsonObject(original), "\(file) changed in a round trip")
        if let outDir {
            try encoded.write(to: outDir.appendingPathComponent("roundtrip-" + file))
        }
        return decoded
    }

    /// The families the app treats apart, for the Python side to hold its packaging to (kvrig/kvcache/families.py).
    func testFamiliesForPython() throws {
        guard let outDir else { return }
        let families = [
            "keeps_kv_unquantized": CachePlan.keepsKVUnquantized.sorted(),
            "reads_dequantized": CachePlan.readsDequantized.sorted(),
        ]
        let data = try JSONSerialization.data(withJSONObject: families, options: [.sortedKeys])
        try data.write(to: outDir.appendingPathComponent("families.json"))
    }

    /// What the app accepts of kvcache.json's quantization, for the Python side to hold its schema to.
    func testQuantizationForPython() throws {
        guard let outDir else { return }
        let accepted = ["group_sizes": KVCacheConfig.groupSizes, "kv_bits": KVCacheConfig.kvBits]
        let data = try JSONSerialization.data(withJSONObject: accepted, options: [.sortedKeys])
        try data.write(to: outDir.appendingPathComponent("quantization.json"))
    }

    /// The full KV spec each rotation gives the reference file, for the Python side to hold to its own.
    func testSpecForPython() throws {
        guard let outDir else { return }
        var config = try ContractJSON.decoder().decode(
            KVCacheConfig.self, from: Data(contentsOf: fixture("kvcache.json")))
        var specs: [String: String] = [:]
        for rotation in [Rotation.none, .hadamardKeys, .hadamard] {
            config.rotation = rotation
            specs[rotation.rawValue] = config.spec
        }
        config.sinkTokens = 0
        config.recentTokens = 0
        specs["plain"] = config.spec
        let data = try JSONSerialization.data(withJSONObject: specs, options: [.sortedKeys])
        try data.write(to: outDir.appendingPathComponent("specs.json"))
    }

    func testKVCacheJSONFromPython() throws {
        let config = try assertRoundTrip(KVCacheConfig.self, file: "kvcache.json")
        XCTAssertEqual(config.schema, 3)
        XCTAssertEqual(config.schema, KVCacheConfig.schemaVersion)
        XCTAssertFalse(config.layers.isEmpty)
        XCTAssertEqual(config.layers.map(\.layer), Array(0 ..< config.layers.count))
    }

    func testSoakPlanFromPython() throws {
        let plan = try assertRoundTrip(SoakPlan.self, file: "soakplan.json")
        XCTAssertFalse(plan.runId.isEmpty)
        XCTAssertFalse(plan.schedule.targets.isEmpty)
        XCTAssertEqual(plan.schema, SoakPlan.schemaVersion)
        // Schema 2: the plan names the backend; a schema-1 plan (no backend) is refused, as is an unknown one.
        var object = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: fixture("soakplan.json"))) as? [String: Any])
        var old = object
        old["schema"] = 1
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: old)))
        object["backend"] = "metal"
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: object)))
        object.removeValue(forKey: "backend")
        let defaulted = try ContractJSON.decoder().decode(
            SoakPlan.self, from: JSONSerialization.data(withJSONObject: object))
        XCTAssertEqual(defaulted.backend, .mlx)
        // Schema 3: the plan may name the weights' residency. A schema-2 plan still reads (as the bundle says),
        // but cannot carry the field; an unknown residency and a later schema are refused.
        var two = object
        two["schema"] = 2
        two.removeValue(forKey: "weights_residency")
        two.removeValue(forKey: "buffer_cache")
        let older = try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: two))
        XCTAssertEqual(older.schema, 2)
        XCTAssertNil(older.weightsResidency)
        two["weights_residency"] = "mapped"
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: two)))
        var odd = object
        odd["weights_residency"] = "wired"
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: odd)))
        // Schema 4: the plan may run the app with MLX's buffer cache uncapped; a schema-3 plan cannot carry it.
        var three = object
        three["schema"] = 3
        three.removeValue(forKey: "buffer_cache")
        XCTAssertNil(try ContractJSON.decoder().decode(
            SoakPlan.self, from: JSONSerialization.data(withJSONObject: three)).bufferCache)
        three["buffer_cache"] = "uncapped"
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: three)))
        var uncapped = object
        uncapped["buffer_cache"] = "uncapped"
        XCTAssertEqual(try ContractJSON.decoder().decode(
            SoakPlan.self, from: JSONSerialization.data(withJSONObject: uncapped)).bufferCache, .uncapped)
        var later = object
        later["schema"] = 5
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(SoakPlan.self, from: JSONSerialization.data(withJSONObject: later)))
    }

    func testBrokenFilesAreRejected() throws {
        var object = try XCTUnwrap(
            JSONSerialization.jsonObject(with: Data(contentsOf: fixture("kvcache.json"))) as? [String: Any])
        object["unexpected"] = 1
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(
                KVCacheConfig.self, from: JSONSerialization.data(withJSONObject: object)))
        object.removeValue(forKey: "unexpected")
        // Schema 1 files predate hadamard_keys / sink_tokens / recent_tokens: repackage rather than guess.
        var old = object
        old["schema"] = 1
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(
                KVCacheConfig.self, from: JSONSerialization.data(withJSONObject: old)))
        var negative = object
        negative["recent_tokens"] = -1
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(
                KVCacheConfig.self, from: JSONSerialization.data(withJSONObject: negative)))
        // A group size or bit width MLX does not quantize with, at the top or on a layer, names its field.
        var layers = try XCTUnwrap(object["layers"] as? [[String: Any]])
        layers[0]["key_bits"] = 7
        for (key, value, field) in [
            ("group_size", 7 as Any, "group_size"), ("value_bits", 1 as Any, "value_bits"),
            ("layers", layers as Any, "layers.0.key_bits"),
        ] {
            var odd = object
            odd[key] = value
            XCTAssertThrowsError(
                try ContractJSON.decoder().decode(KVCacheConfig.self, from: JSONSerialization.data(withJSONObject: odd))
            ) { error in XCTAssertEqual((error as? ContractError)?.field, field) }
        }
        object.removeValue(forKey: "key_bits")
        XCTAssertThrowsError(
            try ContractJSON.decoder().decode(
                KVCacheConfig.self, from: JSONSerialization.data(withJSONObject: object)))
    }

    /// One event of each kind, every optional field both set and unset, written with the app's own writer.
    func testTelemetryWriterSample() throws {
        let dir = outDir ?? FileManager.default.temporaryDirectory
        let url = dir.appendingPathComponent("telemetry-from-swift.jsonl")
        try? FileManager.default.removeItem(at: url)
        var lines: [String] = []
        var tick = 1_700_000_000.0
        let log = try TelemetryLog(
            runId: "swift-\"quoted\"", url: url, clock: { tick += 0.25; return tick }, mirror: { lines.append($0) })
        try log.record(
            .start(
                model: "Smol \"LM\" \\ 135M", scheme: "k8v4", productType: "iPhone16,1", osVersion: "17.5",
                limitBytes: 3_221_225_472, converted: []))
        try log.record(
            .start(model: "m", scheme: "fp16", productType: "iPhone15,2", osVersion: "16.7", limitBytes: nil,
                   converted: ["activations"], backend: .coreml, weightsResidency: .loaded, mappedWeightBytes: 0,
                   residencyNote: "mapping \"refused\": fell back"))
        try log.record(
            .step(
                StepMetrics(
                    contextTokens: 1024, decodeTps: 31.5, prefillTps: 410.25, physFootprintBytes: 900_000_000,
                    availableBytes: 2_000_000_000, mlxActiveBytes: 700_000_000, mlxCacheBytes: 20_000_000,
                    mlxPeakBytes: 750_000_000, kvBytes: 12_000_000, thermalState: .fair, backend: .coreml)))
        try log.record(.step(StepMetrics(contextTokens: 0, decodeTps: .infinity, physFootprintBytes: 1)))
        try log.record(.memoryPressure(level: .warning, contextTokens: 2048, physFootprintBytes: 1_000_000))
        try log.record(.memoryPressure(level: .critical, contextTokens: 2048, physFootprintBytes: nil))
        try log.record(.evict(tokensEvicted: 256, contextTokens: 1792, kvBytes: 10_000_000))
        try log.record(.evict(tokensEvicted: 0, contextTokens: 4, kvBytes: nil))
        try log.record(.scene(phase: .background, contextTokens: 1792, during: .decode, gpu: .paused))
        try log.record(.scene(phase: .active, contextTokens: 1792, during: .prefill, gpu: .resumed))
        for reason in [
            EndReason.completed, .stopCondition, .memoryCritical, .allocationFailed, .error, .backgroundTaskExpired,
        ] {
            try log.record(.end(reason: reason, contextTokens: 1792, message: reason == .error ? "boom\n" : nil))
        }
        let written = try String(contentsOf: url, encoding: .utf8)
        XCTAssertEqual(written, lines.joined())
        let records = written.split(separator: "\n").map {
            try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any]
        }
        XCTAssertEqual(records.count, 16)
        XCTAssertEqual(records.compactMap { $0?["seq"] as? Int }, Array(0 ..< 16))
        XCTAssertTrue(records[3]?["decode_tps"] is NSNull, "a non-finite rate is written as null")
    }
}
