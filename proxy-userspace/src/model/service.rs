//! One Service's frontends: its identity and the proxy filters, then its cluster IPs, ports, policies and
//! north–south addresses ([`plan_service`]).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tracing::debug;

use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};
use crate::net::{Cidr, Protocol};

use super::frontend::ServiceName;
use super::{DEFAULT_AFFINITY_TIMEOUT_SECONDS, MAX_AFFINITY_TIMEOUT_SECONDS, ModelStats};

/// The options, as the selection of objects and endpoints needs them.
pub(super) struct Filter<'a> {
    pub(super) node_name: Option<&'a str>,
    pub(super) proxy_name: Option<&'a str>,
    pub(super) zone: Option<&'a str>,
}

impl Filter<'_> {
    /// Whether a Service with these labels is kproxy's: without a proxy name, those without the label;
    /// with one, those whose label has that value.
    pub(super) fn service_is_ours(&self, meta: &ObjectMeta) -> bool {
        label(meta, LABEL_SERVICE_PROXY_NAME) == self.proxy_name
    }

    /// Whether an EndpointSlice with these labels may be used. The EndpointSlice controller copies the
    /// Service's labels to its slices; a slice without the label (e.g. written by hand) is decided by its
    /// Service alone.
    pub(super) fn slice_is_ours(&self, meta: &ObjectMeta) -> bool {
        match label(meta, LABEL_SERVICE_PROXY_NAME) {
            None => true,
            Some(value) => Some(value) == self.proxy_name,
        }
    }
}

/// A Service that will be programmed, after validation.
pub(super) struct ServicePlan<'a> {
    pub(super) origin: &'a str,
    pub(super) name: ServiceName,
    /// Its cluster IPs, of either family (`spec.clusterIPs` in order).
    pub(super) vips: Vec<IpAddr>,
    pub(super) ports: Vec<PortPlan>,
    /// Usable `spec.externalIPs` of either family, each with its index there.
    pub(super) external_ips: Vec<(IpAddr, usize)>,
    /// Usable `status.loadBalancer.ingress[].ip` of a LoadBalancer Service, of either family, each
    /// with its index.
    pub(super) load_balancer_ips: Vec<(IpAddr, usize)>,
    /// The valid `spec.loadBalancerSourceRanges` of a LoadBalancer Service, of both families.
    pub(super) source_ranges: Vec<Cidr>,
    pub(super) affinity_timeout: Option<u32>,
    /// `internalTrafficPolicy: Local`.
    pub(super) local_only: bool,
    /// `externalTrafficPolicy: Local`.
    pub(super) external_local: bool,
    /// A valid `healthCheckNodePort`, kept only with `externalTrafficPolicy: Local`.
    pub(super) health_check_port: Option<u16>,
}

pub(super) struct PortPlan {
    /// Position in `spec.ports`, for messages.
    pub(super) index: usize,
    pub(super) name: String,
    pub(super) port: u16,
    pub(super) proto: Protocol,
    /// For NodePort and LoadBalancer Services; absent is legal (`allocateLoadBalancerNodePorts: false`).
    pub(super) node_port: Option<u16>,
}

pub(super) fn namespace_of(meta: &ObjectMeta) -> String {
    match meta.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => ns.to_string(),
        _ => "default".to_string(),
    }
}

pub(super) fn has_label(meta: &ObjectMeta, key: &str) -> bool {
    meta.labels.as_ref().is_some_and(|labels| labels.contains_key(key))
}

pub(super) fn label<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.labels.as_ref().and_then(|labels| labels.get(key)).map(String::as_str)
}

pub(super) fn service_error(
    origin: &str,
    name: &ServiceName,
    field: String,
    message: String,
) -> ManifestError {
    ManifestError::new(origin, message).with_object(format!("Service {name}")).with_field(field)
}

