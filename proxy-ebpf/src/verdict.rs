//! What becomes of a packet: one [`Verdict`] for the tc and XDP programs, an
//! action and the counter it adds one to.
//!
//! A stage returns `Result<Verdict, Verdict>`: `Ok` is its own decision, `Err`
//! a stop on the way (`?` on a helper that failed, or found the packet is not
//! its to handle). tc carries either out as it is ([`finish`]). XDP has
//! rewritten nothing when a stage stops, so it leaves such a packet to tc,
//! counting why (`xdp::run`); tc then decides as it would without XDP.
//!
//! A `u32` with a niche rather than an enum with data: the stages are separate
//! functions (the 512-byte stack), so verdicts cross calls. A
//! `Result<(), Verdict>` crosses in a register, and both variants of a
//! `Result<Verdict, Verdict>` write the same bytes. The variant not taken of a
//! `Result` of data-carrying enums leaves bytes of the caller's stack
//! unwritten, and the verifier lets only CAP_PERFMON holders read those.
use core::num::NonZeroU32;

use aya_ebpf::{
    bindings::tcx_action_base::{TCX_DROP, TCX_NEXT},
    helpers::{bpf_redirect, generated::bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::stats::Stat;

use crate::{fib, stats};

/// What a program does with the packet.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// On its way, rewritten or not: to the next program in the TCX chain, or
    /// the stack (from XDP: to the stack, and so to tc).
    Next,
    /// tc: back out of the interface it came in on, to the sender's MAC
    /// (refusals and hairpin flows, which the node must not route).
    Bounce,
    /// Out of the interface of the stage's [`fib::Route`], without the stack
    /// (a source that is now a node address, which the stack refuses on input).
    Redirect,
    /// Dropped: it was partly rewritten, or must not get through.
    Drop,
}

/// An [`Action`] (bits 0–7, from 1) and a [`Stat`] to count (bits 8–31: its
/// index plus one, 0 for none).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Verdict(NonZeroU32);

impl Verdict {
    /// On its way; the stage counted what it did.
    pub const NEXT: Self = Self::new(Action::Next, None);
    pub const BOUNCE: Self = Self::new(Action::Bounce, None);
    pub const REDIRECT: Self = Self::new(Action::Redirect, None);

    /// Left as it is, counted as `stat`.
    #[inline(always)]
    pub const fn pass(stat: Stat) -> Self {
        Self::new(Action::Next, Some(stat))
    }

    /// Dropped, counted as `stat`.
    #[inline(always)]
    pub const fn drop(stat: Stat) -> Self {
        Self::new(Action::Drop, Some(stat))
    }

    #[inline(always)]
    const fn new(action: Action, stat: Option<Stat>) -> Self {
        let counter = match stat {
            Some(stat) => stat as u32 + 1,
            None => 0,
        };
        // SAFETY: the action's bits are 1 to 4.
        Self(unsafe { NonZeroU32::new_unchecked(counter << 8 | (action as u32 + 1)) })
    }

    #[inline(always)]
    pub fn action(self) -> Action {
        match self.0.get() & 0xff {
            1 => Action::Next,
            2 => Action::Bounce,
            3 => Action::Redirect,
            _ => Action::Drop,
        }
    }

    /// Adds one to the verdict's counter, if it has one.
    #[inline(always)]
    pub fn count(self) {
        let counter = self.0.get() >> 8;
        if counter != 0 {
            stats::count_index(counter - 1);
        }
    }
}

/// An early stop and a stage's own verdict end the same way in tc.
#[inline(always)]
pub fn settle(result: Result<Verdict, Verdict>) -> Verdict {
    let (Ok(verdict) | Err(verdict)) = result;
    verdict
}

/// Carries out a tc stage's verdict; `route` is where [`Action::Redirect`]
/// sends the packet (written by the stage that chose it).
#[inline(always)]
pub fn finish(ctx: &TcContext, result: Result<Verdict, Verdict>, route: &fib::Route) -> i32 {
    let verdict = settle(result);
    verdict.count();
    match verdict.action() {
        Action::Next => TCX_NEXT,
        Action::Drop => TCX_DROP,
        Action::Bounce => {
            // Back to the sender: the frame must be addressed to its MAC.
            if swap_macs(ctx).is_err() {
                stats::count(Stat::RewriteFailed);
                return TCX_DROP;
            }
            // SAFETY: a helper taking plain values.
            unsafe { bpf_redirect(fib::ingress_ifindex(ctx), 0) as i32 }
        }
        Action::Redirect => match route.neighbour_known {
            true => {
                if ctx.store(0, &route.macs, 0).is_err() {
                    stats::count(Stat::RewriteFailed);
                    return TCX_DROP;
                }
                // SAFETY: a helper taking plain values.
                unsafe { bpf_redirect(route.ifindex, 0) as i32 }
            }
            // The neighbour is not resolved yet: the kernel resolves it.
            // SAFETY: a helper taking plain values; no parameters struct.
            false => unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) as i32 },
        },
    }
}

/// Not inlined, so that its buffers have stack slots of their own: inlined,
/// they may be given the bytes of a dead local that held a pointer, which the
/// helpers may not overwrite in programs without CAP_PERFMON ("attempt to
/// corrupt spilled pointer on stack").
#[inline(never)]
fn swap_macs(ctx: &TcContext) -> Result<(), i64> {
    let macs: [u8; 12] = ctx.load(0)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0)
}
