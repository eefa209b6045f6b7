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
//!
//! Files: this one (the types, the errors and the four calls), `request` (requests encoded),
//! `reply` (a datagram's messages decoded into entries), `socket` (the netlink socket).

mod reply;
mod request;
mod socket;
// The fixtures are in this machine's byte order: netlink headers are host-endian.
#[cfg(all(test, target_endian = "little"))]
mod tests;

use std::{
    fmt, io,
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use reply::{Replies, Reply};
use request::{create_request, delete_request, dump_request};
use socket::{RECV_BUF_LEN, RECV_TIMEOUT, Socket};

use crate::net::Protocol;

/// `CTA_ZONE` (uapi nfnetlink_conntrack.h), which netlink-packet-netfilter does not model: sent
/// by `request`, read by `reply`.
const CTA_ZONE: u16 = 18;

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
