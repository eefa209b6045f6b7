//! The cluster as the differential test sees it: Services, their ports and endpoints. One
//! [`ClusterSpec`] is rendered both ways — Service and EndpointSlice manifests for `kproxy agent
//! --manifests`, and the endpoint lists kube-proxy's rules are generated from — so a backend
//! change is the same change for every proxy.
use std::net::Ipv4Addr;

use serde_json::{Value, json};

use crate::kube_proxy_rules::Svc;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    /// The Kubernetes spelling (`TCP`, `UDP`).
    pub fn k8s(self) -> &'static str {
        match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    pub name: &'static str,
    pub port: u16,
    pub proto: Proto,
    pub target_port: u16,
    /// Makes the Service `type: NodePort` (`externalTrafficPolicy: Cluster`).
    pub node_port: Option<u16>,
}

/// The node the sandbox's proxy runs as (`--hostname-override`; kube-proxy's rules are generated for it).
pub const THIS_NODE: &str = "node-1";

/// One endpoint of a Service's EndpointSlice, with its conditions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub pod: String,
    pub ip: Ipv4Addr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// `nodeName` (every pod runs in the one sandbox; the slice says where it is).
    pub node: &'static str,
    /// `hints.forNodes`.
    pub for_nodes: Vec<&'static str>,
}

impl EndpointSpec {
    pub fn ready(pod: &str, ip: Ipv4Addr) -> Self {
        Self {
            pod: pod.to_owned(),
            ip,
            ready: true,
            serving: true,
            terminating: false,
            node: THIS_NODE,
            for_nodes: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    pub namespace: &'static str,
    pub name: &'static str,
    pub cluster_ip: Ipv4Addr,
    pub ports: Vec<PortSpec>,
    pub endpoints: Vec<EndpointSpec>,
    /// Makes the Service `type: LoadBalancer` with this `status.loadBalancer.ingress` IP.
    pub load_balancer_ip: Option<Ipv4Addr>,
    /// `spec.loadBalancerSourceRanges`.
    pub source_ranges: Vec<&'static str>,
    /// `sessionAffinity: ClientIP` with this timeout (seconds).
    pub affinity_timeout: Option<u32>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `spec.trafficDistribution` (kube-proxy reads the hints the EndpointSlice controller wrote for it).
    pub traffic_distribution: Option<&'static str>,
}

impl ServiceSpec {
    /// The endpoints kube-proxy sends new connections to the cluster IP to, as
    /// `CategorizeEndpoints` (pkg/proxy/topology.go) picks them: the ready ones (on this node only
    /// for `internalTrafficPolicy: Local`), or, when none is ready, the serving and terminating
    /// ones (KEP-1669); for the cluster-wide policy narrowed by node hints when every ready
    /// endpoint has `hints.forNodes` and one names this node (`topologyModeFromHints`:
    /// PreferSameNode). kproxy's model makes the same choice.
    pub fn used_endpoints(&self) -> Vec<&EndpointSpec> {
        let candidates: Vec<&EndpointSpec> =
            self.endpoints.iter().filter(|e| !self.internal_local || e.node == THIS_NODE).collect();
        let ready: Vec<&EndpointSpec> = candidates.iter().copied().filter(|e| e.ready).collect();
        if ready.is_empty() {
            return candidates.into_iter().filter(|e| e.serving && e.terminating).collect();
        }
        let hinted = !self.internal_local
            && ready.iter().all(|e| !e.for_nodes.is_empty())
            && ready.iter().any(|e| e.for_nodes.contains(&THIS_NODE));
        if hinted {
            return ready.into_iter().filter(|e| e.for_nodes.contains(&THIS_NODE)).collect();
        }
        ready
    }

    /// Whether the Service has usable endpoints, on any node (kube-proxy's `hasEndpoints`).
    fn has_endpoints(&self) -> bool {
        self.endpoints.iter().any(|e| e.ready || (e.serving && e.terminating))
    }

    fn manifest(&self) -> Value {
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| {
                let mut port = json!({"name": p.name, "port": p.port, "protocol": p.proto.k8s(), "targetPort": p.target_port});
                if let Some(node_port) = p.node_port {
                    port["nodePort"] = node_port.into();
                }
                port
            })
            .collect();
        let kind = if self.load_balancer_ip.is_some() {
            "LoadBalancer"
        } else if self.ports.iter().any(|p| p.node_port.is_some()) {
            "NodePort"
        } else {
            "ClusterIP"
        };
        let mut service = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "type": kind,
                "clusterIP": self.cluster_ip.to_string(),
                "clusterIPs": [self.cluster_ip.to_string()],
                "ports": ports,
            },
        });
        if self.internal_local {
            service["spec"]["internalTrafficPolicy"] = "Local".into();
        }
        if let Some(distribution) = self.traffic_distribution {
            service["spec"]["trafficDistribution"] = distribution.into();
        }
        if let Some(timeout) = self.affinity_timeout {
            service["spec"]["sessionAffinity"] = "ClientIP".into();
            service["spec"]["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": timeout}});
        }
        if let Some(ip) = self.load_balancer_ip {
            service["spec"]["loadBalancerSourceRanges"] = json!(self.source_ranges);
            service["status"] = json!({"loadBalancer": {"ingress": [{"ip": ip.to_string()}]}});
        }
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|e| {
                let mut endpoint = json!({
                    "addresses": [e.ip.to_string()],
                    "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                    "nodeName": e.node,
                    "targetRef": {"kind": "Pod", "name": e.pod, "namespace": self.namespace},
                });
                if !e.for_nodes.is_empty() {
                    let nodes: Vec<Value> = e.for_nodes.iter().map(|n| json!({"name": n})).collect();
                    endpoint["hints"] = json!({"forNodes": nodes});
                }
                endpoint
            })
            .collect();
        let slice_ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| json!({"name": p.name, "port": p.target_port, "protocol": p.proto.k8s()}))
            .collect();
        let slice = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{}-diff", self.name),
                "namespace": self.namespace,
                "labels": {"kubernetes.io/service-name": self.name},
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": slice_ports,
        });
        json!({"apiVersion": "v1", "kind": "List", "items": [service, slice]})
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ClusterSpec {
    pub services: Vec<ServiceSpec>,
}

