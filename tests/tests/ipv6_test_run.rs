//! Byte-exact tests of the IPv6 ClusterIP path of the tc programs (issue 19) through
//! BPF_PROG_TEST_RUN: the real object, loaded into this kernel (needs root), fed real IPv6 frames.
//! Every expected frame is built from scratch here, its L4 checksum recomputed over the IPv6
//! pseudo-header by proxy_common's reference math, and every output's checksum is verified the same
//! way.
//!
//! [`V6`] writes SERVICES_V6, BACKENDS_V6 and VIPS_V6 directly through aya, with the slot layout
//! the Syncer gives IPv4 (slot 0: count and rev-NAT id; slots 1..=count: backend ids): written
//! while the Syncer did not program IPv6. It does now (the model and syncer commit of issue 19;
//! `tests/dual_stack.rs` goes through it end to end); these tests could program the maps through
//! it as `datapath_test_run` does for IPv4.

mod common;

use aya::{
    Ebpf,
    maps::{HashMap, MapData, PerCpuArray},
    programs::SchedClassifier,
};
use common::{
    CLIENT_MAC, NODE_MAC, Packet, checksums_valid,
    harness::{BOUNCE, CLIENT, DROP, Harness, PASS, WEB_BACKENDS, WEB_VIP, test_run},
};
use kproxy::bpf;
use proxy_common::{
    checksum,
    conntrack::CtState,
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_DIRECT, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, IPPROTO_TCP,
        IPPROTO_UDP, SCOPE_INTERNAL, SVC_FLAG_AFFINITY, ServiceValueV4, VipV4,
    },
    maps_v6::{BackendV6, CtEntryV6, CtKeyV6, HAIRPIN_ADDR_V6, ServiceKeyV6},
    packet::{TCP_ACK, TCP_RST, TCP_SYN},
    packet6::{IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_ICMPV6},
    stats::Stat,
};

const fn addr6(last: u16, net: u16) -> [u8; 16] {
    let n = net.to_be_bytes();
    let l = last.to_be_bytes();
    [0xfd, 0x00, 0x10, 0x00, n[0], n[1], 0, 0, 0, 0, 0, 0, 0, 0, l[0], l[1]]
}

/// Pods in fd00:1000:244::/64, Services in fd00:1000:96::/64.
const CLIENT6: [u8; 16] = addr6(0x02, 0x0244);
const WEB6: [u8; 16] = addr6(0x64, 0x0096);
const DNS6: [u8; 16] = addr6(0x0a, 0x0096);
const EMPTY6: [u8; 16] = addr6(0xc8, 0x0096);
const WEB6_BACKENDS: [[u8; 16]; 2] = [addr6(0x11, 0x0244), addr6(0x12, 0x0244)];
const DNS6_BACKEND: [u8; 16] = addr6(0x21, 0x0244);
const OTHER_POD: [u8; 16] = addr6(0x30, 0x0244);
/// A Service whose only backend is the client itself (hairpin).
const SELF6: [u8; 16] = addr6(0x77, 0x0096);

/// The real object with its IPv6 maps in hand.
struct V6 {
    ebpf: Ebpf,
    services: HashMap<MapData, ServiceKeyV6, ServiceValueV4>,
    backends: HashMap<MapData, u32, BackendV6>,
    vips: HashMap<MapData, [u8; 16], VipV4>,
    conntrack: HashMap<MapData, CtKeyV6, CtEntryV6>,
    stats: PerCpuArray<MapData, u64>,
    service_cidrs: aya::maps::Array<MapData, proxy_common::service_cidr::ServiceCidrsV6>,
    next_backend_id: u32,
    next_rev_nat_id: u32,
}

impl V6 {
    /// web (TCP 80 → 8080 on two backends), dns (UDP 53 on one), empty (TCP 80 and UDP 53, no
    /// endpoints), self (TCP 80 → the client's own 8080).
    fn new() -> Self {
        let mut ebpf =
            bpf::load_unpinned().expect("loading the datapath needs root and a BPF-capable kernel");
        let maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        let mut v6 = Self {
            ebpf,
            services: maps.services_v6,
            backends: maps.backends_v6,
            vips: maps.vips_v6,
            conntrack: maps.conntrack_v6,
            stats: maps.stats,
            service_cidrs: maps.service_cidrs_v6,
            next_backend_id: 1,
            next_rev_nat_id: 1,
        };
        let web: Vec<_> = WEB6_BACKENDS.iter().map(|a| (*a, 8080)).collect();
        v6.frontend(WEB6, 80, IPPROTO_TCP, &web);
        v6.frontend(DNS6, 53, IPPROTO_UDP, &[(DNS6_BACKEND, 53)]);
        v6.frontend(EMPTY6, 80, IPPROTO_TCP, &[]);
        v6.frontend(EMPTY6, 53, IPPROTO_UDP, &[]);
        v6.frontend(SELF6, 80, IPPROTO_TCP, &[(CLIENT6, 8080)]);
        v6
    }

    /// One frontend as the Syncer lays IPv4 out: backends, slots, slot 0, then the VIP's count.
    fn frontend(&mut self, vip: [u8; 16], port: u16, proto: u8, backends: &[([u8; 16], u16)]) {
        self.frontend_with(vip, port, proto, backends, ServiceValueV4::default());
    }

    /// [`V6::frontend`] with slot 0's flags and affinity timeout from `slot0`.
    fn frontend_with(
        &mut self,
        vip: [u8; 16],
        port: u16,
        proto: u8,
        backends: &[([u8; 16], u16)],
        slot0: ServiceValueV4,
    ) {
        let rev_nat_id = self.next_rev_nat_id;
        self.next_rev_nat_id += 1;
        let key = ServiceKeyV6::new(vip, port.to_be_bytes(), proto, SCOPE_INTERNAL, 0);
        for (slot, (addr, port)) in backends.iter().enumerate() {
            let id = self.next_backend_id;
            self.next_backend_id += 1;
            let backend = BackendV6 { addr: *addr, port: port.to_be_bytes(), proto, flags: 0 };
            self.backends.insert(id, backend, 0).unwrap();
            let value = ServiceValueV4 { backend_id: id, rev_nat_id, ..Default::default() };
            self.services.insert(key.with_slot(slot as u16 + 1), value, 0).unwrap();
        }
        let slot0 = ServiceValueV4 { count: backends.len() as u16, rev_nat_id, ..slot0 };
        self.services.insert(key, slot0, 0).unwrap();
        let frontends = self.vips.get(&vip, 0).map_or(0, |v| v.frontends);
        self.vips.insert(vip, VipV4 { frontends: frontends + 1 }, 0).unwrap();
    }

    fn run(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier = self.ebpf.program(program).unwrap().try_into().unwrap();
        test_run(prog, frame, None)
    }

    fn ingress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run("kproxy_ingress", frame)
    }

    fn egress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run("kproxy_egress", frame)
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

/// An IPv6 TCP or UDP packet, its checksum computed from scratch.
#[derive(Clone, Debug)]
struct Packet6 {
    src: [u8; 16],
    dst: [u8; 16],
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    payload: Vec<u8>,
    /// Extension headers before the L4 header: (type, bytes after the next-header byte).
    ext: Vec<(u8, Vec<u8>)>,
}

