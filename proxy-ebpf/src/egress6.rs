//! The IPv6 path of `kproxy_egress` (packets entering a pod): a reply of a translated flow comes
//! from the Service again, found by its reply entry; anything else (a reply of a flow kproxy never
//! translated, neighbour discovery and other ICMPv6) is left untouched, but for ICMPv6 errors
//! about translated flows, un-NATed for the client (`icmp6`). A chain of its own, as
//! `ingress6`.
use aya_ebpf::programs::TcContext;
use proxy_common::{
    maps::{CT_DIR_REPLY, CT_FLAG_DIRECT, CT_FLAG_REMAP},
    stats::Stat,
    trace::EV_UNNAT,
};

use crate::{
    conntrack, conntrack6, events, fib, icmp6,
    maps::FLOW6_SCRATCH,
    nat6,
    parse6::{self, Flow6},
    snat6, stats,
    verdict::{Verdict, finish},
};

#[inline(never)]
pub fn run(ctx: &TcContext) -> i32 {
    finish(ctx, egress(ctx), &fib::Route::NONE)
}

#[inline(always)]
fn egress(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let flow = FLOW6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    match parse6::flow(ctx, flow) {
        Ok(()) => unnat(ctx, flow).inspect(|_| events::step6(ctx, flow, EV_UNNAT, core::ptr::null())),
        Err(Stat::PassNotTcpUdp) => icmp6::unnat_error(ctx),
        Err(stat) => Err(Verdict::pass(stat)),
    }
}

/// A reply of a translated flow: its source back to the Service, and for a flow whose source port
/// was remapped (port reuse) its destination port back to the client's own (SNAT_V6) — the only
/// change for a direct flow, which no Service translated. Not inlined: a stage of its own beside
/// `parse6::flow`, as both would not fit on the stack together.
#[inline(never)]
fn unnat(ctx: &TcContext, flow: &Flow6) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    // SAFETY: a map value valid for this program run.
    let flags = unsafe { (*entry).flags };
    let client_port = if flags & CT_FLAG_REMAP != 0 {
        snat6::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?
    } else {
        flow.dport
    };
    let now = conntrack::now();
    // SAFETY: a map value valid for this program run, read in place (see `conntrack6::expired`).
    let (vip, vip_port) = unsafe {
        conntrack6::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack6::track_reply(
            entry,
            flow,
            &(flow.daddr, client_port),
            &((*entry).nat_addr, (*entry).nat_port),
        );
        (&(*entry).nat_addr, (*entry).nat_port)
    };
    nat6::rewrite_source(ctx, flow, vip, vip_port)?;
    nat6::rewrite_destination_port(ctx, flow, client_port)?;
    if flags & CT_FLAG_DIRECT == 0 {
        stats::count(Stat::ReverseNat);
    }
    Ok(Verdict::NEXT)
}
