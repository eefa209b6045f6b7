//! A seeded randomized test of the real datapath through BPF_PROG_TEST_RUN: at least 100k
//! generated packets per run go through the programs a packet would meet on a node — a pod's
//! veth (`kproxy_ingress` as it leaves its pod, `kproxy_egress` as it enters one), the external
//! interface (`kproxy_xdp`, then `kproxy_external_ingress`, and `kproxy_egress` on the way out) —
//! hop by hop, routed between them by the destination each hop leaves the packet with.
//!
//! Every hop is checked against invariants that do not come from the datapath's code
//! (`datapath_fuzz/oracle.rs` keeps the model; it learns translations only from what it saw):
//! - a packet is untouched unless it is translated: to a Service's frontend, as the reply of a
//!   translated flow, or as a direct flow whose source port was remapped because its reply
//!   tuple was a live translated flow's (only the source port, into the SNAT range; its replies
//!   get the original port back);
//! - after every rewrite the IPv4 header checksum and the L4 checksum (TCP; UDP unless zero,
//!   which stays zero; a first fragment's over its whole datagram; ICMP and a quoted header) are
//!   valid, recomputed from scratch;
//! - a translated packet goes only to one of its Service's backends (address and target port);
//! - no byte outside the rewritten fields changes, above all nothing past the IP datagram
//!   (Ethernet padding);
//! - replies are un-NATed only for flows that were translated, and a new flow never takes the
//!   reply tuple of a live one (direct pod-to-pod traffic from reused ports, two Services with
//!   the same backend, hairpin);
//! - refusals are well-formed and never sent to addresses no node answers, or for a RST.
//!
//! The mix: TCP with every flag combination, UDP, ICMP errors (unreachable, fragmentation needed,
//! time exceeded) quoting translated and untranslated flows, some cut by the IP total length,
//! fragments (lost, reordered, IDs reused), IP and TCP options, cut frames, Ethernet padding,
//! packets to cluster IPs, NodePorts, ports a Service lacks, Services without endpoints, pod IPs
//! and node ports in the SNAT range, replies, and Service changes (backends removed, a Service
//! deleted) every few thousand packets, with ports from small sets so flows collide.
//!
//! `KPROXY_FUZZ_SEED` (decimal or 0x-hex) picks the seed, `KPROXY_FUZZ_PACKETS` the count. A run
//! does not stop at the first broken invariant: it keeps the first instance of each, resets the
//! flow state and goes on; at the end each is reduced to a short packet sequence (replayed on a
//! clean datapath) and reported with its bytes.

mod common;
#[path = "datapath_fuzz/frame.rs"]
mod frame;
#[path = "datapath_fuzz/generate.rs"]
mod generate;
#[path = "datapath_fuzz/oracle.rs"]
mod oracle;
#[path = "datapath_fuzz/topology.rs"]
mod topology;

use std::{
    collections::BTreeMap,
    process::Command,
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData},
    programs::{SchedClassifier, Xdp},
};
use common::harness::test_run;
use frame::{Fields, Kind};
use generate::{Action, Entry, Generator, Packet};
use kproxy::{bpf, sync::Syncer};
use oracle::{Fail, Hop, Observed, Oracle, Verdict};
use proxy_common::maps::{
    AffinityKeyV4, AffinityValueV4, ConfigV4, CtEntryV4, CtKeyV4, ExternalIfaceV4, FragmentKeyV4,
    FragmentPortsV4, SnatEntryV4,
};
use topology::{Config, LOCAL_PODS, NODE, NODE_MAC, PEER, PEER_MAC, POD_GATEWAY_MAC, VARIANTS, mac_of};

