//! The `kubeproxy_*` families: kube-proxy 1.34's names, types, labels, help texts and buckets byte for byte, so
//! that dashboards and alerts written for kube-proxy keep working; and the process-wide health-answer counters
//! behind `kubeproxy_proxy_healthz_total` and `_livez_total`.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use super::Inner;
use super::exposition::{exponential_buckets, format_float, header, sample, scalars};

pub(super) const SYNC_DURATION: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
pub(super) const SYNC_FULL_DURATION: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds";
pub(super) const SYNC_PARTIAL_DURATION: &str = "kubeproxy_sync_partial_proxy_rules_duration_seconds";
pub(super) const NO_LOCAL_ENDPOINTS: &str = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
pub(super) const HEALTHZ_TOTAL: &str = "kubeproxy_proxy_healthz_total";
pub(super) const LIVEZ_TOTAL: &str = "kubeproxy_proxy_livez_total";
pub(super) const CT_RECONCILER_DURATION: &str = "kubeproxy_conntrack_reconciler_sync_duration_seconds";
pub(super) const CT_RECONCILER_DELETED: &str = "kubeproxy_conntrack_reconciler_deleted_entries_total";
pub(super) const NETWORK_PROGRAMMING: &str = "kubeproxy_network_programming_duration_seconds";
pub(super) const LAST_SYNC_TIMESTAMP: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
pub(super) const LAST_QUEUED_TIMESTAMP: &str = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds";
pub(super) const ENDPOINT_CHANGES_PENDING: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_pending";
pub(super) const ENDPOINT_CHANGES_TOTAL: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_total";
pub(super) const SERVICE_CHANGES_PENDING: &str = "kubeproxy_sync_proxy_rules_service_changes_pending";
pub(super) const SERVICE_CHANGES_TOTAL: &str = "kubeproxy_sync_proxy_rules_service_changes_total";

/// kube-proxy ≥ 1.34 labels its per-family series with the family each of its proxiers programs, and
/// runs one per family whenever the node supports both (whatever the cluster), so a dashboard finds
/// both `ip_family` values. kproxy's datapath serves both families, so both are always written.
pub(super) const IP_FAMILIES: [&str; 2] = ["IPv4", "IPv6"];

/// The index of a family in [`IP_FAMILIES`] and the per-family arrays of [`Inner`].
pub(super) fn family_index(addr: &std::net::IpAddr) -> usize {
    usize::from(addr.is_ipv6())
}

/// A histogram family written once per `ip_family`, with the same observations: kproxy's one sync
/// writes both families' maps (kube-proxy's two proxiers each sync their own), and the conntrack
/// reconciler's one run scans both tables, so each family's series see every run.
fn render_both_families(histogram: &super::Histogram, name: &str, help: &str, out: &mut String) {
    header(out, name, help, "histogram");
    for family in IP_FAMILIES {
        histogram.render_series(name, &[("ip_family", family)], out);
    }
}

/// A gauge or counter family with one value per `ip_family`.
fn render_per_family(out: &mut String, name: &str, help: &str, kind: &str, values: [String; 2]) {
    header(out, name, help, kind);
    for (family, value) in IP_FAMILIES.iter().zip(values) {
        sample(out, name, &[("ip_family", family)], &value);
    }
}

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

/// Which of kube-proxy's health endpoints answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Probe {
    Healthz,
    Livez,
}

/// Health answers by endpoint and HTTP status code. Process-wide, as kube-proxy's
/// legacy registry is: the health server runs apart from the sync loop's [`Metrics`](super::Metrics).
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

/// The kube-proxy families, in the order the page has always listed them.
pub(super) fn render(inner: &Inner, out: &mut String) {
    render_sync_latencies(inner, out);
    render_sync_state(inner, out);
    render_no_local_endpoints(inner.no_local_endpoints, out);
    render_probes(out);
    render_conntrack_reconciler(inner, out);
}

