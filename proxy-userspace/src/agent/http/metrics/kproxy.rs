//! The `kproxy_*` families: what kube-proxy has no name for: the eBPF maps and the datapath's counters, the
//! frontends programmed, conntrack garbage collection and eviction, inherited connections, the manifests
//! source, and the build.

use crate::k8s::manifest_watch;

use super::exposition::{format_float, header, labelled, sample, scalar, scalars};
use super::{BUILD_COMMIT, BUILD_VERSION, Inner};

pub(super) const BUILD_INFO: &str = "kproxy_build_info";
pub(super) const MAP_ENTRIES: &str = "kproxy_bpf_map_entries";
pub(super) const MAP_CAPACITY: &str = "kproxy_bpf_map_capacity";
pub(super) const DATAPATH_PACKETS: &str = "kproxy_datapath_packets_total";
pub(super) const SYNC_ERRORS: &str = "kproxy_sync_errors_total";
pub(super) const FRONTENDS: &str = "kproxy_frontends";
pub(super) const BACKENDS: &str = "kproxy_backends";
pub(super) const CT_GC_RUNS: &str = "kproxy_conntrack_gc_runs_total";
pub(super) const CT_GC_DELETED: &str = "kproxy_conntrack_gc_deleted_total";
pub(super) const CT_GC_INTERVAL: &str = "kproxy_conntrack_gc_interval_seconds";
pub(super) const CT_PURGED: &str = "kproxy_conntrack_purged_total";
pub(super) const INHERITED_OPEN: &str = "kproxy_inherited_connections";
pub(super) const CT_CREATED: &str = "kproxy_conntrack_created_total";
pub(super) const CT_EVICTED: &str = "kproxy_conntrack_evicted_total";
pub(super) const AFFINITY_GC_DELETED: &str = "kproxy_affinity_gc_deleted_total";
pub(super) const TOPOLOGY_PORTS: &str = "kproxy_topology_service_ports";
const MANIFEST_OBJECTS_KEPT: &str = "kproxy_manifest_objects_kept_last_good";
const MANIFEST_ERRORS: &str = "kproxy_manifest_errors";
/// The datapath counter of new translated flows (two entries each).
pub(super) const NEW_FLOW_REASON: &str = "dnat_new_flow";
pub(super) const CONNTRACK_MAP: &str = "conntrack_v4";
/// The IPv6 table: the datapath's new-flow counter counts flows of both families.
pub(super) const CONNTRACK_MAP_V6: &str = "conntrack_v6";

/// The maps' occupancy, the datapath's packet counters, the failed syncs and what is programmed.
pub(super) fn render_datapath(inner: &Inner, out: &mut String) {
    labelled(
        out,
        MAP_ENTRIES,
        "Entries currently in a kproxy BPF map",
        "gauge",
        "map",
        inner.maps.iter().map(|(map, (entries, _))| (map, *entries)),
    );
    labelled(
        out,
        MAP_CAPACITY,
        "Maximum entries of a kproxy BPF map",
        "gauge",
        "map",
        inner.maps.iter().map(|(map, (_, capacity))| (map, *capacity)),
    );
    labelled(
        out,
        DATAPATH_PACKETS,
        "Packets seen by the kproxy datapath, by outcome",
        "counter",
        "reason",
        inner.datapath_packets.iter().map(|(reason, value)| (reason, *value)),
    );
    scalars(
        out,
        [
            (SYNC_ERRORS, "Failed datapath syncs", "counter", inner.sync_errors_total.to_string()),
            (FRONTENDS, "Service frontends programmed in the datapath", "gauge", inner.frontends.to_string()),
            (BACKENDS, "Service backends programmed in the datapath", "gauge", inner.backends.to_string()),
        ],
    );
    render_topology(inner.topology_narrowed, out);
}

/// Per family, `(same zone, same node)`: Service ports whose endpoints topology hints narrowed.
fn render_topology(per_family: [(u64, u64); 2], out: &mut String) {
    header(
        out,
        TOPOLOGY_PORTS,
        "Service ports whose endpoints topology hints narrowed, by the rule that chose them",
        "gauge",
    );
    for (family, (same_zone, same_node)) in ["IPv4", "IPv6"].into_iter().zip(per_family) {
        for (topology, count) in [("PreferSameZone", same_zone), ("PreferSameNode", same_node)] {
            sample(out, TOPOLOGY_PORTS, &[("ip_family", family), ("topology", topology)], &count.to_string());
        }
    }
}