const DEFAULT_SEED: u64 = 0x6b70_726f_7879_0013;
const DEFAULT_PACKETS: u64 = 120_000;

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Runs `test` in a thread inside a new network namespace (gone with the thread) holding the
/// node's interfaces: `ext0` (192.168.100.10/24, the peer node's pod CIDR routed via it) and
/// `pod0` (standing for every local pod's host veth, 10.244.0.0/24 on it), with static
/// neighbours and no route out.
fn in_private_netns(test: impl FnOnce(u32, u32) + Send + 'static) {
    let result = std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread, which owns nothing shared yet.
        let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(ret, 0, "unshare(CLONE_NEWNET) needs root: {}", std::io::Error::last_os_error());
        sh(&["ip", "link", "add", "ext0", "address", &mac(NODE_MAC), "type", "veth", "peer", "name", "ext1"]);
        sh(&[
            "ip",
            "link",
            "add",
            "pod0",
            "address",
            &mac(POD_GATEWAY_MAC),
            "type",
            "veth",
            "peer",
            "name",
            "pod1",
        ]);
        for dev in ["lo", "ext0", "ext1", "pod0", "pod1"] {
            sh(&["ip", "link", "set", dev, "up"]);
        }
        sh(&["ip", "addr", "add", "192.168.100.10/24", "dev", "ext0"]);
        sh(&["ip", "route", "add", "10.244.1.0/24", "via", "192.168.100.11"]);
        sh(&["ip", "route", "add", "10.244.0.0/24", "dev", "pod0"]);
        let ip = frame::ip;
        let mut neighbours = vec![(ip(PEER), PEER_MAC, "ext0")];
        for client in topology::EXTERNAL_CLIENTS {
            neighbours.push((ip(client), mac_of(client), "ext0"));
        }
        for pod in LOCAL_PODS {
            neighbours.push((ip(pod), mac_of(pod), "pod0"));
        }
        for (addr, m, dev) in neighbours {
            sh(&["ip", "neigh", "replace", &addr, "lladdr", &mac(m), "dev", dev, "nud", "permanent"]);
        }
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap();
        let index =
            |name: &str| bpf::interfaces().unwrap().into_iter().find(|i| i.name == name).unwrap().index;
        test(index("ext0"), index("pod0"));
    })
    .join();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// The real programs, loaded unpinned, their maps programmed through the agent's Syncer.
struct World {
    ebpf: Ebpf,
    syncer: Syncer,
    conntrack: HashMap<MapData, CtKeyV4, CtEntryV4>,
    snat: HashMap<MapData, CtKeyV4, SnatEntryV4>,
    affinity: HashMap<MapData, AffinityKeyV4, AffinityValueV4>,
    fragments: HashMap<MapData, FragmentKeyV4, FragmentPortsV4>,
    ext: u32,
    pod: u32,
    runs: u64,
    /// What the hops did and which flows they made, to show what a run exercised.
    coverage: BTreeMap<String, u64>,
}

impl World {
    fn new(ext: u32, pod: u32) -> Self {
        let mut ebpf =
            bpf::load_unpinned().expect("loading the datapath needs root and a BPF-capable kernel");
        let mut maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        maps.external_ifaces.insert(ext, ExternalIfaceV4 { addr: NODE, _pad: 0 }, 0).unwrap();
        // No flow expires during a run: what a flow may do must not depend on the clock.
        let hour = 3_600_000_000_000;
        let timeouts = ConfigV4 {
            timeout_tcp_syn_ns: hour,
            timeout_tcp_established_ns: hour,
            timeout_tcp_closing_ns: hour,
            timeout_udp_ns: hour,
            ..Default::default()
        };
        maps.config.set(0, timeouts, 0).unwrap();
        let (cluster_cidr, cluster_cidr_prefix) = topology::CLUSTER_CIDR;
        let north_south = proxy_common::maps::NodePortConfigV4 {
            cluster_cidr,
            cluster_cidr_prefix,
            ..maps.nodeport_config.get(&0, 0).unwrap()
        };
        maps.nodeport_config.set(0, north_south, 0).unwrap();
        let fragments = HashMap::try_from(ebpf.take_map("FRAGMENTS_V4").expect("FRAGMENTS_V4")).unwrap();
        let store = bpf::BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips)
            .with_source_ranges(maps.source_ranges);
        let syncer = Syncer::with_store(store).unwrap();
        Self {
            ebpf,
            syncer,
            conntrack: maps.conntrack,
            snat: maps.snat,
            affinity: maps.affinity,
            fragments,
            ext,
            pod,
            runs: 0,
            coverage: BTreeMap::new(),
        }
    }

    fn configure(&mut self, config: &Config) {
        let report = self.syncer.apply(&config.desired());
        assert!(report.errors.is_empty(), "{:?}", report.errors);
    }

    /// Forgets every flow (conntrack, SNAT, fragments, affinity); the Services stay.
    fn reset(&mut self) {
        fn clear<K: aya::Pod, V: aya::Pod>(map: &mut HashMap<MapData, K, V>) {
            let keys: Vec<K> = map.keys().filter_map(Result::ok).collect();
            for k in keys {
                let _ = map.remove(&k);
            }
        }
        clear(&mut self.conntrack);
        clear(&mut self.snat);
        clear(&mut self.affinity);
        clear(&mut self.fragments);
    }

    fn run(&mut self, hop: Hop, frame: &[u8]) -> (u32, Vec<u8>) {
        self.runs += 1;
        let tc = |name: &str, ifindex: u32| {
            let prog: &SchedClassifier = self.ebpf.program(name).unwrap().try_into().unwrap();
            // struct __sk_buff up to ifindex (offset 40), which picks the device.
            let mut ctx = [0u8; 192];
            ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
            test_run(prog, frame, Some(&ctx))
        };
        match hop {
            Hop::PodIngress => tc("kproxy_ingress", self.pod),
            Hop::PodEgress => tc("kproxy_egress", self.pod),
            Hop::ExternalTc => tc("kproxy_external_ingress", self.ext),
            Hop::ExternalEgress => tc("kproxy_egress", self.ext),
            Hop::ExternalXdp => {
                let prog: &Xdp = self.ebpf.program("kproxy_xdp").unwrap().try_into().unwrap();
                // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index.
                let mut ctx = [0u8; 24];
                ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
                ctx[12..16].copy_from_slice(&self.ext.to_ne_bytes());
                test_run(prog, frame, Some(&ctx))
            }
        }
    }
}

