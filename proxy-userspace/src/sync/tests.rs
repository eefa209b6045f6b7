use super::image::*;
use super::*;
use crate::model::ServiceName;
use crate::model::{BackendAddr, Desired, Frontend};
use crate::net::Protocol;
use std::net::Ipv4Addr;

type FakeStore = crate::sync::mem_store::MemStore;

const VIP: [u8; 4] = [10, 96, 0, 100];

fn be(addr: [u8; 4], port: u16) -> BackendAddr {
    BackendAddr { addr: Ipv4Addr::from(addr).into(), port }
}

fn web(port: u16, proto: Protocol, active: &[u8], terminating: &[u8]) -> Frontend {
    let mut fe = Frontend::new(
        ServiceName { namespace: "default".into(), name: "web".into() },
        format!("p{port}"),
        Ipv4Addr::from(VIP),
        port,
        proto,
        active.iter().map(|last| be([10, 244, 0, *last], 8080)).collect(),
    );
    fe.terminating_backends = terminating.iter().map(|last| be([10, 244, 0, *last], 8080)).collect();
    fe
}

fn slot0(store: &FakeStore, port: u16, proto: Protocol) -> ServiceValueV4 {
    store.services[&(VIP, port, proto.number(), SCOPE_INTERNAL, 0)]
}

fn slot_backends(store: &FakeStore, port: u16, proto: Protocol) -> Vec<[u8; 4]> {
    let master = slot0(store, port, proto);
    (1..=master.count + master.terminating_count)
        .map(|s| {
            store.backends[&store.services[&(VIP, port, proto.number(), SCOPE_INTERNAL, s)].backend_id].addr
        })
        .collect()
}

fn flags_of(store: &FakeStore, last: u8) -> u8 {
    store.backends.values().find(|b| b.addr == [10, 244, 0, last]).expect("backend present").flags
}

fn id_of(store: &FakeStore, last: u8) -> u32 {
    *store.backends.iter().find(|(_, b)| b.addr == [10, 244, 0, last]).unwrap().0
}

fn position(log: &[String], entry: &str) -> usize {
    log.iter().position(|l| l == entry).unwrap_or_else(|| panic!("{entry:?} not in {log:#?}"))
}

#[test]
fn terminating_backends_get_slots_after_the_count_and_their_flag() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[3])]));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.backends_added, 3);
    let store = syncer.store();
    let master = slot0(store, 80, Protocol::Tcp);
    assert_eq!((master.count, master.terminating_count), (2, 1));
    assert_eq!(slot_backends(store, 80, Protocol::Tcp), [[10, 244, 0, 1], [10, 244, 0, 2], [10, 244, 0, 3]]);
    assert_eq!(flags_of(store, 1), BACKEND_FLAG_ACTIVE);
    assert_eq!(flags_of(store, 3), BACKEND_FLAG_TERMINATING);
    assert_eq!(store.vips[&VIP].frontends, 1);
    // The VIP entry exists before slot 0 of its first frontend.
    assert!(
        position(&store.log, "put vip 10.96.0.100 1") < position(&store.log, "put slot 10.96.0.100:80#0")
    );

    // A restarted agent adopts the terminating slots: nothing is rewritten.
    let store = std::mem::take(&mut syncer.store);
    let mut syncer = Syncer::with_store(FakeStore { log: vec![], ..store }).unwrap();
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[3])]));
    assert!(!report.changed(), "{report:?}");
    assert!(syncer.store().log.is_empty(), "{:?}", syncer.store().log);
    assert_eq!(syncer.backend_count(), 3);
}

#[test]
fn a_backend_changing_state_keeps_its_id_and_flips_its_flag_in_place() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[])]));
    let id2 = id_of(syncer.store(), 2);

    // Pod .2 starts terminating: it leaves the active slots, stays as a terminating one.
    syncer.store.log.clear();
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[2])]));
    assert_eq!((report.backends_added, report.backends_removed, report.backends_updated), (0, 0, 1));
    assert!(report.removed_backends.is_empty());
    let store = syncer.store();
    assert_eq!(id_of(store, 2), id2);
    assert_eq!(flags_of(store, 2), BACKEND_FLAG_TERMINATING);
    let master = slot0(store, 80, Protocol::Tcp);
    assert_eq!((master.count, master.terminating_count), (1, 1));
    // Flag goes terminating only after slot 0 no longer counts it as active.
    let flip = position(&store.log, &format!("put backend {id2} flags {BACKEND_FLAG_TERMINATING}"));
    assert!(position(&store.log, "put slot 10.96.0.100:80#0") < flip, "{:#?}", store.log);

    // ... and back (readiness restored): active before any slot names it for new flows.
    syncer.store.log.clear();
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[])]));
    assert_eq!(report.backends_updated, 1);
    let store = syncer.store();
    assert_eq!(id_of(store, 2), id2);
    assert_eq!(flags_of(store, 2), BACKEND_FLAG_ACTIVE);
    let flip = position(&store.log, &format!("put backend {id2} flags {BACKEND_FLAG_ACTIVE}"));
    assert!(flip < position(&store.log, "put slot 10.96.0.100:80#0"), "{:#?}", store.log);
    assert_eq!(slot0(store, 80, Protocol::Tcp).terminating_count, 0);
    assert_eq!(store.services.len(), 3, "no slot above the total is left");
}

