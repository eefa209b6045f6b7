//! `kproxy trace` events: one array lookup when nobody listens, and a full
//! ring buffer drops the event instead of slowing the packet. A stage emits
//! with one call; each builds the event in this CPU's scratch entry (the BPF
//! stack has no room for it in the programs that emit the most).
use aya_ebpf::programs::TcContext;
use proxy_common::{
    checksum::FourTuple6,
    icmp::Quote,
    icmp6::{QUOTE6_OFF_DADDR, QUOTE6_OFF_DPORT, QUOTE6_OFF_SADDR, QUOTE6_OFF_SPORT},
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CtEntryV4, ServiceValueV4},
    maps_v6::{CtEntryV6, CtKeyV6},
    packet::ETH_HLEN,
    packet6::{IP6_OFF_DADDR, IP6_OFF_SADDR, IPV6_HLEN},
    stats::Stat,
    trace::{EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_ICMP_UNNAT, EV_UNNAT, TraceEventV4, TraceEventV6},
};

use crate::{
    conntrack, conntrack6,
    maps::{CHOICE6_SCRATCH, EVENT_SCRATCH, EVENT_SCRATCH_V6, EVENTS, TRACE},
    parse::Flow,
    parse6::{self, Flow6},
    stats,
};

/// An address and port, in network order.
pub type Endpoint = ([u8; 4], [u8; 2]);

/// What a new flow's event tells of how its backend was chosen.
pub struct Chosen {
    pub backend_id: u32,
    /// 1-based slot the backend was picked from; `SLOT_BY_AFFINITY` or `SLOT_BY_MAGLEV` when no
    /// slot was drawn.
    pub slot: u16,
    /// Active backends of the frontend when the slot was picked.
    pub count: u16,
    pub rev_nat_id: proxy_common::maps::RevNatId,
    /// The flow's conntrack flags (hairpin, SNAT, remapped).
    pub ct_flags: u8,
}

#[inline(always)]
pub fn enabled() -> bool {
    TRACE.get(0).is_some_and(|c| c.enabled != 0)
}

/// A packet left untranslated that `kproxy trace` shows: refused
/// (`EV_REJECT`) or dropped as invalid (`EV_DROP_INVALID`), for frontend
/// `rev_nat_id` (0: it matched none, as a port the Service does not have).
#[inline(always)]
pub fn untranslated(flow: &Flow, kind: u8, rev_nat_id: proxy_common::maps::RevNatId, now: u64) {
    if let Some(event) = start_flow(flow, kind, now) {
        event.rev_nat_id = rev_nat_id;
        emit(event);
    }
}

/// A packet of a known flow, rewritten to go from `after.0` to `after.1`.
#[inline(always)]
pub fn dnat_established(flow: &Flow, after: (Endpoint, Endpoint), entry: &CtEntryV4, now: u64) {
    if let Some(event) = start_flow(flow, EV_DNAT_ESTABLISHED, now) {
        set_after(event, after);
        set_entry(event, entry);
        emit(event);
    }
}

/// The first packet of a new flow, rewritten to go from `after.0` to its
/// backend `after.1`.
#[inline(always)]
pub fn dnat_new(flow: &Flow, after: (Endpoint, Endpoint), chosen: Chosen, now: u64) {
    if let Some(event) = start_flow(flow, EV_DNAT_NEW, now) {
        set_after(event, after);
        event.ct_created_ns = now;
        event.ct_flags = chosen.ct_flags;
        event.backend_id = chosen.backend_id;
        event.backend_slot = chosen.slot;
        event.backend_count = chosen.count;
        event.rev_nat_id = chosen.rev_nat_id;
        emit(event);
    }
}

/// A reply rewritten to come from `after.0` (the frontend) and go to
/// `after.1` (the client, as it sent the flow).
#[inline(always)]
pub fn unnat(flow: &Flow, entry: &CtEntryV4, after: (Endpoint, Endpoint), now: u64) {
    if let Some(event) = start_flow(flow, EV_UNNAT, now) {
        set_after(event, after);
        set_entry(event, entry);
        emit(event);
    }
}

/// An ICMP error quoting a translated flow: the quote as it arrived, and as
/// the client gets it (from `after.0` to `after.1`).
#[inline(always)]
pub fn icmp_unnat(quote: &Quote, entry: &CtEntryV4, after: (Endpoint, Endpoint)) {
    if !enabled() {
        return;
    }
    let before = ((quote.saddr, quote.sport), (quote.daddr, quote.dport));
    if let Some(event) = start(before, quote.proto, EV_ICMP_UNNAT, conntrack::now()) {
        set_after(event, after);
        set_entry(event, entry);
        emit(event);
    }
}

