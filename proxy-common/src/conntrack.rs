//! Conntrack states and their transitions, applied by the datapath on every
//! packet of a translated flow and read back by `kproxy dump conntrack`.

use crate::maps::{CT_DIR_FORWARD, CT_DIR_REPLY, IPPROTO_TCP};
use crate::packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// How long an entry may stay idle in each state, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_syn_ns: u64,
    pub tcp_established_ns: u64,
    pub tcp_closing_ns: u64,
    pub udp_ns: u64,
}

const SECOND: u64 = 1_000_000_000;

impl Timeouts {
    /// Cilium's and Calico's ranges: SYN 60 s, established 6 h, closing 10 s,
    /// UDP and other 60 s.
    pub const DEFAULT: Timeouts = Timeouts {
        tcp_syn_ns: 60 * SECOND,
        tcp_established_ns: 6 * 3600 * SECOND,
        tcp_closing_ns: 10 * SECOND,
        udp_ns: 60 * SECOND,
    };

    /// The timeouts in `config`, where zero means the default.
    pub const fn from_config(config: &crate::maps::ConfigV4) -> Timeouts {
        const fn or(value: u64, default: u64) -> u64 {
            if value == 0 { default } else { value }
        }
        let d = Self::DEFAULT;
        Timeouts {
            tcp_syn_ns: or(config.timeout_tcp_syn_ns, d.tcp_syn_ns),
            tcp_established_ns: or(config.timeout_tcp_established_ns, d.tcp_established_ns),
            tcp_closing_ns: or(config.timeout_tcp_closing_ns, d.tcp_closing_ns),
            udp_ns: or(config.timeout_udp_ns, d.udp_ns),
        }
    }

    /// The idle timeout of an entry in `state`.
    pub const fn for_state(&self, state: CtState) -> u64 {
        match state {
            CtState::SynSent | CtState::SynReceived => self.tcp_syn_ns,
            CtState::Established => self.tcp_established_ns,
            CtState::Closing | CtState::Closed => self.tcp_closing_ns,
            CtState::Open => self.udp_ns,
        }
    }

    /// Whether an entry last seen at `last_seen_ns` in raw `state` is dead at
    /// `now_ns`. Unknown states expire like the shortest timeout.
    pub const fn expired(&self, state: u8, last_seen_ns: u64, now_ns: u64) -> bool {
        let timeout = match CtState::from_u8(state) {
            Some(s) => self.for_state(s),
            None => self.tcp_closing_ns,
        };
        now_ns.saturating_sub(last_seen_ns) > timeout
    }
}

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtState {
    /// A TCP SYN went out, no reply yet.
    SynSent = 1,
    /// The backend answered the SYN.
    SynReceived = 2,
    Established = 3,
    /// A FIN was seen in either direction.
    Closing = 4,
    /// A RST was seen; the entry only waits to be collected.
    Closed = 5,
    /// UDP, or TCP picked up mid-stream: no handshake to follow.
    Open = 6,
}

impl CtState {
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::SynSent,
            2 => Self::SynReceived,
            3 => Self::Established,
            4 => Self::Closing,
            5 => Self::Closed,
            6 => Self::Open,
            _ => return None,
        })
    }

    pub const fn name(self) -> &'static str {
        match self {
            Self::SynSent => "SYN_SENT",
            Self::SynReceived => "SYN_RECV",
            Self::Established => "ESTABLISHED",
            Self::Closing => "CLOSING",
            Self::Closed => "CLOSED",
            Self::Open => "OPEN",
        }
    }

    /// The state of a flow whose first packet is the one being translated.
    pub const fn initial(proto: u8, tcp_flags: u8) -> Self {
        if proto != IPPROTO_TCP {
            return Self::Open;
        }
        if tcp_flags & TCP_RST != 0 {
            Self::Closed
        } else if tcp_flags & TCP_SYN != 0 && tcp_flags & TCP_ACK == 0 {
            Self::SynSent
        } else {
            Self::Open
        }
    }

    /// The state after a packet with `tcp_flags` travelling in `direction`.
    pub const fn next(self, proto: u8, tcp_flags: u8, direction: u8) -> Self {
        if proto != IPPROTO_TCP {
            return Self::Open;
        }
        if tcp_flags & TCP_RST != 0 {
            return Self::Closed;
        }
        if tcp_flags & TCP_FIN != 0 {
            return Self::Closing;
        }
        match self {
            Self::SynSent
                if direction == CT_DIR_REPLY && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK =>
            {
                Self::SynReceived
            }
            Self::SynReceived if direction == CT_DIR_FORWARD && tcp_flags & TCP_ACK != 0 => Self::Established,
            // A new SYN on a closed tuple is a reused port: start over.
            Self::Closed | Self::Closing if direction == CT_DIR_FORWARD && tcp_flags & TCP_SYN != 0 => {
                Self::SynSent
            }
            Self::Open if tcp_flags & TCP_ACK != 0 => Self::Established,
            other => other,
        }
    }
}

