//! The sync loop: a snapshot of the objects → the model → the maps (reconcile), then the sockets and
//! UDP flows of removed backends (effects), then logs, metrics and health (report).

use std::{
    collections::BTreeSet,
    time::{Instant, SystemTime},
};

use anyhow::Result;
use proxy_common::maps::SockRevNatKeyV4;

use super::{SocketLbMode, gc, nodeport};
use crate::{
    agent::http::health::Health,
    agent::http::metrics::Metrics,
    agent::nodeport::{NodeAddresses, NorthSouthOptions},
    bpf::{self, InterfaceSelector, Maps},
    k8s::api_watch::{Changes, Objects, Pending},
    k8s::kept,
    k8s::manifest::ManifestError,
    model::{self, Desired, ModelOptions, service_cidrs::ServiceCidrs},
    net::Protocol,
    sync::{SyncReport, Syncer},
};

pub(super) struct SyncLoop<'a> {
    /// `--nodeport-addresses primary` with `--manifests`: the default route's address.
    pub(super) fixed_primary: Option<std::net::Ipv4Addr>,
    pub(super) syncer: &'a mut Syncer,
    pub(super) metrics: &'a Metrics,
    pub(super) health: &'a Health,
    /// The next sync is a full one in kube-proxy's sense (the first, and each after the maps were
    /// re-read for the periodic resync), for the full and partial sync histograms.
    pub(super) full_sync_due: bool,
    /// Errors already logged: a bad object is reported once per version.
    pub(super) logged: BTreeSet<String>,
    /// The agent's handles on the maps besides the syncer's: north-south addresses, service CIDRs,
    /// socket rev-NAT, conntrack purges.
    pub(super) maps: Maps,
    /// Per-Service model results, for the API-server source (where
    /// namespace/name is unique); manifests are always modelled whole, which
    /// also reports a Service defined twice.
    pub(super) cache: Option<crate::model::cache::ModelCache>,
    pub(super) north_south: NorthSouthOptions,
    pub(super) socket_lb: SocketLbMode,
    pub(super) pod_interfaces: InterfaceSelector,
    /// As last written to the maps.
    pub(super) node_addresses: Option<NodeAddresses>,
    /// Objects whose new version is invalid keep their last valid one.
    pub(super) last_good: crate::model::last_good::LastGood,
    /// The service CIDRs as last logged.
    pub(super) service_cidrs: Option<ServiceCidrs>,
    /// Which endpoints topology chose per Service port, as last logged.
    pub(super) topology: super::topology::TopologyChoices,
}

