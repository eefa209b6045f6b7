//! The kernel's own connection tracking table (nf_conntrack), read and changed over ctnetlink, for
//! IPv4 TCP and UDP: [`dump_v4`], [`delete`], [`create_dnat`], [`is_available`].
//!
//! Flows that kube-proxy's rules NATed before kproxy attached are netfilter's to finish (issue 17):
//! their translation lives in nf_conntrack, not in kproxy's maps. This module is how the agent and
//! the operator commands find them (an entry with [`Entry::is_dst_nat`] that is not
//! [`Entry::is_over`]), and how kproxy can hand a flow it translated back to netfilter
//! ([`create_dnat`]).
//!
//! Messages are encoded and decoded by rust-netlink's `netlink-packet-netfilter` (its `conntrack`
//! module models tuples, status, TCP protocol info, timeout and mark); the attributes it does not
//! model (`CTA_ZONE`, `CTA_NAT_DST`, `CTA_NAT_SRC`) travel as raw attributes. The socket is a plain
//! `NETLINK_NETFILTER` socket, like `agent/sockdiag.rs`'s: one per call, so every call works in the
//! network namespace of the calling thread (enter another one with `setns` on a thread of its own).
//!
//! What the kernel does that this module relies on (`net/netfilter/nf_conntrack_netlink.c`):
//! - every ctnetlink message, a dump included, needs `CAP_NET_ADMIN` in the socket's namespace;
//! - attribute values are big-endian, but the kernel does not set `NLA_F_NET_BYTEORDER` on them;
//!   nested attributes carry `NLA_F_NESTED`;
//! - a `IPCTNL_MSG_CT_DELETE` without a tuple flushes the whole table, so [`delete`] always sends
//!   the original tuple;
//! - creating needs `NLM_F_CREATE`, both tuples and `CTA_TIMEOUT`. The kernel sets `IPS_CONFIRMED`
//!   before it applies `CTA_STATUS`, and refuses a status without it (EBUSY); the NAT bits of
//!   `CTA_STATUS` are ignored (two tuples and a status with `IPS_DST_NAT` make an entry that
//!   translates nothing). NAT comes only from `CTA_NAT_DST`, applied like a DNAT rule to the reply
//!   tuple given: so [`create_dnat`] sends the reply tuple as the inverse of the original one and
//!   the kernel rewrites it to backend → client and sets `IPS_DST_NAT`;
//! - creating always sets up source NAT too: with no `CTA_NAT_SRC` the kernel makes a null
//!   binding, which moves the client to another port when the reply tuple backend → client is
//!   taken (seen on 6.18: an entry created while the plain entry client → backend existed got the
//!   reply backend → client:39383, so the backend would see a stranger's port). So
//!   [`create_dnat`] pins the source to the client itself, and a clash is refused (EEXIST)
//!   instead: while netfilter still holds the plain entry of a flow that kproxy translated
//!   (original client → backend), delete that one first.