#[test]
fn active_wins_when_two_frontends_disagree_about_a_backend() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let a = web(80, Protocol::Tcp, &[1], &[2]);
    let b = web(81, Protocol::Tcp, &[2], &[]);
    let report = syncer.apply(&Desired::new(vec![a, b]));
    assert!(report.errors.is_empty());
    assert_eq!(syncer.backend_count(), 2);
    assert_eq!(flags_of(syncer.store(), 2), BACKEND_FLAG_ACTIVE);
    assert_eq!(syncer.store().vips[&VIP].frontends, 2);
}

#[test]
fn removed_backends_are_reported_with_their_protocol() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    syncer
        .apply(&Desired::new(vec![web(53, Protocol::Udp, &[1, 2], &[]), web(80, Protocol::Tcp, &[1], &[3])]));
    let udp2 = *syncer.backends.get(&(be([10, 244, 0, 2], 8080), Protocol::Udp)).map(|b| &b.id).unwrap();
    let tcp3 = *syncer.backends.get(&(be([10, 244, 0, 3], 8080), Protocol::Tcp)).map(|b| &b.id).unwrap();
    // .2 is deleted; .3 finished terminating and disappears.
    let report = syncer
        .apply(&Desired::new(vec![web(53, Protocol::Udp, &[1], &[]), web(80, Protocol::Tcp, &[1], &[])]));
    let mut removed = report.removed_backends.clone();
    removed.sort();
    let mut expected = vec![(udp2, Protocol::Udp), (tcp3, Protocol::Tcp)];
    expected.sort();
    assert_eq!(removed, expected);
    assert_eq!(report.backends_removed, 2);
    // A terminating backend stays referenced (not an orphan) while listed.
    let report = syncer
        .apply(&Desired::new(vec![web(53, Protocol::Udp, &[], &[1]), web(80, Protocol::Tcp, &[1], &[])]));
    assert!(report.removed_backends.is_empty(), "{report:?}");
}

#[test]
fn vips_count_frontends_and_go_after_the_last_one() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[]), web(80, Protocol::Udp, &[], &[])]));
    assert_eq!(syncer.store().vips[&VIP].frontends, 2);
    syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
    assert_eq!(syncer.store().vips[&VIP].frontends, 1);

    syncer.store.log.clear();
    syncer.apply(&Desired::new(vec![]));
    let store = syncer.store();
    assert!(store.vips.is_empty());
    assert!(position(&store.log, "del slot 10.96.0.100:80#0") < position(&store.log, "del vip 10.96.0.100"));
    assert!(store.services.is_empty() && store.backends.is_empty() && store.rev_nat.is_empty());

    // Drift is repaired by a reload: a VIP entry removed behind our back comes back.
    syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
    syncer.store.vips.clear();
    syncer.reload().unwrap();
    syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
    assert_eq!(syncer.store().vips[&VIP].frontends, 1);
}

