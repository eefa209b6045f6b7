//! The cluster the fuzzer plays: one node with local pods, a peer node's pods behind the external
//! interface, external clients, and Services in a few configurations the run switches between.

use std::net::Ipv4Addr;

use kproxy::model::{BackendAddr, Desired, Frontend, FrontendKind, ServiceName};
use kproxy::net::Protocol;
use proxy_common::maps::DEFAULT_HAIRPIN_ADDR;

use super::frame::{TCP, UDP};

pub const NODE: [u8; 4] = [192, 168, 100, 10];
pub const PEER: [u8; 4] = [192, 168, 100, 11];
pub const EXTERNAL_CLIENTS: [[u8; 4]; 2] = [[192, 168, 100, 200], [192, 168, 100, 201]];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];
pub const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x11];
pub const POD_GATEWAY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

/// Local pods (behind the node's pod veths).
pub const C1: [u8; 4] = [10, 244, 0, 2];
pub const C2: [u8; 4] = [10, 244, 0, 3];
pub const W1: [u8; 4] = [10, 244, 0, 11];
pub const W2: [u8; 4] = [10, 244, 0, 12];
pub const W4: [u8; 4] = [10, 244, 0, 14];
pub const D1: [u8; 4] = [10, 244, 0, 21];
pub const D2: [u8; 4] = [10, 244, 0, 22];
pub const LOCAL_PODS: [[u8; 4]; 7] = [C1, C2, W1, W2, W4, D1, D2];
/// Pods on the peer node (behind the external interface).
pub const W3: [u8; 4] = [10, 244, 1, 13];
pub const D3: [u8; 4] = [10, 244, 1, 23];
pub const R1: [u8; 4] = [10, 244, 1, 30];
/// Routers that may send ICMP errors about packets on their way.
pub const ROUTERS: [[u8; 4]; 2] = [PEER, [10, 244, 1, 1]];

pub const WEB: [u8; 4] = [10, 96, 0, 100];
pub const WEB2: [u8; 4] = [10, 96, 0, 101];
pub const DNS: [u8; 4] = [10, 96, 0, 10];
pub const DNS2: [u8; 4] = [10, 96, 0, 11];
pub const EMPTY: [u8; 4] = [10, 96, 0, 200];
pub const HAIRPIN: [u8; 4] = DEFAULT_HAIRPIN_ADDR;

pub const SNAT_RANGE: (u16, u16) = (61000, 65535);

pub fn mac_of(addr: [u8; 4]) -> [u8; 6] {
    [0x02, 0x00, addr[0], addr[1], addr[2], addr[3]]
}

pub fn is_local_pod(a: [u8; 4]) -> bool {
    LOCAL_PODS.contains(&a)
}

pub fn is_remote_pod(a: [u8; 4]) -> bool {
    a[..3] == [10, 244, 1]
}

/// The node's `--cluster-cidr`, 10.244.0.0/16: every pod of both nodes.
pub const CLUSTER_CIDR: ([u8; 4], u8) = ([10, 244, 0, 0], 16);

/// Whether `a` is inside [`CLUSTER_CIDR`] (the datapath masquerades clients outside it reaching a
/// cluster IP from outside, as kube-proxy's local-traffic detector does).
pub fn in_cluster_cidr(a: [u8; 4]) -> bool {
    a[..2] == CLUSTER_CIDR.0[..2]
}

/// Addresses a node never answers a refusal to (RFC 1122): unspecified, loopback, multicast,
/// broadcast.
pub fn unanswerable(a: [u8; 4]) -> bool {
    a[0] == 0 || a[0] == 127 || (224..=239).contains(&a[0]) || a == [255; 4]
}

#[derive(Clone, Debug)]
pub struct Service {
    pub name: &'static str,
    pub addr: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub backends: Vec<([u8; 4], u16)>,
    pub node_port: bool,
}

/// What the Services are at some point of the run.
#[derive(Clone, Debug)]
pub struct Config {
    pub variant: usize,
    pub services: Vec<Service>,
}

