//! How a tc program ends: what its stages decided ([`Done`], or [`Verdict`]
//! when they stopped early), carried out by [`finish`].
use aya_ebpf::{
    helpers::{bpf_redirect, generated::bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::stats::Stat;

use crate::{fib, stats};

/// Let the next program in the TCX chain (or the stack) have the packet.
const TC_NEXT: i32 = -1;
const TC_DROP: i32 = 2;

/// What to do with a packet the program handled.
pub enum Done {
    /// Continue on its way (rewritten or not).
    Next,
    /// Send it back out of the interface it came in on (reject replies and
    /// hairpin flows, which must not be routed by the node).
    Bounce,
    /// Send it out of this interface without the stack (its source is now a
    /// node address, which the stack refuses on input).
    Redirect(fib::Route),
}

/// Why a program stopped early.
pub enum Verdict {
    /// Leave the packet as it is.
    Pass(Stat),
    /// Drop the packet: it was partly rewritten, or must not get through.
    Drop(Stat),
}

#[inline(always)]
pub fn finish(ctx: &TcContext, result: Result<Done, Verdict>) -> i32 {
    match result {
        Ok(Done::Next) => TC_NEXT,
        Ok(Done::Bounce) => {
            // Back to the sender: the frame must be addressed to its MAC.
            if swap_macs(ctx).is_err() {
                stats::count(Stat::RewriteFailed);
                return TC_DROP;
            }
            // SAFETY: reading the context field the kernel filled in.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            // SAFETY: a helper taking plain values.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        Ok(Done::Redirect(route)) => match route.neighbour_known {
            true => {
                if ctx.store(0, &route.macs, 0).is_err() {
                    stats::count(Stat::RewriteFailed);
                    return TC_DROP;
                }
                // SAFETY: a helper taking plain values.
                unsafe { bpf_redirect(route.ifindex, 0) as i32 }
            }
            // The neighbour is not resolved yet: the kernel resolves it.
            // SAFETY: a helper taking plain values; no parameters struct.
            false => unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) as i32 },
        },
        Err(Verdict::Pass(stat)) => {
            stats::count(stat);
            TC_NEXT
        }
        Err(Verdict::Drop(stat)) => {
            stats::count(stat);
            TC_DROP
        }
    }
}

#[inline(always)]
fn swap_macs(ctx: &TcContext) -> Result<(), i64> {
    let macs: [u8; 12] = ctx.load(0)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0)
}
