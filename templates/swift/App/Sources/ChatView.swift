import KvrigCore
import SwiftUI

struct ChatView: View {
    @Bindable var engine: Engine
    @State private var draft = ""

    var body: some View {
        VStack(spacing: 0) {
            MetricsStrip(metrics: engine.metrics)
            Divider()
            ScrollViewReader { proxy in
                ScrollView {
                    LazyVStack(alignment: .leading, spacing: 12) {
                        ForEach(engine.messages) { message in
                            MessageRow(message: message)
                                .id(message.id)
                        }
                    }
                    .padding()
                }
                .onChange(of: engine.messages.last?.text) {
                    if let last = engine.messages.last { proxy.scrollTo(last.id, anchor: .bottom) }
                }
            }
            Divider()
            Text(engine.status)
                .font(.caption)
                .foregroundStyle(.secondary)
                .frame(maxWidth: .infinity, alignment: .leading)
                .padding(.horizontal)
                .padding(.top, 4)
            HStack {
                TextField("Message", text: $draft, axis: .vertical)
                    .textFieldStyle(.roundedBorder)
                    .lineLimit(1 ... 4)
                if engine.isGenerating {
                    Button("Stop") { engine.stop() }
                } else {
                    Button("Send") {
                        let prompt = draft
                        draft = ""
                        Task { await engine.send(prompt) }
                    }
                    .disabled(draft.isEmpty || !engine.isReady)
                }
                Button("New") { Task { await engine.newChat() } }
                    .disabled(engine.isGenerating)
            }
            .padding()
        }
        .navigationTitle(AppConfig.displayName)
    }
}

struct MessageRow: View {
    let message: ChatMessage

    var body: some View {
        VStack(alignment: .leading, spacing: 4) {
            Text(message.role == .user ? "You" : AppConfig.displayName)
                .font(.caption.bold())
                .foregroundStyle(.secondary)
            Text(message.text)
                .textSelection(.enabled)
        }
        .frame(maxWidth: .infinity, alignment: .leading)
    }
}

/// The live numbers a soak is about: speed, what jetsam compares (footprint), room left, context and KV size.
struct MetricsStrip: View {
    let metrics: LiveMetrics

    var body: some View {
        HStack(spacing: 12) {
            Metric(label: "tok/s", value: metrics.decodeTps.map { String(format: "%.1f", $0) } ?? "–")
            Metric(label: "footprint", value: Self.bytes(metrics.footprintBytes))
            Metric(label: "available", value: metrics.availableBytes.map(Self.bytes) ?? "–")
            Metric(label: "context", value: "\(metrics.contextTokens)")
            Metric(label: "KV", value: Self.bytes(metrics.kvBytes))
        }
        .padding(.horizontal)
        .padding(.vertical, 6)
        .background(.thinMaterial)
    }

    static func bytes(_ n: Int) -> String {
        ByteCountFormatter.string(fromByteCount: Int64(n), countStyle: .memory)
    }
}

struct Metric: View {
    let label: String
    let value: String

    var body: some View {
        VStack(spacing: 2) {
            Text(value).font(.caption.monospacedDigit().bold())
            Text(label).font(.caption2).foregroundStyle(.secondary)
        }
        .frame(maxWidth: .infinity)
    }
}
