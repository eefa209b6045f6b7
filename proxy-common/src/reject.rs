//! The packets kproxy answers with when a Service cannot take a connection:
//! a TCP RST for TCP and an ICMP port unreachable for UDP, so the client
//! sees "connection refused" at once instead of a timeout (what kube-proxy's
//! `REJECT` rules do). Built from the offending packet's headers; the kernel
//! program writes them back over the packet and returns it to the sender.

use crate::{checksum, maps::IPPROTO_TCP, packet};

/// ICMP protocol number.
pub const IPPROTO_ICMP: u8 = 1;
/// Bytes of the reply after the Ethernet header.
pub const TCP_RESET_LEN: usize = 40;
pub const ICMP_UNREACHABLE_LEN: usize = 56;

const IPTOS_PREC_INTERNETCONTROL: u8 = 0xc0;
const TTL: u8 = 64;

/// Whether a refusal may answer a packet from `source` sent to the link-layer
/// address whose first octet is `dest_mac_first`. RFC 1122 never answers a
/// packet whose source names no single host — 0.0.0.0/8 ("this network"),
/// 127.0.0.0/8 (loopback), 224.0.0.0/4 (multicast), 240.0.0.0/4 (reserved,
/// and the limited broadcast 255.255.255.255) — nor one sent to a link-layer
/// group (3.2.2 for ICMP errors, 4.2.3.10 for TCP): an answer would go to a
/// group, to nobody, or back to the node itself, and a forged source would
/// turn each refusal into a broadcast. The kernel's `icmp_send` and TCP reset
/// path refuse the same (and never forward a frame sent to a group, so
/// kube-proxy's REJECT rules never see one). A subnet's directed broadcast
/// cannot be told from a host by its address alone; the kernel does not
/// answer it either, but it is not known here.
pub fn may_refuse(dest_mac_first: u8, source: [u8; 4]) -> bool {
    let link_layer_group = dest_mac_first & 0x01 != 0;
    let one_host = !matches!(source[0], 0 | 127 | 224..=255);
    one_host && !link_layer_group
}

fn ipv4_header(tos: u8, total_len: u16, df: bool, proto: u8, src: [u8; 4], dst: [u8; 4]) -> [u8; 20] {
    let len = total_len.to_be_bytes();
    let frag = if df { 0x40 } else { 0 };
    let mut h = [
        0x45, tos, len[0], len[1], 0, 0, frag, 0, TTL, proto, 0, 0, src[0], src[1], src[2], src[3], dst[0],
        dst[1], dst[2], dst[3],
    ];
    let check = checksum::checksum(&h).to_be_bytes();
    h[10] = check[0];
    h[11] = check[1];
    h
}

fn addr(ip: &[u8; 20], at: usize) -> [u8; 4] {
    [ip[at], ip[at + 1], ip[at + 2], ip[at + 3]]
}

/// The TCP header (checksum zero) of the RST that answers the segment whose TCP header is `tcp`
/// (its first 20 bytes), `segment_len` being the TCP header plus payload length as received.
/// RFC 793: a segment with ACK gets `seq = its ack`; one without gets `seq = 0, ack = its seq + its
/// length` (SYN and FIN count one). Shared by both address families.
pub fn reset_segment(tcp: &[u8; 20], segment_len: u16) -> [u8; 20] {
    let flags_in = tcp[13];
    let header_len = u16::from(tcp[12] >> 4) * 4;
    let payload = u32::from(segment_len.saturating_sub(header_len));
    let seq_in = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let (seq, ack, flags) = if flags_in & packet::TCP_ACK != 0 {
        ([tcp[8], tcp[9], tcp[10], tcp[11]], 0u32, packet::TCP_RST)
    } else {
        let syn_fin = u32::from(flags_in & packet::TCP_SYN != 0) + u32::from(flags_in & packet::TCP_FIN != 0);
        ([0; 4], seq_in.wrapping_add(payload).wrapping_add(syn_fin), packet::TCP_RST | packet::TCP_ACK)
    };
    let ack = ack.to_be_bytes();
    [
        tcp[2],
        tcp[3],
        tcp[0],
        tcp[1],
        seq[0],
        seq[1],
        seq[2],
        seq[3],
        ack[0],
        ack[1],
        ack[2],
        ack[3],
        5 << 4,
        flags,
        0,
        0,
        0,
        0,
        0,
        0,
    ]
}

