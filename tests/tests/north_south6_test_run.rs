//! BPF_PROG_TEST_RUN of the external tc program (`kproxy_external_ingress`) on IPv6 frames (issue 19):
//! byte-exact rewrites of a NodePort flow to a backend on another node (DNAT + SNAT to the node's
//! IPv6 address, sent back out with the route's MACs) and of its reply, a NodePort flow to a local
//! backend (DNAT only, its reply un-NATed by the egress program), a cluster IP reached from
//! outside `--cluster-cidr` (masqueraded to a local backend too, its reply turned back on the pod's
//! veth), and `externalTrafficPolicy: Local` without a local endpoint (dropped). Every expected frame is built from scratch here, its L4
//! checksum computed over the IPv6 pseudo-header by proxy_common's reference math, and every
//! output's checksum is verified the same way.
//!
//! The route lookups need an interface, routes and neighbours: each test runs in a thread that
//! moves itself into a new network namespace (`unshare(CLONE_NEWNET)`) with one veth pair to the
//! "underlay" (static neighbours, the peer node's pod prefix routed via it, no route out) and one to
//! a local pod. The namespace disappears with the thread. The maps are programmed through the
//! agent's Syncer; EXTERNAL_IFACES_V6 is written as the agent writes it.

use std::net::Ipv6Addr;
use std::process::Command;

use aya::maps::{HashMap, MapData, PerCpuArray};
use kproxy::{
    bpf,
    model::{BackendAddr, Desired, Frontend, FrontendKind, Scope, ServiceName},
    net::Protocol,
    sync::Syncer,
};
use proxy_common::{
    checksum,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_SNAT, IPPROTO_TCP, IPPROTO_UDP},
    maps_v6::{CtEntryV6, CtKeyV6, ExternalIfaceV6, SnatEntryV6},
    packet::{TCP_ACK, TCP_SYN},
    packet6::IPPROTO_ICMPV6,
    stats::Stat,
};

mod common;

use common::harness::{DROP, PASS as TCX_NEXT, test_run};

const TC_ACT_REDIRECT: u32 = 7;

const fn addr6(net: u16, subnet: u16, host: u16) -> [u8; 16] {
    let (n, s, h) = (net.to_be_bytes(), subnet.to_be_bytes(), host.to_be_bytes());
    [0xfd, 0x00, n[0], n[1], s[0], s[1], 0, 0, 0, 0, 0, 0, 0, 0, h[0], h[1]]
}

/// The underlay fd00:192:168:100::/64: this node, the peer node, an external client.
const NODE: [u8; 16] = addr6(0x0192, 0x0100, 0x10);
const PEER: [u8; 16] = addr6(0x0192, 0x0100, 0x11);
const CLIENT: [u8; 16] = addr6(0x0192, 0x0100, 0x200);
/// A router between the nodes (on a smaller-MTU link).
const ROUTER: [u8; 16] = addr6(0x0192, 0x0100, 0x01);
/// A pod of the peer node (fd00:244:1::/64, routed via the peer) and one of this node
/// (fd00:244::/64 on pod0).
const REMOTE_BACKEND: [u8; 16] = addr6(0x0244, 0x0001, 0x05);
const LOCAL_BACKEND: [u8; 16] = addr6(0x0244, 0x0000, 0x05);
const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x11];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xc8];
const LOCAL_POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x05];

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn ip(a: [u8; 16]) -> String {
    Ipv6Addr::from(a).to_string()
}

/// Runs `test` in a thread inside a fresh network namespace with `ext0` (the node's external
/// interface, NODE/64, the peer node and the client as permanent neighbours, the peer's pod prefix
/// routed via it) and `pod0` (a local pod's veth, fd00:244::/64 on it), IPv6 forwarding on; `test`
/// gets ext0's index.
fn in_private_netns6(test: impl FnOnce(u32) + Send + 'static) {
    let result = std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread, which owns nothing shared yet.
        let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(ret, 0, "unshare(CLONE_NEWNET) needs root: {}", std::io::Error::last_os_error());
        for knob in ["all/disable_ipv6", "default/disable_ipv6"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{knob}"), "0").unwrap();
        }
        sh(&["ip", "link", "add", "ext0", "address", &mac(NODE_MAC), "type", "veth", "peer", "name", "ext1"]);
        sh(&["ip", "link", "add", "pod0", "type", "veth", "peer", "name", "pod1"]);
        for dev in ["lo", "ext0", "ext1", "pod0", "pod1"] {
            sh(&["ip", "link", "set", dev, "up"]);
        }
        // bpf_fib_lookup answers IPv6 only where the ingress interface forwards.
        std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").unwrap();
        sh(&["ip", "-6", "addr", "add", &format!("{}/64", ip(NODE)), "dev", "ext0", "nodad"]);
        sh(&["ip", "-6", "route", "add", "fd00:244:1::/64", "via", &ip(PEER), "dev", "ext0"]);
        sh(&["ip", "-6", "route", "add", "fd00:244::/64", "dev", "pod0"]);
        for (addr, m, dev) in
            [(PEER, PEER_MAC, "ext0"), (CLIENT, CLIENT_MAC, "ext0"), (LOCAL_BACKEND, LOCAL_POD_MAC, "pod0")]
        {
            sh(&[
                "ip",
                "-6",
                "neigh",
                "replace",
                &ip(addr),
                "lladdr",
                &mac(m),
                "dev",
                dev,
                "nud",
                "permanent",
            ]);
        }
        let index = bpf::interfaces().unwrap().into_iter().find(|i| i.name == "ext0").unwrap().index;
        test(index);
    })
    .join();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

fn web(kind: FrontendKind, vip: [u8; 16], port: u16, backends: &[[u8; 16]]) -> Frontend {
    let mut fe = Frontend::new(
        ServiceName { namespace: "default".into(), name: "web".into() },
        "http",
        Ipv6Addr::from(vip),
        port,
        Protocol::Tcp,
        backends.iter().map(|a| BackendAddr { addr: Ipv6Addr::from(*a).into(), port: 80 }).collect(),
    );
    fe.kind = kind;
    fe
}

