use proxy_common::stats::Stat;

use crate::maps::STATS;

#[inline(always)]
pub fn count(stat: Stat) {
    count_index(stat as u32);
}

/// Counts the [`Stat`] whose discriminant is `index` (one carried in a
/// `Verdict`).
///
/// Not inlined, so that the map key has a stack slot of its own: inlined, it
/// may be given the bytes of a struct that held a pointer (LLVM reuses the
/// memory of dead locals), and the verifier refuses a partial overwrite of a
/// pointer to programs without CAP_PERFMON ("attempt to corrupt spilled
/// pointer on stack").
#[inline(never)]
pub fn count_index(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot, written only by this CPU.
        unsafe { *counter += 1 };
    }
}
