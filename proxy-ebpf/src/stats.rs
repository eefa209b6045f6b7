use proxy_common::stats::Stat;

use crate::maps::STATS;

#[inline(always)]
pub fn count(stat: Stat) {
    if let Some(counter) = STATS.get_ptr_mut(stat as u32) {
        // SAFETY: a per-CPU slot, written only by this CPU.
        unsafe { *counter += 1 };
    }
}