fn hop_name(hop: Hop) -> &'static str {
    match hop {
        Hop::PodIngress => "kproxy_ingress (pod veth)",
        Hop::PodEgress => "kproxy_egress (pod veth)",
        Hop::ExternalXdp => "kproxy_xdp (external interface)",
        Hop::ExternalTc => "kproxy_external_ingress (external interface)",
        Hop::ExternalEgress => "kproxy_egress (external interface)",
    }
}

fn verdict(hop: Hop, ret: u32) -> Option<Verdict> {
    match (hop, ret) {
        (Hop::ExternalXdp, 2) => Some(Verdict::Pass),
        (Hop::ExternalXdp, 1) => Some(Verdict::Drop),
        (Hop::ExternalXdp, 3 | 4) => Some(Verdict::Redirect),
        (Hop::ExternalXdp, _) => None,
        (_, u32::MAX | 0) => Some(Verdict::Pass),
        (_, 2) => Some(Verdict::Drop),
        (_, 7) => Some(Verdict::Redirect),
        _ => None,
    }
}

/// The checks every hop's output must pass whatever the packet, and what the hop did.
fn observe(
    hop: Hop,
    input: &[u8],
    kind: &Kind,
    rest: Option<&[u8]>,
    ret: u32,
    out: &[u8],
) -> Result<Observed, Fail> {
    let Some(verdict) = verdict(hop, ret) else {
        return oracle::fail("unexpected program return value", format!("{} returned {ret}", hop_name(hop)));
    };
    if verdict == Verdict::Drop {
        return Ok(Observed::Dropped);
    }
    if verdict == Verdict::Pass && out == input {
        return Ok(Observed::Untouched);
    }
    let bounce = out.len() >= 12 && out[..6] == input[6..12] && out[6..12] == input[..6];
    if let (Some(i), Some(o)) = (frame::ipv4(input), frame::ipv4(out))
        && matches!(kind, Kind::L4 { .. })
        && verdict == Verdict::Redirect
        && o.src == i.dst
        && o.dst == i.src
    {
        return Ok(Observed::Refusal { frame: out.to_vec(), bounce });
    }
    if let Some(what) = frame::unexpected_changes(input, out, kind) {
        let check = if frame::icmp_quote_cut(input) {
            "ICMP error whose quote is cut by the IP total length rewritten (from bytes past the datagram)"
        } else if what.contains("past the IP datagram") {
            "bytes past the IP datagram changed"
        } else {
            "bytes outside the translated fields changed"
        };
        return oracle::fail(check, what);
    }
    if verdict == Verdict::Pass && out[..12] != input[..12] {
        return oracle::fail("MAC addresses changed on a packet passed on", "");
    }
    let before = frame::bad_checksums(input, rest);
    let after = frame::bad_checksums(out, rest);
    let broken: Vec<_> = after.iter().filter(|c| !before.contains(c)).collect();
    if !broken.is_empty() {
        return oracle::fail(
            "checksum invalid after a rewrite",
            format!("{broken:?} checksum no longer verifies"),
        );
    }
    match (frame::udp_checksum_zero(input), frame::udp_checksum_zero(out)) {
        (Some(true), Some(false)) => return oracle::fail("UDP checksum of zero not kept", ""),
        (Some(false), Some(true)) => return oracle::fail("UDP checksum became zero", ""),
        _ => {}
    }
    let fields_in = frame::fields(input, kind);
    let fields_out = frame::fields(out, kind).unwrap();
    if verdict == Verdict::Pass && fields_in == Some(fields_out) {
        if hop == Hop::ExternalXdp {
            return oracle::fail(
                "XDP_PASS with a changed frame",
                "the fields are the same, other bytes are not",
            );
        }
        return Ok(Observed::Untouched);
    }
    Ok(Observed::Changed { verdict, fields: fields_out, bounce })
}

