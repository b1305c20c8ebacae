import Foundation

/// What the app does when iOS reports memory pressure, decided from kvcache.json's policy and the soak plan.
public enum PressureResponse: Equatable, Sendable {
    case nothing
    /// Drop this many of the oldest tokens after the first keep_tokens.
    case evict(tokens: Int)
    /// Stop generating, write the checkpoint and the end event.
    case stopAndSave
}

public struct PressureDecider: Sendable {
    public let policy: PressurePolicy
    public let keepTokens: Int
    public let pageTokens: Int
    public let onCritical: CriticalBehaviour

    public init(config: KVCacheConfig, onCritical: CriticalBehaviour = .stopAndSave) {
        self.policy = config.pressure
        self.keepTokens = config.keepTokens
        self.pageTokens = config.pageTokens
        self.onCritical = onCritical
    }

    public func respond(to level: PressureLevel, contextTokens: Int) -> PressureResponse {
        let action: PressureAction
        switch level {
        case .normal: return .nothing
        case .warning: action = policy.warning
        case .critical:
            // A soak that wants to run into jetsam keeps going: evict a page rather than stop.
            action = (onCritical == .continue && policy.critical == .stopAndSave) ? .evictOldestPages : policy.critical
        }
        switch action {
        case .none:
            return .nothing
        case .stopAndSave:
            return .stopAndSave
        case .evictOldestPages:
            let pages = max(1, policy.warningEvictPages)
            let tokens = Paging.tokensToEvict(
                context: contextTokens, keep: keepTokens, pageTokens: pageTokens, pages: pages)
            if tokens > 0 { return .evict(tokens: tokens) }
            // Nothing left to evict: at critical that means stopping is the only safe move.
            return level == .critical && onCritical == .stopAndSave ? .stopAndSave : .nothing
        }
    }
}

/// What the app writes when it stops on critical pressure or a failed allocation, so a later launch (or the
/// host) knows how far the run got. App-internal: the host reads the telemetry end event, not this file.
public struct SoakCheckpoint: Codable, Equatable, Sendable {
    public var runId: String
    public var contextTokens: Int
    public var reason: EndReason
    public var t: Double

    enum CodingKeys: String, CodingKey {
        case runId = "run_id"
        case contextTokens = "context_tokens"
        case reason, t
    }

    public init(runId: String, contextTokens: Int, reason: EndReason, t: Double) {
        self.runId = runId
        self.contextTokens = contextTokens
        self.reason = reason
        self.t = t
    }

    public func write(to url: URL) throws {
        try ContractJSON.encoder(pretty: true).encode(self).write(to: url, options: .atomic)
    }
}
