//! BPF_PROG_TEST_RUN of the real XDP program (`kproxy_xdp`) and the external tc program: byte-exact
//! rewrites of a NodePort flow to a backend on another node (DNAT + SNAT, sent back out with
//! XDP_REDIRECT) and of its reply, and the cases XDP leaves to tc.
//!
//! The route lookups the programs make need an interface, a route and neighbours: each test runs
//! in a thread that moves itself into a new network namespace (`unshare(CLONE_NEWNET)`) holding
//! one veth pair with static neighbours and no route out. The namespace disappears with the
//! thread.

use std::net::Ipv4Addr;

use aya::programs::Xdp;
use kproxy::{
    bpf,
    model::{BackendAddr, Frontend, FrontendKind, Scope, ServiceName},
    net::{Cidr4, Protocol},
    sync::Syncer,
};
use proxy_common::{
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_SNAT, ExternalIfaceV4, IPPROTO_TCP},
    packet::{TCP_ACK, TCP_SYN},
    stats::Stat,
};

mod common;

use common::external_node::{
    EXT_CLIENT as CLIENT, EXT_CLIENT_MAC as CLIENT_MAC, LOCAL_POD as LOCAL_BACKEND, NODE, NODE_MAC,
    OTHER_HOST as OTHER_CLIENT, PEER_MAC, REMOTE_BACKEND, in_private_netns,
};
use common::{
    Packet, checksums_valid,
    harness::{PASS as TCX_NEXT, ct_key, test_run},
    icmp_error,
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
const TC_ACT_REDIRECT: u32 = 7;

fn web(kind: FrontendKind, vip: [u8; 4], port: u16, backends: &[[u8; 4]]) -> Frontend {
    let mut fe = Frontend::new(
        ServiceName { namespace: "default".into(), name: "web".into() },
        "http",
        Ipv4Addr::from(vip),
        port,
        Protocol::Tcp,
        backends.iter().map(|a| BackendAddr { addr: Ipv4Addr::from(*a).into(), port: 80 }).collect(),
    );
    fe.kind = kind;
    fe
}

struct Xdp0 {
    ebpf: aya::Ebpf,
    _syncer: Syncer,
    conntrack:
        aya::maps::HashMap<aya::maps::MapData, proxy_common::maps::CtKeyV4, proxy_common::maps::CtEntryV4>,
    stats: aya::maps::PerCpuArray<aya::maps::MapData, u64>,
    snat:
        aya::maps::HashMap<aya::maps::MapData, proxy_common::maps::CtKeyV4, proxy_common::maps::SnatEntryV4>,
    nodeport_config: aya::maps::Array<aya::maps::MapData, proxy_common::maps::NodePortConfigV4>,
    ingress: u32,
}

impl Xdp0 {
    fn new(ingress: u32, frontends: Vec<Frontend>) -> Self {
        let mut ebpf = bpf::load_unpinned().expect("loading the datapath needs root");
        let mut maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        maps.external_ifaces.insert(ingress, ExternalIfaceV4 { addr: NODE, _pad: 0 }, 0).unwrap();
        let (conntrack, stats, snat, nodeport_config) =
            (maps.conntrack, maps.stats, maps.snat, maps.nodeport_config);
        let store = bpf::BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips)
            .with_source_ranges(maps.source_ranges);
        let mut syncer = Syncer::with_store(store).unwrap();
        let report = syncer.apply(&kproxy::model::Desired::new(frontends));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        Self { ebpf, _syncer: syncer, conntrack, stats, snat, nodeport_config, ingress }
    }

    fn xdp(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &Xdp = self.ebpf.program("kproxy_xdp").unwrap().try_into().unwrap();
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&self.ingress.to_ne_bytes());
        test_run(prog, frame, Some(&ctx))
    }

    fn stat(&self, stat: Stat) -> u64 {
        self.stats.get(&(stat as u32), 0).unwrap().iter().sum()
    }

    /// The external tc program (what XDP passes on) on a frame arriving on the interface.
    fn tc(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &aya::programs::SchedClassifier =
            self.ebpf.program("kproxy_external_ingress").unwrap().try_into().unwrap();
        // struct __sk_buff up to ifindex (offset 40), which picks the device the packet is on.
        let mut ctx = [0u8; 192];
        ctx[40..44].copy_from_slice(&self.ingress.to_ne_bytes());
        test_run(prog, frame, Some(&ctx))
    }
}

