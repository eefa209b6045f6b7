//! `--lb-algorithm=maglev` through the real programs (BPF_PROG_TEST_RUN of `kproxy_ingress`): two
//! independently loaded datapaths — two nodes — programmed with the same backends and seed pick the
//! same backend for every flow, and removing one backend of ten moves only that backend's flows
//! (plus a little Maglev churn), where random selection would move almost all of them.

use std::net::Ipv4Addr;

use aya::{
    maps::{HashMap, MapData},
    programs::SchedClassifier,
};
use kproxy::{
    bpf,
    model::{BackendAddr, Desired, Frontend, FrontendKind, ServiceName},
    net::Protocol,
    sync::{MaglevSettings, Syncer},
};
use proxy_common::{
    maps::{CtEntryV4, CtKeyV4},
    packet::TCP_SYN,
    stats::Stat,
};

mod common;
use common::{Packet, harness::test_run};

const LB_IP: [u8; 4] = [192, 168, 200, 10];
const CLIENT: [u8; 4] = [10, 244, 0, 2];
const FLOWS: u16 = 2000;

struct Node {
    ebpf: aya::Ebpf,
    syncer: Syncer,
    conntrack: HashMap<MapData, CtKeyV4, CtEntryV4>,
    stats: aya::maps::PerCpuArray<MapData, u64>,
}

fn backends(n: u8) -> Vec<BackendAddr> {
    (1..=n).map(|i| BackendAddr { addr: Ipv4Addr::new(10, 244, 1, i).into(), port: 8080 }).collect()
}

fn desired(backends: Vec<BackendAddr>) -> Desired {
    let mut fe = Frontend::new(
        ServiceName { namespace: "default".into(), name: "web".into() },
        "http",
        Ipv4Addr::from(LB_IP),
        80,
        Protocol::Tcp,
        backends,
    );
    fe.kind = FrontendKind::LoadBalancer;
    Desired::new(vec![fe])
}

impl Node {
    fn new(seed: u32, backends: Vec<BackendAddr>) -> Self {
        let capacities = bpf::Capacities { maglev_tables: 4, ..Default::default() };
        let mut ebpf = bpf::load_unpinned_with(&capacities).expect("loading the datapath needs root");
        let maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        let (conntrack, stats, maglev) = (maps.conntrack, maps.stats, maps.maglev);
        let store = bpf::BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips)
            .with_maglev(maglev);
        let mut syncer = Syncer::with_store(store).unwrap().with_maglev(MaglevSettings { seed, tables: 4 });
        let report = syncer.apply(&desired(backends));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        Node { ebpf, syncer, conntrack, stats }
    }

    /// The backend address a new flow from `sport` is sent to.
    fn pick(&self, sport: u16) -> [u8; 4] {
        let prog: &SchedClassifier = self.ebpf.program("kproxy_ingress").unwrap().try_into().unwrap();
        let (_, out) = test_run(prog, &Packet::tcp(CLIENT, sport, LB_IP, 80, TCP_SYN).frame(), None);
        out[30..34].try_into().unwrap()
    }

    /// Forgets every flow, so the next packet of a tuple picks its backend again.
    fn flush_conntrack(&mut self) {
        let keys: Vec<CtKeyV4> = self.conntrack.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = self.conntrack.remove(&key);
        }
    }

    fn picks(&mut self) -> Vec<[u8; 4]> {
        self.flush_conntrack();
        (0..FLOWS).map(|i| self.pick(20000 + i)).collect()
    }

    fn stat(&self, stat: Stat) -> u64 {
        self.stats.get(&(stat as u32), 0).unwrap().iter().sum()
    }
}

#[test]
fn two_nodes_with_the_same_seed_pick_the_same_backend_for_every_flow() {
    let mut a = Node::new(7, backends(10));
    let mut b = Node::new(7, backends(10));
    let (from_a, from_b) = (a.picks(), b.picks());
    assert_eq!(from_a, from_b, "the same flow reaches the same backend whichever node it enters");
    assert_eq!(a.stat(Stat::MaglevPick), u64::from(FLOWS));
    let used: std::collections::BTreeSet<[u8; 4]> = from_a.iter().copied().collect();
    assert_eq!(used.len(), 10, "every backend gets flows");

    // Another seed is another table.
    let mut c = Node::new(8, backends(10));
    let same = c.picks().iter().zip(&from_a).filter(|(x, y)| x == y).count();
    assert!(same < usize::from(FLOWS) / 4, "{same} of {FLOWS} flows agree across seeds");
}

#[test]
fn removing_one_of_ten_backends_moves_only_its_own_flows_and_a_few_more() {
    let mut node = Node::new(7, backends(10));
    let before = node.picks();
    let removed_backend = backends(10)[3];
    let std::net::IpAddr::V4(removed) = removed_backend.addr else { unreachable!("IPv4 backends") };
    let removed = removed.octets();
    let remaining: Vec<BackendAddr> = backends(10).into_iter().filter(|b| *b != removed_backend).collect();
    let report = node.syncer.apply(&desired(remaining));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let after = node.picks();

    let (mut kept, mut moved) = (0usize, 0usize);
    for (old, new) in before.iter().zip(&after) {
        assert_ne!(*new, removed, "a flow still goes to the removed backend");
        if *old != removed {
            if old == new { kept += 1 } else { moved += 1 }
        }
    }
    let moved_fraction = moved as f64 / (kept + moved) as f64;
    // Maglev's extra churn is about 1 % of the table for ten backends; random selection would
    // move 90 % of these flows.
    assert!(moved_fraction < 0.05, "{moved} of {} flows of surviving backends moved", kept + moved);
    eprintln!(
        "flows of surviving backends that moved: {moved} of {} ({:.2} %)",
        kept + moved,
        moved_fraction * 100.0
    );
}
