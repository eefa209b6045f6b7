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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::k8s::api_watch::QueueObserver;
use crate::k8s::manifest_watch;
use crate::model::{Frontend, Scope};

/// `Content-Type` of the Prometheus text exposition format served on `/metrics`.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const SYNC_DURATION: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
const SYNC_FULL_DURATION: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds";
const SYNC_PARTIAL_DURATION: &str = "kubeproxy_sync_partial_proxy_rules_duration_seconds";
const NO_LOCAL_ENDPOINTS: &str = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
const HEALTHZ_TOTAL: &str = "kubeproxy_proxy_healthz_total";
const LIVEZ_TOTAL: &str = "kubeproxy_proxy_livez_total";
const CT_RECONCILER_DURATION: &str = "kubeproxy_conntrack_reconciler_sync_duration_seconds";
const CT_RECONCILER_DELETED: &str = "kubeproxy_conntrack_reconciler_deleted_entries_total";
const BUILD_INFO: &str = "kproxy_build_info";
const PROCESS_CPU: &str = "process_cpu_seconds_total";
const PROCESS_RESIDENT: &str = "process_resident_memory_bytes";
const PROCESS_VIRTUAL: &str = "process_virtual_memory_bytes";
const PROCESS_VIRTUAL_MAX: &str = "process_virtual_memory_max_bytes";
const PROCESS_START: &str = "process_start_time_seconds";
const PROCESS_OPEN_FDS: &str = "process_open_fds";
const PROCESS_MAX_FDS: &str = "process_max_fds";
const NETWORK_PROGRAMMING: &str = "kubeproxy_network_programming_duration_seconds";
const LAST_SYNC_TIMESTAMP: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
const LAST_QUEUED_TIMESTAMP: &str = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds";
const ENDPOINT_CHANGES_PENDING: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_pending";
const ENDPOINT_CHANGES_TOTAL: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_total";
const SERVICE_CHANGES_PENDING: &str = "kubeproxy_sync_proxy_rules_service_changes_pending";
const SERVICE_CHANGES_TOTAL: &str = "kubeproxy_sync_proxy_rules_service_changes_total";
const MAP_ENTRIES: &str = "kproxy_bpf_map_entries";
const MAP_CAPACITY: &str = "kproxy_bpf_map_capacity";
const DATAPATH_PACKETS: &str = "kproxy_datapath_packets_total";
const SYNC_ERRORS: &str = "kproxy_sync_errors_total";
const FRONTENDS: &str = "kproxy_frontends";
const BACKENDS: &str = "kproxy_backends";
const CT_GC_RUNS: &str = "kproxy_conntrack_gc_runs_total";
const CT_GC_DELETED: &str = "kproxy_conntrack_gc_deleted_total";
const CT_GC_INTERVAL: &str = "kproxy_conntrack_gc_interval_seconds";
const CT_PURGED: &str = "kproxy_conntrack_purged_total";
const INHERITED_OPEN: &str = "kproxy_inherited_connections";
const CT_CREATED: &str = "kproxy_conntrack_created_total";
const CT_EVICTED: &str = "kproxy_conntrack_evicted_total";
const AFFINITY_GC_DELETED: &str = "kproxy_affinity_gc_deleted_total";
/// The datapath counter of new translated flows (two entries each).
const NEW_FLOW_REASON: &str = "dnat_new_flow";
const CONNTRACK_MAP: &str = "conntrack_v4";

/// kube-proxy ≥ 1.34 labels its per-family series with the family it programs;
/// kproxy programs IPv4 only, so every such series is `ip_family="IPv4"`.
const IP_FAMILY: (&str, &str) = ("ip_family", "IPv4");

/// The version kproxy was built as (the crate's).
pub const BUILD_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit kproxy was built from: `git rev-parse --short HEAD` when built in a
/// checkout (or `KPROXY_GIT_COMMIT` when the build sets it), else `unknown` (build.rs).
pub const BUILD_COMMIT: &str = env!("KPROXY_GIT_COMMIT");

/// kube-proxy's buckets for the rule sync duration: `0.001 × 2^i`, `i = 0..14`.
pub fn sync_duration_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's buckets for the network programming latency: 0.25 and 0.5,
/// then 1..=59 by 1, 60..=115 by 5 and 120..=300 by 30 (seconds).
pub fn network_programming_buckets() -> Vec<f64> {
    let mut buckets = vec![0.25, 0.5];
    buckets.extend((1..=59).map(f64::from));
    buckets.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    buckets.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    buckets
}

/// `count` bucket bounds `start, start × factor, start × factor², …`, computed
/// the way Prometheus client libraries do (repeated multiplication).
pub fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    let mut buckets = Vec::with_capacity(count);
    let mut bound = start;
    for _ in 0..count {
        buckets.push(bound);
        bound *= factor;
    }
    buckets
}