use std::{
    ffi::c_void,
    fmt, io,
    net::{IpAddr, Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use netlink_packet_core::{
    DefaultNla, Emitable, NLA_F_NESTED, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Status, TCPFlags,
        Tuple as CtTuple,
    },
};

use crate::net::Protocol;

const NETLINK_NETFILTER: i32 = 12;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLA_HDRLEN: usize = 4;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_OVERRUN: u16 = 4;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW`: every entry of a dump comes as one of these.
const CT_NEW_MESSAGE: u16 = 1 << 8;

// Attributes netlink-packet-netfilter does not model (uapi nfnetlink_conntrack.h).
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_DST: u16 = 13;
const CTA_ZONE: u16 = 18;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;

/// `IP_CT_TCP_FLAG_BE_LIBERAL` (uapi nf_conntrack_tcp.h).
const TCP_FLAG_BE_LIBERAL: u8 = 0x08;

// Status bits (uapi nf_conntrack_common.h, enum ip_conntrack_status).
pub const IPS_EXPECTED: u32 = 1;
pub const IPS_SEEN_REPLY: u32 = 1 << 1;
pub const IPS_ASSURED: u32 = 1 << 2;
pub const IPS_CONFIRMED: u32 = 1 << 3;
pub const IPS_SRC_NAT: u32 = 1 << 4;
pub const IPS_DST_NAT: u32 = 1 << 5;
pub const IPS_SRC_NAT_DONE: u32 = 1 << 7;
pub const IPS_DST_NAT_DONE: u32 = 1 << 8;
pub const IPS_DYING: u32 = 1 << 9;

/// Big enough for any datagram a dump sends (the kernel fills at most 32 KiB per read).
const RECV_BUF_LEN: usize = 64 * 1024;
/// How long one read waits for the kernel before the call gives up.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);
const CONNTRACK_MAX_SYSCTL: &str = "/proc/sys/net/netfilter/nf_conntrack_max";

static SEQUENCE: AtomicU32 = AtomicU32::new(1);

/// One direction of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
}

impl Tuple {
    /// The tuple of the other direction, as it is before any NAT.
    pub fn inverse(&self) -> Tuple {
        Tuple { src: self.dst, dst: self.src, sport: self.dport, dport: self.sport }
    }
}

impl fmt::Display for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} -> {}:{}", self.src, self.sport, self.dst, self.dport)
    }
}

/// TCP conntrack states, in the kernel's `enum tcp_conntrack` order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TcpState {
    None,
    SynSent,
    SynRecv,
    Established,
    FinWait,
    CloseWait,
    LastAck,
    TimeWait,
    Close,
    SynSent2,
}

impl TcpState {
    const ALL: [TcpState; 10] = [
        TcpState::None,
        TcpState::SynSent,
        TcpState::SynRecv,
        TcpState::Established,
        TcpState::FinWait,
        TcpState::CloseWait,
        TcpState::LastAck,
        TcpState::TimeWait,
        TcpState::Close,
        TcpState::SynSent2,
    ];

    /// The kernel's number for this state (`TCP_CONNTRACK_*`).
    pub fn number(self) -> u8 {
        self as u8
    }

    pub fn from_number(n: u8) -> Option<TcpState> {
        Self::ALL.get(usize::from(n)).copied()
    }

    /// The name `/proc/net/nf_conntrack` and `conntrack -L` print.
    pub fn name(self) -> &'static str {
        match self {
            TcpState::None => "NONE",
            TcpState::SynSent => "SYN_SENT",
            TcpState::SynRecv => "SYN_RECV",
            TcpState::Established => "ESTABLISHED",
            TcpState::FinWait => "FIN_WAIT",
            TcpState::CloseWait => "CLOSE_WAIT",
            TcpState::LastAck => "LAST_ACK",
            TcpState::TimeWait => "TIME_WAIT",
            TcpState::Close => "CLOSE",
            TcpState::SynSent2 => "SYN_SENT2",
        }
    }
}

impl fmt::Display for TcpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One conntrack entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub proto: Protocol,
    /// The flow as its first packet had it (client → Service address for a Service flow).
    pub orig: Tuple,
    /// What replies look like on the wire (backend → client after a DNAT).
    pub reply: Tuple,
    /// `IPS_*` bits.
    pub status: u32,
    /// `Some` for TCP.
    pub tcp_state: Option<TcpState>,
    /// Seconds until the entry expires.
    pub timeout_secs: u32,
    pub mark: u32,
    /// The conntrack zone (`CTA_ZONE`); 0 is the default zone.
    pub zone: u16,
}

impl Entry {
    /// Its destination was translated (kube-proxy's DNAT to a backend).
    pub fn is_dst_nat(&self) -> bool {
        self.status & IPS_DST_NAT != 0
    }

    /// Its source was translated (kube-proxy's masquerade).
    pub fn is_src_nat(&self) -> bool {
        self.status & IPS_SRC_NAT != 0
    }

    /// A TCP flow that has closed (TIME_WAIT or CLOSE): the entry only waits to expire.
    pub fn is_over(&self) -> bool {
        matches!(self.tcp_state, Some(TcpState::TimeWait | TcpState::Close))
    }
}

/// A flow to hand to netfilter: the client reached `vip`, and `backend` serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnatFlow {
    pub proto: Protocol,
    pub client: SocketAddrV4,
    pub vip: SocketAddrV4,
    pub backend: SocketAddrV4,
    /// Seconds until the entry expires unless traffic refreshes it.
    pub timeout_secs: u32,
    pub mark: u32,
    pub zone: u16,
}

/// A ctnetlink call that failed, naming what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum NfConntrackError {
    #[error(
        "conntrack {op} needs CAP_NET_ADMIN in this network namespace (the kernel answered {})",
        errno_name(*errno)
    )]
    NeedsCapNetAdmin { op: &'static str, errno: i32 },
    #[error(
        "conntrack {op}: connection tracking (nf_conntrack and nf_conntrack_netlink) is not loaded in this \
         kernel: {source}"
    )]
    NotLoaded { op: &'static str, source: io::Error },
    #[error("conntrack {op}: {source}")]
    Kernel { op: &'static str, source: io::Error },
    #[error("conntrack {op}: the kernel did not answer within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    #[error(
        "conntrack dump: the socket buffer overflowed (ENOBUFS) on two dumps in a row: the table changes \
         faster than it can be read"
    )]
    Overrun,
    #[error("conntrack {op}: truncated reply: {what}")]
    Truncated { op: &'static str, what: String },
    #[error("conntrack {op}: malformed reply: {what}")]
    Malformed { op: &'static str, what: String },
}

fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        _ => "a permission error",
    }
}

impl NfConntrackError {
    /// What an errno from the kernel means for `op`.
    fn from_errno(op: &'static str, errno: i32) -> NfConntrackError {
        let source = io::Error::from_raw_os_error(errno);
        match errno {
            libc::EPERM | libc::EACCES => NfConntrackError::NeedsCapNetAdmin { op, errno },
            // socket(2) without nfnetlink; a dump without ctnetlink (nfnetlink finds no
            // subsystem and answers EINVAL to a request that is otherwise always valid).
            libc::EPROTONOSUPPORT | libc::EAFNOSUPPORT => NfConntrackError::NotLoaded { op, source },
            libc::EINVAL if op == OP_DUMP => NfConntrackError::NotLoaded { op, source },
            libc::ENOBUFS if op == OP_DUMP => NfConntrackError::Overrun,
            libc::EAGAIN => NfConntrackError::Timeout { op, timeout: RECV_TIMEOUT },
            _ => NfConntrackError::Kernel { op, source },
        }
    }
}

const OP_DUMP: &str = "dump";
const OP_DELETE: &str = "delete";
const OP_CREATE: &str = "create";

/// Whether connection tracking is loaded in the calling thread's network namespace (its sysctls
/// are there). Without it there is nothing to read, and no legacy flow.
pub fn is_available() -> bool {
    Path::new(CONNTRACK_MAX_SYSCTL).exists()
}

/// Every IPv4 TCP and UDP entry of the calling thread's network namespace (other protocols are
/// skipped). A dump that overflows the socket buffer is started over once.
pub fn dump_v4() -> Result<Vec<Entry>, NfConntrackError> {
    again_after_overrun(dump_into)
}

/// What `dump` collects; a second try from scratch if the first one overran.
fn again_after_overrun(
    mut dump: impl FnMut(&mut Vec<Entry>) -> Result<(), NfConntrackError>,
) -> Result<Vec<Entry>, NfConntrackError> {
    let mut entries = Vec::new();
    match dump(&mut entries) {
        Err(NfConntrackError::Overrun) => {
            entries.clear();
            dump(&mut entries)?;
        }
        other => other?,
    }
    Ok(entries)
}

/// Deletes `entry` (found by its original tuple and zone, as `conntrack -D` does). `Ok(false)` if
/// it was already gone.
pub fn delete(entry: &Entry) -> Result<bool, NfConntrackError> {
    let seq = next_sequence();
    let socket = Socket::open(OP_DELETE)?;
    socket.send(OP_DELETE, &delete_request(entry, seq))?;
    match socket.ack(OP_DELETE, seq)? {
        0 => Ok(true),
        errno if errno == libc::ENOENT => Ok(false),
        errno => Err(NfConntrackError::from_errno(OP_DELETE, errno)),
    }
}

/// Creates a confirmed, assured entry for `flow`: original client → vip, reply backend → client,
/// destination NATed, so that netfilter translates the flow's packets both ways as if its own DNAT
/// rule had chosen `backend`. A TCP entry starts ESTABLISHED with liberal window tracking
/// (`IP_CT_TCP_FLAG_BE_LIBERAL` both ways): the kernel knows nothing of the connection's sequence
/// numbers or window scale, and without it marks the segments of a window-scaled connection
/// handed over mid-stream INVALID, which kube-proxy's rules drop (the connection stalls; the root
/// test shows both). `Ok(false)` if an entry with the same original tuple, or whose reply tuple is
/// backend → client, already exists (nothing is changed then).
pub fn create_dnat(flow: &DnatFlow) -> Result<bool, NfConntrackError> {
    create_dnat_from(flow, flow.client)
}

/// [`create_dnat`] for a flow whose source is translated too, to `source`: reply backend →
/// `source`, and the client's packets leave from `source` (kproxy's NodePort flows, sent from a
/// node address and an SNAT port, handed to netfilter on `kproxy unload`). `Ok(false)` if an
/// entry with the same original tuple, or whose reply tuple is backend → `source`, exists.
pub fn create_dnat_from(flow: &DnatFlow, source: SocketAddrV4) -> Result<bool, NfConntrackError> {
    let seq = next_sequence();
    let socket = Socket::open(OP_CREATE)?;
    socket.send(OP_CREATE, &create_request(flow, source, seq))?;
    match socket.ack(OP_CREATE, seq)? {
        0 => Ok(true),
        errno if errno == libc::EEXIST => Ok(false),
        errno => Err(NfConntrackError::from_errno(OP_CREATE, errno)),
    }
}

fn next_sequence() -> u32 {
    SEQUENCE.fetch_add(1, Ordering::Relaxed)
}

fn dump_into(entries: &mut Vec<Entry>) -> Result<(), NfConntrackError> {
    let seq = next_sequence();
    let socket = Socket::open(OP_DUMP)?;
    socket.send(OP_DUMP, &dump_request(seq))?;
    let mut buf = vec![0u8; RECV_BUF_LEN];
    loop {
        let n = socket.recv(OP_DUMP, &mut buf)?;
        for reply in Replies::new(OP_DUMP, &buf[..n]) {
            let (reply_seq, reply) = reply?;
            if reply_seq != seq {
                continue;
            }
            match reply {
                Reply::Entry(Some(entry)) => entries.push(entry),
                Reply::Entry(None) => {}
                Reply::Done(0) => return Ok(()),
                Reply::Done(code) | Reply::Ack(code) => {
                    // An ACK of 0 in a dump would be odd but harmless.
                    if code != 0 {
                        return Err(NfConntrackError::from_errno(OP_DUMP, -code));
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Requests.

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

fn dump_request(seq: u32) -> Vec<u8> {
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

fn zone_attribute(zone: u16) -> ConntrackAttribute {
    ConntrackAttribute::Other(DefaultNla::new(CTA_ZONE, zone.to_be_bytes().to_vec()))
}

fn delete_request(entry: &Entry, seq: u32) -> Vec<u8> {
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

fn create_request(flow: &DnatFlow, source: SocketAddrV4, seq: u32) -> Vec<u8> {
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

// ---------------------------------------------------------------------------------------------
// Replies.

#[derive(Debug, PartialEq, Eq)]
enum Reply {
    /// A conntrack entry; `None` for one of another protocol.
    Entry(Option<Entry>),
    /// NLMSG_DONE, with the dump's error (0, or a negative errno).
    Done(i32),
    /// NLMSG_ERROR: 0 (an ACK) or a negative errno.
    Ack(i32),
}

/// The messages of one datagram, each with its sequence number. Stops at the first error.
struct Replies<'a> {
    op: &'static str,
    buf: &'a [u8],
    at: usize,
}

impl<'a> Replies<'a> {
    fn new(op: &'static str, buf: &'a [u8]) -> Self {
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

// ---------------------------------------------------------------------------------------------
// The socket.

struct Socket(OwnedFd);

impl Socket {
    fn open(op: &'static str) -> Result<Self, NfConntrackError> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_NETFILTER) };
        if fd < 0 {
            return Err(NfConntrackError::from_errno(op, last_errno()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let socket = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
        let timeout = libc::timeval { tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
        // SAFETY: setsockopt reading a live timeval of the given size.
        let ret = unsafe {
            libc::setsockopt(
                socket.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if ret != 0 {
            return Err(NfConntrackError::from_errno(op, last_errno()));
        }
        Ok(socket)
    }

    fn send(&self, op: &'static str, msg: &[u8]) -> Result<(), NfConntrackError> {
        loop {
            // SAFETY: sending from a live buffer of the given length (to the kernel, port 0).
            let sent = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr() as *const c_void, msg.len(), 0) };
            if sent >= 0 {
                return Ok(());
            }
            match last_errno() {
                libc::EINTR => continue,
                errno => return Err(NfConntrackError::from_errno(op, errno)),
            }
        }
    }

    /// One datagram into `buf`; its length.
    fn recv(&self, op: &'static str, buf: &mut [u8]) -> Result<usize, NfConntrackError> {
        loop {
            // SAFETY: receiving into a live buffer of the given length. MSG_TRUNC makes the
            // return value the datagram's full length, so a cut one is seen.
            let got = unsafe {
                libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut c_void, buf.len(), libc::MSG_TRUNC)
            };
            if got >= 0 {
                let got = got as usize;
                if got > buf.len() {
                    return Err(NfConntrackError::Truncated {
                        op,
                        what: format!("a datagram of {got} bytes, more than the {} read", buf.len()),
                    });
                }
                return Ok(got);
            }
            match last_errno() {
                libc::EINTR => continue,
                errno => return Err(NfConntrackError::from_errno(op, errno)),
            }
        }
    }

    /// The error code of the kernel's answer to request `seq` (0 for success).
    fn ack(&self, op: &'static str, seq: u32) -> Result<i32, NfConntrackError> {
        let mut buf = vec![0u8; 8192];
        loop {
            let n = self.recv(op, &mut buf)?;
            for reply in Replies::new(op, &buf[..n]) {
                if let (reply_seq, Reply::Ack(code)) = reply?
                    && reply_seq == seq
                {
                    return Ok(-code);
                }
            }
        }
    }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

// The fixtures are in this machine's byte order: netlink headers are host-endian.
#[cfg(all(test, target_endian = "little"))]
mod tests {
    use super::*;

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

    fn tuple(
        proto: u8,
        src: [u8; 4],
        dst: [u8; 4],
        sport: u16,
        dport: u16,
        extra: &[Vec<u8>],
    ) -> Vec<Vec<u8>> {
        let mut proto_parts =
            vec![nla(1, &[proto]), nla(2, &sport.to_be_bytes()), nla(3, &dport.to_be_bytes())];
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
                &[nest(
                    1,
                    &[nla(1, &[3]), nla(2, &[10]), nla(3, &[10]), nla(4, &[0x23, 0]), nla(5, &[0x23, 0])],
                )],
            ),
        ]
    }

    fn kernel_tcp_entry() -> Entry {
        Entry {
            proto: Protocol::Tcp,
            orig: Tuple {
                src: Ipv4Addr::LOCALHOST,
                dst: Ipv4Addr::new(10, 96, 0, 10),
                sport: 41000,
                dport: 80,
            },
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
        let portless =
            vec![nest(1, &[nla(1, &[10, 0, 0, 1]), nla(2, &[10, 0, 0, 2])]), nest(2, &[nla(1, &[6])])];
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
        let holds =
            |request: &[u8], attribute: &[u8]| request.windows(attribute.len()).any(|w| w == attribute);
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
        assert!(
            matches!(err, NfConntrackError::NeedsCapNetAdmin { .. }) && calls == 1,
            "{err}, {calls} calls"
        );
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
}
