// The generated app's engine without its SwiftUI views, run headless on a host (Linux): loads a bundle,
// applies kvcache.json, runs a soak plan or chat turns with the same Engine, CacheSet and TokenLoop the
// phone runs, and writes the same telemetry JSONL. Not part of the iPhone target.
//
//   kvrig-engine --bundle DIR [--documents DIR] [--kvrig-soak-plan FILE] [--chat TEXT]... [--temperature T]
//                [--max-tokens N] [--print-tokens] [--host-kernel] [--no-float32] [--exit-when-done]
//   kvrig-engine --probe-buffer-cache BYTES   (prints what MLX's buffer cache keeps with that cap, as JSON)
//   kvrig-engine --attention-probe KVCACHE_JSON IN.safetensors OUT.safetensors   (see AttentionProbe)
//
// --host-kernel: speak the virtual iPhone's JSON-line channel on stdin/stdout (kvrig/virtual/apprun.py):
// a measurement after every step, the kernel's verdict back (footprint, available, pressure). The measurement
// carries the phone's residency: weights the phone maps (mapped_weight_bytes), which the kernel does not charge.
import Foundation
import KvrigCore
import MLX

let options: RunnerOptions
do {
    options = try RunnerOptions(CommandLine.arguments.dropFirst())
} catch {
    FileHandle.standardError.write(Data("kvrig-engine: \(error)\n".utf8))
    exit(2)
}

if let limit = options.probeBufferCache {
    let line = try JSONSerialization.data(withJSONObject: BufferCacheProbe.run(limit: limit), options: [.sortedKeys])
    FileHandle.standardOutput.write(line + Data("\n".utf8))
    exit(0)
}

if let probe = options.attentionProbe {
    do {
        try AttentionProbe.run(config: probe.config, input: probe.input, output: probe.output)
    } catch {
        FileHandle.standardError.write(Data("kvrig-engine: \(error)\n".utf8))
        exit(2)
    }
    exit(0)
}

let host = RunnerHost(options: options)
if options.hostKernel {
    let channel = ChannelKernel()
    KernelHub.shared.attach(channel)
    LogSink.shared.redirect { category, text in channel.log(category: category, text: text) }
    Log.app.notice("kvrig-engine: the app's Swift engine, compiled for this host against MLX Swift")
}
let engine = Engine(host: host)
engine.chatTemperature = options.temperature
engine.chatMaxTokens = options.maxTokens
await engine.start(arguments: options.engineArguments)
if !engine.isReady {
    FileHandle.standardError.write(Data("kvrig-engine: \(engine.status)\n".utf8))
    if options.exitWhenDone { exit(3) }
}
for prompt in options.chat where engine.isReady {
    let collected = TokenCollector()
    let onToken: (@Sendable (Int) -> Void)? = options.printTokens ? { @Sendable token in collected.append(token) } : nil
    await engine.send(prompt, onToken: onToken)
    if options.printTokens {
        let line = try JSONSerialization.data(withJSONObject: ["prompt": prompt, "tokens": collected.tokens] as [String: Any])
        FileHandle.standardOutput.write(line + Data("\n".utf8))
    }
}
if !options.exitWhenDone {
    // Like an app left in the foreground: stays until killed or its channel closes.
    while readLine() != nil {}
}
exit(0)