/// A Prometheus histogram: observations counted in buckets with inclusive
/// upper bounds (`le`), plus their sum and count. The implicit `+Inf` bucket
/// is the count.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: Vec<f64>,
    /// Observations per bucket (not cumulative); `counts[i]` is for
    /// `bounds[i - 1] < v <= bounds[i]`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram with these upper bounds. They are sorted, and NaN, infinite
    /// and duplicate bounds are dropped (`+Inf` is always implied).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let mut bounds: Vec<f64> = bounds.into_iter().filter(|b| b.is_finite()).collect();
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let counts = vec![0; bounds.len()];
        Histogram { bounds, counts, sum: 0.0, count: 0 }
    }

    /// Record one observation. NaN is counted only in `+Inf` (and makes the
    /// sum NaN), as Prometheus clients do.
    pub fn observe(&mut self, value: f64) {
        let index = self.bounds.partition_point(|bound| *bound < value);
        if let Some(slot) = self.counts.get_mut(index) {
            *slot += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    /// Record a duration in seconds.
    pub fn observe_duration(&mut self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// The finite upper bounds.
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    /// `(upper bound, observations <= bound)` for every bucket including the
    /// final `+Inf` one, as exposed on the wire.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        let mut out: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(bound, count)| {
                total += count;
                (*bound, total)
            })
            .collect();
        out.push((f64::INFINITY, self.count));
        out
    }

    /// Sum of all observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Append the family (`HELP`, `TYPE`, `_bucket`, `_sum`, `_count`) to `out`.
    pub fn render(&self, name: &str, help: &str, out: &mut String) {
        self.render_labelled(name, help, &[], out);
    }

    /// As [`Histogram::render`], with `labels` on every series (before `le`, as
    /// client_golang writes them).
    pub fn render_labelled(&self, name: &str, help: &str, labels: &[(&str, &str)], out: &mut String) {
        header(out, name, help, "histogram");
        for (bound, count) in self.cumulative() {
            let le = format_float(bound);
            let bucket_labels: Vec<(&str, &str)> =
                labels.iter().copied().chain([("le", le.as_str())]).collect();
            let _ = writeln!(out, "{name}_bucket{} {count}", label_set(&bucket_labels));
        }
        let _ = writeln!(out, "{name}_sum{} {}", label_set(labels), format_float(self.sum));
        let _ = writeln!(out, "{name}_count{} {}", label_set(labels), self.count);
    }
}

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
    /// `traffic_policy` (internal, external).
    no_local_endpoints: (u64, u64),
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
            no_local_endpoints: (0, 0),
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
    /// (cluster IPs, node ports, external and load-balancer IPs) they answer on.
    pub fn set_no_local_endpoints(&self, frontends: &[Frontend]) {
        let mut internal = BTreeSet::new();
        let mut external = BTreeSet::new();
        for frontend in frontends.iter().filter(|f| f.no_local_endpoints) {
            let service_port = (&frontend.service, frontend.port_name.as_str(), frontend.proto);
            match frontend.scope {
                Scope::Internal => internal.insert(service_port),
                Scope::External => external.insert(service_port),
            };
        }
        self.lock().no_local_endpoints = (internal.len() as u64, external.len() as u64);
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

    /// Conntrack entries purged for deleted UDP backends.
    pub fn add_conntrack_purged(&self, entries: u64) {
        let mut inner = self.lock();
        inner.purged_total = inner.purged_total.saturating_add(entries);
    }

    /// The exposition in Prometheus text format 0.0.4 (see [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let inner = self.lock();
        let mut out = String::with_capacity(8192);

        let family = [IP_FAMILY];
        inner.sync_duration.render_labelled(
            SYNC_DURATION,
            "SyncProxyRules latency in seconds",
            &family,
            &mut out,
        );
        inner.sync_full_duration.render_labelled(
            SYNC_FULL_DURATION,
            "SyncProxyRules latency in seconds for full resyncs",
            &family,
            &mut out,
        );
        inner.sync_partial_duration.render_labelled(
            SYNC_PARTIAL_DURATION,
            "SyncProxyRules latency in seconds for partial resyncs",
            &family,
            &mut out,
        );
        inner.network_programming.render_labelled(
            NETWORK_PROGRAMMING,
            "In Cluster Network Programming Latency in seconds",
            &family,
            &mut out,
        );
        header(&mut out, LAST_SYNC_TIMESTAMP, "The last time proxy rules were successfully synced", "gauge");
        sample(&mut out, LAST_SYNC_TIMESTAMP, &family, &format_float(inner.last_sync_timestamp));
        header(&mut out, LAST_QUEUED_TIMESTAMP, "The last time a sync of proxy rules was queued", "gauge");
        sample(&mut out, LAST_QUEUED_TIMESTAMP, &family, &format_float(inner.last_queued_timestamp));
        scalar(
            &mut out,
            ENDPOINT_CHANGES_PENDING,
            "Pending proxy rules Endpoint changes",
            "gauge",
            &inner.endpoint_changes_pending.to_string(),
        );
        scalar(
            &mut out,
            ENDPOINT_CHANGES_TOTAL,
            "Cumulative proxy rules Endpoint changes",
            "counter",
            &inner.endpoint_changes_total.to_string(),
        );
        scalar(
            &mut out,
            SERVICE_CHANGES_PENDING,
            "Pending proxy rules Service changes",
            "gauge",
            &inner.service_changes_pending.to_string(),
        );
        scalar(
            &mut out,
            SERVICE_CHANGES_TOTAL,
            "Cumulative proxy rules Service changes",
            "counter",
            &inner.service_changes_total.to_string(),
        );
        header(
            &mut out,
            NO_LOCAL_ENDPOINTS,
            "Number of services with a Local traffic policy and no endpoints",
            "gauge",
        );
        let (internal, external) = inner.no_local_endpoints;
        for (policy, count) in [("internal", internal), ("external", external)] {
            sample(
                &mut out,
                NO_LOCAL_ENDPOINTS,
                &[IP_FAMILY, ("traffic_policy", policy)],
                &count.to_string(),
            );
        }
        for (probe, name, help) in [
            (Probe::Healthz, HEALTHZ_TOTAL, "Cumulative proxy healthz HTTP status"),
            (Probe::Livez, LIVEZ_TOTAL, "Cumulative proxy livez HTTP status"),
        ] {
            header(&mut out, name, help, "counter");
            for ((_, code), count) in lock_probes().iter().filter(|((p, _), _)| *p == probe) {
                sample(&mut out, name, &[("code", &code.to_string())], &count.to_string());
            }
        }
        inner.ct_reconcile_duration.render_labelled(
            CT_RECONCILER_DURATION,
            "ReconcileConntrackFlowsLatency latency in seconds",
            &family,
            &mut out,
        );
        header(
            &mut out,
            CT_RECONCILER_DELETED,
            "Cumulative conntrack flows deleted by conntrack reconciler",
            "counter",
        );
        sample(&mut out, CT_RECONCILER_DELETED, &family, &inner.purged_total.to_string());

        labelled(
            &mut out,
            MAP_ENTRIES,
            "Entries currently in a kproxy BPF map",
            "gauge",
            "map",
            inner.maps.iter().map(|(map, (entries, _))| (map, *entries)),
        );
        labelled(
            &mut out,
            MAP_CAPACITY,
            "Maximum entries of a kproxy BPF map",
            "gauge",
            "map",
            inner.maps.iter().map(|(map, (_, capacity))| (map, *capacity)),
        );
        labelled(
            &mut out,
            DATAPATH_PACKETS,
            "Packets seen by the kproxy datapath, by outcome",
            "counter",
            "reason",
            inner.datapath_packets.iter().map(|(reason, value)| (reason, *value)),
        );
        scalar(
            &mut out,
            SYNC_ERRORS,
            "Failed datapath syncs",
            "counter",
            &inner.sync_errors_total.to_string(),
        );
        scalar(
            &mut out,
            FRONTENDS,
            "Service frontends programmed in the datapath",
            "gauge",
            &inner.frontends.to_string(),
        );
        scalar(
            &mut out,
            BACKENDS,
            "Service backends programmed in the datapath",
            "gauge",
            &inner.backends.to_string(),
        );

        scalar(
            &mut out,
            CT_GC_RUNS,
            "Conntrack garbage collection runs",
            "counter",
            &inner.gc_runs_total.to_string(),
        );
        labelled(
            &mut out,
            CT_GC_DELETED,
            "Conntrack entries deleted by garbage collection, by the flow's state",
            "counter",
            "state",
            inner.gc_deleted.iter().map(|(state, n)| (state, *n)),
        );
        scalar(
            &mut out,
            CT_GC_INTERVAL,
            "Current (adaptive) interval between conntrack garbage collection runs",
            "gauge",
            &format_float(inner.gc_interval_seconds),
        );
        scalar(
            &mut out,
            INHERITED_OPEN,
            "Connections netfilter (kube-proxy) translated before kproxy took over that are still open: left to \
             netfilter until they end",
            "gauge",
            &inner.inherited_open.to_string(),
        );
        scalar(
            &mut out,
            CT_PURGED,
            "Conntrack entries deleted at once because their UDP backend was removed",
            "counter",
            &inner.purged_total.to_string(),
        );
        let created = inner.datapath_packets.get(NEW_FLOW_REASON).copied().unwrap_or(0);
        scalar(
            &mut out,
            CT_CREATED,
            "Translated flows created by the datapath (two conntrack entries each)",
            "counter",
            &created.to_string(),
        );
        let current = inner.maps.get(CONNTRACK_MAP).map_or(0, |(entries, _)| *entries);
        let gc_deleted: u64 = inner.gc_deleted.values().sum();
        let evicted =
            crate::bpf::conntrack::evicted_estimate(created, gc_deleted, inner.purged_total, current);
        scalar(
            &mut out,
            CT_EVICTED,
            "Estimate of conntrack entries evicted by the LRU: 2 x created - GC-deleted - purged - \
             current entries, clamped at 0 (an estimate: the agent's counters restart with it, the \
             datapath's do not, and flushes and datapath replacements are not subtracted)",
            "counter",
            &evicted.to_string(),
        );
        scalar(
            &mut out,
            AFFINITY_GC_DELETED,
            "sessionAffinity entries deleted by garbage collection",
            "counter",
            &inner.affinity_gc_deleted_total.to_string(),
        );
        drop(inner);
        if let Some(state) = manifest_watch::last_state() {
            scalar(
                &mut out,
                MANIFEST_OBJECTS_KEPT,
                "Objects from --manifests kept at their last good version because their file or document \
                 cannot be read as it is now",
                "gauge",
                &state.objects_kept.to_string(),
            );
            scalar(
                &mut out,
                MANIFEST_ERRORS,
                "Problems the --manifests source reports now (files, documents and objects it cannot read)",
                "gauge",
                &state.errors.to_string(),
            );
        }
        header(&mut out, BUILD_INFO, "kproxy's version and the commit it was built from; always 1", "gauge");
        sample(&mut out, BUILD_INFO, &[("commit", BUILD_COMMIT), ("version", BUILD_VERSION)], "1");
        render_process(&mut out, &ProcessStats::read());
        out
    }
}