/// The sync and network-programming histograms.
fn render_sync_latencies(inner: &Inner, out: &mut String) {
    for (histogram, name, help) in [
        (&inner.sync_duration, SYNC_DURATION, "SyncProxyRules latency in seconds"),
        (&inner.sync_full_duration, SYNC_FULL_DURATION, "SyncProxyRules latency in seconds for full resyncs"),
        (
            &inner.sync_partial_duration,
            SYNC_PARTIAL_DURATION,
            "SyncProxyRules latency in seconds for partial resyncs",
        ),
        (
            &inner.network_programming,
            NETWORK_PROGRAMMING,
            "In Cluster Network Programming Latency in seconds",
        ),
    ] {
        render_both_families(histogram, name, help, out);
    }
}

/// When rules were last synced and queued, and the changes pending and received.
fn render_sync_state(inner: &Inner, out: &mut String) {
    // One sync programs both families, and a change queues it for both.
    let synced = format_float(inner.last_sync_timestamp);
    let queued = format_float(inner.last_queued_timestamp);
    render_per_family(
        out,
        LAST_SYNC_TIMESTAMP,
        "The last time proxy rules were successfully synced",
        "gauge",
        [synced.clone(), synced],
    );
    render_per_family(
        out,
        LAST_QUEUED_TIMESTAMP,
        "The last time a sync of proxy rules was queued",
        "gauge",
        [queued.clone(), queued],
    );
    scalars(
        out,
        [
            (
                ENDPOINT_CHANGES_PENDING,
                "Pending proxy rules Endpoint changes",
                "gauge",
                inner.endpoint_changes_pending.to_string(),
            ),
            (
                ENDPOINT_CHANGES_TOTAL,
                "Cumulative proxy rules Endpoint changes",
                "counter",
                inner.endpoint_changes_total.to_string(),
            ),
            (
                SERVICE_CHANGES_PENDING,
                "Pending proxy rules Service changes",
                "gauge",
                inner.service_changes_pending.to_string(),
            ),
            (
                SERVICE_CHANGES_TOTAL,
                "Cumulative proxy rules Service changes",
                "counter",
                inner.service_changes_total.to_string(),
            ),
        ],
    );
}

/// Per family, `(internal, external)`: Service ports by the traffic policy that finds no local endpoint.
fn render_no_local_endpoints(per_family: [(u64, u64); 2], out: &mut String) {
    header(
        out,
        NO_LOCAL_ENDPOINTS,
        "Number of services with a Local traffic policy and no endpoints",
        "gauge",
    );
    for (family, (internal, external)) in IP_FAMILIES.iter().zip(per_family) {
        for (policy, count) in [("internal", internal), ("external", external)] {
            sample(
                out,
                NO_LOCAL_ENDPOINTS,
                &[("ip_family", family), ("traffic_policy", policy)],
                &count.to_string(),
            );
        }
    }
}

/// The health server's answers by endpoint and status code.
fn render_probes(out: &mut String) {
    for (probe, name, help) in [
        (Probe::Healthz, HEALTHZ_TOTAL, "Cumulative proxy healthz HTTP status"),
        (Probe::Livez, LIVEZ_TOTAL, "Cumulative proxy livez HTTP status"),
    ] {
        header(out, name, help, "counter");
        for ((_, code), count) in lock_probes().iter().filter(|((p, _), _)| *p == probe) {
            sample(out, name, &[("code", &code.to_string())], &count.to_string());
        }
    }
}

