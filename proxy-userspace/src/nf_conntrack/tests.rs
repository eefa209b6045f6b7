use netlink_packet_core::{
    NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::{
    NetfilterMessage, NetfilterMessageInner,
    conntrack::{ConntrackAttribute, ConntrackMessage},
};

use super::{reply::*, request::*, *};

/// A TCP entry exactly as kernel 6.18 dumped it (`NLM_F_MULTI | NLM_F_DUMP_FILTERED`): the
/// client 127.0.0.1:41000 reached 10.96.0.10:80, which an nft `dnat to 127.0.0.1:8080` rule
/// translated. Nested attributes carry NLA_F_NESTED (0x8000); values are big-endian and
/// padded to 4 bytes.
#[rustfmt::skip]
const KERNEL_TCP: [u8; 212] = [
    0xd4, 0x00, 0x00, 0x00, 0x00, 0x01, 0x22, 0x00, // nlmsghdr: 212 bytes, CT_NEW, MULTI|DUMP_FILTERED
    0x07, 0x00, 0x00, 0x00, 0x13, 0x0e, 0x00, 0x00, // seq 7, port id
    0x02, 0x00, 0x00, 0x00,                         // nfgenmsg: AF_INET, version 0, res_id 0
    0x34, 0x00, 0x01, 0x80,                         // CTA_TUPLE_ORIG (nested), 52 bytes
    0x14, 0x00, 0x01, 0x80,                         //   CTA_TUPLE_IP (nested), 20 bytes
    0x08, 0x00, 0x01, 0x00, 127, 0, 0, 1,           //     CTA_IP_V4_SRC
    0x08, 0x00, 0x02, 0x00, 10, 96, 0, 10,          //     CTA_IP_V4_DST
    0x1c, 0x00, 0x02, 0x80,                         //   CTA_TUPLE_PROTO (nested), 28 bytes
    0x05, 0x00, 0x01, 0x00, 6, 0, 0, 0,             //     CTA_PROTO_NUM 6, 3 bytes of padding
    0x06, 0x00, 0x02, 0x00, 0xa0, 0x28, 0, 0,       //     CTA_PROTO_SRC_PORT 41000
    0x06, 0x00, 0x03, 0x00, 0x00, 0x50, 0, 0,       //     CTA_PROTO_DST_PORT 80
    0x34, 0x00, 0x02, 0x80,                         // CTA_TUPLE_REPLY (nested)
    0x14, 0x00, 0x01, 0x80,
    0x08, 0x00, 0x01, 0x00, 127, 0, 0, 1,
    0x08, 0x00, 0x02, 0x00, 127, 0, 0, 1,
    0x1c, 0x00, 0x02, 0x80,
    0x05, 0x00, 0x01, 0x00, 6, 0, 0, 0,
    0x06, 0x00, 0x02, 0x00, 0x1f, 0x90, 0, 0,       //     8080
    0x06, 0x00, 0x03, 0x00, 0xa0, 0x28, 0, 0,       //     41000
    0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x01, 0xae, // CTA_STATUS: SEEN_REPLY ASSURED CONFIRMED DST_NAT *_NAT_DONE
    0x08, 0x00, 0x08, 0x00, 0, 0, 0, 0,             // CTA_MARK
    0x08, 0x00, 0x0c, 0x00, 0x86, 0x42, 0x95, 0xb1, // CTA_ID
    0x08, 0x00, 0x0b, 0x00, 0, 0, 0, 1,             // CTA_USE
    0x08, 0x00, 0x07, 0x00, 0x00, 0x06, 0x97, 0x7f, // CTA_TIMEOUT 431999
    0x30, 0x00, 0x04, 0x80,                         // CTA_PROTOINFO (nested)
    0x2c, 0x00, 0x01, 0x80,                         //   CTA_PROTOINFO_TCP (nested)
    0x05, 0x00, 0x01, 0x00, 3, 0, 0, 0,             //     CTA_PROTOINFO_TCP_STATE ESTABLISHED
    0x05, 0x00, 0x02, 0x00, 10, 0, 0, 0,            //     CTA_PROTOINFO_TCP_WSCALE_ORIGINAL
    0x05, 0x00, 0x03, 0x00, 10, 0, 0, 0,            //     CTA_PROTOINFO_TCP_WSCALE_REPLY
    0x06, 0x00, 0x04, 0x00, 0x23, 0x00, 0, 0,       //     CTA_PROTOINFO_TCP_FLAGS_ORIGINAL
    0x06, 0x00, 0x05, 0x00, 0x23, 0x00, 0, 0,       //     CTA_PROTOINFO_TCP_FLAGS_REPLY
];

/// The UDP entry of the same dump: 127.0.0.1:42000 → 10.96.0.10:53, DNATed to :5353; seen a
/// reply, not yet assured; no CTA_PROTOINFO.
#[rustfmt::skip]
const KERNEL_UDP: [u8; 164] = [
    0xa4, 0x00, 0x00, 0x00, 0x00, 0x01, 0x22, 0x00, 0x07, 0x00, 0x00, 0x00, 0x13, 0x0e, 0x00, 0x00,
    0x02, 0x00, 0x00, 0x00,
    0x34, 0x00, 0x01, 0x80, 0x14, 0x00, 0x01, 0x80,
    0x08, 0x00, 0x01, 0x00, 127, 0, 0, 1, 0x08, 0x00, 0x02, 0x00, 10, 96, 0, 10,
    0x1c, 0x00, 0x02, 0x80, 0x05, 0x00, 0x01, 0x00, 17, 0, 0, 0,
    0x06, 0x00, 0x02, 0x00, 0xa4, 0x10, 0, 0, 0x06, 0x00, 0x03, 0x00, 0x00, 0x35, 0, 0,
    0x34, 0x00, 0x02, 0x80, 0x14, 0x00, 0x01, 0x80,
    0x08, 0x00, 0x01, 0x00, 127, 0, 0, 1, 0x08, 0x00, 0x02, 0x00, 127, 0, 0, 1,
    0x1c, 0x00, 0x02, 0x80, 0x05, 0x00, 0x01, 0x00, 17, 0, 0, 0,
    0x06, 0x00, 0x02, 0x00, 0x14, 0xe9, 0, 0, 0x06, 0x00, 0x03, 0x00, 0xa4, 0x10, 0, 0,
    0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x01, 0xaa, // CTA_STATUS: SEEN_REPLY CONFIRMED DST_NAT *_NAT_DONE
    0x08, 0x00, 0x08, 0x00, 0, 0, 0, 0,
    0x08, 0x00, 0x0c, 0x00, 0x07, 0x32, 0x62, 0x39,
    0x08, 0x00, 0x0b, 0x00, 0, 0, 0, 1,
    0x08, 0x00, 0x07, 0x00, 0, 0, 0, 0x1d,          // CTA_TIMEOUT 29
];

/// The dump's end: NLMSG_DONE carrying error 0.
#[rustfmt::skip]
const KERNEL_DONE: [u8; 20] = [
    0x14, 0x00, 0x00, 0x00, 0x03, 0x00, 0x02, 0x00, 0x07, 0x00, 0x00, 0x00, 0x13, 0x0e, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00,
];

// Builders with the kernel's layout, for variations of the captured messages.

fn nla(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((NLA_HDRLEN + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize((out.len() + 3) & !3, 0);
    out
}

fn nest(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
    nla(kind | NLA_F_NESTED, &parts.concat())
}

fn netlink(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0x0e13u32.to_ne_bytes());
    out.extend_from_slice(body);
    out
}

fn ct_message(kind: u16, flags: u16, seq: u32, attributes: &[Vec<u8>]) -> Vec<u8> {
    let mut body = vec![libc::AF_INET as u8, 0, 0, 0];
    body.extend(attributes.concat());
    netlink(kind, flags, seq, &body)
}

fn tuple(proto: u8, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, extra: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut proto_parts = vec![nla(1, &[proto]), nla(2, &sport.to_be_bytes()), nla(3, &dport.to_be_bytes())];
    proto_parts.extend_from_slice(extra);
    vec![nest(1, &[nla(1, &src), nla(2, &dst)]), nest(2, &proto_parts)]
}

/// The TCP entry's attributes, `extra_proto` added to its original CTA_TUPLE_PROTO.
fn tcp_attributes(extra_proto: &[Vec<u8>]) -> Vec<Vec<u8>> {
    vec![
        nest(1, &tuple(6, [127, 0, 0, 1], [10, 96, 0, 10], 41000, 80, extra_proto)),
        nest(2, &tuple(6, [127, 0, 0, 1], [127, 0, 0, 1], 8080, 41000, &[])),
        nla(3, &0x1aeu32.to_be_bytes()),
        nla(8, &0u32.to_be_bytes()),
        nla(12, &[0x86, 0x42, 0x95, 0xb1]), // CTA_ID
        nla(11, &1u32.to_be_bytes()),
        nla(7, &431_999u32.to_be_bytes()),
        nest(
            4,
            &[nest(1, &[nla(1, &[3]), nla(2, &[10]), nla(3, &[10]), nla(4, &[0x23, 0]), nla(5, &[0x23, 0])])],
        ),
    ]
}

fn kernel_tcp_entry() -> Entry {
    Entry {
        proto: Protocol::Tcp,
        orig: Tuple { src: Ipv4Addr::LOCALHOST, dst: Ipv4Addr::new(10, 96, 0, 10), sport: 41000, dport: 80 },
        reply: Tuple { src: Ipv4Addr::LOCALHOST, dst: Ipv4Addr::LOCALHOST, sport: 8080, dport: 41000 },
        status: IPS_SEEN_REPLY
            | IPS_ASSURED
            | IPS_CONFIRMED
            | IPS_DST_NAT
            | IPS_SRC_NAT_DONE
            | IPS_DST_NAT_DONE,
        tcp_state: Some(TcpState::Established),
        timeout_secs: 431_999,
        mark: 0,
        zone: 0,
    }
}

fn replies(buf: &[u8]) -> Vec<Result<(u32, Reply), NfConntrackError>> {
    Replies::new(OP_DUMP, buf).collect()
}

fn only_entry(buf: &[u8]) -> Result<Option<Entry>, NfConntrackError> {
    let mut all = replies(buf);
    assert_eq!(all.len(), 1, "one message in {buf:02x?}");
    all.remove(0).map(|(_, reply)| match reply {
        Reply::Entry(entry) => entry,
        other => panic!("not an entry: {other:?}"),
    })
}

#[test]
fn the_builders_reproduce_the_kernels_bytes() {
    assert_eq!(ct_message(CT_NEW_MESSAGE, 0x22, 7, &tcp_attributes(&[])), KERNEL_TCP);
}

#[test]
fn a_kernel_tcp_entry_parses_into_its_tuples_status_state_and_timeout() {
    let entry = only_entry(&KERNEL_TCP).unwrap().expect("a TCP entry");
    assert_eq!(entry, kernel_tcp_entry());
    assert!(entry.is_dst_nat());
    assert!(!entry.is_src_nat());
    assert!(!entry.is_over());
    assert_eq!(entry.orig.to_string(), "127.0.0.1:41000 -> 10.96.0.10:80");
}

#[test]
fn a_multi_part_datagram_yields_each_entry_then_done() {
    let datagram = [&KERNEL_TCP[..], &KERNEL_UDP, &KERNEL_DONE].concat();
    let all: Vec<(u32, Reply)> = replies(&datagram).into_iter().map(Result::unwrap).collect();
    assert_eq!(all.len(), 3);
    assert_eq!(all[0], (7, Reply::Entry(Some(kernel_tcp_entry()))));
    let Reply::Entry(Some(udp)) = &all[1].1 else { panic!("{:?}", all[1]) };
    assert_eq!(udp.proto, Protocol::Udp);
    assert_eq!(
        udp.orig,
        Tuple { src: Ipv4Addr::LOCALHOST, dst: Ipv4Addr::new(10, 96, 0, 10), sport: 42000, dport: 53 }
    );
    assert_eq!(
        udp.reply,
        Tuple { src: Ipv4Addr::LOCALHOST, dst: Ipv4Addr::LOCALHOST, sport: 5353, dport: 42000 }
    );
    assert_eq!(
        udp.status,
        IPS_SEEN_REPLY | IPS_CONFIRMED | IPS_DST_NAT | IPS_SRC_NAT_DONE | IPS_DST_NAT_DONE
    );
    assert_eq!((udp.tcp_state, udp.timeout_secs), (None, 29));
    assert!(udp.is_dst_nat() && !udp.is_over());
    assert_eq!(all[2], (7, Reply::Done(0)));
}

#[test]
fn unknown_attributes_are_skipped_at_every_level() {
    let mut attributes = tcp_attributes(&[nla(9, &[1, 2, 3, 4, 5, 6])]); // CTA_PROTO_ICMPV6_CODE-like
    attributes.insert(2, nla(0x7e, &[0xff; 7])); // no such CTA_*
    attributes.push(nest(0x7d, &[nla(1, &[0; 12])])); // an unknown nest
    attributes.push(nla(9, &[0; 16])); // CTA_COUNTERS_ORIG's number, not nested
    let entry = only_entry(&ct_message(CT_NEW_MESSAGE, 0x22, 7, &attributes)).unwrap();
    assert_eq!(entry, Some(kernel_tcp_entry()));
}

#[test]
fn a_zone_is_read_from_cta_zone() {
    let mut attributes = tcp_attributes(&[]);
    attributes.push(nla(CTA_ZONE, &7u16.to_be_bytes()));
    let entry = only_entry(&ct_message(CT_NEW_MESSAGE, 0x22, 7, &attributes)).unwrap().unwrap();
    assert_eq!(entry.zone, 7);
}

#[test]
fn entries_of_other_protocols_are_skipped() {
    // An ICMP echo: CTA_PROTO_ICMP_ID/TYPE/CODE instead of ports.
    let icmp = |src: [u8; 4], dst: [u8; 4]| {
        vec![
            nest(1, &[nla(1, &src), nla(2, &dst)]),
            nest(2, &[nla(1, &[1]), nla(4, &7u16.to_be_bytes()), nla(5, &[8]), nla(6, &[0])]),
        ]
    };
    let message = ct_message(
        CT_NEW_MESSAGE,
        0x22,
        7,
        &[
            nest(1, &icmp([10, 0, 0, 1], [10, 0, 0, 2])),
            nest(2, &icmp([10, 0, 0, 2], [10, 0, 0, 1])),
            nla(3, &0x8u32.to_be_bytes()),
            nla(7, &30u32.to_be_bytes()),
        ],
    );
    assert_eq!(only_entry(&message).unwrap(), None);
}

fn error_text(buf: &[u8]) -> String {
    let err = replies(buf).into_iter().find_map(Result::err).expect("an error");
    err.to_string()
}

#[test]
fn a_datagram_cut_inside_a_message_names_the_message() {
    let text = error_text(&KERNEL_TCP[..100]);
    assert!(text.contains("truncated"), "{text}");
    assert!(text.contains("netlink message (type 0x100) of 212 bytes with 100 bytes left"), "{text}");
    let text = error_text(&[&KERNEL_TCP[..], &KERNEL_DONE[..10]].concat());
    assert!(text.contains("10 bytes after the last message"), "{text}");
}

#[test]
fn an_attribute_longer_than_its_entry_names_the_attribute() {
    // CTA_PROTOINFO claims 8 bytes more than the message holds; the message is consistent.
    let mut message = KERNEL_TCP.to_vec();
    let protoinfo = 212 - 48;
    assert_eq!(&message[protoinfo..protoinfo + 4], &[0x30, 0x00, 0x04, 0x80]);
    message[protoinfo] = 0x38;
    let text = error_text(&message);
    assert!(text.contains("truncated reply: CTA_PROTOINFO of 56 bytes with 48 bytes left"), "{text}");
}

#[test]
fn a_nested_attribute_cut_short_is_named() {
    // CTA_TUPLE_ORIG holds its CTA_TUPLE_IP, whose CTA_IP_V4_DST claims 12 bytes of 8.
    let mut message = KERNEL_TCP.to_vec();
    let v4_dst = 20 + 4 + 4 + 8;
    assert_eq!(&message[v4_dst..v4_dst + 4], &[0x08, 0x00, 0x02, 0x00]);
    message[v4_dst] = 0x0c;
    let text = error_text(&message);
    assert!(
        text.contains("invalid CTA_TUPLE_IP value caused by buffer has length: 8, but the NLA is 12"),
        "{text}"
    );
    // A value too short for its type.
    let status = ct_message(
        CT_NEW_MESSAGE,
        0x22,
        7,
        &[
            nest(1, &tuple(17, [10, 0, 0, 1], [10, 0, 0, 2], 1, 2, &[])),
            nest(2, &tuple(17, [10, 0, 0, 2], [10, 0, 0, 1], 2, 1, &[])),
            nla(3, &[0, 1]),
        ],
    );
    let text = error_text(&status);
    assert!(text.contains("CTA_STATUS"), "{text}");
}

#[test]
fn an_entry_without_its_tuples_or_ports_is_an_error_not_a_guess() {
    let text = error_text(&ct_message(CT_NEW_MESSAGE, 0x22, 7, &[nla(3, &8u32.to_be_bytes())]));
    assert!(text.contains("without CTA_TUPLE_ORIG"), "{text}");
    let portless = vec![nest(1, &[nla(1, &[10, 0, 0, 1]), nla(2, &[10, 0, 0, 2])]), nest(2, &[nla(1, &[6])])];
    let text = error_text(&ct_message(
        CT_NEW_MESSAGE,
        0x22,
        7,
        &[nest(1, &portless), nest(2, &portless), nla(3, &8u32.to_be_bytes())],
    ));
    assert!(text.contains("CTA_TUPLE_ORIG lacks CTA_PROTO_SRC_PORT"), "{text}");
}

#[test]
fn errors_and_done_codes_come_through() {
    let mut body = (-libc::EPERM).to_ne_bytes().to_vec();
    body.extend_from_slice(&dump_request(7)); // the request, echoed
    let error = netlink(NLMSG_ERROR, 0, 7, &body);
    assert_eq!(
        replies(&error).into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [(7, Reply::Ack(-libc::EPERM))]
    );
    let done = netlink(NLMSG_DONE, 2, 7, &(-libc::ENOBUFS).to_ne_bytes());
    assert_eq!(
        replies(&done).into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [(7, Reply::Done(-libc::ENOBUFS))]
    );
    let text = error_text(&netlink(NLMSG_ERROR, 0, 7, &[0, 0]));
    assert!(text.contains("NLMSG_ERROR of 18 bytes"), "{text}");
}

#[test]
fn errnos_name_what_failed() {
    let text = NfConntrackError::from_errno(OP_DUMP, libc::EPERM).to_string();
    assert_eq!(
        text,
        "conntrack dump needs CAP_NET_ADMIN in this network namespace (the kernel answered EPERM)"
    );
    let text = NfConntrackError::from_errno(OP_DUMP, libc::EPROTONOSUPPORT).to_string();
    assert!(text.contains("is not loaded"), "{text}");
    assert!(matches!(NfConntrackError::from_errno(OP_DUMP, libc::ENOBUFS), NfConntrackError::Overrun));
    let text = NfConntrackError::from_errno(OP_CREATE, libc::EBUSY).to_string();
    assert!(text.starts_with("conntrack create: "), "{text}");
}

#[test]
fn the_dump_request_has_the_kernels_layout() {
    #[rustfmt::skip]
    let expected = [
        20, 0, 0, 0, 0x01, 0x01, 0x01, 0x03, 9, 0, 0, 0, 0, 0, 0, 0, // CT_GET, REQUEST|DUMP, seq 9
        libc::AF_INET as u8, 0, 0, 0,
    ];
    assert_eq!(dump_request(9), expected);
}

#[test]
fn a_delete_names_the_entry_by_its_original_tuple() {
    let entry = kernel_tcp_entry();
    let expected = ct_message(
        (1 << 8) | 2,
        NLM_F_REQUEST | NLM_F_ACK,
        5,
        &[nest(1, &tuple(6, [127, 0, 0, 1], [10, 96, 0, 10], 41000, 80, &[]))],
    );
    let mut request = delete_request(&entry, 5);
    request[12..16].copy_from_slice(&0x0e13u32.to_ne_bytes()); // the builder's port id
    assert_eq!(request, expected);
    // In a zone: the zone too.
    let other = Entry { zone: 3, proto: Protocol::Udp, ..entry };
    let expected = ct_message(
        (1 << 8) | 2,
        NLM_F_REQUEST | NLM_F_ACK,
        5,
        &[nest(1, &tuple(17, [127, 0, 0, 1], [10, 96, 0, 10], 41000, 80, &[])), nla(CTA_ZONE, &[0, 3])],
    );
    let mut request = delete_request(&other, 5);
    request[12..16].copy_from_slice(&0x0e13u32.to_ne_bytes());
    assert_eq!(request, expected);
}

#[test]
fn a_dnat_create_sends_tuples_nat_status_timeout_and_tcp_state() {
    let flow = DnatFlow {
        proto: Protocol::Tcp,
        client: "10.244.1.2:40000".parse().unwrap(),
        vip: "10.96.0.11:80".parse().unwrap(),
        backend: "10.244.1.3:8080".parse().unwrap(),
        timeout_secs: 300,
        mark: 0,
        zone: 0,
    };
    // netlink-packet-netfilter emits its raw top-level attributes without NLA_F_NESTED;
    // ctnetlink parses the request liberally and takes the nest all the same.
    let nat = |kind: u16, ip: [u8; 4], port: u16| {
        let range = [
            nla(CTA_NAT_V4_MINIP, &ip),
            nla(CTA_NAT_V4_MAXIP, &ip),
            nest(
                CTA_NAT_PROTO,
                &[
                    nla(CTA_PROTONAT_PORT_MIN, &port.to_be_bytes()),
                    nla(CTA_PROTONAT_PORT_MAX, &port.to_be_bytes()),
                ],
            ),
        ];
        nla(kind, &range.concat())
    };
    let expected = ct_message(
        1 << 8,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        4,
        &[
            nest(1, &tuple(6, [10, 244, 1, 2], [10, 96, 0, 11], 40000, 80, &[])),
            // The inverse of the original: the kernel rewrites it as it applies CTA_NAT_DST.
            nest(2, &tuple(6, [10, 96, 0, 11], [10, 244, 1, 2], 80, 40000, &[])),
            nat(CTA_NAT_DST, [10, 244, 1, 3], 8080),
            // The client keeps its address and port.
            nat(CTA_NAT_SRC, [10, 244, 1, 2], 40000),
            nla(3, &(IPS_CONFIRMED | IPS_ASSURED | IPS_SEEN_REPLY).to_be_bytes()),
            nla(7, &300u32.to_be_bytes()),
            nest(4, &[nest(1, &[nla(1, &[3]), nla(4, &[0x08, 0x08]), nla(5, &[0x08, 0x08])])]),
        ],
    );
    let mut request = create_request(&flow, flow.client, 4);
    request[12..16].copy_from_slice(&0x0e13u32.to_ne_bytes());
    assert_eq!(request, expected);
    // A source given: CTA_NAT_SRC maps the client to exactly it.
    let from_node = create_request(&flow, "192.168.0.1:61000".parse().unwrap(), 4);
    let holds = |request: &[u8], attribute: &[u8]| request.windows(attribute.len()).any(|w| w == attribute);
    assert!(holds(&from_node, &nat(CTA_NAT_SRC, [192, 168, 0, 1], 61000)));
    assert!(!holds(&from_node, &nat(CTA_NAT_SRC, [10, 244, 1, 2], 40000)));
    assert!(holds(&from_node, &nat(CTA_NAT_DST, [10, 244, 1, 3], 8080)));
    // UDP: no protocol info; a mark and a zone when asked for.
    let udp = DnatFlow { proto: Protocol::Udp, mark: 0x4000, zone: 2, ..flow };
    let request = create_request(&udp, udp.client, 4);
    let parsed = NetlinkMessage::<NetfilterMessage>::deserialize(&request).unwrap();
    let NetlinkPayload::InnerMessage(NetfilterMessage {
        inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)),
        ..
    }) = parsed.payload
    else {
        panic!("{parsed:?}")
    };
    assert!(attributes.contains(&ConntrackAttribute::CtaMark(0x4000)));
    assert!(attributes.contains(&zone_attribute(2)));
    assert!(!attributes.iter().any(|a| matches!(a, ConntrackAttribute::CtaProtoInfo(_))));
}