/// Conntrack garbage collection, the inherited connections, the purge, and the flows created and evicted.
pub(super) fn render_conntrack(inner: &Inner, out: &mut String) {
    scalar(out, CT_GC_RUNS, "Conntrack garbage collection runs", "counter", &inner.gc_runs_total.to_string());
    labelled(
        out,
        CT_GC_DELETED,
        "Conntrack entries deleted by garbage collection, by the flow's state",
        "counter",
        "state",
        inner.gc_deleted.iter().map(|(state, n)| (state, *n)),
    );
    let created = inner.datapath_packets.get(NEW_FLOW_REASON).copied().unwrap_or(0);
    let current: u64 = [CONNTRACK_MAP, CONNTRACK_MAP_V6]
        .iter()
        .filter_map(|map| inner.maps.get(*map))
        .map(|(entries, _)| entries)
        .sum();
    let gc_deleted: u64 = inner.gc_deleted.values().sum();
    let evicted = crate::bpf::conntrack::evicted_estimate(created, gc_deleted, inner.purged_total, current);
    scalars(
        out,
        [
            (
                CT_GC_INTERVAL,
                "Current (adaptive) interval between conntrack garbage collection runs",
                "gauge",
                format_float(inner.gc_interval_seconds),
            ),
            (
                INHERITED_OPEN,
                "Connections netfilter (kube-proxy) translated before kproxy took over that are still open: \
                 left to netfilter until they end",
                "gauge",
                inner.inherited_open.to_string(),
            ),
            (
                CT_PURGED,
                "Conntrack entries deleted at once because their UDP backend was removed",
                "counter",
                inner.purged_total.to_string(),
            ),
            (
                CT_CREATED,
                "Translated flows created by the datapath (two conntrack entries each)",
                "counter",
                created.to_string(),
            ),
            (
                CT_EVICTED,
                "Estimate of conntrack entries evicted by the LRU: 2 x created - GC-deleted - purged - \
                 current entries, clamped at 0 (an estimate: the agent's counters restart with it, the \
                 datapath's do not, and flushes and datapath replacements are not subtracted)",
                "counter",
                evicted.to_string(),
            ),
            (
                AFFINITY_GC_DELETED,
                "sessionAffinity entries deleted by garbage collection",
                "counter",
                inner.affinity_gc_deleted_total.to_string(),
            ),
        ],
    );
}

/// What the `--manifests` source last published; nothing when the agent reads the API server.
pub(super) fn render_manifests(out: &mut String) {
    let Some(state) = manifest_watch::last_state() else { return };
    scalars(
        out,
        [
            (
                MANIFEST_OBJECTS_KEPT,
                "Objects from --manifests kept at their last good version because their file or document \
                 cannot be read as it is now",
                "gauge",
                state.objects_kept.to_string(),
            ),
            (
                MANIFEST_ERRORS,
                "Problems the --manifests source reports now (files, documents and objects it cannot read)",
                "gauge",
                state.errors.to_string(),
            ),
        ],
    );
}

pub(super) fn render_build_info(out: &mut String) {
    header(out, BUILD_INFO, "kproxy's version and the commit it was built from; always 1", "gauge");
    sample(out, BUILD_INFO, &[("commit", BUILD_COMMIT), ("version", BUILD_VERSION)], "1");
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::Metrics;
    use super::super::tests::parse;
    use super::*;

    #[test]
    fn conntrack_gc_metrics_and_the_eviction_estimate() {
        let m = Metrics::new();
        m.set_gc_interval(Duration::from_secs(30));
        assert_eq!(parse(&m.render()).value(CT_GC_INTERVAL, &[]), Some("30"));
        m.observe_gc(&[("OPEN", 4), ("ESTABLISHED", 2)].into(), 1, Duration::from_secs(15));
        m.observe_gc(&[("OPEN", 2)].into(), 0, Duration::from_secs_f64(7.5));
        m.add_conntrack_purged(4, 2);
        m.set_datapath_counters(&[(NEW_FLOW_REASON, 50)]);
        m.set_map_usage(CONNTRACK_MAP, 30, 262144);
        // Flows of both families count as created; their entries are in both tables.
        m.set_map_usage(CONNTRACK_MAP_V6, 10, 262144);
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
