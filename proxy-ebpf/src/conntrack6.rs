//! IPv6 conntrack: CONNTRACK_V6 with the states, transitions and timeouts of IPv4's
//! (`proxy_common::conntrack`: `CtState`, `record_packet`, `reply_moves_state`, `Timeouts`), and
//! the same pairing of a flow's forward and reply entries. Reply entries are keyed by
//! `backend → client`, `backend → HAIRPIN_ADDR_V6` for a hairpin flow, `backend →
//! client:remapped port` for a flow whose source port was remapped (port reuse, `snat6`), or
//! `backend → node address:port` for a source-NATed north–south flow (`CT_FLAG_SNAT`).
use proxy_common::{
    conntrack::{
        Clash, ClashingFlow, CtState, Timeouts, clashing_forward_key, forward_points_back, record_packet,
        reply_moves_state,
    },
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, CT_FLAG_SNAT, reply_key_in_snat},
    maps_v6::{CtEntryV6, CtKeyV6, HAIRPIN_ADDR_V6},
    stats::Stat,
};

use crate::{
    config, conntrack,
    maps::{CONNTRACK_V6, SNAT_V6},
    parse6::Flow6,
    snat6, stats,
    verdict::Verdict,
};

#[inline(always)]
pub fn lookup(key: &CtKeyV6) -> Option<*mut CtEntryV6> {
    CONNTRACK_V6.get_ptr_mut(key)
}

/// The key of a forward entry's reply entry: `backend → client`, `backend → hairpin address` for a
/// pod's flow to itself, `backend → client:remapped port` for a remapped flow, or `backend → node
/// address:port` for a source-NATed one — `None` when its SNAT_V6 entry is gone (evicted):
/// nothing can find its replies any more.
///
/// # Safety
/// `forward` must come from [`lookup`] in this program run.
#[inline(always)]
unsafe fn reply_key(forward_key: &CtKeyV6, forward: *const CtEntryV6) -> Option<CtKeyV6> {
    // SAFETY: per the contract above.
    let mut key = unsafe { forward_key.reply_of((*forward).nat_addr, (*forward).nat_port) };
    // SAFETY: as above.
    let flags = unsafe { (*forward).flags };
    if flags & CT_FLAG_HAIRPIN != 0 {
        key.daddr = HAIRPIN_ADDR_V6;
    }
    if reply_key_in_snat(flags) {
        let to = snat6::forward_entry(forward_key)?;
        // SAFETY: a map value valid for this program run, read in place. A remapped flow's
        // address there is the client's own, already the key's.
        unsafe {
            key.daddr = (*to).addr;
            key.dport = (*to).port;
        }
    }
    Some(key)
}

/// Whether a flow has been idle past its state's timeout: the reply direction is consulted only
/// when the forward one looks idle (a flow where only the server talks is alive).
#[inline(always)]
///
/// Entries are read in place here and below: copies of them (72 bytes each) would not fit on the
/// IPv6 chain's stack.
///
/// # Safety
/// `forward` must come from [`lookup`] in this program run.
pub unsafe fn expired(
    forward_key: &CtKeyV6,
    forward: *const CtEntryV6,
    timeouts: &Timeouts,
    now: u64,
) -> bool {
    // SAFETY: per the contract above.
    let forward = unsafe { &*forward };
    if !timeouts.expired(forward.state, forward.last_seen_ns, now) {
        return false;
    }
    // SAFETY: as above.
    match unsafe { reply_key(forward_key, forward) }.and_then(|key| lookup(&key)) {
        // SAFETY: a valid map value for this program run.
        Some(reply) => timeouts.expired(forward.state, unsafe { (*reply).last_seen_ns }, now),
        None => true,
    }
}

