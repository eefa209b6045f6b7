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
}