impl Packet6 {
    fn tcp(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, flags: u8) -> Self {
        Self { src, dst, sport, dport, proto: IPPROTO_TCP, tcp_flags: flags, payload: vec![], ext: vec![] }
    }

    fn udp(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, payload: &[u8]) -> Self {
        Self { proto: IPPROTO_UDP, payload: payload.to_vec(), ..Self::tcp(src, sport, dst, dport, 0) }
    }

    /// With an options header (hop-by-hop or destination options) of 8 bytes holding a PadN.
    fn with_options_header(mut self, kind: u8) -> Self {
        self.ext.push((kind, vec![0, 1, 4, 0, 0, 0, 0]));
        self
    }

    /// The L4 segment, its checksum computed over the IPv6 pseudo-header.
    fn segment(&self) -> Vec<u8> {
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
        seg
    }

    /// The extension headers, each pointing at the next, the last at `last_next`.
    fn ext_bytes(&self, last_next: u8) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, (_, body)) in self.ext.iter().enumerate() {
            out.push(self.ext.get(i + 1).map_or(last_next, |(kind, _)| *kind));
            out.extend_from_slice(body);
        }
        out
    }

    fn frame(&self) -> Vec<u8> {
        let mut payload = self.ext_bytes(self.proto);
        payload.extend_from_slice(&self.segment());
        let first_next = self.ext.first().map_or(self.proto, |(kind, _)| *kind);
        frame6(&self.src, &self.dst, first_next, &payload)
    }

    /// The packet as the first and a later fragment: the fragment header after the other
    /// extension headers, `first_len` bytes (a multiple of 8) of the segment in the first.
    fn fragments(&self, first_len: usize, id: u32) -> (Vec<u8>, Vec<u8>) {
        let segment = self.segment();
        let fragment = |offset: usize, more: bool, data: &[u8]| {
            let mut payload = self.ext_bytes(IPPROTO_FRAGMENT);
            let field = ((offset / 8) as u16) << 3 | u16::from(more);
            payload.extend_from_slice(&[self.proto, 0]);
            payload.extend_from_slice(&field.to_be_bytes());
            payload.extend_from_slice(&id.to_be_bytes());
            payload.extend_from_slice(data);
            let first_next = self.ext.first().map_or(IPPROTO_FRAGMENT, |(kind, _)| *kind);
            frame6(&self.src, &self.dst, first_next, &payload)
        };
        (fragment(0, true, &segment[..first_len]), fragment(first_len, false, &segment[first_len..]))
    }
}

/// An Ethernet frame holding an IPv6 header (with a flow label and traffic class the datapath
/// must keep) and `payload`.
fn frame6(src: &[u8; 16], dst: &[u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&0x86ddu16.to_be_bytes());
    let len = (payload.len() as u16).to_be_bytes();
    frame.extend_from_slice(&[0x60, 0x0a, 0xbc, 0xde, len[0], len[1], next, 64]);
    frame.extend_from_slice(src);
    frame.extend_from_slice(dst);
    frame.extend_from_slice(payload);
    frame
}

/// An ICMPv6 message of `kind`/`code` with `body` after its first 4 bytes, checksummed.
fn icmp6(src: &[u8; 16], dst: &[u8; 16], kind: u8, code: u8, body: &[u8]) -> Vec<u8> {
    let mut message = vec![kind, code, 0, 0];
    message.extend_from_slice(body);
    let check = checksum::l4_checksum_v6(src, dst, IPPROTO_ICMPV6, &message);
    message[2..4].copy_from_slice(&check.to_be_bytes());
    frame6(src, dst, IPPROTO_ICMPV6, &message)
}

/// Where the L4 header of a frame built here starts, its protocol, and the source and destination.
fn parts(frame: &[u8]) -> (usize, u8, [u8; 16], [u8; 16]) {
    assert_eq!(&frame[12..14], &[0x86, 0xdd], "an IPv6 frame");
    let mut next = frame[14 + 6];
    let mut at = 14 + 40;
    while matches!(next, IPPROTO_HOPOPTS | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT) {
        let len = if next == IPPROTO_FRAGMENT { 8 } else { (usize::from(frame[at + 1]) + 1) * 8 };
        next = frame[at];
        at += len;
    }
    (at, next, frame[22..38].try_into().unwrap(), frame[38..54].try_into().unwrap())
}

/// Whether the L4 checksum of an unfragmented frame is right, recomputed over the pseudo-header.
fn l4_checksum_valid(frame: &[u8]) -> bool {
    let (at, proto, src, dst) = parts(frame);
    let end = 14 + 40 + usize::from(u16::from_be_bytes([frame[18], frame[19]]));
    let segment = &frame[at..end];
    let pseudo = checksum::pseudo_header_sum_v6(&src, &dst, proto, segment.len() as u32);
    checksum::is_valid(checksum::add_words(pseudo, segment))
}

/// The destination address and port of a frame built here.
fn destination(frame: &[u8]) -> ([u8; 16], u16) {
    let (at, _, _, dst) = parts(frame);
    (dst, u16::from_be_bytes([frame[at + 2], frame[at + 3]]))
}

#[test]
fn a_tcp_syn_to_the_v6_cluster_ip_is_dnated_byte_exact_and_tracked() {
    let v6 = V6::new();
    let syn = Packet6::tcp(CLIENT6, 40000, WEB6, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&syn.frame());
    assert_eq!(ret, PASS);
    let (backend, port) = destination(&out);
    assert!(WEB6_BACKENDS.contains(&backend), "DNATed to {backend:02x?}");
    assert_eq!(port, 8080);
    // Only the destination and the checksum differ from the input: flow label, hop limit and the
    // rest are kept.
    assert_eq!(out, Packet6 { dst: backend, dport: 8080, ..syn }.frame());
    assert!(l4_checksum_valid(&out));

    let fwd = v6.ct(&ct_key6(CLIENT6, 40000, WEB6, 80, IPPROTO_TCP, CT_DIR_FORWARD)).expect("forward entry");
    assert_eq!((fwd.nat_addr, u16::from_be_bytes(fwd.nat_port)), (backend, 8080));
    assert_eq!(fwd.state, CtState::SynSent as u8);
    assert_eq!((fwd.packets, fwd.bytes), (1, 60));
    let reply =
        v6.ct(&ct_key6(backend, 8080, CLIENT6, 40000, IPPROTO_TCP, CT_DIR_REPLY)).expect("reply entry");
    assert_eq!((reply.nat_addr, u16::from_be_bytes(reply.nat_port)), (WEB6, 80));
    assert_eq!((reply.rev_nat_id, reply.backend_id), (fwd.rev_nat_id, fwd.backend_id));
    assert_eq!(v6.stat(Stat::DnatNew), 1);
}

