import Foundation
import KvrigCore
import MLX
import MLXLMCommon

struct RunnerOptions {
    var bundle: URL?
    var documents: URL
    var soakPlan: String?
    var chat: [String] = []
    var temperature: Float = 0.6
    var maxTokens = 2048
    var printTokens = false
    var hostKernel = false
    var float32 = true
    var exitWhenDone = false
    var probeBufferCache: Int?
    /// kvcache.json, input and output safetensors of `--attention-probe` (see AttentionProbe).
    var attentionProbe: (config: URL, input: URL, output: URL)?

    struct UsageError: Error, CustomStringConvertible {
        let description: String
    }

    init(_ arguments: some Sequence<String>) throws {
        let environment = ProcessInfo.processInfo.environment
        let container = environment["KVRIG_CONTAINER"].map { URL(fileURLWithPath: $0) }
        documents = (container ?? URL(fileURLWithPath: FileManager.default.currentDirectoryPath))
            .appendingPathComponent("Documents", isDirectory: true)
        var iterator = arguments.makeIterator()
        func value(_ flag: String) throws -> String {
            guard let next = iterator.next() else { throw UsageError(description: "\(flag) needs a value") }
            return next
        }
        while let argument = iterator.next() {
            switch argument {
            case "--bundle": bundle = URL(fileURLWithPath: try value(argument), isDirectory: true)
            case "--kvrig-bundle": bundle = documents.appendingPathComponent(try value(argument), isDirectory: true)
            case "--documents": documents = URL(fileURLWithPath: try value(argument), isDirectory: true)
            case AppConfig.soakPlanArgument: soakPlan = try value(argument)
            case "--chat": chat.append(try value(argument))
            case "--temperature":
                guard let t = Float(try value(argument)), t >= 0 else {
                    throw UsageError(description: "--temperature: expected a number >= 0")
                }
                temperature = t
            case "--max-tokens":
                guard let n = Int(try value(argument)), n >= 0 else {
                    throw UsageError(description: "--max-tokens: expected a whole number >= 0")
                }
                maxTokens = n
            case "--print-tokens": printTokens = true
            case "--host-kernel": hostKernel = true
            case "--no-float32": float32 = false
            case "--exit-when-done": exitWhenDone = true
            case "--probe-buffer-cache":
                guard let n = Int(try value(argument)), n >= 0 else {
                    throw UsageError(description: "--probe-buffer-cache: expected a byte count >= 0")
                }
                probeBufferCache = n
            case "--attention-probe":
                let paths = try (0 ..< 3).map { _ in URL(fileURLWithPath: try value(argument)) }
                attentionProbe = (paths[0], paths[1], paths[2])
            default: throw UsageError(description: "unknown argument \(argument)")
            }
        }
        if bundle == nil {
            // Else the folder the app was generated for (AppConfig.bundleFolder), as on the phone.
            bundle = Self.findBundle(in: documents)
        }
    }

    /// The arguments the app itself understands (what a launch passes the phone's app).
    var engineArguments: [String] {
        soakPlan.map { [AppConfig.soakPlanArgument, $0] } ?? []
    }

    /// The single folder in Documents holding kvcache.json (what `kvrig deploy` pushes), if there is one.
    static func findBundle(in documents: URL) -> URL? {
        let entries = (try? FileManager.default.contentsOfDirectory(at: documents, includingPropertiesForKeys: nil)) ?? []
        let found = entries.filter {
            FileManager.default.fileExists(atPath: $0.appendingPathComponent("kvcache.json").path)
        }
        return found.count == 1 ? found[0] : nil
    }
}

/// The runner's side of the Engine's host hooks: its folders, the float32 conversion, the kernel's samples.
final class RunnerHost: EngineHost, @unchecked Sendable {
    let documents: URL
    let bundle: URL
    private let float32: Bool
    private let hostKernel: Bool
    private let lock = NSLock()
    private var format: HostFormat?
    private var stepPeak = 0
    private var mappedWeightBytes = 0
    /// The weights as stored (what the phone holds), for samples when no float32 conversion measured them.
    private var storedWeightBytes = 0

