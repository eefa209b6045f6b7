//! The proxier's health: when changes were queued and last synced, whether the node may take traffic, and
//! how each API watch is faring. The watchers report through the `k8s` traits this implements.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use crate::k8s::api_watch::{WatchObserver, WatchProgress};

/// Failed lists in a row after which a watched kind counts as blind before its
/// progress timeout: it needs a list (it never had one, or the server said its
/// resourceVersion is gone, so changes are being missed) and cannot get one.
/// With kube-runtime's default backoff (0.8 s doubling, up to twice that with
/// its jitter) the fifth failure comes 12 to 24 s after the first.
pub const LIST_FAILURES_BLIND: u32 = 5;

/// Shared proxier health state; cheap to clone.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Mutex<HealthState>>,
}

struct HealthState {
    health_timeout: Duration,
    started: SystemTime,
    /// Time of the last successful sync, if any.
    last_updated: Option<SystemTime>,
    /// When the oldest change not yet applied was queued.
    oldest_pending: Option<SystemTime>,
    /// Whether the node may receive traffic (kube-proxy: not being deleted
    /// and not tainted ToBeDeletedByClusterAutoscaler). Only `/healthz` uses it.
    node_eligible: bool,
    /// The API watches, by name ("Service watch"). Only `/healthz` uses them.
    sources: BTreeMap<&'static str, SourceState>,
}

/// How one watched kind is faring.
struct SourceState {
    progress_timeout: Duration,
    /// The last complete list, event, bookmark or accepted watch (or when the
    /// watch was registered, before any).
    last_progress: SystemTime,
    /// Failed lists since the last complete one.
    list_failures: u32,
    last_list_error: String,
    /// What went wrong since the last progress, if anything.
    last_error: Option<String>,
    /// When the list under way was asked for.
    listing_since: Option<SystemTime>,
}

impl SourceState {
    /// Why this watch cannot see the cluster as of `now`, if it cannot.
    fn blind(&self, name: &str, now: SystemTime) -> Option<String> {
        if self.list_failures >= LIST_FAILURES_BLIND {
            return Some(format!(
                "{name}: list failed {} times: {}",
                self.list_failures, self.last_list_error
            ));
        }
        let silent = now.duration_since(self.last_progress).unwrap_or_default();
        if silent < self.progress_timeout {
            return None;
        }
        let mut reason = format!(
            "{name}: no list, event or bookmark for {} (limit {})",
            seconds(silent),
            seconds(self.progress_timeout)
        );
        if let Some(asked) = self.listing_since {
            let waited = now.duration_since(asked).unwrap_or_default();
            reason.push_str(&format!("; a list has waited {} for an answer", seconds(waited)));
        }
        if let Some(error) = &self.last_error {
            reason.push_str("; last error: ");
            reason.push_str(error);
        }
        Some(reason)
    }
}

/// `4s`, `2.5s`, `120s`: whole seconds when they are.
fn seconds(duration: Duration) -> String {
    if duration.subsec_millis() == 0 || duration >= Duration::from_secs(10) {
        format!("{}s", duration.as_secs())
    } else {
        format!("{:.1}s", duration.as_secs_f64())
    }
}

/// Result of [`Health::check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    /// No change has waited past the health timeout (kube-proxy's health).
    pub healthy: bool,
    /// Last successful sync, or the start time if there was none yet.
    pub last_updated: SystemTime,
    pub current_time: SystemTime,
    /// Why `healthy` is false.
    pub unsynced: Option<String>,
    /// Why the agent cannot see the cluster, if it cannot (`/healthz` only).
    pub blind: Option<String>,
    /// Set until the first successful sync (`/healthz` only): a node whose datapath holds nothing yet
    /// is not ready for traffic, but the process is alive.
    pub not_synced_yet: Option<String>,
}