/// The real object, its maps programmed with `frontends` and ext0's IPv6 address.
struct Node6 {
    ebpf: aya::Ebpf,
    _syncer: Syncer,
    conntrack: HashMap<MapData, CtKeyV6, CtEntryV6>,
    snat: HashMap<MapData, CtKeyV6, SnatEntryV6>,
    stats: PerCpuArray<MapData, u64>,
    service_cidrs: aya::maps::Array<MapData, proxy_common::service_cidr::ServiceCidrsV6>,
    nodeport_config6: aya::maps::Array<MapData, proxy_common::maps_v6::NodePortConfigV6>,
    ingress: u32,
}

impl Node6 {
    fn new(ingress: u32, frontends: Vec<Frontend>) -> Self {
        let mut ebpf = bpf::load_unpinned().expect("loading the datapath needs root");
        let maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        let mut own = maps.try_clone().unwrap();
        own.external_ifaces_v6.insert(ingress, ExternalIfaceV6 { addr: NODE }, 0).unwrap();
        let mut syncer = Syncer::with_store(bpf::BpfStore::from_maps(maps, false)).unwrap();
        let report = syncer.apply(&Desired::new(frontends));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        Self {
            ebpf,
            _syncer: syncer,
            conntrack: own.conntrack_v6,
            snat: own.snat_v6,
            stats: own.stats,
            service_cidrs: own.service_cidrs_v6,
            nodeport_config6: own.nodeport_config_v6,
            ingress,
        }
    }

    /// `program` on a frame that arrived on ext0.
    fn run(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run_on(program, self.ingress, frame)
    }

    /// `program` on a frame that arrived on interface `ifindex`.
    fn run_on(&self, program: &str, ifindex: u32, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &aya::programs::SchedClassifier = self.ebpf.program(program).unwrap().try_into().unwrap();
        // struct __sk_buff up to ifindex (offset 40), which picks the device the packet is on.
        let mut ctx = [0u8; 192];
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        test_run(prog, frame, Some(&ctx))
    }

    fn external(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run("kproxy_external_ingress", frame)
    }

    fn stat(&self, stat: Stat) -> u64 {
        self.stats.get(&(stat as u32), 0).unwrap().iter().sum()
    }

    fn ct(&self, key: &CtKeyV6) -> Option<CtEntryV6> {
        self.conntrack.get(key, 0).ok()
    }
}

fn ct_key6(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, proto: u8, direction: u8) -> CtKeyV6 {
    CtKeyV6 {
        saddr: src,
        daddr: dst,
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto,
        direction,
        _pad: [0; 2],
    }
}

/// An IPv6 TCP or UDP packet in an Ethernet frame (to `dmac` from `smac`), its L4 checksum computed
/// from scratch over the pseudo-header; a flow label, traffic class and hop limit the datapath
/// must keep.
#[derive(Clone, Debug)]
struct Packet6 {
    src: [u8; 16],
    dst: [u8; 16],
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    payload: Vec<u8>,
}

impl Packet6 {
    fn tcp(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, flags: u8, payload: &[u8]) -> Self {
        Self { src, dst, sport, dport, proto: IPPROTO_TCP, tcp_flags: flags, payload: payload.to_vec() }
    }

    fn udp(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, payload: &[u8]) -> Self {
        Self { proto: IPPROTO_UDP, ..Self::tcp(src, sport, dst, dport, 0, payload) }
    }

    fn frame(&self, dmac: [u8; 6], smac: [u8; 6]) -> Vec<u8> {
        let mut seg = Vec::new();
        seg.extend_from_slice(&self.sport.to_be_bytes());
        seg.extend_from_slice(&self.dport.to_be_bytes());
        let check_at = if self.proto == IPPROTO_TCP {
            seg.extend_from_slice(&0x0102_0304u32.to_be_bytes());
            seg.extend_from_slice(&0u32.to_be_bytes());
            seg.extend_from_slice(&[5 << 4, self.tcp_flags]);
            seg.extend_from_slice(&64800u16.to_be_bytes());
            seg.extend_from_slice(&[0, 0, 0, 0]);
            16
        } else {
            seg.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
            seg.extend_from_slice(&[0, 0]);
            6
        };
        seg.extend_from_slice(&self.payload);
        let check = checksum::l4_checksum_v6(&self.src, &self.dst, self.proto, &seg);
        seg[check_at..check_at + 2].copy_from_slice(&check.to_be_bytes());
        let mut frame = Vec::new();
        frame.extend_from_slice(&dmac);
        frame.extend_from_slice(&smac);
        frame.extend_from_slice(&0x86ddu16.to_be_bytes());
        let len = (seg.len() as u16).to_be_bytes();
        frame.extend_from_slice(&[0x60, 0x0a, 0xbc, 0xde, len[0], len[1], self.proto, 61]);
        frame.extend_from_slice(&self.src);
        frame.extend_from_slice(&self.dst);
        frame.extend_from_slice(&seg);
        frame
    }
}

