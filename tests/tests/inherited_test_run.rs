//! Inherited flows, byte-exact through BPF_PROG_TEST_RUN: connections netfilter (kube-proxy)
//! translated before kproxy attached, marked in INHERITED_V4 as the agent marks them from
//! nf_conntrack, are left to netfilter untouched; a new flow whose reply tuple netfilter still
//! holds gets another source port. The sandbox test of the whole migration is
//! tests/tests/migration.rs.

mod common;

use common::{
    Packet,
    harness::{CLIENT, DNS_BACKEND, DNS_VIP, DROP, Harness, PASS, WEB_BACKENDS, WEB_VIP, ct_key},
};
use proxy_common::{
    maps::{CT_DIR_FORWARD, IPPROTO_TCP, IPPROTO_UDP},
    packet::{TCP_ACK, TCP_SYN},
    stats::Stat,
};

#[test]
fn a_segment_of_a_connection_netfilter_translated_passes_untouched() {
    let mut h = Harness::new();
    // Not netfilter's: a segment with no connection is dropped, as before.
    let stray = Packet::tcp(CLIENT, 40000, WEB_VIP, 80, TCP_ACK).frame();
    assert_eq!(h.ingress(&stray).0, DROP);
    assert_eq!(h.stat(Stat::DropInvalidTcp), 1);

    h.mark_inherited(
        IPPROTO_TCP,
        [(CLIENT, 40001), (WEB_VIP, 80)],
        [(WEB_BACKENDS[1], 8080), (CLIENT, 40001)],
        true,
    );
    let segment = Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_ACK).frame();
    let (ret, out) = h.ingress(&segment);
    assert_eq!(ret, PASS);
    assert_eq!(out, segment, "netfilter translates it: kproxy must not touch a byte");
    assert_eq!(h.stat(Stat::PassInheritedFlow), 1);
    assert_eq!(h.stat(Stat::DropInvalidTcp), 1);
    assert!(h.ct(&ct_key(CLIENT, 40001, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).is_none());

    // A SYN retransmitted for a connection netfilter has in SYN_SENT is netfilter's too.
    let syn = Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_SYN).frame();
    assert_eq!(h.ingress(&syn), (PASS, syn.clone()));
}

#[test]
fn a_datagram_of_an_inherited_udp_flow_is_not_translated_again() {
    let mut h = Harness::new();
    h.mark_inherited(IPPROTO_UDP, [(CLIENT, 5353), (DNS_VIP, 53)], [(DNS_BACKEND, 53), (CLIENT, 5353)], true);
    let query = Packet::udp(CLIENT, 5353, DNS_VIP, 53, b"query").frame();
    assert_eq!(h.ingress(&query), (PASS, query.clone()));
    assert_eq!(h.stat(Stat::PassInheritedFlow), 1);
    assert_eq!(h.stat(Stat::DnatNew), 0);

    // Another port of the same client is a new flow of kproxy's.
    let other = Packet::udp(CLIENT, 5354, DNS_VIP, 53, b"query").frame();
    let (ret, out) = h.ingress(&other);
    assert_eq!(ret, PASS);
    assert_eq!(out[30..34], DNS_BACKEND);
    assert_eq!(h.stat(Stat::DnatNew), 1);
}

#[test]
fn an_inherited_connection_to_a_port_the_service_lost_is_not_refused() {
    let mut h = Harness::new();
    h.mark_inherited(
        IPPROTO_TCP,
        [(CLIENT, 40003), (WEB_VIP, 81)],
        [(WEB_BACKENDS[0], 8081), (CLIENT, 40003)],
        true,
    );
    let segment = Packet::tcp(CLIENT, 40003, WEB_VIP, 81, TCP_ACK).frame();
    assert_eq!(h.ingress(&segment), (PASS, segment.clone()));
    assert_eq!(h.stat(Stat::RejectTcp), 0);
    // Unmarked, the same segment is refused (the VIP has no port 81).
    let (ret, _) = h.ingress(&Packet::tcp(CLIENT, 40004, WEB_VIP, 81, TCP_ACK).frame());
    assert_ne!(ret, PASS);
}

#[test]
fn a_new_flow_whose_reply_tuple_netfilter_still_holds_gets_another_source_port() {
    let mut h = Harness::new();
    // The client's earlier connection from port 40002 went through kube-proxy to each backend in
    // turn; netfilter keeps the last in TIME_WAIT (over: only its reply tuple is marked).
    for backend in WEB_BACKENDS {
        h.mark_inherited(
            IPPROTO_TCP,
            [(CLIENT, 40002), (WEB_VIP, 80)],
            [(backend, 8080), (CLIENT, 40002)],
            false,
        );
    }
    let syn = Packet::tcp(CLIENT, 40002, WEB_VIP, 80, TCP_SYN).frame();
    let (ret, out) = h.ingress(&syn);
    assert_eq!(ret, PASS);
    assert!(WEB_BACKENDS.iter().any(|b| out[30..34] == *b), "DNATed to a backend");
    let sport = u16::from_be_bytes([out[34], out[35]]);
    assert_ne!(sport, 40002, "netfilter would drop a new flow with an existing reply tuple");
    assert_eq!(h.stat(Stat::PortRemapped), 1);
    assert_eq!(h.stat(Stat::PassInheritedFlow), 0);
}