impl SyncLoop<'_> {
    /// The node's NodePort addresses and external interfaces, read again at
    /// every sync (addresses come and go with DHCP and operators); the
    /// datapath's view is updated when they change.
    pub(super) fn refresh_node_addresses(
        &mut self,
        primary: Option<std::net::Ipv4Addr>,
    ) -> Vec<std::net::IpAddr> {
        let primary = self.fixed_primary.or(primary);
        let addresses = match nodeport::local_addresses() {
            Ok(local) => nodeport::select(&self.north_south, &local, &self.pod_interfaces, primary),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "reading the node's addresses failed");
                return self.node_addresses.as_ref().map(|a| a.nodeport.clone()).unwrap_or_default();
            }
        };
        if self.node_addresses.as_ref() != Some(&addresses) {
            match nodeport::write_maps(&mut self.maps, &self.north_south, &addresses) {
                Ok(_) => {
                    tracing::info!(
                        nodeport_addresses = ?addresses.nodeport,
                        external_interfaces = ?addresses.interface_names(),
                        "north-south addresses"
                    );
                    self.node_addresses = Some(addresses.clone());
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "writing the external interfaces failed"),
            }
        }
        addresses.nodeport
    }

    /// Applies the current objects; returns the healthCheckNodePorts to serve.
    pub(super) fn sync(&mut self, changes: &Changes, options: &ModelOptions) -> Vec<model::HealthCheck> {
        let started = Instant::now();
        let pending = changes.take_pending();
        let options = &ModelOptions {
            node_addresses: self.refresh_node_addresses(changes.node_primary_ipv4()),
            // --node-zone wins over the Node object's label.
            zone: options.zone.clone().or_else(|| changes.node_zone()),
            ..options.clone()
        };
        // Reconcile: the objects → the model → the maps. From the API server, an endpoint change
        // reaches the model as the objects replaced, at their positions: no pass over every object.
        let replaced = match &self.cache {
            Some(_) => changes.take_replaced().and_then(|r| self.last_good.admit_replaced(r, options)),
            None => None,
        };
        // The cache is taken out for the sync: the desired state is borrowed from it.
        let mut cache = self.cache.take();
        let built;
        let (desired, model_errors, changed, taken) = match &mut cache {
            Some(cache) => {
                let patched =
                    replaced.as_ref().and_then(|r| cache.update_replaced(&r.services, &r.slices, options));
                let (changed, taken) = match (patched, replaced) {
                    (Some(changed), Some(replaced)) => (changed, Taken::counted(replaced.errors, cache)),
                    _ => {
                        let snapshot = self.last_good.admit(changes.objects(), options);
                        let changed = cache.update(&snapshot.services, &snapshot.slices, options).changed;
                        (changed, Taken::of(snapshot))
                    }
                };
                let (desired, errors) = cache.result();
                (desired, errors.to_vec(), changed, taken)
            }
            None => {
                // Manifests: modelled whole, from the objects as the source keeps them.
                let snapshot = self.last_good.admit(changes.objects(), options);
                let (services, slices) = (kept::decoded(&snapshot.services), kept::decoded(&snapshot.slices));
                built = model::build_with(&services, &slices, options);
                (&built.0, built.1.clone(), None, Taken::of(snapshot))
            }
        };
        let (service_cidrs, cidr_errors) =
            model::service_cidrs::resolve(&options.service_cidrs, &changes.service_cidrs());
        let model_errors: Vec<ManifestError> = model_errors.into_iter().chain(cidr_errors).collect();
        // Only the frontends the model changed, unless this is a full sync (after the maps were read
        // again, everything is compared).
        let report = changed
            .filter(|_| !self.full_sync_due)
            .and_then(|changed| self.syncer.apply_changed(desired, &changed))
            .unwrap_or_else(|| self.syncer.apply(desired));
        self.program_service_cidrs(service_cidrs);
        self.metrics.set_no_local_endpoints(&desired.frontends);
        self.tell_topology(&desired.frontends);
        // Effects: what removed backends leave behind.
        self.destroy_udp_sockets(&report);
        self.purge_udp_conntrack(&report);
        // Report: logs, metrics, health.
        let finished = SystemTime::now();
        self.log_new_errors(&taken.errors, &model_errors, &report);
        self.record(&report, pending, started, finished);
        if report.changed() || !report.errors.is_empty() {
            self.log_summary(&taken, desired, &report, started);
        }
        let health_checks = desired.health_checks.clone();
        self.cache = cache;
        health_checks
    }

    /// Logs each Service port whose topology choice changed, and sets the gauge.
    fn tell_topology(&mut self, frontends: &[crate::model::Frontend]) {
        let (changes, narrowed) = self.topology.observe(frontends);
        changes.iter().for_each(super::topology::TopologyChange::log);
        self.metrics.set_topology_narrowed(narrowed);
    }

    /// Writes the service CIDRs when the map holds others (a datapath loaded afresh holds none), after
    /// the frontends: a new Service's cluster IP is a VIP before its range drops the rest. Logs each new
    /// set, and the ranges left out.
    fn program_service_cidrs(&mut self, cidrs: ServiceCidrs) {
        if self.service_cidrs.as_ref() != Some(&cidrs) {
            let shown = |list: &[crate::net::Cidr]| list.iter().map(ToString::to_string).collect::<Vec<_>>();
            let both: Vec<crate::net::Cidr> = cidrs
                .ipv4
                .iter()
                .map(|c| crate::net::Cidr::V4(*c))
                .chain(cidrs.ipv6.iter().map(|c| crate::net::Cidr::V6(*c)))
                .collect();
            tracing::info!(service_cidrs = ?shown(&both), "unallocated addresses of these service CIDRs are dropped");
            let before = self.service_cidrs.as_ref();
            if !cidrs.overflow.is_empty() && before.is_none_or(|b| b.overflow != cidrs.overflow) {
                tracing::warn!(
                    left_out = ?shown(&cidrs.overflow),
                    "more than {} service CIDRs of a family: the unallocated addresses of these are not dropped",
                    proxy_common::service_cidr::SERVICE_CIDRS_MAX
                );
            }
        }
        let map = &mut self.maps.service_cidrs;
        let written = bpf::service_cidrs::read(map)
            .and_then(
                |held| if held == cidrs.ipv4 { Ok(()) } else { bpf::service_cidrs::write(map, &cidrs.ipv4) },
            )
            .and_then(|()| {
                let map = &mut self.maps.service_cidrs_v6;
                let held = bpf::service_cidrs::read6(map)?;
                if held == cidrs.ipv6 { Ok(()) } else { bpf::service_cidrs::write6(map, &cidrs.ipv6) }
            });
        match written {
            Ok(()) => self.service_cidrs = Some(cidrs),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "writing the service CIDRs failed"),
        }
    }

    /// Destroys the UDP sockets connected to removed backends (socket-level load balancing).
    fn destroy_udp_sockets(&self, report: &SyncReport) {
        // Only UDP sockets: a TCP connection to a backend that left the slice carries on while
        // the pod answers, as kube-proxy leaves established TCP flows alone.
        let peers: Vec<crate::agent::sockdiag::Peer> = report
            .removed_backend_addrs
            .iter()
            .filter(|(_, proto)| *proto == Protocol::Udp)
            .map(|(b, _)| crate::agent::sockdiag::Peer { addr: b.addr, port: b.port })
            .collect();
        if self.socket_lb != SocketLbMode::Off && !peers.is_empty() {
            let (sock_revnat, sock_revnat_v6) = (&self.maps.sock_revnat, &self.maps.sock_revnat_v6);
            // An IPv4 peer of an AF_INET6 socket (mapped address) is in SOCK_REVNAT_V4 too.
            let translated = |cookie: u64, peer: &crate::agent::sockdiag::Peer| match peer.addr {
                std::net::IpAddr::V4(addr) => {
                    let key = SockRevNatKeyV4 {
                        cookie,
                        addr: addr.octets(),
                        port: peer.port.to_be_bytes(),
                        _pad: [0; 2],
                    };
                    sock_revnat.get(&key, 0).is_ok()
                }
                std::net::IpAddr::V6(addr) => {
                    let key = proxy_common::sock_v6::SockRevNatKeyV6 {
                        cookie,
                        addr: addr.octets(),
                        port: peer.port.to_be_bytes(),
                        _pad: [0; 6],
                    };
                    sock_revnat_v6.get(&key, 0).is_ok()
                }
            };
            let destroyed = crate::agent::sockdiag::destroy_everywhere(&peers, &translated);
            match destroyed {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(sockets = n, "destroyed the UDP sockets connected to removed backends")
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "destroying UDP sockets of removed backends failed")
                }
            }
        }
    }

    /// Purges the conntrack entries of removed UDP backends.
    fn purge_udp_conntrack(&mut self, report: &SyncReport) {
        if report.removed_backends.iter().any(|(_, proto)| *proto == Protocol::Udp) {
            // At once, so a UDP client that keeps its source port reaches a live
            // backend with its next packet (the CoreDNS problem).
            let reconcile_started = Instant::now();
            match purge_removed_udp_backends(&mut self.maps, report) {
                Ok(purged) => {
                    self.metrics.add_conntrack_purged(purged.ipv4, purged.ipv6);
                    if purged.total() > 0 {
                        tracing::info!(
                            entries = purged.total(),
                            ipv6_entries = purged.ipv6,
                            "purged the conntrack entries of removed UDP backends"
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "purging conntrack entries failed"),
            }
            self.metrics.observe_conntrack_reconcile(reconcile_started.elapsed());
        }
    }

    /// Logs each source, model and sync error once, when it first appears.
    fn log_new_errors(
        &mut self,
        source_errors: &[ManifestError],
        model_errors: &[ManifestError],
        report: &SyncReport,
    ) {
        let errors: BTreeSet<String> = source_errors
            .iter()
            .chain(model_errors)
            .map(ToString::to_string)
            .chain(report.errors.iter().map(ToString::to_string))
            .collect();
        for error in errors.difference(&self.logged) {
            tracing::error!("{error}");
        }
        self.logged = errors;
    }

    /// The sync's metrics, and `/healthz` when it succeeded.
    fn record(&mut self, report: &SyncReport, pending: Pending, started: Instant, finished: SystemTime) {
        self.metrics.observe_sync(started.elapsed(), finished, std::mem::take(&mut self.full_sync_due));
        // The pending gauges and the last-queued time are the queue's (Changes): set as changes
        // arrive, zeroed as this sync took them.
        self.metrics.add_changes(pending.endpoint_changes, pending.service_changes);
        self.metrics.inc_sync_errors(report.errors.len() as u64);
        self.metrics.set_programmed(self.syncer.frontend_count() as u64, self.syncer.backend_count() as u64);
        for (map, entries) in self.syncer.map_fill() {
            self.metrics.set_map_entries(map, entries);
        }
        for trigger in pending.trigger_times {
            if let Ok(latency) = finished.duration_since(trigger) {
                self.metrics.observe_network_programming(latency);
            }
        }
        if report.errors.is_empty() {
            self.health.updated(finished);
        }
    }

    fn log_summary(&self, taken: &Taken, desired: &Desired, report: &SyncReport, started: Instant) {
        tracing::info!(
            services = taken.services,
            endpoint_slices = taken.slices,
            frontends = desired.frontends.len(),
            added = report.frontends_added,
            updated = report.frontends_updated,
            removed = report.frontends_removed,
            backends_added = report.backends_added,
            backends_removed = report.backends_removed,
            backends_updated = report.backends_updated,
            errors = self.logged.len(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "synced"
        );
    }
}

/// What a sync took of the source: its errors (and those of kept last good versions), and how many
/// objects it holds, for the summary.
struct Taken {
    errors: Vec<ManifestError>,
    services: usize,
    slices: usize,
}

impl Taken {
    fn of(objects: Objects) -> Self {
        Self { services: objects.services.len(), slices: objects.slices.len(), errors: objects.errors }
    }

    /// After objects replaced in place: as many as the model's last whole list.
    fn counted(errors: Vec<ManifestError>, cache: &crate::model::cache::ModelCache) -> Self {
        let (services, slices) = cache.object_counts();
        Self { errors, services, slices }
    }
}

/// Deletes at once the conntrack entries of the UDP backends a sync removed, of both families
/// (TCP flows keep their backend, as kube-proxy's; see [`gc::purge_backends`]).
fn purge_removed_udp_backends(maps: &mut Maps, report: &SyncReport) -> Result<gc::Purged> {
    let udp: Vec<u32> = report
        .removed_backends
        .iter()
        .filter(|(_, proto)| *proto == Protocol::Udp)
        .map(|(id, _)| *id)
        .collect();
    gc::purge_backends(maps, &udp)
}