#[test]
fn an_unallocated_address_of_an_ipv6_service_cidr_is_dropped_and_the_rest_goes_on() {
    let mut v6 = V6::new();
    let unallocated = addr6(0xc9, 0x0096);
    let syn = Packet6::tcp(CLIENT6, 40100, unallocated, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&syn.frame());
    assert_eq!((ret, out), (PASS, syn.frame()), "no service CIDR known: nothing is dropped");

    // fd00:1000:96::/64 as the agent writes it (`bpf::service_cidrs::write6`).
    let range = kproxy::net::Cidr6::new(std::net::Ipv6Addr::from(addr6(0, 0x0096)), 64).unwrap();
    kproxy::bpf::service_cidrs::write6(&mut v6.service_cidrs, &[range]).unwrap();
    for packet in [syn.clone(), Packet6::udp(CLIENT6, 40101, unallocated, 53, b"query")] {
        let (ret, _) = v6.ingress(&packet.frame());
        assert_eq!(ret, DROP, "an unallocated address of the range never leaves the node: {packet:?}");
    }
    assert_eq!(v6.stat(Stat::DropUnallocatedServiceIp), 2);
    // A cluster IP of the range is served, a port it lacks refused, and a pod outside the range
    // reached untouched.
    let (ret, out) = v6.ingress(&Packet6::tcp(CLIENT6, 40102, WEB6, 80, TCP_SYN).frame());
    assert_eq!(ret, PASS);
    assert!(WEB6_BACKENDS.contains(&destination(&out).0));
    let (ret, _) = v6.ingress(&Packet6::tcp(CLIENT6, 40103, WEB6, 81, TCP_SYN).frame());
    assert_eq!(ret, BOUNCE, "refused with a RST");
    let direct = Packet6::tcp(CLIENT6, 40104, OTHER_POD, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&direct.frame());
    assert_eq!((ret, out), (PASS, direct.frame()));
    assert_eq!(v6.stat(Stat::DropUnallocatedServiceIp), 2);

    // Other protocols, as kube-proxy's `ip6 daddr { CIDRs } drop` under `ct state new` sees them: an
    // echo request (`ping -6`), a node information query, SCTP, and an echo request behind a
    // hop-by-hop header open a connection there and are dropped...
    let echo = icmp6(&CLIENT6, &unallocated, 128, 0, &[0, 1, 0, 1, b'p', b'i', b'n', b'g']);
    let mut behind_hop_by_hop =
        frame6(&CLIENT6, &unallocated, IPPROTO_HOPOPTS, &[IPPROTO_ICMPV6, 0, 0, 0, 0, 0, 0, 0]);
    behind_hop_by_hop.extend_from_slice(&echo[14 + 40..]);
    let payload_len = (behind_hop_by_hop.len() - 54) as u16;
    behind_hop_by_hop[18..20].copy_from_slice(&payload_len.to_be_bytes());
    let dropped = [
        echo.clone(),
        icmp6(&CLIENT6, &unallocated, 139, 0, &[0; 12]),
        frame6(&CLIENT6, &unallocated, 132, &[0x9c, 0x40, 0x0b, 0x59, 0, 0, 0, 0, 0, 0, 0, 0]),
        behind_hop_by_hop,
    ];
    for frame in &dropped {
        assert_eq!(v6.ingress(frame).0, DROP, "{:02x?}", &frame[14..]);
    }
    assert_eq!(v6.stat(Stat::DropUnallocatedServiceIp), 2 + dropped.len() as u64);
    // ...while an echo reply, neighbour discovery and an error pass untouched, and so does an echo
    // request to an allocated cluster IP (its address answers nothing, as with kube-proxy, but no
    // rule of a service proxy drops it) or to a pod.
    let passed = [
        icmp6(&CLIENT6, &unallocated, 129, 0, &[0, 1, 0, 1]),
        icmp6(&CLIENT6, &unallocated, 135, 0, &[&[0u8; 4][..], &unallocated[..]].concat()),
        icmp6(&CLIENT6, &unallocated, 1, 4, &[0; 4]),
        icmp6(&CLIENT6, &WEB6, 128, 0, &[0, 1, 0, 1]),
        icmp6(&CLIENT6, &OTHER_POD, 128, 0, &[0, 1, 0, 1]),
    ];
    for frame in &passed {
        assert_eq!(v6.ingress(frame), (PASS, frame.clone()), "{:02x?}", &frame[14..]);
    }
    assert_eq!(v6.stat(Stat::DropUnallocatedServiceIp), 2 + dropped.len() as u64);
}

#[test]
fn a_tcp_handshake_follows_its_backend_and_replies_come_from_the_cluster_ip() {
    let v6 = V6::new();
    let (_, first) = v6.ingress(&Packet6::tcp(CLIENT6, 40001, WEB6, 80, TCP_SYN).frame());
    let (backend, _) = destination(&first);

    let syn_ack = Packet6::tcp(backend, 8080, CLIENT6, 40001, TCP_SYN | TCP_ACK);
    let (ret, out) = v6.egress(&syn_ack.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet6 { src: WEB6, sport: 80, ..syn_ack }.frame(), "un-NATed to the cluster IP");
    assert!(l4_checksum_valid(&out));
    let fwd_key = ct_key6(CLIENT6, 40001, WEB6, 80, IPPROTO_TCP, CT_DIR_FORWARD);
    assert_eq!(v6.ct(&fwd_key).unwrap().state, CtState::SynReceived as u8);

    for i in 0..10u8 {
        let ack = Packet6 { payload: vec![i; 100], ..Packet6::tcp(CLIENT6, 40001, WEB6, 80, TCP_ACK) };
        let (ret, out) = v6.ingress(&ack.frame());
        assert_eq!(ret, PASS);
        assert_eq!(out, Packet6 { dst: backend, dport: 8080, ..ack }.frame(), "segment {i}");
    }
    let fwd = v6.ct(&fwd_key).unwrap();
    assert_eq!((fwd.state, fwd.packets), (CtState::Established as u8, 11));
    assert_eq!(v6.stat(Stat::DnatEstablished), 10);
    assert_eq!(v6.stat(Stat::ReverseNat), 1);
}

#[test]
fn a_udp_datagram_to_the_v6_cluster_ip_is_dnated_and_its_answer_un_nated() {
    let v6 = V6::new();
    let query = Packet6::udp(CLIENT6, 56340, DNS6, 53, b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00");
    let (ret, out) = v6.ingress(&query.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet6 { dst: DNS6_BACKEND, ..query }.frame());
    assert!(l4_checksum_valid(&out));

    let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, 56340, b"\x12\x34\x81\x80answer");
    let (ret, out) = v6.egress(&answer.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet6 { src: DNS6, ..answer }.frame());
    assert!(l4_checksum_valid(&out));
    let fwd = v6.ct(&ct_key6(CLIENT6, 56340, DNS6, 53, IPPROTO_UDP, CT_DIR_FORWARD)).unwrap();
    assert_eq!((fwd.state, fwd.packets), (CtState::Open as u8, 1));
}

/// RFC 8200: a UDP checksum that computes to zero is sent as 0xffff (zero means none, which IPv6
/// does not allow). The payload is chosen so that the DNATed datagram's checksum is exactly that.
#[test]
fn a_udp_checksum_that_comes_out_zero_is_sent_as_ffff() {
    let v6 = V6::new();
    let mut query = Packet6::udp(CLIENT6, 56342, DNS6, 53, &[0, 0, 0x12, 0x34]);
    let mut after = Packet6 { dst: DNS6_BACKEND, ..query.clone() };
    let mut segment = after.segment();
    segment[6..8].fill(0);
    let sum = checksum::add_words(
        checksum::pseudo_header_sum_v6(&after.src, &after.dst, IPPROTO_UDP, segment.len() as u32),
        &segment,
    );
    // A first payload word that brings the one's-complement sum to all ones: a checksum of zero.
    let word = 0xffff - checksum::fold(sum);
    query.payload[..2].copy_from_slice(&word.to_be_bytes());
    after.payload = query.payload.clone();
    assert_eq!(after.segment()[6..8], [0xff, 0xff], "the reference computes zero, sent as 0xffff");

    let (ret, out) = v6.ingress(&query.frame());
    assert_eq!(ret, PASS);
    let (at, ..) = parts(&out);
    assert_eq!(out[at + 6..at + 8], [0xff, 0xff]);
    assert_eq!(out, after.frame());
    assert!(l4_checksum_valid(&out));
}

