import Foundation
import KvrigCore

#if canImport(BackgroundTasks) && os(iOS)
import BackgroundTasks
#endif

// Every use of BGContinuedProcessingTask below also needs `compiler(>=6.2)`: the type is in the iOS 26 SDK, which
// ships with Xcode 26 (Swift 6.2), and `@available` cannot hide a type the SDK lacks. An Xcode 16 build has no task.

/// Whether the engine may submit GPU work now. iOS aborts an app that commits Metal work from the background
/// ("Insufficient Permission (to submit GPU work from background)"), so the token loop asks before every forward
/// pass: in the foreground it goes on; in the background it waits until the scene is active again, unless a
/// continued-processing task holds the GPU (iOS 26+, where `BGTaskScheduler.supportedResources` has `.gpu`);
/// when that task ends while the app is away, the run ends (cleanly: the loop stops, the soak writes its end).
/// The work in flight when the scene changes finishes; nothing new is submitted.
final class GPUGate: @unchecked Sendable {
    static let shared = GPUGate()

    enum Verdict { case submit, end }

    private let condition = NSCondition()
    private var foreground = true
    private var gpuTask = false
    private var taskEnded = false
    private var away = false  // a background phase the loop has already reported

    /// The scene left the foreground (`active == false`: SwiftUI's inactive and background alike) or came back.
    func setForeground(_ active: Bool) {
        condition.lock()
        foreground = active
        condition.broadcast()
        condition.unlock()
    }

    /// A continued-processing task with the GPU resource runs (true) or has completed (false).
    func setGPUTask(_ held: Bool) {
        condition.lock()
        gpuTask = held
        condition.broadcast()
        condition.unlock()
    }

    /// The continued-processing task expired (or the person cancelled it): GPU work in the background stops.
    func taskExpired() {
        condition.lock()
        gpuTask = false
        taskEnded = true
        condition.broadcast()
        condition.unlock()
    }

    /// True once a run ended because its continued-processing task expired while the app was away.
    var endedInBackground: Bool {
        condition.lock()
        defer { condition.unlock() }
        return taskEnded && !foreground
    }

    /// A new run: the scene as it is, no task yet.
    func reset() {
        condition.lock()
        gpuTask = false
        taskEnded = false
        away = false
        condition.unlock()
    }

    /// Before a forward pass of `phase`: blocks while the app is in the background without a task holding the
    /// GPU; `.end` when the task ended while it is away. `report` hears each change the loop acts on.
    func admit(_ phase: GPUPhase, report: (SceneState, SceneGPU) -> Void) -> Verdict {
        condition.lock()
        defer { condition.unlock() }
        if !foreground && !away {
            away = true
            report(.background, gpuTask ? .continued : .paused)
        }
        while !foreground && !gpuTask && !taskEnded {
            condition.wait()
        }
        if !foreground && taskEnded {
            return .end
        }
        if foreground && away {
            away = false
            taskEnded = false
            report(.active, .resumed)
        }
        return .submit
    }
}

/// iOS 26's continued-processing task for a soak: submitted from the foreground as the soak starts, with the GPU
/// resource where the device supports it (asked at run time), its progress one unit per soak step.
enum ContinuedProcessing {
    /// `BGTaskScheduler.supportedResources` has `.gpu`: this device can run GPU work in such a task.
    static var supportsBackgroundGPU: Bool {
        #if canImport(BackgroundTasks) && os(iOS) && compiler(>=6.2)
        if #available(iOS 26.0, *) {
            return BGTaskScheduler.supportedResources.contains(.gpu)
        }
        #endif
        return false
    }

    /// Registers and submits the task (identifier `<bundle id>.soak.<run>`, under Info.plist's
    /// `BGTaskSchedulerPermittedIdentifiers` wildcard); false where there is none (before iOS 26, or refused).
    @MainActor static func begin(runId: String, steps: Int) -> Bool {
        #if canImport(BackgroundTasks) && os(iOS) && compiler(>=6.2)
        if #available(iOS 26.0, *) {
            return SoakTask.shared.begin(runId: runId, steps: steps)
        }
        #endif
        return false
    }

    /// One soak step done (the system shows the progress and ends tasks that make none first).
    static func advance() {
        #if canImport(BackgroundTasks) && os(iOS) && compiler(>=6.2)
        if #available(iOS 26.0, *) {
            SoakTask.shared.advance()
        }
        #endif
    }

    /// The soak ended: the task completes and the GPU is no longer held.
    static func finish(success: Bool) {
        #if canImport(BackgroundTasks) && os(iOS) && compiler(>=6.2)
        if #available(iOS 26.0, *) {
            SoakTask.shared.finish(success: success)
        }
        #endif
        GPUGate.shared.setGPUTask(false)
    }
}

#if canImport(BackgroundTasks) && os(iOS) && compiler(>=6.2)
@available(iOS 26.0, *)
private final class SoakTask: @unchecked Sendable {
    static let shared = SoakTask()
    private let lock = NSLock()
    private var task: BGContinuedProcessingTask?

    func begin(runId: String, steps: Int) -> Bool {
        let base = Bundle.main.bundleIdentifier ?? "kvrig"
        let safeRun = String(runId.unicodeScalars.filter { CharacterSet.alphanumerics.contains($0) }.prefix(32))
        let identifier = "\(base).soak.\(safeRun.isEmpty ? "run" : safeRun)"
        let gpu = BGTaskScheduler.supportedResources.contains(.gpu)
        // Continued-processing registrations may come after launch (the one task type exempt from that rule).
        _ = BGTaskScheduler.shared.register(forTaskWithIdentifier: identifier, using: nil) { [weak self] task in
            guard let continued = task as? BGContinuedProcessingTask else {
                task.setTaskCompleted(success: false)
                return
            }
            continued.progress.totalUnitCount = Int64(max(1, steps))
            continued.expirationHandler = {
                Log.app.notice("continued-processing task expired: GPU work in the background stops")
                GPUGate.shared.taskExpired()
                self?.finish(success: false)
            }
            self?.hold(continued)
            GPUGate.shared.setGPUTask(gpu)
        }
        let request = BGContinuedProcessingTaskRequest(identifier: identifier, title: "Soak", subtitle: runId)
        request.strategy = .fail  // now or not at all: a soak started later measures something else
        if gpu {
            request.requiredResources = .gpu
        }
        do {
            try BGTaskScheduler.shared.submit(request)
            Log.app.notice("continued-processing task submitted (\(gpu ? "with" : "without") the GPU)")
            return true
        } catch {
            Log.app.error("continued-processing task refused: \(String(describing: error))")
            return false
        }
    }

    private func hold(_ continued: BGContinuedProcessingTask) {
        lock.lock()
        task = continued
        lock.unlock()
    }

    func advance() {
        lock.lock()
        defer { lock.unlock() }
        guard let task else { return }
        task.progress.completedUnitCount = min(task.progress.totalUnitCount, task.progress.completedUnitCount + 1)
    }

    func finish(success: Bool) {
        lock.lock()
        let finished = task
        task = nil
        lock.unlock()
        finished?.setTaskCompleted(success: success)
    }
}
#endif