fn frame_to_node(packet: &Packet) -> Vec<u8> {
    let mut frame = packet.frame();
    frame[..6].copy_from_slice(&NODE_MAC);
    frame[6..12].copy_from_slice(&CLIENT_MAC);
    frame
}

fn expected(packet: &Packet, dmac: [u8; 6]) -> Vec<u8> {
    let mut frame = packet.frame();
    frame[..6].copy_from_slice(&dmac);
    frame[6..12].copy_from_slice(&NODE_MAC);
    frame
}

#[test]
fn nodeport_to_a_remote_backend_is_dnated_snated_and_sent_back_out_and_so_is_its_reply() {
    in_private_netns(|ingress| {
        let x = Xdp0::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet::tcp(CLIENT, 40000, NODE, 30080, TCP_SYN).with_payload(b"hello");
        let (action, out) = x.xdp(&frame_to_node(&syn));
        assert_eq!(action, XDP_REDIRECT, "{:?}", out);

        // The SNAT port is the one the datapath picked: read it from conntrack.
        let fwd =
            x.conntrack.get(&ct_key(CLIENT, 40000, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD), 0).unwrap();
        assert_eq!(fwd.flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        let port = u16::from_be_bytes([out[34], out[35]]);
        assert!((61000..=65535).contains(&port), "SNAT port {port}");
        let translated = Packet { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..syn.clone() };
        assert_eq!(out, expected(&translated, PEER_MAC), "DNAT + SNAT, MACs of the route to the peer node");
        assert!(checksums_valid(&out));

        // The backend's answer comes back to the node address and SNAT port.
        let reply = Packet::tcp(REMOTE_BACKEND, 80, NODE, port, TCP_SYN | TCP_ACK).with_payload(b"world!");
        let mut frame = reply.frame();
        frame[..6].copy_from_slice(&NODE_MAC);
        frame[6..12].copy_from_slice(&PEER_MAC);
        let (action, out) = x.xdp(&frame);
        assert_eq!(action, XDP_REDIRECT);
        let back = Packet { src: NODE, sport: 30080, dst: CLIENT, dport: 40000, ..reply };
        assert_eq!(out, expected(&back, CLIENT_MAC), "reverse SNAT + DNAT, to the client's MAC");
        assert!(checksums_valid(&out));
        let rkey = ct_key(REMOTE_BACKEND, 80, NODE, port, IPPROTO_TCP, CT_DIR_REPLY);
        assert_eq!(x.conntrack.get(&rkey, 0).unwrap().packets, 1);

        // The next segment of the flow takes the same translation.
        let ack = Packet::tcp(CLIENT, 40000, NODE, 30080, TCP_ACK);
        let (action, out) = x.xdp(&frame_to_node(&ack));
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(
            out,
            expected(&Packet { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..ack }, PEER_MAC)
        );
        assert_eq!(x.stat(Stat::XdpForwarded), 3);
        assert_eq!(x.stat(Stat::SnatNew), 1);
    });
}

/// A router between the node and the remote backend needs smaller packets: its "fragmentation
/// needed" reaches the node, quoting the source-NATed packet. tc sends it on to the client as
/// an error about the packet the client sent (quote un-NATed both ways, checksums right), so the
/// client's TCP learns the path MTU.
#[test]
fn fragmentation_needed_for_a_source_natted_flow_goes_on_to_the_client() {
    in_private_netns(|ingress| {
        let x = Xdp0::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet::tcp(CLIENT, 40000, NODE, 30080, TCP_SYN).with_payload(b"hello");
        let (action, out) = x.xdp(&frame_to_node(&syn));
        assert_eq!(action, XDP_REDIRECT);
        let router = [192, 168, 100, 11];
        let mut error = icmp_error(router, NODE, 3, 4, &out[14..14 + 28]);
        error[..6].copy_from_slice(&NODE_MAC);
        error[6..12].copy_from_slice(&PEER_MAC);
        let before = x.stat(Stat::IcmpErrorUnnat);
        let (action, out) = x.tc(&error);
        assert_eq!(action, TC_ACT_REDIRECT, "{out:?}");
        let mut want = icmp_error(router, CLIENT, 3, 4, &syn.frame()[14..14 + 28]);
        want[..6].copy_from_slice(&CLIENT_MAC);
        want[6..12].copy_from_slice(&NODE_MAC);
        assert_eq!(out, want);
        assert_eq!(x.stat(Stat::IcmpErrorUnnat), before + 1);
    });
}

#[test]
fn udp_nodeport_flows_get_distinct_snat_ports_and_valid_checksums() {
    in_private_netns(|ingress| {
        let mut dns = web(FrontendKind::NodePort, NODE, 30053, &[REMOTE_BACKEND]);
        dns.proto = Protocol::Udp;
        dns.backends[0].port = 53;
        let x = Xdp0::new(ingress, vec![dns]);
        let mut ports = std::collections::BTreeSet::new();
        for sport in 50000..50020 {
            let query = Packet::udp(CLIENT, sport, NODE, 30053, b"a DNS query, more or less");
            let (action, out) = x.xdp(&frame_to_node(&query));
            assert_eq!(action, XDP_REDIRECT);
            assert!(checksums_valid(&out));
            assert_eq!(&out[30..34], &REMOTE_BACKEND);
            assert!(ports.insert(u16::from_be_bytes([out[34], out[35]])), "a SNAT port was handed out twice");
        }
        assert_eq!(x.stat(Stat::SnatNew), 20);
    });
}

#[test]
fn local_backends_policy_local_and_other_traffic_are_left_to_tc_and_source_ranges_drop() {
    in_private_netns(|ingress| {
        let local = web(FrontendKind::NodePort, NODE, 30081, &[LOCAL_BACKEND]);
        let mut etp_local = web(FrontendKind::NodePort, NODE, 30082, &[LOCAL_BACKEND]);
        etp_local.scope = Scope::External;
        etp_local.external_local = true;
        let mut ranged = web(FrontendKind::LoadBalancer, [192, 168, 200, 11], 80, &[REMOTE_BACKEND]);
        ranged.source_ranges = vec![Cidr4::new(Ipv4Addr::from(CLIENT), 32).unwrap().into()];
        let x = Xdp0::new(ingress, vec![local, etp_local, ranged]);

        for port in [30081, 30082, 22] {
            let frame = frame_to_node(&Packet::tcp(CLIENT, 40000, NODE, port, TCP_SYN));
            let (action, out) = x.xdp(&frame);
            assert_eq!((action, &out), (XDP_PASS, &frame), "port {port} is tc's, untouched");
        }
        // The metric says why: two Service packets left to tc by design, one to no Service.
        let reasons = |x: &Xdp0| (x.stat(Stat::XdpToTc), x.stat(Stat::PassNoService), x.stat(Stat::XdpPass));
        assert_eq!(reasons(&x), (2, 1, 3));
        // The local backend XDP picked is recorded, so tc follows that choice rather than
        // picking again; policy Local and other ports leave no trace.
        let fwd =
            x.conntrack.get(&ct_key(CLIENT, 40000, NODE, 30081, IPPROTO_TCP, CT_DIR_FORWARD), 0).unwrap();
        assert_eq!((fwd.nat_addr, fwd.flags & CT_FLAG_SNAT), (LOCAL_BACKEND, 0));
        assert!(
            x.conntrack.get(&ct_key(CLIENT, 40000, NODE, 30082, IPPROTO_TCP, CT_DIR_FORWARD), 0).is_err()
        );
        let allowed = frame_to_node(&Packet::tcp(CLIENT, 40001, [192, 168, 200, 11], 80, TCP_SYN));
        assert_eq!(x.xdp(&allowed).0, XDP_REDIRECT);
        let other = frame_to_node(&Packet::tcp(OTHER_CLIENT, 40001, [192, 168, 200, 11], 80, TCP_SYN));
        assert_eq!(x.xdp(&other).0, XDP_DROP);
        assert_eq!(x.stat(Stat::DropSourceRange), 1);
        // A segment that is not a SYN starts no flow (tc drops it).
        let stray = frame_to_node(&Packet::tcp(CLIENT, 40002, [192, 168, 200, 11], 80, TCP_ACK));
        assert_eq!(x.xdp(&stray).0, XDP_PASS);
        assert_eq!(reasons(&x), (3, 1, 4));
    });
}

/// A source-NATed flow whose SNAT translation was evicted (SNAT_V4 is an LRU): its reply cannot
/// be un-NATed, so XDP and then tc leave it untouched, and the metric names the cause rather
/// than "no service".
#[test]
fn a_reply_whose_snat_translation_is_gone_passes_counted_as_snat_entry_missing() {
    in_private_netns(|ingress| {
        let mut x = Xdp0::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet::tcp(CLIENT, 40000, NODE, 30080, TCP_SYN);
        let (action, out) = x.xdp(&frame_to_node(&syn));
        assert_eq!(action, XDP_REDIRECT);
        let port = u16::from_be_bytes([out[34], out[35]]);
        let reverse = ct_key(REMOTE_BACKEND, 80, NODE, port, IPPROTO_TCP, CT_DIR_REPLY);
        x.snat.remove(&reverse).expect("the flow's SNAT translation");

        let reply = Packet::tcp(REMOTE_BACKEND, 80, NODE, port, TCP_SYN | TCP_ACK);
        let mut frame = reply.frame();
        frame[..6].copy_from_slice(&NODE_MAC);
        frame[6..12].copy_from_slice(&PEER_MAC);
        let (action, out) = x.xdp(&frame);
        assert_eq!((action, &out), (XDP_PASS, &frame));
        assert_eq!(x.stat(Stat::SnatEntryMissing), 1);
        let (action, out) = x.tc(&frame);
        assert_eq!((action, &out), (TCX_NEXT, &frame), "tc passes it too, untouched");
        assert_eq!((x.stat(Stat::SnatEntryMissing), x.stat(Stat::PassNoService)), (2, 0));
    });
}

/// The first flow to a remote backend before the node has resolved the next hop's MAC: XDP
/// cannot send it, but it records its pick (with the SNAT port) and passes the packet on
/// untouched; tc then finds the flow established and sends it where XDP chose, resolving the
/// neighbour. Picking again in tc instead skewed balancing toward local backends (3 in 4 flows
/// while the neighbour was unknown, and it stayed unknown for as long as tc picked local ones).
#[test]
fn a_remote_pick_with_the_neighbour_unknown_is_recorded_and_tc_sends_it_there() {
    in_private_netns(|ingress| {
        let peer = Ipv4Addr::from(common::external_node::PEER).to_string();
        let out =
            std::process::Command::new("ip").args(["neigh", "del", &peer, "dev", "ext0"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let x = Xdp0::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = frame_to_node(&Packet::tcp(CLIENT, 40000, NODE, 30080, TCP_SYN).with_payload(b"hello"));
        let (action, out) = x.xdp(&syn);
        assert_eq!((action, &out), (XDP_PASS, &syn), "left to tc untouched");
        assert_eq!((x.stat(Stat::XdpToTc), x.stat(Stat::SnatNew), x.stat(Stat::XdpForwarded)), (1, 1, 0));
        let fwd =
            x.conntrack.get(&ct_key(CLIENT, 40000, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD), 0).unwrap();
        assert_eq!((fwd.nat_addr, fwd.flags & CT_FLAG_SNAT), (REMOTE_BACKEND, CT_FLAG_SNAT));

        let (action, out) = x.tc(&syn);
        assert_eq!(action, TC_ACT_REDIRECT, "{out:?}");
        let port = u16::from_be_bytes([out[34], out[35]]);
        let rkey = ct_key(REMOTE_BACKEND, 80, NODE, port, IPPROTO_TCP, CT_DIR_REPLY);
        assert!(x.snat.get(&rkey, 0).is_ok(), "tc used the SNAT port XDP took ({port})");
        assert_eq!(
            (&out[26..30], &out[30..34]),
            (&NODE[..], &REMOTE_BACKEND[..]),
            "DNAT + SNAT as XDP chose"
        );
        assert!(checksums_valid(&out));
        assert_eq!(x.stat(Stat::DnatNew), 1, "one pick for the flow, not a second one in tc");
    });
}

/// kube-proxy masquerades off-cluster traffic to a cluster IP only where it knows the cluster CIDR
/// (its local-traffic detector; with no cluster CIDR it writes no masquerade rule), and so does the
/// external tc program: with none known, an outside client reaching a cluster IP routed to the
/// node keeps its address on the way to a local backend (DNAT alone, to the stack); with
/// `--cluster-cidr` 10.244.0.0/16 the client is outside it, and its flow is source-NATed to the
/// node and sent to the pod's veth.
#[test]
fn a_cluster_ip_from_outside_is_masqueraded_to_a_local_backend_only_when_the_cluster_cidr_is_known() {
    in_private_netns(|ingress| {
        const CLUSTER_IP: [u8; 4] = [10, 96, 0, 10];
        let mut x = Xdp0::new(ingress, vec![web(FrontendKind::ClusterIp, CLUSTER_IP, 80, &[LOCAL_BACKEND])]);
        let syn = |port: u16| frame_to_node(&Packet::tcp(CLIENT, port, CLUSTER_IP, 80, TCP_SYN));
        let flags = |x: &Xdp0, port: u16| {
            let key = ct_key(CLIENT, port, CLUSTER_IP, 80, IPPROTO_TCP, CT_DIR_FORWARD);
            x.conntrack.get(&key, 0).unwrap().flags & CT_FLAG_SNAT
        };

        let (action, out) = x.tc(&syn(40010));
        assert_eq!(action, TCX_NEXT, "DNAT alone, to the stack: {out:02x?}");
        assert_eq!(&out[26..30], &CLIENT, "the client's own address");
        assert_eq!(&out[30..34], &LOCAL_BACKEND);
        assert_eq!(flags(&x, 40010), 0);

        let known = proxy_common::maps::NodePortConfigV4 {
            cluster_cidr: [10, 244, 0, 0],
            cluster_cidr_prefix: 16,
            ..x.nodeport_config.get(&0, 0).unwrap()
        };
        x.nodeport_config.set(0, known, 0).unwrap();
        let (action, out) = x.tc(&syn(40011));
        assert_eq!(action, TC_ACT_REDIRECT, "to the pod's veth: {out:02x?}");
        assert_eq!(&out[26..30], &NODE, "masqueraded to the node");
        assert_eq!(&out[30..34], &LOCAL_BACKEND);
        assert_eq!(flags(&x, 40011), CT_FLAG_SNAT);
        assert!(checksums_valid(&out));
    });
}

/// Source ranges admit new connections: narrowing them keeps the established ones, through XDP as
/// through tc (which finds a known flow before its frontend) and kube-proxy's firewall rules; XDP
/// checked the ranges first and dropped the established flow's next segment.
#[test]
fn an_established_flow_goes_on_through_xdp_when_its_source_ranges_narrow_and_new_ones_are_dropped() {
    in_private_netns(|ingress| {
        const LB_IP: [u8; 4] = [192, 168, 200, 11];
        let lb = |client: [u8; 4]| {
            let mut lb = web(FrontendKind::LoadBalancer, LB_IP, 80, &[REMOTE_BACKEND]);
            lb.source_ranges = vec![Cidr4::new(Ipv4Addr::from(client), 32).unwrap().into()];
            lb
        };
        let mut x = Xdp0::new(ingress, vec![lb(CLIENT)]);
        let (action, out) = x.xdp(&frame_to_node(&Packet::tcp(CLIENT, 40010, LB_IP, 80, TCP_SYN)));
        assert_eq!(action, XDP_REDIRECT);
        let port = u16::from_be_bytes([out[34], out[35]]);

        let report = x._syncer.apply(&kproxy::model::Desired::new(vec![lb(OTHER_CLIENT)]));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let ack = Packet::tcp(CLIENT, 40010, LB_IP, 80, TCP_ACK).with_payload(b"go on");
        let (action, out) = x.xdp(&frame_to_node(&ack));
        assert_eq!(action, XDP_REDIRECT, "the established flow goes on");
        let translated = Packet { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..ack };
        assert_eq!(out, expected(&translated, PEER_MAC));
        assert!(checksums_valid(&out));

        let new = frame_to_node(&Packet::tcp(CLIENT, 40011, LB_IP, 80, TCP_SYN));
        assert_eq!(x.xdp(&new).0, XDP_DROP, "a new connection from outside the ranges is dropped");
        assert_eq!(x.stat(Stat::DropSourceRange), 1);
    });
}