#[test]
fn a_reply_of_a_flow_never_translated_is_untouched() {
    let v6 = V6::new();
    let passed = v6.stat(Stat::PassNoService);
    // A pod answering a client that reached it directly (no Service), and one whose source port
    // matches a translated flow's backend but not its client.
    let (_, _) = v6.ingress(&Packet6::udp(CLIENT6, 56343, DNS6, 53, b"q").frame());
    for reply in [
        Packet6::udp(OTHER_POD, 53, CLIENT6, 56343, b"direct"),
        Packet6::udp(DNS6_BACKEND, 53, CLIENT6, 56399, b"another port"),
        Packet6::tcp(DNS6_BACKEND, 53, CLIENT6, 56343, TCP_SYN | TCP_ACK),
    ] {
        let frame = reply.frame();
        assert_eq!(v6.egress(&frame), (PASS, frame), "{reply:?}");
    }
    assert_eq!(v6.stat(Stat::PassNoService), passed + 3);
    assert_eq!(v6.stat(Stat::ReverseNat), 0);
}

#[test]
fn datagrams_with_destination_options_or_hop_by_hop_headers_are_translated() {
    let v6 = V6::new();
    for (kind, sport) in [(IPPROTO_DSTOPTS, 56350), (IPPROTO_HOPOPTS, 56351)] {
        let query =
            Packet6::udp(CLIENT6, sport, DNS6, 53, b"\x12\x34 with options").with_options_header(kind);
        let (ret, out) = v6.ingress(&query.frame());
        assert_eq!(ret, PASS);
        assert_eq!(out, Packet6 { dst: DNS6_BACKEND, ..query.clone() }.frame(), "header {kind}");
        assert!(l4_checksum_valid(&out));
        // And the answer, with the same header, back from the cluster IP.
        let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, sport, b"answer").with_options_header(kind);
        let (_, out) = v6.egress(&answer.frame());
        assert_eq!(out, Packet6 { src: DNS6, ..answer }.frame(), "answer with header {kind}");
    }
    // Two headers in a row: hop-by-hop, then destination options.
    let syn = Packet6::tcp(CLIENT6, 40010, WEB6, 80, TCP_SYN)
        .with_options_header(IPPROTO_HOPOPTS)
        .with_options_header(IPPROTO_DSTOPTS);
    let (_, out) = v6.ingress(&syn.frame());
    let (backend, port) = destination(&out);
    assert_eq!(out, Packet6 { dst: backend, dport: port, ..syn }.frame());
    assert!(WEB6_BACKENDS.contains(&backend) && port == 8080);
    assert_eq!(v6.stat(Stat::DnatNew), 3);
}

/// A datagram larger than the MTU arrives in fragments; only the first has the UDP header. The
/// first is translated (its checksum, which covers the whole datagram, updated for the new
/// destination), and its ports kept in FRAGMENTS_V6: the later one gets the same destination
/// (IPv6 has no header checksum, and it has no L4 checksum of its own). Replies the same way back.
#[test]
fn a_fragmented_datagram_is_translated_fragment_by_fragment() {
    let v6 = V6::new();
    let query = Packet6::udp(CLIENT6, 56360, DNS6, 53, &[0x5a; 100]);
    let (first, later) = query.fragments(48, 0x0bad_cafe);
    let (want_first, want_later) = Packet6 { dst: DNS6_BACKEND, ..query.clone() }.fragments(48, 0x0bad_cafe);
    let followed = v6.stat(Stat::FragmentFollowed);
    let (ret, out) = v6.ingress(&first);
    assert_eq!((ret, &out), (PASS, &want_first), "first fragment");
    let (ret, out_later) = v6.ingress(&later);
    assert_eq!((ret, &out_later), (PASS, &want_later), "later fragment");
    assert_eq!(v6.stat(Stat::FragmentFollowed), followed + 1);
    // The reassembled datagram's checksum is right: the first fragment's L4 bytes, then the later's.
    let (at, ..) = parts(&out);
    let mut segment = out[at..].to_vec();
    segment.extend_from_slice(&out_later[14 + 40 + 8..]);
    let pseudo = checksum::pseudo_header_sum_v6(&CLIENT6, &DNS6_BACKEND, IPPROTO_UDP, segment.len() as u32);
    assert!(checksum::is_valid(checksum::add_words(pseudo, &segment)), "reassembled checksum");
    let fwd = v6.ct(&ct_key6(CLIENT6, 56360, DNS6, 53, IPPROTO_UDP, CT_DIR_FORWARD)).expect("flow recorded");
    assert_eq!(fwd.nat_addr, DNS6_BACKEND);

    let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, 56360, &[0xa5; 200]);
    let (first, later) = answer.fragments(104, 0x7001);
    let (want_first, want_later) = Packet6 { src: DNS6, ..answer }.fragments(104, 0x7001);
    assert_eq!(v6.egress(&first), (PASS, want_first), "first fragment of the answer");
    assert_eq!(v6.egress(&later), (PASS, want_later), "later fragment of the answer");

    // Another datagram's later fragment, its first never seen: left alone.
    let stray = query.fragments(48, 0x0bad_cafe + 1).1;
    let passed = v6.stat(Stat::PassFragment);
    assert_eq!(v6.ingress(&stray), (PASS, stray.clone()));
    assert_eq!(v6.stat(Stat::PassFragment), passed + 1);
}

