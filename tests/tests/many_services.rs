//! No 64k ceiling (issue 18): the agent itself programs 100,000 Services, each with a NodePort, from
//! manifests — over 200,000 frontends (a cluster IP and a NodePort on the node address per
//! Service), every one under a rev-NAT id of its own, most of them past 65,535 — and clients reach
//! the last of them through the cluster IP and the NodePort. Needs root.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use common::cluster::{CLIENT_IP, Cluster, Mode, WEB_PODS};
use kproxy::bpf::{Maps, PinDir};
use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL, SVC_FLAG_EXTERNAL_ADDR, ServiceKeyV4};
use sandbox::NODE_IP;
use serde_json::{Value, json};

const SERVICES: u32 = 100_000;
/// Services per manifest file: about 1.2 MB each.
const PER_FILE: u32 = 2_000;
/// Every entry of the services maps: 2 per frontend here (slot 0 and one backend).
const LB_MAP_MAX: &str = "524288";

/// Service `i`: cluster IP 10.100.0.1 + i, port 80 to the web pods' nginx (one of them, in turn), and
/// a NodePort. NodePorts are unique per protocol, so some are UDP and the rest TCP, over 1024-60999
/// (below the SNAT range) without the agent's own ports.
struct Many {
    vip: Ipv4Addr,
    proto: &'static str,
    node_port: u16,
    endpoint: Ipv4Addr,
}

fn node_ports() -> Vec<u16> {
    (1024..=60999).filter(|p| ![10249, 10256].contains(p)).collect()
}

fn many(i: u32, ports: &[u16]) -> Many {
    // UDP first: the last Services, whose ids are the highest, are TCP for curl.
    let udp = SERVICES as usize - ports.len();
    let (proto, node_port) = match (i as usize).checked_sub(udp) {
        Some(tcp) => ("TCP", ports[tcp]),
        None => ("UDP", ports[i as usize]),
    };
    Many {
        vip: Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 1)) + i),
        proto,
        node_port,
        endpoint: WEB_PODS[i as usize % WEB_PODS.len()].1,
    }
}

/// Services `range` and their slices as one `kind: List` (the agent reads files of up to 4 MiB).
fn manifests(ports: &[u16], range: std::ops::Range<u32>) -> String {
    let mut items = Vec::with_capacity(2 * range.len());
    for i in range {
        let svc = many(i, ports);
        let name = format!("svc-{i:06}");
        items.push(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "many"},
            "spec": {
                "type": "NodePort",
                "clusterIP": svc.vip.to_string(), "clusterIPs": [svc.vip.to_string()],
                "ports": [{"name": "http", "port": 80, "protocol": svc.proto, "targetPort": 80, "nodePort": svc.node_port}],
            },
        }));
        items.push(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{name}-1"), "namespace": "many", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [svc.endpoint.to_string()], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 80, "protocol": svc.proto}],
        }));
    }
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

fn key(vip: Ipv4Addr, port: u16, proto: &str) -> ServiceKeyV4 {
    let proto = if proto == "TCP" { IPPROTO_TCP } else { IPPROTO_UDP };
    ServiceKeyV4::new(vip.octets(), port.to_be_bytes(), proto, SCOPE_INTERNAL, 0)
}