/// Where a packet goes after a hop (by the destination it left with).
fn next_hop(hop: Hop, verdict: Verdict, out: &[u8]) -> Option<Hop> {
    match (hop, verdict) {
        (_, Verdict::Drop) | (Hop::PodEgress | Hop::ExternalEgress, _) => None,
        (Hop::ExternalXdp, Verdict::Pass) => Some(Hop::ExternalTc),
        (Hop::ExternalXdp, Verdict::Redirect) => None,
        _ => route(out),
    }
}

fn route(frame: &[u8]) -> Option<Hop> {
    let h = frame::ipv4(frame)?;
    if topology::is_local_pod(h.dst) {
        Some(Hop::PodEgress)
    } else if h.dst == NODE || h.dst[..2] == [10, 96] || h.dst == topology::HAIRPIN {
        None
    } else {
        Some(Hop::ExternalEgress)
    }
}

/// What one hop saw and did, for reports.
#[derive(Clone)]
struct HopRecord {
    hop: Hop,
    input: Vec<u8>,
    ret: u32,
    output: Vec<u8>,
    observed: String,
}

struct Failure {
    fail: Fail,
    event: u64,
    hop: HopRecord,
    /// The actions since the last reset, the failing one last, and the Services they started with.
    actions: Vec<Action>,
    start_variant: usize,
    /// The flows the oracle saw since the reset (client's tuple, tuple sent), in order.
    flows: Vec<(frame::Tuple, frame::Tuple)>,
}

/// Sends one packet through its hops, each judged by the oracle.
fn deliver(
    world: &mut World,
    oracle: &mut Oracle,
    packet: &Packet,
    trace: &mut Vec<HopRecord>,
) -> Result<(), (Fail, HopRecord)> {
    let mut hop = match packet.entry {
        Entry::Pod => Some(Hop::PodIngress),
        Entry::Wire { xdp: true } => Some(Hop::ExternalXdp),
        Entry::Wire { xdp: false } => Some(Hop::ExternalTc),
        Entry::Node => route(&packet.frame),
    };
    let mut frame = packet.frame.clone();
    while let Some(at) = hop {
        let (ret, out) = world.run(at, &frame);
        let kind = frame::kind(&frame);
        let fields: Option<Fields> = frame::fields(&frame, &kind);
        let record = |observed: String| HopRecord {
            hop: at,
            input: frame.clone(),
            ret,
            output: out.clone(),
            observed,
        };
        let observed = match observe(at, &frame, &kind, packet.rest.as_deref(), ret, &out) {
            Ok(o) => o,
            Err(e) => return Err((e, record("(failed the checks every rewrite must pass)".into()))),
        };
        let flows_before = oracle.flows.len();
        if let Err(e) = oracle.check(at, &frame, &kind, fields, &observed) {
            return Err((e, record(observed.to_string())));
        }
        let what = match (&kind, &observed) {
            (_, Observed::Dropped) => "dropped",
            (_, Observed::Untouched) => "untouched",
            (_, Observed::Refusal { .. }) => "refused",
            (Kind::IcmpError { .. }, _) => "ICMP error rewritten",
            (Kind::LaterFragment { .. }, _) => "later fragment rewritten",
            _ => "rewritten",
        };
        *world.coverage.entry(format!("{}: {what}", hop_name(at))).or_default() += 1;
        for f in &oracle.flows[flows_before..] {
            let kind = match (f.service, f.hairpin, f.snat, f.remapped) {
                (None, ..) => "direct flows with a remapped source port",
                (Some(_), true, ..) => "hairpin flows",
                (Some(_), _, true, _) => "source-NATed flows",
                (Some(_), _, _, true) => "Service flows with a remapped source port",
                _ => "Service flows",
            };
            *world.coverage.entry(format!("new {kind}")).or_default() += 1;
        }
        trace.push(record(observed.to_string()));
        hop = match &observed {
            Observed::Dropped => None,
            _ => next_hop(at, verdict(at, ret).unwrap(), &out),
        };
        frame = out;
    }
    Ok(())
}

