//! Each Service's candidate frontends ([`Parts`]) and how they are merged: the first Service to claim an
//! address:port/protocol keeps it, later claimants are reported ([`Merge`]).

use std::borrow::{Borrow, Cow};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::ops::Range;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::k8s::manifest::{ManifestError, Sourced};
use crate::net::{Cidr, Protocol};

use super::endpoints::{
    Selection, SliceUse, count_endpoints, endpoints_for, local_endpoint_counts, select, use_slice,
};
use super::frontend::{Frontend, FrontendKind, HealthCheck, Scope, ServiceName, Topology};
use super::service::{ServicePlan, plan_service, service_error};
use super::{Desired, ModelOptions, ModelStats, filter_of};

/// The merge's maps, rebuilt every sync (see foldhash in Cargo.toml).
type FastMap<K, V> = foldhash::HashMap<K, V>;

/// What the model makes of some Services, each taken on its own: everything but the rules that span
/// Services, which [`Merge`] applies. [`crate::model::cache::ModelCache`] keeps one per Service and merges
/// them as [`build_with`] does, so both give the same result.
#[derive(Clone, Debug, Default)]
pub(crate) struct Parts {
    pub(super) services: Vec<ServiceParts>,
    /// The Services' claims one after the other, in the order they are claimed.
    pub(super) claims: Vec<Claim>,
    /// All counters but `services_programmed` and the frontend ones, which depend on the merge.
    pub(super) stats: ModelStats,
    pub(super) errors: Vec<ManifestError>,
}

/// One Service's candidate frontends, health check and trigger time.
#[derive(Clone, Debug)]
pub(super) struct ServiceParts {
    pub(super) origin: String,
    pub(super) name: ServiceName,
    /// Its part of [`Parts::claims`].
    pub(super) claims: Range<usize>,
    pub(super) health_check: Option<HealthCheck>,
    pub(super) trigger_time: Option<String>,
}

/// The entries of one address:port/protocol. They are claimed together so that internal and external
/// clients of an address always reach the same Service.
#[derive(Clone, Debug)]
pub(super) struct Claim {
    /// What to blame when another Service has the address:port/protocol already.
    pub(super) field: ClaimField,
    pub(super) internal: Frontend,
    /// The [`Scope::External`] entry of a north–south address with `externalTrafficPolicy: Local`.
    pub(super) external: Option<Frontend>,
}

impl Claim {
    pub(super) fn entries(&self) -> impl Iterator<Item = &Frontend> {
        std::iter::once(&self.internal).chain(&self.external)
    }

    pub(super) fn into_entries(self) -> impl Iterator<Item = Frontend> {
        std::iter::once(self.internal).chain(self.external)
    }
}

/// The field a [`Claim`] comes from (an index into the Service's lists).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ClaimField {
    ClusterIp { port: usize },
    NodePort { port: usize },
    ExternalIp { ip: usize },
    LoadBalancerIp { ingress: usize },
}

impl ClaimField {
    pub(super) fn path(self) -> String {
        match self {
            ClaimField::ClusterIp { port } => format!("spec.ports[{port}]"),
            ClaimField::NodePort { port } => format!("spec.ports[{port}].nodePort"),
            ClaimField::ExternalIp { ip } => format!("spec.externalIPs[{ip}]"),
            ClaimField::LoadBalancerIp { ingress } => format!("status.loadBalancer.ingress[{ingress}].ip"),
        }
    }

    /// What a conflict leaves out.
    pub(super) fn skipped(self) -> &'static str {
        match self {
            ClaimField::ClusterIp { .. } => "the port",
            ClaimField::NodePort { .. } => "the NodePort",
            ClaimField::ExternalIp { .. } => "the external IP",
            ClaimField::LoadBalancerIp { .. } => "the load-balancer IP",
        }
    }
}

/// Puts [`Parts`] together in order, applying the rules that span Services: an address:port/protocol,
/// and a health check port, belong to the first Service that claims them.
#[derive(Default)]
pub(crate) struct Merge {
    pub(super) frontends: Vec<Frontend>,
    pub(super) stats: ModelStats,
    pub(super) trigger_times: Vec<(ServiceName, String)>,
    pub(super) health_checks: Vec<HealthCheck>,
    /// The problems found in the parts, in order.
    pub(super) errors: Vec<ManifestError>,
    /// Problems found by the merge; reported after the others.
    pub(super) conflicts: Vec<ManifestError>,
    /// Who holds an address:port/protocol: the position of its first entry in `frontends`.
    pub(super) taken: FastMap<(IpAddr, u16, Protocol), usize>,
    /// Who holds a health check port: the position of its check in `health_checks`.
    pub(super) health_ports: FastMap<u16, usize>,
}