impl ClusterSpec {
    pub fn service(&self, name: &str) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.name == name)
    }

    pub fn service_mut(&mut self, name: &str) -> Option<&mut ServiceSpec> {
        self.services.iter_mut().find(|s| s.name == name)
    }

    pub fn service_by_ip(&self, ip: Ipv4Addr) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.cluster_ip == ip)
    }

    pub fn service_by_load_balancer_ip(&self, ip: Ipv4Addr) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.load_balancer_ip == Some(ip))
    }

    /// One manifest file per Service (`<namespace>-<name>.json`: a List of the Service and its
    /// EndpointSlice), for `kproxy agent --manifests DIR`.
    pub fn manifest_files(&self) -> Vec<(String, String)> {
        self.services
            .iter()
            .map(|s| (format!("{}-{}.json", s.namespace, s.name), s.manifest().to_string()))
            .collect()
    }

    /// Every Service port with the endpoints kube-proxy would use, for the rule generators.
    pub fn kube_proxy_svcs(&self) -> Vec<Svc> {
        self.services
            .iter()
            .flat_map(|s| {
                let endpoints: Vec<Ipv4Addr> = s.used_endpoints().iter().map(|e| e.ip).collect();
                let no_local_endpoints = s.internal_local && endpoints.is_empty() && s.has_endpoints();
                s.ports.iter().map(move |p| Svc {
                    namespace: s.namespace.into(),
                    name: s.name.into(),
                    vip: s.cluster_ip,
                    port: p.port,
                    proto: p.proto.k8s(),
                    port_name: p.name,
                    target_port: p.target_port,
                    node_port: p.node_port,
                    load_balancer_ips: s.load_balancer_ip.into_iter().collect(),
                    source_ranges: s.source_ranges.iter().map(|r| (*r).to_owned()).collect(),
                    affinity_timeout: s.affinity_timeout,
                    endpoints: endpoints.clone(),
                    no_local_endpoints,
                })
            })
            .collect()
    }

    /// `(cluster IP, port, serving endpoint addresses)` of every UDP Service port: what
    /// kube-proxy's conntrack clean-up keeps entries for.
    pub fn serving_udp(&self) -> Vec<(Ipv4Addr, u16, Vec<Ipv4Addr>)> {
        self.services
            .iter()
            .flat_map(|s| {
                let serving: Vec<Ipv4Addr> = s.endpoints.iter().filter(|e| e.serving).map(|e| e.ip).collect();
                s.ports
                    .iter()
                    .filter(|p| p.proto == Proto::Udp)
                    .map(move |p| (s.cluster_ip, p.port, serving.clone()))
            })
            .collect()
    }
}
