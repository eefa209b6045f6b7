//! The IPv6 refusals, as [`crate::reject`] builds the IPv4 ones: a TCP RST for TCP and an ICMPv6
//! destination unreachable (port unreachable) for UDP, sent from the address the client asked, so
//! it sees "connection refused" at once (kube-proxy's `REJECT` rules, with
//! `icmp6-port-unreachable`). IPv6 has no header checksum: both checksums cover the pseudo-header.

use crate::{
    checksum,
    maps::IPPROTO_TCP,
    packet6::{IPPROTO_ICMPV6, IPV6_HLEN},
    reject::reset_segment,
};

/// Bytes of the replies after the Ethernet header.
pub const TCP_RESET6_LEN: usize = IPV6_HLEN + 20;
/// The ICMPv6 header and the quote: the datagram's IPv6 header and the 8 bytes of its UDP header.
pub const ICMP6_QUOTE_LEN: usize = IPV6_HLEN + 8;
pub const ICMP6_UNREACHABLE_LEN: usize = IPV6_HLEN + 8 + ICMP6_QUOTE_LEN;

pub const ICMP6_DEST_UNREACH: u8 = 1;
pub const ICMP6_PORT_UNREACH: u8 = 4;
const HOP_LIMIT: u8 = 64;

fn addr(ip: &[u8; IPV6_HLEN], at: usize) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&ip[at..at + 16]);
    a
}

/// The IPv6 header of a reply from `src` to `dst` with `payload_len` bytes of `next_header`.
fn ipv6_header(out: &mut [u8], payload_len: u16, next_header: u8, src: &[u8; 16], dst: &[u8; 16]) {
    let len = payload_len.to_be_bytes();
    out[..8].copy_from_slice(&[0x60, 0, 0, 0, len[0], len[1], next_header, HOP_LIMIT]);
    out[8..24].copy_from_slice(src);
    out[24..40].copy_from_slice(dst);
}

/// IPv6 + TCP headers of the RST that answers the segment with IPv6 header `ip` (no extension
/// headers) and TCP header `tcp` (its first 20 bytes), `segment_len` being the TCP header plus
/// payload length as received; the sequence rules are IPv4's ([`reset_segment`]).
pub fn tcp_reset6(ip: &[u8; IPV6_HLEN], tcp: &[u8; 20], segment_len: u16, out: &mut [u8; TCP_RESET6_LEN]) {
    tcp_reset6_unsummed(ip, tcp, segment_len, out);
    let (src, dst) = (addr(ip, 24), addr(ip, 8));
    let check = checksum::l4_checksum_v6(&src, &dst, IPPROTO_TCP, &out[IPV6_HLEN..]).to_be_bytes();
    out[IPV6_HLEN + TCP_CHECK_AT..IPV6_HLEN + TCP_CHECK_AT + 2].copy_from_slice(&check);
}

/// Where the TCP and ICMPv6 checksum fields sit in their headers.
pub const TCP_CHECK_AT: usize = 16;
pub const ICMP6_CHECK_AT: usize = 2;

/// [`tcp_reset6`] with its checksum field left zero. The kernel programs fill it in with the kernel's
/// checksum helper: a checksum loop over a per-CPU map value is pointer arithmetic the verifier refuses
/// to a loader without CAP_PERFMON, as the DaemonSet runs the agent.
pub fn tcp_reset6_unsummed(
    ip: &[u8; IPV6_HLEN],
    tcp: &[u8; 20],
    segment_len: u16,
    out: &mut [u8; TCP_RESET6_LEN],
) {
    let (src, dst) = (addr(ip, 24), addr(ip, 8));
    ipv6_header(&mut out[..IPV6_HLEN], 20, IPPROTO_TCP, &src, &dst);
    out[IPV6_HLEN..].copy_from_slice(&reset_segment(tcp, segment_len));
}

/// IPv6 + ICMPv6 "destination unreachable, port unreachable" (RFC 4443 3.1) quoting the offending
/// datagram's IPv6 header `ip` (no extension headers) and its UDP header `l4`, sent from the address
/// it was sent to. The quote is shorter than RFC 4443's "as much as fits in 1280 bytes", as
/// kproxy's IPv4 refusal quotes 8 bytes: the kernel needs the headers alone to find the socket.
pub fn icmp6_port_unreachable(ip: &[u8; IPV6_HLEN], l4: &[u8; 8], out: &mut [u8; ICMP6_UNREACHABLE_LEN]) {
    icmp6_port_unreachable_unsummed(ip, l4, out);
    let (src, dst) = (addr(ip, 24), addr(ip, 8));
    let check = checksum::l4_checksum_v6(&src, &dst, IPPROTO_ICMPV6, &out[IPV6_HLEN..]).to_be_bytes();
    out[IPV6_HLEN + ICMP6_CHECK_AT..IPV6_HLEN + ICMP6_CHECK_AT + 2].copy_from_slice(&check);
}