impl Health {
    /// Healthy until a change stays pending for longer than `health_timeout`.
    /// The start time (reported as `last_updated` before the first sync) is now.
    pub fn new(health_timeout: Duration) -> Self {
        Health {
            inner: Arc::new(Mutex::new(HealthState {
                health_timeout,
                started: SystemTime::now(),
                last_updated: None,
                oldest_pending: None,
                node_eligible: true,
                sources: BTreeMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HealthState> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A change arrived at `at` that the datapath does not carry yet. The
    /// oldest pending time is kept until [`Health::updated`].
    pub fn queued(&self, at: SystemTime) {
        let mut state = self.lock();
        state.oldest_pending = Some(match state.oldest_pending {
            Some(oldest) => oldest.min(at),
            None => at,
        });
    }

    /// A sync completed successfully at `at`: every pending change is applied.
    pub fn updated(&self, at: SystemTime) {
        let mut state = self.lock();
        state.last_updated = Some(at);
        state.oldest_pending = None;
    }

    /// Mark whether this node should receive load-balancer traffic. While
    /// false, `/healthz` answers 503 (`/livez` is unaffected). Defaults to true.
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// Registers an API watch called `name` ("Service watch"): from `now` on,
    /// it must show progress through the returned handle at least every
    /// `progress_timeout`, or `/healthz` reports it blind.
    pub fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> SourceHealth {
        let source = SourceState {
            progress_timeout,
            last_progress: now,
            list_failures: 0,
            last_list_error: String::new(),
            last_error: None,
            listing_since: None,
        };
        self.lock().sources.insert(name, source);
        SourceHealth { health: self.clone(), name }
    }

    /// Why the agent cannot see the cluster as of `now`, if it cannot: every
    /// blind watch's reason.
    pub fn blind(&self, now: SystemTime) -> Option<String> {
        let state = self.lock();
        let reasons: Vec<String> =
            state.sources.iter().filter_map(|(name, source)| source.blind(name, now)).collect();
        (!reasons.is_empty()).then(|| reasons.join("; "))
    }

    /// Health as of `now`: unhealthy iff a change has been pending for at
    /// least the health timeout; and whether the agent is blind.
    pub fn check(&self, now: SystemTime) -> HealthReport {
        let blind = self.blind(now);
        let state = self.lock();
        // A pending time in the future (clock step) counts as just queued.
        let waited = state.oldest_pending.map(|oldest| now.duration_since(oldest).unwrap_or_default());
        let unsynced = waited.filter(|waited| *waited >= state.health_timeout).map(|waited| {
            format!(
                "a change has waited {} for a successful sync (limit {})",
                seconds(waited),
                seconds(state.health_timeout)
            )
        });
        let not_synced_yet = state.last_updated.is_none().then(|| {
            let since = now.duration_since(state.started).unwrap_or_default();
            format!("no sync has been programmed yet (started {} ago)", seconds(since))
        });
        HealthReport {
            healthy: unsynced.is_none(),
            last_updated: state.last_updated.unwrap_or(state.started),
            current_time: now,
            unsynced,
            blind,
            not_synced_yet,
        }
    }
}

/// One API watch's handle on the health state (see [`Health::watch_source`]).
#[derive(Clone)]
pub struct SourceHealth {
    health: Health,
    name: &'static str,
}

impl SourceHealth {
    fn update(&self, change: impl FnOnce(&mut SourceState)) {
        if let Some(source) = self.health.lock().sources.get_mut(self.name) {
            change(source);
        }
    }

    /// An event, a bookmark, or a watch the server accepted at `at`: the
    /// agent is current as of then.
    pub fn progress(&self, at: SystemTime) {
        self.update(|source| {
            source.last_progress = source.last_progress.max(at);
            source.last_error = None;
        });
    }

    /// A list was asked for at `at`.
    pub fn listing(&self, at: SystemTime) {
        self.update(|source| source.listing_since = Some(at));
    }

    /// A complete list at `at`: the snapshot was replaced.
    pub fn listed(&self, at: SystemTime) {
        self.progress(at);
        self.update(|source| {
            source.list_failures = 0;
            source.listing_since = None;
        });
    }

    /// A list failed with `error`.
    pub fn list_failed(&self, error: &str) {
        self.update(|source| {
            source.listing_since = None;
            source.list_failures += 1;
            source.last_list_error = error.to_owned();
            source.last_error = Some(format!("list failed: {error}"));
        });
    }

    /// A watch request or stream failed (`error` says which and how).
    pub fn failed(&self, error: &str) {
        self.update(|source| source.last_error = Some(error.to_owned()));
    }
}

/// The API watchers report through [`WatchObserver`] (defined beside them, in `k8s`), so that they
/// never import the agent.
impl WatchObserver for Health {
    fn queued(&self, at: SystemTime) {
        Health::queued(self, at);
    }

    fn node_eligible(&self) -> bool {
        Health::node_eligible(self)
    }

    fn set_node_eligible(&self, eligible: bool) {
        Health::set_node_eligible(self, eligible);
    }

    fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> Arc<dyn WatchProgress> {
        Arc::new(Health::watch_source(self, name, progress_timeout, now))
    }

    fn blind(&self, now: SystemTime) -> Option<String> {
        Health::blind(self, now)
    }
}

impl WatchProgress for SourceHealth {
    fn progress(&self, at: SystemTime) {
        SourceHealth::progress(self, at);
    }

    fn listing(&self, at: SystemTime) {
        SourceHealth::listing(self, at);
    }

    fn listed(&self, at: SystemTime) {
        SourceHealth::listed(self, at);
    }

    fn list_failed(&self, error: &str) {
        SourceHealth::list_failed(self, error);
    }

    fn failed(&self, error: &str) {
        SourceHealth::failed(self, error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn healthy_initially_and_reports_start_time() {
        let before = SystemTime::now();
        let health = Health::new(Duration::from_secs(60));
        let report = health.check(SystemTime::now() + Duration::from_secs(3600));
        assert!(report.healthy, "nothing queued yet must be healthy");
        assert!(report.last_updated >= before && report.last_updated <= SystemTime::now());
        assert!(health.node_eligible());
    }

    #[test]
    fn unhealthy_when_pending_past_timeout_then_healthy_after_update() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        health.queued(t0);
        // Later changes do not move the oldest pending time forward...
        health.queued(t0 + Duration::from_secs(50));
        assert!(health.check(t0 + Duration::from_secs(59)).healthy);
        let late = health.check(t0 + Duration::from_secs(60));
        assert!(!late.healthy);
        assert_eq!(late.current_time, t0 + Duration::from_secs(60));
        // ...but an earlier-stamped one moves it back.
        health.queued(t0 - Duration::from_secs(30));
        assert!(!health.check(t0 + Duration::from_secs(35)).healthy);
        // A clock step back is not a timeout.
        assert!(health.check(t0 - Duration::from_secs(100)).healthy);

        let synced = t0 + Duration::from_secs(61);
        health.updated(synced);
        let report = health.check(t0 + Duration::from_secs(1000));
        assert!(report.healthy);
        assert_eq!(report.last_updated, synced);

        // The timeout restarts from the next queued change.
        health.queued(t0 + Duration::from_secs(2000));
        assert!(health.check(t0 + Duration::from_secs(2059)).healthy);
        assert!(!health.check(t0 + Duration::from_secs(2061)).healthy);
        assert_eq!(health.check(t0).last_updated, synced);
    }

    #[test]
    fn a_watch_without_progress_for_its_timeout_is_blind_until_it_shows_progress() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        let services = health.watch_source("Service watch", Duration::from_secs(4), t0);
        health.watch_source("EndpointSlice watch", Duration::from_secs(4), t0 + Duration::from_secs(100));
        assert_eq!(health.blind(t0 + Duration::from_millis(3_900)), None);
        assert_eq!(
            health.blind(t0 + Duration::from_secs(4)).as_deref(),
            Some("Service watch: no list, event or bookmark for 4s (limit 4s)")
        );
        services.failed("watch: client error (Connect): Connection refused");
        let report = health.check(t0 + Duration::from_millis(6_500));
        assert_eq!(
            report.blind.as_deref(),
            Some(
                "Service watch: no list, event or bookmark for 6.5s (limit 4s); \
                 last error: watch: client error (Connect): Connection refused"
            )
        );
        // Blindness is not kube-proxy's sync health (/livez).
        assert!(report.healthy && report.unsynced.is_none(), "{report:?}");

        // A bookmark (or an event, or an accepted watch) and it sees again, error forgotten.
        services.progress(t0 + Duration::from_secs(7));
        assert_eq!(health.blind(t0 + Duration::from_secs(10)), None);
        // Both watches blind: both named.
        let both = health.blind(t0 + Duration::from_secs(104)).unwrap();
        assert!(
            both.starts_with("EndpointSlice watch: no list") && both.contains("; Service watch: no list"),
            "{both}"
        );
        // A progress report older than the last one does not move it back.
        services.progress(t0);
        assert!(health.blind(t0 + Duration::from_secs(10)).is_none());
    }

    #[test]
    fn lists_that_keep_failing_are_blind_before_the_timeout_and_a_list_clears_them() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        let services = health.watch_source("Service watch", Duration::from_secs(120), t0);
        let error = "500 Internal Server Error: an error on the server";
        for _ in 1..LIST_FAILURES_BLIND {
            services.list_failed(error);
        }
        assert_eq!(health.blind(t0 + Duration::from_secs(1)), None);
        services.list_failed(error);
        assert_eq!(
            health.blind(t0 + Duration::from_secs(1)).as_deref(),
            Some("Service watch: list failed 5 times: 500 Internal Server Error: an error on the server")
        );
        // Watch progress alone does not clear it: the agent still needs a list.
        services.progress(t0 + Duration::from_secs(2));
        assert!(health.blind(t0 + Duration::from_secs(2)).is_some());
        services.listed(t0 + Duration::from_secs(3));
        assert_eq!(health.blind(t0 + Duration::from_secs(3)), None);
        // A list under way is named.
        services.listing(t0 + Duration::from_secs(195));
        let reason = health.blind(t0 + Duration::from_secs(200)).unwrap();
        assert!(reason.contains("(limit 120s); a list has waited 5s for an answer"), "{reason}");
        // Past the timeout the last list error is named.
        services.list_failed(error);
        let reason = health.blind(t0 + Duration::from_secs(200)).unwrap();
        assert!(reason.ends_with(&format!("last error: list failed: {error}")), "{reason}");
    }

    #[test]
    fn an_unsynced_change_is_named_in_the_report() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        health.queued(t0);
        let report = health.check(t0 + Duration::from_secs(65));
        assert!(!report.healthy);
        assert_eq!(
            report.unsynced.as_deref(),
            Some("a change has waited 65s for a successful sync (limit 60s)")
        );
        assert_eq!(report.blind, None);
    }
}
