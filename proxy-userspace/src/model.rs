//! The desired datapath state, computed from Services and EndpointSlices with kube-proxy's semantics.
//!
//! Pure: no BPF, no I/O. [`build`] turns the objects read by [`crate::manifest`] into a sorted list of
//! [`Frontend`]s (cluster IP × port × protocol, each with its ready backends) plus the problems it found.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tracing::debug;

use crate::manifest::{ManifestError, Sourced};

/// EndpointSlice label naming the Service the slice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Objects with this label (any value) are headless; no proxy programs them.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Objects with this label (any value) belong to another service proxy; kproxy is the default proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

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
    pub addr: Ipv4Addr,
    pub port: u16,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.addr, self.port)
    }
}

/// One virtual address the datapath answers: a cluster IP, a Service port and its protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub service: ServiceName,
    /// The Service port's name; empty for an unnamed port.
    pub port_name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
    /// Ready backends, sorted and deduplicated; empty when the Service has no ready endpoint
    /// (the datapath must still know the VIP, to reject instead of letting packets through).
    pub backends: Vec<BackendAddr>,
}

/// Everything the datapath should hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// Sorted by (vip, port, proto); no two frontends share that key.
    pub frontends: Vec<Frontend>,
}

/// Computes the desired state. Problems are returned (named by object and field) and the offending part
/// is left out; everything else is still built. Output is deterministic and this never panics.
pub fn build(
    services: &[Sourced<Service>],
    slices: &[Sourced<EndpointSlice>],
) -> (Desired, Vec<ManifestError>) {
    let mut errors = Vec::new();

    let mut not_ours = HashSet::new();
    let mut seen_services = HashMap::new();
    let plans: Vec<ServicePlan> = services
        .iter()
        .filter_map(|svc| plan_service(svc, &mut errors, &mut not_ours, &mut seen_services))
        .collect();

    let mut by_service: HashMap<ServiceName, Vec<SliceUse>> = HashMap::new();
    let mut seen_slices = HashMap::new();
    for slice in slices {
        if let Some((service, used)) = use_slice(slice, &not_ours, &mut errors, &mut seen_slices) {
            by_service.entry(service).or_default().push(used);
        }
    }

    let mut frontends = Vec::new();
    let mut taken: HashMap<(Ipv4Addr, u16, Protocol), &ServiceName> = HashMap::new();
    for plan in &plans {
        let slices = by_service.get(&plan.name).map(Vec::as_slice).unwrap_or_default();
        for port in &plan.ports {
            let backends = backends_for(&plan.name, port, slices);
            for &vip in &plan.vips {
                let key = (vip, port.port, port.proto);
                if let Some(other) = taken.get(&key) {
                    let message = format!(
                        "{vip}:{}/{} is already used by Service {other}; the port is skipped",
                        port.port, port.proto
                    );
                    errors.push(service_error(
                        plan.origin,
                        &plan.name,
                        format!("spec.ports[{}]", port.index),
                        message,
                    ));
                    continue;
                }
                taken.insert(key, &plan.name);
                frontends.push(Frontend {
                    service: plan.name.clone(),
                    port_name: port.name.clone(),
                    vip,
                    port: port.port,
                    proto: port.proto,
                    backends: backends.clone(),
                });
            }
        }
    }
    frontends.sort_by_key(|f| (f.vip, f.port, f.proto));
    (Desired { frontends }, errors)
}

/// A Service that will be programmed, after validation.
struct ServicePlan<'a> {
    origin: &'a str,
    name: ServiceName,
    vips: Vec<Ipv4Addr>,
    ports: Vec<PortPlan>,
}

struct PortPlan {
    /// Position in `spec.ports`, for messages.
    index: usize,
    name: String,
    port: u16,
    proto: Protocol,
}

/// What one EndpointSlice contributes to its Service.
struct SliceUse {
    /// (port name, target port, protocol) of the slice's valid ports.
    ports: Vec<(String, u16, Protocol)>,
    /// Addresses of ready endpoints.
    ready: Vec<Ipv4Addr>,
}

fn namespace_of(meta: &ObjectMeta) -> String {
    match meta.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => ns.to_string(),
        _ => "default".to_string(),
    }
}

fn has_label(meta: &ObjectMeta, key: &str) -> bool {
    meta.labels.as_ref().is_some_and(|labels| labels.contains_key(key))
}

fn service_error(origin: &str, name: &ServiceName, field: String, message: String) -> ManifestError {
    ManifestError::new(origin, message).with_object(format!("Service {name}")).with_field(field)
}

/// `TCP` when absent (the API server's default); SCTP and anything else are not supported.
fn parse_protocol(protocol: Option<&str>) -> Result<Protocol, String> {
    match protocol {
        None | Some("") | Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Err("SCTP is not supported by kproxy; the port is skipped".to_string()),
        Some(other) => {
            Err(format!("protocol {other:?} is not supported by kproxy (TCP or UDP); the port is skipped"))
        }
    }
}