pub const VARIANTS: [&str; 9] = [
    "all Services",
    "web without 10.244.0.12 (which leaves every Service)",
    "web without 10.244.0.11 (still a backend of web2 and the NodePort)",
    "dns/UDP without 10.244.0.22 (still a dns/TCP backend)",
    "web deleted (its cluster IP unknown)",
    "dns, dns/TCP and dns2 deleted",
    "web2's port 80 becomes 8000",
    "NodePorts down to one backend each (10.244.0.11, 10.244.1.23)",
    "empty gets a backend (10.244.0.14)",
];

impl Config {
    pub fn variant(variant: usize) -> Self {
        let svc = |name, addr, port, proto, backends: &[([u8; 4], u16)], node_port| Service {
            name,
            addr,
            port,
            proto,
            backends: backends.to_vec(),
            node_port,
        };
        let mut services = vec![
            svc("web", WEB, 80, TCP, &[(W1, 8080), (W2, 8080), (W3, 8080)], false),
            svc("web2", WEB2, 80, TCP, &[(W1, 8080), (W4, 8080)], false),
            svc("dns", DNS, 53, UDP, &[(D1, 53), (D2, 53), (D3, 53)], false),
            svc("dns-tcp", DNS, 53, TCP, &[(D1, 53), (D2, 53)], false),
            svc("dns2", DNS2, 53, UDP, &[(D1, 53)], false),
            svc("empty", EMPTY, 80, TCP, &[], false),
            svc("empty-udp", EMPTY, 53, UDP, &[], false),
            svc("np-web", NODE, 30080, TCP, &[(W1, 8080), (W3, 8080)], true),
            svc("np-dns", NODE, 30053, UDP, &[(D1, 53), (D3, 53)], true),
        ];
        let find = |services: &mut Vec<Service>, name: &str| -> usize {
            services.iter().position(|s| s.name == name).unwrap()
        };
        match variant {
            0 => {}
            1 => {
                let i = find(&mut services, "web");
                services[i].backends.retain(|b| b.0 != W2);
            }
            2 => {
                let i = find(&mut services, "web");
                services[i].backends.retain(|b| b.0 != W1);
            }
            3 => {
                let i = find(&mut services, "dns");
                services[i].backends.retain(|b| b.0 != D2);
            }
            4 => services.retain(|s| s.name != "web"),
            5 => services.retain(|s| !s.name.starts_with("dns")),
            6 => {
                let i = find(&mut services, "web2");
                services[i].port = 8000;
            }
            7 => {
                let i = find(&mut services, "np-web");
                services[i].backends.retain(|b| b.0 == W1);
                let i = find(&mut services, "np-dns");
                services[i].backends.retain(|b| b.0 == D3);
            }
            8 => {
                let i = find(&mut services, "empty");
                services[i].backends.push((W4, 8080));
            }
            _ => unreachable!(),
        }
        Self { variant, services }
    }

    pub fn desired(&self) -> Desired {
        Desired::new(
            self.services
                .iter()
                .map(|s| {
                    let mut fe = Frontend::new(
                        ServiceName { namespace: "default".into(), name: s.name.into() },
                        "p",
                        Ipv4Addr::from(s.addr),
                        s.port,
                        if s.proto == TCP { Protocol::Tcp } else { Protocol::Udp },
                        s.backends
                            .iter()
                            .map(|(a, p)| BackendAddr { addr: Ipv4Addr::from(*a).into(), port: *p })
                            .collect(),
                    );
                    if s.node_port {
                        fe.kind = FrontendKind::NodePort;
                    }
                    fe
                })
                .collect(),
        )
    }

    pub fn frontend(&self, addr: [u8; 4], port: u16, proto: u8) -> Option<&Service> {
        self.services.iter().find(|s| s.addr == addr && s.port == port && s.proto == proto)
    }

    /// A Service's cluster IP (on any port).
    pub fn is_cluster_ip(&self, addr: [u8; 4]) -> bool {
        self.services.iter().any(|s| s.addr == addr && !s.node_port)
    }

    /// Whether some Service still has this backend (address, port, protocol).
    pub fn backend_current(&self, addr: [u8; 4], port: u16, proto: u8) -> bool {
        self.services.iter().any(|s| s.proto == proto && s.backends.contains(&(addr, port)))
    }
}
