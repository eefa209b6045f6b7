//! Replies from ctnetlink, decoded: the messages of one datagram, each conntrack entry checked
//! attribute by attribute before netlink-packet-netfilter parses it.

use std::net::IpAddr;

use netlink_packet_core::{NLA_TYPE_MASK, NetlinkMessage, NetlinkPayload, Nla};
use netlink_packet_netfilter::{
    NetfilterMessage, NetfilterMessageInner,
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Tuple as CtTuple,
    },
};

use super::{CTA_ZONE, Entry, NfConntrackError, TcpState, Tuple};
use crate::net::Protocol;

pub(super) const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
pub(super) const NLA_HDRLEN: usize = 4;
pub(super) const NLMSG_NOOP: u16 = 1;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLMSG_OVERRUN: u16 = 4;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW`: every entry of a dump comes as one of these.
pub(super) const CT_NEW_MESSAGE: u16 = 1 << 8;

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Reply {
    /// A conntrack entry; `None` for one of another protocol.
    Entry(Option<Entry>),
    /// NLMSG_DONE, with the dump's error (0, or a negative errno).
    Done(i32),
    /// NLMSG_ERROR: 0 (an ACK) or a negative errno.
    Ack(i32),
}

/// The messages of one datagram, each with its sequence number. Stops at the first error.
pub(super) struct Replies<'a> {
    op: &'static str,
    buf: &'a [u8],
    at: usize,
}

impl<'a> Replies<'a> {
    pub(super) fn new(op: &'static str, buf: &'a [u8]) -> Self {
        Replies { op, buf, at: 0 }
    }

    fn truncated(&mut self, what: String) -> Option<Result<(u32, Reply), NfConntrackError>> {
        self.at = self.buf.len();
        Some(Err(NfConntrackError::Truncated { op: self.op, what }))
    }
}

impl Iterator for Replies<'_> {
    type Item = Result<(u32, Reply), NfConntrackError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let rest = &self.buf[self.at..];
            if rest.is_empty() {
                return None;
            }
            if rest.len() < NLMSG_HDRLEN {
                return self.truncated(format!(
                    "{} bytes after the last message, less than a netlink header",
                    rest.len()
                ));
            }
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes(rest[4..6].try_into().unwrap());
            let seq = u32::from_ne_bytes(rest[8..12].try_into().unwrap());
            if len < NLMSG_HDRLEN || len > rest.len() {
                return self.truncated(format!(
                    "a netlink message (type {kind:#x}) of {len} bytes with {} bytes left in the datagram",
                    rest.len()
                ));
            }
            let message = &rest[..len];
            self.at += (len + 3) & !3;
            self.at = self.at.min(self.buf.len());
            let reply = match kind {
                NLMSG_NOOP => continue,
                NLMSG_DONE | NLMSG_ERROR => {
                    let Some(code) = message.get(NLMSG_HDRLEN..NLMSG_HDRLEN + 4) else {
                        let name = if kind == NLMSG_DONE { "NLMSG_DONE" } else { "NLMSG_ERROR" };
                        return self.truncated(format!("{name} of {len} bytes, without its error code"));
                    };
                    let code = i32::from_ne_bytes(code.try_into().unwrap());
                    if kind == NLMSG_DONE { Reply::Done(code) } else { Reply::Ack(code) }
                }
                NLMSG_OVERRUN => Reply::Done(-libc::ENOBUFS),
                CT_NEW_MESSAGE => match parse_entry(self.op, message) {
                    Ok(entry) => Reply::Entry(entry),
                    Err(err) => {
                        self.at = self.buf.len();
                        return Some(Err(err));
                    }
                },
                _ => continue,
            };
            return Some(Ok((seq, reply)));
        }
    }
}

fn ctattr_name(kind: u16) -> String {
    let name = match kind {
        1 => "CTA_TUPLE_ORIG",
        2 => "CTA_TUPLE_REPLY",
        3 => "CTA_STATUS",
        4 => "CTA_PROTOINFO",
        7 => "CTA_TIMEOUT",
        8 => "CTA_MARK",
        CTA_ZONE => "CTA_ZONE",
        _ => return format!("attribute {kind}"),
    };
    name.to_owned()
}

/// One `IPCTNL_MSG_CT_NEW` message (header included) as an entry; `None` if it is neither TCP nor
/// UDP over IPv4.
fn parse_entry(op: &'static str, message: &[u8]) -> Result<Option<Entry>, NfConntrackError> {
    let truncated = |what: String| NfConntrackError::Truncated { op, what };
    let malformed = |what: String| NfConntrackError::Malformed { op, what };
    // The crate reports an overlong attribute without naming it: check the top level first.
    let attributes = message.get(NLMSG_HDRLEN + NFGENMSG_LEN..).ok_or_else(|| {
        truncated(format!("a conntrack entry of {} bytes, without its nfgenmsg", message.len()))
    })?;
    let mut at = 0;
    while at < attributes.len() {
        let rest = &attributes[at..];
        if rest.len() < NLA_HDRLEN {
            return Err(truncated(format!(
                "a conntrack entry ends inside an attribute header ({} bytes)",
                rest.len()
            )));
        }
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < NLA_HDRLEN || len > rest.len() {
            return Err(truncated(format!(
                "{} of {len} bytes with {} bytes left in the entry",
                ctattr_name(kind),
                rest.len()
            )));
        }
        at += (len + 3) & !3;
    }
    let parsed = NetlinkMessage::<NetfilterMessage>::deserialize(message)
        .map_err(|err| malformed(format!("a conntrack entry: {err}")))?;
    let NetlinkPayload::InnerMessage(NetfilterMessage {
        inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)),
        ..
    }) = parsed.payload
    else {
        return Err(malformed("a conntrack entry that is not IPCTNL_MSG_CT_NEW".to_owned()));
    };
    entry_from(attributes).map_err(malformed)
}

/// The IPv4 TCP/UDP part of a tuple: `Ok(None)` for another protocol or family.
fn tuple_from(attributes: &[CtTuple], which: &str) -> Result<Option<(u8, Tuple)>, String> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for attribute in attributes {
        match attribute {
            CtTuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(addr) => src = Some(*addr),
                        IPTuple::DestinationAddress(addr) => dst = Some(*addr),
                        _ => {}
                    }
                }
            }
            CtTuple::Proto(parts) => {
                for part in parts {
                    match part {
                        ProtoTuple::Protocol(p) => proto = Some(u8::from(*p)),
                        ProtoTuple::SourcePort(port) => sport = Some(*port),
                        ProtoTuple::DestinationPort(port) => dport = Some(*port),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let proto = proto.ok_or_else(|| format!("{which} has no CTA_PROTO_NUM"))?;
    if Protocol::from_number(proto).is_none() {
        return Ok(None);
    }
    let (src, dst) = match (src, dst) {
        (Some(IpAddr::V4(src)), Some(IpAddr::V4(dst))) => (src, dst),
        (Some(IpAddr::V6(_)), _) | (_, Some(IpAddr::V6(_))) => return Ok(None),
        _ => return Err(format!("{which} lacks CTA_IP_V4_SRC or CTA_IP_V4_DST")),
    };
    let (Some(sport), Some(dport)) = (sport, dport) else {
        return Err(format!("{which} lacks CTA_PROTO_SRC_PORT or CTA_PROTO_DST_PORT"));
    };
    Ok(Some((proto, Tuple { src, dst, sport, dport })))
}

fn entry_from(attributes: Vec<ConntrackAttribute>) -> Result<Option<Entry>, String> {
    let (mut orig, mut reply, mut status, mut tcp_state) = (None, None, None, None);
    let (mut timeout_secs, mut mark, mut zone) = (0, 0, 0);
    for attribute in attributes {
        match attribute {
            ConntrackAttribute::CtaTupleOrig(tuple) => orig = Some(tuple_from(&tuple, "CTA_TUPLE_ORIG")?),
            ConntrackAttribute::CtaTupleReply(tuple) => reply = Some(tuple_from(&tuple, "CTA_TUPLE_REPLY")?),
            ConntrackAttribute::CtaStatus(bits) => status = Some(bits.bits()),
            ConntrackAttribute::CtaTimeout(secs) => timeout_secs = secs,
            ConntrackAttribute::CtaMark(value) => mark = value,
            ConntrackAttribute::CtaProtoInfo(infos) => {
                for info in infos {
                    let ProtoInfo::TCP(parts) = info else { continue };
                    for part in parts {
                        if let ProtoInfoTCP::State(n) = part {
                            let state = TcpState::from_number(n).ok_or_else(|| {
                                format!("CTA_PROTOINFO_TCP_STATE {n} is no TCP conntrack state")
                            })?;
                            tcp_state = Some(state);
                        }
                    }
                }
            }
            ConntrackAttribute::Other(raw) if raw.kind() & NLA_TYPE_MASK == CTA_ZONE => {
                let mut value = vec![0u8; raw.value_len()];
                raw.emit_value(&mut value);
                let bytes: [u8; 2] =
                    value.get(..2).and_then(|b| b.try_into().ok()).ok_or("CTA_ZONE under 2 bytes")?;
                zone = u16::from_be_bytes(bytes);
            }
            _ => {}
        }
    }
    let orig = orig.ok_or("an entry without CTA_TUPLE_ORIG")?;
    let reply = reply.ok_or("an entry without CTA_TUPLE_REPLY")?;
    let (Some((proto, orig)), Some((_, reply))) = (orig, reply) else { return Ok(None) };
    let proto = Protocol::from_number(proto).expect("tuple_from keeps TCP and UDP only");
    let status = status.ok_or("an entry without CTA_STATUS")?;
    if proto == Protocol::Tcp && tcp_state.is_none() {
        return Err(format!("the TCP entry {orig} has no CTA_PROTOINFO_TCP_STATE"));
    }
    Ok(Some(Entry { proto, orig, reply, status, tcp_state, timeout_secs, mark, zone }))
}
