use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    maps::{BackendV4, SCOPE_CLUSTER_IP, ServiceKeyV4, ServiceValueV4},
    slots::select_slot,
    stats::Stat,
};

use crate::{Verdict, maps::BACKENDS_V4, maps::SERVICES_V4, parse::Flow};

#[inline(always)]
pub fn lookup_frontend(flow: &Flow) -> Option<&'static ServiceValueV4> {
    let key = ServiceKeyV4::new(flow.daddr, flow.dport, flow.proto, SCOPE_CLUSTER_IP, 0);
    // SAFETY: entries are replaced whole by userspace, never freed under us
    // for longer than the RCU section this program runs in.
    unsafe { SERVICES_V4.get(key) }
}

/// Picks one of the frontend's active backends with equal probability.
#[inline(always)]
pub fn select_backend(flow: &Flow, frontend: &ServiceValueV4) -> Result<(u32, BackendV4), Verdict> {
    // SAFETY: a helper without side effects.
    let random = unsafe { bpf_get_prandom_u32() };
    let slot = select_slot(random, frontend.count).ok_or(Verdict::Pass(Stat::NoBackend))?;
    let key = ServiceKeyV4::new(flow.daddr, flow.dport, flow.proto, SCOPE_CLUSTER_IP, slot);
    // SAFETY: as in `lookup_frontend`.
    let backend_id =
        unsafe { SERVICES_V4.get(key) }.map(|v| v.backend_id).ok_or(Verdict::Pass(Stat::SlotMiss))?;
    // SAFETY: as above; the value is copied out.
    let backend = unsafe { BACKENDS_V4.get(backend_id) }.copied().ok_or(Verdict::Pass(Stat::SlotMiss))?;
    Ok((backend_id, backend))
}
