//! IPv6 Service lookup and backend choice, as `lb.rs` for IPv4: the same slot scheme
//! (`proxy_common::slots::select_slot`) and session affinity, in SERVICES_V6, BACKENDS_V6 and
//! AFFINITY_V6.
use aya_ebpf::{helpers::bpf_get_prandom_u32, programs::TcContext};
use proxy_common::{
    maglev::{MAGLEV_TABLE_SIZE, flow_hash6, table_index},
    maps::{
        AffinityValueV4, BACKEND_FLAG_TERMINATING, CT_FLAG_DIRECT, IPPROTO_TCP, SCOPE_INTERNAL,
        SVC_FLAG_AFFINITY, SVC_FLAG_MAGLEV, ServiceValueV4,
    },
    maps::{RevNatId, SOURCE_RANGE_ID_BITS},
    maps_v6::{AffinityKeyV6, BackendV6, CtEntryV6, ServiceKeyV6, SourceRangeV6},
    packet::{ETH_HLEN, Fragment},
    packet6::{IP6_OFF_DADDR, IPPROTO_ICMPV6, locate_upper},
    service_cidr::drops_other_protocol6,
    slots::select_slot,
    stats::Stat,
    trace::{SLOT_BY_AFFINITY, SLOT_BY_MAGLEV},
};

use crate::{
    config,
    maps::{AFFINITY_V6, BACKENDS_V6, MAGLEV_V4, SERVICE_CIDRS_V6, SERVICES_V6, SOURCE_RANGES_V6, VIPS_V6},
    parse6::Flow6,
    stats,
    verdict::Verdict,
};

/// The frontend's slot 0 for a client inside the cluster (a pod).
#[inline(always)]
pub fn lookup_frontend(flow: &Flow6) -> Option<&'static ServiceValueV4> {
    lookup_scope(flow, SCOPE_INTERNAL)
}

/// The frontend's slot 0 of `scope`.
#[inline(always)]
pub fn lookup_scope(flow: &Flow6, scope: u8) -> Option<&'static ServiceValueV4> {
    let key = ServiceKeyV6::new(flow.daddr, flow.dport, flow.proto, scope, 0);
    // SAFETY: entries are replaced whole by userspace, never freed under us for longer than the
    // RCU section this program runs in.
    unsafe { SERVICES_V6.get(key) }
}

/// Whether `client` is inside one of the frontend's IPv6 loadBalancerSourceRanges.
#[inline(always)]
pub fn source_allowed(rev_nat_id: RevNatId, client: [u8; 16]) -> bool {
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        SOURCE_RANGE_ID_BITS + 128,
        SourceRangeV6::new(rev_nat_id, client),
    );
    SOURCE_RANGES_V6.get(&key).is_some()
}

/// Whether `addr` is a Service's IPv6 cluster IP (on any port). North–south addresses have
/// entries too ([`proxy_common::maps::VipV4`]), and are none.
#[inline(always)]
pub fn is_vip(addr: &[u8; 16]) -> bool {
    // SAFETY: a word copied out at once.
    unsafe { VIPS_V6.get(addr) }.is_some_and(|entry| entry.is_cluster_ip())
}

/// Whether `addr` is inside an IPv6 service CIDR (asked only of an address that is no VIP), as
/// `lb::in_service_cidr`.
#[inline(always)]
pub fn in_service_cidr(addr: &[u8; 16]) -> bool {
    SERVICE_CIDRS_V6.get(0).is_some_and(|cidrs| cidrs.contains(addr))
}