/// An ICMPv6 error about a translated flow reaches the client as if the Service had sent it: the
/// quoted packet's destination goes back to the Service (address and port, the ICMPv6 checksum
/// kept right), and the outer source too when the backend sent the error. Packet too big above
/// all: IPv6 routers never fragment, so TCP learns the path MTU only from it.
#[test]
fn icmpv6_errors_about_a_translated_flow_are_un_nated_for_the_client() {
    let v6 = V6::new();
    let mtu = [0, 0, 0x05, 0x00];

    // The DNS backend has nothing on port 53 any more: port unreachable, from the backend.
    let query = Packet6::udp(CLIENT6, 40000, DNS6, 53, b"\x12\x34\x01\x00");
    let (_, dnat) = v6.ingress(&query.frame());
    let sent = &dnat[14..];
    let error = icmp6(&DNS6_BACKEND, &CLIENT6, 1, 4, &[&[0; 4], sent].concat());
    // The quote as the client sent it; its own UDP checksum stays the DNATed one.
    let quote = [&query.frame()[14..14 + 40], &sent[40..]].concat();
    let (ret, out) = v6.egress(&error);
    assert_eq!(
        (ret, out),
        (PASS, icmp6(&DNS6, &CLIENT6, 1, 4, &[&[0; 4], &quote[..]].concat())),
        "port unreachable"
    );

    // A router between node and web backend has a smaller MTU: packet too big, from the router;
    // the quoted port goes back from 8080 to 80.
    let syn = Packet6 { payload: vec![0x42; 64], ..Packet6::tcp(CLIENT6, 40001, WEB6, 80, TCP_SYN) };
    let (_, dnat) = v6.ingress(&syn.frame());
    let sent = &dnat[14..];
    let router = addr6(1, 0x0900);
    let error = icmp6(&router, &CLIENT6, 2, 0, &[&mtu, sent].concat());
    let quote = [&syn.frame()[14..14 + 40], &sent[40..42], &80u16.to_be_bytes(), &sent[44..]].concat();
    let (ret, out) = v6.egress(&error);
    assert_eq!(
        (ret, out),
        (PASS, icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &quote[..]].concat())),
        "packet too big"
    );
    assert_eq!(v6.stat(Stat::IcmpErrorUnnat), 2);

    // An error about a flow kproxy never translated, and one addressed to someone else than the
    // quoted packet's source, are left alone.
    let stranger = Packet6::udp(CLIENT6, 40002, OTHER_POD, 53, b"x").frame()[14..].to_vec();
    let unknown = icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &stranger[..]].concat());
    assert_eq!(v6.egress(&unknown), (PASS, unknown.clone()));
    let elsewhere = icmp6(&router, &OTHER_POD, 2, 0, &[&mtu, sent].concat());
    assert_eq!(v6.egress(&elsewhere), (PASS, elsewhere.clone()));
    assert_eq!(v6.stat(Stat::IcmpErrorUnnat), 2);
}

/// sessionAffinity: ClientIP: every new connection of a client goes to the backend its first one
/// got, while a Service without affinity spreads them (kube-proxy's `recent` match and random
/// chain).
#[test]
fn session_affinity_keeps_a_v6_client_on_its_backend() {
    let mut v6 = V6::new();
    let sticky_vip = addr6(0x55, 0x0096);
    let web: Vec<_> = WEB6_BACKENDS.iter().map(|a| (*a, 8080)).collect();
    let slot0 = ServiceValueV4 { flags: SVC_FLAG_AFFINITY, affinity_timeout_s: 10_800, ..Default::default() };
    v6.frontend_with(sticky_vip, 80, IPPROTO_TCP, &web, slot0);
    let backend_of = |v6: &V6, vip, sport| {
        let (ret, out) = v6.ingress(&Packet6::tcp(CLIENT6, sport, vip, 80, TCP_SYN).frame());
        assert_eq!(ret, PASS);
        destination(&out).0
    };
    let first = backend_of(&v6, sticky_vip, 41000);
    for sport in 41001..41030 {
        assert_eq!(backend_of(&v6, sticky_vip, sport), first, "connection from port {sport}");
    }
    assert_eq!(v6.stat(Stat::AffinityHit), 29);
    let spread: std::collections::BTreeSet<_> =
        (42000..42040).map(|sport| backend_of(&v6, WEB6, sport)).collect();
    assert_eq!(spread.len(), 2, "without affinity both backends get connections");
}

/// The frame bounced back out of the interface it came in on: the MACs swapped.
fn bounced(frame: Vec<u8>) -> Vec<u8> {
    [&frame[6..12], &frame[..6], &frame[12..]].concat()
}