/// A port number from the API (an i32), if it is in 1..=65535.
fn port_number(port: i32) -> Option<u16> {
    u16::try_from(port).ok().filter(|&p| p != 0)
}

/// Addresses the API server itself refuses for cluster IPs and endpoints, and that the datapath cannot use.
fn unusable(addr: Ipv4Addr) -> Option<&'static str> {
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

fn plan_service<'a>(
    svc: &'a Sourced<Service>,
    errors: &mut Vec<ManifestError>,
    not_ours: &mut HashSet<ServiceName>,
    seen: &mut HashMap<ServiceName, &'a str>,
) -> Option<ServicePlan<'a>> {
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
        not_ours.insert(name);
        return None;
    }
    if has_label(meta, LABEL_SERVICE_PROXY_NAME) {
        debug!(service = %name, "skipping a Service labelled {LABEL_SERVICE_PROXY_NAME} (another proxy's)");
        not_ours.insert(name);
        return None;
    }
    let Some(spec) = svc.object.spec.as_ref() else {
        debug!(service = %name, "skipping a Service without spec");
        return None;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        debug!(service = %name, "skipping an ExternalName Service");
        not_ours.insert(name);
        return None;
    }

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
        not_ours.insert(name);
        return None;
    }
    let mut vips = Vec::new();
    for (field, text) in candidates {
        match text.parse::<IpAddr>() {
            Ok(IpAddr::V4(vip)) => {
                if let Some(what) = unusable(vip) {
                    let message = format!("{vip} is {what}, not a usable cluster IP; the Service is skipped");
                    errors.push(service_error(origin, &name, field, message));
                    return None;
                }
                if !vips.contains(&vip) {
                    vips.push(vip);
                }
            }
            Ok(IpAddr::V6(vip)) => debug!(service = %name, %vip, "IPv6 cluster IPs are not programmed yet"),
            Err(_) => {
                let message = format!("{text:?} is not an IP address; the Service is skipped");
                errors.push(service_error(origin, &name, field, message));
                return None;
            }
        }
    }
    if vips.is_empty() {
        debug!(service = %name, "skipping a Service without an IPv4 cluster IP");
        return None;
    }

    let mut ports: Vec<PortPlan> = Vec::new();
    for (index, sp) in spec.ports.iter().flatten().enumerate() {
        let proto = match parse_protocol(sp.protocol.as_deref()) {
            Ok(proto) => proto,
            Err(message) => {
                errors.push(service_error(origin, &name, format!("spec.ports[{index}].protocol"), message));
                continue;
            }
        };
        let Some(port) = port_number(sp.port) else {
            let message = format!("port {} is not in 1-65535; the port is skipped", sp.port);
            errors.push(service_error(origin, &name, format!("spec.ports[{index}].port"), message));
            continue;
        };
        let port_name = sp.name.clone().unwrap_or_default();
        if let Some(first) = ports.iter().find(|p| p.port == port && p.proto == proto) {
            let message = format!(
                "duplicate port {port}/{proto} (also spec.ports[{}]); the port is skipped",
                first.index
            );
            errors.push(service_error(origin, &name, format!("spec.ports[{index}]"), message));
            continue;
        }
        if let Some(first) = ports.iter().find(|p| p.name == port_name) {
            let message = format!(
                "duplicate port name {port_name:?} (also spec.ports[{}]); the port is skipped",
                first.index
            );
            errors.push(service_error(origin, &name, format!("spec.ports[{index}].name"), message));
            continue;
        }
        ports.push(PortPlan { index, name: port_name, port, proto });
    }
    Some(ServicePlan { origin, name, vips, ports })
}

