//! Service semantics in the datapath, byte-exact through BPF_PROG_TEST_RUN:
//! refusals (exact RST and ICMP bytes), INVALID TCP, every conntrack state
//! transition, expiry, backends that go away, session affinity and hairpin.

mod common;

use std::collections::BTreeSet;

use common::{
    CLIENT_MAC, NODE_MAC, Packet,
    harness::{
        BOUNCE, CLIENT, DNS_VIP, DROP, Harness, PASS, WEB_BACKENDS, WEB_VIP, ct_key, desired, frontend,
    },
};
use kproxy::model::Desired;
use kproxy::net::Protocol;
use proxy_common::{
    checksum,
    conntrack::CtState,
    maps::{
        AffinityKeyV4, CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, ConfigV4, IPPROTO_TCP, IPPROTO_UDP,
    },
    packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    stats::Stat,
};

const EMPTY_VIP: [u8; 4] = [10, 96, 0, 200];

fn destination(frame: &[u8]) -> ([u8; 4], u16) {
    (frame[30..34].try_into().unwrap(), u16::from_be_bytes([frame[36], frame[37]]))
}

/// The frame a correct refusal of `syn` (seq 0x01020304, no payload) is:
/// written out field by field, checksums from the reference math.
fn expected_rst(client: [u8; 4], client_port: u16, vip: [u8; 4], vip_port: u16) -> Vec<u8> {
    let mut ip = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, IPPROTO_TCP, 0, 0];
    ip.extend_from_slice(&vip);
    ip.extend_from_slice(&client);
    let c = checksum::checksum(&ip).to_be_bytes();
    ip[10..12].copy_from_slice(&c);
    let mut tcp = Vec::new();
    tcp.extend_from_slice(&vip_port.to_be_bytes());
    tcp.extend_from_slice(&client_port.to_be_bytes());
    tcp.extend_from_slice(&[0, 0, 0, 0]); // seq 0: the SYN carried no ACK
    tcp.extend_from_slice(&0x0102_0305u32.to_be_bytes()); // its seq + 1
    tcp.extend_from_slice(&[0x50, TCP_RST | TCP_ACK, 0, 0, 0, 0, 0, 0]);
    let c = checksum::l4_checksum(vip, client, IPPROTO_TCP, &tcp).to_be_bytes();
    tcp[16..18].copy_from_slice(&c);
    let mut frame = Vec::new();
    frame.extend_from_slice(&CLIENT_MAC); // back to the pod
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&tcp);
    frame
}

fn expected_icmp(offending: &[u8]) -> Vec<u8> {
    let quoted = &offending[14..14 + 28];
    let (client, vip) = (&offending[26..30], &offending[30..34]);
    let mut ip = vec![0x45, 0xc0, 0, 56, 0, 0, 0, 0, 64, 1, 0, 0];
    ip.extend_from_slice(vip);
    ip.extend_from_slice(client);
    let c = checksum::checksum(&ip).to_be_bytes();
    ip[10..12].copy_from_slice(&c);
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(quoted);
    let c = checksum::checksum(&icmp).to_be_bytes();
    icmp[2..4].copy_from_slice(&c);
    let mut frame = Vec::new();
    frame.extend_from_slice(&CLIENT_MAC);
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}

/// A frame sent back to the pod it came from: addressed to the pod's MAC.
fn bounced(mut frame: Vec<u8>) -> Vec<u8> {
    frame[..6].copy_from_slice(&CLIENT_MAC);
    frame[6..12].copy_from_slice(&NODE_MAC);
    frame
}

#[test]
fn a_syn_to_a_service_without_endpoints_is_answered_with_an_exact_rst() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 4242, EMPTY_VIP, 80, TCP_SYN).frame();
    let (ret, out) = h.ingress(&syn);
    assert_eq!(ret, BOUNCE, "the RST goes back out of the pod's interface");
    assert_eq!(out, expected_rst(CLIENT, 4242, EMPTY_VIP, 80));
    assert_eq!(h.stat(Stat::RejectTcp), 1);
    assert_eq!(h.conntrack.keys().count(), 0);
}