/// The fields of a conntrack entry that every packet of its flow updates, whatever its address
/// family ([`crate::maps::CtEntryV4`], [`crate::maps_v6::CtEntryV6`]), so the update is written once.
pub struct PacketFields<'a> {
    pub last_seen_ns: &'a mut u64,
    pub packets: &'a mut u64,
    pub bytes: &'a mut u64,
    pub tcp_flags_seen: &'a mut u8,
    pub state: &'a mut u8,
}

macro_rules! packet_fields {
    ($($entry:ty),*) => {$(
        impl $entry {
            /// What [`record_packet`] updates.
            #[inline(always)]
            pub fn packet_fields(&mut self) -> PacketFields<'_> {
                PacketFields {
                    last_seen_ns: &mut self.last_seen_ns,
                    packets: &mut self.packets,
                    bytes: &mut self.bytes,
                    tcp_flags_seen: &mut self.tcp_flags_seen,
                    state: &mut self.state,
                }
            }
        }
    )*};
}
packet_fields!(crate::maps::CtEntryV4, crate::maps_v6::CtEntryV6);

/// Records one more packet of `len` bytes travelling in `direction` at `now`, and advances the
/// state of a forward entry (a reply moves the state through [`reply_moves_state`] instead: it
/// lives on the forward entry). Counters are plain adds: the BPF target has no 64-bit atomic RMW
/// in `core`, and a rare lost increment under contention is acceptable. Flags and state are written
/// only when they change: steady traffic stores nothing but the counters and the timestamp.
#[inline(always)]
pub fn record_packet(entry: PacketFields<'_>, proto: u8, tcp_flags: u8, len: u16, direction: u8, now: u64) {
    *entry.last_seen_ns = now;
    *entry.packets += 1;
    *entry.bytes += u64::from(len);
    let flags_seen = *entry.tcp_flags_seen;
    if flags_seen | tcp_flags != flags_seen {
        *entry.tcp_flags_seen = flags_seen | tcp_flags;
    }
    if direction != CT_DIR_REPLY {
        let current = *entry.state;
        let state = CtState::from_u8(current).unwrap_or(CtState::Open);
        let next = state.next(proto, tcp_flags, direction) as u8;
        if next != current {
            *entry.state = next;
        }
    }
}

/// Whether a reply with `tcp_flags` may move its flow's state, `mirrored` being the state its reply
/// entry mirrors: only TCP, and once established only SYN, FIN and RST.
#[inline(always)]
pub const fn reply_moves_state(proto: u8, tcp_flags: u8, mirrored: u8) -> bool {
    proto == IPPROTO_TCP
        && (tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0 || mirrored != CtState::Established as u8)
}

/// Whether a TCP segment with `tcp_flags` may start a flow: a bare SYN. With
/// ACK, RST or FIN it belongs to a connection that must already exist
/// (netfilter's TCP tracker calls SYN|FIN and SYN|RST invalid).
pub const fn starts_tcp_flow(tcp_flags: u8) -> bool {
    tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) == TCP_SYN
}

/// Whether a packet to no Service must be checked against the translated flows for its reply
/// tuple (the port-reuse clash, [`Clash`]). Only a packet that may start a flow can be remapped: UDP,
/// or a bare TCP SYN. Any other TCP segment is left alone whatever holds its tuple (a clash check
/// would answer [`Clash::Leave`]), and the SYN that opened its connection had the clash resolved, so
/// most direct traffic (established TCP) pays no lookup for it.
pub const fn direct_may_clash(proto: u8, tcp_flags: u8) -> bool {
    proto != IPPROTO_TCP || starts_tcp_flow(tcp_flags)
}