fn use_slice<'a>(
    slice: &'a Sourced<EndpointSlice>,
    not_ours: &HashSet<ServiceName>,
    errors: &mut Vec<ManifestError>,
    seen: &mut HashMap<(String, String), &'a str>,
) -> Option<(ServiceName, SliceUse)> {
    let origin = slice.origin.as_str();
    let meta = &slice.object.metadata;
    let namespace = namespace_of(meta);
    let slice_name = meta.name.clone().unwrap_or_default();
    let object = format!("EndpointSlice {namespace}/{slice_name}");
    let service = meta
        .labels
        .as_ref()
        .and_then(|labels| labels.get(LABEL_SERVICE_NAME))
        .filter(|service| !service.is_empty());
    let Some(service) = service else {
        debug!(slice = %object, "ignoring an EndpointSlice without the {LABEL_SERVICE_NAME} label");
        return None;
    };
    let service = ServiceName { namespace: namespace.clone(), name: service.clone() };
    if has_label(meta, LABEL_HEADLESS)
        || has_label(meta, LABEL_SERVICE_PROXY_NAME)
        || not_ours.contains(&service)
    {
        debug!(slice = %object, "ignoring an EndpointSlice of a Service kproxy does not program");
        return None;
    }
    if slice.object.address_type != "IPv4" {
        debug!(slice = %object, address_type = slice.object.address_type, "ignoring a non-IPv4 EndpointSlice");
        return None;
    }
    if !slice_name.is_empty() {
        if let Some(first) = seen.get(&(namespace.clone(), slice_name.clone())) {
            let message =
                format!("the EndpointSlice is defined again (first in {first}); this copy is skipped");
            errors.push(ManifestError::new(origin, message).with_object(object));
            return None;
        }
        seen.insert((namespace, slice_name), origin);
    }
    let error = |field: String, message: String| {
        ManifestError::new(origin, message).with_object(object.clone()).with_field(field)
    };

    let mut ports = Vec::new();
    for (i, port) in slice.object.ports.iter().flatten().enumerate() {
        let number = match port.port {
            Some(n) => match port_number(n) {
                Some(number) => number,
                None => {
                    let message = format!("port {n} is not in 1-65535; the port is ignored");
                    errors.push(error(format!("ports[{i}].port"), message));
                    continue;
                }
            },
            None => {
                let message = "the port number is missing; the port is ignored".to_string();
                errors.push(error(format!("ports[{i}].port"), message));
                continue;
            }
        };
        // An unsupported protocol was already reported on the Service's port.
        let Ok(proto) = parse_protocol(port.protocol.as_deref()) else {
            debug!(slice = %object, index = i, "ignoring an EndpointSlice port with an unsupported protocol");
            continue;
        };
        ports.push((port.name.clone().unwrap_or_default(), number, proto));
    }

    let mut ready = Vec::new();
    for (i, endpoint) in slice.object.endpoints.iter().enumerate() {
        let is_ready = endpoint.conditions.as_ref().and_then(|c| c.ready) != Some(false);
        for (j, text) in endpoint.addresses.iter().enumerate() {
            let field = || format!("endpoints[{i}].addresses[{j}]");
            match text.parse::<Ipv4Addr>() {
                Ok(addr) => match unusable(addr) {
                    Some(what) => {
                        let message =
                            format!("{addr} is {what}, not a usable endpoint; the address is skipped");
                        errors.push(error(field(), message));
                    }
                    None if is_ready => ready.push(addr),
                    None => {}
                },
                Err(_) => {
                    let message = format!("{text:?} is not an IPv4 address; the address is skipped");
                    errors.push(error(field(), message));
                }
            }
        }
    }
    Some((service, SliceUse { ports, ready }))
}

/// Ready backends of one Service port: slice ports are matched by name (absent and empty are equal) and
/// must have the same protocol; the slice port's number is the target port of that slice's endpoints.
fn backends_for(service: &ServiceName, port: &PortPlan, slices: &[SliceUse]) -> Vec<BackendAddr> {
    let mut backends = BTreeSet::new();
    for slice in slices {
        for (name, target, proto) in &slice.ports {
            if *name != port.name {
                continue;
            }
            if *proto != port.proto {
                debug!(%service, port = name, "EndpointSlice port protocol differs from the Service port's; ignored");
                continue;
            }
            backends.extend(slice.ready.iter().map(|&addr| BackendAddr { addr, port: *target }));
        }
    }
    backends.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Objects, parse_str};

    const KUBE_DNS: &str = r#"apiVersion: v1
kind: Service
metadata:
  annotations:
    prometheus.io/port: "9153"
    prometheus.io/scrape: "true"
  labels:
    k8s-app: kube-dns
    kubernetes.io/cluster-service: "true"
    kubernetes.io/name: CoreDNS
  name: kube-dns
  namespace: kube-system
  resourceVersion: "234"
  uid: 5d3b9f5e-8c1a-4f0e-9a55-0c6f1f3f2a11
spec:
  clusterIP: 10.96.0.10
  clusterIPs:
  - 10.96.0.10
  internalTrafficPolicy: Cluster
  ipFamilies:
  - IPv4
  ipFamilyPolicy: SingleStack
  ports:
  - name: dns
    port: 53
    protocol: UDP
    targetPort: 53
  - name: dns-tcp
    port: 53
    protocol: TCP
    targetPort: 53
  - name: metrics
    port: 9153
    protocol: TCP
    targetPort: 9153
  selector:
    k8s-app: kube-dns
  sessionAffinity: None
  type: ClusterIP
status:
  loadBalancer: {}
"#;

    const KUBE_DNS_SLICE_A: &str = r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.0.13
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: kind-control-plane
  targetRef:
    kind: Pod
    name: coredns-668d6bf9bc-x7k2p
    namespace: kube-system
- addresses:
  - 10.244.0.12
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: kind-control-plane
  targetRef:
    kind: Pod
    name: coredns-668d6bf9bc-4zq8m
    namespace: kube-system
kind: EndpointSlice
metadata:
  generateName: kube-dns-
  labels:
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
    k8s-app: kube-dns
    kubernetes.io/service-name: kube-dns
  name: kube-dns-abc12
  namespace: kube-system
ports:
- name: dns-tcp
  port: 53
  protocol: TCP
- name: dns
  port: 53
  protocol: UDP
- name: metrics
  port: 9153
  protocol: TCP