/// An ICMPv6 message of `kind`/`code` (4 bytes of `word`, then `quote`) in a frame to `dmac` from
/// `smac`, its checksum computed over the pseudo-header.
fn icmp6_frame(
    src: [u8; 16],
    dst: [u8; 16],
    kind: u8,
    word: u32,
    quote: &[u8],
    dmac: [u8; 6],
    smac: [u8; 6],
) -> Vec<u8> {
    let mut message = vec![kind, 0, 0, 0];
    message.extend_from_slice(&word.to_be_bytes());
    message.extend_from_slice(quote);
    let check = checksum::l4_checksum_v6(&src, &dst, IPPROTO_ICMPV6, &message);
    message[2..4].copy_from_slice(&check.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend_from_slice(&dmac);
    frame.extend_from_slice(&smac);
    frame.extend_from_slice(&0x86ddu16.to_be_bytes());
    let len = (message.len() as u16).to_be_bytes();
    frame.extend_from_slice(&[0x60, 0, 0, 0, len[0], len[1], IPPROTO_ICMPV6, 64]);
    frame.extend_from_slice(&src);
    frame.extend_from_slice(&dst);
    frame.extend_from_slice(&message);
    frame
}

/// Whether the L4 checksum of a frame built here is right, recomputed over the pseudo-header.
fn l4_checksum_valid(frame: &[u8]) -> bool {
    let (src, dst): ([u8; 16], [u8; 16]) =
        (frame[22..38].try_into().unwrap(), frame[38..54].try_into().unwrap());
    let end = 54 + usize::from(u16::from_be_bytes([frame[18], frame[19]]));
    let segment = &frame[54..end];
    let pseudo = checksum::pseudo_header_sum_v6(&src, &dst, frame[20], segment.len() as u32);
    checksum::is_valid(checksum::add_words(pseudo, segment))
}

/// The source port of a frame built here.
fn source_port(frame: &[u8]) -> u16 {
    u16::from_be_bytes([frame[54], frame[55]])
}

#[test]
fn a_v6_nodeport_flow_to_a_remote_backend_is_dnated_snated_to_the_node_and_sent_out_and_so_is_its_reply() {
    in_private_netns6(|ingress| {
        let node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet6::tcp(CLIENT, 40000, NODE, 30080, TCP_SYN, b"hello");
        let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "{out:02x?}");

        // The SNAT port is the one the datapath took: the forward entry and SNAT_V6 agree on it.
        let fwd =
            node.ct(&ct_key6(CLIENT, 40000, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD)).expect("forward");
        assert_eq!(fwd.flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        assert_eq!((fwd.nat_addr, u16::from_be_bytes(fwd.nat_port)), (REMOTE_BACKEND, 80));
        let port = source_port(&out);
        assert!((61000..=65535).contains(&port), "SNAT port {port}");
        let to_node =
            node.snat.get(&ct_key6(CLIENT, 40000, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD), 0).unwrap();
        assert_eq!((to_node.addr, u16::from_be_bytes(to_node.port)), (NODE, port));
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..syn.clone() };
        assert_eq!(
            out,
            translated.frame(PEER_MAC, NODE_MAC),
            "DNAT + SNAT, hop limit and flow label kept, MACs of the route to the peer node"
        );
        assert!(l4_checksum_valid(&out));
        let reply_key = ct_key6(REMOTE_BACKEND, 80, NODE, port, IPPROTO_TCP, CT_DIR_REPLY);
        let reply = node.ct(&reply_key).expect("reply entry keyed by the node address and SNAT port");
        assert_eq!((reply.nat_addr, u16::from_be_bytes(reply.nat_port)), (NODE, 30080));
        assert_eq!(reply.flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        let to_client = node.snat.get(&reply_key, 0).unwrap();
        assert_eq!((to_client.addr, u16::from_be_bytes(to_client.port)), (CLIENT, 40000));
        assert_eq!((node.stat(Stat::DnatNew), node.stat(Stat::SnatNew)), (1, 1));

        // The backend's answer, to the node address and SNAT port, goes back to the client from
        // the NodePort, out of ext0 to the client's MAC.
        let syn_ack = Packet6::tcp(REMOTE_BACKEND, 80, NODE, port, TCP_SYN | TCP_ACK, b"world!");
        let (action, out) = node.external(&syn_ack.frame(NODE_MAC, PEER_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "{out:02x?}");
        let back = Packet6 { src: NODE, sport: 30080, dst: CLIENT, dport: 40000, ..syn_ack };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::SnatReverse), 1);

        // The client's next segment follows the same translation, port and route.
        let ack = Packet6::tcp(CLIENT, 40000, NODE, 30080, TCP_ACK, b"more");
        let (action, out) = node.external(&ack.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT);
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..ack };
        assert_eq!(out, translated.frame(PEER_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::DnatEstablished), 1);
    });
}

#[test]
fn a_v6_nodeport_datagram_to_a_remote_backend_is_source_natted_with_its_udp_checksum_right() {
    in_private_netns6(|ingress| {
        let mut dns = web(FrontendKind::NodePort, NODE, 30053, &[REMOTE_BACKEND]);
        dns.proto = Protocol::Udp;
        let node = Node6::new(ingress, vec![dns]);
        let query = Packet6::udp(CLIENT, 5353, NODE, 30053, b"a query of odd length");
        let (action, out) = node.external(&query.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "{out:02x?}");
        let port = source_port(&out);
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..query.clone() };
        assert_eq!(out, translated.frame(PEER_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));

        let answer = Packet6::udp(REMOTE_BACKEND, 80, NODE, port, b"an answer");
        let (action, out) = node.external(&answer.frame(NODE_MAC, PEER_MAC));
        assert_eq!(action, TC_ACT_REDIRECT);
        let back = Packet6 { src: NODE, sport: 30053, dst: CLIENT, dport: 5353, ..answer };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));
    });
}

#[test]
fn an_echo_request_from_outside_to_an_unallocated_v6_service_address_is_dropped_and_neighbour_discovery_passes()
 {
    in_private_netns6(|ingress| {
        let mut node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[LOCAL_BACKEND])]);
        let range = kproxy::net::Cidr6::new(std::net::Ipv6Addr::from(addr6(0x1000, 0x0096, 0)), 64).unwrap();
        bpf::service_cidrs::write6(&mut node.service_cidrs, &[range]).unwrap();
        let unallocated = addr6(0x1000, 0x0096, 0xc9);
        let echo = icmp6_frame(CLIENT, unallocated, 128, 0x0001_0001, b"ping", NODE_MAC, CLIENT_MAC);
        assert_eq!(
            node.external(&echo).0,
            DROP,
            "kube-proxy's cluster-ips-check drops it on every interface"
        );
        assert_eq!(node.stat(Stat::DropUnallocatedServiceIp), 1);
        let echo_reply = icmp6_frame(CLIENT, unallocated, 129, 0x0001_0001, b"ping", NODE_MAC, CLIENT_MAC);
        let neighbour_solicitation =
            icmp6_frame(CLIENT, unallocated, 135, 0, &unallocated, NODE_MAC, CLIENT_MAC);
        let echo_to_the_node = icmp6_frame(CLIENT, NODE, 128, 0x0001_0001, b"ping", NODE_MAC, CLIENT_MAC);
        for frame in [echo_reply, neighbour_solicitation, echo_to_the_node] {
            assert_eq!(node.external(&frame), (TCX_NEXT, frame.clone()), "{:02x?}", &frame[14..]);
        }
        assert_eq!(node.stat(Stat::DropUnallocatedServiceIp), 1);
    });
}