/// A [`Claim`] the merge may keep: moved out of owned parts, copied from borrowed ones.
pub(super) trait ClaimSource {
    fn claim(&self) -> &Claim;
    fn keep(self, frontends: &mut Vec<Frontend>);
}

impl ClaimSource for Claim {
    fn claim(&self) -> &Claim {
        self
    }

    fn keep(self, frontends: &mut Vec<Frontend>) {
        frontends.extend(self.into_entries());
    }
}

impl ClaimSource for &Claim {
    fn claim(&self) -> &Claim {
        self
    }

    fn keep(self, frontends: &mut Vec<Frontend>) {
        frontends.extend(self.entries().cloned());
    }
}

impl Merge {
    /// Adds the next parts. Owned parts are moved in; borrowed ones (a cache's) are copied.
    pub(crate) fn add(&mut self, parts: Cow<'_, Parts>) {
        self.stats.add(&parts.stats);
        self.frontends.reserve(parts.claims.len());
        match parts {
            Cow::Owned(parts) => {
                self.errors.extend(parts.errors);
                let mut claims = parts.claims.into_iter();
                for service in &parts.services {
                    let its_claims = claims.by_ref().take(service.claims.len());
                    self.add_service(service, its_claims);
                }
            }
            Cow::Borrowed(parts) => {
                self.errors.extend(parts.errors.iter().cloned());
                for service in &parts.services {
                    self.add_service(service, &parts.claims[service.claims.clone()]);
                }
            }
        }
    }

    /// Keeps the claims of a Service that no earlier Service holds, then its health check if it got any.
    pub(super) fn add_service<C: ClaimSource>(
        &mut self,
        service: &ServiceParts,
        claims: impl IntoIterator<Item = C>,
    ) {
        let error =
            |field: String, message: String| service_error(&service.origin, &service.name, field, message);
        let mut programmed = false;
        for source in claims {
            let claim = source.claim();
            let Frontend { vip, port, proto, .. } = claim.internal;
            if let Some(&holder) = self.taken.get(&(vip, port, proto)) {
                let message = format!(
                    "{vip}:{port}/{proto} is already used by Service {}; {} is skipped",
                    self.frontends[holder].service,
                    claim.field.skipped()
                );
                self.conflicts.push(error(claim.field.path(), message));
                continue;
            }
            self.taken.insert((vip, port, proto), self.frontends.len());
            for entry in claim.entries() {
                self.stats.add(&entry_stats(entry));
            }
            programmed = true;
            source.keep(&mut self.frontends);
        }
        self.stats.services_programmed += usize::from(programmed);
        // A load balancer probing a Service that has no frontend here would only be misled.
        if let Some(check) = service.health_check.as_ref().filter(|_| programmed) {
            match self.health_ports.get(&check.port) {
                Some(&holder) => {
                    let message = format!(
                        "healthCheckNodePort {} is already used by Service {}; no health check is served",
                        check.port, self.health_checks[holder].service
                    );
                    self.conflicts.push(error("spec.healthCheckNodePort".to_string(), message));
                }
                None => {
                    self.health_ports.insert(check.port, self.health_checks.len());
                    self.health_checks.push(check.clone());
                }
            }
        }
        if let Some(time) = &service.trigger_time {
            self.trigger_times.push((service.name.clone(), time.clone()));
        }
    }

    pub(crate) fn finish(mut self) -> (Desired, Vec<ManifestError>) {
        self.frontends.sort_by_key(|f| (f.vip, f.port, f.proto, f.scope));
        self.trigger_times.sort();
        self.health_checks.sort_by_key(|check| check.port);
        self.errors.append(&mut self.conflicts);
        let desired = Desired {
            frontends: self.frontends,
            stats: self.stats,
            trigger_times: self.trigger_times,
            health_checks: self.health_checks,
        };
        (desired, self.errors)
    }
}

/// What one kept frontend entry adds to the counters (the frontend ones).
pub(super) fn entry_stats(entry: &Frontend) -> ModelStats {
    ModelStats {
        frontends: 1,
        frontends_without_backends: usize::from(entry.backends.is_empty()),
        frontends_terminating_fallback: usize::from(entry.terminating_fallback),
        frontends_topology_same_zone: usize::from(entry.topology == Topology::SameZone),
        frontends_topology_same_node: usize::from(entry.topology == Topology::SameNode),
        frontends_no_local_endpoints: usize::from(entry.no_local_endpoints),
        ..Default::default()
    }
}