"#;

    /// A second slice of kube-dns: one endpoint shared with the first (a duplicate), one new on another
    /// node, and one that is not ready.
    const KUBE_DNS_SLICE_B: &str = r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.1.9
  conditions:
    ready: true
  nodeName: kind-worker
- addresses:
  - 10.244.0.12
  conditions: {}
  nodeName: kind-control-plane
- addresses:
  - 10.244.2.4
  conditions:
    ready: false
    serving: false
    terminating: true
  nodeName: kind-worker2
kind: EndpointSlice
metadata:
  labels:
    kubernetes.io/service-name: kube-dns
  name: kube-dns-def34
  namespace: kube-system
ports:
- name: dns
  port: 53
  protocol: UDP
- name: dns-tcp
  port: 53
  protocol: TCP
- name: metrics
  port: 9153
  protocol: TCP
"#;

    fn parse(docs: &[&str]) -> Objects {
        let mut objects = Objects::default();
        for (i, doc) in docs.iter().enumerate() {
            objects.append(parse_str(doc, &format!("test-{i}.yaml")));
        }
        assert!(objects.errors.is_empty(), "manifest errors: {:?}", objects.errors);
        objects
    }

    fn build_from(docs: &[&str]) -> (Desired, Vec<ManifestError>) {
        let objects = parse(docs);
        build(&objects.services, &objects.slices)
    }

    fn build_ok(docs: &[&str]) -> Desired {
        let (desired, errors) = build_from(docs);
        assert!(errors.is_empty(), "model errors: {errors:#?}");
        desired
    }

    fn frontend<'a>(desired: &'a Desired, vip: &str, port: u16, proto: Protocol) -> &'a Frontend {
        let vip: Ipv4Addr = vip.parse().unwrap();
        desired
            .frontends
            .iter()
            .find(|f| f.vip == vip && f.port == port && f.proto == proto)
            .unwrap_or_else(|| panic!("no frontend {vip}:{port}/{proto} in {desired:#?}"))
    }

    fn backends(list: &[(&str, u16)]) -> Vec<BackendAddr> {
        list.iter().map(|(addr, port)| BackendAddr { addr: addr.parse().unwrap(), port: *port }).collect()
    }

    fn keys(desired: &Desired) -> Vec<String> {
        desired.frontends.iter().map(|f| format!("{}:{}/{}", f.vip, f.port, f.proto)).collect()
    }

    /// A Service `shop/web` with the given spec lines (indented by two spaces under `spec:`).
    fn web(spec: &str) -> String {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\nspec:\n{spec}")
    }

    /// An IPv4 EndpointSlice of `shop/web` with the given top-level lines.
    fn web_slice(name: &str, body: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\n{body}"
        )
    }

    #[test]
    fn kube_dns_with_one_slice() {
        let desired = build_ok(&[KUBE_DNS, KUBE_DNS_SLICE_A]);
        assert_eq!(keys(&desired), ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP"]);
        let dns = frontend(&desired, "10.96.0.10", 53, Protocol::Udp);
        assert_eq!(dns.service, ServiceName { namespace: "kube-system".into(), name: "kube-dns".into() });
        assert_eq!(dns.service.to_string(), "kube-system/kube-dns");
        assert_eq!(dns.port_name, "dns");
        assert_eq!(dns.backends, backends(&[("10.244.0.12", 53), ("10.244.0.13", 53)]));
        assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Tcp).port_name, "dns-tcp");
        let metrics = frontend(&desired, "10.96.0.10", 9153, Protocol::Tcp);
        assert_eq!(metrics.port_name, "metrics");
        assert_eq!(metrics.backends, backends(&[("10.244.0.12", 9153), ("10.244.0.13", 9153)]));
    }

    #[test]
    fn slices_are_merged_deduplicated_sorted_and_only_ready_endpoints_used() {
        let desired = build_ok(&[KUBE_DNS_SLICE_B, KUBE_DNS, KUBE_DNS_SLICE_A]);
        let expected = backends(&[("10.244.0.12", 53), ("10.244.0.13", 53), ("10.244.1.9", 53)]);
        assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Udp).backends, expected);
        assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Tcp).backends, expected);
    }

    #[test]
    fn output_does_not_depend_on_input_order() {
        let a = build_ok(&[KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_B]);
        let b = build_ok(&[KUBE_DNS_SLICE_B, KUBE_DNS_SLICE_A, KUBE_DNS]);
        assert_eq!(a, b);
        let other = web("  clusterIP: 10.96.0.5\n  ports:\n  - port: 80\n");
        let c = build_ok(&[&other, KUBE_DNS]);
        let d = build_ok(&[KUBE_DNS, &other]);
        assert_eq!(c, d);
        assert_eq!(
            keys(&c),
            ["10.96.0.5:80/TCP", "10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP"]
        );
    }

    #[test]
    fn readiness_absent_or_true_is_ready_false_is_not() {
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.1]\n- addresses: [10.244.1.2]\n  conditions: {ready: true}\n- addresses: [10.244.1.3]\n  conditions: {ready: false, serving: true, terminating: true}\n- addresses: [10.244.1.4]\n  conditions: {serving: true}\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n",
        );
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: http\n",
        );
        let desired = build_ok(&[&svc, &slice]);
        let fe = frontend(&desired, "10.96.12.7", 80, Protocol::Tcp);
        assert_eq!(
            fe.backends,
            backends(&[("10.244.1.1", 8080), ("10.244.1.2", 8080), ("10.244.1.4", 8080)])
        );
    }

    #[test]
    fn no_ready_endpoints_still_gives_a_frontend() {
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.3]\n  conditions: {ready: false}\nports:\n- port: 8080\n",
        );
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
        let desired = build_ok(&[&svc, &slice]);
        assert_eq!(desired.frontends.len(), 1);
        assert!(frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends.is_empty());

        // And with no EndpointSlice at all.
        let desired = build_ok(&[KUBE_DNS]);
        assert_eq!(desired.frontends.len(), 3);
        assert!(desired.frontends.iter().all(|f| f.backends.is_empty()));

        // And with a slice that has `endpoints: null`, as the API prints for an empty slice.
        let slice = web_slice("web-x1", "endpoints: null\nports:\n- port: 8080\n");
        let desired = build_ok(&[&svc, &slice]);
        assert!(desired.frontends[0].backends.is_empty());
    }

    #[test]
    fn dual_stack_uses_ipv4_cluster_ips_deduplicated() {
        let svc = web(
            "  clusterIP: fd00:10:96::4a1\n  clusterIPs:\n  - fd00:10:96::4a1\n  - 10.96.12.7\n  ipFamilies: [IPv6, IPv4]\n  ipFamilyPolicy: PreferDualStack\n  ports:\n  - name: http\n    port: 80\n",
        );
        let desired = build_ok(&[&svc]);
        assert_eq!(keys(&desired), ["10.96.12.7:80/TCP"]);

        let svc =
            web("  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, 10.96.12.8]\n  ports:\n  - port: 80\n");
        let desired = build_ok(&[&svc]);
        assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.8:80/TCP"]);

        // Only clusterIPs set (clusterIP empty) still works.
        let svc = web("  clusterIP: \"\"\n  clusterIPs: [10.96.12.9]\n  ports:\n  - port: 80\n");
        assert_eq!(keys(&build_ok(&[&svc])), ["10.96.12.9:80/TCP"]);

        // IPv6-only: skipped quietly.
        let svc =
            web("  clusterIP: fd00:10:96::4a1\n  clusterIPs: [fd00:10:96::4a1]\n  ports:\n  - port: 80\n");
        assert_eq!(build_ok(&[&svc]), Desired::default());
    }

    #[test]
    fn headless_external_name_and_missing_cluster_ip_are_skipped_without_error() {
        let headless =
            web("  clusterIP: None\n  clusterIPs: [None]\n  ports:\n  - name: http\n    port: 80\n");
        let headless_slice = web_slice(
            "web-h1",
            "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: null\n",
        );
        let external = r#"apiVersion: v1
kind: Service
metadata:
  name: search
  namespace: shop
spec:
  type: ExternalName
  externalName: search.example.com
  ports:
  - port: 443
"#;
        let no_ip = "apiVersion: v1\nkind: Service\nmetadata:\n  name: pending\n  namespace: shop\nspec:\n  ports:\n  - port: 80\n";
        let no_spec = "apiVersion: v1\nkind: Service\nmetadata:\n  name: bare\n";
        // The slice of the headless Service is not ours: its missing port number is not reported.
        let desired = build_ok(&[&headless, &headless_slice, external, no_ip, no_spec]);
        assert_eq!(desired, Desired::default());
    }

    #[test]
    fn headless_and_service_proxy_name_labels_skip_the_service() {
        for label in
            ["service.kubernetes.io/headless: \"\"", "service.kubernetes.io/service-proxy-name: cilium"]
        {
            let svc = format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\n  labels:\n    app: web\n    {label}\nspec:\n  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n"
            );
            let slice = web_slice("web-x1", "endpoints:\n- addresses: [bogus]\nports:\n- port: 0\n");
            assert_eq!(build_ok(&[&svc, &slice]), Desired::default(), "{label}");
        }
        // A slice carrying the label is ignored as well, as kube-proxy's informers do.
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
        let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-x1\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\n    service.kubernetes.io/service-proxy-name: other\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.1]\nports:\n- port: 8080\n";
        let desired = build_ok(&[&svc, slice]);
        assert!(desired.frontends[0].backends.is_empty());
    }

    #[test]
    fn protocol_defaults_to_tcp_and_sctp_is_reported_but_other_ports_kept() {
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n  - name: sig\n    port: 3868\n    protocol: SCTP\n  - name: syslog\n    port: 514\n    protocol: UDP\n  - name: weird\n    port: 9\n    protocol: tcp\n",
        );
        let (desired, errors) = build_from(&[&svc]);
        assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.7:514/UDP"]);
        assert_eq!(errors.len(), 2, "{errors:#?}");
        assert_eq!(errors[0].origin, "test-0.yaml");
        assert_eq!(errors[0].object.as_deref(), Some("Service shop/web"));
        assert_eq!(errors[0].field.as_deref(), Some("spec.ports[1].protocol"));
        assert!(errors[0].message.contains("SCTP is not supported by kproxy"), "{}", errors[0].message);
        assert!(errors[0].message.contains("skipped"), "{}", errors[0].message);
        assert_eq!(errors[1].field.as_deref(), Some("spec.ports[3].protocol"));
        assert!(errors[1].message.contains("\"tcp\""), "{}", errors[1].message);
    }

    #[test]
    fn invalid_cluster_ip_skips_the_service() {
        for (spec, field) in [
            ("  clusterIP: 10.96.300.1\n", "spec.clusterIP"),
            ("  clusterIP: web.shop.svc\n", "spec.clusterIP"),
            ("  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"10.96.12.x\"]\n", "spec.clusterIPs[1]"),
            ("  clusterIP: 0.0.0.0\n", "spec.clusterIP"),
            ("  clusterIP: 127.0.0.1\n", "spec.clusterIP"),
        ] {
            let svc = web(&format!("{spec}  ports:\n  - port: 80\n"));
            let (desired, errors) = build_from(&[&svc, KUBE_DNS]);
            assert_eq!(desired.frontends.len(), 3, "kube-dns is still built: {spec}");
            assert_eq!(errors.len(), 1, "{spec}: {errors:#?}");
            assert_eq!(errors[0].object.as_deref(), Some("Service shop/web"));
            assert_eq!(errors[0].field.as_deref(), Some(field));
            assert!(errors[0].message.ends_with("the Service is skipped"), "{}", errors[0].message);
        }
    }

    #[test]
    fn out_of_range_ports_are_reported_and_skipped() {
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: a\n    port: 0\n  - name: b\n    port: 70000\n  - name: c\n    port: -80\n  - name: d\n    port: 65535\n  - name: e\n",
        );
        let (desired, errors) = build_from(&[&svc]);
        assert_eq!(keys(&desired), ["10.96.12.7:65535/TCP"]);
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_deref().unwrap()).collect();
        assert_eq!(
            fields,
            ["spec.ports[0].port", "spec.ports[1].port", "spec.ports[2].port", "spec.ports[4].port"]
        );
        assert_eq!(
            errors[1].to_string(),
            "test-0.yaml: Service shop/web: spec.ports[1].port: port 70000 is not in 1-65535; the port is skipped"
        );
    }

    #[test]
    fn duplicate_port_and_protocol_is_reported_same_port_other_protocol_is_fine() {
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n  - name: http-udp\n    port: 80\n    protocol: UDP\n  - name: again\n    port: 80\n",
        );
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n- name: http-udp\n  port: 8081\n  protocol: UDP\n",
        );
        let (desired, errors) = build_from(&[&svc, &slice]);
        assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.7:80/UDP"]);
        assert_eq!(
            frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends,
            backends(&[("10.244.1.1", 8080)])
        );
        assert_eq!(
            frontend(&desired, "10.96.12.7", 80, Protocol::Udp).backends,
            backends(&[("10.244.1.1", 8081)])
        );
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert_eq!(errors[0].field.as_deref(), Some("spec.ports[2]"));
        assert!(
            errors[0].message.contains("duplicate port 80/TCP (also spec.ports[0])"),
            "{}",
            errors[0].message
        );
    }

    #[test]
    fn duplicate_port_name_is_reported() {
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n  - name: http\n    port: 81\n",
        );
        let (desired, errors) = build_from(&[&svc]);
        assert_eq!(keys(&desired), ["10.96.12.7:80/TCP"]);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].field.as_deref(), Some("spec.ports[1].name"));
    }

    #[test]
    fn slices_link_by_label_within_the_namespace() {
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
        let unlabelled = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-manual\n  namespace: shop\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.1]\nports:\n- port: 8080\n";
        let other_ns = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-x1\n  namespace: staging\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\nports:\n- port: 8080\n";
        let linked = web_slice("web-x2", "endpoints:\n- addresses: [10.244.1.3]\nports:\n- port: 8080\n");
        let desired = build_ok(&[&svc, unlabelled, other_ns, &linked]);
        assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.3", 8080)]));

        // A slice without a namespace belongs to `default`.
        let svc = "apiVersion: v1\nkind: Service\nmetadata:\n  name: api\nspec:\n  clusterIP: 10.96.0.20\n  ports:\n  - port: 443\n";
        let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: api-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: api\naddressType: IPv4\nendpoints:\n- addresses: [10.244.3.3]\nports:\n- port: 6443\n";
        let desired = build_ok(&[svc, slice]);
        assert_eq!(desired.frontends[0].service.to_string(), "default/api");
        assert_eq!(desired.frontends[0].backends, backends(&[("10.244.3.3", 6443)]));
    }

    #[test]
    fn ipv6_and_fqdn_slices_are_skipped_quietly() {
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
        let v6 = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-v6\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv6\nendpoints:\n- addresses: [\"fd00:10:244::5\"]\nports:\n- port: 8080\n";
        let fqdn = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-fqdn\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: FQDN\nendpoints:\n- addresses: [web.example.com]\nports:\n- port: 0\n";
        let desired = build_ok(&[&svc, v6, fqdn]);
        assert_eq!(desired.frontends.len(), 1);
        assert!(desired.frontends[0].backends.is_empty());
    }

    #[test]
    fn named_target_ports_resolve_per_slice() {
        // Port 80 → container port "http", which is 100 on one set of pods and 101 on another
        // (the e2e "multi-port, named targetPort" case); unnamed ports match unnamed slice ports.
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    targetPort: http\n  - name: admin\n    port: 81\n    targetPort: admin\n",
        );
        let old = web_slice(
            "web-old",
            "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: 100\n  protocol: TCP\n- name: admin\n  port: 200\n  protocol: TCP\n",
        );
        let new = web_slice(
            "web-new",
            "endpoints:\n- addresses: [10.244.2.1]\nports:\n- name: http\n  port: 101\n  protocol: TCP\n- port: 999\n",
        );
        let desired = build_ok(&[&svc, &old, &new]);
        let http = frontend(&desired, "10.96.12.7", 80, Protocol::Tcp);
        assert_eq!(http.backends, backends(&[("10.244.1.1", 100), ("10.244.2.1", 101)]));
        let admin = frontend(&desired, "10.96.12.7", 81, Protocol::Tcp);
        assert_eq!(admin.backends, backends(&[("10.244.1.1", 200)]));

        // Absent and empty names match each other.
        let svc = web("  clusterIP: 10.96.12.8\n  ports:\n  - port: 80\n    targetPort: 8080\n");
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.5]\nports:\n- name: \"\"\n  port: 8080\n",
        );
        let desired = build_ok(&[&svc, &slice]);
        assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.5", 8080)]));
        let svc = web("  clusterIP: 10.96.12.8\n  ports:\n  - name: \"\"\n    port: 80\n");
        let slice = web_slice("web-x1", "endpoints:\n- addresses: [10.244.1.5]\nports:\n- port: 8080\n");
        let desired = build_ok(&[&svc, &slice]);
        assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.5", 8080)]));
    }

    #[test]
    fn slice_port_protocol_must_match() {
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n");
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: dns\n  port: 5353\n  protocol: TCP\n",
        );
        let desired = build_ok(&[&svc, &slice]);
        assert!(frontend(&desired, "10.96.12.7", 53, Protocol::Udp).backends.is_empty());
    }

    #[test]
    fn invalid_slice_ports_are_reported_and_ignored() {
        let svc = web(
            "  clusterIP: 10.96.12.7\n  ports:\n  - name: a\n    port: 80\n  - name: b\n    port: 81\n  - name: c\n    port: 82\n  - name: d\n    port: 83\n",
        );
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: a\n  port: 0\n- name: b\n  port: 70000\n- name: c\n- name: d\n  port: 8083\n",
        );
        let (desired, errors) = build_from(&[&svc, &slice]);
        assert_eq!(desired.frontends.len(), 4);
        assert!(frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends.is_empty());
        assert!(frontend(&desired, "10.96.12.7", 81, Protocol::Tcp).backends.is_empty());
        assert!(frontend(&desired, "10.96.12.7", 82, Protocol::Tcp).backends.is_empty());
        assert_eq!(
            frontend(&desired, "10.96.12.7", 83, Protocol::Tcp).backends,
            backends(&[("10.244.1.1", 8083)])
        );
        assert_eq!(errors.len(), 3, "{errors:#?}");
        for (err, i) in errors.iter().zip(0..) {
            assert_eq!(err.origin, "test-1.yaml");
            assert_eq!(err.object.as_deref(), Some("EndpointSlice shop/web-x1"));
            assert_eq!(err.field, Some(format!("ports[{i}].port")));
        }
        assert!(errors[2].message.contains("missing"), "{}", errors[2].message);
    }

    #[test]
    fn invalid_endpoint_addresses_are_reported_and_skipped() {
        let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
        let slice = web_slice(
            "web-x1",
            "endpoints:\n- addresses: [10.244.1.1]\n- addresses: [\"10.244.1.300\", 10.244.1.2, \"fd00::1\"]\n- addresses: [127.0.0.1]\n  conditions: {ready: false}\nports:\n- port: 8080\n",
        );
        let (desired, errors) = build_from(&[&svc, &slice]);
        assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.1", 8080), ("10.244.1.2", 8080)]));
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_deref().unwrap()).collect();
        assert_eq!(
            fields,
            ["endpoints[1].addresses[0]", "endpoints[1].addresses[2]", "endpoints[2].addresses[0]"]
        );
        assert_eq!(
            errors[0].to_string(),
            "test-1.yaml: EndpointSlice shop/web-x1: endpoints[1].addresses[0]: \"10.244.1.300\" is not an IPv4 address; the address is skipped"
        );
    }

    #[test]
    fn conflicting_and_repeated_objects_are_reported() {
        let svc = web(
            "  clusterIP: 10.96.0.10\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n  - port: 80\n",
        );
        let (desired, errors) = build_from(&[KUBE_DNS, &svc, KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_A]);
        assert_eq!(
            keys(&desired),
            ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:80/TCP", "10.96.0.10:9153/TCP"]
        );
        assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Udp).service.name, "kube-dns");
        assert_eq!(frontend(&desired, "10.96.0.10", 80, Protocol::Tcp).service.name, "web");
        let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(texts.len(), 3, "{texts:#?}");
        assert_eq!(
            texts[0],
            "test-2.yaml: Service kube-system/kube-dns: the Service is defined again (first in test-0.yaml); this copy is skipped"
        );
        assert_eq!(
            texts[1],
            "test-4.yaml: EndpointSlice kube-system/kube-dns-abc12: the EndpointSlice is defined again (first in test-3.yaml); this copy is skipped"
        );
        assert_eq!(
            texts[2],
            "test-1.yaml: Service shop/web: spec.ports[0]: 10.96.0.10:53/UDP is already used by Service kube-system/kube-dns; the port is skipped"
        );
    }

    #[test]
    fn multi_document_file_with_broken_document_and_bad_port() {
        let text = format!(
            r#"# web shop, as applied by the demo
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: 10.96.45.3
  ports:
  - name: http
    port: 70000
    targetPort: 8080
  - name: https
    port: 443
    targetPort: 8443
---
apiVersion: v1
kind: Service
metadata:
  name: cart
  namespace: default
spec:
  clusterIP: 10.96.45.4
  ports:
  - name: http
    port: 80
    targetPort: 8080
    protocol: [TCP
---
{KUBE_DNS}---
{KUBE_DNS_SLICE_A}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-7f9c2
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses:
  - 10.244.1.20
  conditions:
    ready: true
ports:
- name: https
  port: 8443
  protocol: TCP
"#
        );
        let objects = parse_str(&text, "examples/web.yaml");
        assert_eq!(objects.services.len(), 2);
        assert_eq!(objects.slices.len(), 2);
        assert_eq!(objects.errors.len(), 1, "{:#?}", objects.errors);
        let broken = objects.errors[0].to_string();
        assert!(broken.starts_with("examples/web.yaml (document 2): invalid YAML: "), "{broken}");

        let (desired, errors) = build(&objects.services, &objects.slices);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        let err = &errors[0];
        assert_eq!(err.origin, "examples/web.yaml (document 1)");
        assert_eq!(err.object.as_deref(), Some("Service default/web"));
        assert_eq!(err.field.as_deref(), Some("spec.ports[0].port"));
        assert_eq!(
            err.to_string(),
            "examples/web.yaml (document 1): Service default/web: spec.ports[0].port: port 70000 is not in 1-65535; the port is skipped"
        );
        assert_eq!(
            keys(&desired),
            ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP", "10.96.45.3:443/TCP"]
        );
        let https = frontend(&desired, "10.96.45.3", 443, Protocol::Tcp);
        assert_eq!(https.port_name, "https");
        assert_eq!(https.backends, backends(&[("10.244.1.20", 8443)]));
        assert_eq!(
            frontend(&desired, "10.96.0.10", 53, Protocol::Udp).backends,
            backends(&[("10.244.0.12", 53), ("10.244.0.13", 53)])
        );
    }

    #[test]
    fn never_panics_on_empty_or_default_objects() {
        let services = vec![
            Sourced { origin: "a".to_string(), object: Service::default() },
            Sourced {
                origin: "b".to_string(),
                object: Service {
                    metadata: ObjectMeta { name: Some("x".into()), ..Default::default() },
                    spec: Some(Default::default()),
                    ..Default::default()
                },
            },
        ];
        let slices = vec![Sourced { origin: "c".to_string(), object: EndpointSlice::default() }];
        let (desired, errors) = build(&services, &slices);
        assert_eq!(desired, Desired::default());
        assert_eq!(errors.len(), 1);
        assert_eq!(
            errors[0].to_string(),
            "a: Service: metadata.name: the Service has no name; it is skipped"
        );
        assert_eq!(build(&[], &[]), (Desired::default(), Vec::new()));
    }

    #[test]
    fn display_forms() {
        assert_eq!(Protocol::Tcp.to_string(), "TCP");
        assert_eq!(Protocol::Udp.to_string(), "UDP");
        let backend = BackendAddr { addr: Ipv4Addr::new(10, 244, 0, 12), port: 53 };
        assert_eq!(backend.to_string(), "10.244.0.12:53");
        assert!(Protocol::Tcp < Protocol::Udp);
    }
}
