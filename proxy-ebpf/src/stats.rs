use proxy_common::stats::Stat;

use crate::maps::STATS;

#[inline(always)]
pub fn count(stat: Stat) {
    count_index(stat as u32);
}

/// Counts the [`Stat`] whose discriminant is `index` (one carried in a
/// `Verdict`).
#[inline(always)]
pub fn count_index(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot, written only by this CPU.
        unsafe { *counter += 1 };
    }
}