/// Validates the Services and EndpointSlices and builds each Service's candidate frontends.
pub(crate) fn build_parts<S: Borrow<Sourced<Service>>, E: Borrow<Sourced<EndpointSlice>>>(
    services: &[S],
    slices: &[E],
    options: &ModelOptions,
) -> Parts {
    let mut errors = Vec::new();
    let mut stats = ModelStats { services_seen: services.len(), ..Default::default() };
    let filter = filter_of(options);
    // A repeated address would only make a Service collide with itself.
    let mut node_addresses = options.node_addresses.clone();
    node_addresses.sort();
    node_addresses.dedup();

    let mut not_ours = HashSet::new();
    let mut seen_services = HashMap::new();
    let plans: Vec<ServicePlan> = services
        .iter()
        .filter_map(|svc| {
            plan_service(svc.borrow(), &filter, &mut errors, &mut stats, &mut not_ours, &mut seen_services)
        })
        .collect();

    let mut by_service: HashMap<ServiceName, Vec<SliceUse>> = HashMap::new();
    let mut seen_slices = HashMap::new();
    for slice in slices {
        let slice = slice.borrow();
        if let Some((service, used)) = use_slice(slice, &filter, &not_ours, &mut errors, &mut seen_slices) {
            by_service.entry(service).or_default().push(used);
        }
    }

    let mut parts = Vec::with_capacity(plans.len());
    let mut claims = Vec::with_capacity(plans.len());
    for plan in plans {
        let slices = by_service.get(&plan.name).map(Vec::as_slice).unwrap_or_default();
        count_endpoints(slices, &mut stats);
        let trigger_time = slices
            .iter()
            .filter_map(|s| s.trigger_time.as_ref())
            .max_by(|a, b| a.cmp(b))
            .map(|(_, text)| text);
        let health_check = plan.health_check_port.map(|port| {
            // A dual-stack pod is one endpoint: its IPv4 address counts, unless the Service is
            // IPv6 only.
            let ipv4 = plan.vips.iter().any(IpAddr::is_ipv4);
            let (local_ready, local_terminating) = local_endpoint_counts(slices, ipv4);
            HealthCheck { service: plan.name.clone(), port, local_ready, local_terminating }
        });
        let first = claims.len();
        add_claims(&plan, slices, &node_addresses, &mut claims);
        parts.push(ServiceParts {
            origin: plan.origin.to_string(),
            name: plan.name,
            claims: first..claims.len(),
            health_check,
            trigger_time: trigger_time.cloned(),
        });
    }
    Parts { services: parts, claims, stats, errors }
}

/// Adds a Service's frontend entries, port by port: its cluster IPs, then the node ports, external IPs
/// and load-balancer IPs. North–south addresses of a family the Service has no cluster IP of are left
/// out, as kube-proxy's proxier of that family never sees the Service.
pub(super) fn add_claims(
    plan: &ServicePlan,
    slices: &[SliceUse],
    node_addresses: &[IpAddr],
    claims: &mut Vec<Claim>,
) {
    let source_ranges = load_balancer_sources(plan, node_addresses);
    for port in &plan.ports {
        // Each family is a proxy of its own, as kube-proxy's dual-stack proxiers are: a frontend's
        // backends, topology and fallbacks come from the endpoints of its family only.
        let (endpoints_v4, endpoints_v6): (Vec<_>, Vec<_>) =
            endpoints_for(plan, port, slices).into_iter().partition(|(backend, _)| backend.addr.is_ipv4());
        let entries = Entries { plan, port, source_ranges: &source_ranges };
        let entry = |vip, number, kind, scope, selected: &Selection| {
            entries.entry(vip, number, kind, scope, selected)
        };

        let internal_v4 = select(&endpoints_v4, plan.local_only);
        let internal_v6 =
            plan.vips.iter().any(IpAddr::is_ipv6).then(|| select(&endpoints_v6, plan.local_only));
        for &vip in &plan.vips {
            let internal = match &internal_v6 {
                Some(internal_v6) if vip.is_ipv6() => internal_v6,
                _ => &internal_v4,
            };
            claims.push(Claim {
                field: ClaimField::ClusterIp { port: port.index },
                internal: entry(vip, port.port, FrontendKind::ClusterIp, Scope::Internal, internal),
                external: None,
            });
        }

        let node_ports = port.node_port.map(|number| {
            node_addresses.iter().map(move |&vip| {
                (vip, number, FrontendKind::NodePort, ClaimField::NodePort { port: port.index })
            })
        });
        let load_balancer_ips = plan.load_balancer_ips.iter();
        let external_ips = plan
            .external_ips
            .iter()
            .map(|&(vip, ip)| (vip, port.port, FrontendKind::ExternalIp, ClaimField::ExternalIp { ip }));
        let load_balancer_ips = load_balancer_ips.map(|&(vip, ingress)| {
            (vip, port.port, FrontendKind::LoadBalancer, ClaimField::LoadBalancerIp { ingress })
        });
        let has_family = |vip: &IpAddr| plan.vips.iter().any(|v| v.is_ipv4() == vip.is_ipv4());
        let mut north_south = node_ports
            .into_iter()
            .flatten()
            .chain(external_ips)
            .chain(load_balancer_ips)
            .filter(|(vip, ..)| has_family(vip))
            .peekable();
        if north_south.peek().is_none() {
            continue;
        }
        // Each family's entries from its own endpoints, as for the cluster IPs.
        let (mut v4, mut v6) = (None, None);
        for (vip, number, kind, field) in north_south {
            let (selection, endpoints) =
                if vip.is_ipv4() { (&mut v4, &endpoints_v4) } else { (&mut v6, &endpoints_v6) };
            let (cluster_wide, node_local) = selection.get_or_insert_with(|| {
                (select(endpoints, false), plan.external_local.then(|| select(endpoints, true)))
            });
            claims.push(Claim {
                field,
                internal: entry(vip, number, kind, Scope::Internal, cluster_wide),
                external: node_local.as_ref().map(|local| entry(vip, number, kind, Scope::External, local)),
            });
        }
    }
}

