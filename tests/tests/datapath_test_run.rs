//! Byte-exact tests of the tc programs through BPF_PROG_TEST_RUN: the real
//! object, loaded into this kernel (needs root), fed crafted frames.
//! Maps are programmed through the agent's own Syncer from a model Desired.

mod common;

use std::collections::BTreeMap;

use common::{
    Packet, checksums_valid,
    harness::{CLIENT, DNS_BACKEND, DNS_VIP, Harness, PASS, WEB_BACKENDS, WEB_VIP, ct_key, desired},
    icmp_error,
};
use kproxy::model::Desired;
use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, IPPROTO_TCP, IPPROTO_UDP},
    packet::{TCP_ACK, TCP_SYN},
    stats::Stat,
};

/// Which backend a DNATed frame was sent to.
fn destination(frame: &[u8]) -> ([u8; 4], u16) {
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let l4 = 14 + ihl;
    (frame[30..34].try_into().unwrap(), u16::from_be_bytes([frame[l4 + 2], frame[l4 + 3]]))
}

#[test]
fn tcp_syn_to_vip_is_dnated_byte_exact_and_tracked() {
    let h = Harness::new();
    let syn = Packet::tcp(CLIENT, 40000, WEB_VIP, 80, TCP_SYN);
    let (ret, out) = h.ingress(&syn.frame());
    assert_eq!(ret, PASS);
    let (backend, port) = destination(&out);
    assert!(WEB_BACKENDS.contains(&backend), "DNATed to {backend:?}");
    assert_eq!(port, 8080);

    // Exactly the frame a correct DNAT produces: only the destination and the
    // two checksums differ from the input.
    let expected = Packet { dst: backend, dport: 8080, ..syn.clone() }.frame();
    assert_eq!(out, expected);
    assert!(checksums_valid(&out));

    let fwd = h.ct(&ct_key(CLIENT, 40000, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD)).expect("forward entry");
    assert_eq!(fwd.nat_addr, backend);
    assert_eq!(u16::from_be_bytes(fwd.nat_port), 8080);
    assert_eq!(fwd.state, CtState::SynSent as u8);
    assert_eq!(fwd.packets, 1);
    assert_eq!(fwd.bytes, 40);
    assert!(fwd.created_ns > 0 && fwd.last_seen_ns == fwd.created_ns);
    let reply = h.ct(&ct_key(backend, 8080, CLIENT, 40000, IPPROTO_TCP, CT_DIR_REPLY)).expect("reply entry");
    assert_eq!(reply.nat_addr, WEB_VIP);
    assert_eq!(u16::from_be_bytes(reply.nat_port), 80);
    assert_eq!(reply.rev_nat_id, fwd.rev_nat_id);
    assert_eq!(reply.backend_id, fwd.backend_id);
    assert_eq!(h.stat(Stat::DnatNew), 1);
}

#[test]
fn later_packets_of_a_flow_go_to_the_same_backend_and_replies_are_un_nated() {
    let h = Harness::new();
    let (_, first) = h.ingress(&Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_SYN).frame());
    let (backend, _) = destination(&first);

    // The backend's SYN-ACK on the client's veth egress: source back to the VIP.
    let syn_ack = Packet::tcp(backend, 8080, CLIENT, 40001, TCP_SYN | TCP_ACK);
    let (ret, out) = h.egress(&syn_ack.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet { src: WEB_VIP, sport: 80, ..syn_ack }.frame());
    let fwd_key = ct_key(CLIENT, 40001, WEB_VIP, 80, IPPROTO_TCP, CT_DIR_FORWARD);
    assert_eq!(h.ct(&fwd_key).unwrap().state, CtState::SynReceived as u8);

    for i in 0..20 {
        let ack = Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_ACK).with_payload(&[i; 100]);
        let (_, out) = h.ingress(&ack.frame());
        assert_eq!(destination(&out), (backend, 8080), "packet {i} changed backend");
        assert_eq!(out, Packet { dst: backend, dport: 8080, ..ack }.frame());
    }
    let fwd = h.ct(&fwd_key).unwrap();
    assert_eq!(fwd.state, CtState::Established as u8);
    assert_eq!(fwd.packets, 21);
    assert_eq!(h.stat(Stat::DnatEstablished), 20);
    assert_eq!(h.stat(Stat::ReverseNat), 1);
}