/// An event whose "before" (and, until set, "after") tuple is the packet as
/// parsed; `None` when nobody listens.
#[inline(always)]
fn start_flow(flow: &Flow, kind: u8, now: u64) -> Option<&'static mut TraceEventV4> {
    if !enabled() {
        return None;
    }
    start(((flow.saddr, flow.sport), (flow.daddr, flow.dport)), flow.proto, kind, now)
}

#[inline(always)]
fn start(before: (Endpoint, Endpoint), proto: u8, kind: u8, now: u64) -> Option<&'static mut TraceEventV4> {
    let ((saddr, sport), (daddr, dport)) = before;
    let event = EVENT_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry; a program runs to completion on its CPU.
    let event = unsafe { &mut *event };
    *event = TraceEventV4 {
        timestamp_ns: now,
        before_saddr: saddr,
        before_daddr: daddr,
        before_sport: sport,
        before_dport: dport,
        after_saddr: saddr,
        after_daddr: daddr,
        after_sport: sport,
        after_dport: dport,
        kind,
        proto,
        ..Default::default()
    };
    Some(event)
}

#[inline(always)]
fn set_after(event: &mut TraceEventV4, after: (Endpoint, Endpoint)) {
    ((event.after_saddr, event.after_sport), (event.after_daddr, event.after_dport)) = after;
}

/// An event's conntrack fields, from the flow's entry.
#[inline(always)]
fn set_entry(event: &mut TraceEventV4, entry: &CtEntryV4) {
    event.ct_created_ns = entry.created_ns;
    event.ct_flags = entry.flags;
    event.backend_id = entry.backend_id;
    event.rev_nat_id = entry.rev_nat_id;
}

#[inline(always)]
fn emit<A: 'static>(event: &proxy_common::trace::TraceEvent<A>) {
    if EVENTS.output::<proxy_common::trace::TraceEvent<A>>(event, 0).is_err() {
        stats::count(Stat::TraceDropped);
    }
}

/// An IPv6 step, emitted after the stage that made it, so that the stages' frames stay as they are
/// (the IPv6 chain has no room for an event beside them): the "before" tuple is the packet as parsed
/// (`flow`, which no rewrite changes), the "after" tuple the rewritten packet itself, and the
/// conntrack fields the flow's entry's (forward for DNAT, reply for un-NAT), looked up again —
/// only while someone listens. `frontend` (null when none) is the frontend of a refusal or a new
/// flow; a new flow's backend choice is this run's CHOICE6_SCRATCH.
#[inline(always)]
pub fn step6(ctx: &TcContext, flow: &Flow6, kind: u8, frontend: *const ServiceValueV4) {
    if enabled() {
        emit6(flow, kind, frontend, |event| {
            parse6::load_into(ctx, ETH_HLEN + IP6_OFF_SADDR, &mut event.after_saddr).is_ok()
                && parse6::load_into(ctx, ETH_HLEN + IP6_OFF_DADDR, &mut event.after_daddr).is_ok()
                && (!flow.has_l4_header()
                    || parse6::load_into(ctx, flow.l4_offset, &mut event.after_sport).is_ok()
                        && parse6::load_into(ctx, flow.l4_offset + 2, &mut event.after_dport).is_ok())
        });
    }
}

/// [`step6`] for XDP, whose "after" tuple is the rewrite it made (`after`: addresses and ports as
/// in the packet).
#[inline(always)]
pub fn xdp_step6(flow: &Flow6, kind: u8, frontend: *const ServiceValueV4, after: &FourTuple6) {
    if enabled() {
        emit6(flow, kind, frontend, |event| {
            event.after_saddr.copy_from_slice(&after[..16]);
            event.after_daddr.copy_from_slice(&after[16..32]);
            event.after_sport.copy_from_slice(&after[32..34]);
            event.after_dport.copy_from_slice(&after[34..]);
            true
        });
    }
}

