use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_common::{
    conntrack::{Clash, ClashingFlow, CtState, record_packet, reply_moves_state},
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_DIRECT, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, CT_FLAG_SNAT,
        CtEntryV4, CtKeyV4, reply_key_in_snat, snat_reply_key,
    },
    stats::Stat,
};

use crate::{
    config::Config,
    lb::Choice,
    maps::{CONNTRACK_V4, SNAT_V4},
    parse::Flow,
    snat, stats,
    verdict::Verdict,
};

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: a helper without side effects.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn lookup(key: &CtKeyV4) -> Option<*mut CtEntryV4> {
    CONNTRACK_V4.get_ptr_mut(key)
}

/// The key of the reply entry of a forward entry.
#[inline(always)]
fn reply_key(forward_key: &CtKeyV4, forward: &CtEntryV4, hairpin_addr: &[u8; 4]) -> CtKeyV4 {
    let mut key = forward_key.reply_of(forward.nat_addr, forward.nat_port);
    if forward.flags & CT_FLAG_HAIRPIN != 0 {
        key.daddr = *hairpin_addr;
    }
    if reply_key_in_snat(forward.flags)
        && let Some(to_node) = snat::forward(forward_key, forward.nat_addr, forward.nat_port, forward.flags)
    {
        key =
            snat_reply_key(forward_key.proto, forward.nat_addr, forward.nat_port, to_node.addr, to_node.port);
    }
    key
}

/// Whether a flow has been idle past its state's timeout. Only when the
/// forward direction looks idle is the reply direction consulted: a flow
/// where only the server talks is alive.
#[inline(always)]
pub fn expired(forward_key: &CtKeyV4, forward: &CtEntryV4, config: &Config, now: u64) -> bool {
    let timeouts = &config.timeouts;
    if !timeouts.expired(forward.state, forward.last_seen_ns, now) {
        return false;
    }
    match lookup(&reply_key(forward_key, forward, &config.hairpin_addr)) {
        // SAFETY: a valid map value for this program run.
        Some(reply) => timeouts.expired(forward.state, unsafe { (*reply).last_seen_ns }, now),
        None => true,
    }
}

/// Keeps a flow's reply entry as fresh as its forward entry in the LRU, and
/// puts it back if it was evicted: a client that keeps sending while its
/// backend is silent must not lose the un-NAT of the backend's next reply.
#[inline(always)]
pub fn keep_reply(forward_key: &CtKeyV4, forward: &CtEntryV4, hairpin_addr: &[u8; 4]) {
    if reply_key_in_snat(forward.flags)
        && snat::forward(forward_key, forward.nat_addr, forward.nat_port, forward.flags).is_none()
    {
        return;
    }
    let key = reply_key(forward_key, forward, hairpin_addr);
    if lookup(&key).is_some() {
        return;
    }
    let reply = CtEntryV4 {
        packets: 0,
        bytes: 0,
        nat_addr: forward_key.daddr,
        nat_port: forward_key.dport,
        tcp_flags_seen: 0,
        ..*forward
    };
    let _ = CONNTRACK_V4.insert(key, reply, 0);
}

/// Deletes a flow's two entries (so a new flow can take the tuple).
#[inline(always)]
pub fn remove_pair(forward_key: &CtKeyV4, forward: &CtEntryV4, hairpin_addr: &[u8; 4]) {
    let _ = CONNTRACK_V4.remove(reply_key(forward_key, forward, hairpin_addr));
    let _ = CONNTRACK_V4.remove(*forward_key);
    if reply_key_in_snat(forward.flags) {
        snat::remove(forward_key, forward.nat_addr, forward.nat_port, forward.flags);
    }
}

