//! IPv6 header layout and the walk over extension headers to the TCP/UDP header, the IPv6
//! counterpart of [`crate::packet::classify_ipv4`]. The kernel program hands [`locate_l4`] a reader
//! of the packet's bytes; everything it declines passes untouched.

use crate::maps::{IPPROTO_TCP, IPPROTO_UDP};
use crate::packet::{Fragment, Skip, TCP_MIN_HLEN, TCP_OFF_CHECK, UDP_HLEN, UDP_OFF_CHECK};

pub const ETH_P_IPV6: u16 = 0x86DD;
pub const IPV6_HLEN: usize = 40;

/// Offsets inside the IPv6 header.
pub const IP6_OFF_PAYLOAD_LEN: usize = 4;
pub const IP6_OFF_NEXT_HEADER: usize = 6;
pub const IP6_OFF_HOP_LIMIT: usize = 7;
pub const IP6_OFF_SADDR: usize = 8;
pub const IP6_OFF_DADDR: usize = 24;

/// Next-header values: the extension headers [`locate_l4`] walks, and ICMPv6.
pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_ICMPV6: u8 = 58;
pub const IPPROTO_DSTOPTS: u8 = 60;

/// Extension headers walked at most before the packet is left alone: RFC 8200's recommended order
/// has at most six (hop-by-hop, destination options, routing, fragment, AH, destination options),
/// and a chain longer than this is no real client's. A constant bound is what the verifier accepts.
pub const MAX_EXT_HEADERS: usize = 4;

/// The fragment header's offset field (in 8-byte units, upper 13 bits) and more-fragments flag.
pub const IP6_FRAG_OFFSET_MASK: u16 = 0xfff8;
pub const IP6_FRAG_MORE: u16 = 0x0001;

/// Where an IPv6 packet's L4 header is (relative to the IPv6 header), its protocol, and which part
/// of a fragmented datagram the packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L4Location6 {
    pub l4_offset: usize,
    pub proto: u8,
    pub fragment: Fragment,
    /// The fragment header's identification (zero when there is none).
    pub fragment_id: [u8; 4],
}

impl L4Location6 {
    /// Offset of the L4 checksum field, relative to the IPv6 header.
    pub const fn checksum_offset(&self) -> usize {
        self.l4_offset + if self.proto == IPPROTO_TCP { TCP_OFF_CHECK } else { UDP_OFF_CHECK }
    }

    /// Whether extension headers sit between the IPv6 header and the L4 header.
    pub const fn has_extension_headers(&self) -> bool {
        self.l4_offset != IPV6_HLEN
    }
}

/// Walks the extension headers of an IPv6 packet whose fixed header says `version_word` (its first
/// byte), `next_header` and `payload_len`, to its TCP or UDP header. `available` is how many bytes
/// of the packet follow the start of the IPv6 header; `read(offset)` returns the 8 bytes at
/// `offset` from the start of the IPv6 header (the first 8 bytes of an extension header hold its
/// next header and length), `None` past the packet.
///
/// Hop-by-hop (0), routing (43) and destination options (60) headers are skipped by their length;
/// a fragment header (44) makes the packet a first fragment (offset 0, more fragments: it has the
/// ports) or a later one (no L4 header; its protocol is the fragment header's next header). ICMPv6
/// (neighbour discovery included), AH, ESP, "no next header" and everything else are not TCP/UDP.
#[inline(always)]
pub fn locate_l4<F: FnMut(usize) -> Option<[u8; 8]>>(
    version_word: u8,
    next_header: u8,
    payload_len: u16,
    available: usize,
    read: F,
) -> Result<L4Location6, Skip> {
    let loc = locate_upper(version_word, next_header, payload_len, available, read)?;
    let l4_min = match loc.proto {
        IPPROTO_TCP => TCP_MIN_HLEN,
        IPPROTO_UDP => UDP_HLEN,
        _ => return Err(Skip::NotTcpUdp),
    };
    if !matches!(loc.fragment, Fragment::Later)
        && loc.l4_offset + l4_min > IPV6_HLEN + usize::from(payload_len)
    {
        return Err(Skip::Truncated);
    }
    Ok(loc)
}

