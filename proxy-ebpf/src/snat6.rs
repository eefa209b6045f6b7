//! Rewritten client tuples of IPv6 flows, as `snat.rs` for IPv4: a new flow whose reply tuple a live
//! translated flow already has (the client reused its source port) gets a port of the SNAT range
//! instead, its address kept (netfilter's clash resolution); a north–south flow to a remote
//! backend becomes the node's address and a port of that range (source NAT). SNAT_V6 holds both
//! directions: the flow's own forward key → the address and port it became, and its reply key
//! (`backend → that address:port`) → the client's own address and port. A port is taken by
//! inserting the reverse entry with BPF_NOEXIST, which fails if another flow (on any CPU) holds it.
//!
//! The search over candidate ports runs in `bpf_loop`, one attempt per callback call, rather than
//! as a loop in the program: without CAP_PERFMON (the DaemonSet's capabilities) the verifier also
//! walks the speculative path of every branch, and the speculative path past a loop's last
//! iteration goes on looping, pushing states until "the sequence of 8193 jumps is too complex".
//! A callback has no counter of its own: the verifier walks its body until its states converge.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, generated::bpf_loop},
};
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

/// What one attempt of [`remap`]'s search reads and writes: the reply key whose destination port
/// is the candidate, the reverse entry to insert under it, the range, and whether a port was taken.
#[repr(C)]
struct Search {
    reply_key: CtKeyV6,
    to_client: SnatEntryV6,
    min: u16,
    max: u16,
    taken: u32,
}

/// One candidate port (a `bpf_loop` callback): 1 stops the loop — the port was taken for this
/// flow — and 0 tries another. A port whose reply tuple a conntrack entry already has is never
/// taken.
#[inline(never)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: the keys stay in `remap`'s frame, not copied into this one"
)]
extern "C" fn attempt(_index: u64, search: *mut c_void) -> i64 {
    // SAFETY: `remap`'s `Search`, on its stack for the whole of `bpf_loop`.
    let search = unsafe { &mut *search.cast::<Search>() };
    // SAFETY: a helper without side effects.
    let port = snat_port_candidate(unsafe { bpf_get_prandom_u32() }, search.min, search.max);
    search.reply_key.dport = port.to_be_bytes();
    if CONNTRACK_V6.get_ptr(&search.reply_key).is_some() {
        return 0;
    }
    if SNAT_V6.insert(&search.reply_key, &search.to_client, u64::from(BPF_NOEXIST)).is_err() {
        return 0;
    }
    search.taken = 1;
    1
}

/// Takes a free port of the SNAT range for `flow`, sent to `backend:backend_port`, with `source` as
/// its source address — the client's own for a remapped port, a node address for source NAT — and
/// records both directions. Not inlined: a stage of its own, called from the program between the
/// clash check (or the route lookup) and the stage that records the flow (its keys would not fit
/// beside either).
#[inline(never)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: a by-value key is a copy on the stack"
)]
pub fn remap(
    flow: &Flow6,
    backend: &[u8; 16],
    backend_port: [u8; 2],
    source: &[u8; 16],
    now: u64,
) -> Result<[u8; 2], Verdict> {
    let (min, max) = config::nodeport().port_range();
    let mut search = Search {
        reply_key: CtKeyV6 {
            saddr: *backend,
            daddr: *source,
            sport: backend_port,
            dport: [0; 2],
            proto: flow.proto,
            direction: CT_DIR_REPLY,
            _pad: [0; 2],
        },
        to_client: SnatEntryV6 { created_ns: now, addr: flow.saddr, port: flow.sport, _pad: [0; 6] },
        min,
        max,
        taken: 0,
    };
    // SAFETY: `attempt` reads `search` as the `Search` it is, and `bpf_loop` returns before
    // `search` goes.
    unsafe { bpf_loop(SNAT_PORT_ATTEMPTS, attempt as *mut c_void, (&raw mut search).cast::<c_void>(), 0) };
    if search.taken == 0 {
        return Err(Verdict::drop(Stat::SnatPortExhausted));
    }
    let port = search.reply_key.dport;
    // The forward entry, keyed by the flow's own (pre-DNAT) tuple as its conntrack entry.
    search.to_client.addr = *source;
    search.to_client.port = port;
    if SNAT_V6.insert(&flow.ct_key(CT_DIR_FORWARD), &search.to_client, 0).is_err() {
        let _ = SNAT_V6.remove(&search.reply_key);
        return Err(Verdict::drop(Stat::ConntrackInsertFailed));
    }
    Ok(port)
}

/// The port a remapped or source-NATed flow (its forward key) sends from.
#[inline(always)]
pub fn forward(forward_key: &CtKeyV6) -> Option<[u8; 2]> {
    // SAFETY: the value is copied out at once.
    unsafe { SNAT_V6.get(forward_key) }.map(|e| e.port)
}

/// The address and port a remapped or source-NATed flow (its forward key) sends from, read in
/// place (a map value valid for this program run).
#[inline(always)]
pub fn forward_entry(forward_key: &CtKeyV6) -> Option<*const SnatEntryV6> {
    SNAT_V6.get_ptr(forward_key)
}

/// The client's own port for a reply of a remapped flow (keyed by the reply's tuple).
#[inline(always)]
pub fn reverse(reply_key: &CtKeyV6) -> Option<[u8; 2]> {
    // SAFETY: as above.
    unsafe { SNAT_V6.get(reply_key) }.map(|e| e.port)
}

/// The client (address and port) a reply of a source-NATed flow goes back to, read in place.
#[inline(always)]
pub fn reverse_entry(reply_key: &CtKeyV6) -> Option<*const SnatEntryV6> {
    SNAT_V6.get_ptr(reply_key)
}

/// Forgets both directions of a remapped flow.
#[inline(always)]
pub fn remove(forward_key: &CtKeyV6, reply_key: &CtKeyV6) {
    let _ = SNAT_V6.remove(reply_key);
    let _ = SNAT_V6.remove(forward_key);
}