/// Whether a new flow of `flow`'s client may have `reply_key` as its reply
/// tuple. `None`: nothing else has it (any translated flow that had it but was
/// over has just been removed). Otherwise how the clash is resolved.
/// Not inlined: its copies of two entries stay out of the caller's frame.
/// Plain and remapped flows only can clash: hairpin and node-address SNAT
/// reply tuples never are a pod's own.
#[inline(never)]
pub fn claim(flow: &Flow, reply_key: &CtKeyV4) -> Option<Clash> {
    // Map values are read in place: copies of two entries would not fit in
    // the stack beside the caller's.
    let reply = lookup(reply_key)?;
    // Read only now: most packets that get here clash with nothing.
    let now = now();
    // SAFETY: a map value valid for this program run.
    let (reply_flags, reply_flags_seen, nat_addr, nat_port) =
        unsafe { ((*reply).flags, (*reply).tcp_flags_seen, (*reply).nat_addr, (*reply).nat_port) };
    let config = crate::config::get();
    // The flow the reply entry belongs to, if its forward entry is still
    // there and still that flow's (pointing back at the reply's source).
    // A hairpin flow's client is its backend; its replies go to the hairpin address.
    // Both read, then one chosen: LLVM makes a choice between two fields a
    // choice of address, pointer arithmetic the verifier allows only
    // CAP_PERFMON holders.
    // SAFETY: reads of the caller's key.
    let (saddr, daddr) =
        unsafe { (core::ptr::read_volatile(&reply_key.saddr), core::ptr::read_volatile(&reply_key.daddr)) };
    let client = if reply_flags & CT_FLAG_HAIRPIN != 0 { saddr } else { daddr };
    let mut forward_key = CtKeyV4 {
        saddr: client,
        daddr: nat_addr,
        sport: reply_key.dport,
        dport: nat_port,
        proto: reply_key.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    let mut forward: *mut CtEntryV4 = core::ptr::null_mut();
    let remapped = reply_flags & CT_FLAG_REMAP != 0;
    let original = if remapped { SNAT_V4.get_ptr(reply_key) } else { None };
    if !remapped || original.is_some() {
        if let Some(original) = original {
            // SAFETY: as above.
            forward_key.sport = unsafe { (*original).port };
        }
        if let Some(ptr) = lookup(&forward_key)
            // SAFETY: as above.
            && unsafe { (*ptr).nat_addr == reply_key.saddr && (*ptr).nat_port == reply_key.sport }
        {
            forward = ptr;
        }
    }
    let existing = if forward.is_null() {
        ClashingFlow { state: None, forward_flags_seen: 0, reply_flags_seen, idle: true }
    } else {
        // SAFETY: as above.
        let entry = unsafe { &*forward };
        ClashingFlow {
            state: Some(entry.state),
            forward_flags_seen: entry.tcp_flags_seen,
            reply_flags_seen,
            idle: expired(&forward_key, entry, &config, now),
        }
    };
    match Clash::resolve(flow.proto, flow.tcp_flags, existing) {
        Clash::Yield => {
            if forward.is_null() {
                let _ = CONNTRACK_V4.remove(*reply_key);
                if remapped {
                    let _ = SNAT_V4.remove(*reply_key);
                }
            } else {
                // SAFETY: as above.
                remove_pair(&forward_key, unsafe { &*forward }, &config.hairpin_addr);
            }
            stats::count(Stat::ClashYielded);
            None
        }
        other => Some(other),
    }
}

/// A reply moves the flow's TCP state, which lives on the forward entry (the
/// reply entry mirrors it, so steady traffic needs one lookup). `client` and
/// `frontend` are the forward tuple's ends.
///
/// # Safety
/// `entry` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn track_reply(
    entry: *mut CtEntryV4,
    flow: &Flow,
    client: ([u8; 4], [u8; 2]),
    frontend: ([u8; 4], [u8; 2]),
) {
    // SAFETY: per the contract above.
    let mirrored = unsafe { (*entry).state };
    let forward = CtKeyV4 {
        saddr: client.0,
        daddr: frontend.0,
        sport: client.1,
        dport: frontend.1,
        proto: flow.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    // Looked up on every reply: a backend that keeps sending to a silent
    // client keeps the flow's forward entry from being evicted first.
    let Some(fwd) = lookup(&forward) else {
        // Evicted all the same: put it back from what the reply entry knows,
        // so the client's next packet is not taken for a flow mid-stream.
        // SAFETY: per the contract above.
        let reply = unsafe { *entry };
        let recreated = CtEntryV4 {
            packets: 0,
            bytes: 0,
            nat_addr: flow.saddr,
            nat_port: flow.sport,
            tcp_flags_seen: 0,
            ..reply
        };
        let _ = CONNTRACK_V4.insert(forward, recreated, 0);
        return;
    };
    if !reply_moves_state(flow.proto, flow.tcp_flags, mirrored) {
        return;
    }
    // SAFETY: both are map values valid for this program run.
    unsafe {
        let state = CtState::from_u8((*fwd).state).unwrap_or(CtState::Open);
        let next = state.next(flow.proto, flow.tcp_flags, CT_DIR_REPLY) as u8;
        (*fwd).state = next;
        (*entry).state = next;
    }
}

/// Where a new flow's replies come back to: the client itself, or (by
/// `flags`) the hairpin address `addr`, a node address and SNAT port
/// `addr:port`, or the client at a remapped `port`. A plain struct with every
/// byte set: an enum with data in some variants leaves bytes undefined, and
/// the verifier refuses a copy of them.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct ReplyTo {
    pub addr: [u8; 4],
    pub port: [u8; 2],
    /// `CT_FLAG_*` of the flow's entries.
    pub flags: u8,
    _pad: u8,
}

