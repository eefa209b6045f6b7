//! Backend selection over the slots of a frontend.

/// The slot (1-based) that a uniformly random `random` picks among `count`
/// active backends: every backend gets the same share, like kube-proxy's
/// chain of `statistic --mode random --probability 1/n, 1/(n-1), ..., 1`.
/// Returns `None` for a frontend without backends.
pub const fn select_slot(random: u32, count: u16) -> Option<u16> {
    if count == 0 {
        return None;
    }
    // Multiply-shift maps the 32-bit random value onto 0..count without the
    // bias of `%` and without a division the verifier has to check.
    Some(((random as u64 * count as u64) >> 32) as u16 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_backends_no_slot() {
        assert_eq!(select_slot(12345, 0), None);
    }

    #[test]
    fn bounds() {
        for count in 1..=64u16 {
            assert_eq!(select_slot(0, count), Some(1));
            assert_eq!(select_slot(u32::MAX, count), Some(count));
        }
    }

    #[test]
    fn every_slot_gets_an_equal_share() {
        // Equally spaced inputs over the 32-bit range: each of the n slots
        // receives exactly 1/n of them (within one, as n need not divide).
        for count in [1u16, 2, 3, 5, 7, 100] {
            let samples = 30_000u64;
            let mut hits = std::vec![0u64; usize::from(count) + 1];
            for i in 0..samples {
                let random = ((i << 32) / samples) as u32;
                hits[usize::from(select_slot(random, count).unwrap())] += 1;
            }
            assert_eq!(hits[0], 0);
            let expected = samples / u64::from(count);
            for (slot, n) in hits.iter().enumerate().skip(1) {
                assert!(n.abs_diff(expected) <= 1, "count {count} slot {slot}: {n}");
            }
        }
    }
}