/// [`icmp6_port_unreachable`] with its checksum field left zero (see [`tcp_reset6_unsummed`]).
pub fn icmp6_port_unreachable_unsummed(
    ip: &[u8; IPV6_HLEN],
    l4: &[u8; 8],
    out: &mut [u8; ICMP6_UNREACHABLE_LEN],
) {
    let (src, dst) = (addr(ip, 24), addr(ip, 8));
    let message_len = (ICMP6_UNREACHABLE_LEN - IPV6_HLEN) as u16;
    ipv6_header(&mut out[..IPV6_HLEN], message_len, IPPROTO_ICMPV6, &src, &dst);
    let icmp = &mut out[IPV6_HLEN..];
    icmp[..8].copy_from_slice(&[ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH, 0, 0, 0, 0, 0, 0]);
    icmp[8..8 + IPV6_HLEN].copy_from_slice(ip);
    icmp[8 + IPV6_HLEN..].copy_from_slice(l4);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{maps::IPPROTO_UDP, packet};

    const CLIENT: [u8; 16] = [0xfd, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
    const VIP: [u8; 16] = [0xfd, 0, 0x10, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x64];

    fn ip(proto: u8, payload_len: u16) -> [u8; IPV6_HLEN] {
        let mut h = [0u8; IPV6_HLEN];
        let len = payload_len.to_be_bytes();
        h[..8].copy_from_slice(&[0x60, 0x0a, 0xbc, 0xde, len[0], len[1], proto, 63]);
        h[8..24].copy_from_slice(&CLIENT);
        h[24..40].copy_from_slice(&VIP);
        h
    }

    fn valid(src: &[u8; 16], dst: &[u8; 16], proto: u8, segment: &[u8]) -> bool {
        let pseudo = checksum::pseudo_header_sum_v6(src, dst, proto, segment.len() as u32);
        checksum::is_valid(checksum::add_words(pseudo, segment))
    }

    #[test]
    fn rst_answers_a_syn_from_the_vip() {
        // sport 40000, dport 80, seq 0x01020304, SYN, window 64240.
        let syn = [0x9c, 0x40, 0, 80, 1, 2, 3, 4, 0, 0, 0, 0, 0xa0, packet::TCP_SYN, 0xfa, 0xf0, 0, 0, 0, 0];
        let mut out = [0u8; TCP_RESET6_LEN];
        tcp_reset6(&ip(IPPROTO_TCP, 40), &syn, 40, &mut out);
        let (h, t) = out.split_at(IPV6_HLEN);
        assert_eq!(&h[..8], &[0x60, 0, 0, 0, 0, 20, IPPROTO_TCP, 64], "no flow label, 20 bytes of TCP");
        assert_eq!(&h[8..24], &VIP, "from the VIP");
        assert_eq!(&h[24..40], &CLIENT, "to the client");
        assert_eq!(&t[0..4], &[0, 80, 0x9c, 0x40], "ports swapped");
        assert_eq!(&t[4..8], &[0, 0, 0, 0]);
        assert_eq!(u32::from_be_bytes([t[8], t[9], t[10], t[11]]), 0x0102_0305, "ack = seq + 1 for the SYN");
        assert_eq!(t[13], packet::TCP_RST | packet::TCP_ACK);
        assert!(valid(&VIP, &CLIENT, IPPROTO_TCP, t));
    }

    #[test]
    fn icmp6_quotes_the_datagram_and_verifies() {
        let original = ip(IPPROTO_UDP, 8 + 12);
        let udp = [0xdc, 0x14, 0, 53, 0, 20, 0x12, 0x34];
        let mut out = [0u8; ICMP6_UNREACHABLE_LEN];
        icmp6_port_unreachable(&original, &udp, &mut out);
        let (h, icmp) = out.split_at(IPV6_HLEN);
        assert_eq!(u16::from_be_bytes([h[4], h[5]]) as usize, 8 + 48);
        assert_eq!(h[6], IPPROTO_ICMPV6);
        assert_eq!(&h[8..24], &VIP);
        assert_eq!(&h[24..40], &CLIENT);
        assert_eq!(&icmp[..2], &[1, 4], "destination unreachable, port unreachable");
        assert_eq!(&icmp[4..8], &[0; 4], "unused");
        assert_eq!(&icmp[8..48], &original);
        assert_eq!(&icmp[48..56], &udp);
        assert!(valid(&VIP, &CLIENT, IPPROTO_ICMPV6, icmp));
    }
}