#[test]
fn every_frontend_address_has_a_vip_entry_and_north_south_ones_are_told_apart() {
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let cluster_ip = web(80, Protocol::Tcp, &[1], &[]);
    let mut node_port = web(80, Protocol::Tcp, &[1], &[]);
    node_port.kind = FrontendKind::NodePort;
    node_port.vip = Ipv4Addr::new(192, 168, 1, 5).into();
    node_port.port = 30080;
    let mut external_ip = web(80, Protocol::Tcp, &[1], &[]);
    external_ip.kind = FrontendKind::ExternalIp;
    external_ip.vip = Ipv4Addr::new(203, 0, 113, 7).into();
    syncer.apply(&Desired::new(vec![cluster_ip.clone(), node_port.clone(), external_ip]));
    let store = syncer.store();
    assert_eq!(store.vips[&VIP], VipV4::new(1, false));
    assert_eq!(store.vips[&[192, 168, 1, 5]], VipV4::new(0, true), "a node address: looked up, not refused");
    assert_eq!(store.vips[&[203, 0, 113, 7]], VipV4::new(0, true));
    // The datapath looks up frontends only on addresses it has an entry for: the entry first.
    assert!(
        position(&store.log, &format!("put vip 192.168.1.5 {}", VipV4::NORTH_SOUTH))
            < position(&store.log, "put slot 192.168.1.5:30080#0")
    );

    syncer.store.log.clear();
    syncer.apply(&Desired::new(vec![cluster_ip]));
    let store = syncer.store();
    assert!(!store.vips.contains_key(&[192, 168, 1, 5]) && !store.vips.contains_key(&[203, 0, 113, 7]));
    assert!(
        position(&store.log, "del slot 192.168.1.5:30080#0") < position(&store.log, "del vip 192.168.1.5")
    );
    assert_eq!(store.vips[&VIP], VipV4::new(1, false));
}

#[test]
fn a_frontend_that_cannot_be_written_leaves_no_vip_behind() {
    let store = FakeStore { backend_capacity: Some(0), ..Default::default() };
    let mut syncer = Syncer::with_store(store).unwrap();
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert!(
        matches!(&report.errors[0], SyncError::FrontendNotProgrammed { service, port: 80, .. } if service.to_string() == "default/web"),
        "{:?}",
        report.errors[0]
    );
    assert!(syncer.store().vips.is_empty());
    assert_eq!(syncer.frontend_count(), 0);
}

#[test]
fn slot_layout_and_flags() {
    let slots = slot_layout(&[7, 8], &[9], 3, SVC_FLAG_AFFINITY, 60).unwrap();
    assert_eq!(slots.len(), 4);
    assert_eq!(slots[0].1.count, 2);
    assert_eq!(slots[0].1.terminating_count, 1);
    assert_eq!(slots[0].1.affinity_timeout_s, 60);
    assert_eq!(
        slots.iter().skip(1).map(|(s, v)| (*s, v.backend_id)).collect::<Vec<_>>(),
        [(1, 7), (2, 8), (3, 9)]
    );
    assert!(slots.iter().all(|(_, v)| v.rev_nat_id == 3));
    assert!(slot_layout(&vec![1; 40_000], &vec![2; 30_000], 1, 0, 0).is_err());

    let mut fe = web(80, Protocol::Tcp, &[1], &[]);
    assert_eq!(frontend_flags(&fe), 0);
    fe.session_affinity_timeout = Some(10);
    fe.local_only = true;
    fe.terminating_fallback = true;
    assert_eq!(frontend_flags(&fe), SVC_FLAG_AFFINITY | SVC_FLAG_LOCAL_ONLY | SVC_FLAG_TERMINATING_FALLBACK);
}

/// sessionAffinity is kept per Service port (kube-proxy's affinity sets): every frontend of the port names the
/// cluster IP frontend's rev-NAT id, the cluster IP its own (0); without affinity none is named.
#[test]
fn a_service_ports_frontends_share_the_cluster_ips_affinity_id() {
    let external = [192, 168, 100, 50];
    let frontend = |vip: [u8; 4], kind: FrontendKind, affinity: Option<u32>| {
        let mut fe = web(80, Protocol::Tcp, &[1, 2], &[]);
        fe.vip = Ipv4Addr::from(vip).into();
        fe.kind = kind;
        fe.session_affinity_timeout = affinity;
        fe
    };
    // The external IP sorts before the cluster IP, so it would be applied first in address order.
    let external_ip = frontend(external, FrontendKind::ExternalIp, Some(60));
    let mut external_local = external_ip.clone();
    external_local.scope = crate::model::Scope::External;
    external_local.external_local = true;
    let desired = Desired::new(vec![
        frontend(VIP, FrontendKind::ClusterIp, Some(60)),
        external_ip.clone(),
        external_local,
    ]);
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let report = syncer.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let store = syncer.store();
    let cluster_ip = slot0(store, 80, Protocol::Tcp);
    assert_eq!(cluster_ip.named_affinity_id(), 0);
    for scope in [SCOPE_INTERNAL, SCOPE_EXTERNAL] {
        let master = store.services[&(external, 80, Protocol::Tcp.number(), scope, 0)];
        assert_ne!(master.rev_nat_id, cluster_ip.rev_nat_id);
        assert_eq!(master.affinity_id(), cluster_ip.rev_nat_id, "scope {scope}");
        assert_eq!(master.maglev_table(), None);
    }

    // A restarted agent reads the ids back and rewrites nothing.
    let mut restarted = Syncer::with_store(syncer.store().clone()).unwrap();
    let again = restarted.apply(&desired);
    assert_eq!((again.frontends_added, again.frontends_updated), (0, 0), "{again:?}");

    // Affinity turned off: the external IP keys by nothing but its own id again.
    let plain = Desired::new(vec![
        frontend(VIP, FrontendKind::ClusterIp, None),
        frontend(external, FrontendKind::ExternalIp, None),
    ]);
    restarted.apply(&plain);
    let master = restarted.store().services[&(external, 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)];
    assert_eq!((master.named_affinity_id(), master.backend_id), (0, 0));
}