/// The entry of the live flow of forward `key` that keeps its backend, with the packet's time read
/// into `now` for it (a packet of no known flow reads no clock). An expired entry, or a UDP flow
/// whose backend is gone, is removed: the packet is then looked up as a new flow. As netfilter's
/// conntrack, a known flow goes on after its Service (or the port) is deleted. Both IPv6 chains'
/// first step (`ingress6`, `external6`), as `ingress::known_flow` is IPv4's.
#[inline(always)]
pub fn known_flow(key: &CtKeyV6, proto: u8, now: &mut u64) -> Option<*mut CtEntryV6> {
    let entry = lookup(key)?;
    *now = conntrack::now();
    // SAFETY: map values stay valid for the program's run; concurrent writers only race on
    // counters and timestamps.
    if unsafe { expired(key, entry, &config::get().timeouts, *now) } {
        // SAFETY: as above.
        unsafe { remove_pair(key, entry) };
        stats::count(Stat::ConntrackExpired);
    } else if crate::lb6::keeps_backend(unsafe { &*entry }, proto) {
        return Some(entry);
    } else {
        // SAFETY: as above.
        unsafe { remove_pair(key, entry) };
        stats::count(Stat::Rebalanced);
    }
    None
}

/// Deletes a flow's two entries, so that a new flow can take the tuple.
///
/// # Safety
/// `forward` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn remove_pair(forward_key: &CtKeyV6, forward: *const CtEntryV6) {
    // SAFETY: per the contract above; the key is built before either entry goes.
    if let Some(reply_key) = unsafe { reply_key(forward_key, forward) } {
        let _ = CONNTRACK_V6.remove(reply_key);
        // SAFETY: as above.
        if reply_key_in_snat(unsafe { (*forward).flags }) {
            snat6::remove(forward_key, &reply_key);
        }
    }
    let _ = CONNTRACK_V6.remove(*forward_key);
}

/// Keeps a flow's reply entry as fresh as its forward entry in the LRU and puts it back if it was
/// evicted (a client that keeps sending to a silent backend must not lose the un-NAT of its next
/// reply), as IPv4's `conntrack::keep_reply`.
///
/// # Safety
/// `forward` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn keep_reply(forward_key: &CtKeyV6, forward: *const CtEntryV6) {
    // SAFETY: per the contract above.
    let Some(key) = (unsafe { reply_key(forward_key, forward) }) else { return };
    if lookup(&key).is_some() {
        return;
    }
    // SAFETY: as above.
    unsafe { put_back(&key, forward, &forward_key.daddr, forward_key.dport) };
}

/// Inserts under `key` the other direction of the flow whose entry `other` is, pointing at
/// `nat_addr:nat_port`: `other`'s value itself, corrected in place once inserted (a copy would
/// not fit on the stack).
///
/// # Safety
/// `other` must come from [`lookup`] in this program run.
#[inline(always)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: a by-value entry is a copy on the stack"
)]
unsafe fn put_back(key: &CtKeyV6, other: *const CtEntryV6, nat_addr: &[u8; 16], nat_port: [u8; 2]) {
    // SAFETY: per the contract above.
    if CONNTRACK_V6.insert(key, unsafe { &*other }, 0).is_err() {
        return;
    }
    if let Some(entry) = lookup(key) {
        // SAFETY: a map value valid for this program run.
        unsafe {
            (*entry).packets = 0;
            (*entry).bytes = 0;
            (*entry).nat_addr = *nat_addr;
            (*entry).nat_port = nat_port;
            (*entry).tcp_flags_seen = 0;
        }
    }
}

/// Records one more packet of the flow (and, forward, advances its state).
///
/// # Safety
/// `entry` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn touch(entry: *mut CtEntryV6, flow: &Flow6, direction: u8, now: u64) {
    // SAFETY: per the contract above; concurrent writers only race on counters and timestamps.
    let entry = unsafe { &mut *entry };
    record_packet(entry.packet_fields(), flow.proto, flow.tcp_flags, flow.ip_len(), direction, now);
}

