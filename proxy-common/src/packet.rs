//! Header layout and the decision of which IPv4 packets the datapath may
//! rewrite. The kernel program reads a few header bytes and asks
//! [`classify_ipv4`]; everything it declines passes untouched.

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const IPV4_MIN_HLEN: usize = 20;
pub const TCP_MIN_HLEN: usize = 20;
pub const UDP_HLEN: usize = 8;

/// Offsets inside the IPv4 header.
pub const IP_OFF_TOT_LEN: usize = 2;
pub const IP_OFF_FRAG: usize = 6;
pub const IP_OFF_PROTO: usize = 9;
pub const IP_OFF_CHECK: usize = 10;
pub const IP_OFF_SADDR: usize = 12;
pub const IP_OFF_DADDR: usize = 16;

/// Offsets inside the TCP/UDP header.
pub const L4_OFF_SPORT: usize = 0;
pub const L4_OFF_DPORT: usize = 2;
pub const TCP_OFF_FLAGS: usize = 13;
pub const TCP_OFF_CHECK: usize = 16;
pub const UDP_OFF_CHECK: usize = 6;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The fragment field's more-fragments flag and fragment offset.
pub const IP_MF: u16 = 0x2000;
pub const IP_OFFSET_MASK: u16 = 0x1fff;

/// Why a packet is left alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Neither TCP nor UDP (ICMP, SCTP, ...).
    NotTcpUdp,
    /// A later fragment whose first fragment was not seen: its ports are
    /// unknown.
    Fragment,
    /// Version is not 4, IHL below 5, or lengths that contradict each other.
    Malformed,
    /// The L4 header does not fit in the packet.
    Truncated,
}

/// Which part of a datagram an IPv4 packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fragment {
    /// Not fragmented.
    Whole,
    /// The first fragment: it has the L4 header (ports, checksum); the
    /// datapath remembers its ports for the fragments that follow.
    First,
    /// A later fragment: no L4 header. Only its addresses are rewritten, with
    /// the ports its first fragment had.
    Later,
}

/// Where the L4 header starts (relative to the IPv4 header), its protocol,
/// and whether the packet has it at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L4Location {
    pub ip_header_len: usize,
    pub proto: u8,
    pub fragment: Fragment,
}

impl L4Location {
    pub const fn checksum_offset(&self) -> usize {
        self.ip_header_len
            + if self.proto == crate::maps::IPPROTO_TCP { TCP_OFF_CHECK } else { UDP_OFF_CHECK }
    }
}

/// Decides from the first bytes of an IPv4 header whether its TCP/UDP header
/// can be rewritten. `available` is how many bytes of the packet follow the
/// start of the IPv4 header.
pub fn classify_ipv4(
    version_ihl: u8,
    total_len: u16,
    frag_field: u16,
    proto: u8,
    available: usize,
) -> Result<L4Location, Skip> {
    if version_ihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ip_header_len = usize::from(version_ihl & 0x0f) * 4;
    if ip_header_len < IPV4_MIN_HLEN {
        return Err(Skip::Malformed);
    }
    let total_len = usize::from(total_len);
    if total_len < ip_header_len || total_len > available {
        return Err(Skip::Malformed);
    }
    let l4_min = match proto {
        crate::maps::IPPROTO_TCP => TCP_MIN_HLEN,
        crate::maps::IPPROTO_UDP => UDP_HLEN,
        _ => return Err(Skip::NotTcpUdp),
    };
    let fragment = match (frag_field & IP_OFFSET_MASK != 0, frag_field & IP_MF != 0) {
        (true, _) => return Ok(L4Location { ip_header_len, proto, fragment: Fragment::Later }),
        (false, true) => Fragment::First,
        (false, false) => Fragment::Whole,
    };
    if total_len < ip_header_len + l4_min {
        return Err(Skip::Truncated);
    }
    Ok(L4Location { ip_header_len, proto, fragment })
}

/// The key under which a first fragment's ports wait for the later ones:
/// RFC 791's reassembly key (source, destination, protocol, identification).
#[inline]
pub const fn fragment_key(
    saddr: [u8; 4],
    daddr: [u8; 4],
    id: [u8; 2],
    proto: u8,
) -> crate::maps::FragmentKeyV4 {
    crate::maps::FragmentKeyV4 { saddr, daddr, id, proto, _pad: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::{IPPROTO_TCP, IPPROTO_UDP};

    #[test]
    fn plain_tcp_and_udp() {
        assert_eq!(
            classify_ipv4(0x45, 60, 0x4000, IPPROTO_TCP, 60),
            Ok(L4Location { ip_header_len: 20, proto: IPPROTO_TCP, fragment: Fragment::Whole })
        );
        assert_eq!(
            classify_ipv4(0x45, 28, 0, IPPROTO_UDP, 28),
            Ok(L4Location { ip_header_len: 20, proto: IPPROTO_UDP, fragment: Fragment::Whole })
        );
    }

    #[test]
    fn options_move_the_l4_header() {
        let loc = classify_ipv4(0x47, 28 + 8, 0, IPPROTO_UDP, 36).unwrap();
        assert_eq!(loc.ip_header_len, 28);
        assert_eq!(loc.checksum_offset(), 28 + UDP_OFF_CHECK);
    }

    #[test]
    fn fragments_are_told_apart() {
        let at = |fragment| Ok(L4Location { ip_header_len: 20, proto: IPPROTO_UDP, fragment });
        // Don't-fragment alone, more-fragments at offset 0, an offset (with and without MF).
        assert_eq!(classify_ipv4(0x45, 100, 0x4000, IPPROTO_UDP, 100), at(Fragment::Whole));
        assert_eq!(classify_ipv4(0x45, 100, 0x2000, IPPROTO_UDP, 100), at(Fragment::First));
        assert_eq!(classify_ipv4(0x45, 100, 0x00b9, IPPROTO_UDP, 100), at(Fragment::Later));
        assert_eq!(classify_ipv4(0x45, 100, 0x20b9, IPPROTO_UDP, 100), at(Fragment::Later));
        // A later fragment has no L4 header to be short of; a first one must hold it.
        assert_eq!(classify_ipv4(0x45, 24, 0x00b9, IPPROTO_UDP, 24), at(Fragment::Later));
        assert_eq!(classify_ipv4(0x45, 24, 0x2000, IPPROTO_UDP, 24), Err(Skip::Truncated));
        assert_eq!(classify_ipv4(0x45, 24, 0x00b9, 1, 24), Err(Skip::NotTcpUdp));
    }

    #[test]
    fn malformed_and_truncated() {
        assert_eq!(classify_ipv4(0x65, 40, 0, IPPROTO_TCP, 40), Err(Skip::Malformed));
        assert_eq!(classify_ipv4(0x44, 40, 0, IPPROTO_TCP, 40), Err(Skip::Malformed));
        assert_eq!(classify_ipv4(0x45, 19, 0, IPPROTO_TCP, 40), Err(Skip::Malformed));
        assert_eq!(classify_ipv4(0x45, 80, 0, IPPROTO_TCP, 40), Err(Skip::Malformed));
        assert_eq!(classify_ipv4(0x45, 30, 0, IPPROTO_TCP, 30), Err(Skip::Truncated));
        assert_eq!(classify_ipv4(0x4f, 60, 0, IPPROTO_UDP, 60), Err(Skip::Truncated));
    }

    #[test]
    fn other_protocols_pass() {
        assert_eq!(classify_ipv4(0x45, 84, 0, 1, 84), Err(Skip::NotTcpUdp));
        assert_eq!(classify_ipv4(0x45, 84, 0, 132, 84), Err(Skip::NotTcpUdp));
    }
}
