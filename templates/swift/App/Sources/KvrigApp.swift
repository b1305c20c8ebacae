import SwiftUI

@main
struct KvrigGeneratedApp: App {
    @State private var engine = Engine()
    @Environment(\.scenePhase) private var scenePhase

    var body: some Scene {
        WindowGroup {
            ChatView(engine: engine)
                .task { await engine.start(arguments: ProcessInfo.processInfo.arguments) }
                // iOS aborts an app that submits GPU work from the background: the engine stops before its next
                // forward pass whenever the scene is not active, and goes on when it is again.
                .onChange(of: scenePhase) { _, phase in engine.sceneChanged(active: phase == .active) }
        }
    }
}