/// Per family, as kube-proxy's affinity lives in each family's proxier: a dual-stack Service's IPv4 external
/// IP names the IPv4 cluster IP's id and its IPv6 external IP the IPv6 one's, whichever comes first.
#[test]
fn a_dual_stack_service_ports_frontends_share_the_affinity_id_of_their_own_familys_cluster_ip() {
    let frontend = |vip: std::net::IpAddr, kind: FrontendKind| {
        let mut fe = web(80, Protocol::Tcp, &[1, 2], &[]);
        (fe.vip, fe.kind, fe.session_affinity_timeout) = (vip, kind, Some(60));
        fe
    };
    let (v4_cluster, v4_external): (std::net::IpAddr, std::net::IpAddr) =
        (Ipv4Addr::from(VIP).into(), Ipv4Addr::new(192, 168, 100, 50).into());
    let (v6_cluster, v6_external): (std::net::IpAddr, std::net::IpAddr) =
        ("fd00:10:96::64".parse().unwrap(), "2001:db8::50".parse().unwrap());
    let desired = Desired::new(vec![
        frontend(v4_cluster, FrontendKind::ClusterIp),
        frontend(v4_external, FrontendKind::ExternalIp),
        frontend(v6_cluster, FrontendKind::ClusterIp),
        frontend(v6_external, FrontendKind::ExternalIp),
    ]);
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let report = syncer.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let store = syncer.store();
    let v4 = |addr: std::net::IpAddr| {
        let std::net::IpAddr::V4(a) = addr else { unreachable!() };
        store.services[&(a.octets(), 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)]
    };
    let v6 = |addr: std::net::IpAddr| {
        let std::net::IpAddr::V6(a) = addr else { unreachable!() };
        store.services6[&(a.octets(), 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)]
    };
    assert_eq!(v4(v4_external).affinity_id(), v4(v4_cluster).rev_nat_id, "IPv4 external IP");
    assert_eq!(v6(v6_external).affinity_id(), v6(v6_cluster).rev_nat_id, "IPv6 external IP");
}

#[test]
fn a_dual_stack_service_programs_each_family_in_its_own_maps_under_shared_ids() {
    let v6_vip: std::net::Ipv6Addr = "fd00:10:96::64".parse().unwrap();
    let v6_backend = BackendAddr { addr: "fd00:10:244::1".parse().unwrap(), port: 8080 };
    let mut v6 = web(80, Protocol::Tcp, &[], &[]);
    v6.vip = v6_vip.into();
    v6.backends = vec![v6_backend];
    let desired = Desired::new(vec![web(80, Protocol::Tcp, &[1], &[]), v6.clone()]);
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let report = syncer.apply(&desired);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let store = syncer.store();
    let slot0_v6 = store.services6[&(v6_vip.octets(), 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)];
    let slot1_v6 = store.services6[&(v6_vip.octets(), 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 1)];
    assert_eq!(slot0_v6.count, 1);
    assert_eq!(
        store.backends6[&slot1_v6.backend_id].addr,
        "fd00:10:244::1".parse::<std::net::Ipv6Addr>().unwrap().octets()
    );
    assert_eq!(store.rev_nat6[&slot0_v6.rev_nat_id].vip, v6_vip.octets());
    assert_eq!(store.vips6[&v6_vip.octets()].frontends, 1);
    // One id space: the IPv4 frontend and backend have ids of their own, not the IPv6 ones.
    let slot0_v4 = slot0(store, 80, Protocol::Tcp);
    assert_ne!(slot0_v4.rev_nat_id, slot0_v6.rev_nat_id);
    assert!(!store.backends.contains_key(&slot1_v6.backend_id));
    assert!(!store.services.keys().any(|k| k.0 != VIP), "an IPv6 entry in the IPv4 map");

    // A restarted agent reads both families back: nothing is rewritten.
    let store = std::mem::take(&mut syncer.store);
    let mut syncer = Syncer::with_store(FakeStore { log: vec![], ..store }).unwrap();
    assert!(!syncer.apply(&desired).changed());
    assert!(syncer.store().log.is_empty(), "{:?}", syncer.store().log);

    // Removing the IPv6 frontend removes its entries from the IPv6 maps only.
    let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let store = syncer.store();
    assert!(
        store.services6.is_empty() && store.backends6.is_empty() && store.vips6.is_empty(),
        "{:?}",
        store.log
    );
    assert!(store.rev_nat6.is_empty());
    assert_eq!(slot0(store, 80, Protocol::Tcp).count, 1);
}

