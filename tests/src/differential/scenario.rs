//! Scenarios: what one client does, step by step, written once and run against every proxy.
//!
//! A scenario is a list of [`Step`]s built with the methods of [`Scenario`]: sockets are named
//! (`"a"`, `"b"`), opened from a place ([`Place`]: the client pod by default, the node itself, or
//! another pod), and later steps use them by name. Destinations are symbolic ([`Dst`]): a
//! Service's cluster IP, or the pod that answered an earlier step (`server_of(k)`: "the backend
//! this connection landed on"), so the same scenario means the same thing whichever backend the
//! random choice picked. Source ports are symbolic too ([`Port::Nth`]): every scenario gets its
//! own block of ports, so one scenario's leftovers (conntrack entries, TIME_WAIT) never meet
//! another's, and `Port::Nth(0)` twice is the same port reused on purpose.
//!
//! Backend changes are steps as well ([`Change`]), applied to every proxy the same way and waited
//! for before the next step.
use std::net::Ipv4Addr;

use super::spec::Proto;

/// Where a socket lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// The client pod (10.244.0.2).
    Client,
    /// A process in the node's own network namespace (hostNetwork pods, kubelet).
    Node,
    /// Another pod, by name (e.g. a backend reaching itself through its Service: hairpin).
    Pod(&'static str),
}