/// The walk of [`locate_l4`] to the first header that is no extension header, whatever its
/// protocol (ICMPv6, SCTP, ESP, ...): what a packet the datapath does not translate carries, which
/// the service-CIDR check needs (an ICMPv6 echo request behind a hop-by-hop header is still one).
/// A later fragment's protocol is its fragment header's next header, and its `l4_offset` is where
/// its data starts (no upper-layer header is there). Nothing past the header's start is checked.
#[inline(always)]
pub fn locate_upper<F: FnMut(usize) -> Option<[u8; 8]>>(
    version_word: u8,
    next_header: u8,
    payload_len: u16,
    available: usize,
    mut read: F,
) -> Result<L4Location6, Skip> {
    if version_word >> 4 != 6 {
        return Err(Skip::Malformed);
    }
    let end = IPV6_HLEN + usize::from(payload_len);
    // A payload length of zero with a hop-by-hop header is a jumbogram: no pod sends one.
    if payload_len == 0 || end > available {
        return Err(Skip::Malformed);
    }
    let mut next = next_header;
    let mut offset = IPV6_HLEN;
    let mut fragment = Fragment::Whole;
    let mut fragment_id = [0u8; 4];
    for _ in 0..MAX_EXT_HEADERS {
        if !matches!(next, IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT) {
            return Ok(L4Location6 { l4_offset: offset, proto: next, fragment, fragment_id });
        }
        if offset + 8 > end {
            return Err(Skip::Truncated);
        }
        let header = read(offset).ok_or(Skip::Truncated)?;
        if next == IPPROTO_FRAGMENT {
            let field = u16::from_be_bytes([header[2], header[3]]);
            fragment_id = [header[4], header[5], header[6], header[7]];
            if field & IP6_FRAG_OFFSET_MASK != 0 {
                return Ok(L4Location6 {
                    l4_offset: offset + 8,
                    proto: header[0],
                    fragment: Fragment::Later,
                    fragment_id,
                });
            }
            // Offset 0 without more fragments is an atomic fragment (RFC 6946): the whole datagram.
            if field & IP6_FRAG_MORE != 0 {
                fragment = Fragment::First;
            }
            offset += 8;
        } else {
            offset += (usize::from(header[1]) + 1) * 8;
        }
        next = header[0];
    }
    Err(Skip::Malformed)
}

