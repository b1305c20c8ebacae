import Foundation

/// The Python side rejects unknown keys; Core does the same so a typo in a file fails loudly on both sides.
struct AnyKey: CodingKey {
    var stringValue: String
    var intValue: Int? { nil }
    init(stringValue: String) { self.stringValue = stringValue }
    init?(intValue: Int) { nil }
}

func rejectUnknownKeys<K: CodingKey & CaseIterable>(_ decoder: Decoder, known: K.Type) throws {
    let container = try decoder.container(keyedBy: AnyKey.self)
    let allowed = Set(K.allCases.map(\.stringValue))
    for key in container.allKeys where !allowed.contains(key.stringValue) {
        throw DecodingError.dataCorruptedError(
            forKey: key, in: container, debugDescription: "unknown key '\(key.stringValue)'")
    }
}

/// Raised when a decoded file is well formed JSON but breaks a rule of its schema.
public struct ContractError: Error, CustomStringConvertible, Equatable {
    public let field: String
    public let message: String

    public init(field: String, message: String) {
        self.field = field
        self.message = message
    }

    public var description: String { "field '\(field)': \(message)" }
}

func require(_ condition: Bool, _ field: String, _ message: String) throws {
    if !condition { throw ContractError(field: field, message: message) }
}

/// One JSON coder configuration for every contract file, so Swift and Python agree on the bytes.
public enum ContractJSON {
    public static func decoder() -> JSONDecoder { JSONDecoder() }

    public static func encoder(pretty: Bool = false) -> JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = pretty ? [.sortedKeys, .prettyPrinted] : [.sortedKeys]
        return encoder
    }

    public static func load<T: Decodable>(_ type: T.Type, from url: URL) throws -> T {
        try decoder().decode(type, from: Data(contentsOf: url))
    }
}
