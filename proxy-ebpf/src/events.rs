//! `kproxy trace` events: one array lookup when nobody listens, and a full
//! ring buffer drops the event instead of slowing the packet.
use proxy_common::{
    maps::CtEntryV4,
    stats::Stat,
    trace::{EV_UNNAT, TraceEventV4},
};

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
    from_tuple((flow.saddr, flow.sport), (flow.daddr, flow.dport), flow.proto, kind, now)
}

/// [`from_flow`] for a tuple that is not the packet's own (an ICMP error's quote).
#[inline(always)]
pub fn from_tuple(
    source: ([u8; 4], [u8; 2]),
    destination: ([u8; 4], [u8; 2]),
    proto: u8,
    kind: u8,
    now: u64,
) -> Option<&'static mut TraceEventV4> {
    let event = EVENT_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry; a program runs to completion on its CPU.
    let event = unsafe { &mut *event };
    *event = TraceEventV4 {
        timestamp_ns: now,
        before_saddr: source.0,
        before_daddr: destination.0,
        before_sport: source.1,
        before_dport: destination.1,
        after_saddr: source.0,
        after_daddr: destination.0,
        after_sport: source.1,
        after_dport: destination.1,
        kind,
        proto,
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

/// An event's conntrack fields, from the flow's entry.
#[inline(always)]
pub fn set_entry(event: &mut TraceEventV4, entry: &CtEntryV4) {
    event.ct_created_ns = entry.created_ns;
    event.ct_flags = entry.flags;
    event.backend_id = entry.backend_id;
    event.rev_nat_id = entry.rev_nat_id;
}

/// A reply rewritten to come from `source` (the frontend) and go to
/// `destination` (the client, as it sent the flow).
#[inline(always)]
pub fn emit_unnat(
    flow: &Flow,
    entry: &CtEntryV4,
    source: ([u8; 4], [u8; 2]),
    destination: ([u8; 4], [u8; 2]),
    now: u64,
) {
    let Some(event) = from_flow(flow, EV_UNNAT, now) else { return };
    (event.after_saddr, event.after_sport) = source;
    (event.after_daddr, event.after_dport) = destination;
    set_entry(event, entry);
    emit(event);
}