/// A pod reaching itself through its Service: the source becomes the hairpin address (so the
/// answer comes back through the node) and the packet goes straight back to the pod; the pod's
/// answer to the hairpin address comes back from the Service, also bounced.
#[test]
fn a_pod_reaching_itself_through_its_v6_service_is_hairpinned() {
    let v6 = V6::new();
    let syn = Packet6::tcp(CLIENT6, 40100, SELF6, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&syn.frame());
    assert_eq!(ret, BOUNCE);
    let hairpinned = Packet6 { src: HAIRPIN_ADDR_V6, dst: CLIENT6, dport: 8080, ..syn };
    assert_eq!(out, bounced(hairpinned.frame()));
    assert!(l4_checksum_valid(&out));
    let reply = v6
        .ct(&ct_key6(CLIENT6, 8080, HAIRPIN_ADDR_V6, 40100, IPPROTO_TCP, CT_DIR_REPLY))
        .expect("reply entry");
    assert_eq!((reply.nat_addr, reply.flags), (SELF6, CT_FLAG_HAIRPIN));

    let syn_ack = Packet6::tcp(CLIENT6, 8080, HAIRPIN_ADDR_V6, 40100, TCP_SYN | TCP_ACK);
    let (ret, out) = v6.ingress(&syn_ack.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, bounced(Packet6 { src: SELF6, sport: 80, dst: CLIENT6, ..syn_ack }.frame()));
    assert!(l4_checksum_valid(&out));

    let ack = Packet6 {
        payload: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        ..Packet6::tcp(CLIENT6, 40100, SELF6, 80, TCP_ACK)
    };
    let (ret, out) = v6.ingress(&ack.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, bounced(Packet6 { src: HAIRPIN_ADDR_V6, dst: CLIENT6, dport: 8080, ..ack }.frame()));
    let fwd = v6.ct(&ct_key6(CLIENT6, 40100, SELF6, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.state, CtState::Established as u8);
    assert_eq!((v6.stat(Stat::Hairpin), v6.stat(Stat::ReverseNat)), (1, 1));

    // To the hairpin address without being a hairpin flow's reply: left alone.
    let stray = Packet6::tcp(CLIENT6, 8080, HAIRPIN_ADDR_V6, 40199, TCP_ACK).frame();
    assert_eq!(v6.ingress(&stray), (PASS, stray.clone()));
}

#[test]
fn neighbour_discovery_and_echo_are_never_touched() {
    let v6 = V6::new();
    let mut solicited_node = [0u8; 16];
    solicited_node[..2].copy_from_slice(&[0xff, 0x02]);
    solicited_node[11..].copy_from_slice(&[1, 0xff, 0, 0, 0x64]);
    // Neighbour solicitation for the cluster IP, with the source link-layer option.
    let mut ns = vec![0, 0, 0, 0];
    ns.extend_from_slice(&WEB6);
    ns.extend_from_slice(&[1, 1]);
    ns.extend_from_slice(&CLIENT_MAC);
    let solicitation = icmp6(&CLIENT6, &solicited_node, 135, 0, &ns);
    let echo = icmp6(&CLIENT6, &WEB6, 128, 0, &[0x12, 0x34, 0, 1, b'p', b'i', b'n', b'g']);
    let mut na = vec![0x60, 0, 0, 0];
    na.extend_from_slice(&WEB6);
    let advertisement = icmp6(&DNS6_BACKEND, &CLIENT6, 136, 0, &na);
    let passed = v6.stat(Stat::PassNotTcpUdp);
    for frame in [&solicitation, &echo, &advertisement] {
        assert_eq!(v6.ingress(frame), (PASS, frame.clone()));
        assert_eq!(v6.egress(frame), (PASS, frame.clone()));
    }
    assert_eq!(v6.stat(Stat::PassNotTcpUdp), passed + 6);
}

#[test]
fn no_endpoints_refuses_tcp_with_a_reset_and_udp_with_port_unreachable() {
    let v6 = V6::new();
    // TCP: a RST from the cluster IP, acknowledging the SYN.
    let syn = Packet6::tcp(CLIENT6, 40020, EMPTY6, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&syn.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(&out[..12], &[CLIENT_MAC, NODE_MAC].concat()[..], "back to the client's MAC");
    assert_eq!(&out[14..22], &[0x60, 0, 0, 0, 0, 20, IPPROTO_TCP, 64]);
    let (at, proto, src, dst) = parts(&out);
    assert_eq!((proto, src, dst), (IPPROTO_TCP, EMPTY6, CLIENT6));
    assert_eq!(&out[at..at + 4], &[0, 80, 0x9c, 0x54], "ports swapped");
    assert_eq!(u32::from_be_bytes(out[at + 8..at + 12].try_into().unwrap()), 0x0102_0305, "ack = seq + 1");
    assert_eq!(out[at + 13], TCP_RST | TCP_ACK);
    assert_eq!(out.len(), 14 + 40 + 20);
    assert!(l4_checksum_valid(&out), "RST checksum over the pseudo-header");

    // UDP: ICMPv6 destination unreachable, port unreachable, quoting the IPv6 and UDP headers.
    let query = Packet6::udp(CLIENT6, 56370, EMPTY6, 53, b"\x12\x34 no one here");
    let sent = query.frame();
    let (ret, out) = v6.ingress(&sent);
    assert_eq!(ret, BOUNCE);
    let mut body = vec![0, 0, 0, 0];
    body.extend_from_slice(&sent[14..14 + 48]);
    let want = icmp6(&EMPTY6, &CLIENT6, 1, 4, &body);
    assert_eq!(&out[..12], &[CLIENT_MAC, NODE_MAC].concat()[..]);
    assert_eq!(
        &out[12..22],
        &[0x86, 0xdd, 0x60, 0, 0, 0, 0, 56, IPPROTO_ICMPV6, 64],
        "no flow label, 56 bytes"
    );
    assert_eq!(out[22..], want[22..], "port unreachable from the cluster IP");
    let message = &out[14 + 40..];
    let pseudo = checksum::pseudo_header_sum_v6(&EMPTY6, &CLIENT6, IPPROTO_ICMPV6, message.len() as u32);
    assert!(checksum::is_valid(checksum::add_words(pseudo, message)), "ICMPv6 checksum");

    // A port the Service does not have is refused the same way.
    let (ret, out) = v6.ingress(&Packet6::tcp(CLIENT6, 40021, WEB6, 443, TCP_SYN).frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(parts(&out).2, WEB6);
    assert_eq!((v6.stat(Stat::RejectTcp), v6.stat(Stat::RejectUdp)), (2, 1));
    // Nothing was recorded for the refused flows.
    assert!(v6.ct(&ct_key6(CLIENT6, 40020, EMPTY6, 80, IPPROTO_TCP, CT_DIR_FORWARD)).is_none());
}

#[test]
fn a_tcp_segment_that_is_no_syn_without_a_flow_to_a_cluster_ip_is_dropped() {
    let v6 = V6::new();
    for flags in [TCP_ACK, TCP_SYN | TCP_ACK] {
        let (ret, _) = v6.ingress(&Packet6::tcp(CLIENT6, 40030, WEB6, 80, flags).frame());
        assert_eq!(ret, DROP, "flags {flags:#x}");
    }
    assert_eq!(v6.stat(Stat::DropInvalidTcp), 2);
    assert!(v6.ct(&ct_key6(CLIENT6, 40030, WEB6, 80, IPPROTO_TCP, CT_DIR_FORWARD)).is_none());
}

#[test]
fn a_packet_to_no_service_is_untouched() {
    let v6 = V6::new();
    for packet in [
        Packet6::tcp(CLIENT6, 40040, OTHER_POD, 80, TCP_SYN),
        Packet6::udp(CLIENT6, 40041, OTHER_POD, 53, b"direct"),
        Packet6::udp(CLIENT6, 40042, addr6(0x99, 0x0096), 53, b"no such service"),
    ] {
        let frame = packet.frame();
        assert_eq!(v6.ingress(&frame), (PASS, frame.clone()), "{packet:?}");
    }
    assert_eq!(v6.stat(Stat::PassNoService), 3);
    assert_eq!(v6.stat(Stat::DnatNew), 0);
}

/// The IPv4 path is unchanged by the IPv6 one beside it (programmed through the agent's Syncer).
#[test]
fn an_ipv4_packet_is_still_translated_as_before() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 40050, WEB_VIP, 80, TCP_SYN);
    let (ret, out) = h.ingress(&syn.frame());
    assert_eq!(ret, PASS);
    let backend: [u8; 4] = out[30..34].try_into().unwrap();
    assert!(WEB_BACKENDS.contains(&backend));
    assert_eq!(out, Packet { dst: backend, dport: 8080, ..syn }.frame());
    assert!(checksums_valid(&out));
    assert_eq!(h.stat(Stat::DnatNew), 1);
}

/// The source address and port of a frame built here.
fn source(frame: &[u8]) -> ([u8; 16], u16) {
    let (at, _, src, _) = parts(frame);
    (src, u16::from_be_bytes([frame[at], frame[at + 1]]))
}

/// The SNAT range the remapped ports come from (the agent's default, nothing configured here).
const REMAP_PORTS: std::ops::RangeInclusive<u16> = 61000..=65535;

/// Port reuse: a pod reached backend B through the Service from port P, and while that
/// connection lives it dials B directly from P (a StatefulSet peer, a Kafka client). The direct
/// flow's source port is remapped — netfilter's clash resolution — so that B's replies to it reach
/// the client's socket from B itself, never un-NATed to the Service, and the translated flow's
/// replies still come from the Service.
#[test]
fn a_direct_flow_reusing_the_port_of_a_live_translated_flow_is_remapped() {
    let v6 = V6::new();
    let (_, out) = v6.ingress(&Packet6::tcp(CLIENT6, 40200, WEB6, 80, TCP_SYN).frame());
    let (backend, _) = destination(&out);
    let syn_ack = Packet6::tcp(backend, 8080, CLIENT6, 40200, TCP_SYN | TCP_ACK);
    assert_eq!(v6.egress(&syn_ack.frame()).1, Packet6 { src: WEB6, sport: 80, ..syn_ack.clone() }.frame());
    v6.ingress(&Packet6::tcp(CLIENT6, 40200, WEB6, 80, TCP_ACK).frame());

    let direct = Packet6::tcp(CLIENT6, 40200, backend, 8080, TCP_SYN);
    let (ret, out) = v6.ingress(&direct.frame());
    assert_eq!(ret, PASS);
    let (_, remapped) = source(&out);
    assert!(REMAP_PORTS.contains(&remapped), "source port {remapped} remapped into the SNAT range");
    assert_eq!(out, Packet6 { sport: remapped, ..direct.clone() }.frame(), "only the source port changed");
    assert!(l4_checksum_valid(&out));
    assert_eq!(v6.stat(Stat::PortRemapped), 1);
    let fwd =
        v6.ct(&ct_key6(CLIENT6, 40200, backend, 8080, IPPROTO_TCP, CT_DIR_FORWARD)).expect("direct flow");
    assert_eq!(fwd.flags, CT_FLAG_REMAP | CT_FLAG_DIRECT);

    // B answers the remapped port: the client's port comes back, the source stays B.
    let answer = Packet6::tcp(backend, 8080, CLIENT6, remapped, TCP_SYN | TCP_ACK);
    let (ret, out) = v6.egress(&answer.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet6 { dport: 40200, ..answer }.frame(), "from B to port 40200, not from the VIP");
    assert!(l4_checksum_valid(&out));
    // The direct flow's next segment keeps its port; the translated flow is untouched.
    let ack = Packet6 { payload: b"hello".to_vec(), ..Packet6::tcp(CLIENT6, 40200, backend, 8080, TCP_ACK) };
    assert_eq!(v6.ingress(&ack.frame()).1, Packet6 { sport: remapped, ..ack }.frame());
    let reply = Packet6 {
        payload: b"via the Service".to_vec(),
        ..Packet6::tcp(backend, 8080, CLIENT6, 40200, TCP_ACK)
    };
    assert_eq!(v6.egress(&reply.frame()).1, Packet6 { src: WEB6, sport: 80, ..reply }.frame());
    let via = Packet6::tcp(CLIENT6, 40200, WEB6, 80, TCP_ACK);
    assert_eq!(v6.ingress(&via.frame()).1, Packet6 { dst: backend, dport: 8080, ..via }.frame());
    // ReverseNat counts the Service's replies only.
    assert_eq!(v6.stat(Stat::ReverseNat), 2);

    // A segment that starts nothing, from another port, while a live translated flow holds its
    // tuple: left alone.
    v6.ingress(&Packet6::tcp(CLIENT6, 40201, WEB6, 80, TCP_SYN).frame());
    let fwd = v6.ct(&ct_key6(CLIENT6, 40201, WEB6, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    let stray = Packet6::tcp(CLIENT6, 40201, fwd.nat_addr, 8080, TCP_ACK).frame();
    assert_eq!(v6.ingress(&stray), (PASS, stray.clone()));

    // UDP the same way: a resolver asking the Service, then the pod by address from one port.
    v6.ingress(&Packet6::udp(CLIENT6, 56400, DNS6, 53, b"q1").frame());
    let query = Packet6::udp(CLIENT6, 56400, DNS6_BACKEND, 53, b"q2");
    let (_, out) = v6.ingress(&query.frame());
    let (_, remapped) = source(&out);
    assert!(REMAP_PORTS.contains(&remapped));
    let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, remapped, b"a2");
    assert_eq!(v6.egress(&answer.frame()).1, Packet6 { dport: 56400, ..answer }.frame());
    let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, 56400, b"a1");
    assert_eq!(v6.egress(&answer.frame()).1, Packet6 { src: DNS6, ..answer }.frame());
}

/// The same reuse after the translated connection is over (reset; or idle past its timeout): it
/// yields its tuple, and the direct flow is not translated at all, nor are its replies.
#[test]
fn a_direct_flow_reusing_the_port_of_a_closed_translated_flow_is_untouched() {
    let mut v6 = V6::new();
    let (_, out) = v6.ingress(&Packet6::tcp(CLIENT6, 40300, WEB6, 80, TCP_SYN).frame());
    let (backend, _) = destination(&out);
    v6.egress(&Packet6::tcp(backend, 8080, CLIENT6, 40300, TCP_SYN | TCP_ACK).frame());
    v6.ingress(&Packet6::tcp(CLIENT6, 40300, WEB6, 80, TCP_ACK).frame());
    v6.ingress(&Packet6::tcp(CLIENT6, 40300, WEB6, 80, TCP_RST | TCP_ACK).frame());
    let fwd_key = ct_key6(CLIENT6, 40300, WEB6, 80, IPPROTO_TCP, CT_DIR_FORWARD);
    assert_eq!(v6.ct(&fwd_key).unwrap().state, CtState::Closed as u8);

    let direct = Packet6::tcp(CLIENT6, 40300, backend, 8080, TCP_SYN).frame();
    assert_eq!(v6.ingress(&direct), (PASS, direct.clone()), "untouched");
    assert_eq!((v6.stat(Stat::ClashYielded), v6.stat(Stat::PortRemapped)), (1, 0));
    assert!(v6.ct(&fwd_key).is_none(), "the closed flow's entries are gone");
    assert!(v6.ct(&ct_key6(backend, 8080, CLIENT6, 40300, IPPROTO_TCP, CT_DIR_REPLY)).is_none());
    let answer = Packet6::tcp(backend, 8080, CLIENT6, 40300, TCP_SYN | TCP_ACK).frame();
    assert_eq!(v6.egress(&answer), (PASS, answer.clone()), "B's answer reaches the client from B");

    // Expired: a UDP flow idle past its timeout (its entries aged by hand) yields the same way.
    v6.ingress(&Packet6::udp(CLIENT6, 56410, DNS6, 53, b"q").frame());
    for key in [
        ct_key6(CLIENT6, 56410, DNS6, 53, IPPROTO_UDP, CT_DIR_FORWARD),
        ct_key6(DNS6_BACKEND, 53, CLIENT6, 56410, IPPROTO_UDP, CT_DIR_REPLY),
    ] {
        let entry = v6.conntrack.get(&key, 0).unwrap();
        v6.conntrack.insert(key, CtEntryV6 { last_seen_ns: 1, ..entry }, 0).unwrap();
    }
    let query = Packet6::udp(CLIENT6, 56410, DNS6_BACKEND, 53, b"direct").frame();
    assert_eq!(v6.ingress(&query), (PASS, query.clone()));
    let answer = Packet6::udp(DNS6_BACKEND, 53, CLIENT6, 56410, b"from the pod").frame();
    assert_eq!(v6.egress(&answer), (PASS, answer.clone()));
    assert_eq!(v6.stat(Stat::ClashYielded), 2);
}

/// Two Services in front of one backend, one client port to both at once: the second flow's reply
/// tuple is the first's, so its port is remapped, and each reply comes from the Service it was
/// sent to.
#[test]
fn two_v6_services_with_one_backend_share_a_client_port() {
    let mut v6 = V6::new();
    let (one, two, shared) = (addr6(0x51, 0x0096), addr6(0x52, 0x0096), addr6(0x40, 0x0244));
    v6.frontend(one, 80, IPPROTO_TCP, &[(shared, 8080)]);
    v6.frontend(two, 80, IPPROTO_TCP, &[(shared, 8080)]);
    let first = Packet6::tcp(CLIENT6, 40400, one, 80, TCP_SYN);
    assert_eq!(v6.ingress(&first.frame()).1, Packet6 { dst: shared, dport: 8080, ..first }.frame());
    let second = Packet6::tcp(CLIENT6, 40400, two, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&second.frame());
    assert_eq!(ret, PASS);
    let (_, remapped) = source(&out);
    assert!(REMAP_PORTS.contains(&remapped), "port {remapped}");
    assert_eq!(out, Packet6 { sport: remapped, dst: shared, dport: 8080, ..second }.frame());
    assert!(l4_checksum_valid(&out));
    let fwd = v6.ct(&ct_key6(CLIENT6, 40400, two, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.flags, CT_FLAG_REMAP);

    let to_first = Packet6::tcp(shared, 8080, CLIENT6, 40400, TCP_SYN | TCP_ACK);
    assert_eq!(v6.egress(&to_first.frame()).1, Packet6 { src: one, sport: 80, ..to_first }.frame());
    let to_second = Packet6::tcp(shared, 8080, CLIENT6, remapped, TCP_SYN | TCP_ACK);
    let (_, out) = v6.egress(&to_second.frame());
    assert_eq!(out, Packet6 { src: two, sport: 80, dport: 40400, ..to_second }.frame());
    assert!(l4_checksum_valid(&out));
    // Both go on: the second flow's segments keep the remapped port.
    let ack = Packet6::tcp(CLIENT6, 40400, two, 80, TCP_ACK);
    assert_eq!(
        v6.ingress(&ack.frame()).1,
        Packet6 { sport: remapped, dst: shared, dport: 8080, ..ack }.frame()
    );
    let ack = Packet6::tcp(CLIENT6, 40400, one, 80, TCP_ACK);
    assert_eq!(v6.ingress(&ack.frame()).1, Packet6 { dst: shared, dport: 8080, ..ack }.frame());
    assert_eq!(v6.stat(Stat::ReverseNat), 2);
}

/// Packet too big about remapped flows (port reuse): the quote reaches the client with its own
/// source port back, not the remapped one its stack knows nothing of — for the direct flow to the
/// pod (the quoted destination stays the pod) and for a second Service flow (the quoted
/// destination goes back to that Service). Without it TCP on a remapped flow never learns a
/// smaller path MTU.
#[test]
fn packet_too_big_about_a_remapped_flow_quotes_the_clients_own_port() {
    let mut v6 = V6::new();
    let mtu = [0, 0, 0x05, 0x00];
    let router = addr6(1, 0x0900);
    let (_, out) = v6.ingress(&Packet6::tcp(CLIENT6, 40500, WEB6, 80, TCP_SYN).frame());
    let (backend, _) = destination(&out);
    v6.egress(&Packet6::tcp(backend, 8080, CLIENT6, 40500, TCP_SYN | TCP_ACK).frame());

    // Direct to the pod from the same port: remapped.
    let direct = Packet6 { payload: vec![0x42; 64], ..Packet6::tcp(CLIENT6, 40500, backend, 8080, TCP_SYN) };
    let (_, sent) = v6.ingress(&direct.frame());
    let (_, remapped) = source(&sent);
    assert!(REMAP_PORTS.contains(&remapped), "source port {remapped}");
    let error = icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &sent[14..]].concat());
    // The client's own header and ports; the quote's TCP checksum stays the sent packet's, as for
    // every quote.
    let quote = [&direct.frame()[14..14 + 44], &sent[14 + 44..]].concat();
    let (ret, out) = v6.egress(&error);
    assert_eq!(
        (ret, out),
        (PASS, icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &quote[..]].concat())),
        "the direct flow's quote with port 40500"
    );

    // A second Service in front of the same backend, from the same port: remapped, and its quote
    // gets both the Service and the client's port back.
    let other = addr6(0x56, 0x0096);
    v6.frontend(other, 80, IPPROTO_TCP, &[(backend, 8080)]);
    let second = Packet6 { payload: vec![0x43; 64], ..Packet6::tcp(CLIENT6, 40500, other, 80, TCP_SYN) };
    let (_, sent) = v6.ingress(&second.frame());
    let (_, remapped2) = source(&sent);
    assert!(REMAP_PORTS.contains(&remapped2) && remapped2 != remapped, "source port {remapped2}");
    let error = icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &sent[14..]].concat());
    let quote = [&second.frame()[14..14 + 44], &sent[14 + 44..]].concat();
    let (ret, out) = v6.egress(&error);
    assert_eq!((ret, out), (PASS, icmp6(&router, &CLIENT6, 2, 0, &[&mtu, &quote[..]].concat())));
    assert_eq!(v6.stat(Stat::IcmpErrorUnnat), 2);
}

