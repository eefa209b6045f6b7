//! Byte-exact BPF_PROG_TEST_RUN tests of what the tc programs do with ICMP: errors about
//! translated flows are un-NATed only when they are what they claim to be (addressed to the
//! quoted packet's sender, the quote inside the IP datagram), and refusals are never sent to
//! sources that name no single host.
//!
//! The external program's route lookups need an interface, a route and neighbours: those tests
//! run in a thread that moves itself into a new network namespace (`unshare(CLONE_NEWNET)`)
//! holding a veth pair with static neighbours and no route out; it disappears with the thread.

mod common;

use common::external_node::{
    EXT_CLIENT, EXT_CLIENT_MAC, LOCAL_POD, NODE, NODE_MAC, OTHER_HOST, PEER as ROUTER, PEER_MAC,
    REMOTE_BACKEND, in_private_netns,
};

use std::net::Ipv4Addr;

use aya::programs::SchedClassifier;
use common::{
    Packet,
    harness::{CLIENT, Harness, PASS, WEB_VIP, test_run},
    icmp_error,
};
use kproxy::{
    bpf,
    model::{BackendAddr, Frontend, FrontendKind, ServiceName},
    net::Protocol,
    sync::Syncer,
};
use proxy_common::{checksum, maps::ExternalIfaceV4, packet::TCP_SYN, stats::Stat};

/// TC_ACT_REDIRECT: sent out of an interface without the stack.
const REDIRECT: u32 = 7;

/// The outer IPv4 header and the ICMP message checksums of an ICMP frame, each over what the IP
/// total length covers.
fn icmp_checksums_valid(frame: &[u8]) -> bool {
    let ip = &frame[14..];
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    checksum::is_valid(checksum::add_words(0, &ip[..20]))
        && checksum::is_valid(checksum::add_words(0, &ip[20..total]))
}

/// An error about a translated flow is sent to the packet's sender: one addressed to another pod
/// is not about the client's flow at all (whatever its quote says) and is not rewritten.
#[test]
fn on_pod_egress_an_error_addressed_to_another_pod_is_left_untouched() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 40002, WEB_VIP, 80, TCP_SYN);
    let (_, dnat) = h.ingress(&syn.frame());
    let router = [10, 244, 9, 1];
    let unnat = h.stat(Stat::IcmpErrorUnnat);
    let error = icmp_error(router, [10, 244, 0, 3], 3, 4, &dnat[14..14 + 28]);
    assert_eq!(h.egress(&error), (PASS, error.clone()));
    assert_eq!(h.stat(Stat::IcmpErrorUnnat), unnat);
}

// The north–south path: a NodePort on the node's external interface, its backend on another node
// (so the flow is source-NATed to the node address).

/// The datapath with a NodePort NODE:30080 → REMOTE_BACKEND:80 and ext0 as external interface.
struct External {
    ebpf: aya::Ebpf,
    _syncer: Syncer,
    stats: aya::maps::PerCpuArray<aya::maps::MapData, u64>,
    ingress: u32,
}

impl External {
    fn new(ingress: u32) -> Self {
        let mut ebpf = bpf::load_unpinned().expect("loading the datapath needs root");
        let mut maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        maps.external_ifaces.insert(ingress, ExternalIfaceV4 { addr: NODE, _pad: 0 }, 0).unwrap();
        let mut web = Frontend::new(
            ServiceName { namespace: "default".into(), name: "web".into() },
            "http",
            Ipv4Addr::from(NODE),
            30080,
            Protocol::Tcp,
            vec![BackendAddr { addr: Ipv4Addr::from(REMOTE_BACKEND).into(), port: 80 }],
        );
        web.kind = FrontendKind::NodePort;
        let stats = maps.stats;
        let store = bpf::BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips);
        let mut syncer = Syncer::with_store(store).unwrap();
        let report = syncer.apply(&kproxy::model::Desired::new(vec![web]));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        Self { ebpf, _syncer: syncer, stats, ingress }
    }

    fn stat(&self, stat: Stat) -> u64 {
        self.stats.get(&(stat as u32), 0).unwrap().iter().sum()
    }

    /// The external tc program on a frame arriving on ext0.
    fn tc(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier =
            self.ebpf.program("kproxy_external_ingress").unwrap().try_into().unwrap();
        // struct __sk_buff up to ifindex (offset 40), which picks the device the packet is on.
        let mut ctx = [0u8; 192];
        ctx[40..44].copy_from_slice(&self.ingress.to_ne_bytes());
        test_run(prog, frame, Some(&ctx))
    }

    /// The client's SYN to the NodePort, as it arrives, and as the datapath sent it on (source
    /// NATed to the node address and a SNAT port, destination the remote backend).
    fn snat_flow(&self, sport: u16) -> (Packet, Vec<u8>) {
        let syn = Packet::tcp(EXT_CLIENT, sport, NODE, 30080, TCP_SYN).with_payload(b"hello");
        let (action, out) = self.tc(&on_the_wire(syn.frame(), NODE_MAC, EXT_CLIENT_MAC));
        assert_eq!(action, REDIRECT, "the SYN was not source-NATed: {out:02x?}");
        assert_eq!(&out[14 + 12..14 + 20], &[NODE, REMOTE_BACKEND].concat());
        (syn, out)
    }
}