/// A destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dst {
    /// The cluster IP of Service `name` (still its address after the Service is deleted), `port`.
    Service(&'static str, u16),
    /// The pod that answered step `k`, at its server port for the socket's protocol.
    ServerOf(usize),
    /// Pod `name`'s own address, `port`.
    Pod(&'static str, u16),
    /// The node's address, `port` (a NodePort).
    Node(u16),
    /// The load-balancer IP of Service `name`, `port`.
    LoadBalancer(&'static str, u16),
    /// Any address.
    Addr(Ipv4Addr, u16),
}

pub fn svc(name: &'static str, port: u16) -> Dst {
    Dst::Service(name, port)
}

pub fn server_of(step: usize) -> Dst {
    Dst::ServerOf(step)
}

pub fn pod(name: &'static str, port: u16) -> Dst {
    Dst::Pod(name, port)
}

/// NodePort `port` on the node's address.
pub fn node_port(port: u16) -> Dst {
    Dst::Node(port)
}

/// The load-balancer IP of Service `name`.
pub fn lb(name: &'static str, port: u16) -> Dst {
    Dst::LoadBalancer(name, port)
}

/// A pod named directly or as the answer of an earlier step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodRef {
    Named(&'static str),
    ServerOf(usize),
}

/// A client source port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Port {
    /// Whatever the kernel picks.
    Any,
    /// The scenario's `n`-th port (its own block; the same `n` is the same port).
    Nth(u16),
}

/// An endpoint's conditions in its EndpointSlice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// Not ready, not serving (a failing readiness probe).
pub const UNREADY: Conditions = Conditions { ready: false, serving: false, terminating: false };
/// Shutting down but still serving (graceful termination).
pub const TERMINATING: Conditions = Conditions { ready: false, serving: true, terminating: true };
pub const READY: Conditions = Conditions { ready: true, serving: true, terminating: false };

/// A backend change, applied to every proxy and waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Drop the pod from the Service's EndpointSlice (the pod keeps running and serving).
    RemoveEndpoint { service: &'static str, pod: PodRef },
    /// Add the pod to the Service's EndpointSlice, ready.
    AddEndpoint { service: &'static str, pod: PodRef },
    /// Set an endpoint's conditions.
    Conditions { service: &'static str, pod: PodRef, conditions: Conditions },
    /// Delete the Service and its EndpointSlice.
    DeleteService(&'static str),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// TCP connect from `port` (SO_REUSEADDR: a port may be shared with live sockets).
    TcpConnect {
        sock: &'static str,
        from: Place,
        dst: Dst,
        port: Port,
    },
    /// Send `hello`, read the server's answer: its pod name and the client address it saw.
    Hello {
        sock: &'static str,
    },
    /// Ask the server to close first (`close`): read its `bye`, its FIN, then close (so the
    /// client holds no TIME_WAIT; the server does).
    ServerClose {
        sock: &'static str,
    },
    /// Ask the server to abort the connection (RST).
    ServerReset {
        sock: &'static str,
    },
    /// Close first from the client (FIN), wait for the server's FIN (the client holds TIME_WAIT).
    ClientClose {
        sock: &'static str,
    },
    /// Abort from the client (SO_LINGER 0: RST).
    ClientReset {
        sock: &'static str,
    },
    /// A UDP socket bound to `port`, connected to `connect` when given.
    UdpOpen {
        sock: &'static str,
        from: Place,
        port: Port,
        connect: Option<Dst>,
    },
    /// A datagram of `size` bytes to the echo servers (to `to`, or the connected peer); the
    /// answer (same size) names the pod and the address it saw.
    UdpEcho {
        sock: &'static str,
        to: Option<Dst>,
        size: usize,
    },
    /// A DNS query (TXT `whoami.kproxy.test`, answered with the DNS pod's name) over UDP.
    Dns {
        sock: &'static str,
        to: Option<Dst>,
    },
    /// The same query over a connected TCP socket.
    TcpDns {
        sock: &'static str,
    },
    Change(Change),
}

impl Op {
    /// The socket a step uses, if any.
    pub fn sock(&self) -> Option<&'static str> {
        match self {
            Op::TcpConnect { sock, .. }
            | Op::Hello { sock }
            | Op::ServerClose { sock }
            | Op::ServerReset { sock }
            | Op::ClientClose { sock }
            | Op::ClientReset { sock }
            | Op::UdpOpen { sock, .. }
            | Op::UdpEcho { sock, .. }
            | Op::Dns { sock, .. }
            | Op::TcpDns { sock } => Some(sock),
            Op::Change(_) => None,
        }
    }

    /// The protocol of the socket a step opens.
    pub fn opens(&self) -> Option<Proto> {
        match self {
            Op::TcpConnect { .. } => Some(Proto::Tcp),
            Op::UdpOpen { .. } => Some(Proto::Udp),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub op: Op,
    /// Compare only that the answer came from one of the Service's current endpoints (for
    /// steps whose backend is a fresh random pick), not which one.
    pub any_backend: bool,
}

/// Which kube-proxy mode an allowed difference is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Oracle {
    Iptables,
    Nftables,
    Both,
}

/// A part of an [`super::Observation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Outcome,
    Server,
    Peer,
    /// The client address the server saw.
    Seen,
    Bytes,
}

/// A difference from an oracle that is explained (kproxy is right, or the oracle's behaviour is
/// an artefact of the sandbox): only `field` may differ at `step`; the reason is printed with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allowed {
    pub step: usize,
    pub oracle: Oracle,
    pub field: Field,
    pub why: &'static str,
}

#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub steps: Vec<Step>,
    pub allowed: Vec<Allowed>,
}

impl Scenario {
    pub fn new(name: &'static str, about: &'static str) -> Self {
        Self { name, about, steps: Vec::new(), allowed: Vec::new() }
    }

    fn push(mut self, op: Op) -> Self {
        self.steps.push(Step { op, any_backend: false });
        self
    }

    /// The index the next step will have (for `server_of` references while building).
    pub fn next_step(&self) -> usize {
        self.steps.len()
    }

    pub fn tcp(self, sock: &'static str, dst: Dst, port: Port) -> Self {
        self.push(Op::TcpConnect { sock, from: Place::Client, dst, port })
    }

    pub fn tcp_from(self, from: Place, sock: &'static str, dst: Dst, port: Port) -> Self {
        self.push(Op::TcpConnect { sock, from, dst, port })
    }

    pub fn hello(self, sock: &'static str) -> Self {
        self.push(Op::Hello { sock })
    }

    pub fn server_close(self, sock: &'static str) -> Self {
        self.push(Op::ServerClose { sock })
    }

    pub fn server_reset(self, sock: &'static str) -> Self {
        self.push(Op::ServerReset { sock })
    }

    pub fn client_close(self, sock: &'static str) -> Self {
        self.push(Op::ClientClose { sock })
    }

    pub fn client_reset(self, sock: &'static str) -> Self {
        self.push(Op::ClientReset { sock })
    }

    pub fn udp(self, sock: &'static str, port: Port) -> Self {
        self.push(Op::UdpOpen { sock, from: Place::Client, port, connect: None })
    }

    pub fn udp_from(self, from: Place, sock: &'static str, port: Port) -> Self {
        self.push(Op::UdpOpen { sock, from, port, connect: None })
    }

    pub fn udp_connected(self, sock: &'static str, port: Port, dst: Dst) -> Self {
        self.push(Op::UdpOpen { sock, from: Place::Client, port, connect: Some(dst) })
    }

    pub fn echo(self, sock: &'static str, to: Dst, size: usize) -> Self {
        self.push(Op::UdpEcho { sock, to: Some(to), size })
    }

    /// An echo datagram on a connected UDP socket.
    pub fn echo_connected(self, sock: &'static str, size: usize) -> Self {
        self.push(Op::UdpEcho { sock, to: None, size })
    }

    pub fn dns(self, sock: &'static str, to: Dst) -> Self {
        self.push(Op::Dns { sock, to: Some(to) })
    }

    pub fn tcp_dns(self, sock: &'static str) -> Self {
        self.push(Op::TcpDns { sock })
    }

    pub fn change(self, change: Change) -> Self {
        self.push(Op::Change(change))
    }

    /// The last step's answer is compared as "one of the Service's endpoints", not by identity.
    pub fn any_backend(mut self) -> Self {
        self.steps.last_mut().expect("any_backend() after a step").any_backend = true;
        self
    }

    /// Allows `field` of `step` to differ from `oracle`, for the reason given.
    pub fn allow(mut self, step: usize, oracle: Oracle, field: Field, why: &'static str) -> Self {
        assert!(step < self.steps.len(), "{}: allow() for step {step}, which does not exist", self.name);
        self.allowed.push(Allowed { step, oracle, field, why });
        self
    }

    /// The explanations given for differences from `oracle` at `step`.
    pub fn allowances(&self, step: usize, oracle: Oracle) -> impl Iterator<Item = &Allowed> {
        self.allowed
            .iter()
            .filter(move |a| a.step == step && (a.oracle == oracle || a.oracle == Oracle::Both))
    }
}