#[test]
fn udp_dns_query_and_reply() {
    let h = Harness::new();
    let query = Packet::udp(CLIENT, 56340, DNS_VIP, 53, b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00");
    let (ret, out) = h.ingress(&query.frame());
    assert_eq!(ret, PASS);
    assert_eq!(out, Packet { dst: DNS_BACKEND, ..query.clone() }.frame());
    assert!(checksums_valid(&out));

    let answer = Packet::udp(DNS_BACKEND, 53, CLIENT, 56340, b"\x12\x34\x81\x80answer");
    let (_, out) = h.egress(&answer.frame());
    assert_eq!(out, Packet { src: DNS_VIP, ..answer }.frame());
    let fwd = h.ct(&ct_key(CLIENT, 56340, DNS_VIP, 53, IPPROTO_UDP, CT_DIR_FORWARD)).unwrap();
    assert_eq!(fwd.state, CtState::Open as u8);
}

/// A datagram larger than the MTU arrives in fragments; only the first has the UDP header.
/// Each fragment is translated as the whole datagram would be: the first one's checksum
/// (which covers the whole datagram) and addresses, the later one's addresses, with the ports
/// the first one had. Replies the same way back.
#[test]
fn a_fragmented_udp_datagram_is_translated_fragment_by_fragment() {
    let h = Harness::new();
    let query = Packet::udp(CLIENT, 56341, DNS_VIP, 53, &[0x5a; 100]);
    let (first, later) = fragments(&query.frame(), 48);
    let (want_first, want_later) = fragments(&Packet { dst: DNS_BACKEND, ..query.clone() }.frame(), 48);
    let followed = h.stat(Stat::FragmentFollowed);
    let (ret, out) = h.ingress(&first);
    assert_eq!((ret, &out), (PASS, &want_first), "first fragment");
    let (ret, out) = h.ingress(&later);
    assert_eq!((ret, &out), (PASS, &want_later), "later fragment");
    assert_eq!(h.stat(Stat::FragmentFollowed), followed + 1);
    assert_eq!(reassembled_checksum_valid(&want_first, &want_later), Ok(()));

    let answer = Packet { ip_id: 0x7001, ..Packet::udp(DNS_BACKEND, 53, CLIENT, 56341, &[0xa5; 200]) };
    let (first, later) = fragments(&answer.frame(), 104);
    let (want_first, want_later) = fragments(&Packet { src: DNS_VIP, ..answer }.frame(), 104);
    assert_eq!(h.egress(&first).1, want_first, "first fragment of the reply");
    assert_eq!(h.egress(&later).1, want_later, "later fragment of the reply");

    // Another datagram's later fragment, its first never seen: left alone.
    let stray = fragments(&Packet { ip_id: 0x7002, ..query }.frame(), 48).1;
    let passed = h.stat(Stat::PassFragment);
    assert_eq!(h.ingress(&stray), (PASS, stray.clone()));
    assert_eq!(h.stat(Stat::PassFragment), passed + 1);
}

/// Splits an option-less IPv4 frame into two fragments: the first carries `first_len` bytes of
/// the IP payload (a multiple of 8), the second the rest; IP header checksums recomputed.
fn fragments(frame: &[u8], first_len: usize) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(first_len % 8, 0);
    let (head, payload) = frame.split_at(14 + 20);
    let fragment = |data: &[u8], frag_field: u16| {
        let mut out = head.to_vec();
        out[14 + 2..14 + 4].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
        out[14 + 6..14 + 8].copy_from_slice(&frag_field.to_be_bytes());
        out[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
        let check = proxy_common::checksum::checksum(&out[14..14 + 20]);
        out[14 + 10..14 + 12].copy_from_slice(&check.to_be_bytes());
        out.extend_from_slice(data);
        out
    };
    (fragment(&payload[..first_len], 0x2000), fragment(&payload[first_len..], (first_len / 8) as u16))
}

/// Whether the UDP checksum in `first` is right for the datagram the two fragments make.
fn reassembled_checksum_valid(first: &[u8], later: &[u8]) -> Result<(), String> {
    let mut whole = first[..14 + 20].to_vec();
    whole.extend_from_slice(&first[14 + 20..]);
    whole.extend_from_slice(&later[14 + 20..]);
    let total = (whole.len() - 14) as u16;
    whole[14 + 2..14 + 4].copy_from_slice(&total.to_be_bytes());
    whole[14 + 6..14 + 8].copy_from_slice(&[0, 0]);
    whole[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let check = proxy_common::checksum::checksum(&whole[14..14 + 20]);
    whole[14 + 10..14 + 12].copy_from_slice(&check.to_be_bytes());
    if checksums_valid(&whole) { Ok(()) } else { Err(format!("{whole:?}")) }
}

/// An ICMP error about a translated flow reaches the client as if the Service had sent it: the
/// quoted packet's destination goes back to the Service (address, header checksum, port, with
/// the ICMP checksum kept right), and the outer source too when the backend sent the error.
#[test]
fn icmp_errors_quoting_a_translated_flow_are_un_nated_for_the_client() {
    let h = Harness::new();
    let unnat_before = h.stat(Stat::IcmpErrorUnnat);

    // The DNS backend has nothing on port 53 any more: port unreachable, from the backend.
    let query = Packet::udp(CLIENT, 40000, DNS_VIP, 53, b"\x12\x34\x01\x00");
    let (_, dnat) = h.ingress(&query.frame());
    let sent = &dnat[14..];
    let error = icmp_error(DNS_BACKEND, CLIENT, 3, 3, &sent[..28]);
    let mut quote = query.frame()[14..14 + 20].to_vec();
    quote.extend_from_slice(&sent[20..28]);
    let (ret, out) = h.egress(&error);
    assert_eq!((ret, out), (PASS, icmp_error(DNS_VIP, CLIENT, 3, 3, &quote)), "port unreachable");

    // A router between node and web backend needs smaller packets: fragmentation needed, from
    // the router; the quoted port goes back from 8080 to 80.
    let syn = Packet::tcp(CLIENT, 40001, WEB_VIP, 80, TCP_SYN);
    let (_, dnat) = h.ingress(&syn.frame());
    let sent = &dnat[14..];
    let router = [10, 244, 9, 1];
    let error = icmp_error(router, CLIENT, 3, 4, &sent[..28]);
    let mut quote = syn.frame()[14..14 + 20].to_vec();
    quote.extend_from_slice(&sent[20..22]);
    quote.extend_from_slice(&80u16.to_be_bytes());
    quote.extend_from_slice(&sent[24..28]);
    let (ret, out) = h.egress(&error);
    assert_eq!((ret, out), (PASS, icmp_error(router, CLIENT, 3, 4, &quote)), "fragmentation needed");
    assert_eq!(h.stat(Stat::IcmpErrorUnnat), unnat_before + 2);

    // An error about a flow kproxy never translated is left alone.
    let stranger = Packet::udp(CLIENT, 40002, [10, 244, 0, 30], 53, b"x").frame()[14..14 + 28].to_vec();
    let error = icmp_error([10, 244, 0, 30], CLIENT, 3, 3, &stranger);
    assert_eq!(h.egress(&error), (PASS, error.clone()));
    assert_eq!(h.stat(Stat::IcmpErrorUnnat), unnat_before + 2);
}

#[test]
fn udp_without_checksum_keeps_zero() {
    let h = Harness::new();
    let query = Packet { udp_no_checksum: true, ..Packet::udp(CLIENT, 5353, DNS_VIP, 53, b"q") };
    let (_, out) = h.ingress(&query.frame());
    assert_eq!(out, Packet { dst: DNS_BACKEND, ..query }.frame());
    let l4 = 14 + 20;
    assert_eq!(&out[l4 + 6..l4 + 8], &[0, 0]);
}

#[test]
fn ip_options_are_handled() {
    let h = Harness::new();
    // Four NOPs: IHL 6, the TCP header starts at byte 24 of the IP packet.
    let syn = Packet { options: vec![1, 1, 1, 1], ..Packet::tcp(CLIENT, 40100, WEB_VIP, 80, TCP_SYN) };
    let (_, out) = h.ingress(&syn.frame());
    let (backend, port) = destination(&out);
    assert!(WEB_BACKENDS.contains(&backend));
    assert_eq!(out, Packet { dst: backend, dport: port, ..syn }.frame());
    assert!(checksums_valid(&out));
}

#[test]
fn other_traffic_passes_untouched() {
    let h = Harness::new();
    let mut cases: Vec<(&str, Vec<u8>, Stat)> = Vec::new();
    cases.push((
        "non-service TCP",
        Packet::tcp(CLIENT, 1234, [10, 244, 0, 11], 80, TCP_SYN).frame(),
        Stat::PassNoService,
    ));
    let mut icmp = Packet::tcp(CLIENT, 0, WEB_VIP, 0, 0).frame();
    icmp[14 + 9] = 1;
    cases.push(("ICMP to the VIP", icmp, Stat::PassNotTcpUdp));
    let mut arp = vec![0xff; 12];
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.extend_from_slice(&[0u8; 28]);
    cases.push(("ARP", arp, Stat::PassNotIpv4));
    let mut ipv6 = vec![0xff; 12];
    ipv6.extend_from_slice(&[0x86, 0xdd, 0x60]);
    ipv6.extend_from_slice(&[0u8; 60]);
    // IPv6 has a path of its own (ipv6_test_run.rs): a header without payload is malformed there.
    cases.push(("IPv6 without payload", ipv6, Stat::PassMalformed));
    let mut later_fragment = Packet::udp(CLIENT, 999, DNS_VIP, 53, &[7; 64]).frame();
    later_fragment[14 + 6..14 + 8].copy_from_slice(&0x00b9u16.to_be_bytes());
    cases.push(("a later fragment whose first was not seen", later_fragment, Stat::PassFragment));
    let mut truncated = Packet::tcp(CLIENT, 1234, WEB_VIP, 80, TCP_SYN).frame();
    truncated.truncate(14 + 20 + 10);
    cases.push(("TCP header cut short", truncated, Stat::PassMalformed));
    let mut short_total = Packet::tcp(CLIENT, 1234, WEB_VIP, 80, TCP_SYN).frame();
    short_total[14 + 2..14 + 4].copy_from_slice(&30u16.to_be_bytes());
    cases.push(("total length below the TCP header", short_total, Stat::PassTruncated));
    let mut bad_ihl = Packet::tcp(CLIENT, 1234, WEB_VIP, 80, TCP_SYN).frame();
    bad_ihl[14] = 0x43;
    cases.push(("IHL 3", bad_ihl, Stat::PassMalformed));
    let mut bad_version = Packet::tcp(CLIENT, 1234, WEB_VIP, 80, TCP_SYN).frame();
    bad_version[14] = 0x65;
    cases.push(("version 6 in an IPv4 ethertype", bad_version, Stat::PassMalformed));
    // (A frame shorter than an IPv4 header is refused by BPF_PROG_TEST_RUN
    // itself, so the shortest frame tested is a bare header.)
    let mut bare_header = Packet::tcp(CLIENT, 1234, WEB_VIP, 80, TCP_SYN).frame();
    bare_header.truncate(14 + 20);
    bare_header[14 + 2..14 + 4].copy_from_slice(&20u16.to_be_bytes());
    cases.push(("IPv4 header without its TCP header", bare_header, Stat::PassTruncated));

    let mut expected_counts: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, frame, stat) in &cases {
        let (ret, out) = h.ingress(frame);
        assert_eq!(ret, PASS, "{name}");
        assert_eq!(&out, frame, "{name}: frame was modified");
        let (ret, out) = h.egress(frame);
        assert_eq!(ret, PASS, "{name} (egress)");
        assert_eq!(&out, frame, "{name}: frame was modified on egress");
        *expected_counts.entry(stat.name()).or_default() += 1;
    }
    // Ingress counts each reason; egress counts the same reasons except that a
    // missing conntrack entry is also PassNoService.
    for stat in
        [Stat::PassNotIpv4, Stat::PassNotTcpUdp, Stat::PassFragment, Stat::PassMalformed, Stat::PassTruncated]
    {
        assert_eq!(
            h.stat(stat),
            2 * expected_counts.get(stat.name()).copied().unwrap_or(0),
            "{}",
            stat.name()
        );
    }
    assert_eq!(h.stat(Stat::DnatNew), 0);
    assert_eq!(h.conntrack.keys().count(), 0, "no conntrack entry for untranslated traffic");
}

#[test]
fn new_flows_spread_evenly_over_backends() {
    let h = Harness::new();
    let mut hits: BTreeMap<[u8; 4], u32> = BTreeMap::new();
    let flows = 600u16;
    for sport in 0..flows {
        let (_, out) = h.ingress(&Packet::tcp(CLIENT, 20000 + sport, WEB_VIP, 80, TCP_SYN).frame());
        *hits.entry(destination(&out).0).or_default() += 1;
    }
    assert_eq!(hits.len(), 3, "{hits:?}");
    // Binomial(600, 1/3): mean 200, sd 11.5; 5 sd each side.
    for (backend, n) in &hits {
        assert!((142..=258).contains(n), "backend {backend:?} got {n} of {flows}: {hits:?}");
    }
}

#[test]
fn a_removed_backend_gets_no_new_flows_and_slots_shrink() {
    let mut h = Harness::new();
    let mut two = desired();
    two.frontends.iter_mut().find(|f| f.service.name == "web").unwrap().backends.remove(2);
    let report = h.apply(&two);
    assert_eq!(report.frontends_updated, 1);
    assert_eq!(report.backends_removed, 1);
    for sport in 0..200u16 {
        let (_, out) = h.ingress(&Packet::tcp(CLIENT, 30000 + sport, WEB_VIP, 80, TCP_SYN).frame());
        assert_ne!(destination(&out).0, WEB_BACKENDS[2]);
    }
    // Removing the Service stops translation.
    let none = Desired::new(vec![]);
    let report = h.apply(&none);
    assert_eq!(report.frontends_removed, 3);
    let syn = Packet::tcp(CLIENT, 50000, WEB_VIP, 80, TCP_SYN).frame();
    assert_eq!(h.ingress(&syn).1, syn);
}

/// kube-proxy's nftables `cluster-ips-check`: inside a service CIDR, an address that is no Service's
/// is dropped (and counted) from a pod and from outside alike; a Service's cluster IP in it is still
/// translated, an unknown port of one still refused, and an address outside every CIDR passes.
/// `frame` with its IP protocol set to `proto` (the IP checksum recomputed).
fn with_protocol(frame: &[u8], proto: u8) -> Vec<u8> {
    let mut frame = frame.to_vec();
    frame[14 + 9] = proto;
    frame[14 + 10..14 + 12].fill(0);
    let check = proxy_common::checksum::checksum(&frame[14..34]);
    frame[14 + 10..14 + 12].copy_from_slice(&check.to_be_bytes());
    frame
}

/// Neither TCP nor UDP: kube-proxy's `cluster-ips-check` drops what conntrack calls new, whatever the
/// protocol — ICMP requests, any packet of a generically tracked protocol — and lets ICMP errors and
/// replies (related or invalid there) pass.
#[test]
fn other_protocols_to_an_unallocated_address_are_dropped_when_they_would_open_a_connection() {
    use common::harness::DROP;
    use kproxy::net::Cidr4;

    let mut h = Harness::new();
    let unallocated = [10, 96, 0, 77];
    let echo = icmp_error(CLIENT, unallocated, 8, 0, b"kproxy-echo-");
    let gre = with_protocol(&echo, 47);
    let quote = Packet::udp(unallocated, 53, CLIENT, 40000, b"late").frame()[14..42].to_vec();
    let port_unreachable = icmp_error(CLIENT, unallocated, 3, 3, &quote);
    let echo_reply = icmp_error(CLIENT, unallocated, 0, 0, b"kproxy-echo-");
    let echo_to_a_pod = icmp_error(CLIENT, WEB_BACKENDS[0], 8, 0, b"kproxy-echo-");
    let echo_to_a_vip = icmp_error(CLIENT, WEB_VIP, 8, 0, b"kproxy-echo-");

    // No CIDR known: all pass.
    assert_eq!(h.ingress(&echo), (PASS, echo.clone()));
    assert_eq!(h.ingress(&gre), (PASS, gre.clone()));

    let cidrs: Vec<Cidr4> = vec!["10.96.0.0/16".parse().unwrap()];
    kproxy::bpf::service_cidrs::write(&mut h.service_cidrs, &cidrs).unwrap();
    assert_eq!(h.ingress(&echo).0, DROP, "an echo request");
    assert_eq!(h.ingress(&gre).0, DROP, "GRE");
    assert_eq!(h.run("kproxy_external_ingress", &echo).0, DROP, "an echo request from an external interface");
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 3);
    // Errors and replies, a pod's address, a cluster IP: untouched.
    for (what, frame) in [
        ("a port unreachable", &port_unreachable),
        ("an echo reply", &echo_reply),
        ("an echo request to a pod", &echo_to_a_pod),
        ("an echo request to a cluster IP", &echo_to_a_vip),
    ] {
        assert_eq!(h.ingress(frame), (PASS, frame.clone()), "{what}");
    }
    assert_eq!(h.run("kproxy_external_ingress", &port_unreachable).0, PASS);
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 3);
}