/// A reply moves the flow's TCP state, which lives on the forward entry (the reply entry mirrors
/// it); the forward entry is looked up on every reply, which keeps it from being evicted first,
/// and put back from the reply entry if it was. `client` and `frontend` are the forward tuple's ends.
///
/// # Safety
/// `entry` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn track_reply(
    entry: *mut CtEntryV6,
    flow: &Flow6,
    client: &([u8; 16], [u8; 2]),
    frontend: &([u8; 16], [u8; 2]),
) {
    let forward = CtKeyV6 {
        saddr: client.0,
        daddr: frontend.0,
        sport: client.1,
        dport: frontend.1,
        proto: flow.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    let Some(fwd) = lookup(&forward) else {
        // Evicted all the same: put back from what the reply entry knows, so that the client's
        // next packet is not taken for a flow mid-stream.
        // SAFETY: per the contract above.
        unsafe { put_back(&forward, entry, &flow.saddr, flow.sport) };
        return;
    };
    // SAFETY: both are map values valid for this program run.
    unsafe {
        if !reply_moves_state(flow.proto, flow.tcp_flags, (*entry).state) {
            return;
        }
        let state = CtState::from_u8((*fwd).state).unwrap_or(CtState::Open);
        let next = state.next(flow.proto, flow.tcp_flags, CT_DIR_REPLY) as u8;
        (*fwd).state = next;
        (*entry).state = next;
    }
}

/// Creates the reply entry, then the forward entry, so that no reply can arrive for a flow whose
/// un-NAT is not yet known. One entry on the stack, the reply's, then turned into the forward one.
/// A remapped port taken for a flow that cannot be recorded is not given back: inserts into an
/// LRU map evict rather than fail, and SNAT_V6's LRU reclaims it (no frame here has room for the
/// keys the clean-up needs).
#[inline(always)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: a by-value entry is a copy on the stack"
)]
pub fn create(
    flow: &Flow6,
    forward_key: &CtKeyV6,
    backend: &proxy_common::maps_v6::BackendV6,
    backend_id: u32,
    rev_nat_id: proxy_common::maps::RevNatId,
    now: u64,
    reply_to: ReplyTo6,
) -> Result<(), Verdict> {
    let client = if reply_to.flags & CT_FLAG_HAIRPIN != 0 { &HAIRPIN_ADDR_V6 } else { &flow.saddr };
    create_to(flow, forward_key, backend, backend_id, rev_nat_id, now, reply_to, client)
}

/// [`create`] with the address the replies come back to (`reply_addr`: the client, the hairpin
/// address, or the node address of a source-NATed flow).
#[inline(always)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    clippy::too_many_arguments,
    reason = "by reference: a by-value entry is a copy on the stack; inlined, the arguments cost nothing"
)]
pub fn create_to(
    flow: &Flow6,
    forward_key: &CtKeyV6,
    backend: &proxy_common::maps_v6::BackendV6,
    backend_id: u32,
    rev_nat_id: proxy_common::maps::RevNatId,
    now: u64,
    reply_to: ReplyTo6,
    reply_addr: &[u8; 16],
) -> Result<(), Verdict> {
    let mut entry = CtEntryV6 {
        created_ns: now,
        last_seen_ns: now,
        backend_id,
        nat_addr: flow.daddr,
        nat_port: flow.dport,
        rev_nat_id,
        state: CtState::initial(flow.proto, flow.tcp_flags) as u8,
        flags: reply_to.flags,
        ..Default::default()
    };
    let mut reply_key = forward_key.reply_of(backend.addr, backend.port);
    reply_key.daddr = *reply_addr;
    reply_key.dport = reply_to.port;
    CONNTRACK_V6.insert(reply_key, &entry, 0).map_err(|_| Verdict::pass(Stat::ConntrackInsertFailed))?;
    entry.packets = 1;
    entry.bytes = u64::from(flow.ip_len());
    entry.nat_addr = backend.addr;
    entry.nat_port = backend.port;
    entry.tcp_flags_seen = flow.tcp_flags;
    CONNTRACK_V6.insert(forward_key, &entry, 0).map_err(|_| Verdict::pass(Stat::ConntrackInsertFailed))?;
    Ok(())
}

/// Where a new flow's replies come back to, as IPv4's `conntrack::ReplyTo`: the client's own port,
/// or the remapped one (`CT_FLAG_REMAP`), and the flow's `CT_FLAG_*`. Every byte a field.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct ReplyTo6 {
    pub port: [u8; 2],
    pub flags: u8,
    _pad: u8,
}

impl ReplyTo6 {
    /// Replies to the client's own `port`.
    pub const fn client(port: [u8; 2]) -> Self {
        ReplyTo6 { port, flags: 0, _pad: 0 }
    }

    /// Replies to the client at the remapped `port`; `direct`: a flow to a pod's own address, not
    /// a Service's.
    pub const fn remap(port: [u8; 2], direct: bool) -> Self {
        let flags = if direct { CT_FLAG_REMAP | proxy_common::maps::CT_FLAG_DIRECT } else { CT_FLAG_REMAP };
        ReplyTo6 { port, flags, _pad: 0 }
    }