#[test]
fn rev_nat_ids_go_past_16_bits_distinct_and_a_restarted_syncer_continues_above_them() {
    let frontend = |i: u32| {
        Frontend::new(
            ServiceName { namespace: "many".into(), name: format!("svc-{i}") },
            "http".to_owned(),
            Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 1)) + i),
            80,
            Protocol::Tcp,
            vec![be([10, 244, 0, 11], 8080)],
        )
    };
    let n = 70_000;
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    let report = syncer.apply(&Desired::new((0..n).map(frontend).collect()));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let ids: std::collections::BTreeSet<RevNatId> =
        syncer.store().services.iter().filter(|(k, _)| k.4 == 0).map(|(_, v)| v.rev_nat_id).collect();
    assert_eq!(ids.len(), n as usize, "one id per frontend");
    assert_eq!((ids.first().copied(), ids.last().copied()), (Some(1), Some(n)));
    let store = syncer.store();
    let last = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 1)) + n - 1).octets();
    let master = store.services[&(last, 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)];
    assert_eq!(store.rev_nat[&master.rev_nat_id].vip, last);
    assert_eq!(store.names[&master.rev_nat_id], "many/svc-69999:http");

    // A restart reads the ids back and hands out the next one above them.
    let mut restarted = Syncer::with_store(syncer.store().clone()).unwrap();
    let report = restarted.apply(&Desired::new((0..=n).map(frontend).collect()));
    assert_eq!((report.frontends_added, report.frontends_updated), (1, 0), "{report:?}");
    let added = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 1)) + n).octets();
    let master = restarted.store().services[&(added, 80, Protocol::Tcp.number(), SCOPE_INTERNAL, 0)];
    assert_eq!(master.rev_nat_id, n + 1);
}

/// What the metrics report for the service maps comes from the mirror: it must equal what the maps hold.
#[test]
fn map_fill_counts_what_the_maps_hold_in_both_families() {
    let v6 = |last: u16| BackendAddr {
        addr: std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last).into(),
        port: 80,
    };
    let mut web6 = web(80, Protocol::Tcp, &[], &[]);
    (web6.vip, web6.backends, web6.terminating_backends) =
        ("fd00:10:96::64".parse().unwrap(), vec![v6(1), v6(2)], vec![v6(3)]);
    let mut node_port = web(30080, Protocol::Tcp, &[1, 2], &[3]);
    (node_port.vip, node_port.kind) = (Ipv4Addr::new(192, 168, 1, 10).into(), FrontendKind::NodePort);
    let desired = Desired::new(vec![
        web(80, Protocol::Tcp, &[1, 2], &[3]),
        web(53, Protocol::Udp, &[1], &[]),
        node_port,
        web6,
    ]);
    let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
    assert!(syncer.apply(&desired).errors.is_empty());
    let store = syncer.store();
    let held = [
        ("services_v4", store.services.len()),
        ("backends_v4", store.backends.len()),
        ("rev_nat_v4", store.rev_nat.len()),
        ("vips_v4", store.vips.len()),
        ("services_v6", store.services6.len()),
        ("backends_v6", store.backends6.len()),
        ("rev_nat_v6", store.rev_nat6.len()),
        ("vips_v6", store.vips6.len()),
    ]
    .map(|(name, n)| (name, n as u64));
    assert_eq!(syncer.map_fill(), held);
    assert_eq!(held[0], ("services_v4", 4 + 2 + 4), "slot 0 and the slots of each IPv4 frontend");

    // After a removal too, and read back by a restarted agent.
    let smaller = Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]);
    syncer.apply(&smaller);
    let restarted = Syncer::with_store(syncer.store().clone()).unwrap();
    for s in [&syncer, &restarted] {
        let fill = s.map_fill();
        assert_eq!(fill[0], ("services_v4", s.store().services.len() as u64));
        assert_eq!(fill[1], ("backends_v4", s.store().backends.len() as u64));
        assert_eq!(fill[4], ("services_v6", 0));
    }
}