#[test]
fn a_v6_nodeport_flow_to_a_local_backend_is_dnated_only_and_its_reply_un_nated_on_the_way_out() {
    in_private_netns6(|ingress| {
        let node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[LOCAL_BACKEND])]);
        let syn = Packet6::tcp(CLIENT, 40001, NODE, 30080, TCP_SYN, b"");
        let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TCX_NEXT, "to the stack, which routes it to the pod");
        let translated = Packet6 { dst: LOCAL_BACKEND, dport: 80, ..syn };
        assert_eq!(out, translated.frame(NODE_MAC, CLIENT_MAC), "DNAT alone: the backend sees the client");
        assert!(l4_checksum_valid(&out));
        let fwd = node.ct(&ct_key6(CLIENT, 40001, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
        assert_eq!(fwd.flags & CT_FLAG_SNAT, 0);
        assert_eq!(node.stat(Stat::SnatNew), 0);

        // Its answer leaves through the external interface's egress, from the NodePort again.
        let syn_ack = Packet6::tcp(LOCAL_BACKEND, 80, CLIENT, 40001, TCP_SYN | TCP_ACK, b"");
        let (action, out) = node.run("kproxy_egress", &syn_ack.frame(CLIENT_MAC, NODE_MAC));
        assert_eq!(action, TCX_NEXT);
        let back = Packet6 { src: NODE, sport: 30080, ..syn_ack };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));
    });
}

#[test]
fn external_traffic_policy_local_drops_v6_clients_without_a_local_endpoint_and_keeps_the_client_with_one() {
    in_private_netns6(|ingress| {
        // Policy Local: the internal entry has every endpoint; the external one this node's.
        let local_entry = |vip: [u8; 16], port: u16, local: &[[u8; 16]], all: &[[u8; 16]]| {
            let internal = Frontend { external_local: true, ..web(FrontendKind::NodePort, vip, port, all) };
            let external = Frontend {
                scope: Scope::External,
                local_only: true,
                no_local_endpoints: local.is_empty(),
                ..web(FrontendKind::NodePort, vip, port, local)
            };
            [internal, external]
        };
        let mut frontends = local_entry(NODE, 30090, &[], &[REMOTE_BACKEND]).to_vec();
        frontends.extend(local_entry(NODE, 30091, &[LOCAL_BACKEND], &[REMOTE_BACKEND, LOCAL_BACKEND]));
        let node = Node6::new(ingress, frontends);

        let syn = Packet6::tcp(CLIENT, 40002, NODE, 30090, TCP_SYN, b"");
        let (action, _) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, DROP, "no local endpoint: dropped, not refused nor sent elsewhere");
        assert_eq!(node.stat(Stat::DropNoLocalEndpoint), 1);
        assert!(node.ct(&ct_key6(CLIENT, 40002, NODE, 30090, IPPROTO_TCP, CT_DIR_FORWARD)).is_none());

        // With one, every new flow goes to it, unSNATed, however many remote endpoints there are.
        for client_port in 40010..40020 {
            let syn = Packet6::tcp(CLIENT, client_port, NODE, 30091, TCP_SYN, b"");
            let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
            assert_eq!(action, TCX_NEXT);
            assert_eq!(out, Packet6 { dst: LOCAL_BACKEND, dport: 80, ..syn }.frame(NODE_MAC, CLIENT_MAC));
        }
        assert_eq!(node.stat(Stat::SnatNew), 0);
    });
}