/// Builds the frontend entries of one Service port.
struct Entries<'a> {
    plan: &'a ServicePlan<'a>,
    port: &'a super::service::PortPlan,
    /// The LoadBalancer IPs' admitted sources.
    source_ranges: &'a [Cidr],
}

impl Entries<'_> {
    fn entry(
        &self,
        vip: IpAddr,
        number: u16,
        kind: FrontendKind,
        scope: Scope,
        selected: &Selection,
    ) -> Frontend {
        let (plan, port) = (self.plan, self.port);
        Frontend {
            service: plan.name.clone(),
            port_name: port.name.clone(),
            vip,
            port: number,
            proto: port.proto,
            backends: selected.backends.clone(),
            session_affinity_timeout: plan.affinity_timeout,
            local_only: selected.local_only,
            terminating_fallback: selected.terminating_fallback,
            terminating_backends: selected.terminating_backends.clone(),
            kind,
            scope,
            external_local: kind != FrontendKind::ClusterIp && plan.external_local,
            // Each family's ranges filter its own clients only (kube-proxy's per-family proxiers): an
            // IPv6 LB IP of a Service with IPv4 ranges alone is open to every IPv6 client.
            source_ranges: if kind == FrontendKind::LoadBalancer {
                self.source_ranges.iter().filter(|range| range.is_ipv4() == vip.is_ipv4()).copied().collect()
            } else {
                Vec::new()
            },
            no_local_endpoints: selected.no_local_endpoints,
            topology: selected.topology,
        }
    }
}

/// The sources a LoadBalancer IP with `loadBalancerSourceRanges` admits. As kube-proxy's
/// `allowFromNode`: when a range holds one of this node's addresses, the load-balancer IPs themselves
/// are admitted too — a VIP-style load balancer whose IP is local to the node loops the node's own
/// requests back with that IP as their source.
pub(super) fn load_balancer_sources(plan: &ServicePlan, node_addresses: &[IpAddr]) -> Vec<Cidr> {
    let mut ranges = plan.source_ranges.clone();
    // Per family: a node address in an IPv4 range admits the IPv4 load-balancer IPs only.
    for ipv4 in [true, false] {
        let allow_from_node =
            plan.source_ranges.iter().filter(|range| range.is_ipv4() == ipv4).any(|range| {
                node_addresses.iter().any(|addr| addr.is_ipv4() == ipv4 && range.contains(*addr))
            });
        if !allow_from_node {
            continue;
        }
        for &(ip, _) in plan.load_balancer_ips.iter().filter(|(ip, _)| ip.is_ipv4() == ipv4) {
            if !ranges.iter().any(|range| range.contains(ip)) {
                ranges.push(Cidr::host(ip));
            }
        }
    }
    ranges.sort();
    ranges
}