/// Which of kube-proxy's health endpoints answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Probe {
    Healthz,
    Livez,
}

/// Health answers by endpoint and HTTP status code. Process-wide, as kube-proxy's
/// legacy registry is: the health server runs apart from the sync loop's [`Metrics`].
static PROBES: Mutex<BTreeMap<(Probe, u16), u64>> = Mutex::new(BTreeMap::new());

fn lock_probes() -> MutexGuard<'static, BTreeMap<(Probe, u16), u64>> {
    PROBES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The health server answered `probe` with HTTP `status` (kube-proxy's
/// `proxy_healthz_total{code}` and `proxy_livez_total{code}`).
pub fn count_probe(probe: Probe, status: u16) {
    let mut probes = lock_probes();
    let count = probes.entry((probe, status)).or_default();
    *count = count.saturating_add(1);
}

/// What the process collectors of the Prometheus client libraries report, read
/// from `/proc/self` at scrape time. A value that cannot be read is left out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    /// `RLIMIT_AS`; `u64::MAX` when unlimited, as client_golang reports it.
    pub virtual_max_bytes: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    /// `RLIMIT_NOFILE`'s soft limit.
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    /// This process, now.
    pub fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        // SAFETY: sysconf takes no pointer and only reads configuration.
        let (ticks, page_size) =
            unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let boot_time = read("/proc/stat").as_deref().and_then(boot_time_seconds);
        let mut stats = match read("/proc/self/stat") {
            Some(stat) if ticks > 0 && page_size > 0 => {
                parse_stat(&stat, ticks as f64, page_size as u64, boot_time).unwrap_or_default()
            }
            _ => ProcessStats::default(),
        };
        if let Some(limits) = read("/proc/self/limits") {
            stats.max_fds = limit(&limits, "Max open files");
            stats.virtual_max_bytes = limit(&limits, "Max address space");
        }
        stats.open_fds = std::fs::read_dir("/proc/self/fd").ok().map(|dir| dir.count() as u64);
        stats
    }
}