/// Replays `actions` on a clean datapath: whether one of them breaks `check` (the datapath's
/// random choices differ between attempts, so a few are made).
fn reproduces(world: &mut World, failure: &Failure, actions: &[Action], attempts: usize) -> bool {
    (0..attempts).any(|_| {
        replay(world, failure, actions, &mut Vec::new()).is_some_and(|(f, _)| f.check == failure.fail.check)
    })
}

/// Replays `actions` on a clean datapath, `log` getting each action's hops. A packet the original
/// run addressed to a translation the datapath picked at random (a backend, a SNAT or remapped
/// port) is sent to what the replay's datapath picked for the same flow instead.
fn replay(
    world: &mut World,
    failure: &Failure,
    actions: &[Action],
    log: &mut Vec<Vec<HopRecord>>,
) -> Option<(Fail, HopRecord)> {
    use frame::Tuple;
    world.reset();
    let config = Config::variant(failure.start_variant);
    world.configure(&config);
    let mut oracle = Oracle::new(config);
    let mut original: std::collections::HashMap<Tuple, Vec<Tuple>> = std::collections::HashMap::new();
    for (orig, wire) in &failure.flows {
        original.entry(*orig).or_default().push(*wire);
    }
    let mut seen: std::collections::HashMap<Tuple, usize> = std::collections::HashMap::new();
    let mut substitute: std::collections::HashMap<Tuple, Tuple> = std::collections::HashMap::new();
    // A first fragment's (source, destination, id) → the addresses it was sent with instead.
    type Addrs = ([u8; 4], [u8; 4]);
    let mut fragment_addrs: std::collections::HashMap<(Addrs, u16), Addrs> = std::collections::HashMap::new();
    for action in actions {
        oracle.event += 1;
        match action {
            Action::Configure(v) => {
                let config = Config::variant(*v);
                world.configure(&config);
                oracle.reconfigure(config);
                log.push(Vec::new());
            }
            Action::Packet(p) => {
                let mut p = p.clone();
                match frame::kind(&p.frame) {
                    Kind::L4 { tuple, part, .. } => {
                        if let Some(t) = substitute.get(&tuple) {
                            frame::set_tuple(&mut p.frame, t, p.rest.as_deref());
                            p.entry = entry_for(t.src, p.entry);
                            if part == frame::Part::First {
                                let id = frame::ipv4(&p.frame).unwrap().id;
                                fragment_addrs.insert(((tuple.src, tuple.dst), id), (t.src, t.dst));
                            }
                        }
                    }
                    Kind::LaterFragment { src, dst, id, .. } => {
                        if let Some((s, d)) = fragment_addrs.get(&((src, dst), id)) {
                            p.frame[26..30].copy_from_slice(s);
                            p.frame[30..34].copy_from_slice(d);
                            frame::fix_ip_checksum(&mut p.frame);
                        }
                    }
                    Kind::IcmpError { outer_src, outer_dst, quote, .. } => {
                        if let Some(q) = substitute.get(&quote) {
                            let src = if outer_src == quote.dst { q.dst } else { outer_src };
                            let dst = if outer_dst == quote.src { q.src } else { outer_dst };
                            frame::set_icmp_error(&mut p.frame, src, dst, q);
                            p.entry = entry_for(src, p.entry);
                        }
                    }
                    _ => {}
                }
                let flows_before = oracle.flows.len();
                let mut trace = Vec::new();
                let result = deliver(world, &mut oracle, &p, &mut trace);
                for f in &oracle.flows[flows_before..] {
                    let n = seen.entry(f.orig).or_default();
                    if let Some(was) = original.get(&f.orig).and_then(|w| w.get(*n))
                        && *was != f.wire
                    {
                        substitute.insert(*was, f.wire);
                        substitute.insert(was.reverse(), f.wire.reverse());
                    }
                    *n += 1;
                }
                if let Err((fail, record)) = result {
                    trace.push(record.clone());
                    log.push(trace);
                    return Some((fail, record));
                }
                log.push(trace);
            }
        }
    }
    None
}

