//! IPv6 Service lookup and backend choice, as `lb.rs` for IPv4: the same slot scheme
//! (`proxy_common::slots::select_slot`), in SERVICES_V6 and BACKENDS_V6.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    maps::{CT_FLAG_DIRECT, IPPROTO_TCP, SCOPE_INTERNAL, ServiceValueV4},
    maps_v6::{BackendV6, CtEntryV6, ServiceKeyV6},
    slots::select_slot,
    stats::Stat,
};

use crate::{
    maps::{BACKENDS_V6, SERVICES_V6, VIPS_V6},
    parse6::Flow6,
    verdict::Verdict,
};

/// The frontend's slot 0 for a client inside the cluster (a pod).
#[inline(always)]
pub fn lookup_frontend(flow: &Flow6) -> Option<&'static ServiceValueV4> {
    let key = ServiceKeyV6::new(flow.daddr, flow.dport, flow.proto, SCOPE_INTERNAL, 0);
    // SAFETY: entries are replaced whole by userspace, never freed under us for longer than the
    // RCU section this program runs in.
    unsafe { SERVICES_V6.get(key) }
}

/// Whether `addr` is a Service's IPv6 cluster IP (on any port).
#[inline(always)]
pub fn is_vip(addr: &[u8; 16]) -> bool {
    VIPS_V6.get_ptr(addr).is_some()
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

/// The backend a new flow is sent to and its id: one of the frontend's `count` active slots with
/// equal probability (slots past `count` hold terminating backends, which take no new flow).
/// Session affinity and Maglev are IPv4's only for now: such a frontend gets a random pick.
#[inline(always)]
pub fn select_backend(flow: &Flow6, frontend: &ServiceValueV4) -> Result<(u32, BackendV6), Verdict> {
    // SAFETY: a helper without side effects.
    let pick = unsafe { bpf_get_prandom_u32() };
    let slot = select_slot(pick, frontend.count).ok_or(Verdict::pass(Stat::NoBackend))?;
    let key = ServiceKeyV6::new(flow.daddr, flow.dport, flow.proto, SCOPE_INTERNAL, slot);
    // SAFETY: as in `lookup_frontend`.
    let backend_id =
        unsafe { SERVICES_V6.get(key) }.map(|v| v.backend_id).ok_or(Verdict::pass(Stat::SlotMiss))?;
    // SAFETY: as above; the value is copied out.
    let backend = unsafe { BACKENDS_V6.get(backend_id) }.copied().ok_or(Verdict::pass(Stat::SlotMiss))?;
    Ok((backend_id, backend))
}