#[test]
fn a_port_the_service_does_not_have_is_refused_too() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 4243, WEB_VIP, 443, TCP_SYN).frame();
    let (ret, out) = h.ingress(&syn);
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, expected_rst(CLIENT, 4243, WEB_VIP, 443));
    // A payload-carrying UDP datagram to the same VIP: ICMP port unreachable
    // quoting its header and first 8 bytes.
    let dgram = Packet::udp(CLIENT, 5353, WEB_VIP, 9999, b"some payload").frame();
    let (ret, out) = h.ingress(&dgram);
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, expected_icmp(&dgram));
    assert_eq!((h.stat(Stat::RejectTcp), h.stat(Stat::RejectUdp)), (1, 1));
}

#[test]
fn udp_to_a_service_without_endpoints_gets_an_exact_port_unreachable() {
    let mut d = desired();
    d.frontends.push(frontend("quiet", "dns", EMPTY_VIP, 53, Protocol::Udp, &[]));
    let h = Harness::with(&Desired::new(d.frontends));
    let query = Packet::udp(CLIENT, 33333, EMPTY_VIP, 53, &[0x12; 40]).frame();
    let (ret, out) = h.ingress(&query);
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, expected_icmp(&query));
    // A short datagram grows to the ICMP's size.
    let short = Packet::udp(CLIENT, 33334, EMPTY_VIP, 53, b"").frame();
    let (_, out) = h.ingress(&short);
    assert_eq!(out, expected_icmp(&short));
}

#[test]
fn a_reset_is_never_answered() {
    let h = Harness::new();
    let rst = Packet::tcp(CLIENT, 4244, EMPTY_VIP, 80, TCP_RST).frame();
    assert_eq!(h.ingress(&rst).0, DROP);
}

#[test]
fn invalid_tcp_to_a_vip_is_dropped_not_leaked() {
    let h = Harness::new();
    for flags in [TCP_ACK, TCP_ACK | 0x08, TCP_FIN | TCP_ACK, TCP_SYN | TCP_ACK] {
        let frame = Packet::tcp(CLIENT, 40500, WEB_VIP, 80, flags).frame();
        assert_eq!(h.ingress(&frame).0, DROP, "flags {flags:#x}");
    }
    assert_eq!(h.stat(Stat::DropInvalidTcp), 4);
    assert_eq!(h.conntrack.keys().count(), 0, "no flow starts mid-stream");
}

#[test]
fn every_tcp_state_transition() {
    let h = Harness::new();
    let fwd = ct_key(CLIENT, 40600, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD);
    let (_, out) = h.ingress(&Packet::tcp(CLIENT, 40600, WEB_VIP, 80, TCP_SYN).frame());
    let (backend, port) = destination(&out);
    let state = || CtState::from_u8(h.ct(&fwd).unwrap().state).unwrap();
    assert_eq!(state(), CtState::SynSent);
    h.egress(&Packet::tcp(backend, port, CLIENT, 40600, TCP_SYN | TCP_ACK).frame());
    assert_eq!(state(), CtState::SynReceived);
    h.ingress(&Packet::tcp(CLIENT, 40600, WEB_VIP, 80, TCP_ACK).frame());
    assert_eq!(state(), CtState::Established);
    let reply = ct_key(backend, port, CLIENT, 40600, IPPROTO_TCP, CT_DIR_REPLY);
    h.egress(&Packet::tcp(backend, port, CLIENT, 40600, TCP_ACK).frame());
    assert_eq!(h.ct(&reply).unwrap().state, CtState::Established as u8, "mirrored on the reply entry");
    h.egress(&Packet::tcp(backend, port, CLIENT, 40600, TCP_FIN | TCP_ACK).frame());
    assert_eq!(state(), CtState::Closing);
    h.ingress(&Packet::tcp(CLIENT, 40600, WEB_VIP, 80, TCP_RST).frame());
    assert_eq!(state(), CtState::Closed);
    // The port is reused for a new connection.
    h.ingress(&Packet::tcp(CLIENT, 40600, WEB_VIP, 80, TCP_SYN).frame());
    assert_eq!(state(), CtState::SynSent);
}

