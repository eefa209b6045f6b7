//! ICMPv6 errors about translated IPv6 flows, as [`crate::icmp`] for IPv4: a backend (or a router
//! on its way) that cannot deliver — packet too big above all (IPv6 routers never fragment, so TCP
//! through a cluster IP learns a smaller path MTU only from these), port unreachable, hop limit
//! exceeded — quotes the client → backend packet after DNAT; the client's kernel matches the quote
//! against its sockets, which know only the Service address, so the quote is un-NATed.

use crate::{
    maps::{CT_DIR_REPLY, IPPROTO_TCP, IPPROTO_UDP},
    maps_v6::CtKeyV6,
    packet6::{IPPROTO_ICMPV6, IPV6_HLEN},
};

pub const ICMP6_DEST_UNREACH: u8 = 1;
pub const ICMP6_PACKET_TOO_BIG: u8 = 2;
pub const ICMP6_TIME_EXCEEDED: u8 = 3;
/// The ICMPv6 header before the quoted packet.
pub const ICMP6_HLEN: usize = 8;
/// What the datapath reads of an ICMPv6 error: its header, the quoted IPv6 header (no extension
/// headers) and the quoted ports.
pub const ICMP6_ERROR_SPAN: usize = ICMP6_HLEN + IPV6_HLEN + 4;
/// Offsets inside that span.
pub const ICMP6_OFF_CHECK: usize = 2;
pub const QUOTE6_OFF_SADDR: usize = ICMP6_HLEN + 8;
pub const QUOTE6_OFF_DADDR: usize = ICMP6_HLEN + 24;
pub const QUOTE6_OFF_SPORT: usize = ICMP6_HLEN + IPV6_HLEN;
pub const QUOTE6_OFF_DPORT: usize = ICMP6_HLEN + IPV6_HLEN + 2;

fn addr(bytes: &[u8], at: usize) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&bytes[at..at + 16]);
    a
}

/// The reply key of the flow an ICMPv6 message quotes (the quote is client → backend, the reply
/// entry is keyed backend → client), when it is an error the datapath un-NATs: destination
/// unreachable, packet too big or time exceeded, in an IPv6 packet whose fixed header is `outer`
/// with no extension headers and a payload long enough for the span read (bytes past the payload
/// length are never read as the quote), quoting a TCP or UDP packet without extension headers, and
/// addressed to that packet's source, as every host and router sends its errors.
pub fn quoted6(outer: &[u8; IPV6_HLEN], message: &[u8; ICMP6_ERROR_SPAN]) -> Option<CtKeyV6> {
    let payload_len = usize::from(u16::from_be_bytes([outer[4], outer[5]]));
    if outer[0] >> 4 != 6 || outer[6] != IPPROTO_ICMPV6 || payload_len < ICMP6_ERROR_SPAN {
        return None;
    }
    if !matches!(message[0], ICMP6_DEST_UNREACH | ICMP6_PACKET_TOO_BIG | ICMP6_TIME_EXCEEDED) {
        return None;
    }
    let quote = &message[ICMP6_HLEN..];
    let proto = quote[6];
    if quote[0] >> 4 != 6 || !matches!(proto, IPPROTO_TCP | IPPROTO_UDP) {
        return None;
    }
    let client = addr(message, QUOTE6_OFF_SADDR);
    if addr(outer, 24) != client {
        return None;
    }
    Some(CtKeyV6 {
        saddr: addr(message, QUOTE6_OFF_DADDR),
        daddr: client,
        sport: [message[QUOTE6_OFF_DPORT], message[QUOTE6_OFF_DPORT + 1]],
        dport: [message[QUOTE6_OFF_SPORT], message[QUOTE6_OFF_SPORT + 1]],
        proto,
        direction: CT_DIR_REPLY,
        _pad: [0; 2],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: [u8; 16] = [0xfd, 0, 0x10, 0, 2, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
    const BACKEND: [u8; 16] = [0xfd, 0, 0x10, 0, 2, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x21];
    const ROUTER: [u8; 16] = [0xfd, 0, 0x10, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

    fn error(kind: u8, to: [u8; 16], proto: u8) -> ([u8; IPV6_HLEN], [u8; ICMP6_ERROR_SPAN]) {
        let mut outer = [0u8; IPV6_HLEN];
        outer[..8].copy_from_slice(&[0x60, 0, 0, 0, 0, 100, IPPROTO_ICMPV6, 64]);
        outer[8..24].copy_from_slice(&ROUTER);
        outer[24..].copy_from_slice(&to);
        let mut message = [0u8; ICMP6_ERROR_SPAN];
        message[..8].copy_from_slice(&[kind, 0, 0x12, 0x34, 0, 0, 0x05, 0x00]);
        message[8..16].copy_from_slice(&[0x60, 0, 0, 0, 0, 20, proto, 63]);
        message[16..32].copy_from_slice(&CLIENT);
        message[32..48].copy_from_slice(&BACKEND);
        message[48..52].copy_from_slice(&[0x9c, 0x40, 0x1f, 0x90]);
        (outer, message)
    }

    #[test]
    fn an_error_to_the_quoted_source_names_its_reply_entry() {
        for kind in [ICMP6_DEST_UNREACH, ICMP6_PACKET_TOO_BIG, ICMP6_TIME_EXCEEDED] {
            let (outer, message) = error(kind, CLIENT, IPPROTO_TCP);
            let key = quoted6(&outer, &message).expect("un-NATed");
            assert_eq!((key.saddr, key.daddr), (BACKEND, CLIENT));
            assert_eq!((key.sport, key.dport), ([0x1f, 0x90], [0x9c, 0x40]));
            assert_eq!((key.proto, key.direction), (IPPROTO_TCP, CT_DIR_REPLY));
        }
    }

    #[test]
    fn other_messages_and_errors_are_left_alone() {
        // Echo, neighbour solicitation; an error to someone else; a quote of ICMPv6.
        for (kind, to, proto) in [
            (128, CLIENT, IPPROTO_TCP),
            (135, CLIENT, IPPROTO_TCP),
            (2, ROUTER, IPPROTO_UDP),
            (1, CLIENT, 58),
        ] {
            let (outer, message) = error(kind, to, proto);
            assert_eq!(quoted6(&outer, &message), None, "{kind} to {to:02x?}, quoting {proto}");
        }
        let (mut outer, message) = error(ICMP6_PACKET_TOO_BIG, CLIENT, IPPROTO_TCP);
        outer[5] = (ICMP6_ERROR_SPAN - 1) as u8;
        assert_eq!(quoted6(&outer, &message), None, "a quote cut short of its ports");
        let (mut outer, message) = error(ICMP6_PACKET_TOO_BIG, CLIENT, IPPROTO_TCP);
        outer[6] = 60;
        assert_eq!(quoted6(&outer, &message), None, "extension headers before the ICMPv6 header");
    }
}
