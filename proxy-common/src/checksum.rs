//! Internet checksum arithmetic (RFC 1071, incremental update per RFC 1624).
//!
//! The tc programs apply rewrites through the kernel's `bpf_l3/l4_csum_replace`
//! helpers, because only the kernel knows whether a packet carries a partial
//! (offloaded) checksum. This module is the reference those rewrites are tested
//! against, and the arithmetic the XDP path uses where no such helper exists.
//! Checksums are handled as host-order `u16` values of the big-endian field.

/// Adds `data` to `sum` as big-endian 16-bit words; an odd last byte is padded
/// with zero as RFC 1071 prescribes.
pub fn add_words(mut sum: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for word in &mut chunks {
        sum = sum.wrapping_add(u32::from(u16::from_be_bytes([word[0], word[1]])));
        sum = (sum & 0xffff) + (sum >> 16);
    }
    if let [last] = chunks.remainder() {
        sum = sum.wrapping_add(u32::from(*last) << 8);
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// Folds the carries of a one's-complement sum into 16 bits.
pub fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The checksum field value for a header or segment whose own checksum field
/// is zero.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(add_words(0, data))
}

/// The IPv4 pseudo header sum for an L4 segment of `l4_len` bytes.
pub fn pseudo_header_sum(src: [u8; 4], dst: [u8; 4], proto: u8, l4_len: u16) -> u32 {
    let mut sum = add_words(0, &src);
    sum = add_words(sum, &dst);
    sum = add_words(sum, &[0, proto]);
    add_words(sum, &l4_len.to_be_bytes())
}

/// The TCP or UDP checksum of `segment` (with its checksum field zeroed).
/// A computed UDP checksum of zero is sent as 0xffff (RFC 768).
pub fn l4_checksum(src: [u8; 4], dst: [u8; 4], proto: u8, segment: &[u8]) -> u16 {
    let sum = add_words(pseudo_header_sum(src, dst, proto, segment.len() as u16), segment);
    let check = !fold(sum);
    if proto == crate::maps::IPPROTO_UDP && check == 0 { 0xffff } else { check }
}

/// The IPv6 pseudo-header sum (RFC 8200 8.1) for an upper-layer packet of `l4_len` bytes: both
/// addresses, the length as 32 bits and the next header.
pub fn pseudo_header_sum_v6(src: &[u8; 16], dst: &[u8; 16], proto: u8, l4_len: u32) -> u32 {
    let mut sum = add_words(0, src);
    sum = add_words(sum, dst);
    sum = add_words(sum, &l4_len.to_be_bytes());
    add_words(sum, &[0, 0, 0, proto])
}

/// The TCP, UDP or ICMPv6 checksum of an IPv6 upper-layer `segment` (its checksum field zeroed).
/// A computed UDP checksum of zero is sent as 0xffff (RFC 8200 8.1: zero is not allowed).
pub fn l4_checksum_v6(src: &[u8; 16], dst: &[u8; 16], proto: u8, segment: &[u8]) -> u16 {
    let sum = add_words(pseudo_header_sum_v6(src, dst, proto, segment.len() as u32), segment);
    let check = !fold(sum);
    if proto == crate::maps::IPPROTO_UDP && check == 0 { 0xffff } else { check }
}

/// True when a header or segment including its checksum field sums to all ones.
pub fn is_valid(sum_including_field: u32) -> bool {
    fold(sum_including_field) == 0xffff
}

/// RFC 1624 equation 3: `HC' = ~(~HC + ~m + m')` for a field that changed from
/// `old` to `new` (both the same even length, aligned on a 16-bit boundary of
/// the checksummed data).
pub fn update(check: u16, old: &[u8], new: &[u8]) -> u16 {
    debug_assert_eq!(old.len(), new.len());
    let mut sum = u32::from(!check);
    let mut old_words = old.chunks_exact(2);
    for word in &mut old_words {
        sum = sum.wrapping_add(u32::from(!u16::from_be_bytes([word[0], word[1]])));
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum = add_words(sum, new);
    !fold(sum)
}

/// [`update`] for a change of one IPv4 address in a header whose checksum is `check`: fixed-size and
/// without loops, for the tc programs, which write a header's checksum and addresses in one store.
#[inline(always)]
pub fn update_addr(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let word = |b: [u8; 4], i: usize| u32::from(u16::from_be_bytes([b[i], b[i + 1]]));
    let mut sum = u32::from(!check) + (!word(old, 0) & 0xffff) + (!word(old, 2) & 0xffff);
    sum += word(new, 0) + word(new, 2);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// [`update`] for a UDP checksum: zero means "no checksum" and stays zero, and
/// an updated checksum that comes out as zero is sent as 0xffff.
pub fn update_udp(check: u16, old: &[u8], new: &[u8]) -> u16 {
    if check == 0 {
        return 0;
    }
    match update(check, old, new) {
        0 => 0xffff,
        other => other,
    }
}

/// A flow's addresses and ports as they sit in the packet: source address,
/// destination address, source port, destination port (network order).
pub type FourTuple = [u8; 12];

/// The IPv4 header and L4 checksums after the four-tuple `old` became `new`
/// (for programs without the kernel's checksum helpers, i.e. XDP). The L4
/// checksum covers the addresses through the pseudo-header; a UDP checksum of
/// zero ("none") stays zero. Both checksums must be complete ones, as on the
/// wire. Always inlined: as a BPF function its five arguments and returned
/// pair would not fit the five argument registers.
#[inline(always)]
pub fn translated(ip_check: u16, l4_check: u16, proto: u8, old: &FourTuple, new: &FourTuple) -> (u16, u16) {
    let ip = update(ip_check, &old[..8], &new[..8]);
    let l4 = if proto == crate::maps::IPPROTO_UDP {
        update_udp(l4_check, old, new)
    } else {
        update(l4_check, old, new)
    };
    (ip, l4)
}

/// A flow's addresses and ports as they sit in an IPv6 packet: source address, destination
/// address (the 32 bytes from the IPv6 header's offset 8), source port, destination port.
pub type FourTuple6 = [u8; 36];

/// The L4 checksum of an IPv6 packet after its addresses `old_addrs` (as in the header) and ports
/// `old_ports` became `new` (XDP's, which has no checksum helpers; IPv6 has no header checksum).
/// The checksum covers the addresses through the pseudo-header; a UDP checksum of zero stays
/// zero, as [`update_udp`] (a sender of one over IPv6 broke RFC 8200, and the receiver drops it
/// either way). Always inlined, as [`translated`].
#[inline(always)]
pub fn translated_v6(
    l4_check: u16,
    proto: u8,
    old_addrs: &[u8; 32],
    old_ports: &[u8; 4],
    new: &FourTuple6,
) -> u16 {
    if proto == crate::maps::IPPROTO_UDP && l4_check == 0 {
        return 0;
    }
    let check = update(update(l4_check, old_addrs, &new[..32]), old_ports, &new[32..]);
    if proto == crate::maps::IPPROTO_UDP && check == 0 { 0xffff } else { check }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// A small deterministic generator, so failures reproduce.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    #[test]
    fn rfc1071_example() {
        // The worked example of RFC 1071 section 3: words 0001 f203 f4f5 f6f7
        // sum to ddf2 (before complement).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(add_words(0, &data)), 0xddf2);
        assert_eq!(checksum(&data), !0xddf2);
    }

    #[test]
    fn known_ipv4_header() {
        // A real header (Wikipedia's IPv4 checksum example): checksum b861.
        let mut header = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01,
            0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&header), 0xb861);
        header[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert!(is_valid(add_words(0, &header)));
    }

    #[test]
    fn an_address_change_updates_the_header_checksum_as_recomputation_does() {
        let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
        for _ in 0..20_000 {
            let mut header: [u8; 20] = rng.bytes(20).try_into().unwrap();
            header[10..12].fill(0);
            let check = checksum(&header);
            let field = if rng.next().is_multiple_of(2) { 12 } else { 16 };
            let old: [u8; 4] = header[field..field + 4].try_into().unwrap();
            let new: [u8; 4] = rng.bytes(4).try_into().unwrap();
            header[field..field + 4].copy_from_slice(&new);
            let updated = update_addr(check, old, new);
            assert_eq!(updated, update(check, &old, &new));
            header[10..12].copy_from_slice(&updated.to_be_bytes());
            assert!(is_valid(add_words(0, &header)), "{header:02x?}");
        }
    }

    #[test]
    fn odd_length_is_padded() {
        assert_eq!(fold(add_words(0, &[0x12, 0x34, 0x56])), 0x1234 + 0x5600);
    }

    #[test]
    fn incremental_update_equals_recomputation_for_addresses_and_ports() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        for round in 0..20_000 {
            let proto = if round % 2 == 0 { crate::maps::IPPROTO_TCP } else { crate::maps::IPPROTO_UDP };
            let len = 8 + (rng.next() % 120) as usize;
            let src: [u8; 4] = rng.bytes(4).try_into().unwrap();
            let dst: [u8; 4] = rng.bytes(4).try_into().unwrap();
            let mut segment = rng.bytes(len);
            let check_at = if proto == crate::maps::IPPROTO_TCP { 16 } else { 6 };
            if segment.len() < check_at + 2 {
                segment.resize(check_at + 2, 0);
            }
            segment[check_at..check_at + 2].fill(0);
            let before = l4_checksum(src, dst, proto, &segment);

            // DNAT: new destination address (pseudo header) and port (segment).
            let new_dst: [u8; 4] = rng.bytes(4).try_into().unwrap();
            let new_port: [u8; 2] = rng.bytes(2).try_into().unwrap();
            let old_port = [segment[2], segment[3]];
            let mut updated = update(before, &dst, &new_dst);
            updated = update(updated, &old_port, &new_port);
            if proto == crate::maps::IPPROTO_UDP && updated == 0 {
                updated = 0xffff;
            }

            segment[2..4].copy_from_slice(&new_port);
            let recomputed = l4_checksum(src, new_dst, proto, &segment);
            // 0x0000 and 0xffff are the same one's-complement value; both
            // verify, so compare by verification and by value modulo that.
            let norm = |c: u16| if c == 0xffff { 0 } else { c };
            assert_eq!(norm(updated), norm(recomputed), "round {round}");
            segment[check_at..check_at + 2].copy_from_slice(&updated.to_be_bytes());
            let sum = add_words(pseudo_header_sum(src, new_dst, proto, segment.len() as u16), &segment);
            assert!(is_valid(sum), "round {round}: updated checksum does not verify");
        }
    }

    #[test]
    fn ipv4_header_update_equals_recomputation() {
        let mut rng = XorShift(42);
        for _ in 0..10_000 {
            let mut header = rng.bytes(20);
            header[0] = 0x45;
            header[10..12].fill(0);
            let check = checksum(&header);
            let new_dst: [u8; 4] = rng.bytes(4).try_into().unwrap();
            let updated = update(check, &header[16..20], &new_dst);
            header[16..20].copy_from_slice(&new_dst);
            assert_eq!(updated, checksum(&header));
        }
    }

    #[test]
    fn ipv6_pseudo_header_counts_both_addresses_length_and_next_header() {
        // RFC 8200's pseudo-header, summed word by word by hand.
        let mut src = [0u8; 16];
        src[0] = 0xfd;
        src[15] = 1;
        let mut dst = [0u8; 16];
        dst[0] = 0xfd;
        dst[15] = 2;
        // fd00 ... 0001, fd00 ... 0002, the length 0000 0010, then 0000 0011 (UDP).
        let want = 0xfd00 + 0x0001 + 0xfd00 + 0x0002 + 0x0010 + 0x0011;
        assert_eq!(fold(pseudo_header_sum_v6(&src, &dst, crate::maps::IPPROTO_UDP, 16)), fold(want));
        let segment = [0x9c, 0x40, 0, 53, 0, 16, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let check = l4_checksum_v6(&src, &dst, crate::maps::IPPROTO_UDP, &segment);
        let mut with = segment;
        with[6..8].copy_from_slice(&check.to_be_bytes());
        assert!(is_valid(add_words(pseudo_header_sum_v6(&src, &dst, 17, 16), &with)));
    }

    #[test]
    fn udp_zero_checksum_stays_zero() {
        assert_eq!(update_udp(0, &[1, 2, 3, 4], &[5, 6, 7, 8]), 0);
    }

    #[test]
    fn udp_update_never_yields_zero() {
        // Pick a change that makes the plain update come out as zero.
        let check = 0x1234u16;
        let old = [0x00, 0x00];
        // ~(~check + ~old + new) == 0  <=>  ~check + 0xffff + new == 0xffff
        let new = check.to_be_bytes();
        assert_eq!(update(check, &old, &new), 0);
        assert_eq!(update_udp(check, &old, &new), 0xffff);
    }

    /// A TCP or UDP packet (IPv4 header + L4) with correct checksums.
    fn packet(proto: u8, tuple: &FourTuple, payload: &[u8]) -> Vec<u8> {
        let l4_len = if proto == crate::maps::IPPROTO_UDP { 8 } else { 20 };
        let total = 20 + l4_len + payload.len();
        let mut p = Vec::new();
        p.extend_from_slice(&[0x45, 0, (total >> 8) as u8, total as u8, 0, 1, 0x40, 0, 64, proto, 0, 0]);
        p.extend_from_slice(&tuple[..8]);
        p.extend_from_slice(&tuple[8..12]);
        if proto == crate::maps::IPPROTO_UDP {
            let len = (8 + payload.len()) as u16;
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&[0, 0]);
        } else {
            p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x12, 0xff, 0xff, 0, 0, 0, 0]);
        }
        p.extend_from_slice(payload);
        let ip = checksum(&p[..20]);
        p[10..12].copy_from_slice(&ip.to_be_bytes());
        let off = if proto == crate::maps::IPPROTO_UDP { 26 } else { 36 };
        let l4 =
            l4_checksum(tuple[..4].try_into().unwrap(), tuple[4..8].try_into().unwrap(), proto, &p[20..]);
        p[off..off + 2].copy_from_slice(&l4.to_be_bytes());
        p
    }

    #[test]
    fn translated_checksums_equal_recomputed_ones() {
        let mut rng = XorShift(0x5eed);
        for proto in [crate::maps::IPPROTO_TCP, crate::maps::IPPROTO_UDP] {
            for _ in 0..500 {
                let mut old = [0u8; 12];
                let mut new = [0u8; 12];
                old.iter_mut().chain(new.iter_mut()).for_each(|b| *b = rng.next() as u8);
                let payload: Vec<u8> = (0..(rng.next() % 40)).map(|_| rng.next() as u8).collect();
                let before = packet(proto, &old, &payload);
                let after = packet(proto, &new, &payload);
                let off = if proto == crate::maps::IPPROTO_UDP { 26 } else { 36 };
                let read = |p: &[u8], at: usize| u16::from_be_bytes([p[at], p[at + 1]]);
                let (ip, l4) = translated(read(&before, 10), read(&before, off), proto, &old, &new);
                assert_eq!(ip, read(&after, 10), "IP checksum");
                // 0 and 0xffff are the same one's-complement value; UDP sends 0xffff.
                let want = read(&after, off);
                assert!(
                    l4 == want || (l4 == 0xffff && want == 0) || (l4 == 0 && want == 0xffff),
                    "{proto}: {l4:#x} vs {want:#x}"
                );
            }
        }
    }

    #[test]
    fn udp_without_checksum_stays_without() {
        let (_, l4) = translated(0x1234, 0, crate::maps::IPPROTO_UDP, &[1; 12], &[2; 12]);
        assert_eq!(l4, 0);
    }

    #[test]
    fn an_ipv6_four_tuple_change_updates_the_l4_checksum_as_recomputation_does() {
        let mut rng = XorShift(0x51_7cc1_b727_220a);
        let norm = |c: u16| if c == 0xffff { 0 } else { c };
        for round in 0..20_000 {
            let proto = if round % 2 == 0 { crate::maps::IPPROTO_TCP } else { crate::maps::IPPROTO_UDP };
            let check_at = if proto == crate::maps::IPPROTO_TCP { 16 } else { 6 };
            let extra = (rng.next() % 100) as usize;
            let mut segment = rng.bytes(check_at + 2 + extra);
            segment[check_at..check_at + 2].fill(0);
            let addrs: [u8; 32] = rng.bytes(32).try_into().unwrap();
            let (src, dst): ([u8; 16], [u8; 16]) =
                (addrs[..16].try_into().unwrap(), addrs[16..].try_into().unwrap());
            let before = l4_checksum_v6(&src, &dst, proto, &segment);
            let ports: [u8; 4] = segment[..4].try_into().unwrap();
            let new: FourTuple6 = rng.bytes(36).try_into().unwrap();
            let updated = translated_v6(before, proto, &addrs, &ports, &new);

            segment[..4].copy_from_slice(&new[32..]);
            let (new_src, new_dst): ([u8; 16], [u8; 16]) =
                (new[..16].try_into().unwrap(), new[16..32].try_into().unwrap());
            segment[check_at..check_at + 2].fill(0);
            let recomputed = l4_checksum_v6(&new_src, &new_dst, proto, &segment);
            assert_eq!(norm(updated), norm(recomputed), "round {round}");
            if proto == crate::maps::IPPROTO_UDP {
                assert_ne!(
                    updated, 0,
                    "round {round}: a UDP checksum that comes out as zero is sent as 0xffff"
                );
            }
            segment[check_at..check_at + 2].copy_from_slice(&updated.to_be_bytes());
            let sum =
                add_words(pseudo_header_sum_v6(&new_src, &new_dst, proto, segment.len() as u32), &segment);
            assert!(is_valid(sum), "round {round}: the updated checksum does not verify");
        }
        assert_eq!(
            translated_v6(0, crate::maps::IPPROTO_UDP, &[1; 32], &[2; 4], &[3; 36]),
            0,
            "no checksum stays none"
        );
        // A sum that comes out as zero: 0xffff with the tuple unchanged. TCP sends 0, UDP 0xffff.
        let same: FourTuple6 = core::array::from_fn(|i| i as u8);
        let (addrs, ports) = (same[..32].try_into().unwrap(), same[32..].try_into().unwrap());
        assert_eq!(translated_v6(0xffff, crate::maps::IPPROTO_TCP, &addrs, &ports, &same), 0);
        assert_eq!(translated_v6(0xffff, crate::maps::IPPROTO_UDP, &addrs, &ports, &same), 0xffff);
    }
}
