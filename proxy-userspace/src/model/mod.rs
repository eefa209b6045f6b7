//! The desired datapath state, computed from Services and EndpointSlices with kube-proxy's semantics.
//!
//! Pure: no BPF, no I/O. [`build`] (or [`build_with`], for a node name, a service proxy name and node
//! addresses) turns the objects read by [`crate::k8s::manifest`] into a sorted list of [`Frontend`]s (address ×
//! port × protocol × scope, each with the backends new connections may use), the health checks to serve,
//! plus the problems it found.
//!
//! Endpoint selection follows kube-proxy (`pkg/proxy/endpointslicecache.go`, `pkg/proxy/topology.go`
//! `CategorizeEndpoints`, KEP-1669, KEP-2086, KEP-2433 and KEP-4444):
//! 1. the endpoints of a Service port are those of all its EndpointSlices, merged by address and target port
//!    (when one appears more than once, the "best" copy wins: ready, then serving and terminating, then
//!    serving, then on this node); an endpoint is its `addresses[0]` (the API gives the others no
//!    meaning, and kube-proxy ignores them);
//! 2. `ready` is `conditions.ready != false`, `serving` is `conditions.serving != false`, `terminating`
//!    is `conditions.terminating == true` — nil means true for the first two, as kube-proxy reads them;
//!    `publishNotReadyAddresses` is not read here: the EndpointSlice controller already writes such
//!    endpoints as ready, and kube-proxy trusts the slice;
//! 3. `internalTrafficPolicy: Local` keeps only endpoints whose `nodeName` is this node's;
//! 4. topology (cluster-wide selections only, never Local ones): when every ready endpoint carries a
//!    `hints.forNodes` and one is hinted for this node, only the endpoints hinted for this node are used
//!    ("PreferSameNode"); otherwise when every ready endpoint carries `hints.forZones` and one is hinted
//!    for this node's zone ([`ModelOptions::zone`]), only those ("PreferSameZone"); otherwise all;
//! 5. the ready ones are used; when there are none, the serving-and-terminating ones are
//!    (the "terminating fallback", which ignores topology);
//! 6. a Local selection left empty while the Service has usable endpoints elsewhere drops new connections
//!    ([`Frontend::no_local_endpoints`]) instead of refusing them: the client times out, as with
//!    kube-proxy's "has no local endpoints" DROP rule; with no usable endpoint anywhere, they are refused.
//!
//! North–south frontends (node ports on [`ModelOptions::node_addresses`], `spec.externalIPs`, and the
//! `status.loadBalancer.ingress` IPs of LoadBalancer Services) follow kube-proxy too:
//! - their [`Scope::Internal`] entry uses every endpoint of the cluster, whatever the traffic policies:
//!   kube-proxy sends traffic from inside the cluster to an external address as if it had gone out to a
//!   load balancer and come back ("short-circuiting"), and with `externalTrafficPolicy: Cluster` external
//!   clients use it as well;
//! - with `externalTrafficPolicy: Local` a [`Scope::External`] entry is added for clients from outside,
//!   using only this node's endpoints (the terminating fallback applies among them);
//! - `ipMode: Proxy` ingress entries are left to the load balancer, and only the LoadBalancer IPs are
//!   subject to `spec.loadBalancerSourceRanges`.
//! - each family is a proxy of its own, as kube-proxy's dual-stack proxiers are: a Service gets
//!   north–south entries only on the addresses of a family it has a cluster IP of, each taking its
//!   backends from the EndpointSlices of that family; the health check counts the Service's IPv4
//!   endpoints (its IPv6 ones when it is IPv6-only), so a dual-stack pod counts once. Each family's
//!   source ranges filter its own clients only (an IPv6 LB IP of a Service with IPv4 ranges alone
//!   admits every IPv6 client, as kube-proxy's IPv6 proxier does).

use std::borrow::{Borrow, Cow};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::k8s::manifest::{ManifestError, Sourced};

use claims::{Merge, build_parts};
use endpoints::use_slice;
use service::{Filter, plan_service};

pub mod cache;
mod claims;
mod endpoints;
mod frontend;
pub mod last_good;
mod service;
pub mod service_cidrs;
#[cfg(test)]
mod tests;

pub use cache::ModelCache;
pub use frontend::*;