    /// Replies to the node address a source-NATed flow took, at `port`.
    pub const fn snat(port: [u8; 2]) -> Self {
        ReplyTo6 { port, flags: CT_FLAG_SNAT, _pad: 0 }
    }

    pub const fn with_flag(self, flag: u8) -> Self {
        ReplyTo6 { flags: self.flags | flag, ..self }
    }

    pub const fn is(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Whether a new flow of `flow`'s client may have `backend:backend_port → client:port` as its
/// reply tuple, as IPv4's `conntrack::claim` (the decision is `proxy_common::conntrack::Clash`,
/// shared): `None` when no translated flow has it (one that had it but was over has just been
/// removed: it yields), otherwise how the clash is resolved (`Remap`: this flow's source port must
/// be remapped; `Leave`: a TCP segment that starts nothing). Not inlined: a stage of its own,
/// called from the program, with its keys out of the other stages' frames. A `hairpin` flow (the
/// pod reaching itself) has `backend:backend_port → HAIRPIN_ADDR_V6:port` as its reply tuple, which
/// only another hairpin flow of the pod from the same port can hold — to another of its Services
/// on the same backend port — so the two kinds never clash with each other.
#[inline(never)]
pub fn claim(flow: &Flow6, backend: &[u8; 16], backend_port: [u8; 2], hairpin: bool) -> Option<Clash> {
    let mut reply_key = CtKeyV6 {
        saddr: *backend,
        daddr: flow.saddr,
        sport: backend_port,
        dport: flow.sport,
        proto: flow.proto,
        direction: CT_DIR_REPLY,
        _pad: [0; 2],
    };
    if hairpin {
        reply_key.daddr = HAIRPIN_ADDR_V6;
    }
    let reply = lookup(&reply_key)?;
    // Read only now: most packets that get here clash with nothing.
    let now = conntrack::now();
    // SAFETY: a map value valid for this program run, read in place.
    let (reply_flags, reply_flags_seen, frontend) =
        unsafe { ((*reply).flags, (*reply).tcp_flags_seen, ((*reply).nat_addr, (*reply).nat_port)) };
    // The flow the reply entry belongs to, if its forward entry is still there and still that
    // flow's (pointing back at the reply's source); a remapped flow's forward key has the client's
    // own port, from its reverse SNAT entry.
    let mut forward_key = clashing_forward_key(&reply_key, reply_key.daddr, reply_key.dport, frontend);
    // A hairpin flow's client is its backend: the reply's source.
    if hairpin {
        forward_key.saddr = reply_key.saddr;
    }
    let remapped = reply_flags & CT_FLAG_REMAP != 0;
    let original = if remapped { snat6::reverse(&reply_key) } else { None };
    let mut forward: *mut CtEntryV6 = core::ptr::null_mut();
    if !remapped || original.is_some() {
        if let Some(port) = original {
            forward_key.sport = port;
        }
        if let Some(ptr) = lookup(&forward_key)
            // SAFETY: as above.
            && forward_points_back(&reply_key, unsafe { ((*ptr).nat_addr, (*ptr).nat_port) })
        {
            forward = ptr;
        }
    }
    let existing = if forward.is_null() {
        ClashingFlow::orphan(reply_flags_seen)
    } else {
        // SAFETY: as above.
        let (state, forward_flags_seen) = unsafe { ((*forward).state, (*forward).tcp_flags_seen) };
        ClashingFlow {
            state: Some(state),
            forward_flags_seen,
            reply_flags_seen,
            // SAFETY: as above.
            idle: unsafe { expired(&forward_key, forward, &config::get().timeouts, now) },
        }
    };
    match Clash::resolve(flow.proto, flow.tcp_flags, existing) {
        Clash::Yield => {
            if forward.is_null() {
                let _ = CONNTRACK_V6.remove(reply_key);
                if remapped {
                    let _ = SNAT_V6.remove(reply_key);
                }
            } else {
                // SAFETY: as above.
                unsafe { remove_pair(&forward_key, forward) };
            }
            stats::count(Stat::ClashYielded);
            None
        }
        other => Some(other),
    }
}