impl ReplyTo {
    pub const CLIENT: ReplyTo = ReplyTo { addr: [0; 4], port: [0; 2], flags: 0, _pad: 0 };

    pub const fn hairpin(addr: [u8; 4]) -> Self {
        ReplyTo { addr, flags: CT_FLAG_HAIRPIN, ..Self::CLIENT }
    }

    pub const fn snat(addr: [u8; 4], port: [u8; 2]) -> Self {
        ReplyTo { addr, port, flags: CT_FLAG_SNAT, _pad: 0 }
    }

    /// `direct`: a flow to a pod's own address, not a Service's.
    pub const fn remap(port: [u8; 2], direct: bool) -> Self {
        let flags = if direct { CT_FLAG_REMAP | CT_FLAG_DIRECT } else { CT_FLAG_REMAP };
        ReplyTo { port, flags, ..Self::CLIENT }
    }

    /// The same translation with the client's port remapped too.
    pub const fn with_port(self, port: [u8; 2]) -> Self {
        ReplyTo { port, flags: self.flags | CT_FLAG_REMAP, ..self }
    }

    /// The address the client's replies are sent to: its own, or the hairpin one.
    pub const fn client_addr(&self, client: [u8; 4]) -> [u8; 4] {
        if self.is(CT_FLAG_HAIRPIN) { self.addr } else { client }
    }

    pub const fn is(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Records one more packet of the flow and advances its state
/// (`proxy_common::conntrack::record_packet`, shared with IPv6).
///
/// # Safety
/// `entry` must come from [`lookup`] in this program run.
#[inline(always)]
pub unsafe fn touch(entry: *mut CtEntryV4, flow: &Flow, direction: u8, now: u64) {
    // SAFETY: per the contract above; concurrent writers only race on counters and timestamps.
    let entry = unsafe { &mut *entry };
    record_packet(entry.packet_fields(), flow.proto, flow.tcp_flags, flow.ip_total_len, direction, now);
}

/// Creates the reply entry, then the forward entry, so that no reply can
/// arrive for a flow whose un-NAT is not yet known.
#[inline(always)]
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by reference: a by-value entry is a copy on the stack"
)]
pub fn create(
    flow: &Flow,
    forward_key: &CtKeyV4,
    choice: &Choice,
    rev_nat_id: proxy_common::maps::RevNatId,
    now: u64,
    reply_to: ReplyTo,
) -> Result<(), Verdict> {
    let state = CtState::initial(flow.proto, flow.tcp_flags) as u8;
    let mut reply_key = forward_key.reply_of(choice.backend.addr, choice.backend.port);
    if reply_to.is(CT_FLAG_HAIRPIN) {
        reply_key.daddr = reply_to.addr;
    } else if reply_to.is(CT_FLAG_SNAT) {
        reply_key = snat_reply_key(
            flow.proto,
            choice.backend.addr,
            choice.backend.port,
            reply_to.addr,
            reply_to.port,
        );
    }
    if reply_to.is(CT_FLAG_REMAP) {
        reply_key.dport = reply_to.port;
    }
    let flags = reply_to.flags;
    // One entry on the stack, written as the reply and then changed into the forward entry: two
    // copies of it would not fit new_flow's frame in the 512-byte stack.
    let mut entry = CtEntryV4 {
        created_ns: now,
        last_seen_ns: now,
        backend_id: choice.backend_id,
        nat_addr: flow.daddr,
        nat_port: flow.dport,
        rev_nat_id,
        state,
        flags,
        ..Default::default()
    };
    CONNTRACK_V4.insert(reply_key, &entry, 0).map_err(|_| Verdict::pass(Stat::ConntrackInsertFailed))?;
    entry.packets = 1;
    entry.bytes = u64::from(flow.ip_total_len);
    entry.nat_addr = choice.backend.addr;
    entry.nat_port = choice.backend.port;
    entry.tcp_flags_seen = flow.tcp_flags;
    CONNTRACK_V4.insert(forward_key, &entry, 0).map_err(|_| Verdict::pass(Stat::ConntrackInsertFailed))?;
    Ok(())
}
