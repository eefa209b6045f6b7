//! Conntrack states and their transitions, applied by the datapath on every
//! packet of a translated flow and read back by `kproxy dump conntrack`.

use crate::maps::{CT_DIR_FORWARD, CT_DIR_REPLY, IPPROTO_TCP};
use crate::packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

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