/// What becomes of a translated flow when a new flow would have the same
/// reply tuple (the client reused its source port: to a pod it had reached
/// through a Service, or through a second Service to the same backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clash {
    /// The translated flow is over: its entries are removed and the new flow
    /// takes the tuple (netfilter reuses the tuple of a closed TCP connection
    /// the same way).
    Yield,
    /// The translated flow may still carry packets: the new flow's source port
    /// is remapped so that both keep working (netfilter's clash resolution).
    Remap,
    /// The packet cannot start a flow (a TCP segment without SYN): nothing
    /// is changed for it.
    Leave,
}

/// The translated flow's side of a clash, as its entries record it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClashingFlow {
    /// The forward entry's state; `None` when only the reply entry is left
    /// (its forward entry was evicted or removed: nothing can use it).
    pub state: Option<u8>,
    /// TCP flags seen from the client and from the backend.
    pub forward_flags_seen: u8,
    pub reply_flags_seen: u8,
    /// Whether the flow is idle past its state's timeout.
    pub idle: bool,
}

impl Clash {
    /// The resolution for a new packet with `tcp_flags` (`proto`) whose reply
    /// tuple is already `existing`'s.
    pub const fn resolve(proto: u8, tcp_flags: u8, existing: ClashingFlow) -> Clash {
        let over = match existing.state {
            None => true,
            Some(_) if existing.idle => true,
            Some(state) => {
                proto == IPPROTO_TCP
                    && (state == CtState::Closed as u8
                        || (existing.forward_flags_seen & TCP_FIN != 0
                            && existing.reply_flags_seen & TCP_FIN != 0))
            }
        };
        if over {
            return Clash::Yield;
        }
        if proto == IPPROTO_TCP && !starts_tcp_flow(tcp_flags) {
            return Clash::Leave;
        }
        Clash::Remap
    }
}

/// A conntrack key of either family ([`crate::maps::CtKeyV4`], [`crate::maps_v6::CtKeyV6`]), so
/// that the clash checks below are written once for both.
pub trait FlowKey: Copy {
    type Addr: Copy + PartialEq;
    fn saddr(&self) -> Self::Addr;
    fn daddr(&self) -> Self::Addr;
    fn sport(&self) -> [u8; 2];
    fn dport(&self) -> [u8; 2];
    fn proto(&self) -> u8;
    /// A forward-direction key.
    fn forward(saddr: Self::Addr, daddr: Self::Addr, sport: [u8; 2], dport: [u8; 2], proto: u8) -> Self;
}

macro_rules! flow_key {
    ($($key:ty, $addr:ty);*) => {$(
        impl FlowKey for $key {
            type Addr = $addr;
            #[inline(always)]
            fn saddr(&self) -> $addr { self.saddr }
            #[inline(always)]
            fn daddr(&self) -> $addr { self.daddr }
            #[inline(always)]
            fn sport(&self) -> [u8; 2] { self.sport }
            #[inline(always)]
            fn dport(&self) -> [u8; 2] { self.dport }
            #[inline(always)]
            fn proto(&self) -> u8 { self.proto }
            #[inline(always)]
            fn forward(saddr: $addr, daddr: $addr, sport: [u8; 2], dport: [u8; 2], proto: u8) -> Self {
                Self { saddr, daddr, sport, dport, proto, direction: CT_DIR_FORWARD, _pad: [0; 2] }
            }
        }
    )*};
}
flow_key!(crate::maps::CtKeyV4, [u8; 4]; crate::maps_v6::CtKeyV6, [u8; 16]);

/// The forward key of the translated flow whose reply entry holds a new flow's reply tuple
/// `reply_key` (`backend → client:port`): `client`'s flow (the reply's destination, or for a
/// hairpin flow its source) from `client_port` to `frontend`, the address and port its reply entry
/// un-NATs to. `client_port` is the reply's destination port, or the client's own port when the
/// flow was remapped (its reverse SNAT entry).
#[inline(always)]
pub fn clashing_forward_key<K: FlowKey>(
    reply_key: &K,
    client: K::Addr,
    client_port: [u8; 2],
    frontend: (K::Addr, [u8; 2]),
) -> K {
    K::forward(client, frontend.0, client_port, frontend.1, reply_key.proto())
}