fn on_the_wire(mut frame: Vec<u8>, dst: [u8; 6], src: [u8; 6]) -> Vec<u8> {
    frame[..6].copy_from_slice(&dst);
    frame[6..12].copy_from_slice(&src);
    frame
}

/// A router on the way to the remote backend sends "fragmentation needed" about the source-NATed
/// SYN — but to another host, the client, or a pod, not to the node address the flow was
/// source-NATed to (the quote's source). Such an error is not about the node's flow: it goes on
/// untouched, where before it was un-NATed and redirected with an outer header checksum fixed up
/// from the quote's source instead of its real destination (so wrong). The error the node does
/// get is un-NATed with every checksum right.
#[test]
fn on_an_external_interface_only_errors_addressed_to_the_snat_address_are_un_nated() {
    in_private_netns(|ingress| {
        let x = External::new(ingress);
        let (syn, sent) = x.snat_flow(40000);
        let unnat = x.stat(Stat::IcmpErrorUnnat);
        for elsewhere in [OTHER_HOST, EXT_CLIENT, LOCAL_POD] {
            let error =
                on_the_wire(icmp_error(ROUTER, elsewhere, 3, 4, &sent[14..14 + 28]), NODE_MAC, PEER_MAC);
            let (action, out) = x.tc(&error);
            assert_eq!((action, &out), (PASS, &error), "an error addressed to {elsewhere:?}");
            assert_eq!(x.stat(Stat::IcmpErrorUnnat), unnat, "an error addressed to {elsewhere:?}");
        }

        let error = on_the_wire(icmp_error(ROUTER, NODE, 3, 4, &sent[14..14 + 28]), NODE_MAC, PEER_MAC);
        let (action, out) = x.tc(&error);
        assert_eq!(action, REDIRECT);
        let want = on_the_wire(
            icmp_error(ROUTER, EXT_CLIENT, 3, 4, &syn.frame()[14..14 + 28]),
            EXT_CLIENT_MAC,
            NODE_MAC,
        );
        assert_eq!(out, want);
        assert!(icmp_checksums_valid(&out));
        assert_eq!(x.stat(Stat::IcmpErrorUnnat), unnat + 1);
    });
}

// Quotes that run past the IP datagram.

use proxy_common::icmp::{ICMP_ERROR_SPAN, ICMP_HLEN};

