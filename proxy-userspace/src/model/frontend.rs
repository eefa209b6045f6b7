//! The model's output types: a Service's name, a backend address, and a [`Frontend`] (address × port ×
//! protocol × scope with the backends new connections may use).

use std::fmt;
use std::net::IpAddr;

use crate::net::{Cidr, Protocol};

/// A Service's namespace and name; displayed as `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One backend: an endpoint address and the target port on it. Displayed as `addr:port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    /// Of the frontend's address family (a frontend's backends come from slices of its family).
    pub addr: IpAddr,
    pub port: u16,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(addr) => write!(f, "{addr}:{}", self.port),
            IpAddr::V6(addr) => write!(f, "[{addr}]:{}", self.port),
        }
    }
}

/// What kind of address a frontend answers on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum FrontendKind {
    /// `spec.clusterIP(s)` and the Service port.
    #[default]
    ClusterIp,
    /// A node address selected by `--nodeport-addresses` and `spec.ports[].nodePort`.
    NodePort,
    /// `spec.externalIPs[]` and the Service port.
    ExternalIp,
    /// `status.loadBalancer.ingress[].ip` and the Service port.
    LoadBalancer,
}

impl fmt::Display for FrontendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::ExternalIp => "ExternalIP",
            FrontendKind::LoadBalancer => "LoadBalancer",
        })
    }
}

/// Which clients a frontend entry serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Scope {
    /// Clients inside the cluster (pods, this node); also clients arriving on the node's external
    /// interface when the frontend has no `External` entry.
    #[default]
    Internal,
    /// Clients arriving on the node's external interface, for `externalTrafficPolicy: Local`:
    /// only this node's endpoints, no source NAT.
    External,
}

/// A `healthCheckNodePort` the agent serves for an `externalTrafficPolicy: Local` Service: load
/// balancers probe it to learn whether this node has endpoints of the Service.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HealthCheck {
    pub service: ServiceName,
    pub port: u16,
    /// Ready endpoints on this node (each address counted once).
    pub local_ready: usize,
    /// Serving-and-terminating (not ready) endpoints on this node.
    pub local_terminating: usize,
}

/// One virtual address the datapath answers: a cluster IP, a Service port and its protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub service: ServiceName,
    /// The Service port's name; empty for an unnamed port.
    pub port_name: String,
    /// IPv4 or IPv6; every backend is of the same family.
    pub vip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    /// The endpoints new connections may use, sorted and deduplicated: the ready ones (on this node only,
    /// for `internalTrafficPolicy: Local`), or the serving-and-terminating ones when there is no ready one
    /// (then [`Frontend::terminating_fallback`] is set). Empty when there is neither: the datapath must
    /// still know the VIP, to reject instead of letting packets through.
    pub backends: Vec<BackendAddr>,
    /// `Some(seconds)` for `sessionAffinity: ClientIP` (from `sessionAffinityConfig.clientIP.timeoutSeconds`,
    /// 10800 when absent or invalid); `None` for no affinity.
    pub session_affinity_timeout: Option<u32>,
    /// Only endpoints on this node are used (none if the node is unknown): `internalTrafficPolicy: Local`
    /// on a ClusterIP frontend, `externalTrafficPolicy: Local` on a [`Scope::External`] entry. Always
    /// false on the [`Scope::Internal`] entry of a north–south frontend, which ignores both policies.
    pub local_only: bool,
    /// `backends` are terminating endpoints that still serve, used because no endpoint is ready.
    pub terminating_fallback: bool,
    /// Serving-and-terminating endpoints that are not in `backends` (sorted): they get no new connection
    /// but keep the ones they have, so the datapath must still know them (as terminating backends) and
    /// must not send their established flows elsewhere. Empty when the terminating fallback is used
    /// (then they are the `backends`).
    pub terminating_backends: Vec<BackendAddr>,
    pub kind: FrontendKind,
    pub scope: Scope,
    /// `externalTrafficPolicy: Local` (NodePort, ExternalIp and LoadBalancer kinds).
    pub external_local: bool,
    /// `spec.loadBalancerSourceRanges` (LoadBalancer kind only); empty means every source.
    pub source_ranges: Vec<Cidr>,
    /// A `local_only` entry without backends whose Service has usable endpoints on other nodes: new
    /// connections are dropped rather than refused (kube-proxy's "has no local endpoints" rule).
    pub no_local_endpoints: bool,
    /// Which topology rule narrowed `backends` (step 4 of the module doc).
    pub topology: Topology,
}

/// Which endpoints topology left to a cluster-wide selection, after kube-proxy's `topologyModeFromHints`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Topology {
    /// Every endpoint (no hints, or hints that do not all agree, or none for this node or zone).
    #[default]
    All,
    /// Those hinted (`hints.forZones`) for this node's zone.
    SameZone,
    /// Those hinted (`hints.forNodes`) for this node.
    SameNode,
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Topology::All => "all",
            Topology::SameZone => "PreferSameZone",
            Topology::SameNode => "PreferSameNode",
        })
    }
}

impl Frontend {
    /// A frontend without session affinity, with `internalTrafficPolicy: Cluster`, whose backends are ready.
    pub fn new(
        service: ServiceName,
        port_name: impl Into<String>,
        vip: impl Into<IpAddr>,
        port: u16,
        proto: Protocol,
        backends: Vec<BackendAddr>,
    ) -> Self {
        Frontend {
            service,
            port_name: port_name.into(),
            vip: vip.into(),
            port,
            proto,
            backends,
            session_affinity_timeout: None,
            local_only: false,
            terminating_fallback: false,
            terminating_backends: Vec::new(),
            kind: FrontendKind::ClusterIp,
            scope: Scope::Internal,
            external_local: false,
            source_ranges: Vec::new(),
            no_local_endpoints: false,
            topology: Topology::All,
        }
    }
}
