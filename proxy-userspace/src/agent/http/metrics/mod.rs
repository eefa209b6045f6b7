//! Prometheus metrics in kube-proxy's names, rendered in the text exposition
//! format 0.0.4.
//!
//! The kube-proxy families (`kubeproxy_*`) keep kube-proxy 1.34's names, types,
//! labels and buckets byte for byte, so that existing dashboards and alerts keep
//! working when kproxy replaces kube-proxy; the `kproxy_*` families describe the
//! eBPF datapath, and the `process_*` ones are every Prometheus client's process
//! collector. docs/metrics.md lists them all, and the kube-proxy families left out.
//!
//! There is no registry: [`Metrics`] is a fixed set of families behind one
//! mutex, cheap to clone and to update from the sync loop, and [`Metrics::render`]
//! writes the whole exposition at scrape time (why not a Prometheus crate:
//! docs/metrics.md).
//!
//! [`exposition`] writes the text format (and holds the histogram), [`kube_proxy`], [`kproxy`] and
//! [`process`] each write their families, and this file holds the state they read and the updates.

mod exposition;
mod kproxy;
mod kube_proxy;
mod process;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::k8s::api_watch::QueueObserver;
use crate::model::{Frontend, Scope};

pub use exposition::{Histogram, escape_label_value, exponential_buckets, format_float};
pub use kube_proxy::{Probe, count_probe, network_programming_buckets, sync_duration_buckets};
pub use process::ProcessStats;

/// `Content-Type` of the Prometheus text exposition format served on `/metrics`.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The version kproxy was built as (the crate's).
pub const BUILD_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit kproxy was built from: `git rev-parse --short HEAD` when built in a
/// checkout (or `KPROXY_GIT_COMMIT` when the build sets it), else `unknown` (build.rs).
pub const BUILD_COMMIT: &str = env!("KPROXY_GIT_COMMIT");

/// Shared, cheaply clonable metric set; every method locks briefly.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    sync_duration: Histogram,
    /// The syncs that re-read the datapath's maps and rewrote what differs (the
    /// first one and every `--sync-period`), and the ones that applied changes.
    sync_full_duration: Histogram,
    sync_partial_duration: Histogram,
    network_programming: Histogram,
    /// Service ports with a Local policy and endpoints only on other nodes, by
    /// `traffic_policy` (internal, external), per family (IPv4, IPv6).
    no_local_endpoints: [(u64, u64); 2],
    /// Service ports whose endpoints topology hints narrowed, per family: (same zone, same node).
    topology_narrowed: [(u64, u64); 2],
    /// The purge of removed UDP backends' conntrack entries, kproxy's conntrack
    /// reconciler; what it deletes is `purged_total`.
    ct_reconcile_duration: Histogram,
    last_sync_timestamp: f64,
    last_queued_timestamp: f64,
    endpoint_changes_pending: u64,
    endpoint_changes_total: u64,
    service_changes_pending: u64,
    service_changes_total: u64,
    sync_errors_total: u64,
    /// map name → (entries, capacity)
    maps: BTreeMap<String, (u64, u64)>,
    /// reason → packets
    datapath_packets: BTreeMap<String, u64>,
    frontends: u64,
    backends: u64,
    gc_runs_total: u64,
    /// conntrack state → entries deleted by GC
    gc_deleted: BTreeMap<String, u64>,
    gc_interval_seconds: f64,
    /// entries deleted at once for removed UDP backends
    purged_total: u64,
    /// the same, per family (IPv4, IPv6): kube-proxy's reconciler counts per family
    purged_by_family: [u64; 2],
    affinity_gc_deleted_total: u64,
    /// Connections netfilter translated before kproxy took over, still open.
    inherited_open: u64,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            sync_duration: Histogram::new(sync_duration_buckets()),
            sync_full_duration: Histogram::new(sync_duration_buckets()),
            sync_partial_duration: Histogram::new(sync_duration_buckets()),
            network_programming: Histogram::new(network_programming_buckets()),
            no_local_endpoints: [(0, 0); 2],
            topology_narrowed: [(0, 0); 2],
            ct_reconcile_duration: Histogram::new(sync_duration_buckets()),
            last_sync_timestamp: 0.0,
            last_queued_timestamp: 0.0,
            endpoint_changes_pending: 0,
            endpoint_changes_total: 0,
            service_changes_pending: 0,
            service_changes_total: 0,
            sync_errors_total: 0,
            maps: BTreeMap::new(),
            datapath_packets: BTreeMap::new(),
            frontends: 0,
            backends: 0,
            gc_runs_total: 0,
            gc_deleted: BTreeMap::new(),
            gc_interval_seconds: 0.0,
            purged_total: 0,
            purged_by_family: [0; 2],
            affinity_gc_deleted_total: 0,
            inherited_open: 0,
        }
    }
}