#[test]
fn a_v6_load_balancer_ip_admits_only_clients_in_its_ipv6_source_ranges_from_outside_and_from_pods() {
    in_private_netns6(|ingress| {
        const LB_IP: [u8; 16] = addr6(0x0203, 0x0000, 0x10);
        /// Outside the ranges: another client of the underlay's neighbourhood, and a pod.
        const OUTSIDER: [u8; 16] = addr6(0x0198, 0x0051, 0x07);
        const POD: [u8; 16] = addr6(0x0244, 0x0000, 0x09);
        let mut lb = web(FrontendKind::LoadBalancer, LB_IP, 80, &[LOCAL_BACKEND]);
        // The client's /64 and one pod's address.
        lb.source_ranges = vec![
            format!("{}/64", ip(CLIENT)).parse().unwrap(),
            format!("{}/128", ip(LOCAL_BACKEND)).parse().unwrap(),
        ];
        let node = Node6::new(ingress, vec![lb]);

        let syn = Packet6::tcp(CLIENT, 40100, LB_IP, 80, TCP_SYN, b"");
        let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TCX_NEXT, "a client in a range is admitted");
        assert_eq!(out, Packet6 { dst: LOCAL_BACKEND, ..syn }.frame(NODE_MAC, CLIENT_MAC));
        assert!(l4_checksum_valid(&out));

        let denied = Packet6::tcp(OUTSIDER, 40101, LB_IP, 80, TCP_SYN, b"");
        let (action, _) = node.external(&denied.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, DROP, "a client outside every range is dropped");
        assert_eq!(node.stat(Stat::DropSourceRange), 1);
        assert!(node.ct(&ct_key6(OUTSIDER, 40101, LB_IP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).is_none());

        // Pods are filtered on their veth too (kube-proxy checks every source before DNAT).
        let from_pod = Packet6::tcp(POD, 40102, LB_IP, 80, TCP_SYN, b"");
        let (action, _) = node.run("kproxy_ingress", &from_pod.frame(NODE_MAC, LOCAL_POD_MAC));
        assert_eq!(action, DROP, "a pod outside every range");
        assert_eq!(node.stat(Stat::DropSourceRange), 2);
        let from_admitted_pod = Packet6::tcp(LOCAL_BACKEND, 40103, LB_IP, 80, TCP_SYN, b"");
        let (action, out) = node.run("kproxy_ingress", &from_admitted_pod.frame(NODE_MAC, LOCAL_POD_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "a pod in a range (here the backend itself: hairpin, sent back)");
        assert_eq!(&out[38..54], &LOCAL_BACKEND[..], "translated to the backend");
        assert_eq!(node.stat(Stat::DropSourceRange), 2);
    });
}

#[test]
fn packet_too_big_about_a_source_natted_v6_flow_reaches_the_client_about_its_own_packet() {
    in_private_netns6(|ingress| {
        let node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let big = Packet6::tcp(CLIENT, 40003, NODE, 30080, TCP_SYN, &[0x55; 200]);
        let (action, out) = node.external(&big.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT);
        let port = source_port(&out);

        // A router between the nodes cannot forward it: its error to the node quotes the
        // translated packet (node:SNAT port → backend).
        const PACKET_TOO_BIG: u8 = 2;
        let error = icmp6_frame(ROUTER, NODE, PACKET_TOO_BIG, 1280, &out[14..], NODE_MAC, PEER_MAC);
        let (action, got) = node.external(&error);
        assert_eq!(action, TC_ACT_REDIRECT, "{got:02x?}");
        // The client hears of its own packet (client:port → NodePort), from the router, at its MAC.
        // The quote's own TCP checksum is left as it was: receivers do not check a quote's.
        let mut quote = out[14..].to_vec();
        quote[8..24].copy_from_slice(&CLIENT);
        quote[24..40].copy_from_slice(&NODE);
        quote[40..42].copy_from_slice(&40003u16.to_be_bytes());
        quote[42..44].copy_from_slice(&30080u16.to_be_bytes());
        let want = icmp6_frame(ROUTER, CLIENT, PACKET_TOO_BIG, 1280, &quote, CLIENT_MAC, NODE_MAC);
        assert_eq!(got, want, "quote and outer destination un-NATed, the ICMPv6 checksum right");
        assert_ne!(port, 40003);
        assert_eq!(node.stat(Stat::IcmpErrorUnnat), 1);

        // One about a flow the node never source-NATed is left to the node.
        let mut stray = out[14..].to_vec();
        stray[42..44].copy_from_slice(&(port ^ 1).to_be_bytes());
        let error = icmp6_frame(ROUTER, NODE, PACKET_TOO_BIG, 1280, &stray, NODE_MAC, PEER_MAC);
        let (action, got) = node.external(&error);
        assert_eq!((action, got), (TCX_NEXT, error));
    });
}

#[test]
fn a_v6_client_reaching_the_pod_directly_from_the_port_of_its_live_nodeport_flow_is_remapped() {
    in_private_netns6(|ingress| {
        let node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[LOCAL_BACKEND])]);
        // client:40004 → NodePort → the local pod, live.
        let syn = Packet6::tcp(CLIENT, 40004, NODE, 30080, TCP_SYN, b"");
        assert_eq!(node.external(&syn.frame(NODE_MAC, CLIENT_MAC)).0, TCX_NEXT);
        // The same client port straight to the pod (a routed pod network): the same reply tuple,
        // so its source port is remapped, and the pod's answer gets the client's port back.
        let direct = Packet6::tcp(CLIENT, 40004, LOCAL_BACKEND, 80, TCP_SYN, b"");
        let (action, out) = node.external(&direct.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TCX_NEXT);
        let port = source_port(&out);
        assert!((61000..=65535).contains(&port), "remapped to {port}");
        assert_eq!(out, Packet6 { sport: port, ..direct.clone() }.frame(NODE_MAC, CLIENT_MAC));
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::PortRemapped), 1);

        let answer = Packet6::tcp(LOCAL_BACKEND, 80, CLIENT, port, TCP_SYN | TCP_ACK, b"");
        let (action, out) = node.run("kproxy_egress", &answer.frame(CLIENT_MAC, NODE_MAC));
        assert_eq!(action, TCX_NEXT);
        let back = Packet6 { dport: 40004, ..answer };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC), "from the pod itself, to the client's own port");
        // The NodePort flow's answer still comes from the NodePort.
        let answer = Packet6::tcp(LOCAL_BACKEND, 80, CLIENT, 40004, TCP_SYN | TCP_ACK, b"");
        let (_, out) = node.run("kproxy_egress", &answer.frame(CLIENT_MAC, NODE_MAC));
        assert_eq!(out, Packet6 { src: NODE, sport: 30080, ..answer }.frame(CLIENT_MAC, NODE_MAC));

        // Direct traffic that clashes with nothing is untouched.
        let other = Packet6::tcp(CLIENT, 40005, LOCAL_BACKEND, 80, TCP_SYN, b"");
        let frame = other.frame(NODE_MAC, CLIENT_MAC);
        assert_eq!(node.external(&frame), (TCX_NEXT, frame.clone()));
    });
}

/// A cluster IP (no NodePort) routed to the node, with its one backend on this node.
const CLUSTER_IP: [u8; 16] = addr6(0x0010, 0x0096, 0x10);