/// CPU time, memory and start time from `/proc/<pid>/stat`: `comm` (field 2) may
/// hold spaces and parentheses, so fields are counted from its closing `)`.
fn parse_stat(
    stat: &str,
    ticks_per_second: f64,
    page_size: u64,
    boot_time: Option<f64>,
) -> Option<ProcessStats> {
    let (_, rest) = stat.rsplit_once(')')?;
    // rest[0] is field 3 (state); field N is rest[N - 3].
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let (utime, stime) = (field(14)?, field(15)?);
    Some(ProcessStats {
        cpu_seconds: Some((utime + stime) as f64 / ticks_per_second),
        start_time_seconds: boot_time
            .zip(field(22))
            .map(|(boot, start_ticks)| boot + start_ticks as f64 / ticks_per_second),
        virtual_bytes: field(23),
        resident_bytes: field(24).map(|pages| pages.saturating_mul(page_size)),
        ..ProcessStats::default()
    })
}

/// `btime` of `/proc/stat`: when the machine booted, in seconds since the epoch.
fn boot_time_seconds(proc_stat: &str) -> Option<f64> {
    proc_stat.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

/// The soft limit named `name` in `/proc/<pid>/limits`; `unlimited` is `u64::MAX`.
fn limit(limits: &str, name: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|line| line.strip_prefix(name))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        soft => soft.parse().ok(),
    }
}

/// The `process_*` families under client_golang's names and help texts.
fn render_process(out: &mut String, stats: &ProcessStats) {
    let families: [(&str, &str, &str, Option<String>); 7] = [
        (
            PROCESS_CPU,
            "Total user and system CPU time spent in seconds.",
            "counter",
            stats.cpu_seconds.map(format_float),
        ),
        (
            PROCESS_OPEN_FDS,
            "Number of open file descriptors.",
            "gauge",
            stats.open_fds.map(|v| v.to_string()),
        ),
        (
            PROCESS_MAX_FDS,
            "Maximum number of open file descriptors.",
            "gauge",
            stats.max_fds.map(|v| format_float(v as f64)),
        ),
        (
            PROCESS_VIRTUAL,
            "Virtual memory size in bytes.",
            "gauge",
            stats.virtual_bytes.map(|v| v.to_string()),
        ),
        (
            PROCESS_VIRTUAL_MAX,
            "Maximum amount of virtual memory available in bytes.",
            "gauge",
            stats.virtual_max_bytes.map(|v| format_float(v as f64)),
        ),
        (
            PROCESS_RESIDENT,
            "Resident memory size in bytes.",
            "gauge",
            stats.resident_bytes.map(|v| v.to_string()),
        ),
        (
            PROCESS_START,
            "Start time of the process since unix epoch in seconds.",
            "gauge",
            stats.start_time_seconds.map(format_float),
        ),
    ];
    for (name, help, kind, value) in families {
        if let Some(value) = value {
            scalar(out, name, help, kind, &value);
        }
    }
}

const MANIFEST_OBJECTS_KEPT: &str = "kproxy_manifest_objects_kept_last_good";
const MANIFEST_ERRORS: &str = "kproxy_manifest_errors";

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn scalar(out: &mut String, name: &str, help: &str, kind: &str, value: &str) {
    header(out, name, help, kind);
    sample(out, name, &[], value);
}

/// One series: `name{labels} value`.
fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: &str) {
    let _ = writeln!(out, "{name}{} {value}", label_set(labels));
}

/// `{k="v",k2="v2"}` with the values escaped, or nothing without labels.
fn label_set(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> =
        labels.iter().map(|(key, value)| format!("{key}=\"{}\"", escape_label_value(value))).collect();
    format!("{{{}}}", pairs.join(","))
}

fn labelled<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    label: &str,
    samples: impl Iterator<Item = (&'a String, u64)>,
) {
    header(out, name, help, kind);
    for (value, sample) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {sample}", escape_label_value(value));
    }
}