#[test]
fn an_unallocated_address_of_a_service_cidr_is_dropped_and_the_rest_untouched() {
    use common::harness::DROP;
    use kproxy::net::Cidr4;

    let mut h = Harness::new();
    let unallocated = Packet::tcp(CLIENT, 40001, [10, 96, 0, 77], 80, TCP_SYN).frame();
    let udp_unallocated = Packet::udp(CLIENT, 40002, [10, 96, 255, 1], 53, b"query").frame();
    let outside = Packet::tcp(CLIENT, 40003, [10, 97, 0, 77], 80, TCP_SYN).frame();

    // No CIDR known: nothing is dropped (kube-proxy adds its rule only once it knows one).
    assert_eq!(h.ingress(&unallocated), (PASS, unallocated.clone()));
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 0);

    let cidrs: Vec<Cidr4> = vec!["10.96.0.0/16".parse().unwrap(), "192.0.2.0/28".parse().unwrap()];
    kproxy::bpf::service_cidrs::write(&mut h.service_cidrs, &cidrs).unwrap();
    assert_eq!(kproxy::bpf::service_cidrs::read(&h.service_cidrs).unwrap(), cidrs);

    assert_eq!(h.ingress(&unallocated).0, DROP, "TCP to an unallocated address");
    assert_eq!(h.ingress(&udp_unallocated).0, DROP, "UDP to an unallocated address");
    let second_range = Packet::tcp(CLIENT, 40004, [192, 0, 2, 15], 443, TCP_SYN).frame();
    assert_eq!(h.ingress(&second_range).0, DROP, "inside the second CIDR");
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 3);
    assert_eq!(h.conntrack.keys().count(), 0, "a dropped packet starts no flow");

    // From outside the cluster (tc ingress of an external interface): dropped too, as kube-proxy's
    // chain hooks forward.
    assert_eq!(h.run("kproxy_external_ingress", &unallocated).0, DROP, "from an external interface");
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 4);

    // Outside every CIDR: untouched.
    assert_eq!(h.ingress(&outside), (PASS, outside.clone()));
    let beyond_second = Packet::tcp(CLIENT, 40005, [192, 0, 2, 16], 443, TCP_SYN).frame();
    assert_eq!(h.ingress(&beyond_second), (PASS, beyond_second.clone()));
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 4);

    // A cluster IP inside the CIDR is still translated, byte for byte.
    let syn = Packet::tcp(CLIENT, 40006, WEB_VIP, 80, TCP_SYN);
    let (ret, out) = h.ingress(&syn.frame());
    assert_eq!(ret, PASS);
    let (backend, port) = destination(&out);
    assert!(WEB_BACKENDS.contains(&backend) && port == 8080, "DNATed to {backend:?}:{port}");
    assert_eq!(out, Packet { dst: backend, dport: 8080, ..syn.clone() }.frame());
    // A port the Service does not have is refused (RST), not dropped.
    let wrong_port = Packet::tcp(CLIENT, 40007, WEB_VIP, 81, TCP_SYN).frame();
    let (_, rst) = h.ingress(&wrong_port);
    assert_ne!(rst, wrong_port, "answered with a reset");
    assert_eq!(h.stat(Stat::RejectTcp), 1);
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 4);

    // A Service created at an address of the range: translated from then on.
    let mut with_new = desired();
    with_new.frontends.push(common::harness::frontend(
        "new",
        "http",
        [10, 96, 0, 77],
        80,
        kproxy::net::Protocol::Tcp,
        &[(WEB_BACKENDS[0], 8080)],
    ));
    let with_new = Desired::new(with_new.frontends);
    h.apply(&with_new);
    let (ret, out) = h.ingress(&unallocated);
    assert_eq!((ret, destination(&out)), (PASS, (WEB_BACKENDS[0], 8080)));

    // The CIDRs removed: nothing dropped again.
    kproxy::bpf::service_cidrs::write(&mut h.service_cidrs, &[]).unwrap();
    assert_eq!(h.ingress(&udp_unallocated), (PASS, udp_unallocated.clone()));
    assert_eq!(h.stat(Stat::DropUnallocatedServiceIp), 4);
}
