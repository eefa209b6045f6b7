//! Which endpoints topology chose for each Service port, told to the operator: a log line when a
//! Service port's choice changes (narrowed to this node's hinted endpoints, to this zone's, or back
//! to all of them), and the `kproxy_topology_service_ports` gauge. kube-proxy logs its topology
//! decisions only at high verbosity (`pkg/proxy/topology.go`); an operator who turned on
//! `trafficDistribution` and sees traffic stay on one pod wants to see why without raising it.

use std::collections::BTreeMap;

use crate::model::{Frontend, Scope, ServiceName, Topology};
use crate::net::Protocol;

/// A Service port of one family, as one selection: frontends of the same Service port, family and
/// scope (cluster IP, node ports, external and load-balancer IPs) share their endpoints.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ServicePort {
    service: ServiceName,
    port_name: String,
    proto: Protocol,
    ipv6: bool,
    scope: Scope,
}

/// The rule that chose a Service port's endpoints, and how many it chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Choice {
    topology: Topology,
    chosen: usize,
}

/// The Service ports topology narrowed, as last told (ports with every endpoint are not kept).
#[derive(Debug, Default)]
pub(super) struct TopologyChoices {
    last: BTreeMap<ServicePort, Choice>,
}

/// One Service port whose rule changed.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct TopologyChange {
    pub service: String,
    pub port: String,
    pub protocol: Protocol,
    pub ip_family: &'static str,
    pub scope: Scope,
    pub before: Topology,
    pub after: Topology,
    /// Endpoints the new rule chose.
    pub chosen: usize,
}

/// Service ports whose endpoints topology narrowed, per family (IPv4, IPv6): `(same zone, same node)`.
pub(crate) type NarrowedPorts = [(u64, u64); 2];

impl TopologyChoices {
    /// Takes the frontends just programmed; returns the Service ports whose rule changed since the
    /// last call (a port that appears narrowed counts as a change from `all`, one that goes away
    /// while narrowed as a change back) and the gauge's counts.
    pub(super) fn observe(&mut self, frontends: &[Frontend]) -> (Vec<TopologyChange>, NarrowedPorts) {
        // Only narrowed ports are kept: most Services have no hints, and this runs on every sync.
        let now = narrowed_choices(frontends);
        let mut changes = Vec::new();
        for (port, choice) in &now {
            let before = self.last.get(port).map_or(Topology::All, |c| c.topology);
            if before != choice.topology {
                changes.push(change(port, before, *choice));
            }
        }
        for (port, choice) in &self.last {
            if !now.contains_key(port) {
                // Back to every endpoint, or gone (none chosen).
                let chosen = frontends.iter().find(|f| port.is_of(f)).map_or(0, |f| f.backends.len());
                changes.push(change(port, choice.topology, Choice { topology: Topology::All, chosen }));
            }
        }
        let mut narrowed: NarrowedPorts = [(0, 0); 2];
        for (port, choice) in &now {
            let family = &mut narrowed[usize::from(port.ipv6)];
            match choice.topology {
                Topology::All => {}
                Topology::SameZone => family.0 += 1,
                Topology::SameNode => family.1 += 1,
            }
        }
        self.last = now;
        (changes, narrowed)
    }
}

impl ServicePort {
    fn of(frontend: &Frontend) -> Self {
        ServicePort {
            service: frontend.service.clone(),
            port_name: frontend.port_name.clone(),
            proto: frontend.proto,
            ipv6: frontend.vip.is_ipv6(),
            scope: frontend.scope,
        }
    }

    fn is_of(&self, frontend: &Frontend) -> bool {
        self.service == frontend.service
            && self.port_name == frontend.port_name
            && self.proto == frontend.proto
            && self.ipv6 == frontend.vip.is_ipv6()
            && self.scope == frontend.scope
    }
}

