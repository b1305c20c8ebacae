import Foundation
import KvrigCore
import MLX
import MLXLLM
import MLXLMCommon
import MLXNN

#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#endif

/// Loads the bundle the way kvcache.json (or the soak plan) asks: its weights mapped from the safetensors files,
/// or loaded into memory MLX allocates (mlx-swift-lm's own loader).
///
/// Mapped: each file is mapped once, read-only and shared (PROT_READ: a writable private mapping is charged as
/// memory to commit; MAP_SHARED, as llama.cpp and ExecuTorch map theirs); every tensor of it starts on a page
/// (`kvrig package --weights-layout mapped`), and each weight is an MLXArray over its pages, adopted without a
/// copy: MLXArray(rawPointer:_:dtype:finalizer:), over mlx-c's `mlx_array_new_data_managed_payload`, whose MLX
/// core asks the allocator to wrap the pointer (`allocator::make_buffer`). Metal's allocator makes a no-copy buffer
/// over the pages; an allocator that cannot (MLX's CPU allocator on Linux has no `make_buffer`, so MLX copies into
/// its own memory and calls the finalizer at once) is seen by its finalizer having run, and the engine loads
/// instead, saying why. The clean, file-backed pages are what iOS leaves out of the app's footprint; MLX still
/// counts them as active memory.
enum BundleLoader {
    /// The model, its tokenizer, and how the weights are held.
    struct Loaded: Sendable {
        let container: ModelContainer
        let weights: WeightsReport
    }

    /// `requested`: the soak plan's residency (nil: kvcache.json's layout).
    static func load(bundle: URL, config: KVCacheConfig, requested: WeightsResidency?) async throws -> Loaded {
        var note: String?
        let plan = WeightsMap.plan(bundle: bundle, config: config, requested: requested, pageSize: WeightsMap.pageSize)
        switch plan {
        case .load(let why):
            note = why
        case .map(let files):
            do {
                return try await loadMapped(bundle: bundle, files: files)
            } catch let refused as WeightsMapRefusal {
                note = refused.description
            }
        }
        if let note {
            Log.app.notice("weights loaded, not mapped: \(note)")
        }
        let container = try await LLMModelFactory.shared.loadContainer(
            from: bundle, using: TransformersTokenizerLoader())
        return Loaded(container: container, weights: WeightsReport(residency: .loaded, mappedBytes: 0, note: note))
    }

    private static func loadMapped(bundle: URL, files: [SafetensorsFile]) async throws -> Loaded {
        let map = try WeightsMap(files: files)
        let container = try await ModelBuilder.container(bundle: bundle, weights: map.take(), metadata: map.metadata)
        // What is still mapped once the model holds its weights (sanitize may have dropped some).
        let report = map.report()
        Log.app.notice("weights mapped: \(report.mappedBytes) B from \(files.count) file(s), outside the footprint")
        return Loaded(container: container, weights: report)
    }
}

/// How the app holds its weights, for the telemetry `start` record and the host kernel.
struct WeightsReport: Sendable, Equatable {
    var residency: WeightsResidency
    var mappedBytes: Int
    var note: String?
}

/// Why the weights could not be mapped; the engine loads them instead and says this.
struct WeightsMapRefusal: Error, CustomStringConvertible {
    let description: String
}

/// One safetensors file's header: its tensors with absolute offsets, and its metadata.
struct SafetensorsFile: Sendable {
    struct Tensor: Sendable {
        let name: String
        let dtype: DType
        let shape: [Int]
        let offset: Int
        let byteCount: Int
    }

    let url: URL
    let size: Int
    let tensors: [Tensor]
    let metadata: [String: String]

    /// safetensors' own limit for the JSON header.
    private static let maxHeader = 100 * 1024 * 1024

