//! Source NAT of external flows: the client's address and port become a node
//! address and a port from the SNAT range, so that the backend's replies come
//! back through this node. A port is taken by inserting the reverse entry
//! with BPF_NOEXIST, which fails if another flow (on any CPU) holds it: two
//! flows never share a translation.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use proxy_common::{
    maps::{
        CT_FLAG_REMAP, CtKeyV4, SNAT_PORT_ATTEMPTS, SnatEntryV4, legacy_snat_forward_key, snat_forward_key,
        snat_port_candidate, snat_reply_key,
    },
    stats::Stat,
};

use crate::{
    config,
    maps::{CONNTRACK_V4, SNAT_V4},
    parse::Flow,
    verdict::Verdict,
};

/// Takes a port for `flow` (its original tuple is `forward_key`), sent to
/// `backend:backend_port`, as `node_addr` — a node address, or the client's
/// own when only its port is remapped — and records both directions. A port
/// whose reply tuple a conntrack entry already has is never taken. Returns
/// the port.
#[inline(always)]
pub fn allocate(
    flow: &Flow,
    forward_key: &CtKeyV4,
    backend: [u8; 4],
    backend_port: [u8; 2],
    node_addr: [u8; 4],
    now: u64,
) -> Result<[u8; 2], Verdict> {
    let (min, max) = config::nodeport().port_range();
    let to_client = SnatEntryV4 { created_ns: now, addr: flow.saddr, port: flow.sport, _pad: [0; 2] };
    for _ in 0..SNAT_PORT_ATTEMPTS {
        // SAFETY: a helper without side effects.
        let port = snat_port_candidate(unsafe { bpf_get_prandom_u32() }, min, max).to_be_bytes();
        let reverse = snat_reply_key(flow.proto, backend, backend_port, node_addr, port);
        // A port netfilter's masquerade gave a flow that is still its own
        // would send that flow's replies here.
        if CONNTRACK_V4.get_ptr(reverse).is_some() || crate::inherited::holds_reply(&reverse) {
            continue;
        }
        if SNAT_V4.insert(reverse, to_client, u64::from(BPF_NOEXIST)).is_ok() {
            let to_node = SnatEntryV4 { created_ns: now, addr: node_addr, port, _pad: [0; 2] };
            let forward = snat_forward_key(forward_key);
            if SNAT_V4.insert(forward, to_node, 0).is_err() {
                let _ = SNAT_V4.remove(reverse);
                return Err(Verdict::drop(Stat::ConntrackInsertFailed));
            }
            return Ok(port);
        }
    }
    Err(Verdict::drop(Stat::SnatPortExhausted))
}

/// The node address and port a flow sent to `backend` was translated to.
/// `flags` are the flow's: one source-NATed by a kproxy from before the
/// per-flow key may still have its translation under the legacy key (never a
/// remapped one, which did not exist then).
#[inline(always)]
pub fn forward(
    forward_key: &CtKeyV4,
    backend: [u8; 4],
    backend_port: [u8; 2],
    flags: u8,
) -> Option<SnatEntryV4> {
    forward_entry(forward_key, backend, backend_port, flags).map(|(entry, _)| entry)
}

/// [`forward`], and whether it was found under the legacy key.
#[inline(always)]
fn forward_entry(
    forward_key: &CtKeyV4,
    backend: [u8; 4],
    backend_port: [u8; 2],
    flags: u8,
) -> Option<(SnatEntryV4, bool)> {
    // SAFETY: the values are copied out at once.
    if let Some(entry) = unsafe { SNAT_V4.get(snat_forward_key(forward_key)) } {
        return Some((*entry, false));
    }
    if flags & CT_FLAG_REMAP != 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { SNAT_V4.get(legacy_snat_forward_key(forward_key, backend, backend_port)) }.map(|e| (*e, true))
}

/// The client a reply (keyed by its own tuple) goes back to.
#[inline(always)]
pub fn reverse(reply_key: &CtKeyV4) -> Option<SnatEntryV4> {
    // SAFETY: as above.
    unsafe { SNAT_V4.get(reply_key) }.copied()
}

/// Forgets both directions of a translation (`flags` as for [`forward`]).
/// The legacy key is removed only when the translation was found under it:
/// the same bytes may be another flow's own key.
#[inline(always)]
pub fn remove(forward_key: &CtKeyV4, backend: [u8; 4], backend_port: [u8; 2], flags: u8) {
    let Some((to_node, legacy)) = forward_entry(forward_key, backend, backend_port, flags) else {
        return;
    };
    let _ =
        SNAT_V4.remove(snat_reply_key(forward_key.proto, backend, backend_port, to_node.addr, to_node.port));
    if legacy {
        let _ = SNAT_V4.remove(legacy_snat_forward_key(forward_key, backend, backend_port));
    } else {
        let _ = SNAT_V4.remove(snat_forward_key(forward_key));
    }
}