#[test]
fn an_overrun_dump_is_started_over_once() {
    let entry = kernel_tcp_entry();
    let mut calls = 0;
    let entries = again_after_overrun(|out| {
        calls += 1;
        out.push(Entry { mark: calls, ..entry.clone() });
        if calls == 1 { Err(NfConntrackError::Overrun) } else { Ok(()) }
    })
    .unwrap();
    assert_eq!(entries, [Entry { mark: 2, ..entry.clone() }], "only the second dump's entries");
    let mut calls = 0;
    let err = again_after_overrun(|_| {
        calls += 1;
        Err(NfConntrackError::Overrun)
    })
    .unwrap_err();
    assert!(matches!(err, NfConntrackError::Overrun) && calls == 2, "{err}, {calls} calls");
    let mut calls = 0;
    let err = again_after_overrun(|_| {
        calls += 1;
        Err(NfConntrackError::from_errno(OP_DUMP, libc::EPERM))
    })
    .unwrap_err();
    assert!(matches!(err, NfConntrackError::NeedsCapNetAdmin { .. }) && calls == 1, "{err}, {calls} calls");
}

#[test]
fn tcp_states_follow_the_kernels_numbers() {
    assert_eq!(TcpState::from_number(3), Some(TcpState::Established));
    assert_eq!(TcpState::from_number(7), Some(TcpState::TimeWait));
    assert_eq!(TcpState::from_number(9), Some(TcpState::SynSent2));
    assert_eq!(TcpState::from_number(10), None);
    for (n, state) in TcpState::ALL.iter().enumerate() {
        assert_eq!(usize::from(state.number()), n);
    }
    let closed = |state| Entry { tcp_state: Some(state), ..kernel_tcp_entry() };
    assert!(closed(TcpState::TimeWait).is_over());
    assert!(closed(TcpState::Close).is_over());
    assert!(!closed(TcpState::FinWait).is_over());
    // A state the kernel does not have is an error.
    let mut message = KERNEL_TCP.to_vec();
    let state = 212 - 40 + 4;
    assert_eq!(message[state], 3);
    message[state] = 12;
    assert!(error_text(&message).contains("CTA_PROTOINFO_TCP_STATE 12"));
}
