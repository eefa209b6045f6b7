//! What the watchers report, to whoever serves their health and metrics (the agent): traits defined
//! here and implemented there, so the watchers never name the agent.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

/// What the watchers tell whoever serves their health (the agent's `/healthz`), which lives outside
/// this module: it implements the trait, and the watchers never name it.
pub trait WatchObserver: Send + Sync {
    /// A change arrived at `at` that the datapath does not carry yet.
    fn queued(&self, at: SystemTime);
    /// Whether this node should receive load-balancer traffic, as last set.
    fn node_eligible(&self) -> bool;
    /// The Node object says whether this node is going away (kube-proxy's node eligibility).
    fn set_node_eligible(&self, eligible: bool);
    /// Registers an API watch called `name`: from `now` on it must show progress through the returned
    /// handle at least every `progress_timeout`, or it counts as blind.
    fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> Arc<dyn WatchProgress>;
    /// Why the watches cannot see the cluster as of `now`, if they cannot.
    fn blind(&self, now: SystemTime) -> Option<String>;
}

/// What the metrics learn as changes are queued and taken, outside this module (the agent's
/// `/metrics` implements it). kube-proxy sets its `_changes_pending` gauges and the last-queued
/// time in its change trackers as a change arrives, and zeroes the gauges when a sync takes the
/// changes, so a sync loop that hangs shows as changes pending and a last-queued time after the
/// last sync.
pub trait QueueObserver: Send + Sync {
    /// `services` and `endpoints` changes now wait for a sync; the latest was queued at `at`.
    fn queued(&self, services: u64, endpoints: u64, at: SystemTime);
    /// A sync took every pending change.
    fn taken(&self);
}

/// One API watch's reports (see [`WatchObserver::watch_source`]).
pub trait WatchProgress: Send + Sync {
    /// An event, a bookmark, or a watch the server accepted at `at`: current as of then.
    fn progress(&self, at: SystemTime);
    /// A list was asked for at `at`.
    fn listing(&self, at: SystemTime);
    /// A complete list at `at`.
    fn listed(&self, at: SystemTime);
    /// A list failed with `error`.
    fn list_failed(&self, error: &str);
    /// A watch request or stream failed (`error` says which and how).
    fn failed(&self, error: &str);
}