/// kube-proxy masquerades a client outside `--cluster-cidr` reaching a cluster IP (its
/// `! -s clusterCIDR -d clusterIP` rule), even to a local backend: the SYN leaves for the pod from
/// the node's address and a SNAT port, and the pod's answer — to that address and port, seen on
/// its veth by the pod-side program — goes back to the client from the cluster IP, out of ext0.
/// A client inside the cluster CIDR keeps its address (DNAT alone), so does every client when no
/// cluster CIDR is known (kube-proxy's no-op local detector writes no masquerade rule), and so
/// does anyone reaching a NodePort (`a_v6_nodeport_flow_to_a_local_backend_...`).
#[test]
fn a_v6_cluster_ip_reached_from_outside_the_cluster_cidr_is_masqueraded_even_to_a_local_backend() {
    in_private_netns6(|ingress| {
        let mut node =
            Node6::new(ingress, vec![web(FrontendKind::ClusterIp, CLUSTER_IP, 80, &[LOCAL_BACKEND])]);
        // The pods' prefix, fd00:244::/32: the outside client is not in it.
        let cluster_cidr = proxy_common::maps_v6::NodePortConfigV6::new(Some((addr6(0x0244, 0, 0), 32)));
        node.nodeport_config6.set(0, cluster_cidr, 0).unwrap();
        let pod0 = bpf::interfaces().unwrap().into_iter().find(|i| i.name == "pod0").unwrap().index;

        let syn = Packet6::tcp(CLIENT, 40002, CLUSTER_IP, 80, TCP_SYN, b"hello");
        let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "straight to the pod's veth: {out:02x?}");
        let port = source_port(&out);
        assert!((61000..=65535).contains(&port), "SNAT port {port}");
        let translated = Packet6 { src: NODE, sport: port, dst: LOCAL_BACKEND, dport: 80, ..syn.clone() };
        assert_eq!(&out[..6], &LOCAL_POD_MAC, "to the pod's MAC");
        assert_eq!(out[12..], translated.frame(LOCAL_POD_MAC, NODE_MAC)[12..], "DNAT + SNAT to the node");
        assert!(l4_checksum_valid(&out));
        let fwd = node.ct(&ct_key6(CLIENT, 40002, CLUSTER_IP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
        assert_eq!(fwd.flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        assert_eq!(node.stat(Stat::SnatNew), 1);

        let syn_ack = Packet6::tcp(LOCAL_BACKEND, 80, NODE, port, TCP_SYN | TCP_ACK, b"world!");
        let (action, out) = node.run_on("kproxy_ingress", pod0, &syn_ack.frame(NODE_MAC, LOCAL_POD_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "{out:02x?}");
        let back = Packet6 { src: CLUSTER_IP, sport: 80, dst: CLIENT, dport: 40002, ..syn_ack };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC), "from the cluster IP to the client, out of ext0");
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::SnatReverse), 1);

        // A client inside the cluster CIDR (another node's pod, routed in) is not masqueraded.
        let inside = addr6(0x0244, 0x0002, 0x07);
        let syn = Packet6::tcp(inside, 40003, CLUSTER_IP, 80, TCP_SYN, b"");
        let (action, out) = node.external(&syn.frame(NODE_MAC, PEER_MAC));
        assert_eq!(action, TCX_NEXT, "{out:02x?}");
        let translated = Packet6 { dst: LOCAL_BACKEND, dport: 80, ..syn };
        assert_eq!(out, translated.frame(NODE_MAC, PEER_MAC), "DNAT alone: the backend sees the pod");
        assert_eq!(node.stat(Stat::SnatNew), 1);

        // With no cluster CIDR known, no client is taken for an outside one: kube-proxy's no-op local
        // detector writes no masquerade rule, and the outside client keeps its address too.
        node.nodeport_config6.set(0, proxy_common::maps_v6::NodePortConfigV6::new(None), 0).unwrap();
        let syn = Packet6::tcp(CLIENT, 40004, CLUSTER_IP, 80, TCP_SYN, b"");
        let (action, out) = node.external(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TCX_NEXT, "{out:02x?}");
        assert_eq!(out, Packet6 { dst: LOCAL_BACKEND, dport: 80, ..syn }.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(node.stat(Stat::SnatNew), 1);
    });
}

// XDP (`kproxy_xdp`) on the same frames: the IPv6 fast path for remote backends, and what it leaves
// to tc. Its actions are XDP's, not tc's.
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

impl Node6 {
    /// The XDP program on a frame that arrived on ext0.
    fn xdp(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &aya::programs::Xdp = self.ebpf.program("kproxy_xdp").unwrap().try_into().unwrap();
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&self.ingress.to_ne_bytes());
        test_run(prog, frame, Some(&ctx))
    }
}

#[test]
fn xdp_sends_a_v6_nodeport_flow_to_a_remote_backend_back_out_dnated_and_snated_and_its_reply_to_the_client() {
    in_private_netns6(|ingress| {
        let mut node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet6::tcp(CLIENT, 40200, NODE, 30080, TCP_SYN, b"hello");
        let (action, out) = node.xdp(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT, "{out:02x?}");
        let fwd_key = ct_key6(CLIENT, 40200, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD);
        let fwd = node.ct(&fwd_key).expect("XDP recorded the flow");
        assert_eq!(fwd.flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        assert_eq!((fwd.nat_addr, u16::from_be_bytes(fwd.nat_port)), (REMOTE_BACKEND, 80));
        let port = source_port(&out);
        assert!((61000..=65535).contains(&port), "SNAT port {port}");
        let to_node = node.snat.get(&fwd_key, 0).unwrap();
        assert_eq!((to_node.addr, u16::from_be_bytes(to_node.port)), (NODE, port));
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..syn.clone() };
        assert_eq!(
            out,
            translated.frame(PEER_MAC, NODE_MAC),
            "the frame tc would send: DNAT + SNAT, hop limit and flow label kept, the peer node's MACs"
        );
        assert!(l4_checksum_valid(&out));
        let reply_key = ct_key6(REMOTE_BACKEND, 80, NODE, port, IPPROTO_TCP, CT_DIR_REPLY);
        assert_eq!(node.ct(&reply_key).expect("reply entry").flags & CT_FLAG_SNAT, CT_FLAG_SNAT);
        assert_eq!((node.stat(Stat::DnatNew), node.stat(Stat::SnatNew)), (1, 1));

        let syn_ack = Packet6::tcp(REMOTE_BACKEND, 80, NODE, port, TCP_SYN | TCP_ACK, b"world!");
        let (action, out) = node.xdp(&syn_ack.frame(NODE_MAC, PEER_MAC));
        assert_eq!(action, XDP_REDIRECT, "{out:02x?}");
        let back = Packet6 { src: NODE, sport: 30080, dst: CLIENT, dport: 40200, ..syn_ack };
        assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC), "from the NodePort to the client, its MAC");
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::SnatReverse), 1);

        let ack = Packet6::tcp(CLIENT, 40200, NODE, 30080, TCP_ACK, b"more");
        let (action, out) = node.xdp(&ack.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT);
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..ack };
        assert_eq!(out, translated.frame(PEER_MAC, NODE_MAC), "the same port and route");
        assert!(l4_checksum_valid(&out));
        assert_eq!(node.stat(Stat::DnatEstablished), 1);
        assert_eq!(node.stat(Stat::XdpForwarded), 3);
        let fwd = node.ct(&fwd_key).unwrap();
        assert_eq!(fwd.packets, 2, "the SYN and the ACK counted on the forward entry");
        assert_eq!(fwd.state, proxy_common::conntrack::CtState::Established as u8, "the handshake moved it");

        // An evicted reply entry is put back by the client's next segment.
        node.conntrack.remove(&reply_key).unwrap();
        let ack2 = Packet6::tcp(CLIENT, 40200, NODE, 30080, TCP_ACK, b"again");
        assert_eq!(node.xdp(&ack2.frame(NODE_MAC, CLIENT_MAC)).0, XDP_REDIRECT);
        assert!(node.ct(&reply_key).is_some(), "XDP put the reply entry back");
        let answer = Packet6::tcp(REMOTE_BACKEND, 80, NODE, port, TCP_ACK, b"answer");
        let (action, out) = node.xdp(&answer.frame(NODE_MAC, PEER_MAC));
        assert_eq!(action, XDP_REDIRECT);
        assert_eq!(
            out,
            Packet6 { src: NODE, sport: 30080, dst: CLIENT, dport: 40200, ..answer }
                .frame(CLIENT_MAC, NODE_MAC)
        );
    });
}