/// Where a packet from `src` enters the node (the same as `was` when its sender's place did
/// not change).
fn entry_for(src: [u8; 4], was: Entry) -> Entry {
    if topology::is_local_pod(src) {
        Entry::Pod
    } else if src == NODE {
        Entry::Node
    } else if let Entry::Wire { .. } = was {
        was
    } else {
        Entry::Wire { xdp: false }
    }
}

/// The endpoints (address, port) a packet's headers name, for slicing a sequence.
fn endpoints(action: &Action) -> Vec<([u8; 4], u16)> {
    let Action::Packet(p) = action else { return Vec::new() };
    match frame::kind(&p.frame) {
        Kind::L4 { tuple, .. } => vec![(tuple.src, tuple.sport), (tuple.dst, tuple.dport)],
        Kind::IcmpError { quote, .. } => vec![(quote.src, quote.sport), (quote.dst, quote.dport)],
        Kind::LaterFragment { src, dst, .. } => vec![(src, 0), (dst, 0)],
        _ => Vec::new(),
    }
}

/// Shrinks a failing sequence: first to the packets sharing an endpoint with the failing one,
/// then by delta debugging, within a time budget.
fn reduce(world: &mut World, failure: &Failure, budget: Duration) -> Vec<Action> {
    let deadline = Instant::now() + budget;
    let mut actions = failure.actions.clone();
    // A failure that needs two flows to have picked the same backend takes a few tries.
    if !reproduces(world, failure, &actions, 60) {
        return actions;
    }
    let attempts = 12;
    let last = endpoints(actions.last().unwrap());
    let mut slice_by = last.clone();
    // Two rounds: the packets naming the failing packet's endpoints, then theirs.
    for _ in 0..2 {
        let mut grown = slice_by.clone();
        for a in &actions {
            let e = endpoints(a);
            if e.iter().any(|x| slice_by.contains(x) || (x.1 == 0 && slice_by.iter().any(|y| y.0 == x.0))) {
                grown.extend(e);
            }
        }
        slice_by = grown;
    }
    let sliced: Vec<Action> = actions
        .iter()
        .filter(|a| match a {
            Action::Configure(_) => true,
            _ => endpoints(a).iter().any(|x| slice_by.contains(x)),
        })
        .cloned()
        .collect();
    if sliced.len() < actions.len() && reproduces(world, failure, &sliced, attempts) {
        actions = sliced;
    }
    // ddmin over complements: drop chunks while the failure stays.
    let mut parts = 2;
    while actions.len() >= 2 && Instant::now() < deadline {
        let chunk = actions.len().div_ceil(parts);
        let mut reduced = false;
        for start in (0..actions.len()).step_by(chunk) {
            if Instant::now() >= deadline {
                break;
            }
            let end = (start + chunk).min(actions.len());
            let candidate: Vec<Action> = actions[..start].iter().chain(&actions[end..]).cloned().collect();
            if !candidate.is_empty() && reproduces(world, failure, &candidate, attempts) {
                actions = candidate;
                parts = (parts - 1).max(2);
                reduced = true;
                break;
            }
        }
        if !reduced {
            if parts >= actions.len() {
                break;
            }
            parts = (parts * 2).min(actions.len());
        }
    }
    actions
}

/// `sent`: the frame the replay sent for it, when it differs from the recorded one.
fn describe_action(action: &Action, sent: Option<&[u8]>) -> String {
    match action {
        Action::Configure(v) => format!("Services become: {}", VARIANTS[*v]),
        Action::Packet(p) => {
            let from = match p.entry {
                Entry::Pod => "from a pod",
                Entry::Wire { xdp: true } => "on the external interface (XDP, then tc)",
                Entry::Wire { xdp: false } => "on the external interface (tc)",
                Entry::Node => "from the node",
            };
            let frame = sent.unwrap_or(&p.frame);
            format!("{} {from}\n       bytes {}", frame::describe(frame), frame::hex(frame))
        }
    }
}