    /// Reads the header (8 bytes of little-endian length, then JSON), checking every tensor lies in the file.
    init(url: URL) throws {
        let name = url.lastPathComponent
        let handle = try FileHandle(forReadingFrom: url)
        defer { try? handle.close() }
        let size = Int(try handle.seekToEnd())
        try handle.seek(toOffset: 0)
        let lengthBytes = try handle.read(upToCount: 8) ?? Data()
        guard lengthBytes.count == 8 else { throw WeightsMapRefusal(description: "\(name): shorter than a header") }
        let length = lengthBytes.reversed().reduce(0) { $0 << 8 | Int($1) }
        guard length >= 2, length <= Self.maxHeader, length <= size - 8 else {
            throw WeightsMapRefusal(description: "\(name): a safetensors header of \(length) bytes in \(size)")
        }
        let json = try handle.read(upToCount: length) ?? Data()
        let header: Header
        do {
            header = try JSONDecoder().decode(Header.self, from: json)
        } catch {
            throw WeightsMapRefusal(description: "\(name): unreadable safetensors header: \(error)")
        }
        let dataStart = 8 + length
        var tensors: [Tensor] = []
        for (tensorName, entry) in header.tensors {
            guard let dtype = Self.dtypes[entry.dtype] else {
                throw WeightsMapRefusal(description: "\(name): tensor \(tensorName) has dtype \(entry.dtype)")
            }
            let offsets = entry.dataOffsets
            let byteCount = offsets.count == 2 ? offsets[1] - offsets[0] : -1
            guard offsets.count == 2, offsets[0] >= 0, byteCount >= 0, dataStart + offsets[1] <= size,
                byteCount == entry.shape.reduce(1, *) * dtype.size
            else {
                throw WeightsMapRefusal(description: "\(name): tensor \(tensorName) has bad data_offsets \(offsets)")
            }
            tensors.append(
                Tensor(
                    name: tensorName, dtype: dtype, shape: entry.shape, offset: dataStart + offsets[0],
                    byteCount: byteCount))
        }
        self.url = url
        self.size = size
        self.tensors = tensors.sorted { $0.offset < $1.offset }
        self.metadata = header.metadata
    }

    var byteCount: Int { tensors.reduce(0) { $0 + $1.byteCount } }

    /// The safetensors files at the top of a bundle folder (what mlx-swift-lm's loader reads), in name order.
    static func files(in bundle: URL) throws -> [URL] {
        try FileManager.default.contentsOfDirectory(at: bundle, includingPropertiesForKeys: nil)
            .filter { $0.pathExtension == "safetensors" }
            .sorted { $0.lastPathComponent < $1.lastPathComponent }
    }

    /// safetensors dtype names as MLX's own loader maps them (mlx/io/safetensors.cpp).
    private static let dtypes: [String: DType] = [
        "F32": .float32, "F16": .float16, "BF16": .bfloat16, "I64": .int64, "I32": .int32, "I16": .int16,
        "I8": .int8, "U64": .uint64, "U32": .uint32, "U16": .uint16, "U8": .uint8, "BOOL": .bool,
        "C64": .complex64, "F8_E4M3": .uint8,
    ]

    private struct Entry: Decodable {
        let dtype: String
        let shape: [Int]
        let dataOffsets: [Int]

        enum CodingKeys: String, CodingKey {
            case dtype, shape
            case dataOffsets = "data_offsets"
        }
    }

    private struct AnyKey: CodingKey {
        let stringValue: String
        var intValue: Int? { nil }
        init(stringValue: String) { self.stringValue = stringValue }
        init?(intValue: Int) { nil }
    }

    private struct Header: Decodable {
        var tensors: [String: Entry] = [:]
        var metadata: [String: String] = [:]

        init(from decoder: Decoder) throws {
            let c = try decoder.container(keyedBy: AnyKey.self)
            for key in c.allKeys {
                if key.stringValue == "__metadata__" {
                    metadata = try c.decode([String: String].self, forKey: key)
                } else {
                    tensors[key.stringValue] = try c.decode(Entry.self, forKey: key)
                }
            }
        }
    }
}

/// The bundle's safetensors files mapped read-only, and the MLXArrays over their pages.
final class WeightsMap {
    enum Plan {
        case map([SafetensorsFile])
        /// Load; why, when mapping was asked for.
        case load(String?)
    }

    /// This process's VM page size (16 KiB on an iPhone): what a mapped tensor must start on.
    static var pageSize: Int { Int(getpagesize()) }

    /// What the phone's app does with the bundle: map it when asked (the plan, else kvcache.json) and when every
    /// tensor of every file starts on a page of `pageSize`; else load, with the reason. The same rule decides
    /// for the phone when a host (kvrig's runner) plays it.
    static func plan(bundle: URL, config: KVCacheConfig, requested: WeightsResidency?, pageSize: Int) -> Plan {
        let wanted = requested ?? (config.weightsLayout == .mapped ? .mapped : .loaded)
        guard wanted == .mapped else { return .load(nil) }
        guard config.weightsLayout == .mapped else {
            return .load(
                "the bundle's weights are not laid out for mapping (kvcache.json weights_layout: loaded); "
                    + "repackage with `kvrig package --weights-layout mapped`")
        }
        do {
            let urls = try SafetensorsFile.files(in: bundle)
            guard !urls.isEmpty else { return .load("the bundle has no safetensors file to map") }
            let files = try urls.map { try SafetensorsFile(url: $0) }
            for file in files {
                if let off = file.tensors.first(where: { $0.offset % pageSize != 0 }) {
                    return .load(
                        "\(file.url.lastPathComponent): tensor '\(off.name)' starts at byte \(off.offset), "
                            + "not on a \(pageSize)-byte page")
                }
            }
            return .map(files)
        } catch {
            return .load("cannot map the weights: \(error)")
        }
    }