/// kproxy's conntrack reconciler: the purge of removed UDP backends' entries, deleted per family.
fn render_conntrack_reconciler(inner: &Inner, out: &mut String) {
    render_both_families(
        &inner.ct_reconcile_duration,
        CT_RECONCILER_DURATION,
        "ReconcileConntrackFlowsLatency latency in seconds",
        out,
    );
    render_per_family(
        out,
        CT_RECONCILER_DELETED,
        "Cumulative conntrack flows deleted by conntrack reconciler",
        "counter",
        inner.purged_by_family.map(|n| n.to_string()),
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use super::super::tests::{Exposition, parse};
    use super::super::{Metrics, unix_seconds};
    use super::*;
    use crate::model::{Frontend, Scope};

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

    fn frontend(
        name: &str,
        port_name: &str,
        vip: impl Into<std::net::IpAddr>,
        scope: Scope,
        no_local: bool,
    ) -> Frontend {
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
            // The same Service dual-stack: its IPv6 cluster IP counts its port under IPv6.
            frontend("itp", "http", v6(1), Scope::Internal, true),
            // externalTrafficPolicy: Local, endpoints elsewhere: one port on a node port and an external IP;
            // its internal entries ignore the policy and have endpoints.
            frontend("etp", "http", [192, 168, 1, 10], Scope::External, true),
            frontend("etp", "http", [203, 0, 113, 7], Scope::External, true),
            frontend("etp", "http", [192, 168, 1, 10], Scope::Internal, false),
            // Served here, or by nobody (refused, not dropped): not counted.
            frontend("fine", "http", [10, 96, 0, 3], Scope::Internal, false),
            frontend("fine", "http", v6(3), Scope::Internal, false),
            // An IPv6-only Service with internalTrafficPolicy: Local and its endpoints elsewhere.
            frontend("itp6", "dns", v6(0x53), Scope::Internal, true),
        ]);
        let exp = parse(&m.render());
        let value =
            |policy| exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", "IPv4"), ("traffic_policy", policy)]);
        assert_eq!((value("internal"), value("external")), (Some("2"), Some("1")));
        let value6 =
            |policy| exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", "IPv6"), ("traffic_policy", policy)]);
        assert_eq!((value6("internal"), value6("external")), (Some("2"), Some("0")));

        // Recounted at each sync, as kube-proxy sets the gauge.
        m.set_no_local_endpoints(&[]);
        let exp = parse(&m.render());
        let value =
            |policy| exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", "IPv4"), ("traffic_policy", policy)]);
        assert_eq!((value("internal"), value("external")), (Some("0"), Some("0")));
    }

    fn v6(last: u16) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, last)
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
        m.add_conntrack_purged(4, 2);
        m.observe_conntrack_reconcile(Duration::from_micros(1500));
        m.add_conntrack_purged(0, 6);
        m.observe_conntrack_reconcile(Duration::from_millis(40));
        let exp = parse(&m.render());
        let (v4, v6) = ([("ip_family", "IPv4")], [("ip_family", "IPv6")]);
        // Deleted entries by the family of their table.
        assert_eq!(exp.value(CT_RECONCILER_DELETED, &v4), Some("4"));
        assert_eq!(exp.value(CT_RECONCILER_DELETED, &v6), Some("8"));
        // Each run scans both tables: both families' histograms see it.
        for family in ["IPv4", "IPv6"] {
            assert_eq!(
                exp.value(&format!("{CT_RECONCILER_DURATION}_count"), &[("ip_family", family)]),
                Some("2")
            );
            let bucket = |le| {
                exp.value(&format!("{CT_RECONCILER_DURATION}_bucket"), &[("ip_family", family), ("le", le)])
            };
            assert_eq!(
                (bucket("0.001"), bucket("0.002"), bucket("0.064")),
                (Some("0"), Some("1"), Some("2"))
            );
        }
        // kproxy's own counter is the sum.
        assert_eq!(exp.value(super::super::kproxy::CT_PURGED, &[]), Some("12"));
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
            let value = exp.value(LAST_QUEUED_TIMESTAMP, &[("ip_family", "IPv4")]);
            assert_eq!(
                value,
                exp.value(LAST_QUEUED_TIMESTAMP, &[("ip_family", "IPv6")]),
                "one queue for both"
            );
            value.unwrap().parse::<f64>().unwrap()
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
}
