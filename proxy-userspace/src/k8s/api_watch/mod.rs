//! Where Services and EndpointSlices come from: the API server (kube-rs
//! watchers, the way kube-proxy's informers see them) or manifests on disk.
//! Both keep a [`Snapshot`] and wake the sync loop through [`Changes`].
//!
//! Files: this one (the label selector, [`WatchOptions`]), `changes` (the snapshot and the
//! changes the sync loop takes), `observer` (what the watchers report to health and metrics),
//! `watchers` (one task per watched kind), `reflect` (list, then watch from the list's version).

mod changes;
mod observer;
mod reflect;
mod watchers;

use std::time::Duration;

pub use changes::{Changes, Kinded, ObjectKey, ObjectMap, Objects, Pending, Replaced, Snapshot};
pub use observer::{QueueObserver, WatchObserver, WatchProgress};
pub(crate) use reflect::describe;
pub use watchers::{node_primary_ipv4, watch_cluster};

// The watchers' client comes from where the API server is decided (one place for agent, diff, doctor).
pub use crate::k8s::api_endpoint::{KubeOptions, client};
use crate::k8s::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};

/// The label selector of the Services and EndpointSlices this agent lists: kube-proxy's
/// (`!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`: those that name
/// another proxy, or are headless, are not even listed), or, with `--service-proxy-name NAME`, only
/// those labelled with that name. The EndpointSlice controller copies a Service's labels to its
/// slices, so one selector serves both kinds; a Service whose label is removed stops matching and
/// the watch reports it deleted, which hands it back to the default proxy.
pub fn label_selector(service_proxy_name: Option<&str>) -> String {
    match service_proxy_name.filter(|name| !name.is_empty()) {
        Some(name) => format!("{LABEL_SERVICE_PROXY_NAME}={name},!{LABEL_HEADLESS}"),
        None => format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"),
    }
}

/// How the API watches judge their own progress (`--api-progress-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchOptions {
    /// A watched kind with no complete list, event, bookmark or accepted watch
    /// for this long makes `/healthz` answer 503. A real API server sends a
    /// bookmark on every watch at least once a minute (the watch cache's
    /// bookmark timer) and ends each watch at its `timeoutSeconds`, half of
    /// this, so a connected agent shows progress well within it.
    pub progress_timeout: Duration,
}

/// Twice the watch cache's bookmark period.
pub const DEFAULT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(120);

impl Default for WatchOptions {
    fn default() -> Self {
        Self { progress_timeout: DEFAULT_PROGRESS_TIMEOUT }
    }
}

impl WatchOptions {
    /// `timeoutSeconds` of each watch: half the progress timeout, so even a
    /// server without periodic bookmarks ends each watch (and the agent opens
    /// the next) within it; at most kube-runtime's 290 s.
    fn watch_timeout_secs(&self) -> u32 {
        (self.progress_timeout.as_secs() / 2).clamp(1, 290) as u32
    }

    /// A watch silent this long (no event, no bookmark, past the end the
    /// server was asked for) is presumed dead and opened again.
    fn idle_cutoff(&self) -> Duration {
        self.progress_timeout + self.progress_timeout / 2
    }
}