    let metadata: [String: String]
    private var arrays: [String: MLXArray]
    private let leases: [(lease: MappingLease, byteCount: Int)]

    /// Maps every file once and makes an array over each tensor's pages. Refuses (unmapping what it mapped) when
    /// MLX copies the first buffer it is handed: its allocator has no no-copy path here.
    init(files: [SafetensorsFile]) throws {
        var metadata: [String: String] = [:]
        var arrays: [String: MLXArray] = [:]
        var leases: [(lease: MappingLease, byteCount: Int)] = []
        var mapped: [MappedFile] = []
        // Once every array exists no more leases are taken: a file unmaps when its last array goes.
        defer { mapped.forEach { $0.seal() } }
        for file in files {
            let mapping = try MappedFile(url: file.url, size: file.size, pageSize: WeightsMap.pageSize)
            mapped.append(mapping)
            if metadata.isEmpty { metadata = file.metadata }
            for tensor in file.tensors {
                let (array, lease) = WeightsMap.array(tensor, in: mapping)
                if let lease {
                    // The first buffer decides: a finalizer that already ran means MLX copied instead of adopting.
                    if leases.isEmpty && lease.isEnded {
                        throw WeightsMapRefusal(
                            description: "MLX copied the mapped buffer into its own memory (its allocator here has "
                                + "no no-copy path: MLX's CPU allocator on Linux cannot adopt a pointer)")
                    }
                    leases.append((lease, tensor.byteCount))
                }
                arrays[tensor.name] = array
            }
        }
        self.metadata = metadata
        self.arrays = arrays
        self.leases = leases
    }

    /// The arrays, handed over once (the map keeps no reference, so sanitize's drops unmap their pages).
    func take() -> [String: MLXArray] {
        defer { arrays = [:] }
        return arrays
    }

    /// The bytes still held mapped: tensors whose buffer MLX adopted and still uses (a copy or a dropped tensor
    /// has ended its lease).
    func report() -> WeightsReport {
        let held = leases.filter { !$0.lease.isEnded }
        let copied = leases.count - held.count
        let note = copied > 0 ? "\(copied) of \(leases.count) tensors are not mapped (copied or dropped)" : nil
        return WeightsReport(residency: .mapped, mappedBytes: held.reduce(0) { $0 + $1.byteCount }, note: note)
    }

    /// An array over `tensor`'s pages. MLX is handed whole pages (Metal's no-copy buffers want a page-aligned
    /// pointer and length; the next tensor starts on the next page, the last page lies inside the mapping), then
    /// takes the tensor's bytes as its dtype and shape: a prefix slice, a view and a reshape of a row-contiguous
    /// array, which MLX makes by sharing the buffer, never by copying.
    private static func array(_ tensor: SafetensorsFile.Tensor, in mapping: MappedFile) -> (MLXArray, MappingLease?) {
        guard tensor.byteCount > 0 else { return (MLXArray.zeros(tensor.shape, dtype: tensor.dtype), nil) }
        let pages = (tensor.byteCount + mapping.pageSize - 1) / mapping.pageSize * mapping.pageSize
        let lease = MappingLease(mapping)
        let raw = MLXArray(rawPointer: mapping.base + tensor.offset, [pages], dtype: .uint8) { lease.end() }
        var array = raw[0 ..< tensor.byteCount]
        if tensor.dtype != .uint8 {
            array = array.view(dtype: tensor.dtype)
        }
        return (array.reshaped(tensor.shape), lease)
    }
}

/// One file mapped read-only (PROT_READ, MAP_SHARED), unmapped when it is sealed and its last array has gone.
/// MLX calls an array's finalizer on whichever thread frees the buffer, hence the lock; the count (not deinit)
/// decides, because mlx-swift keeps a finalizer's closure, and what it captures, alive.
final class MappedFile: @unchecked Sendable {
    let base: UnsafeMutableRawPointer
    let length: Int
    let pageSize: Int
    private let lock = NSLock()
    private var arrays = 0
    private var sealed = false
    private var unmapped = false

    init(url: URL, size: Int, pageSize: Int) throws {
        let name = url.lastPathComponent
        let fd = open(url.path, O_RDONLY)
        guard fd >= 0 else { throw WeightsMapRefusal(description: "\(name): open failed (errno \(errno))") }
        defer { close(fd) }  // the mapping outlives the descriptor
        // Whole pages: the bytes after the end of the file in its last page read as zeros.
        let length = (size + pageSize - 1) / pageSize * pageSize
        guard length > 0, let pointer = mmap(nil, length, PROT_READ, MAP_SHARED, fd, 0),
            pointer != UnsafeMutableRawPointer(bitPattern: -1)
        else {
            throw WeightsMapRefusal(description: "\(name): mmap of \(length) bytes failed (errno \(errno))")
        }
        self.base = pointer
        self.length = length
        self.pageSize = pageSize
    }