/// Escape a label value for the text format: `\` → `\\`, `"` → `\"`,
/// newline → `\n`.
pub fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Escape `HELP` text: `\` → `\\`, newline → `\n`.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value or `le` bound: shortest round-trip decimal, with the text
/// format's spellings of the non-finite values.
pub fn format_float(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_owned()
    } else if value == f64::INFINITY {
        "+Inf".to_owned()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{value}")
    }
}

/// Seconds since the Unix epoch (negative before it).
fn unix_seconds(at: SystemTime) -> f64 {
    match at.duration_since(UNIX_EPOCH) {
        Ok(since) => since.as_secs_f64(),
        Err(before) => -before.duration().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, labels, value)
    type Sample = (String, Vec<(String, String)>, String);

    /// One parsed exposition: families in order with HELP/TYPE, and samples.
    #[derive(Debug, Default)]
    struct Exposition {
        help: BTreeMap<String, String>,
        types: BTreeMap<String, String>,
        /// (name, labels, value) in order of appearance.
        samples: Vec<Sample>,
    }

    impl Exposition {
        fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<&str> {
            self.samples
                .iter()
                .find(|(n, l, _)| {
                    n == name
                        && l.len() == labels.len()
                        && l.iter().zip(labels).all(|((k, v), (k2, v2))| k == k2 && v == v2)
                })
                .map(|(_, _, v)| v.as_str())
        }
    }

    /// A strict-enough parser of the text format: every sample must belong to
    /// a family whose HELP and TYPE were seen before it.
    fn parse(text: &str) -> Exposition {
        let mut exp = Exposition::default();
        assert!(text.ends_with('\n'), "exposition must end with a newline");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("HELP text");
                assert!(exp.help.insert(name.into(), help.into()).is_none(), "dup HELP {name}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE kind");
                assert!(exp.help.contains_key(name), "TYPE before HELP for {name}");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "bad type {kind}");
                assert!(exp.types.insert(name.into(), kind.into()).is_none(), "dup TYPE {name}");
            } else {
                assert!(!line.starts_with('#') && !line.is_empty(), "bad line {line:?}");
                let (series, value) = line.rsplit_once(' ').expect("sample value");
                let (name, labels) = match series.split_once('{') {
                    None => (series.to_owned(), Vec::new()),
                    Some((name, rest)) => {
                        let body = rest.strip_suffix('}').expect("closing brace");
                        (name.to_owned(), parse_labels(body))
                    }
                };
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| {
                        let base = name.strip_suffix(suffix)?;
                        (exp.types.get(base).map(String::as_str) == Some("histogram"))
                            .then(|| base.to_owned())
                    })
                    .unwrap_or_else(|| name.clone());
                assert!(exp.types.contains_key(&family), "sample {name} without TYPE");
                value
                    .parse::<f64>()
                    .or_else(|e| match value {
                        "+Inf" | "-Inf" | "NaN" => Ok(0.0),
                        _ => Err(e),
                    })
                    .unwrap_or_else(|_| panic!("bad value {value:?}"));
                exp.samples.push((name, labels, value.to_owned()));
            }
        }
        exp
    }

    /// `k="v",k2="v2"` with the text format's escapes.
    fn parse_labels(body: &str) -> Vec<(String, String)> {
        let mut labels = Vec::new();
        let mut chars = body.chars().peekable();
        while chars.peek().is_some() {
            let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
            assert_eq!(chars.next(), Some('"'), "label value must be quoted");
            let mut value = String::new();
            loop {
                match chars.next().expect("unterminated label value") {
                    '"' => break,
                    '\\' => match chars.next().expect("escape") {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        other => panic!("bad escape \\{other}"),
                    },
                    c => value.push(c),
                }
            }
            labels.push((key, value));
            match chars.next() {
                None => break,
                Some(',') => {}
                Some(other) => panic!("unexpected {other:?} after label"),
            }
        }
        labels
    }

    #[test]
    fn kube_proxy_bucket_layouts() {
        let sync = sync_duration_buckets();
        assert_eq!(sync.len(), 15);
        assert_eq!(format_float(sync[0]), "0.001");
        assert_eq!(format_float(sync[3]), "0.008");
        assert_eq!(format_float(sync[14]), "16.384");

        let np = network_programming_buckets();
        assert_eq!(np.len(), 2 + 59 + 12 + 7);
        assert_eq!(&np[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert_eq!(np[60], 59.0);
        assert_eq!(&np[61..63], &[60.0, 65.0]);
        assert_eq!(np[72], 115.0);
        assert_eq!(&np[73..], &[120.0, 150.0, 180.0, 210.0, 240.0, 270.0, 300.0]);
        assert!(np.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn histogram_bucket_math() {
        let mut h = Histogram::new([5.0, 1.0, 2.0, 2.0, f64::INFINITY, f64::NAN]);
        assert_eq!(h.bounds(), &[1.0, 2.0, 5.0]);
        for v in [0.5, 1.0, 1.5, 2.0, 4.0, 5.0, 7.0, 100.0] {
            h.observe(v);
        }
        assert_eq!(h.cumulative(), vec![(1.0, 2), (2.0, 4), (5.0, 6), (f64::INFINITY, 8)]);
        assert_eq!(h.count(), 8);
        assert_eq!(h.sum(), 121.0);

        h.observe_duration(Duration::from_millis(1500));
        assert_eq!(h.cumulative()[1], (2.0, 5));
        assert_eq!(h.sum(), 122.5);

        let empty = Histogram::new(Vec::new());
        assert_eq!(empty.cumulative(), vec![(f64::INFINITY, 0)]);
    }

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let mut h = Histogram::new([0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(3.0);
        let mut out = String::new();
        h.render("x_seconds", "Some \\ help\nmore", &mut out);
        assert_eq!(
            out,
            "# HELP x_seconds Some \\\\ help\\nmore\n\
             # TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"0.1\"} 1\n\
             x_seconds_bucket{le=\"1\"} 2\n\
             x_seconds_bucket{le=\"+Inf\"} 3\n\
             x_seconds_sum 3.55\n\
             x_seconds_count 3\n"
        );
    }

    #[test]
    fn label_and_float_formatting() {
        assert_eq!(escape_label_value(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape_label_value("x\ny"), "x\\ny");
        assert_eq!(format_float(1.0), "1");
        assert_eq!(format_float(0.25), "0.25");
        assert_eq!(format_float(f64::INFINITY), "+Inf");
        assert_eq!(format_float(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_float(f64::NAN), "NaN");
    }

    #[test]
    fn empty_metrics_render_every_family() {
        let exp = parse(&Metrics::new().render());
        for (name, kind) in [
            (SYNC_DURATION, "histogram"),
            (NETWORK_PROGRAMMING, "histogram"),
            (LAST_SYNC_TIMESTAMP, "gauge"),
            (LAST_QUEUED_TIMESTAMP, "gauge"),
            (ENDPOINT_CHANGES_PENDING, "gauge"),
            (ENDPOINT_CHANGES_TOTAL, "counter"),
            (SERVICE_CHANGES_PENDING, "gauge"),
            (SERVICE_CHANGES_TOTAL, "counter"),
            (MAP_ENTRIES, "gauge"),
            (MAP_CAPACITY, "gauge"),
            (DATAPATH_PACKETS, "counter"),
            (SYNC_ERRORS, "counter"),
            (FRONTENDS, "gauge"),
            (BACKENDS, "gauge"),
            (CT_GC_RUNS, "counter"),
            (CT_GC_DELETED, "counter"),
            (CT_GC_INTERVAL, "gauge"),
            (CT_PURGED, "counter"),
            (INHERITED_OPEN, "gauge"),
            (CT_CREATED, "counter"),
            (CT_EVICTED, "counter"),
            (AFFINITY_GC_DELETED, "counter"),
            (SYNC_FULL_DURATION, "histogram"),
            (SYNC_PARTIAL_DURATION, "histogram"),
            (NO_LOCAL_ENDPOINTS, "gauge"),
            (HEALTHZ_TOTAL, "counter"),
            (LIVEZ_TOTAL, "counter"),
            (CT_RECONCILER_DURATION, "histogram"),
            (CT_RECONCILER_DELETED, "counter"),
            (BUILD_INFO, "gauge"),
            (PROCESS_CPU, "counter"),
            (PROCESS_RESIDENT, "gauge"),
            (PROCESS_VIRTUAL, "gauge"),
            (PROCESS_VIRTUAL_MAX, "gauge"),
            (PROCESS_START, "gauge"),
            (PROCESS_OPEN_FDS, "gauge"),
            (PROCESS_MAX_FDS, "gauge"),
        ] {
            assert_eq!(exp.types.get(name).map(String::as_str), Some(kind), "{name}");
        }
        let v4 = [("ip_family", "IPv4")];
        for name in [SYNC_DURATION, SYNC_FULL_DURATION, SYNC_PARTIAL_DURATION, CT_RECONCILER_DURATION] {
            let buckets: Vec<&str> = exp
                .samples
                .iter()
                .filter(|(n, _, _)| n == &format!("{name}_bucket"))
                .map(|(_, labels, _)| labels[1].1.as_str())
                .collect();
            assert_eq!(buckets.len(), 16, "{name}");
            assert_eq!((buckets[0], buckets[14], buckets[15]), ("0.001", "16.384", "+Inf"), "{name}");
            assert_eq!(exp.value(&format!("{name}_count"), &v4), Some("0"), "{name}");
        }
        let np_buckets =
            exp.samples.iter().filter(|(n, _, _)| n == &format!("{NETWORK_PROGRAMMING}_bucket")).count();
        assert_eq!(np_buckets, 81);
        assert_eq!(exp.value(LAST_SYNC_TIMESTAMP, &v4), Some("0"));
        for policy in ["internal", "external"] {
            assert_eq!(exp.value(NO_LOCAL_ENDPOINTS, &[v4[0], ("traffic_policy", policy)]), Some("0"));
        }
        assert_eq!(exp.value(CT_RECONCILER_DELETED, &v4), Some("0"));
        assert_eq!(
            exp.value(BUILD_INFO, &[("commit", BUILD_COMMIT), ("version", env!("CARGO_PKG_VERSION"))]),
            Some("1")
        );
        assert!(!BUILD_COMMIT.is_empty());
        // Families without ip_family in kube-proxy 1.34 have none here either.
        assert_eq!(exp.value(ENDPOINT_CHANGES_TOTAL, &[]), Some("0"));
        assert_eq!(exp.value(SERVICE_CHANGES_PENDING, &[]), Some("0"));
    }

    fn frontend(name: &str, port_name: &str, vip: [u8; 4], scope: Scope, no_local: bool) -> Frontend {
        let service = crate::model::ServiceName { namespace: "default".into(), name: name.into() };
        let mut frontend =
            Frontend::new(service, port_name, vip.into(), 80, crate::net::Protocol::Tcp, Vec::new());
        frontend.scope = scope;
        frontend.local_only = no_local;
        frontend.no_local_endpoints = no_local;
        frontend
    }

    #[test]
    fn no_local_endpoints_counts_service_ports_by_policy() {
        let m = Metrics::new();
        m.set_no_local_endpoints(&[
            // internalTrafficPolicy: Local, endpoints elsewhere: two ports, two cluster IPs each.
            frontend("itp", "http", [10, 96, 0, 1], Scope::Internal, true),
            frontend("itp", "http", [10, 96, 0, 2], Scope::Internal, true),
            frontend("itp", "https", [10, 96, 0, 1], Scope::Internal, true),
            // externalTrafficPolicy: Local, endpoints elsewhere: one port on a node port and an external IP;
            // its internal entries ignore the policy and have endpoints.
            frontend("etp", "http", [192, 168, 1, 10], Scope::External, true),
            frontend("etp", "http", [203, 0, 113, 7], Scope::External, true),
            frontend("etp", "http", [192, 168, 1, 10], Scope::Internal, false),
            // Served here, or by nobody (refused, not dropped): not counted.
            frontend("fine", "http", [10, 96, 0, 3], Scope::Internal, false),
        ]);
        let exp = parse(&m.render());
        let value =
            |policy| exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", "IPv4"), ("traffic_policy", policy)]);
        assert_eq!((value("internal"), value("external")), (Some("2"), Some("1")));

        // Recounted at each sync, as kube-proxy sets the gauge.
        m.set_no_local_endpoints(&[]);
        let exp = parse(&m.render());
        let value =
            |policy| exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", "IPv4"), ("traffic_policy", policy)]);
        assert_eq!((value("internal"), value("external")), (Some("0"), Some("0")));
    }

    #[test]
    fn health_answers_are_counted_by_code() {
        // Process-wide counters, shared with the health server's own tests: codes no answer uses.
        count_probe(Probe::Healthz, 591);
        count_probe(Probe::Healthz, 591);
        count_probe(Probe::Healthz, 592);
        count_probe(Probe::Livez, 593);
        let exp = parse(&Metrics::new().render());
        assert_eq!(exp.value(HEALTHZ_TOTAL, &[("code", "591")]), Some("2"));
        assert_eq!(exp.value(HEALTHZ_TOTAL, &[("code", "592")]), Some("1"));
        assert_eq!(exp.value(HEALTHZ_TOTAL, &[("code", "593")]), None);
        assert_eq!(exp.value(LIVEZ_TOTAL, &[("code", "593")]), Some("1"));
    }

    #[test]
    fn conntrack_reconciler_reports_the_purge() {
        let m = Metrics::new();
        m.add_conntrack_purged(4);
        m.observe_conntrack_reconcile(Duration::from_micros(1500));
        m.add_conntrack_purged(0);
        m.observe_conntrack_reconcile(Duration::from_millis(40));
        let exp = parse(&m.render());
        let v4 = [("ip_family", "IPv4")];
        assert_eq!(exp.value(CT_RECONCILER_DELETED, &v4), Some("4"));
        assert_eq!(exp.value(&format!("{CT_RECONCILER_DURATION}_count"), &v4), Some("2"));
        let bucket =
            |le| exp.value(&format!("{CT_RECONCILER_DURATION}_bucket"), &[("ip_family", "IPv4"), ("le", le)]);
        assert_eq!((bucket("0.001"), bucket("0.002"), bucket("0.064")), (Some("0"), Some("1"), Some("2")));
    }

    #[test]
    fn process_stats_from_proc() {
        // A comm with spaces and parentheses; fields as proc(5) numbers them.
        let stat = "4242 (kproxy (a) b) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    250 130 0 0 20 0 3 0 1234500 987654321 2048 18446744073709551615 0 0";
        let stats = parse_stat(stat, 100.0, 4096, Some(1_700_000_000.0)).unwrap();
        assert_eq!(stats.cpu_seconds, Some(3.8));
        assert_eq!(stats.start_time_seconds, Some(1_700_012_345.0));
        assert_eq!(stats.virtual_bytes, Some(987_654_321));
        assert_eq!(stats.resident_bytes, Some(2048 * 4096));
        assert_eq!(parse_stat("4242 (truncated", 100.0, 4096, None), None);

        assert_eq!(boot_time_seconds("cpu  1 2 3\nbtime 1700000000\nprocesses 7\n"), Some(1_700_000_000.0));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max address space         unlimited            unlimited            bytes     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(limit(limits, "Max open files"), Some(1024));
        assert_eq!(limit(limits, "Max address space"), Some(u64::MAX));

        // This test process, read for real.
        let live = ProcessStats::read();
        let now = unix_seconds(SystemTime::now());
        let started = live.start_time_seconds.expect("start time");
        assert!(started <= now + 1.0 && started > now - 86_400.0 * 365.0, "{started} vs {now}");
        assert!(
            live.resident_bytes.unwrap() > 0 && live.virtual_bytes.unwrap() >= live.resident_bytes.unwrap()
        );
        assert!(live.open_fds.unwrap() >= 3 && live.max_fds.unwrap() >= live.open_fds.unwrap());
        assert!(live.cpu_seconds.unwrap() >= 0.0);
        let exp = parse(&Metrics::new().render());
        assert!(exp.value(PROCESS_RESIDENT, &[]).unwrap().parse::<u64>().unwrap() > 0);
    }

    /// kube-proxy's change trackers set the pending gauges and the last-queued time as a change
    /// arrives, and a sync zeroes the gauges when it takes the changes: the page shows what waits.
    #[test]
    fn pending_gauges_follow_the_queue_and_a_sync_taking_it() {
        use crate::k8s::api_watch::{Changes, Snapshot};
        use crate::k8s::manifest::Sourced;
        use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

        let metrics = Metrics::new();
        let changes = Changes::default().with_queue_metrics(Arc::new(metrics.clone()));
        let pending = |exp: &Exposition| {
            let value = |name| exp.value(name, &[]).unwrap().parse::<u64>().unwrap();
            (value(SERVICE_CHANGES_PENDING), value(ENDPOINT_CHANGES_PENDING))
        };
        let last_queued = |exp: &Exposition| {
            exp.value(LAST_QUEUED_TIMESTAMP, &[("ip_family", "IPv4")]).unwrap().parse::<f64>().unwrap()
        };
        let exp = parse(&metrics.render());
        assert_eq!((pending(&exp), last_queued(&exp)), ((0, 0), 0.0));

        let before = unix_seconds(SystemTime::now());
        let mut snapshot = Snapshot::default();
        let service = Arc::new(Sourced { origin: "test".to_owned(), object: Service::default() });
        snapshot.services.insert(("default".into(), "web".into(), 0), service);
        for name in ["web-a", "web-b"] {
            let slice = Arc::new(Sourced { origin: "test".to_owned(), object: EndpointSlice::default() });
            snapshot.slices.insert(("default".into(), name.into(), 0), slice);
        }
        changes.replace_all(snapshot);
        let exp = parse(&metrics.render());
        assert_eq!(pending(&exp), (1, 2), "queued, not yet synced");
        let queued_at = last_queued(&exp);
        assert!(queued_at >= before.floor(), "{queued_at} vs {before}");

        // The sync loop takes the changes as it starts: nothing pending, the queue time stays.
        let taken = changes.take_pending();
        assert_eq!((taken.service_changes, taken.endpoint_changes), (1, 2));
        let exp = parse(&metrics.render());
        assert_eq!(pending(&exp), (0, 0), "taken by the sync");
        assert_eq!(last_queued(&exp), queued_at);
    }

    #[test]
    fn rendered_text_reflects_updates() {
        let m = Metrics::new();
        let finished = UNIX_EPOCH + Duration::from_millis(1_700_000_000_500);
        m.observe_sync(Duration::from_millis(3), finished, true);
        m.observe_sync(Duration::from_millis(20), finished, false);
        m.observe_sync(Duration::from_secs(60), finished, false);
        m.observe_network_programming(Duration::from_millis(700));
        m.observe_network_programming(Duration::from_secs(400));
        m.queued(1, 4, UNIX_EPOCH + Duration::from_secs(1_700_000_100));
        m.add_changes(3, 2);
        m.add_changes(2, 0);
        m.inc_sync_errors(1);
        m.inc_sync_errors(2);
        m.set_map_usage("services", 10, 65536);
        m.set_map_usage("odd\"name\\x", 1, 2);
        m.set_map_usage("services", 12, 65536);
        m.set_datapath_counters(&[("forwarded", 100), ("no_backend", 3)]);
        m.set_datapath_counters(&[("forwarded", 150)]);
        m.set_programmed(7, 21);

        let text = m.render();
        let exp = parse(&text);

        // Sync duration: 3 ms lands in le=0.004, 20 ms in le=0.032, 60 s only in +Inf.
        let v4 = [("ip_family", "IPv4")];
        let bucket =
            |name: &str, le: &str| exp.value(&format!("{name}_bucket"), &[("ip_family", "IPv4"), ("le", le)]);
        assert_eq!(bucket(SYNC_DURATION, "0.002"), Some("0"));
        assert_eq!(bucket(SYNC_DURATION, "0.004"), Some("1"));
        assert_eq!(bucket(SYNC_DURATION, "0.016"), Some("1"));
        assert_eq!(bucket(SYNC_DURATION, "0.032"), Some("2"));
        assert_eq!(bucket(SYNC_DURATION, "16.384"), Some("2"));
        assert_eq!(bucket(SYNC_DURATION, "+Inf"), Some("3"));
        assert_eq!(exp.value(&format!("{SYNC_DURATION}_count"), &v4), Some("3"));
        let sum: f64 = exp.value(&format!("{SYNC_DURATION}_sum"), &v4).unwrap().parse().unwrap();
        assert!((sum - 60.023).abs() < 1e-9, "{sum}");
        // The first sync was full, the other two partial; each is also in the overall histogram.
        assert_eq!(bucket(SYNC_FULL_DURATION, "0.004"), Some("1"));
        assert_eq!(exp.value(&format!("{SYNC_FULL_DURATION}_count"), &v4), Some("1"));
        assert_eq!(bucket(SYNC_PARTIAL_DURATION, "0.004"), Some("0"));
        assert_eq!(bucket(SYNC_PARTIAL_DURATION, "0.032"), Some("1"));
        assert_eq!(bucket(SYNC_PARTIAL_DURATION, "+Inf"), Some("2"));
        assert_eq!(exp.value(&format!("{SYNC_PARTIAL_DURATION}_count"), &v4), Some("2"));

        assert_eq!(bucket(NETWORK_PROGRAMMING, "0.5"), Some("0"));
        assert_eq!(bucket(NETWORK_PROGRAMMING, "1"), Some("1"));
        assert_eq!(bucket(NETWORK_PROGRAMMING, "300"), Some("1"));
        assert_eq!(bucket(NETWORK_PROGRAMMING, "+Inf"), Some("2"));

        // Buckets are cumulative (non-decreasing) and end with +Inf == count.
        for name in [SYNC_DURATION, SYNC_FULL_DURATION, SYNC_PARTIAL_DURATION, NETWORK_PROGRAMMING] {
            let series: Vec<_> =
                exp.samples.iter().filter(|(n, _, _)| n == &format!("{name}_bucket")).collect();
            let counts: Vec<u64> = series.iter().map(|(_, _, v)| v.parse().unwrap()).collect();
            assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{name}");
            assert_eq!(
                series.last().unwrap().1,
                vec![("ip_family".into(), "IPv4".into()), ("le".into(), "+Inf".into())]
            );
        }

        assert_eq!(exp.value(LAST_SYNC_TIMESTAMP, &v4), Some("1700000000.5"));
        assert_eq!(exp.value(LAST_QUEUED_TIMESTAMP, &v4), Some("1700000100"));
        assert_eq!(exp.value(ENDPOINT_CHANGES_PENDING, &[]), Some("4"));
        assert_eq!(exp.value(SERVICE_CHANGES_PENDING, &[]), Some("1"));
        assert_eq!(exp.value(ENDPOINT_CHANGES_TOTAL, &[]), Some("5"));
        assert_eq!(exp.value(SERVICE_CHANGES_TOTAL, &[]), Some("2"));
        assert_eq!(exp.value(SYNC_ERRORS, &[]), Some("3"));
        assert_eq!(exp.value(MAP_ENTRIES, &[("map", "services")]), Some("12"));
        assert_eq!(exp.value(MAP_CAPACITY, &[("map", "services")]), Some("65536"));
        assert_eq!(exp.value(MAP_ENTRIES, &[("map", "odd\"name\\x")]), Some("1"));
        assert!(text.contains(r#"kproxy_bpf_map_capacity{map="odd\"name\\x"} 2"#));
        assert_eq!(exp.value(DATAPATH_PACKETS, &[("reason", "forwarded")]), Some("150"));
        assert_eq!(exp.value(DATAPATH_PACKETS, &[("reason", "no_backend")]), Some("3"));
        assert_eq!(exp.value(FRONTENDS, &[]), Some("7"));
        assert_eq!(exp.value(BACKENDS, &[]), Some("21"));
    }

    #[test]
    fn conntrack_gc_metrics_and_the_eviction_estimate() {
        let m = Metrics::new();
        m.set_gc_interval(Duration::from_secs(30));
        assert_eq!(parse(&m.render()).value(CT_GC_INTERVAL, &[]), Some("30"));
        m.observe_gc(&[("OPEN", 4), ("ESTABLISHED", 2)].into(), 1, Duration::from_secs(15));
        m.observe_gc(&[("OPEN", 2)].into(), 0, Duration::from_secs_f64(7.5));
        m.add_conntrack_purged(6);
        m.set_datapath_counters(&[(NEW_FLOW_REASON, 50)]);
        m.set_map_usage(CONNTRACK_MAP, 40, 262144);
        let exp = parse(&m.render());
        assert_eq!(exp.value(CT_GC_RUNS, &[]), Some("2"));
        assert_eq!(exp.value(CT_GC_DELETED, &[("state", "OPEN")]), Some("6"));
        assert_eq!(exp.value(CT_GC_DELETED, &[("state", "ESTABLISHED")]), Some("2"));
        assert_eq!(exp.value(CT_GC_INTERVAL, &[]), Some("7.5"));
        assert_eq!(exp.value(CT_PURGED, &[]), Some("6"));
        assert_eq!(exp.value(CT_CREATED, &[]), Some("50"));
        // 2 × 50 − 8 − 6 − 40
        assert_eq!(exp.value(CT_EVICTED, &[]), Some("46"));
        assert_eq!(exp.value(AFFINITY_GC_DELETED, &[]), Some("1"));
    }
}
