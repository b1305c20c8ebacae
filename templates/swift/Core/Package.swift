// swift-tools-version: 5.9
// Core of the generated app: contracts (kvcache.json, soak plan, telemetry), page and budget arithmetic and
// the memory-pressure policy. Foundation only, so it builds and is tested on Linux without a network.
import PackageDescription

let package = Package(
    name: "KvrigCore",
    platforms: [.iOS(.v17), .macOS(.v14)],
    products: [
        .library(name: "KvrigCore", targets: ["KvrigCore"])
    ],
    targets: [
        .target(name: "KvrigCore", path: "Sources/KvrigCore"),
        .testTarget(
            name: "KvrigCoreTests",
            dependencies: ["KvrigCore"],
            path: "Tests/KvrigCoreTests",
            exclude: ["Fixtures"]
        ),
    ]
)