#[test]
fn the_agent_programs_100k_services_with_node_ports_each_frontend_under_its_own_rev_nat_id() {
    let ports = node_ports();
    let mut cluster = Cluster::prepared("many", Mode::Files);
    for chunk in 0..SERVICES.div_ceil(PER_FILE) {
        let range = chunk * PER_FILE..((chunk + 1) * PER_FILE).min(SERVICES);
        std::fs::write(cluster.manifests.join(format!("many-{chunk:03}.json")), manifests(&ports, range))
            .unwrap();
    }
    cluster.extra_agent_args =
        vec!["--bpf-lb-map-max".into(), LB_MAP_MAX.into(), "--socket-lb".into(), "off".into()];
    let started = Instant::now();
    cluster.start_agent();

    // Programmed when REV_NAT_V4 holds every frontend: the example's three and two per Service.
    let frontends = 2 * SERVICES as usize + 3;
    let pins = PinDir::new(&cluster.pin_dir);
    let deadline = Instant::now() + Duration::from_secs(300);
    let maps = loop {
        if pins.is_loaded()
            && let Ok(maps) = Maps::from_pins(&pins)
            && maps.rev_nat.keys().count() >= frontends
        {
            break maps;
        }
        let agent = cluster.agent.as_ref().unwrap();
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(Instant::now() < deadline, "100k Services not programmed:\n{}", agent.log());
        std::thread::sleep(Duration::from_secs(1));
    };
    let programmed = started.elapsed();

    // Every Service's cluster IP and NodePort frontend, each with an id no other frontend has,
    // and REV_NAT_V4 and the names map under that id.
    let mut ids: BTreeMap<u32, ServiceKeyV4> = BTreeMap::new();
    let mut slot0 = 0usize;
    for entry in maps.services.iter() {
        let (k, v) = entry.unwrap();
        if k.slot != 0 {
            continue;
        }
        slot0 += 1;
        assert!(v.rev_nat_id != 0, "{k:?} has no rev-NAT id");
        if let Some(other) = ids.insert(v.rev_nat_id, k) {
            panic!("rev-NAT id {} is both {other:?}'s and {k:?}'s", v.rev_nat_id);
        }
    }
    assert_eq!(slot0, frontends, "frontends in the services map");
    let above_u16 = ids.keys().filter(|id| **id > u32::from(u16::MAX)).count();
    assert!(above_u16 >= frontends - usize::from(u16::MAX), "{above_u16} ids above 65,535");
    for i in (0..SERVICES).step_by(997).chain([SERVICES - 1]) {
        let svc = many(i, &ports);
        let name = format!("many/svc-{i:06}:http");
        for (k, external) in
            [(key(svc.vip, 80, svc.proto), false), (key(NODE_IP, svc.node_port, svc.proto), true)]
        {
            let master = maps.services.get(&k, 0).unwrap_or_else(|e| panic!("{name} {k:?}: {e}"));
            assert_eq!(master.count, 1, "{name}");
            assert_eq!(master.flags & SVC_FLAG_EXTERNAL_ADDR != 0, external, "{name} {k:?}");
            let rev = maps.rev_nat.get(&master.rev_nat_id, 0).unwrap();
            assert_eq!((rev.vip, rev.port, rev.proto), (k.vip, k.port, k.proto), "{name}");
            assert_eq!(maps.names.get(&master.rev_nat_id, 0).unwrap().as_str(), name);
        }
    }
    let distinct: BTreeSet<u32> = ids.keys().copied().collect();
    let syncs: Vec<String> = cluster
        .agent_log()
        .lines()
        .filter(|l| l.contains("synced"))
        .map(|l| l.split_once("synced").map_or(l, |(_, rest)| rest).to_owned())
        .collect();
    eprintln!(
        "100k Services with NodePorts from manifests: {slot0} frontends programmed by the agent {programmed:.1?} \
         after its start (ids 1..={}, {above_u16} above 65,535); the agent's syncs:\n{}",
        distinct.last().unwrap(),
        syncs.join("\n")
    );

    // Clients reach the last Service (ids past 65,535) through its cluster IP and its NodePort, and
    // the dump names the flow's Service through that id.
    let i = SERVICES - 1;
    let svc = many(i, &ports);
    assert_eq!(svc.proto, "TCP");
    for k in [key(svc.vip, 80, "TCP"), key(NODE_IP, svc.node_port, "TCP")] {
        let id = maps.services.get(&k, 0).unwrap().rev_nat_id;
        assert!(id > u32::from(u16::MAX), "Service {i} has id {id}");
    }
    let backend_name = WEB_PODS.iter().find(|(_, ip)| *ip == svc.endpoint).unwrap().0;
    let body = cluster.client.curl(&format!("http://{}/", svc.vip)).unwrap();
    assert_eq!(body.trim(), backend_name, "through the cluster IP");
    let body = cluster.client.curl(&format!("http://{NODE_IP}:{}/", svc.node_port)).unwrap();
    assert_eq!(body.trim(), backend_name, "through the NodePort");
    let ct = cluster.dump_json("conntrack");
    let named: Vec<&Value> = ct
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["original"].as_str().is_some_and(|o| o.starts_with(&format!("{CLIENT_IP}:"))))
        .filter(|r| r["service"] == format!("many/svc-{i:06}:http"))
        .collect();
    assert!(named.len() >= 2, "flows named by their Service: {ct}");
}