/// `TCP` when absent (the API server's default); SCTP and anything else are not supported: the reason, for
/// the error that names the port.
pub(super) fn parse_protocol(protocol: Option<&str>) -> Result<Protocol, String> {
    match protocol {
        None | Some("") | Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        // kube-proxy serves SCTP ClusterIPs and NodePorts through netfilter. kproxy would need SCTP's own
        // conntrack states and, for a port rewrite, a CRC32c recomputed over the whole packet (its checksum
        // has no pseudo-header, so an address rewrite alone leaves it valid) — and the kernels it is tested
        // on have no SCTP module to show it with real packets.
        Some("SCTP") => Err("SCTP is not supported by kproxy: its datapath translates TCP and UDP only \
                             (SCTP needs its own conntrack states and a CRC32c recomputed after a port rewrite, \
                             not implemented)"
            .to_string()),
        Some(other) => Err(format!("protocol {other:?} is not supported by kproxy (TCP or UDP)")),
    }
}

/// A port number from the API (an i32), if it is in 1..=65535.
pub(super) fn port_number(port: i32) -> Option<u16> {
    u16::try_from(port).ok().filter(|&p| p != 0)
}

/// Addresses the API server itself refuses for cluster IPs and endpoints, and that the datapath cannot use.
pub(super) fn unusable(addr: IpAddr) -> Option<&'static str> {
    match addr {
        IpAddr::V4(addr) => unusable_v4(addr),
        IpAddr::V6(addr) => unusable_v6(addr),
    }
}

fn unusable_v6(addr: Ipv6Addr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("the unspecified address")
    } else if addr.is_loopback() {
        Some("a loopback address")
    } else if addr.is_unicast_link_local() {
        Some("a link-local address")
    } else if addr.is_multicast() {
        Some("a multicast address")
    } else if addr.to_ipv4_mapped().is_some() {
        Some("an IPv4-mapped address")
    } else {
        None
    }
}

fn unusable_v4(addr: Ipv4Addr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("the unspecified address")
    } else if addr.is_loopback() {
        Some("a loopback address")
    } else if addr.is_link_local() {
        Some("a link-local address")
    } else if addr.is_multicast() {
        Some("a multicast address")
    } else if addr.is_broadcast() {
        Some("the broadcast address")
    } else {
        None
    }
}

pub(super) fn plan_service<'a>(
    svc: &'a Sourced<Service>,
    filter: &Filter,
    errors: &mut Vec<ManifestError>,
    stats: &mut ModelStats,
    not_ours: &mut HashSet<ServiceName>,
    seen: &mut HashMap<ServiceName, &'a str>,
) -> Option<ServicePlan<'a>> {
    let origin = svc.origin.as_str();
    let (name, spec) = identify(svc, filter, errors, stats, not_ours, seen)?;
    let vips = cluster_ips(spec, origin, name.clone(), errors, stats, not_ours)?;
    let ports = ports(spec, origin, &name, errors);
    let affinity_timeout = affinity_timeout(spec, &mut |field, message| {
        errors.push(service_error(origin, &name, field.to_string(), message))
    });
    let local_only = traffic_policy(
        spec.internal_traffic_policy.as_deref(),
        "internalTrafficPolicy",
        origin,
        &name,
        errors,
    );
    let external_local = traffic_policy(
        spec.external_traffic_policy.as_deref(),
        "externalTrafficPolicy",
        origin,
        &name,
        errors,
    );
    let external_ips = external_ips(spec, origin, &name, errors);
    let (load_balancer_ips, source_ranges) = if spec.type_.as_deref() == Some("LoadBalancer") {
        (
            load_balancer_ips(svc, origin, &name, errors),
            load_balancer_source_ranges(spec, origin, &name, errors),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let health_check_port = health_check_port(spec, external_local, origin, &name, errors);
    Some(ServicePlan {
        origin,
        name,
        vips,
        ports,
        external_ips,
        load_balancer_ips,
        source_ranges,
        affinity_timeout,
        local_only,
        external_local,
        health_check_port,
    })
}

/// The Service's name, unless it is unnamed, a repeat, or one kproxy leaves alone (headless by label,
/// another proxy's, without spec, ExternalName).
fn identify<'a>(
    svc: &'a Sourced<Service>,
    filter: &Filter,
    errors: &mut Vec<ManifestError>,
    stats: &mut ModelStats,
    not_ours: &mut HashSet<ServiceName>,
    seen: &mut HashMap<ServiceName, &'a str>,
) -> Option<(ServiceName, &'a ServiceSpec)> {
    let origin = svc.origin.as_str();
    let meta = &svc.object.metadata;
    let namespace = namespace_of(meta);
    let Some(name) = meta.name.as_deref().filter(|name| !name.is_empty()) else {
        let message = "the Service has no name; it is skipped";
        errors.push(ManifestError::new(origin, message).with_object("Service").with_field("metadata.name"));
        return None;
    };
    let name = ServiceName { namespace, name: name.to_string() };
    if let Some(first) = seen.get(&name) {
        let message = format!("the Service is defined again (first in {first}); this copy is skipped");
        errors.push(ManifestError::new(origin, message).with_object(format!("Service {name}")));
        return None;
    }
    seen.insert(name.clone(), origin);

    if has_label(meta, LABEL_HEADLESS) {
        debug!(service = %name, "skipping a Service labelled {LABEL_HEADLESS}");
        stats.services_skipped_headless += 1;
        not_ours.insert(name);
        return None;
    }
    if !filter.service_is_ours(meta) {
        debug!(
            service = %name,
            label = label(meta, LABEL_SERVICE_PROXY_NAME),
            ours = filter.proxy_name,
            "skipping a Service of another service proxy ({LABEL_SERVICE_PROXY_NAME})"
        );
        stats.services_skipped_other_proxy += 1;
        not_ours.insert(name);
        return None;
    }
    let Some(spec) = svc.object.spec.as_ref() else {
        debug!(service = %name, "skipping a Service without spec");
        return None;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        debug!(service = %name, "skipping an ExternalName Service");
        stats.services_skipped_external_name += 1;
        not_ours.insert(name);
        return None;
    }
    Some((name, spec))
}