/// Whether a refusal may answer a packet from `source` sent to the link-layer address whose first
/// octet is `dest_mac_first`: RFC 4443 2.4 (e) sends no ICMPv6 error about a packet whose source
/// names no single node — the unspecified address `::`, loopback `::1`, multicast `ff00::/8` — nor
/// one sent to a link-layer group, and a TCP reset follows the same rule (RFC 1122 4.2.3.10, as
/// [`crate::reject::may_refuse`] for IPv4). IPv4-mapped sources (`::ffff:0:0/96`) never travel
/// on the wire either.
pub fn may_refuse6(dest_mac_first: u8, source: &[u8; 16]) -> bool {
    let link_layer_group = dest_mac_first & 0x01 != 0;
    let zero_prefix = source[..10].iter().all(|b| *b == 0);
    let unspecified_or_loopback = zero_prefix && source[10..15].iter().all(|b| *b == 0) && source[15] <= 1;
    let v4_mapped = zero_prefix && source[10] == 0xff && source[11] == 0xff;
    let multicast = source[0] == 0xff;
    !link_layer_group && !unspecified_or_loopback && !v4_mapped && !multicast
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// The bytes after an IPv6 header: extension headers then the L4 header.
    fn walk(next: u8, rest: &[u8]) -> Result<L4Location6, Skip> {
        let mut packet = std::vec![0u8; IPV6_HLEN];
        packet.extend_from_slice(rest);
        let read = |offset: usize| packet.get(offset..offset + 8).map(|b| <[u8; 8]>::try_from(b).unwrap());
        locate_l4(0x60, next, rest.len() as u16, packet.len(), read)
    }

    fn ext(next: u8, len8: u8) -> Vec<u8> {
        let mut h = std::vec![next, len8];
        h.resize((usize::from(len8) + 1) * 8, 0);
        h
    }

    fn frag(next: u8, offset8: u16, more: bool, id: u32) -> Vec<u8> {
        let field = (offset8 << 3) | u16::from(more);
        let mut h = std::vec![next, 0];
        h.extend_from_slice(&field.to_be_bytes());
        h.extend_from_slice(&id.to_be_bytes());
        h
    }

    #[test]
    fn plain_tcp_and_udp() {
        let at = |proto, l4_offset| {
            Ok(L4Location6 { l4_offset, proto, fragment: Fragment::Whole, fragment_id: [0; 4] })
        };
        assert_eq!(walk(IPPROTO_TCP, &[0; 20]), at(IPPROTO_TCP, 40));
        assert_eq!(walk(IPPROTO_UDP, &[0; 8]), at(IPPROTO_UDP, 40));
        assert_eq!(walk(IPPROTO_UDP, &[0; 7]), Err(Skip::Truncated));
        assert_eq!(walk(IPPROTO_TCP, &[0; 19]), Err(Skip::Truncated));
        assert!(!walk(IPPROTO_UDP, &[0; 8]).unwrap().has_extension_headers());
        assert_eq!(walk(IPPROTO_UDP, &[0; 8]).unwrap().checksum_offset(), 46);
    }

    #[test]
    fn extension_headers_are_skipped_by_their_length() {
        let mut rest = ext(IPPROTO_DSTOPTS, 0);
        rest.extend(ext(IPPROTO_ROUTING, 2));
        rest.extend(ext(IPPROTO_UDP, 1));
        rest.extend([0; 8]);
        // Hop-by-hop (8) + destination options (24) + routing (16).
        let loc = walk(IPPROTO_HOPOPTS, &rest).unwrap();
        assert_eq!(
            (loc.l4_offset, loc.proto, loc.fragment),
            (40 + 8 + 24 + 16, IPPROTO_UDP, Fragment::Whole)
        );
        assert!(loc.has_extension_headers());
        assert_eq!(loc.checksum_offset(), 88 + 6);
    }

    #[test]
    fn icmpv6_and_other_protocols_are_not_walked_into() {
        assert_eq!(walk(IPPROTO_ICMPV6, &[135, 0, 0, 0, 0, 0, 0, 0]), Err(Skip::NotTcpUdp));
        let mut rest = ext(IPPROTO_ICMPV6, 0);
        rest.extend([128, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(walk(IPPROTO_HOPOPTS, &rest), Err(Skip::NotTcpUdp), "MLD behind hop-by-hop");
        assert_eq!(walk(59, &[0; 8]), Err(Skip::NotTcpUdp), "no next header");
        assert_eq!(walk(50, &[0; 8]), Err(Skip::NotTcpUdp), "ESP");
        assert_eq!(walk(51, &[6, 1, 0, 0, 0, 0, 0, 0]), Err(Skip::NotTcpUdp), "AH");
    }

    #[test]
    fn fragments_are_told_apart() {
        let mut first = frag(IPPROTO_UDP, 0, true, 0xdead_beef);
        first.extend([0; 8]);
        let loc = walk(IPPROTO_FRAGMENT, &first).unwrap();
        assert_eq!(
            (loc.l4_offset, loc.fragment, loc.fragment_id),
            (48, Fragment::First, [0xde, 0xad, 0xbe, 0xef])
        );

        let mut later = frag(IPPROTO_UDP, 6, false, 7);
        later.extend([0; 3]);
        let loc = walk(IPPROTO_FRAGMENT, &later).unwrap();
        assert_eq!((loc.proto, loc.fragment, loc.fragment_id), (IPPROTO_UDP, Fragment::Later, [0, 0, 0, 7]));
        let mut middle = frag(IPPROTO_TCP, 6, true, 7);
        middle.extend([0; 8]);
        assert_eq!(walk(IPPROTO_FRAGMENT, &middle).unwrap().fragment, Fragment::Later);
        assert_eq!(walk(IPPROTO_FRAGMENT, &frag(IPPROTO_ICMPV6, 6, false, 7)), Err(Skip::NotTcpUdp));

        let mut atomic = frag(IPPROTO_UDP, 0, false, 9);
        atomic.extend([0; 8]);
        assert_eq!(walk(IPPROTO_FRAGMENT, &atomic).unwrap().fragment, Fragment::Whole, "atomic fragment");

        let mut short_first = frag(IPPROTO_UDP, 0, true, 9);
        short_first.extend([0; 4]);
        assert_eq!(walk(IPPROTO_FRAGMENT, &short_first), Err(Skip::Truncated));

        // A destination options header after the fragment header of a first fragment.
        let mut first = frag(IPPROTO_DSTOPTS, 0, true, 1);
        first.extend(ext(IPPROTO_TCP, 0));
        first.extend([0; 20]);
        assert_eq!(walk(IPPROTO_FRAGMENT, &first).unwrap().l4_offset, 40 + 8 + 8);
    }

    fn upper(next: u8, rest: &[u8]) -> Result<(usize, u8, Fragment), Skip> {
        let mut packet = std::vec![0u8; IPV6_HLEN];
        packet.extend_from_slice(rest);
        let read = |offset: usize| packet.get(offset..offset + 8).map(|b| <[u8; 8]>::try_from(b).unwrap());
        locate_upper(0x60, next, rest.len() as u16, packet.len(), read)
            .map(|loc| (loc.l4_offset, loc.proto, loc.fragment))
    }

    #[test]
    fn the_upper_layer_walk_names_any_protocol_behind_the_extension_headers() {
        let echo = [128, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(upper(IPPROTO_ICMPV6, &echo), Ok((40, IPPROTO_ICMPV6, Fragment::Whole)));
        let mut rest = ext(IPPROTO_ICMPV6, 0);
        rest.extend(echo);
        assert_eq!(
            upper(IPPROTO_HOPOPTS, &rest),
            Ok((48, IPPROTO_ICMPV6, Fragment::Whole)),
            "behind hop-by-hop"
        );
        assert_eq!(upper(132, &[0; 12]), Ok((40, 132, Fragment::Whole)), "SCTP");
        assert_eq!(upper(59, &[0; 8]), Ok((40, 59, Fragment::Whole)), "no next header");
        // A later fragment of an echo request: its data starts after the fragment header.
        let mut later = frag(IPPROTO_ICMPV6, 6, false, 3);
        later.extend([0; 8]);
        assert_eq!(upper(IPPROTO_FRAGMENT, &later), Ok((48, IPPROTO_ICMPV6, Fragment::Later)));
        let mut first = frag(IPPROTO_ICMPV6, 0, true, 3);
        first.extend(echo);
        assert_eq!(upper(IPPROTO_FRAGMENT, &first), Ok((48, IPPROTO_ICMPV6, Fragment::First)));
        // TCP and UDP are where locate_l4 finds them, and a short one is still located here.
        assert_eq!(upper(IPPROTO_UDP, &[0; 4]), Ok((40, IPPROTO_UDP, Fragment::Whole)));
        assert_eq!(walk(IPPROTO_UDP, &[0; 4]), Err(Skip::Truncated));
        // What locate_l4 declines as malformed, so does the upper walk.
        let chain: Vec<u8> = (0..MAX_EXT_HEADERS + 1).flat_map(|_| ext(IPPROTO_DSTOPTS, 0)).collect();
        assert_eq!(upper(IPPROTO_DSTOPTS, &chain), Err(Skip::Malformed));
        assert_eq!(upper(IPPROTO_HOPOPTS, &[IPPROTO_ICMPV6, 3, 0, 0]), Err(Skip::Truncated));
    }

    #[test]
    fn malformed_and_truncated() {
        let mut packet = std::vec![0u8; 48];
        let read = |_: usize| Some([0u8; 8]);
        assert_eq!(locate_l4(0x40, IPPROTO_UDP, 8, 48, read), Err(Skip::Malformed), "version 4");
        assert_eq!(locate_l4(0x60, IPPROTO_UDP, 16, 48, read), Err(Skip::Malformed), "beyond the packet");
        assert_eq!(locate_l4(0x60, IPPROTO_HOPOPTS, 0, 48, read), Err(Skip::Malformed), "jumbogram");
        // An extension header longer than the payload.
        packet[40] = IPPROTO_UDP;
        packet[41] = 4;
        let read = |offset: usize| packet.get(offset..offset + 8).map(|b| <[u8; 8]>::try_from(b).unwrap());
        assert_eq!(locate_l4(0x60, IPPROTO_DSTOPTS, 8, 48, read), Err(Skip::Truncated));
        // A chain longer than any real client's.
        let chain: Vec<u8> = (0..MAX_EXT_HEADERS + 1).flat_map(|_| ext(IPPROTO_DSTOPTS, 0)).collect();
        assert_eq!(walk(IPPROTO_DSTOPTS, &chain), Err(Skip::Malformed));
    }

    #[test]
    fn refusals_answer_single_nodes_only() {
        let unicast_mac = 0x02;
        let mut loopback = [0u8; 16];
        loopback[15] = 1;
        let mut mapped = [0u8; 16];
        mapped[10..].copy_from_slice(&[0xff, 0xff, 10, 0, 0, 1]);
        let mut all_nodes = [0u8; 16];
        all_nodes[0] = 0xff;
        all_nodes[1] = 0x02;
        all_nodes[15] = 1;
        for source in [[0u8; 16], loopback, mapped, all_nodes] {
            assert!(!may_refuse6(unicast_mac, &source), "{source:02x?}");
        }
        let mut pod = [0u8; 16];
        pod[..4].copy_from_slice(&[0xfd, 0, 0x10, 0x02]);
        pod[15] = 5;
        assert!(may_refuse6(unicast_mac, &pod));
        // Neighbour discovery's solicited-node groups and broadcast-like MACs.
        assert!(!may_refuse6(0x33, &pod));
        assert!(!may_refuse6(0xff, &pod));
    }
}