/// kube-proxy's pending gauges and last-queued time follow the change trackers: set as a change
/// arrives, the gauges zeroed when a sync takes the changes.
impl QueueObserver for Metrics {
    fn queued(&self, services: u64, endpoints: u64, at: SystemTime) {
        let mut inner = self.lock();
        inner.service_changes_pending = services;
        inner.endpoint_changes_pending = endpoints;
        inner.last_queued_timestamp = unix_seconds(at);
    }

    fn taken(&self) {
        let mut inner = self.lock();
        inner.service_changes_pending = 0;
        inner.endpoint_changes_pending = 0;
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the plain counters in a
        // state worth refusing to report.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A rule sync took `duration` and finished successfully at `finished_at`;
    /// `full` when it re-read the maps and rewrote what differs (kube-proxy's
    /// full sync), not only applied the changes queued since the last one.
    pub fn observe_sync(&self, duration: Duration, finished_at: SystemTime, full: bool) {
        let mut inner = self.lock();
        inner.sync_duration.observe_duration(duration);
        if full {
            inner.sync_full_duration.observe_duration(duration);
        } else {
            inner.sync_partial_duration.observe_duration(duration);
        }
        inner.last_sync_timestamp = unix_seconds(finished_at);
    }

    /// kube-proxy's `sync_proxy_rules_no_local_endpoints_total` from the
    /// frontends just programmed: Service ports whose Local traffic policy finds
    /// no endpoint on this node while some exist elsewhere (so they drop),
    /// counted once per Service port as kube-proxy does, not once per address
    /// (cluster IPs, node ports, external and load-balancer IPs) they answer on;
    /// per family, as each of kube-proxy's proxiers counts the ports it programs
    /// (a dual-stack Service's port in both).
    pub fn set_no_local_endpoints(&self, frontends: &[Frontend]) {
        let mut internal = [BTreeSet::new(), BTreeSet::new()];
        let mut external = [BTreeSet::new(), BTreeSet::new()];
        for frontend in frontends.iter().filter(|f| f.no_local_endpoints) {
            let family = kube_proxy::family_index(&frontend.vip);
            let service_port = (&frontend.service, frontend.port_name.as_str(), frontend.proto);
            match frontend.scope {
                Scope::Internal => internal[family].insert(service_port),
                Scope::External => external[family].insert(service_port),
            };
        }
        self.lock().no_local_endpoints =
            [0, 1].map(|family| (internal[family].len() as u64, external[family].len() as u64));
    }

    /// Service ports whose endpoints topology hints narrowed, per family (IPv4, IPv6):
    /// `(PreferSameZone, PreferSameNode)` (`agent::topology`).
    pub fn set_topology_narrowed(&self, per_family: [(u64, u64); 2]) {
        self.lock().topology_narrowed = per_family;
    }

    /// One run of the conntrack reconciler (the purge of removed UDP backends'
    /// entries, counted by [`Metrics::add_conntrack_purged`]) took `duration`.
    pub fn observe_conntrack_reconcile(&self, duration: Duration) {
        self.lock().ct_reconcile_duration.observe_duration(duration);
    }

    /// Time from an endpoints change in the API server to the datapath
    /// carrying it.
    pub fn observe_network_programming(&self, latency: Duration) {
        self.lock().network_programming.observe_duration(latency);
    }

    /// Count newly received changes.
    pub fn add_changes(&self, endpoints: u64, services: u64) {
        let mut inner = self.lock();
        inner.endpoint_changes_total = inner.endpoint_changes_total.saturating_add(endpoints);
        inner.service_changes_total = inner.service_changes_total.saturating_add(services);
    }

    pub fn inc_sync_errors(&self, n: u64) {
        let mut inner = self.lock();
        inner.sync_errors_total = inner.sync_errors_total.saturating_add(n);
    }

    /// Occupancy of one BPF map.
    pub fn set_map_usage(&self, map: &str, entries: u64, capacity: u64) {
        self.lock().maps.insert(map.to_owned(), (entries, capacity));
    }

    /// The entries of one BPF map, its capacity left as last set (the Syncer counts the service maps,
    /// the GC the conntrack and affinity tables, each as it goes).
    pub fn set_map_entries(&self, map: &str, entries: u64) {
        self.lock().maps.entry(map.to_owned()).or_default().0 = entries;
    }

    /// The capacity of one BPF map, its entries left as last set.
    pub fn set_map_capacity(&self, map: &str, capacity: u64) {
        self.lock().maps.entry(map.to_owned()).or_default().1 = capacity;
    }

    /// Datapath packet counters by reason, as absolute totals (summed over
    /// CPUs). Reasons not mentioned keep their previous value.
    pub fn set_datapath_counters(&self, counters: &[(&str, u64)]) {
        let mut inner = self.lock();
        for (reason, value) in counters {
            inner.datapath_packets.insert((*reason).to_owned(), *value);
        }
    }

    /// Number of service frontends and backends currently programmed.
    pub fn set_programmed(&self, frontends: u64, backends: u64) {
        let mut inner = self.lock();
        inner.frontends = frontends;
        inner.backends = backends;
    }

    /// One conntrack GC run: entries deleted by state, affinity entries
    /// deleted, and the interval until the next run.
    pub fn observe_gc(&self, deleted: &BTreeMap<&str, u64>, affinity_deleted: u64, next_interval: Duration) {
        let mut inner = self.lock();
        inner.gc_runs_total = inner.gc_runs_total.saturating_add(1);
        for (state, n) in deleted {
            let total = inner.gc_deleted.entry((*state).to_owned()).or_default();
            *total = total.saturating_add(*n);
        }
        inner.affinity_gc_deleted_total = inner.affinity_gc_deleted_total.saturating_add(affinity_deleted);
        inner.gc_interval_seconds = next_interval.as_secs_f64();
    }

    /// The current conntrack GC interval.
    pub fn set_gc_interval(&self, interval: Duration) {
        self.lock().gc_interval_seconds = interval.as_secs_f64();
    }

    /// The open connections the last nf_conntrack scan left to netfilter.
    pub fn set_inherited_open(&self, open: u64) {
        self.lock().inherited_open = open;
    }

    /// Conntrack entries purged for deleted UDP backends, from CONNTRACK_V4 and CONNTRACK_V6.
    pub fn add_conntrack_purged(&self, ipv4: u64, ipv6: u64) {
        let mut inner = self.lock();
        inner.purged_total = inner.purged_total.saturating_add(ipv4).saturating_add(ipv6);
        for (total, n) in inner.purged_by_family.iter_mut().zip([ipv4, ipv6]) {
            *total = total.saturating_add(n);
        }
    }

    /// The exposition in Prometheus text format 0.0.4 (see [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        {
            let inner = self.lock();
            kube_proxy::render(&inner, &mut out);
            kproxy::render_datapath(&inner, &mut out);
            kproxy::render_conntrack(&inner, &mut out);
        }
        kproxy::render_manifests(&mut out);
        kproxy::render_build_info(&mut out);
        process::render(&mut out, &ProcessStats::read());
        out
    }
}

/// Seconds since the Unix epoch (negative before it).
fn unix_seconds(at: SystemTime) -> f64 {
    match at.duration_since(UNIX_EPOCH) {
        Ok(since) => since.as_secs_f64(),
        Err(before) => -before.duration().as_secs_f64(),
    }
}