/// The cluster IPs of both families (`spec.clusterIP` and `spec.clusterIPs`, each once); `None` skips the
/// Service (headless, an unusable or unparsable address, or none at all).
fn cluster_ips(
    spec: &ServiceSpec,
    origin: &str,
    name: ServiceName,
    errors: &mut Vec<ManifestError>,
    stats: &mut ModelStats,
    not_ours: &mut HashSet<ServiceName>,
) -> Option<Vec<IpAddr>> {
    let mut candidates: Vec<(String, &str)> = Vec::new();
    if let Some(ip) = spec.cluster_ip.as_deref().filter(|ip| !ip.is_empty()) {
        candidates.push(("spec.clusterIP".to_string(), ip));
    }
    for (i, ip) in spec.cluster_ips.iter().flatten().enumerate() {
        if !ip.is_empty() {
            candidates.push((format!("spec.clusterIPs[{i}]"), ip.as_str()));
        }
    }
    if candidates.iter().any(|(_, ip)| *ip == "None") {
        debug!(service = %name, "skipping a headless Service");
        stats.services_skipped_headless += 1;
        not_ours.insert(name);
        return None;
    }
    let mut vips = Vec::new();
    for (field, text) in candidates {
        match text.parse::<IpAddr>() {
            Ok(vip) => {
                if let Some(what) = unusable(vip) {
                    let message = format!("{vip} is {what}, not a usable cluster IP; the Service is skipped");
                    errors.push(service_error(origin, &name, field, message));
                    return None;
                }
                if !vips.contains(&vip) {
                    vips.push(vip);
                }
            }
            Err(_) => {
                let message = format!("{text:?} is not an IP address; the Service is skipped");
                errors.push(service_error(origin, &name, field, message));
                return None;
            }
        }
    }
    if vips.is_empty() {
        debug!(service = %name, "skipping a Service without a cluster IP");
        return None;
    }
    Some(vips)
}

