//! `kproxy trace` events: one array lookup when nobody listens, and a full
//! ring buffer drops the event instead of slowing the packet.
use proxy_common::{stats::Stat, trace::TraceEventV4};

use crate::{
    maps::{EVENTS, TRACE},
    parse::Flow,
    stats,
};

#[inline(always)]
pub fn enabled() -> bool {
    TRACE.get(0).is_some_and(|c| c.enabled != 0)
}

/// An event whose "before" tuple is the packet as parsed.
#[inline(always)]
pub fn from_flow(flow: &Flow, kind: u8, now: u64) -> TraceEventV4 {
    TraceEventV4 {
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
    }
}

#[inline(always)]
pub fn emit(event: &TraceEventV4) {
    if EVENTS.output::<TraceEventV4>(event, 0).is_err() {
        stats::count(Stat::TraceDropped);
    }
}