/// Whether a packet of neither TCP nor UDP (ICMPv6 echo, SCTP, ...) goes to an address inside an
/// IPv6 service CIDR that is no VIP and opens a connection there as netfilter's conntrack sees it:
/// then it is dropped, as kube-proxy's cluster-ips-check drops it
/// ([`proxy_common::service_cidr::drops_other_protocol6`]); neighbour discovery and ICMPv6 errors
/// pass. Not inlined: called from the programs themselves, for packets `parse6::flow` left alone.
#[inline(never)]
pub fn unallocated_other_protocol(ctx: &TcContext) -> bool {
    let Ok(daddr) = ctx.load::<[u8; 16]>(ETH_HLEN + IP6_OFF_DADDR) else { return false };
    if !in_service_cidr(&daddr) || is_vip(&daddr) {
        return false;
    }
    let Ok(fixed) = ctx.load::<[u8; 8]>(ETH_HLEN) else { return false };
    let payload_len = u16::from_be_bytes([fixed[4], fixed[5]]);
    let available = (ctx.len() as usize).saturating_sub(ETH_HLEN);
    let read = |offset: usize| ctx.load::<[u8; 8]>(ETH_HLEN + offset).ok();
    let Ok(upper) = locate_upper(fixed[0], fixed[6], payload_len, available, read) else { return false };
    let icmp6_type = if upper.proto == IPPROTO_ICMPV6 && !matches!(upper.fragment, Fragment::Later) {
        // Bounded for the verifier, as parse6::flow bounds the L4 offset.
        match ctx.load::<u8>(ETH_HLEN + (upper.l4_offset & 0x7fff)) {
            Ok(icmp6_type) => Some(icmp6_type),
            Err(_) => return false,
        }
    } else {
        None
    };
    drops_other_protocol6(upper.proto, icmp6_type)
}

/// Whether a known flow stays on the backend its entry records: TCP always, UDP while its backend
/// still exists with that address (see `lb::keeps_backend`).
#[inline(always)]
pub fn keeps_backend(entry: &CtEntryV6, proto: u8) -> bool {
    if proto == IPPROTO_TCP || entry.flags & CT_FLAG_DIRECT != 0 {
        return true;
    }
    // SAFETY: as in `lookup_frontend`.
    match unsafe { BACKENDS_V6.get(entry.backend_id) } {
        Some(b) => b.addr == entry.nat_addr && b.port == entry.nat_port,
        None => false,
    }
}

/// A new flow's backend and its id. Every byte a field (it crosses frames).
#[repr(C)]
pub struct Choice6 {
    pub backend_id: u32,
    pub backend: BackendV6,
    /// The slot it was picked from, or `SLOT_BY_AFFINITY` / `SLOT_BY_MAGLEV` (as `lb::Choice`).
    pub slot: u16,
}

/// Slots searched for a sticky backend that is no longer in its hint's (as `lb::slot_of`).
const AFFINITY_SLOT_SCAN: u16 = 64;

/// The active slot of the frontend (1..=count) that holds `backend_id`, `hint` first: a sticky
/// backend must still be the frontend's own (see `lb::slot_of`).
#[inline(always)]
fn slot_of(flow: &Flow6, scope: u8, count: u16, backend_id: u32, hint: u32) -> Option<u16> {
    let holds = |slot: u16| {
        let key = ServiceKeyV6::new(flow.daddr, flow.dport, flow.proto, scope, slot);
        // SAFETY: as in `lookup_frontend`.
        unsafe { SERVICES_V6.get(key) }.is_some_and(|v| v.backend_id == backend_id)
    };
    if hint >= 1 && hint <= u32::from(count) && holds(hint as u16) {
        return Some(hint as u16);
    }
    for slot in 1..=AFFINITY_SLOT_SCAN {
        if slot > count {
            return None;
        }
        if holds(slot) {
            return Some(slot);
        }
    }
    (count > AFFINITY_SLOT_SCAN).then_some(0)
}

/// The backend for a new flow, into `choice`: the client's sticky one while its AFFINITY_V6 entry
/// is fresh and its backend still an active one of the frontend's (sessionAffinity: ClientIP, keyed
/// by the Service port's affinity id as IPv4's), otherwise one of the frontend's `count` active
/// slots with equal probability (slots past `count` hold terminating backends, which take no new
/// flow). A Maglev frontend's table (in MAGLEV_V4, whose tables serve both families) picks next, as
/// `lb::maglev_backend` does for IPv4, from the flow's [`flow_hash6`]. The internal entry's
/// slots; the work is [`select_backend_in`]'s, not inlined: a stage of its own, called from the
/// program before `new_flow`, which has no room for it.
#[inline(always)]
pub fn select_backend(
    flow: &Flow6,
    frontend: &ServiceValueV4,
    now: u64,
    choice: &mut Choice6,
) -> Result<(), Verdict> {
    select_backend_in(flow, frontend, now, choice, SCOPE_INTERNAL)
}