    init(options: RunnerOptions) {
        documents = options.documents
        bundle = options.bundle ?? options.documents.appendingPathComponent(AppConfig.bundleFolder, isDirectory: true)
        float32 = options.float32
        hostKernel = options.hostKernel
    }

    /// With a host kernel, the phone's residency, decided by the phone's rule (its 16 KiB page) as kvrig's Python
    /// runtime decides it: a host whose MLX copies what it maps (Linux) still loads, and the kernel is told what the
    /// phone maps. Without one, what this host holds.
    func phoneWeights(held: WeightsReport, bundle: URL, requested: WeightsResidency?) -> (
        weights: WeightsReport, converted: [String]
    ) {
        let configURL = bundle.appendingPathComponent("kvcache.json")
        guard hostKernel, let config = try? ContractJSON.load(KVCacheConfig.self, from: configURL) else {
            return (held, [])
        }
        var phone = held
        switch WeightsMap.plan(bundle: bundle, config: config, requested: requested, pageSize: Self.phonePageSize) {
        case .map(let files):
            phone = WeightsReport(residency: .mapped, mappedBytes: files.reduce(0) { $0 + $1.byteCount }, note: nil)
        case .load(let why):
            phone = WeightsReport(residency: .loaded, mappedBytes: 0, note: why)
        }
        let stored = (try? HostFormat.storedWeightBytes(bundle)) ?? 0
        lock.lock()
        mappedWeightBytes = phone.mappedBytes
        storedWeightBytes = stored
        lock.unlock()
        if phone == held { return (held, []) }
        Log.app.notice(
            "this host holds the weights \(held.residency.rawValue); the phone's \(phone.residency.rawValue) "
                + "(\(phone.mappedBytes) B mapped) is what the kernel is told")
        return (phone, ["weights_residency", "mapped_weight_bytes"])
    }

    /// The iPhone's VM page size (every A9 and later): what the phone's app maps on.
    static let phonePageSize = 16384

    func prepare(model: any LanguageModel, bundle: URL) throws -> (phoneElementBytes: Int?, converted: [String]) {
        guard float32 else { return (nil, []) }
        let config = try ContractJSON.load(KVCacheConfig.self, from: bundle.appendingPathComponent("kvcache.json"))
        Log.app.notice("converting the weights to float32 for this host ...")
        let began = Date()
        let format = try HostFormat.convert(model, bundle: bundle, phoneDType: config.dtype.rawValue)
        Log.app.notice(
            "converted to float32 in \(String(format: "%.1f", Date().timeIntervalSince(began))) s "
                + "(\(format.hostWeightBytes) B here, \(format.phoneWeightBytes) B as stored)")
        // The conversion's transients (quantized and float32 copies side by side) exist only on this host: the
        // kernel's first measurement must see what the phone holds after loading, not this peak.
        Memory.clearCache()
        Memory.peakMemory = 0
        lock.lock()
        self.format = format
        lock.unlock()
        // The footprint is the phone's only when a host kernel (the virtual iPhone) accounts it.
        let converted = HostFormat.convertedFields + (hostKernel ? ["phys_footprint_bytes"] : [])
        return (format.phoneElementBytes, converted)
    }

    func phoneBytes(mlxBytes: Int, caches: CacheSet) -> Int {
        lock.lock()
        let format = self.format
        lock.unlock()
        guard let format else { return mlxBytes }
        return max(0, mlxBytes + format.delta(hostBytes: mlxBytes, hostKV: caches.hostKVBytes, phoneKV: caches.kvBytes))
    }

    func takeStepPeak() -> Int {
        lock.lock()
        defer { lock.unlock() }
        let peak = stepPeak
        stepPeak = 0
        return peak
    }

