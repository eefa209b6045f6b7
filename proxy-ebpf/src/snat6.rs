//! Remapped source ports of IPv6 flows, as `snat.rs` for IPv4: a new flow whose reply tuple a live
//! translated flow already has (the client reused its source port) gets a port of the SNAT range
//! instead, its address kept (netfilter's clash resolution). SNAT_V6 holds both directions: the
//! flow's own forward key → the remapped port, and its reply key (`backend → client:remapped
//! port`) → the client's own port. A port is taken by inserting the reverse entry with
//! BPF_NOEXIST, which fails if another flow (on any CPU) holds it.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use proxy_common::{
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, SNAT_PORT_ATTEMPTS, snat_port_candidate},
    maps_v6::{CtKeyV6, SnatEntryV6},
    stats::Stat,
};

use crate::{
    config,
    maps::{CONNTRACK_V6, SNAT_V6},
    parse6::Flow6,
    verdict::Verdict,
};

/// Takes a free port of the SNAT range for `flow`, sent to `backend:backend_port`, and records both
/// directions. A port whose reply tuple a conntrack entry already has is never taken. Not
/// inlined: a stage of its own, called from the program between the clash check and the stage
/// that records the flow (its keys would not fit beside either).
#[inline(never)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: a by-value key is a copy on the stack"
)]
pub fn remap(flow: &Flow6, backend: &[u8; 16], backend_port: [u8; 2], now: u64) -> Result<[u8; 2], Verdict> {
    let (min, max) = config::nodeport().port_range();
    let mut key = CtKeyV6 {
        saddr: *backend,
        daddr: flow.saddr,
        sport: backend_port,
        dport: [0; 2],
        proto: flow.proto,
        direction: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    let mut entry = SnatEntryV6 { created_ns: now, addr: flow.saddr, port: flow.sport, _pad: [0; 6] };
    for _ in 0..SNAT_PORT_ATTEMPTS {
        // SAFETY: a helper without side effects.
        let port = snat_port_candidate(unsafe { bpf_get_prandom_u32() }, min, max).to_be_bytes();
        key.dport = port;
        if CONNTRACK_V6.get_ptr(&key).is_some() {
            continue;
        }
        if SNAT_V6.insert(&key, &entry, u64::from(BPF_NOEXIST)).is_ok() {
            let reverse_port = key.dport;
            // The forward entry, keyed by the flow's own (pre-DNAT) tuple as its conntrack entry.
            key = flow.ct_key(CT_DIR_FORWARD);
            entry.port = port;
            if SNAT_V6.insert(&key, &entry, 0).is_err() {
                key.saddr = *backend;
                key.daddr = flow.saddr;
                key.sport = backend_port;
                key.dport = reverse_port;
                key.direction = CT_DIR_REPLY;
                let _ = SNAT_V6.remove(&key);
                return Err(Verdict::drop(Stat::ConntrackInsertFailed));
            }
            return Ok(port);
        }
    }
    Err(Verdict::drop(Stat::SnatPortExhausted))
}

/// The port a remapped flow (its forward key) sends from.
#[inline(always)]
pub fn forward(forward_key: &CtKeyV6) -> Option<[u8; 2]> {
    // SAFETY: the value is copied out at once.
    unsafe { SNAT_V6.get(forward_key) }.map(|e| e.port)
}

/// The client's own port for a reply of a remapped flow (keyed by the reply's tuple).
#[inline(always)]
pub fn reverse(reply_key: &CtKeyV6) -> Option<[u8; 2]> {
    // SAFETY: as above.
    unsafe { SNAT_V6.get(reply_key) }.map(|e| e.port)
}

/// Forgets both directions of a remapped flow.
#[inline(always)]
pub fn remove(forward_key: &CtKeyV6, reply_key: &CtKeyV6) {
    let _ = SNAT_V6.remove(reply_key);
    let _ = SNAT_V6.remove(forward_key);
}