#[test]
fn xdp_source_nats_a_v6_nodeport_datagram_with_its_udp_checksum_right_and_tc_follows_the_flow() {
    in_private_netns6(|ingress| {
        let mut dns = web(FrontendKind::NodePort, NODE, 30053, &[REMOTE_BACKEND]);
        dns.proto = Protocol::Udp;
        let node = Node6::new(ingress, vec![dns]);
        let query = Packet6::udp(CLIENT, 5353, NODE, 30053, b"a query of odd length");
        let (action, out) = node.xdp(&query.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT, "{out:02x?}");
        let port = source_port(&out);
        let translated = Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, dport: 80, ..query.clone() };
        assert_eq!(out, translated.frame(PEER_MAC, NODE_MAC));
        assert!(l4_checksum_valid(&out));

        // The same flow's next datagram through tc (XDP off, or a frame XDP left to it) takes the
        // translation XDP made: the programs share their conntrack and SNAT entries.
        let (action, out) = node.external(&query.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT);
        assert_eq!(out, translated.frame(PEER_MAC, NODE_MAC), "tc sends it as XDP did");

        // Answers of any length, an empty one included (the frame ends with the UDP header).
        for payload in [&b"an answer"[..], b"", b"a longer answer of more than one word"] {
            let answer = Packet6::udp(REMOTE_BACKEND, 80, NODE, port, payload);
            let (action, out) = node.xdp(&answer.frame(NODE_MAC, PEER_MAC));
            assert_eq!(action, XDP_REDIRECT, "{payload:?}");
            let back = Packet6 { src: NODE, sport: 30053, dst: CLIENT, dport: 5353, ..answer };
            assert_eq!(out, back.frame(CLIENT_MAC, NODE_MAC));
            assert!(l4_checksum_valid(&out));
        }
        assert_eq!(node.stat(Stat::SnatReverse), 3);
    });
}

