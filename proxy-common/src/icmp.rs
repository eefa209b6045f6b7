//! ICMP errors about translated flows. A backend (or a router on its way) that
//! cannot deliver a reply — port unreachable, fragmentation needed, TTL
//! exceeded — sends an ICMP error quoting the packet it received: the client
//! → backend header after DNAT. The client's kernel matches the quote against
//! its sockets, which know only the Service address, so the quote must be
//! un-NATed like the reply itself would have been (netfilter does this for
//! "RELATED" packets in kube-proxy's iptables mode).

use crate::{
    maps::{CT_DIR_REPLY, CtKeyV4, IPPROTO_TCP, IPPROTO_UDP},
    packet::{IP_MF, IP_OFFSET_MASK},
};

pub const IPPROTO_ICMP: u8 = 1;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
/// The ICMP header before the quoted packet.
pub const ICMP_HLEN: usize = 8;
/// What the datapath reads of an ICMP error: its header, an option-less quoted
/// IPv4 header and the quoted ports.
pub const ICMP_ERROR_SPAN: usize = ICMP_HLEN + 20 + 4;
/// Offsets inside that span.
pub const ICMP_OFF_CHECK: usize = 2;
pub const QUOTE_OFF_CHECK: usize = ICMP_HLEN + 10;
pub const QUOTE_OFF_SADDR: usize = ICMP_HLEN + 12;
pub const QUOTE_OFF_DADDR: usize = ICMP_HLEN + 16;
pub const QUOTE_OFF_SPORT: usize = ICMP_HLEN + 20;
pub const QUOTE_OFF_DPORT: usize = ICMP_HLEN + 20 + 2;

/// The quoted packet of an ICMP error, when it is one the datapath un-NATs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quote {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
}

impl Quote {
    /// The conntrack key of the reply direction of the quoted flow: the quote
    /// is client → backend, the reply entry is keyed backend → client.
    pub const fn reply_key(&self) -> CtKeyV4 {
        CtKeyV4 {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
            direction: CT_DIR_REPLY,
            _pad: [0; 2],
        }
    }
}

/// Where the ICMP message starts in the IPv4 datagram whose fixed header is
/// `outer` (its header length), when the datagram is a whole ICMP message
/// long enough to hold what the datapath reads of an error. Bytes past the IP
/// total length (Ethernet padding) are no part of the packet: a quote cut
/// short of its ports is never completed from them, nor rewritten there.
/// Fragmented errors do not happen in practice; their quote would be cut.
pub fn error_message_offset(outer: &[u8; 20]) -> Option<usize> {
    let frag = u16::from_be_bytes([outer[6], outer[7]]);
    if outer[0] >> 4 != 4 || outer[9] != IPPROTO_ICMP || frag & (IP_MF | IP_OFFSET_MASK) != 0 {
        return None;
    }
    let header_len = usize::from(outer[0] & 0x0f) * 4;
    let total_len = usize::from(u16::from_be_bytes([outer[2], outer[3]]));
    if header_len < 20 || total_len < header_len + ICMP_ERROR_SPAN {
        return None;
    }
    Some(header_len)
}