/// [`select_backend`] among the slots of the frontend entry of `scope` (`SCOPE_EXTERNAL`:
/// `externalTrafficPolicy: Local`'s entry of a north–south frontend, this node's endpoints only).
#[inline(never)]
pub fn select_backend_in(
    flow: &Flow6,
    frontend: &ServiceValueV4,
    now: u64,
    choice: &mut Choice6,
    scope: u8,
) -> Result<(), Verdict> {
    let affinity = frontend.flags & SVC_FLAG_AFFINITY != 0;
    let affinity_key = AffinityKeyV6 { client: flow.saddr, rev_nat_id: frontend.affinity_id() };
    if affinity && let Some(sticky) = AFFINITY_V6.get_ptr_mut(affinity_key) {
        // SAFETY: as in `lookup_frontend`; the value is ours to update.
        unsafe {
            let timeout_ns = u64::from(frontend.affinity_timeout_s) * 1_000_000_000;
            let backend_id = (*sticky).backend_id;
            if now.saturating_sub((*sticky).last_used_ns) <= timeout_ns
                && let Some(slot) = slot_of(flow, scope, frontend.count, backend_id, (*sticky).slot)
                && let Some(backend) = BACKENDS_V6.get(backend_id)
                && backend.flags & BACKEND_FLAG_TERMINATING == 0
            {
                (*sticky).last_used_ns = now;
                (*sticky).slot = u32::from(slot);
                stats::count(Stat::AffinityHit);
                choice.backend_id = backend_id;
                choice.backend = *backend;
                choice.slot = SLOT_BY_AFFINITY;
                return Ok(());
            }
        }
    }
    if frontend.flags & SVC_FLAG_MAGLEV != 0
        && let Some(table) = frontend.maglev_table()
        && maglev_backend(flow, table, choice)
    {
        return Ok(());
    }
    // SAFETY: a helper without side effects.
    let pick = unsafe { bpf_get_prandom_u32() };
    let slot = select_slot(pick, frontend.count).ok_or(Verdict::pass(Stat::NoBackend))?;
    let key = ServiceKeyV6::new(flow.daddr, flow.dport, flow.proto, scope, slot);
    // SAFETY: as in `lookup_frontend`.
    let backend_id =
        unsafe { SERVICES_V6.get(key) }.map(|v| v.backend_id).ok_or(Verdict::pass(Stat::SlotMiss))?;
    // SAFETY: as above; the value is copied out.
    let backend = unsafe { BACKENDS_V6.get(backend_id) }.copied().ok_or(Verdict::pass(Stat::SlotMiss))?;
    if affinity {
        let value = AffinityValueV4 { last_used_ns: now, backend_id, slot: u32::from(slot) };
        // A full LRU evicts an old client; a failure only costs stickiness.
        let _ = AFFINITY_V6.insert(affinity_key, value, 0);
    }
    choice.backend_id = backend_id;
    choice.backend = backend;
    choice.slot = slot;
    Ok(())
}

/// The backend Maglev table `table` gives the flow, into `choice`; false when the entry is missing or
/// its backend gone or terminating (then the slots decide).
#[inline(always)]
fn maglev_backend(flow: &Flow6, table: u32, choice: &mut Choice6) -> bool {
    let seed = config::nodeport().maglev_seed;
    let hash = flow_hash6(flow.saddr, flow.daddr, flow.sport, flow.dport, flow.proto, seed);
    let Some(index) = table
        .checked_mul(MAGLEV_TABLE_SIZE)
        .and_then(|base| base.checked_add(table_index(hash, MAGLEV_TABLE_SIZE)))
    else {
        return false;
    };
    let Some(&backend_id) = MAGLEV_V4.get(index) else { return false };
    // SAFETY: the value is copied out at once.
    let Some(backend) = (unsafe { BACKENDS_V6.get(backend_id) }).copied() else { return false };
    if backend.flags & BACKEND_FLAG_TERMINATING != 0 {
        return false;
    }
    stats::count(Stat::MaglevPick);
    choice.backend_id = backend_id;
    choice.backend = backend;
    choice.slot = SLOT_BY_MAGLEV;
    true
}