/// The valid ports, each once by number/protocol and by name, with their node port.
fn ports(
    spec: &ServiceSpec,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> Vec<PortPlan> {
    let has_node_ports = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let mut ports: Vec<PortPlan> = Vec::new();
    for (index, sp) in spec.ports.iter().flatten().enumerate() {
        let proto = match parse_protocol(sp.protocol.as_deref()) {
            Ok(proto) => proto,
            Err(reason) => {
                let port_name = sp.name.as_deref().map(|n| format!("{n:?} ")).unwrap_or_default();
                let protocol = sp.protocol.as_deref().unwrap_or_default();
                let message = format!(
                    "{reason}; port {port_name}{}/{protocol} is skipped: its packets are not translated",
                    sp.port
                );
                errors.push(service_error(origin, name, format!("spec.ports[{index}].protocol"), message));
                continue;
            }
        };
        let Some(port) = port_number(sp.port) else {
            let message = format!("port {} is not in 1-65535; the port is skipped", sp.port);
            errors.push(service_error(origin, name, format!("spec.ports[{index}].port"), message));
            continue;
        };
        let port_name = sp.name.clone().unwrap_or_default();
        if let Some(first) = ports.iter().find(|p| p.port == port && p.proto == proto) {
            let message = format!(
                "duplicate port {port}/{proto} (also spec.ports[{}]); the port is skipped",
                first.index
            );
            errors.push(service_error(origin, name, format!("spec.ports[{index}]"), message));
            continue;
        }
        if let Some(first) = ports.iter().find(|p| p.name == port_name) {
            let message = format!(
                "duplicate port name {port_name:?} (also spec.ports[{}]); the port is skipped",
                first.index
            );
            errors.push(service_error(origin, name, format!("spec.ports[{index}].name"), message));
            continue;
        }
        let node_port = match sp.node_port {
            None | Some(0) => None,
            Some(number) if !has_node_ports => {
                debug!(service = %name, index, number, "ignoring the nodePort of a Service without node ports");
                None
            }
            Some(number) => port_number(number).or_else(|| {
                let message =
                    format!("nodePort {number} is not in 1-65535; no NodePort is programmed for the port");
                errors.push(service_error(origin, name, format!("spec.ports[{index}].nodePort"), message));
                None
            }),
        };
        ports.push(PortPlan { index, name: port_name, port, proto, node_port });
    }
    ports
}

/// `internalTrafficPolicy` or `externalTrafficPolicy` (`policy`): true for Local; anything but Cluster or
/// Local is reported and read as Cluster.
fn traffic_policy(
    value: Option<&str>,
    policy: &str,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> bool {
    match value {
        None | Some("") | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            let message = format!("{policy} {other:?} is not Cluster or Local; Cluster is used");
            errors.push(service_error(origin, name, format!("spec.{policy}"), message));
            false
        }
    }
}

/// `spec.externalIPs` (either family, each once) with their index.
fn external_ips(
    spec: &ServiceSpec,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> Vec<(IpAddr, usize)> {
    let mut external_ips: Vec<(IpAddr, usize)> = Vec::new();
    for (index, text) in spec.external_ips.iter().flatten().enumerate() {
        match north_south_address(text, "external IP") {
            Ok(ip) if !external_ips.iter().any(|&(seen, _)| seen == ip) => external_ips.push((ip, index)),
            Ok(_) => {}
            Err(message) => {
                errors.push(service_error(origin, name, format!("spec.externalIPs[{index}]"), message));
            }
        }
    }
    external_ips
}

/// The `status.loadBalancer.ingress` IPs to answer on (either family, each once, not `ipMode:
/// Proxy`) with their index.
fn load_balancer_ips(
    svc: &Sourced<Service>,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> Vec<(IpAddr, usize)> {
    let mut load_balancer_ips: Vec<(IpAddr, usize)> = Vec::new();
    let ingress = svc.object.status.as_ref().and_then(|status| status.load_balancer.as_ref());
    for (index, entry) in ingress.and_then(|lb| lb.ingress.as_ref()).into_iter().flatten().enumerate() {
        // Hostname-only entries (e.g. AWS ELB) have no address to answer on.
        let Some(text) = entry.ip.as_deref().filter(|ip| !ip.is_empty()) else { continue };
        if entry.ip_mode.as_deref() == Some("Proxy") {
            // The load balancer proxies to the nodes itself; answering its IP on the node would let
            // in-cluster clients bypass it (and whatever it does, e.g. TLS or PROXY protocol).
            debug!(service = %name, ip = text, "not programming a load-balancer IP with ipMode Proxy");
            continue;
        }
        match north_south_address(text, "load-balancer IP") {
            Ok(ip) if !load_balancer_ips.iter().any(|&(seen, _)| seen == ip) => {
                load_balancer_ips.push((ip, index))
            }
            Ok(_) => {}
            Err(message) => {
                let field = format!("status.loadBalancer.ingress[{index}].ip");
                errors.push(service_error(origin, name, field, message));
            }
        }
    }
    load_balancer_ips
}

/// `spec.loadBalancerSourceRanges` of both families, each once, sorted.
fn load_balancer_source_ranges(
    spec: &ServiceSpec,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> Vec<Cidr> {
    let mut source_ranges = Vec::new();
    for (index, text) in spec.load_balancer_source_ranges.iter().flatten().enumerate() {
        match source_range(text) {
            Ok(range) => {
                if !source_ranges.contains(&range) {
                    source_ranges.push(range);
                }
            }
            Err(message) => {
                let field = format!("spec.loadBalancerSourceRanges[{index}]");
                errors.push(service_error(origin, name, field, message));
            }
        }
    }
    source_ranges.sort();
    source_ranges
}

/// `spec.healthCheckNodePort`, served only with `externalTrafficPolicy: Local`.
fn health_check_port(
    spec: &ServiceSpec,
    external_local: bool,
    origin: &str,
    name: &ServiceName,
    errors: &mut Vec<ManifestError>,
) -> Option<u16> {
    match spec.health_check_node_port {
        Some(number) if external_local && number != 0 => port_number(number).or_else(|| {
            let message =
                format!("healthCheckNodePort {number} is not in 1-65535; no health check is served");
            errors.push(service_error(origin, name, "spec.healthCheckNodePort".to_string(), message));
            None
        }),
        _ => None,
    }
}

/// An external or load-balancer address of either family; `Err` for text that is not an address or
/// an address the datapath cannot use.
pub(super) fn north_south_address(text: &str, what: &str) -> Result<IpAddr, String> {
    match text.parse::<IpAddr>() {
        Ok(ip) => match unusable(ip) {
            Some(problem) => Err(format!("{ip} is {problem}, not a usable {what}; it is skipped")),
            None => Ok(ip),
        },
        Err(_) => Err(format!("{text:?} is not an IP address; it is skipped")),
    }
}

/// One `loadBalancerSourceRanges` entry, of either family (each family's frontends take the ranges of
/// their own, as kube-proxy's per-family proxiers do). The API server has accepted entries with spaces
/// around them, so those are trimmed.
pub(super) fn source_range(text: &str) -> Result<Cidr, String> {
    text.trim().parse::<Cidr>().map_err(|problem| format!("{problem}; the range is skipped"))
}

/// The ClientIP affinity timeout, if the Service asks for affinity. Invalid values are reported (through
/// `report(field, message)`) and replaced by the default, or by no affinity for an unknown kind.
pub(super) fn affinity_timeout(spec: &ServiceSpec, report: &mut dyn FnMut(&str, String)) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        None | Some("") | Some("None") => return None,
        Some("ClientIP") => {}
        Some(other) => {
            report(
                "spec.sessionAffinity",
                format!("sessionAffinity {other:?} is not None or ClientIP; no affinity is used"),
            );
            return None;
        }
    }
    let timeout = spec
        .session_affinity_config
        .as_ref()
        .and_then(|config| config.client_ip.as_ref())
        .and_then(|client_ip| client_ip.timeout_seconds);
    let Some(seconds) = timeout else {
        return Some(DEFAULT_AFFINITY_TIMEOUT_SECONDS);
    };
    match u32::try_from(seconds) {
        Ok(seconds) if (1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(&seconds) => Some(seconds),
        _ => {
            report(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                format!(
                    "timeoutSeconds {seconds} is not in 1-{MAX_AFFINITY_TIMEOUT_SECONDS}; \
                     {DEFAULT_AFFINITY_TIMEOUT_SECONDS} is used"
                ),
            );
            Some(DEFAULT_AFFINITY_TIMEOUT_SECONDS)
        }
    }
}