/// Reads an ICMP message (from its type byte on) of the datagram whose fixed
/// header is `outer`: a destination-unreachable or time-exceeded error quoting
/// a TCP or UDP packet with an option-less header, sent to that packet's
/// source as every host and router sends its errors. An error addressed to
/// anyone else is not about a flow the quote's source has (for a source-NATed
/// flow: not addressed to the node address it was source-NATed to), whatever
/// it quotes. Anything else is not ours to rewrite.
pub fn quoted(outer: &[u8; 20], icmp: &[u8; ICMP_ERROR_SPAN]) -> Option<Quote> {
    if icmp[0] != ICMP_DEST_UNREACH && icmp[0] != ICMP_TIME_EXCEEDED {
        return None;
    }
    let ip = ICMP_HLEN;
    let proto = icmp[ip + 9];
    if icmp[ip] != 0x45 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
        return None;
    }
    let saddr = [icmp[ip + 12], icmp[ip + 13], icmp[ip + 14], icmp[ip + 15]];
    if saddr != [outer[16], outer[17], outer[18], outer[19]] {
        return None;
    }
    let l4 = ip + 20;
    Some(Quote {
        saddr,
        daddr: [icmp[ip + 16], icmp[ip + 17], icmp[ip + 18], icmp[ip + 19]],
        sport: [icmp[l4], icmp[l4 + 1]],
        dport: [icmp[l4 + 2], icmp[l4 + 3]],
        proto,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum;

    /// An ICMP port-unreachable from 10.244.0.21 quoting a UDP packet 10.244.0.2:40000 → :53.
    fn port_unreachable() -> [u8; ICMP_ERROR_SPAN] {
        let mut m = [0u8; ICMP_ERROR_SPAN];
        m[0] = ICMP_DEST_UNREACH;
        m[1] = 3;
        let ip = ICMP_HLEN;
        m[ip] = 0x45;
        m[ip + 3] = 60;
        m[ip + 8] = 64;
        m[ip + 9] = IPPROTO_UDP;
        m[ip + 12..ip + 16].copy_from_slice(&[10, 244, 0, 2]);
        m[ip + 16..ip + 20].copy_from_slice(&[10, 244, 0, 21]);
        m[ip + 20..ip + 22].copy_from_slice(&40000u16.to_be_bytes());
        m[ip + 22..ip + 24].copy_from_slice(&53u16.to_be_bytes());
        m
    }

    /// The IPv4 header of an ICMP datagram from 10.244.0.21 to `dst`, `total_len` long.
    fn outer_to(dst: [u8; 4], total_len: u16) -> [u8; 20] {
        let mut h = [0u8; 20];
        h[0] = 0x45;
        h[2..4].copy_from_slice(&total_len.to_be_bytes());
        h[8] = 64;
        h[9] = IPPROTO_ICMP;
        h[12..16].copy_from_slice(&[10, 244, 0, 21]);
        h[16..20].copy_from_slice(&dst);
        h
    }

    /// The outer header of the port unreachable, to the quoted packet's source.
    fn outer() -> [u8; 20] {
        outer_to([10, 244, 0, 2], (20 + ICMP_HLEN + 28) as u16)
    }

    #[test]
    fn a_port_unreachable_quoting_udp_gives_the_reply_key() {
        let quote = quoted(&outer(), &port_unreachable()).unwrap();
        assert_eq!(quote.saddr, [10, 244, 0, 2]);
        assert_eq!(quote.dport, 53u16.to_be_bytes());
        let key = quote.reply_key();
        assert_eq!((key.saddr, key.daddr, key.direction), ([10, 244, 0, 21], [10, 244, 0, 2], CT_DIR_REPLY));
        assert_eq!((key.sport, key.dport), (53u16.to_be_bytes(), 40000u16.to_be_bytes()));
    }

    #[test]
    fn other_messages_and_quotes_are_not_ours() {
        let mut echo = port_unreachable();
        echo[0] = 8;
        assert_eq!(quoted(&outer(), &echo), None);
        let mut options = port_unreachable();
        options[ICMP_HLEN] = 0x46;
        assert_eq!(quoted(&outer(), &options), None);
        let mut icmp_quote = port_unreachable();
        icmp_quote[ICMP_HLEN + 9] = IPPROTO_ICMP;
        assert_eq!(quoted(&outer(), &icmp_quote), None);
        let mut ttl = port_unreachable();
        ttl[0] = ICMP_TIME_EXCEEDED;
        assert!(quoted(&outer(), &ttl).is_some());
    }

    /// Errors go to the quoted packet's source: one addressed elsewhere (another host, the
    /// quoted destination, a broadcast) is about no flow of the quote's source.
    #[test]
    fn an_error_not_addressed_to_the_quoted_source_is_not_ours() {
        let total = (20 + ICMP_HLEN + 28) as u16;
        for elsewhere in [[10, 244, 0, 3], [10, 244, 0, 21], [255, 255, 255, 255], [10, 244, 0, 1]] {
            assert_eq!(quoted(&outer_to(elsewhere, total), &port_unreachable()), None, "to {elsewhere:?}");
        }
    }

    /// The span the datapath reads must lie inside the IP datagram: whatever follows its total
    /// length is padding, not quote.
    #[test]
    fn the_error_span_must_fit_in_the_ip_total_length() {
        let span = (20 + ICMP_ERROR_SPAN) as u16;
        let to_client = |total| outer_to([10, 244, 0, 2], total);
        assert_eq!(error_message_offset(&to_client(span)), Some(20));
        assert_eq!(error_message_offset(&to_client(span + 400)), Some(20));
        for short in [0, 19, 20, 28, 48, span - 1] {
            assert_eq!(error_message_offset(&to_client(short)), None, "total length {short}");
        }
        let mut options = to_client(span + 4);
        options[0] = 0x46;
        assert_eq!(error_message_offset(&options), Some(24));
        options[2..4].copy_from_slice(&(span + 3).to_be_bytes());
        assert_eq!(error_message_offset(&options), None, "the options count against the total length");
    }

    #[test]
    fn fragmented_malformed_and_other_datagrams_hold_no_error() {
        let with = |at: usize, value: u8| {
            let mut h = outer();
            h[2..4].copy_from_slice(&((20 + ICMP_ERROR_SPAN) as u16).to_be_bytes());
            h[at] = value;
            h
        };
        assert_eq!(error_message_offset(&with(6, 0x40)), Some(20), "don't fragment is fine");
        assert_eq!(error_message_offset(&with(6, 0x20)), None, "more fragments");
        assert_eq!(error_message_offset(&with(7, 0x01)), None, "a later fragment");
        assert_eq!(error_message_offset(&with(9, IPPROTO_UDP)), None, "not ICMP");
        assert_eq!(error_message_offset(&with(0, 0x44)), None, "IHL below 5");
        assert_eq!(error_message_offset(&with(0, 0x65)), None, "not version 4");
    }

    /// Why the datapath leaves the ICMP checksum alone when it rewrites the quoted destination:
    /// the quoted header's checksum moves by the opposite amount, so the words the ICMP checksum
    /// covers sum to the same.
    #[test]
    fn rewriting_a_quoted_address_and_its_header_checksum_keeps_the_message_sum() {
        let mut m = port_unreachable();
        let check = checksum::checksum(&m[ICMP_HLEN..ICMP_HLEN + 20]);
        m[QUOTE_OFF_CHECK..QUOTE_OFF_CHECK + 2].copy_from_slice(&check.to_be_bytes());
        let before = checksum::add_words(0, &m);
        m[QUOTE_OFF_DADDR..QUOTE_OFF_DADDR + 4].copy_from_slice(&[10, 96, 0, 10]);
        m[QUOTE_OFF_CHECK..QUOTE_OFF_CHECK + 2].copy_from_slice(&[0, 0]);
        let check = checksum::checksum(&m[ICMP_HLEN..ICMP_HLEN + 20]);
        m[QUOTE_OFF_CHECK..QUOTE_OFF_CHECK + 2].copy_from_slice(&check.to_be_bytes());
        assert_eq!(checksum::fold(checksum::add_words(0, &m)), checksum::fold(before));
    }
}