/// `frame` (an ICMP error) as a sender that quoted only `quoted` bytes would have sent it: the IP
/// total length and both checksums cover that much; the rest of the original quote stays in the
/// frame as trailing bytes (Ethernet padding), outside the datagram.
fn datagram_ends_after(frame: &[u8], quoted: usize) -> Vec<u8> {
    let mut out = frame.to_vec();
    let total = 20 + ICMP_HLEN + quoted;
    out[14 + 2..14 + 4].copy_from_slice(&(total as u16).to_be_bytes());
    out[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let check = checksum::checksum(&out[14..14 + 20]);
    out[14 + 10..14 + 12].copy_from_slice(&check.to_be_bytes());
    let icmp = 14 + 20;
    out[icmp + 2..icmp + 4].copy_from_slice(&[0, 0]);
    let check = checksum::checksum(&out[icmp..14 + total]);
    out[icmp + 2..icmp + 4].copy_from_slice(&check.to_be_bytes());
    out
}

/// How many quoted bytes the datapath needs to know an error's flow: the quoted IPv4 header and
/// ports. An error that quotes less cannot be told apart from one about another flow.
const QUOTE_NEEDED: usize = ICMP_ERROR_SPAN - ICMP_HLEN;

/// A router between node and web backend needs smaller packets, but its error quotes less of the
/// client's packet than the datapath reads (cut anywhere before the end of the quoted ports),
/// with the rest of the quote sitting after the IP datagram. None of it is packet data: the
/// error goes on untouched, where before the quoted port in the padding was "un-NATed" and the
/// ICMP checksum (which does not cover it) adjusted for it, breaking it.
#[test]
fn on_pod_egress_an_error_whose_quote_runs_past_the_ip_datagram_is_left_untouched() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_SYN);
    let (_, dnat) = h.ingress(&syn.frame());
    let router = [10, 244, 9, 1];
    let whole = icmp_error(router, CLIENT, 3, 4, &dnat[14..14 + 28]);
    let unnat = h.stat(Stat::IcmpErrorUnnat);
    for quoted in 0..QUOTE_NEEDED {
        let error = datagram_ends_after(&whole, quoted);
        assert!(icmp_checksums_valid(&error));
        assert_eq!(h.egress(&error), (PASS, error.clone()), "quote cut after {quoted} bytes");
    }
    assert_eq!(h.stat(Stat::IcmpErrorUnnat), unnat);

    // The quote's header and ports inside the datagram, padding after them: un-NATed, the padding
    // as it was.
    let error = datagram_ends_after(&whole, QUOTE_NEEDED);
    let mut quote = syn.frame()[14..14 + 20].to_vec();
    quote.extend_from_slice(&dnat[14 + 20..14 + 22]);
    quote.extend_from_slice(&80u16.to_be_bytes());
    quote.extend_from_slice(&dnat[14 + 24..14 + 28]);
    let want = datagram_ends_after(&icmp_error(router, CLIENT, 3, 4, &quote), QUOTE_NEEDED);
    let mut want = want[..14 + 20 + ICMP_ERROR_SPAN].to_vec();
    want.extend_from_slice(&error[want.len()..]);
    let (ret, out) = h.egress(&error);
    assert_eq!((ret, &out), (PASS, &want));
    assert!(icmp_checksums_valid(&out));
    assert_eq!(h.stat(Stat::IcmpErrorUnnat), unnat + 1);
}

/// The external path reads an error's quote within the IP datagram only, as the pod path does: an
/// error to the node whose quoted ports lie past its IP total length is not un-NATed (nor
/// redirected to the client with padding bytes rewritten).
#[test]
fn on_an_external_interface_an_error_whose_quote_runs_past_the_ip_datagram_is_left_untouched() {
    in_private_netns(|ingress| {
        let x = External::new(ingress);
        let (_, sent) = x.snat_flow(40001);
        let whole = on_the_wire(icmp_error(ROUTER, NODE, 3, 4, &sent[14..14 + 28]), NODE_MAC, PEER_MAC);
        let unnat = x.stat(Stat::IcmpErrorUnnat);
        for quoted in 0..QUOTE_NEEDED {
            let error = datagram_ends_after(&whole, quoted);
            let (action, out) = x.tc(&error);
            assert_eq!((action, &out), (PASS, &error), "quote cut after {quoted} bytes");
        }
        assert_eq!(x.stat(Stat::IcmpErrorUnnat), unnat);
        let (action, out) = x.tc(&datagram_ends_after(&whole, QUOTE_NEEDED));
        assert_eq!(action, REDIRECT);
        assert!(icmp_checksums_valid(&out));
        assert_eq!(x.stat(Stat::IcmpErrorUnnat), unnat + 1);
    });
}

// Refusals.

use common::harness::{BOUNCE, DROP};
use proxy_common::packet::TCP_ACK;

const EMPTY_VIP: [u8; 4] = [10, 96, 0, 200];

/// Sources that name no single host (RFC 1122 3.2.2, 4.2.3.10; the kernel's `icmp_send` and TCP
/// reset path): a refusal to them would go to a group, to nobody, or to the node itself.
const NO_SINGLE_HOST: [[u8; 4]; 10] = [
    [255, 255, 255, 255],
    [0, 0, 0, 0],
    [0, 1, 2, 3],
    [127, 0, 0, 1],
    [127, 255, 0, 9],
    [224, 0, 0, 1],
    [239, 255, 255, 250],
    [240, 0, 0, 1],
    [250, 1, 2, 3],
    [255, 255, 255, 254],
];