/// Builds and sends an IPv6 step's event; `read_after` writes its "after" tuple (false: the packet
/// could not be read, and no event goes out).
#[inline(never)]
fn emit6<F: FnOnce(&mut TraceEventV6) -> bool>(
    flow: &Flow6,
    kind: u8,
    frontend: *const ServiceValueV4,
    read_after: F,
) {
    let Some(event) = EVENT_SCRATCH_V6.get_ptr_mut(0) else { return };
    // SAFETY: this CPU's entry; a program runs to completion on its CPU.
    let event = unsafe { &mut *event };
    event.timestamp_ns = conntrack::now();
    event.ct_created_ns = 0;
    event.backend_id = 0;
    event.ifindex = 0;
    event.before_saddr = flow.saddr;
    event.before_daddr = flow.daddr;
    event.before_sport = flow.sport;
    event.before_dport = flow.dport;
    event.after_saddr = flow.saddr;
    event.after_daddr = flow.daddr;
    event.after_sport = flow.sport;
    event.after_dport = flow.dport;
    event.rev_nat_id = 0;
    event.backend_slot = 0;
    event.backend_count = 0;
    event.kind = kind;
    event.proto = flow.proto;
    event.ct_flags = 0;
    event._pad = [0; 5];
    // SAFETY: null or a map value valid for this program run.
    if let Some(frontend) = unsafe { frontend.as_ref() } {
        event.rev_nat_id = frontend.rev_nat_id;
        event.backend_count = frontend.count;
    }
    let direction = match kind {
        EV_DNAT_NEW | EV_DNAT_ESTABLISHED => CT_DIR_FORWARD,
        EV_UNNAT => CT_DIR_REPLY,
        // Refused or dropped: nothing was rewritten (and a refusal's packet is now its answer).
        _ => {
            emit(event);
            return;
        }
    };
    if !read_after(event) {
        return;
    }
    if let Some(entry) = conntrack6::lookup(&flow.ct_key(direction)) {
        // SAFETY: a map value valid for this program run, read in place.
        unsafe {
            event.ct_created_ns = (*entry).created_ns;
            event.ct_flags = (*entry).flags;
            event.backend_id = (*entry).backend_id;
            event.rev_nat_id = (*entry).rev_nat_id;
        }
    }
    if kind == EV_DNAT_NEW
        && let Some(choice) = CHOICE6_SCRATCH.get_ptr(0)
    {
        // SAFETY: this CPU's entry, set by this program run before the flow was created.
        event.backend_slot = unsafe { (*choice).slot };
    }
    emit(event);
}

/// An ICMPv6 error whose quote of a translated flow was rewritten for the client (`icmp6`), emitted
/// after the rewrite as [`step6`] is: "before" is the quote as it arrived — `quoted`, the flow's
/// reply key, is the quoted packet seen from the other side — and "after" the quote read back from
/// the packet; the conntrack fields are `entry`'s (the reply entry the quote named).
#[inline(always)]
pub fn icmp_step6(ctx: &TcContext, quoted: &CtKeyV6, entry: *const CtEntryV6) {
    if enabled() {
        emit_icmp6(ctx, quoted, entry);
    }
}

// Field by field, as `emit6`, rather than through a builder the two share: inlined into both, one
// took the egress chain's stack to 560 of its 512 bytes (the verifier of the DaemonSet's agent).
#[inline(never)]
fn emit_icmp6(ctx: &TcContext, quoted: &CtKeyV6, entry: *const CtEntryV6) {
    let Some(event) = EVENT_SCRATCH_V6.get_ptr_mut(0) else { return };
    // SAFETY: this CPU's entry; a program runs to completion on its CPU.
    let event = unsafe { &mut *event };
    event.timestamp_ns = conntrack::now();
    event.ifindex = 0;
    event.before_saddr = quoted.daddr;
    event.before_sport = quoted.dport;
    event.before_daddr = quoted.saddr;
    event.before_dport = quoted.sport;
    event.backend_slot = 0;
    event.backend_count = 0;
    event.kind = EV_ICMP_UNNAT;
    event.proto = quoted.proto;
    event._pad = [0; 5];
    // SAFETY: a map value valid for this program run, read in place.
    unsafe {
        event.ct_created_ns = (*entry).created_ns;
        event.ct_flags = (*entry).flags;
        event.backend_id = (*entry).backend_id;
        event.rev_nat_id = (*entry).rev_nat_id;
    }
    let quote = ETH_HLEN + IPV6_HLEN;
    if parse6::load_into(ctx, quote + QUOTE6_OFF_SADDR, &mut event.after_saddr).is_ok()
        && parse6::load_into(ctx, quote + QUOTE6_OFF_SPORT, &mut event.after_sport).is_ok()
        && parse6::load_into(ctx, quote + QUOTE6_OFF_DADDR, &mut event.after_daddr).is_ok()
        && parse6::load_into(ctx, quote + QUOTE6_OFF_DPORT, &mut event.after_dport).is_ok()
    {
        emit(event);
    }
}