/// A pod reaching itself through two of its Services from one source port, on one backend port:
/// both flows are hairpin flows with the reply tuple `pod:8080 → HAIRPIN_ADDR_V6:port`, so the
/// second one's port is remapped (as IPv4's) rather than its reply entry overwriting the first's;
/// each answer comes back from the Service it was sent to, to the pod's own port.
#[test]
fn a_pod_reaching_itself_through_two_v6_services_from_one_port_gets_the_second_remapped() {
    let mut v6 = V6::new();
    let self_b = addr6(0x78, 0x0096);
    v6.frontend(self_b, 80, IPPROTO_TCP, &[(CLIENT6, 8080)]);
    let first = Packet6::tcp(CLIENT6, 40500, SELF6, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&first.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(
        out,
        bounced(Packet6 { src: HAIRPIN_ADDR_V6, dst: CLIENT6, dport: 8080, ..first.clone() }.frame())
    );
    let second = Packet6::tcp(CLIENT6, 40500, self_b, 80, TCP_SYN);
    let (ret, out) = v6.ingress(&second.frame());
    assert_eq!(ret, BOUNCE, "still bounced back to the pod");
    let (_, remapped) = source(&out);
    assert!(REMAP_PORTS.contains(&remapped), "port {remapped}");
    let hairpinned = Packet6 { src: HAIRPIN_ADDR_V6, sport: remapped, dst: CLIENT6, dport: 8080, ..second };
    assert_eq!(out, bounced(hairpinned.frame()));
    assert!(l4_checksum_valid(&out));
    let fwd = v6.ct(&ct_key6(CLIENT6, 40500, self_b, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.flags, CT_FLAG_REMAP | CT_FLAG_HAIRPIN);
    let first_reply =
        v6.ct(&ct_key6(CLIENT6, 8080, HAIRPIN_ADDR_V6, 40500, IPPROTO_TCP, CT_DIR_REPLY)).unwrap();
    assert_eq!(first_reply.nat_addr, SELF6, "the first flow's reply entry is still its own");

    let to_first = Packet6::tcp(CLIENT6, 8080, HAIRPIN_ADDR_V6, 40500, TCP_SYN | TCP_ACK);
    let (ret, out) = v6.ingress(&to_first.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, bounced(Packet6 { src: SELF6, sport: 80, dst: CLIENT6, ..to_first }.frame()));
    let to_second = Packet6::tcp(CLIENT6, 8080, HAIRPIN_ADDR_V6, remapped, TCP_SYN | TCP_ACK);
    let (ret, out) = v6.ingress(&to_second.frame());
    assert_eq!(ret, BOUNCE);
    let back = Packet6 { src: self_b, sport: 80, dst: CLIENT6, dport: 40500, ..to_second };
    assert_eq!(out, bounced(back.frame()), "from the second Service, to the pod's own port");
    assert!(l4_checksum_valid(&out));

    // The second flow's next segment keeps its remapped port and the hairpin source.
    let ack = Packet6::tcp(CLIENT6, 40500, self_b, 80, TCP_ACK);
    let (ret, out) = v6.ingress(&ack.frame());
    assert_eq!(ret, BOUNCE);
    let hairpinned = Packet6 { src: HAIRPIN_ADDR_V6, sport: remapped, dst: CLIENT6, dport: 8080, ..ack };
    assert_eq!(out, bounced(hairpinned.frame()));
    assert_eq!(v6.stat(Stat::ReverseNat), 2);
}
