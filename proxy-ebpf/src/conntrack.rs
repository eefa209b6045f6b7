use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_common::{
    conntrack::CtState,
    maps::{BackendV4, CT_DIR_REPLY, CtEntryV4, CtKeyV4},
    stats::Stat,
};

use crate::{Verdict, maps::CONNTRACK_V4, parse::Flow};

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: a helper without side effects.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn lookup(key: &CtKeyV4) -> Option<*mut CtEntryV4> {
    CONNTRACK_V4.get_ptr_mut(key)
}

/// Records one more packet of the flow and advances its state.
///
/// # Safety
/// `entry` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn touch(entry: *mut CtEntryV4, flow: &Flow, direction: u8, now: u64) {
    unsafe {
        (*entry).last_seen_ns = now;
        // Counters are plain adds: the BPF target has no 64-bit atomic RMW in
        // `core`, and a rare lost increment under contention is acceptable.
        (*entry).packets += 1;
        (*entry).bytes += u64::from(flow.ip_total_len);
        (*entry).tcp_flags_seen |= flow.tcp_flags;
        if direction != CT_DIR_REPLY {
            let state = CtState::from_u8((*entry).state).unwrap_or(CtState::Open);
            (*entry).state = state.next(flow.proto, flow.tcp_flags, direction) as u8;
        }
    }
}

/// Creates the reply entry, then the forward entry, so that no reply can
/// arrive for a flow whose un-NAT is not yet known.
#[inline(always)]
pub fn create(
    flow: &Flow,
    forward_key: &CtKeyV4,
    backend_id: u32,
    backend: &BackendV4,
    rev_nat_id: u16,
    now: u64,
) -> Result<(), Verdict> {
    let state = CtState::initial(flow.proto, flow.tcp_flags) as u8;
    let reply_key = forward_key.reply_of(backend.addr, backend.port);
    let reply = CtEntryV4 {
        created_ns: now,
        last_seen_ns: now,
        backend_id,
        nat_addr: flow.daddr,
        nat_port: flow.dport,
        rev_nat_id,
        state,
        ..Default::default()
    };
    CONNTRACK_V4.insert(reply_key, reply, 0).map_err(|_| Verdict::Pass(Stat::ConntrackInsertFailed))?;
    let forward = CtEntryV4 {
        packets: 1,
        bytes: u64::from(flow.ip_total_len),
        nat_addr: backend.addr,
        nat_port: backend.port,
        tcp_flags_seen: flow.tcp_flags,
        ..reply
    };
    CONNTRACK_V4.insert(forward_key, forward, 0).map_err(|_| Verdict::Pass(Stat::ConntrackInsertFailed))?;
    Ok(())
}