/// The Service ports topology narrowed (one entry per port: its frontends share the choice).
fn narrowed_choices(frontends: &[Frontend]) -> BTreeMap<ServicePort, Choice> {
    let mut out = BTreeMap::new();
    for frontend in frontends.iter().filter(|f| f.topology != Topology::All) {
        out.entry(ServicePort::of(frontend))
            .or_insert(Choice { topology: frontend.topology, chosen: frontend.backends.len() });
    }
    out
}

fn change(port: &ServicePort, before: Topology, after: Choice) -> TopologyChange {
    TopologyChange {
        service: format!("{}/{}", port.service.namespace, port.service.name),
        port: port.port_name.clone(),
        protocol: port.proto,
        ip_family: family_name(port.ipv6),
        scope: port.scope,
        before,
        after: after.topology,
        chosen: after.chosen,
    }
}

fn family_name(ipv6: bool) -> &'static str {
    if ipv6 { "IPv6" } else { "IPv4" }
}

/// Why the rule chose what it chose, in the words of kube-proxy's `topologyModeFromHints`.
fn reason(topology: Topology) -> &'static str {
    match topology {
        Topology::SameNode => "every ready endpoint has hints.forNodes and some are for this node",
        Topology::SameZone => "every ready endpoint has hints.forZones and some are for this node's zone",
        Topology::All => {
            "hints are absent, missing on some ready endpoint, or name no endpoint for this node or zone \
             (or the Service port is gone)"
        }
    }
}

impl TopologyChange {
    pub(super) fn log(&self) {
        let scope = match self.scope {
            Scope::Internal => "internal",
            Scope::External => "external",
        };
        tracing::info!(
            service = %self.service,
            port = %self.port,
            protocol = ?self.protocol,
            ip_family = self.ip_family,
            traffic = scope,
            before = %self.before,
            topology = %self.after,
            endpoints_chosen = self.chosen,
            reason = reason(self.after),
            "topology chose this Service port's endpoints"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    use crate::model::BackendAddr;

    fn frontend(name: &str, vip: &str, topology: Topology, backends: usize) -> Frontend {
        let vip: IpAddr = vip.parse().unwrap();
        let backends = (0..backends)
            .map(|i| BackendAddr { addr: format!("10.244.0.{}", 10 + i).parse().unwrap(), port: 80 })
            .collect();
        let service = ServiceName { namespace: "default".into(), name: name.into() };
        let mut f = Frontend::new(service, "http", vip, 80, Protocol::Tcp, backends);
        f.topology = topology;
        f
    }

    #[test]
    fn a_narrowed_port_is_told_once_and_counted_per_family_and_rule() {
        let mut choices = TopologyChoices::default();
        let first = [
            frontend("web", "10.96.0.10", Topology::SameNode, 1),
            frontend("web", "fd00::10", Topology::SameZone, 2),
            frontend("db", "10.96.0.11", Topology::All, 3),
        ];
        let (changes, narrowed) = choices.observe(&first);
        assert_eq!(narrowed, [(0, 1), (1, 0)]);
        let told: Vec<_> =
            changes.iter().map(|c| (c.service.as_str(), c.ip_family, c.after, c.chosen)).collect();
        assert_eq!(
            told,
            [("default/web", "IPv4", Topology::SameNode, 1), ("default/web", "IPv6", Topology::SameZone, 2)]
        );
        // The same choices again: nothing to tell.
        assert!(choices.observe(&first).0.is_empty());

        // The IPv4 port falls back to every endpoint; the IPv6 one goes away while narrowed.
        let (changes, narrowed) = choices.observe(&[frontend("web", "10.96.0.10", Topology::All, 3)]);
        assert_eq!(narrowed, [(0, 0), (0, 0)]);
        let told: Vec<_> = changes.iter().map(|c| (c.ip_family, c.before, c.after, c.chosen)).collect();
        assert_eq!(
            told,
            [("IPv4", Topology::SameNode, Topology::All, 3), ("IPv6", Topology::SameZone, Topology::All, 0)]
        );
    }
}
