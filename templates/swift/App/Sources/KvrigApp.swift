import SwiftUI

@main
struct KvrigGeneratedApp: App {
    @State private var engine = Engine()

    var body: some Scene {
        WindowGroup {
            ChatView(engine: engine)
                .task { await engine.start(arguments: ProcessInfo.processInfo.arguments) }
        }
    }
}