#[test]
fn an_expired_flow_starts_over() {
    let mut h = Harness::new();
    h.config.set(0, ConfigV4 { timeout_udp_ns: 1, ..Default::default() }, 0).unwrap();
    let query = Packet::udp(CLIENT, 40700, [10, 96, 0, 10], 53, b"q").frame();
    h.ingress(&query);
    let key = ct_key(CLIENT, 40700, [10, 96, 0, 10], 53, IPPROTO_UDP, CT_DIR_FORWARD);
    let first = h.ct(&key).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    h.ingress(&query);
    let second = h.ct(&key).unwrap();
    assert!(second.created_ns > first.created_ns, "a new entry replaced the expired one");
    assert_eq!(second.packets, 1);
    assert_eq!(h.stat(Stat::ConntrackExpired), 1);
}

/// A backend leaves BACKENDS_V4 (unready, relabelled, or deleted) while its pod may still
/// serve: as through kube-proxy, which never touches a TCP flow's conntrack entry, the TCP
/// flow keeps going to it; its replies are still un-NATed.
#[test]
fn a_tcp_flow_whose_backend_is_gone_keeps_its_backend() {
    let mut h = Harness::new();
    let (_, out) = h.ingress(&Packet::tcp(CLIENT, 40800, WEB_VIP, 80, TCP_SYN).frame());
    let (old, _) = destination(&out);
    assert!(WEB_BACKENDS.contains(&old));
    let mut d = desired();
    let web = d.frontends.iter_mut().find(|f| f.service.name == "web").unwrap();
    web.backends.retain(|b| b.addr != std::net::IpAddr::from(old));
    h.apply(&d);
    let (ret, out) = h.ingress(&Packet::tcp(CLIENT, 40800, WEB_VIP, 80, TCP_ACK).frame());
    assert_eq!(ret, PASS);
    assert_eq!(destination(&out), (old, 8080), "the next segment still goes to its backend");
    assert_eq!(h.stat(Stat::Rebalanced), 0);
    let fwd = h.ct(&ct_key(CLIENT, 40800, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.nat_addr, old);
    let (ret, out) = h.egress(&Packet::tcp(old, 8080, CLIENT, 40800, TCP_ACK).frame());
    assert_eq!(ret, PASS);
    assert_eq!(&out[26..30], &WEB_VIP, "the backend's reply is un-NATed to the VIP");
    assert_eq!(u16::from_be_bytes([out[34], out[35]]), 80);
}

/// A UDP flow whose backend is gone moves to a live one with its next datagram (the CoreDNS
/// problem: a resolver that keeps its source port must not keep asking a dead pod).
#[test]
fn a_udp_flow_whose_backend_is_gone_moves_to_another() {
    const DNS_BACKENDS: [[u8; 4]; 2] = [[10, 244, 0, 21], [10, 244, 0, 22]];
    let dns = |backends: &[[u8; 4]]| {
        let backends: Vec<([u8; 4], u16)> = backends.iter().map(|a| (*a, 53)).collect();
        Desired::new(vec![frontend("dns", "dns", DNS_VIP, 53, Protocol::Udp, &backends)])
    };
    let mut h = Harness::with(&dns(&DNS_BACKENDS));
    let query = Packet::udp(CLIENT, 40900, DNS_VIP, 53, b"q").frame();
    let (_, out) = h.ingress(&query);
    let (old, _) = destination(&out);
    let live: Vec<[u8; 4]> = DNS_BACKENDS.iter().copied().filter(|b| *b != old).collect();
    h.apply(&dns(&live));
    let (ret, out) = h.ingress(&query);
    assert_eq!(ret, PASS);
    assert_eq!(destination(&out), (live[0], 53), "the next datagram goes to the live backend");
    assert_eq!(h.stat(Stat::Rebalanced), 1);
    let fwd = h.ct(&ct_key(CLIENT, 40900, DNS_VIP, 53, IPPROTO_UDP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.nat_addr, live[0]);
    assert!(
        h.ct(&ct_key(old, 53, CLIENT, 40900, IPPROTO_UDP, CT_DIR_REPLY)).is_none(),
        "old reply entry gone"
    );
    assert!(h.ct(&ct_key(live[0], 53, CLIENT, 40900, IPPROTO_UDP, CT_DIR_REPLY)).is_some());
}

#[test]
fn session_affinity_sticks_until_its_timeout() {
    let mut d = desired();
    d.frontends.iter_mut().find(|f| f.service.name == "web").unwrap().session_affinity_timeout = Some(60);
    let mut h = Harness::with(&d);
    let mut seen = BTreeSet::new();
    for sport in 0..30 {
        let (_, out) = h.ingress(&Packet::tcp(CLIENT, 41000 + sport, WEB_VIP, 80, TCP_SYN).frame());
        seen.insert(destination(&out).0);
    }
    assert_eq!(seen.len(), 1, "30 connections from one client stuck to one backend: {seen:?}");
    assert_eq!(h.stat(Stat::AffinityHit), 29);

    // Once the entry is older than the timeout, another backend can be picked.
    let mut backends = BTreeSet::new();
    let rev_nat_id =
        h.ct(&ct_key(CLIENT, 41000, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap().rev_nat_id;
    let key = AffinityKeyV4 { client: CLIENT, rev_nat_id };
    for sport in 0..40 {
        let mut entry = h.affinity.get(&key, 0).unwrap();
        entry.last_used_ns = 1;
        h.affinity.insert(key, entry, 0).unwrap();
        let (_, out) = h.ingress(&Packet::tcp(CLIENT, 42000 + sport, WEB_VIP, 80, TCP_SYN).frame());
        backends.insert(destination(&out).0);
    }
    assert!(backends.len() > 1, "after the timeout the choice is random again: {backends:?}");
}

#[test]
fn a_pod_reaching_itself_through_its_service_is_hairpinned() {
    const SELF_IP: [u8; 4] = [10, 244, 0, 11];
    let d = Desired::new(vec![frontend("self", "http", WEB_VIP, 80, Protocol::Tcp, &[(SELF_IP, 8080)])]);
    let h = Harness::with(&d);
    let syn = Packet::tcp(SELF_IP, 45000, WEB_VIP, 80, TCP_SYN);
    let (ret, out) = h.ingress(&syn.frame());
    assert_eq!(ret, BOUNCE, "sent straight back to the pod");
    let hairpin = proxy_common::maps::DEFAULT_HAIRPIN_ADDR;
    assert_eq!(out, bounced(Packet { src: hairpin, dst: SELF_IP, dport: 8080, ..syn }.frame()));
    let fwd = h.ct(&ct_key(SELF_IP, 45000, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.flags & CT_FLAG_HAIRPIN, CT_FLAG_HAIRPIN, "the entry records the hairpin");

    // The pod answers the hairpin address; the node turns it back into the VIP.
    let syn_ack = Packet::tcp(SELF_IP, 8080, hairpin, 45000, TCP_SYN | TCP_ACK);
    let (ret, out) = h.ingress(&syn_ack.frame());
    assert_eq!(ret, BOUNCE);
    assert_eq!(out, bounced(Packet { src: WEB_VIP, sport: 80, dst: SELF_IP, ..syn_ack }.frame()));
    assert_eq!(h.stat(Stat::Hairpin), 1);
}