    func retainArray() {
        lock.lock()
        arrays += 1
        lock.unlock()
    }

    func releaseArray() {
        lock.lock()
        arrays -= 1
        lock.unlock()
        unmapIfUnused()
    }

    /// No further arrays will be made over this file.
    func seal() {
        lock.lock()
        sealed = true
        lock.unlock()
        unmapIfUnused()
    }

    private func unmapIfUnused() {
        lock.lock()
        let unmap = sealed && arrays == 0 && !unmapped
        if unmap { unmapped = true }
        lock.unlock()
        if unmap { munmap(base, length) }
    }
}

/// One array's hold on a mapped file: taken before MLX is handed the pointer, ended by the array's finalizer
/// (at once, when MLX copied instead of adopting the buffer).
final class MappingLease: @unchecked Sendable {
    private let file: MappedFile
    private let lock = NSLock()
    private var ended = false

    init(_ file: MappedFile) {
        self.file = file
        file.retainArray()
    }

    var isEnded: Bool {
        lock.lock()
        defer { lock.unlock() }
        return ended
    }

    func end() {
        lock.lock()
        let first = !ended
        ended = true
        lock.unlock()
        if first { file.releaseArray() }
    }
}

/// Builds the model from the bundle's config with given weights, as mlx-swift-lm's LLMModelFactory builds it
/// (create from config.json, sanitize, quantize the layers whose scales are present, update with every key
/// verified, evaluate), then wraps it with the bundle's tokenizer.
enum ModelBuilder {
    static func container(
        bundle: URL, weights loaded: [String: MLXArray], metadata: [String: String]
    ) async throws -> ModelContainer {
        let configData = try Data(contentsOf: bundle.appendingPathComponent("config.json"))
        let baseConfig = try JSONDecoder.json5().decode(BaseConfiguration.self, from: configData)
        let model = try await LLMTypeRegistry.shared.createModel(
            configuration: configData, modelType: baseConfig.modelType)

        // End-of-sequence ids from config.json, overridden by generation_config.json (mlx-lm's rule).
        var eosTokenIds = Set(baseConfig.eosTokenIds?.values ?? [])
        let generationConfig = (try? Data(contentsOf: bundle.appendingPathComponent("generation_config.json")))
            .flatMap { try? JSONDecoder.json5().decode(GenerationConfigFile.self, from: $0) }
        if let ids = generationConfig?.eosTokenIds?.values {
            eosTokenIds = Set(ids)
        }
        async let tokenizerTask = TransformersTokenizerLoader().load(from: bundle)

        var weights = model.sanitize(weights: loaded, metadata: metadata)
        if let perLayerQuantization = baseConfig.perLayerQuantization {
            quantize(model: model) { path, _ in
                if weights["\(path).scales"] != nil {
                    return perLayerQuantization.quantization(layer: path)?.asTuple
                } else {
                    return nil
                }
            }
        }
        try model.update(parameters: ModuleParameters.unflattened(weights), verify: [.all])
        weights = [:]
        eval(model)

        let tokenizer = try await tokenizerTask
        let messageGenerator: any MessageGenerator =
            (model as? LLMModel)?.messageGenerator(tokenizer: tokenizer) ?? DefaultMessageGenerator()
        let configuration = ModelConfiguration(
            directory: bundle, stopStrings: generationConfig?.stopStrings ?? [], eosTokenIds: eosTokenIds,
            toolCallFormat: ToolCallFormat.infer(from: baseConfig.modelType, configData: configData))
        let processor = ChatInputProcessor(tokenizer: tokenizer, messageGenerator: messageGenerator)
        return ModelContainer(
            context: ModelContext(
                configuration: configuration, model: model, processor: processor, tokenizer: tokenizer))
    }
}

/// Chat input to tokens, as mlx-swift-lm's (private) LLM input processor does: the chat template, else the
/// messages' text joined.
struct ChatInputProcessor: UserInputProcessor {
    let tokenizer: any MLXLMCommon.Tokenizer
    let messageGenerator: any MessageGenerator

    func prepare(input: UserInput) throws -> LMInput {
        let messages = messageGenerator.generate(from: input)
        do {
            let tokens = try tokenizer.applyChatTemplate(
                messages: messages, tools: input.tools, additionalContext: input.additionalContext)
            return LMInput(tokens: MLXArray(tokens))
        } catch MLXLMCommon.TokenizerError.missingChatTemplate {
            let prompt = messages.compactMap { $0["content"] as? String }.joined(separator: "\n\n")
            return LMInput(tokens: MLXArray(tokenizer.encode(text: prompt)))
        }
    }
}