fn report(world: &mut World, seed: u64, failures: &BTreeMap<&'static str, (u64, Failure)>) -> String {
    let mut out = String::new();
    for (check, (count, failure)) in failures {
        out += &format!("\n=== {check} — {count} time(s), first at event {} ===\n", failure.event);
        out += &format!("{}\n", failure.fail.detail);
        let h = &failure.hop;
        out += &format!(
            "at {}: in  {}\n         {}\n       out (return {}) {}\n         {}\n",
            hop_name(h.hop),
            frame::describe(&h.input),
            frame::hex(&h.input),
            h.ret as i32,
            frame::describe(&h.output),
            frame::hex(&h.output)
        );
        let started = Instant::now();
        let minimal = reduce(world, failure, Duration::from_secs(40));
        let mut log = Vec::new();
        let again = (0..20).find_map(|_| {
            log.clear();
            replay(world, failure, &minimal, &mut log).filter(|(f, _)| f.check == *check)
        });
        out += &format!(
            "reproduction (seed {seed:#x}; {} of {} actions after a reset, Services: {}; reduced in {:.1} s{}):\n",
            minimal.len(),
            failure.actions.len(),
            VARIANTS[failure.start_variant],
            started.elapsed().as_secs_f64(),
            if again.is_some() {
                ""
            } else {
                "; did not fail again on replay: it needs backend or port choices the datapath made at random"
            }
        );
        for (i, action) in minimal.iter().enumerate() {
            let sent = log.get(i).and_then(|hops| hops.first()).map(|h| h.input.as_slice());
            out += &format!("  {:>2}. {}\n", i + 1, describe_action(action, sent));
            for hop in log.get(i).into_iter().flatten() {
                out += &format!("       {}: {}\n", hop_name(hop.hop), hop.observed);
            }
        }
        if let Some((fail, _)) = again {
            out += &format!("  replay: {}\n", fail.detail);
        }
    }
    out
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    Some(match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{name}={v}: {e}")),
        None => v.parse().unwrap_or_else(|e| panic!("{name}={v}: {e}")),
    })
}

#[test]
fn generated_packets_keep_the_datapath_invariants() {
    let seed = env_u64("KPROXY_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
    let packets = env_u64("KPROXY_FUZZ_PACKETS").unwrap_or(DEFAULT_PACKETS);
    println!("datapath fuzz: seed {seed:#x} (KPROXY_FUZZ_SEED), {packets} packets (KPROXY_FUZZ_PACKETS)");
    in_private_netns(move |ext, pod| {
        let mut world = World::new(ext, pod);
        let mut config = Config::variant(0);
        world.configure(&config);
        let mut oracle = Oracle::new(config.clone());
        let mut generator = Generator::new(seed);
        let mut failures: BTreeMap<&'static str, (u64, Failure)> = BTreeMap::new();
        let mut segment: Vec<Action> = Vec::new();
        let mut segment_variant = 0;
        let started = Instant::now();
        let (mut sent, mut event) = (0u64, 0u64);
        while sent < packets {
            event += 1;
            oracle.event = event;
            let action = generator.next(&oracle);
            segment.push(action.clone());
            let result = match &action {
                Action::Configure(v) => {
                    config = Config::variant(*v);
                    world.configure(&config);
                    oracle.reconfigure(config.clone());
                    Ok(())
                }
                Action::Packet(p) => {
                    sent += 1;
                    deliver(&mut world, &mut oracle, p, &mut Vec::new())
                }
            };
            if let Err((fail, hop)) = result {
                let entry = failures.entry(fail.check).or_insert_with(|| {
                    println!("event {event}: {} — {}", fail.check, fail.detail);
                    (
                        0,
                        Failure {
                            fail: fail.clone(),
                            event,
                            hop,
                            actions: std::mem::take(&mut segment),
                            start_variant: segment_variant,
                            flows: oracle.flows.iter().map(|f| (f.orig, f.wire)).collect(),
                        },
                    )
                });
                entry.0 += 1;
                // A clean slate, so that one defect does not cascade into reports of others.
                world.reset();
                oracle = Oracle::new(config.clone());
                segment.clear();
                segment_variant = config.variant;
            }
        }
        let elapsed = started.elapsed();
        println!(
            "datapath fuzz: {sent} packets, {} program runs in {:.1} s; {} invariant(s) broken",
            world.runs,
            elapsed.as_secs_f64(),
            failures.len()
        );
        for (what, n) in &world.coverage {
            println!("  {n:>7}  {what}");
        }
        if !failures.is_empty() {
            let text = report(&mut world, seed, &failures);
            println!("{text}");
            panic!("{} datapath invariant(s) broken (seed {seed:#x}):{text}", failures.len());
        }
    });
}