    func sample(caches: CacheSet) -> MemorySample {
        lock.lock()
        let format = self.format
        lock.unlock()
        let active = Memory.activeMemory
        // The peak since the previous sample: the step's transients, which the kernel charges.
        let peak = max(Memory.peakMemory, active)
        Memory.peakMemory = 0
        lock.lock()
        stepPeak = max(stepPeak, peak)
        lock.unlock()
        let hostKV = caches.hostKVBytes
        let phoneKV = caches.kvBytes
        lock.lock()
        let mapped = mappedWeightBytes
        let stored = storedWeightBytes
        lock.unlock()
        // The kernel leaves out at most the weights a sample names, so it names them even unconverted.
        return MemorySample(
            mlxActiveBytes: active, mlxCacheBytes: Memory.cacheMemory, mlxPeakBytes: peak, kvBytes: phoneKV,
            weightBytes: format?.phoneWeightBytes ?? stored, contextTokens: caches.contextTokens,
            phoneFormatDeltaBytes: format?.delta(hostBytes: active, hostKV: hostKV, phoneKV: phoneKV) ?? 0,
            phoneFormatPeakDeltaBytes: format?.delta(hostBytes: peak, hostKV: hostKV, phoneKV: phoneKV) ?? 0,
            mappedWeightBytes: mapped, cacheUncapped: Engine.cacheUncapped)
    }
}

/// The virtual iPhone's kernel, over the JSON-line channel on stdin/stdout.
final class ChannelKernel: HostKernel, @unchecked Sendable {
    private let lock = NSLock()

    private func send(_ object: [String: Any]) {
        guard let data = try? JSONSerialization.data(withJSONObject: object) else { return }
        FileHandle.standardOutput.write(data + Data("\n".utf8))
    }

    func log(category: String, text: String) {
        lock.lock()
        defer { lock.unlock() }
        send(["log": category == "telemetry" ? "telemetry \(text)" : text])
    }

    func report(_ sample: MemorySample) -> KernelVerdict? {
        lock.lock()
        defer { lock.unlock() }
        send([
            "measure": [
                "mlx_active_bytes": sample.mlxActiveBytes, "mlx_cache_bytes": sample.mlxCacheBytes,
                "mlx_peak_bytes": sample.mlxPeakBytes, "kv_bytes": sample.kvBytes,
                "weight_bytes": sample.weightBytes, "context_tokens": sample.contextTokens,
                "phone_format_delta_bytes": sample.phoneFormatDeltaBytes,
                "phone_format_peak_delta_bytes": sample.phoneFormatPeakDeltaBytes,
                "mapped_weight_bytes": sample.mappedWeightBytes,
                "mlx_cache_uncapped": sample.cacheUncapped ? 1 : 0,
            ]
        ])
        // The emulator's scene news ({"scene": ...}, {"continued_processing": ...}) may come before the verdict:
        // the headless runner has no scene, so it passes them by (the virtual iPhone's test app plays them).
        var line: String
        repeat {
            guard let next = readLine() else { exit(0) }  // the emulator went away
            line = next
        } while line.contains("\"scene\"") || line.contains("\"continued_processing\"")
        guard let data = line.data(using: .utf8),
            let reply = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
            let footprint = reply["footprint"] as? Int, let available = reply["available"] as? Int,
            let level = (reply["pressure"] as? String).flatMap(PressureLevel.init(rawValue:))
        else { return nil }
        return KernelVerdict(footprint: footprint, available: available, pressure: level)
    }
}

final class TokenCollector: @unchecked Sendable {
    private let lock = NSLock()
    private var collected: [Int] = []

    func append(_ token: Int) {
        lock.lock()
        collected.append(token)
        lock.unlock()
    }

    var tokens: [Int] {
        lock.lock()
        defer { lock.unlock() }
        return collected
    }
}