/// IPv4 + TCP headers of the RST that answers the segment with IPv4 header
/// `ip` (20 bytes, no options) and TCP header `tcp` (its first 20 bytes),
/// `segment_len` being the TCP header plus payload length as received
/// ([`reset_segment`]).
pub fn tcp_reset(ip: &[u8; 20], tcp: &[u8; 20], segment_len: u16) -> [u8; TCP_RESET_LEN] {
    let (src, dst) = (addr(ip, 16), addr(ip, 12));
    let mut segment = reset_segment(tcp, segment_len);
    let check = checksum::l4_checksum(src, dst, IPPROTO_TCP, &segment).to_be_bytes();
    segment[16] = check[0];
    segment[17] = check[1];
    let header = ipv4_header(0, TCP_RESET_LEN as u16, true, IPPROTO_TCP, src, dst);
    let mut out = [0u8; TCP_RESET_LEN];
    out[..20].copy_from_slice(&header);
    out[20..].copy_from_slice(&segment);
    out
}

/// IPv4 + ICMP "destination unreachable, port unreachable" quoting the
/// offending datagram's IPv4 header `ip` (20 bytes, no options) and the first
/// 8 bytes of its UDP header, sent from the address it was sent to.
pub fn icmp_port_unreachable(ip: &[u8; 20], l4: &[u8; 8]) -> [u8; ICMP_UNREACHABLE_LEN] {
    let (src, dst) = (addr(ip, 16), addr(ip, 12));
    let mut icmp = [0u8; 36];
    icmp[0] = 3; // destination unreachable
    icmp[1] = 3; // port unreachable
    icmp[8..28].copy_from_slice(ip);
    icmp[28..36].copy_from_slice(l4);
    let check = checksum::checksum(&icmp).to_be_bytes();
    icmp[2] = check[0];
    icmp[3] = check[1];
    let header =
        ipv4_header(IPTOS_PREC_INTERNETCONTROL, ICMP_UNREACHABLE_LEN as u16, false, IPPROTO_ICMP, src, dst);
    let mut out = [0u8; ICMP_UNREACHABLE_LEN];
    out[..20].copy_from_slice(&header);
    out[20..].copy_from_slice(&icmp);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::IPPROTO_UDP;

    fn ip(proto: u8, total: u16) -> [u8; 20] {
        let t = total.to_be_bytes();
        let mut h =
            [0x45, 0, t[0], t[1], 0x1c, 0x46, 0x40, 0, 64, proto, 0, 0, 10, 244, 0, 2, 10, 96, 0, 100];
        let c = checksum::checksum(&h).to_be_bytes();
        h[10] = c[0];
        h[11] = c[1];
        h
    }

    fn syn() -> [u8; 20] {
        // sport 40000, dport 80, seq 0x01020304, SYN, window 64240.
        [0x9c, 0x40, 0, 80, 1, 2, 3, 4, 0, 0, 0, 0, 0xa0, packet::TCP_SYN, 0xfa, 0xf0, 0, 0, 0, 0]
    }

    #[test]
    fn rst_answers_a_syn_from_the_vip() {
        let out = tcp_reset(&ip(IPPROTO_TCP, 60), &syn(), 40);
        let (h, t) = out.split_at(20);
        assert_eq!(h[0], 0x45);
        assert_eq!(u16::from_be_bytes([h[2], h[3]]), 40);
        assert_eq!(h[9], IPPROTO_TCP);
        assert_eq!(&h[12..16], &[10, 96, 0, 100], "from the VIP");
        assert_eq!(&h[16..20], &[10, 244, 0, 2], "to the client");
        assert!(checksum::is_valid(checksum::add_words(0, h)));
        assert_eq!(&t[0..4], &[0, 80, 0x9c, 0x40], "ports swapped");
        assert_eq!(&t[4..8], &[0, 0, 0, 0], "seq 0 when the SYN had no ACK");
        assert_eq!(u32::from_be_bytes([t[8], t[9], t[10], t[11]]), 0x0102_0305, "ack = seq + 1 for the SYN");
        assert_eq!(t[12], 0x50);
        assert_eq!(t[13], packet::TCP_RST | packet::TCP_ACK);
        let sum = checksum::add_words(
            checksum::pseudo_header_sum([10, 96, 0, 100], [10, 244, 0, 2], IPPROTO_TCP, 20),
            t,
        );
        assert!(checksum::is_valid(sum));
    }

    #[test]
    fn rst_answers_an_ack_with_its_ack_number() {
        let mut seg = syn();
        seg[12] = 0x50;
        seg[13] = packet::TCP_ACK | 0x08;
        seg[8..12].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        let out = tcp_reset(&ip(IPPROTO_TCP, 20 + 20 + 100), &seg, 120);
        assert_eq!(&out[24..28], &0xdead_beefu32.to_be_bytes());
        assert_eq!(&out[28..32], &[0, 0, 0, 0]);
        assert_eq!(out[33], packet::TCP_RST);
    }

    #[test]
    fn rst_counts_payload_and_fin() {
        let mut seg = syn();
        seg[12] = 0x50;
        seg[13] = packet::TCP_FIN;
        let out = tcp_reset(&ip(IPPROTO_TCP, 20 + 20 + 10), &seg, 30);
        assert_eq!(u32::from_be_bytes([out[28], out[29], out[30], out[31]]), 0x0102_0304 + 10 + 1);
    }

    #[test]
    fn refusals_answer_single_hosts_only() {
        let unicast_mac = 0x02;
        for source in [
            [0, 0, 0, 0],
            [0, 255, 255, 255],
            [127, 0, 0, 1],
            [127, 255, 255, 255],
            [224, 0, 0, 1],
            [239, 255, 255, 255],
            [240, 0, 0, 0],
            [254, 1, 2, 3],
            [255, 255, 255, 255],
        ] {
            assert!(!may_refuse(unicast_mac, source), "{source:?}");
        }
        for source in
            [[1, 0, 0, 0], [10, 244, 0, 2], [126, 255, 255, 255], [128, 0, 0, 0], [223, 255, 255, 255]]
        {
            assert!(may_refuse(unicast_mac, source), "{source:?}");
        }
    }

    #[test]
    fn refusals_never_answer_frames_sent_to_a_link_layer_group() {
        let client = [10, 244, 0, 2];
        // Broadcast, IPv4 and IPv6 multicast MACs have the group bit set; unicast ones do not.
        for group in [0xff, 0x01, 0x33] {
            assert!(!may_refuse(group, client), "{group:#04x}");
        }
        for unicast in [0x00, 0x02, 0x52, 0xfe] {
            assert!(may_refuse(unicast, client), "{unicast:#04x}");
        }
    }

    #[test]
    fn icmp_quotes_the_datagram_and_verifies() {
        let original = ip(IPPROTO_UDP, 28 + 12);
        let udp = [0xdc, 0x14, 0, 53, 0, 20, 0x12, 0x34];
        let out = icmp_port_unreachable(&original, &udp);
        assert_eq!(u16::from_be_bytes([out[2], out[3]]), 56);
        assert_eq!(out[1], 0xc0);
        assert_eq!(out[9], IPPROTO_ICMP);
        assert_eq!(&out[12..16], &[10, 96, 0, 100]);
        assert_eq!(&out[16..20], &[10, 244, 0, 2]);
        assert!(checksum::is_valid(checksum::add_words(0, &out[..20])));
        assert_eq!(&out[20..22], &[3, 3]);
        assert_eq!(&out[28..48], &original);
        assert_eq!(&out[48..56], &udp);
        assert!(checksum::is_valid(checksum::add_words(0, &out[20..])));
    }
}