/// `sessionAffinityConfig.clientIP.timeoutSeconds` when absent (3 hours), as the API server defaults it.
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10800;
/// The largest `timeoutSeconds` the API server accepts (one day).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86400;

/// What the model is built for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// This node's name (--hostname-override / NODE_NAME); endpoints with this nodeName are local.
    /// `None` (or empty) means no endpoint is local.
    pub node_name: Option<String>,
    /// --service-proxy-name: with None, Services labelled service.kubernetes.io/service-proxy-name are skipped;
    /// with Some(n), ONLY Services whose label equals n are programmed (kube-proxy's semantics).
    /// An empty name is the same as `None`.
    pub service_proxy_name: Option<String>,
    /// This node's addresses that answer NodePorts (`--nodeport-addresses` applied), of both
    /// families; none: no NodePort frontends. A Service gets NodePorts on the addresses of the
    /// families it has a cluster IP of.
    pub node_addresses: Vec<IpAddr>,
    /// This node's zone (its `topology.kubernetes.io/zone` label, or `--node-zone`), for zone hints.
    /// `None` (or empty): zone hints are never followed.
    pub zone: Option<String>,
    /// `--service-cidr` (both families): service ranges besides the ServiceCIDR objects'.
    pub service_cidrs: Vec<crate::net::Cidr>,
}

/// Counts about one build, for logs and metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelStats {
    /// Service objects given to the model, including skipped and invalid ones.
    pub services_seen: usize,
    /// Services with at least one frontend entry.
    pub services_programmed: usize,
    /// Services labelled `service.kubernetes.io/headless` or with `clusterIP: None`.
    pub services_skipped_headless: usize,
    pub services_skipped_external_name: usize,
    /// Services left to another proxy by the `service.kubernetes.io/service-proxy-name` label.
    pub services_skipped_other_proxy: usize,
    /// Frontend entries built, each scope counted (same as `Desired::frontends.len()`).
    pub frontends: usize,
    /// Frontends with no backend (connections to them are rejected).
    pub frontends_without_backends: usize,
    /// Frontends whose backends come from the terminating fallback.
    pub frontends_terminating_fallback: usize,
    /// Frontends whose backends topology hints narrowed to this node's zone...
    pub frontends_topology_same_zone: usize,
    /// ...or to this node.
    pub frontends_topology_same_node: usize,
    /// Local frontends that drop new connections: no endpoint here, some elsewhere.
    pub frontends_no_local_endpoints: usize,
    /// Distinct endpoint addresses of the Services kproxy programs, by state (each counted once per
    /// Service, in its best state across slices): ready...
    pub endpoints_ready: usize,
    /// ...not ready and terminating...
    pub endpoints_terminating: usize,
    /// ...and neither.
    pub endpoints_not_ready: usize,
}

/// Everything the datapath should hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// Sorted by (vip, port, proto, scope); no two frontends share that key, and the entries of one
    /// (vip, port, proto) belong to one Service.
    pub frontends: Vec<Frontend>,
    pub stats: ModelStats,
    /// For each programmed Service whose EndpointSlices carry it, the newest
    /// `endpoints.kubernetes.io/last-change-trigger-time` annotation (the string as in the object);
    /// sorted by Service. For the network-programming latency metric.
    pub trigger_times: Vec<(ServiceName, String)>,
    /// The `healthCheckNodePort`s to serve, sorted by port.
    pub health_checks: Vec<HealthCheck>,
}

impl Desired {
    /// A desired state holding just these frontends (no stats, no trigger times), e.g. for tests.
    pub fn new(mut frontends: Vec<Frontend>) -> Self {
        frontends.sort_by_key(|f| (f.vip, f.port, f.proto, f.scope));
        Desired { frontends, ..Default::default() }
    }
}

/// Computes the desired state with the default options (no node name, the default service proxy).
/// Same as [`build_with`] with [`ModelOptions::default()`].
pub fn build<S: Borrow<Sourced<Service>>, E: Borrow<Sourced<EndpointSlice>>>(
    services: &[S],
    slices: &[E],
) -> (Desired, Vec<ManifestError>) {
    build_with(services, slices, &ModelOptions::default())
}

