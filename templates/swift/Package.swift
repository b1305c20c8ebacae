// swift-tools-version: 6.0
// A Linux (CPU) build of this app's engine: every App source except the SwiftUI views, the Core package,
// and the headless runner `kvrig-engine` (Runner/, not part of the iPhone target), against the real MLX Swift,
// mlx-swift-lm and swift-transformers. The iPhone app itself is built from project.yml with Xcode.
//
// KVRIG_SWIFT_DEPS: folder holding mlx-swift, mlx-swift-lm and swift-transformers sources that build on
// Linux (kvrig's build passes it). KVRIG_SWIFT_LANGUAGE_MODE: 5 (what the Xcode project uses) or 6.
import PackageDescription

let deps = Context.environment["KVRIG_SWIFT_DEPS"] ?? "../swift-deps"
let mode: SwiftLanguageMode = Context.environment["KVRIG_SWIFT_LANGUAGE_MODE"] == "6" ? .v6 : .v5

let package = Package(
    name: "KvrigEngine",
    platforms: [.macOS(.v14), .iOS(.v17)],
    products: [.executable(name: "kvrig-engine", targets: ["kvrig-engine"])],
    dependencies: [
        .package(path: "Core"),
        .package(path: "\(deps)/mlx-swift"),
        .package(path: "\(deps)/mlx-swift-lm"),
        .package(path: "\(deps)/swift-transformers"),
    ],
    targets: [
        .executableTarget(
            name: "kvrig-engine",
            dependencies: [
                .product(name: "KvrigCore", package: "Core"),
                .product(name: "MLX", package: "mlx-swift"),
                .product(name: "MLXNN", package: "mlx-swift"),
                .product(name: "MLXLLM", package: "mlx-swift-lm"),
                .product(name: "MLXLMCommon", package: "mlx-swift-lm"),
                .product(name: "Tokenizers", package: "swift-transformers"),
            ],
            path: ".",
            exclude: ["App/Sources/ChatView.swift", "App/Sources/KvrigApp.swift"],
            sources: ["App/Sources", "Runner/Sources"],
            swiftSettings: [.swiftLanguageMode(mode)]
        )
    ]
)