#[test]
fn xdp_leaves_local_backends_policy_local_icmpv6_and_extension_headers_to_tc_and_drops_outside_source_ranges()
{
    in_private_netns6(|ingress| {
        const LB_IP: [u8; 16] = addr6(0x0203, 0x0000, 0x10);
        const OUTSIDER: [u8; 16] = addr6(0x0198, 0x0051, 0x07);
        let mut lb = web(FrontendKind::LoadBalancer, LB_IP, 80, &[REMOTE_BACKEND]);
        lb.source_ranges = vec![format!("{}/64", ip(CLIENT)).parse().unwrap()];
        let internal =
            Frontend { external_local: true, ..web(FrontendKind::NodePort, NODE, 30091, &[REMOTE_BACKEND]) };
        let external = Frontend {
            scope: Scope::External,
            local_only: true,
            no_local_endpoints: true,
            ..web(FrontendKind::NodePort, NODE, 30091, &[])
        };
        let node = Node6::new(
            ingress,
            vec![web(FrontendKind::NodePort, NODE, 30080, &[LOCAL_BACKEND]), lb, internal, external],
        );

        // A local backend: recorded by XDP, passed untouched; tc then follows the recorded choice.
        let syn = Packet6::tcp(CLIENT, 40300, NODE, 30080, TCP_SYN, b"");
        let frame = syn.frame(NODE_MAC, CLIENT_MAC);
        assert_eq!(node.xdp(&frame), (XDP_PASS, frame.clone()), "untouched");
        let fwd =
            node.ct(&ct_key6(CLIENT, 40300, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD)).expect("recorded");
        assert_eq!((fwd.nat_addr, fwd.flags & CT_FLAG_SNAT), (LOCAL_BACKEND, 0));
        let (action, out) = node.external(&frame);
        assert_eq!(action, TCX_NEXT);
        assert_eq!(out, Packet6 { dst: LOCAL_BACKEND, dport: 80, ..syn }.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(
            (node.stat(Stat::DnatNew), node.stat(Stat::DnatEstablished)),
            (0, 1),
            "tc did not pick again"
        );

        // Policy Local, ICMPv6 (neighbour discovery), a hop-by-hop header, a segment of no flow.
        let policy_local = Packet6::tcp(CLIENT, 40301, NODE, 30091, TCP_SYN, b"").frame(NODE_MAC, CLIENT_MAC);
        let solicitation = icmp6_frame(CLIENT, NODE, 135, 0, &NODE, NODE_MAC, CLIENT_MAC);
        let mut hop_by_hop =
            Packet6::tcp(CLIENT, 40302, NODE, 30080, TCP_SYN, b"").frame(NODE_MAC, CLIENT_MAC);
        // The same segment behind an empty hop-by-hop header (PadN), next header TCP.
        hop_by_hop.splice(54..54, [IPPROTO_TCP, 0, 1, 4, 0, 0, 0, 0]);
        let len = u16::from_be_bytes([hop_by_hop[18], hop_by_hop[19]]) + 8;
        hop_by_hop[18..20].copy_from_slice(&len.to_be_bytes());
        hop_by_hop[20] = 0;
        let mid_stream = Packet6::tcp(CLIENT, 40303, NODE, 30080, TCP_ACK, b"x").frame(NODE_MAC, CLIENT_MAC);
        for frame in [policy_local, solicitation, hop_by_hop, mid_stream] {
            assert_eq!(node.xdp(&frame), (XDP_PASS, frame.clone()), "{:02x?}", &frame[14..]);
        }
        for (port, node_port) in [(40301, 30091), (40302, 30080), (40303, 30080)] {
            let key = ct_key6(CLIENT, port, NODE, node_port, IPPROTO_TCP, CT_DIR_FORWARD);
            assert!(node.ct(&key).is_none(), "XDP recorded a flow it left to tc: {port}");
        }
        assert_eq!(node.stat(Stat::XdpForwarded), 0);

        // A load balancer IP's source ranges hold in XDP: outside them, dropped there.
        let denied = Packet6::tcp(OUTSIDER, 40304, LB_IP, 80, TCP_SYN, b"").frame(NODE_MAC, CLIENT_MAC);
        assert_eq!(node.xdp(&denied).0, XDP_DROP);
        assert_eq!(node.stat(Stat::DropSourceRange), 1);
        let admitted = Packet6::tcp(CLIENT, 40305, LB_IP, 80, TCP_SYN, b"");
        let (action, out) = node.xdp(&admitted.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT, "a client in range, to the remote backend");
        assert_eq!(&out[38..54], &REMOTE_BACKEND[..]);
        assert!(l4_checksum_valid(&out));
    });
}

#[test]
fn xdp_records_a_v6_remote_pick_whose_neighbour_is_unknown_and_tc_sends_it_with_the_same_snat_port() {
    in_private_netns6(|ingress| {
        sh(&["ip", "-6", "neigh", "del", &ip(PEER), "dev", "ext0"]);
        let node = Node6::new(ingress, vec![web(FrontendKind::NodePort, NODE, 30080, &[REMOTE_BACKEND])]);
        let syn = Packet6::tcp(CLIENT, 40400, NODE, 30080, TCP_SYN, b"hello").frame(NODE_MAC, CLIENT_MAC);
        assert_eq!(node.xdp(&syn), (XDP_PASS, syn.clone()), "left to tc untouched");
        assert_eq!(
            (node.stat(Stat::XdpToTc), node.stat(Stat::SnatNew), node.stat(Stat::XdpForwarded)),
            (1, 1, 0)
        );
        let fwd_key = ct_key6(CLIENT, 40400, NODE, 30080, IPPROTO_TCP, CT_DIR_FORWARD);
        let fwd = node.ct(&fwd_key).expect("recorded by XDP");
        assert_eq!((fwd.nat_addr, fwd.flags & CT_FLAG_SNAT), (REMOTE_BACKEND, CT_FLAG_SNAT));
        let port = u16::from_be_bytes(node.snat.get(&fwd_key, 0).unwrap().port);

        let (action, out) = node.external(&syn);
        assert_eq!(action, TC_ACT_REDIRECT, "tc sends it (bpf_redirect_neigh resolves the neighbour)");
        assert_eq!(source_port(&out), port, "with the SNAT port XDP took");
        assert_eq!(
            (&out[22..38], &out[38..54]),
            (&NODE[..], &REMOTE_BACKEND[..]),
            "DNAT + SNAT as XDP chose"
        );
        assert!(l4_checksum_valid(&out));
        assert_eq!((node.stat(Stat::DnatNew), node.stat(Stat::DnatEstablished)), (1, 1), "one pick, not two");
    });
}

/// Source ranges admit new connections: narrowing them keeps the established ones, through XDP as
/// through tc (which finds a known flow before its frontend), as kube-proxy's firewall rules do.
#[test]
fn xdp_keeps_an_established_v6_flow_when_its_source_ranges_narrow_and_drops_new_ones() {
    in_private_netns6(|ingress| {
        const LB_IP: [u8; 16] = addr6(0x0203, 0x0000, 0x10);
        let lb = |range: [u8; 16]| {
            let mut lb = web(FrontendKind::LoadBalancer, LB_IP, 80, &[REMOTE_BACKEND]);
            lb.source_ranges = vec![format!("{}/128", ip(range)).parse().unwrap()];
            lb
        };
        let mut node = Node6::new(ingress, vec![lb(CLIENT)]);
        let syn = Packet6::tcp(CLIENT, 40500, LB_IP, 80, TCP_SYN, b"");
        let (action, out) = node.xdp(&syn.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT);
        let port = source_port(&out);

        let report = node._syncer.apply(&Desired::new(vec![lb(PEER)]));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let ack = Packet6::tcp(CLIENT, 40500, LB_IP, 80, TCP_ACK, b"go on");
        let (action, out) = node.xdp(&ack.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, XDP_REDIRECT, "the established flow goes on");
        assert_eq!(
            out,
            Packet6 { src: NODE, sport: port, dst: REMOTE_BACKEND, ..ack.clone() }.frame(PEER_MAC, NODE_MAC)
        );
        let (action, _) = node.external(&ack.frame(NODE_MAC, CLIENT_MAC));
        assert_eq!(action, TC_ACT_REDIRECT, "and through tc alike");

        let new = Packet6::tcp(CLIENT, 40501, LB_IP, 80, TCP_SYN, b"").frame(NODE_MAC, CLIENT_MAC);
        assert_eq!(node.xdp(&new).0, XDP_DROP, "a new connection from outside the ranges is dropped");
        assert_eq!(node.stat(Stat::DropSourceRange), 1);
    });
}