/// Computes the desired state. Problems are returned (named by object and field) and the offending part
/// is left out; everything else is still built. Output is deterministic and this never panics.
/// The objects may be owned or shared (`Arc<Sourced<..>>`), so a caller that
/// keeps them need not copy them for every sync.
pub fn build_with<S: Borrow<Sourced<Service>>, E: Borrow<Sourced<EndpointSlice>>>(
    services: &[S],
    slices: &[E],
    options: &ModelOptions,
) -> (Desired, Vec<ManifestError>) {
    let mut merge = Merge::default();
    merge.add(Cow::Owned(build_parts(services, slices, options)));
    merge.finish()
}

impl ModelStats {
    pub(super) fn add(&mut self, other: &ModelStats) {
        self.services_seen += other.services_seen;
        self.services_programmed += other.services_programmed;
        self.services_skipped_headless += other.services_skipped_headless;
        self.services_skipped_external_name += other.services_skipped_external_name;
        self.services_skipped_other_proxy += other.services_skipped_other_proxy;
        self.frontends += other.frontends;
        self.frontends_without_backends += other.frontends_without_backends;
        self.frontends_terminating_fallback += other.frontends_terminating_fallback;
        self.frontends_topology_same_zone += other.frontends_topology_same_zone;
        self.frontends_topology_same_node += other.frontends_topology_same_node;
        self.frontends_no_local_endpoints += other.frontends_no_local_endpoints;
        self.endpoints_ready += other.endpoints_ready;
        self.endpoints_terminating += other.endpoints_terminating;
        self.endpoints_not_ready += other.endpoints_not_ready;
    }

    /// Takes back what [`ModelStats::add`] added (the incremental model replaces a Service's part).
    pub(super) fn sub(&mut self, other: &ModelStats) {
        let ModelStats {
            services_seen,
            services_programmed,
            services_skipped_headless,
            services_skipped_external_name,
            services_skipped_other_proxy,
            frontends,
            frontends_without_backends,
            frontends_terminating_fallback,
            frontends_topology_same_zone,
            frontends_topology_same_node,
            frontends_no_local_endpoints,
            endpoints_ready,
            endpoints_terminating,
            endpoints_not_ready,
        } = *other;
        self.services_seen -= services_seen;
        self.services_programmed -= services_programmed;
        self.services_skipped_headless -= services_skipped_headless;
        self.services_skipped_external_name -= services_skipped_external_name;
        self.services_skipped_other_proxy -= services_skipped_other_proxy;
        self.frontends -= frontends;
        self.frontends_without_backends -= frontends_without_backends;
        self.frontends_terminating_fallback -= frontends_terminating_fallback;
        self.frontends_topology_same_zone -= frontends_topology_same_zone;
        self.frontends_topology_same_node -= frontends_topology_same_node;
        self.frontends_no_local_endpoints -= frontends_no_local_endpoints;
        self.endpoints_ready -= endpoints_ready;
        self.endpoints_terminating -= endpoints_terminating;
        self.endpoints_not_ready -= endpoints_not_ready;
    }
}

/// What is wrong with one Service on its own (its fields, not its conflicts with other Services):
/// the errors [`build_with`] would report for it. Empty for a valid Service, and for one kproxy skips
/// without an error (headless, ExternalName, another proxy's).
pub fn service_problems(svc: &Sourced<Service>, options: &ModelOptions) -> Vec<ManifestError> {
    let mut errors = Vec::new();
    let filter = filter_of(options);
    plan_service(
        svc,
        &filter,
        &mut errors,
        &mut ModelStats::default(),
        &mut HashSet::new(),
        &mut HashMap::new(),
    );
    errors
}

/// What is wrong with one EndpointSlice on its own; see [`service_problems`].
pub fn slice_problems(slice: &Sourced<EndpointSlice>, options: &ModelOptions) -> Vec<ManifestError> {
    let mut errors = Vec::new();
    use_slice(slice, &filter_of(options), &HashSet::new(), &mut errors, &mut HashMap::new());
    errors
}

fn filter_of(options: &ModelOptions) -> Filter<'_> {
    Filter {
        node_name: options.node_name.as_deref().filter(|n| !n.is_empty()),
        proxy_name: options.service_proxy_name.as_deref().filter(|n| !n.is_empty()),
        zone: options.zone.as_deref().filter(|z| !z.is_empty()),
    }
}
