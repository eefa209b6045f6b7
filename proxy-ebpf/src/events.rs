//! `kproxy trace` events: one array lookup when nobody listens, and a full
//! ring buffer drops the event instead of slowing the packet.
use proxy_common::{stats::Stat, trace::TraceEventV4};

use crate::{
    maps::{EVENT_SCRATCH, EVENTS, TRACE},
    parse::Flow,
    stats,
};

#[inline(always)]
pub fn enabled() -> bool {
    TRACE.get(0).is_some_and(|c| c.enabled != 0)
}

/// An event whose "before" tuple is the packet as parsed, built in this
/// CPU's scratch entry: the BPF stack has no room for it in the programs
/// that emit the most.
#[inline(always)]
pub fn from_flow(flow: &Flow, kind: u8, now: u64) -> Option<&'static mut TraceEventV4> {
    let event = EVENT_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry; a program runs to completion on its CPU.
    let event = unsafe { &mut *event };
    *event = TraceEventV4 {
        timestamp_ns: now,
        before_saddr: flow.saddr,
        before_daddr: flow.daddr,
        before_sport: flow.sport,
        before_dport: flow.dport,
        after_saddr: flow.saddr,
        after_daddr: flow.daddr,
        after_sport: flow.sport,
        after_dport: flow.dport,
        kind,
        proto: flow.proto,
        ..Default::default()
    };
    Some(event)
}

#[inline(always)]
pub fn emit(event: &TraceEventV4) {
    if EVENTS.output::<TraceEventV4>(event, 0).is_err() {
        stats::count(Stat::TraceDropped);
    }
}