/// A SYN or a datagram to a Service without endpoints is refused (RST, ICMP port unreachable)
/// only when its source is one host: from a broadcast, multicast, loopback, unspecified or
/// reserved (240/4) source it is dropped without an answer and counted, as the kernel would.
#[test]
fn refusals_are_never_sent_to_sources_that_name_no_single_host() {
    let h = Harness::new();
    for (i, source) in NO_SINGLE_HOST.into_iter().enumerate() {
        let syn = Packet::tcp(source, 4000 + i as u16, EMPTY_VIP, 80, TCP_SYN).frame();
        assert_eq!(h.ingress(&syn).0, DROP, "SYN from {source:?}");
        let ack = Packet::tcp(source, 4000 + i as u16, WEB_VIP, 443, TCP_ACK).frame();
        assert_eq!(h.ingress(&ack).0, DROP, "ACK to a port the Service does not have, from {source:?}");
        let dgram = Packet::udp(source, 5000 + i as u16, WEB_VIP, 9999, b"query").frame();
        assert_eq!(h.ingress(&dgram).0, DROP, "UDP from {source:?}");
    }
    assert_eq!(h.stat(Stat::RejectUnanswerable), 3 * NO_SINGLE_HOST.len() as u64);
    assert_eq!((h.stat(Stat::RejectTcp), h.stat(Stat::RejectUdp)), (0, 0));

    // The edges of those ranges are single hosts, and are answered.
    for source in [CLIENT, [1, 0, 0, 0], [126, 255, 255, 255], [128, 0, 0, 0], [223, 255, 255, 255]] {
        let syn = Packet::tcp(source, 4100, EMPTY_VIP, 80, TCP_SYN).frame();
        assert_eq!(h.ingress(&syn).0, BOUNCE, "SYN from {source:?}");
        let dgram = Packet::udp(source, 5100, WEB_VIP, 9999, b"query").frame();
        assert_eq!(h.ingress(&dgram).0, BOUNCE, "UDP from {source:?}");
    }
    assert_eq!((h.stat(Stat::RejectTcp), h.stat(Stat::RejectUdp)), (5, 5));
    assert_eq!(h.stat(Stat::RejectUnanswerable), 3 * NO_SINGLE_HOST.len() as u64);
}

/// A frame sent to a link-layer group (broadcast or multicast MAC) is not answered either
/// (RFC 1122 3.2.2): the kernel never forwards one, so netfilter's REJECT never sees it.
#[test]
fn refusals_are_never_sent_for_link_layer_broadcasts() {
    let h = Harness::new();
    for dmac in [[0xff; 6], [0x01, 0x00, 0x5e, 0, 0, 1], [0x33, 0x33, 0, 0, 0, 1]] {
        let syn =
            on_the_wire(Packet::tcp(CLIENT, 4200, EMPTY_VIP, 80, TCP_SYN).frame(), dmac, common::CLIENT_MAC);
        assert_eq!(h.ingress(&syn).0, DROP, "SYN to {dmac:02x?}");
        let dgram =
            on_the_wire(Packet::udp(CLIENT, 5200, WEB_VIP, 9999, b"q").frame(), dmac, common::CLIENT_MAC);
        assert_eq!(h.ingress(&dgram).0, DROP, "UDP to {dmac:02x?}");
    }
    assert_eq!(h.stat(Stat::RejectUnanswerable), 6);
    assert_eq!((h.stat(Stat::RejectTcp), h.stat(Stat::RejectUdp)), (0, 0));
}

/// An error about a flow whose source port was remapped (the client reused a port for the pod it
/// had reached through the Service, while that flow was live) quotes the remapped port; the
/// client's socket knows only its own, so the quote gets it back — byte for byte the error the
/// pod would have sent about the packet the client sent.
#[test]
fn on_pod_egress_an_error_about_a_remapped_flow_quotes_the_clients_own_port() {
    let h = Harness::new();
    let (_, via_service) = h.ingress(&Packet::tcp(CLIENT, 40100, WEB_VIP, 80, TCP_SYN).frame());
    let backend: [u8; 4] = via_service[30..34].try_into().unwrap();
    let backend_port = u16::from_be_bytes([via_service[36], via_service[37]]);
    let remapped_before = h.stat(Stat::PortRemapped);
    let direct = Packet::tcp(CLIENT, 40100, backend, backend_port, TCP_SYN).frame();
    let (ret, sent) = h.ingress(&direct);
    assert_eq!(ret, PASS);
    assert_eq!(h.stat(Stat::PortRemapped), remapped_before + 1, "the live flow's reply tuple is taken");
    let remapped = u16::from_be_bytes([sent[34], sent[35]]);
    assert_ne!(remapped, 40100);

    let error = icmp_error(backend, CLIENT, 3, 3, &sent[14..14 + 28]);
    let (ret, out) = h.egress(&error);
    assert_eq!(ret, PASS);
    assert_eq!(out, icmp_error(backend, CLIENT, 3, 3, &direct[14..14 + 28]));
    assert!(icmp_checksums_valid(&out));
}