/// Whether a forward entry sending its flow to `backend` is the flow of the reply entry under
/// `reply_key` (the reply's source is that backend): a forward entry under the same key may be a
/// later flow's, whose reply tuple is another.
#[inline(always)]
pub fn forward_points_back<K: FlowKey>(reply_key: &K, backend: (K::Addr, [u8; 2])) -> bool {
    backend.0 == reply_key.saddr() && backend.1 == reply_key.sport()
}

impl ClashingFlow {
    /// A reply entry whose forward entry is gone: nothing can use it.
    pub const fn orphan(reply_flags_seen: u8) -> Self {
        ClashingFlow { state: None, forward_flags_seen: 0, reply_flags_seen, idle: true }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::IPPROTO_UDP;

    const FWD: u8 = CT_DIR_FORWARD;
    const REP: u8 = CT_DIR_REPLY;

    #[test]
    fn three_way_handshake_then_fin() {
        let s = CtState::initial(IPPROTO_TCP, TCP_SYN);
        assert_eq!(s, CtState::SynSent);
        let s = s.next(IPPROTO_TCP, TCP_SYN | TCP_ACK, REP);
        assert_eq!(s, CtState::SynReceived);
        let s = s.next(IPPROTO_TCP, TCP_ACK, FWD);
        assert_eq!(s, CtState::Established);
        let s = s.next(IPPROTO_TCP, TCP_ACK, REP);
        assert_eq!(s, CtState::Established);
        let s = s.next(IPPROTO_TCP, TCP_FIN | TCP_ACK, REP);
        assert_eq!(s, CtState::Closing);
        assert_eq!(s.next(IPPROTO_TCP, TCP_ACK, FWD), CtState::Closing);
    }

    #[test]
    fn rst_closes_from_any_state() {
        for s in
            [CtState::SynSent, CtState::SynReceived, CtState::Established, CtState::Closing, CtState::Open]
        {
            assert_eq!(s.next(IPPROTO_TCP, TCP_RST, FWD), CtState::Closed);
            assert_eq!(s.next(IPPROTO_TCP, TCP_RST | TCP_ACK, REP), CtState::Closed);
        }
    }

    #[test]
    fn syn_ack_from_the_client_side_does_not_advance() {
        assert_eq!(CtState::SynSent.next(IPPROTO_TCP, TCP_SYN | TCP_ACK, FWD), CtState::SynSent);
    }

    #[test]
    fn port_reuse_restarts() {
        assert_eq!(CtState::Closed.next(IPPROTO_TCP, TCP_SYN, FWD), CtState::SynSent);
        assert_eq!(CtState::Closing.next(IPPROTO_TCP, TCP_SYN, FWD), CtState::SynSent);
    }

    #[test]
    fn udp_is_open() {
        assert_eq!(CtState::initial(IPPROTO_UDP, 0), CtState::Open);
        assert_eq!(CtState::Open.next(IPPROTO_UDP, 0, REP), CtState::Open);
    }

    #[test]
    fn mid_stream_tcp_is_picked_up() {
        let s = CtState::initial(IPPROTO_TCP, TCP_ACK);
        assert_eq!(s, CtState::Open);
        assert_eq!(s.next(IPPROTO_TCP, TCP_ACK, REP), CtState::Established);
    }

    #[test]
    fn timeouts_per_state_and_config_overrides() {
        let t = Timeouts::DEFAULT;
        assert_eq!(t.for_state(CtState::SynSent), 60 * SECOND);
        assert_eq!(t.for_state(CtState::Established), 6 * 3600 * SECOND);
        assert_eq!(t.for_state(CtState::Closing), 10 * SECOND);
        assert_eq!(t.for_state(CtState::Open), 60 * SECOND);
        assert!(!t.expired(CtState::Open as u8, 100, 100 + 60 * SECOND));
        assert!(t.expired(CtState::Open as u8, 100, 101 + 60 * SECOND));
        assert!(t.expired(0, 0, 11 * SECOND), "an unknown state expires like closing");
        assert!(!t.expired(CtState::Established as u8, 500, 400), "a clock behind last_seen is not expiry");
        let config = crate::maps::ConfigV4 { timeout_udp_ns: SECOND, ..Default::default() };
        let custom = Timeouts::from_config(&config);
        assert_eq!(custom.udp_ns, SECOND);
        assert_eq!(custom.tcp_established_ns, t.tcp_established_ns);
    }

    fn flow(state: CtState, fwd: u8, rep: u8) -> ClashingFlow {
        ClashingFlow { state: Some(state as u8), forward_flags_seen: fwd, reply_flags_seen: rep, idle: false }
    }

    #[test]
    fn a_closed_translated_flow_yields_its_tuple() {
        // The server closed first, the client answered: no TIME_WAIT on the client.
        let closed = flow(CtState::Closing, TCP_SYN | TCP_ACK | TCP_FIN, TCP_SYN | TCP_ACK | TCP_FIN);
        assert_eq!(Clash::resolve(IPPROTO_TCP, TCP_SYN, closed), Clash::Yield);
        assert_eq!(
            Clash::resolve(IPPROTO_TCP, TCP_SYN, flow(CtState::Closed, TCP_SYN, TCP_RST)),
            Clash::Yield
        );
        let orphan = ClashingFlow { state: None, ..closed };
        assert_eq!(Clash::resolve(IPPROTO_UDP, 0, orphan), Clash::Yield);
        let idle = ClashingFlow { idle: true, ..flow(CtState::Open, 0, 0) };
        assert_eq!(Clash::resolve(IPPROTO_UDP, 0, idle), Clash::Yield);
    }

    #[test]
    fn a_live_translated_flow_keeps_its_tuple_and_the_new_one_is_remapped() {
        let live = flow(CtState::Established, TCP_SYN | TCP_ACK, TCP_SYN | TCP_ACK);
        assert_eq!(Clash::resolve(IPPROTO_TCP, TCP_SYN, live), Clash::Remap);
        // Half-closed: the other side may still send.
        let half = flow(CtState::Closing, TCP_ACK | TCP_FIN, TCP_SYN | TCP_ACK);
        assert_eq!(Clash::resolve(IPPROTO_TCP, TCP_SYN, half), Clash::Remap);
        // UDP cannot tell a new exchange from the old one: always both.
        assert_eq!(Clash::resolve(IPPROTO_UDP, 0, flow(CtState::Open, 0, 0)), Clash::Remap);
    }

    /// The clash checks read both families' keys alike: the flow a reply entry belongs to is found
    /// from the reply tuple and the frontend the entry un-NATs to.
    #[test]
    fn the_clashing_flow_is_found_alike_in_both_families() {
        use crate::maps::CtKeyV4;
        use crate::maps_v6::CtKeyV6;
        let (client, backend, vip) = ([10, 244, 0, 5], [10, 244, 0, 9], [10, 96, 0, 10]);
        let forward = CtKeyV4 {
            saddr: client,
            daddr: vip,
            sport: [0x9c, 0x40],
            dport: [0, 80],
            proto: 6,
            ..Default::default()
        };
        let reply = forward.reply_of(backend, [0x1f, 0x90]);
        assert_eq!(clashing_forward_key(&reply, reply.daddr, reply.dport, (vip, [0, 80])), forward);
        assert!(forward_points_back(&reply, (backend, [0x1f, 0x90])));
        assert!(!forward_points_back(&reply, (backend, [0, 80])), "another port of the backend");
        assert!(!forward_points_back(&reply, ([10, 244, 0, 8], [0x1f, 0x90])), "another backend");

        let v6 = |last: u8| [0xfd, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last];
        let forward6 = CtKeyV6 {
            saddr: v6(5),
            daddr: v6(0xa),
            sport: [0x9c, 0x40],
            dport: [0, 53],
            proto: 17,
            ..Default::default()
        };
        // A remapped flow: its reply comes to the remapped port; the forward key has the client's own.
        let mut reply6 = forward6.reply_of(v6(9), [0, 53]);
        reply6.dport = [0xee, 0x48];
        assert_eq!(clashing_forward_key(&reply6, reply6.daddr, [0x9c, 0x40], (v6(0xa), [0, 53])), forward6);
        assert!(forward_points_back(&reply6, (v6(9), [0, 53])));
        assert!(!forward_points_back(&reply6, (v6(8), [0, 53])));
        assert_eq!(Clash::resolve(IPPROTO_UDP, 0, ClashingFlow::orphan(0)), Clash::Yield);
    }

    #[test]
    fn only_a_syn_starts_a_remapped_tcp_flow() {
        let live = flow(CtState::Established, TCP_SYN | TCP_ACK, TCP_SYN | TCP_ACK);
        for flags in [TCP_ACK, TCP_SYN | TCP_ACK, TCP_RST, TCP_SYN | TCP_RST, TCP_FIN | TCP_ACK] {
            assert_eq!(Clash::resolve(IPPROTO_TCP, flags, live), Clash::Leave, "flags {flags:#x}");
        }
    }

    #[test]
    fn only_udp_and_bare_syns_to_no_service_are_checked_for_a_clash() {
        assert!(direct_may_clash(IPPROTO_UDP, 0));
        assert!(direct_may_clash(IPPROTO_TCP, TCP_SYN));
        let live = flow(CtState::Established, TCP_SYN | TCP_ACK, TCP_SYN | TCP_ACK);
        for flags in [TCP_ACK, TCP_SYN | TCP_ACK, TCP_RST, TCP_FIN | TCP_ACK, TCP_SYN | TCP_FIN] {
            assert!(!direct_may_clash(IPPROTO_TCP, flags), "flags {flags:#x}");
            // What the skipped check would have answered for a live flow holding the tuple.
            assert_eq!(Clash::resolve(IPPROTO_TCP, flags, live), Clash::Leave, "flags {flags:#x}");
        }
    }

    #[test]
    fn only_a_bare_syn_starts_a_tcp_flow() {
        assert!(starts_tcp_flow(TCP_SYN));
        assert!(starts_tcp_flow(TCP_SYN | 0x08 | 0x20), "PSH and URG do not matter");
        for flags in [0, TCP_ACK, TCP_SYN | TCP_ACK, TCP_SYN | TCP_FIN, TCP_SYN | TCP_RST, TCP_FIN, TCP_RST] {
            assert!(!starts_tcp_flow(flags), "flags {flags:#x}");
        }
    }

    #[test]
    fn a_packet_is_recorded_alike_in_both_families() {
        let mut v4 = crate::maps::CtEntryV4 { state: CtState::SynSent as u8, ..Default::default() };
        let mut v6 = crate::maps_v6::CtEntryV6 { state: CtState::SynSent as u8, ..Default::default() };
        record_packet(v4.packet_fields(), IPPROTO_TCP, TCP_SYN | TCP_ACK, 60, REP, 7);
        record_packet(v6.packet_fields(), IPPROTO_TCP, TCP_SYN | TCP_ACK, 80, REP, 7);
        // A reply counts but leaves the state to the forward entry.
        assert_eq!((v4.packets, v4.bytes, v4.last_seen_ns, v4.state), (1, 60, 7, CtState::SynSent as u8));
        assert_eq!((v6.packets, v6.bytes, v6.tcp_flags_seen), (1, 80, TCP_SYN | TCP_ACK));
        v6.state = CtState::SynReceived as u8;
        record_packet(v6.packet_fields(), IPPROTO_TCP, TCP_ACK, 72, FWD, 9);
        assert_eq!((v6.packets, v6.bytes, v6.state), (2, 152, CtState::Established as u8));
    }

    #[test]
    fn an_established_reply_moves_the_state_only_with_syn_fin_or_rst() {
        let est = CtState::Established as u8;
        assert!(!reply_moves_state(IPPROTO_TCP, TCP_ACK, est));
        assert!(reply_moves_state(IPPROTO_TCP, TCP_FIN | TCP_ACK, est));
        assert!(reply_moves_state(IPPROTO_TCP, TCP_ACK, CtState::SynSent as u8));
        assert!(!reply_moves_state(IPPROTO_UDP, 0, CtState::Open as u8));
    }

    #[test]
    fn names_round_trip() {
        for v in 1..=6u8 {
            let s = CtState::from_u8(v).unwrap();
            assert_eq!(s as u8, v);
            assert!(!s.name().is_empty());
        }
        assert_eq!(CtState::from_u8(0), None);
        assert_eq!(CtState::from_u8(7), None);
    }
}
