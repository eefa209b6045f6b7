//! Requests to ctnetlink, encoded: a dump, a delete by original tuple, a NAT entry to create.

use std::net::{IpAddr, SocketAddrV4};

use netlink_packet_core::{
    DefaultNla, Emitable, NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST,
    NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterProtoFamily,
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Status, TCPFlags,
        Tuple as CtTuple,
    },
};

use super::{CTA_ZONE, DnatFlow, Entry, IPS_ASSURED, IPS_CONFIRMED, IPS_SEEN_REPLY, TcpState, Tuple};
use crate::net::Protocol;

// Attributes netlink-packet-netfilter does not model (uapi nfnetlink_conntrack.h).
pub(super) const CTA_NAT_SRC: u16 = 6;
pub(super) const CTA_NAT_DST: u16 = 13;
pub(super) const CTA_NAT_V4_MINIP: u16 = 1;
pub(super) const CTA_NAT_V4_MAXIP: u16 = 2;
pub(super) const CTA_NAT_PROTO: u16 = 3;
pub(super) const CTA_PROTONAT_PORT_MIN: u16 = 1;
pub(super) const CTA_PROTONAT_PORT_MAX: u16 = 2;

/// `IP_CT_TCP_FLAG_BE_LIBERAL` (uapi nf_conntrack_tcp.h).
const TCP_FLAG_BE_LIBERAL: u8 = 0x08;

fn request(message: ConntrackMessage, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let netfilter = NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::IPv4, 0, 0), message);
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(netfilter));
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf);
    buf
}

pub(super) fn dump_request(seq: u32) -> Vec<u8> {
    request(ConntrackMessage::Get(Vec::new()), NLM_F_REQUEST | NLM_F_DUMP, seq)
}

fn tuple_attributes(proto: Protocol, tuple: &Tuple) -> Vec<CtTuple> {
    vec![
        CtTuple::Ip(vec![
            IPTuple::SourceAddress(IpAddr::V4(tuple.src)),
            IPTuple::DestinationAddress(IpAddr::V4(tuple.dst)),
        ]),
        CtTuple::Proto(vec![
            ProtoTuple::Protocol(proto.number().into()),
            ProtoTuple::SourcePort(tuple.sport),
            ProtoTuple::DestinationPort(tuple.dport),
        ]),
    ]
}

pub(super) fn zone_attribute(zone: u16) -> ConntrackAttribute {
    ConntrackAttribute::Other(DefaultNla::new(CTA_ZONE, zone.to_be_bytes().to_vec()))
}

pub(super) fn delete_request(entry: &Entry, seq: u32) -> Vec<u8> {
    // Never without the tuple: a delete that names no entry flushes the table.
    let mut attributes = vec![ConntrackAttribute::CtaTupleOrig(tuple_attributes(entry.proto, &entry.orig))];
    if entry.zone != 0 {
        attributes.push(zone_attribute(entry.zone));
    }
    request(ConntrackMessage::Delete(attributes), NLM_F_REQUEST | NLM_F_ACK, seq)
}

/// Attributes in wire form, for nesting them inside a raw attribute.
fn emitted(attributes: &[DefaultNla]) -> Vec<u8> {
    let mut buf = vec![0u8; attributes.buffer_len()];
    attributes.emit(&mut buf);
    buf
}

fn tcp_flags(flags: u8, mask: u8) -> TCPFlags {
    TCPFlags::parse(&[flags, mask]).expect("two bytes are a TCPFlags")
}

/// `CTA_NAT_DST` or `CTA_NAT_SRC` mapping to exactly `to`.
fn nat_attribute(kind: u16, to: SocketAddrV4) -> ConntrackAttribute {
    let ip = to.ip().octets().to_vec();
    let port = to.port().to_be_bytes().to_vec();
    let proto = emitted(&[
        DefaultNla::new(CTA_PROTONAT_PORT_MIN, port.clone()),
        DefaultNla::new(CTA_PROTONAT_PORT_MAX, port),
    ]);
    let nat = emitted(&[
        DefaultNla::new(CTA_NAT_V4_MINIP, ip.clone()),
        DefaultNla::new(CTA_NAT_V4_MAXIP, ip),
        DefaultNla::new(CTA_NAT_PROTO | NLA_F_NESTED, proto),
    ]);
    ConntrackAttribute::Other(DefaultNla::new(kind | NLA_F_NESTED, nat))
}

pub(super) fn create_request(flow: &DnatFlow, source: SocketAddrV4, seq: u32) -> Vec<u8> {
    let orig = Tuple {
        src: *flow.client.ip(),
        dst: *flow.vip.ip(),
        sport: flow.client.port(),
        dport: flow.vip.port(),
    };
    let mut attributes = vec![
        ConntrackAttribute::CtaTupleOrig(tuple_attributes(flow.proto, &orig)),
        // The kernel turns this into backend -> client when it applies CTA_NAT_DST.
        ConntrackAttribute::CtaTupleReply(tuple_attributes(flow.proto, &orig.inverse())),
        nat_attribute(CTA_NAT_DST, flow.backend),
        // The client keeps its own address and port (or takes exactly `source`). Without this
        // the kernel's null source binding would move the client to another port when
        // backend -> client is taken.
        nat_attribute(CTA_NAT_SRC, source),
        ConntrackAttribute::CtaStatus(Status::from_bits_retain(IPS_CONFIRMED | IPS_ASSURED | IPS_SEEN_REPLY)),
        ConntrackAttribute::CtaTimeout(flow.timeout_secs),
    ];
    if flow.mark != 0 {
        attributes.push(ConntrackAttribute::CtaMark(flow.mark));
    }
    if flow.zone != 0 {
        attributes.push(zone_attribute(flow.zone));
    }
    if flow.proto == Protocol::Tcp {
        let liberal = tcp_flags(TCP_FLAG_BE_LIBERAL, TCP_FLAG_BE_LIBERAL);
        attributes.push(ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(vec![
            ProtoInfoTCP::State(TcpState::Established.number()),
            ProtoInfoTCP::OriginalFlags(liberal.clone()),
            ProtoInfoTCP::ReplyFlags(liberal),
        ])]));
    }
    request(ConntrackMessage::New(attributes), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, seq)
}
