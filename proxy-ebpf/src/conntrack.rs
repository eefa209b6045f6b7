use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, CT_FLAG_SNAT, CtEntryV4, CtKeyV4, snat_reply_key},
    stats::Stat,
};

use crate::{Verdict, config::Config, lb::Choice, maps::CONNTRACK_V4, parse::Flow, snat};

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
    if forward.flags & CT_FLAG_SNAT != 0
        && let Some(to_node) = snat::forward(forward_key, forward.nat_addr, forward.nat_port)
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

/// Deletes a flow's two entries (so a new flow can take the tuple).
#[inline(always)]
pub fn remove_pair(forward_key: &CtKeyV4, forward: &CtEntryV4, hairpin_addr: &[u8; 4]) {
    let _ = CONNTRACK_V4.remove(reply_key(forward_key, forward, hairpin_addr));
    let _ = CONNTRACK_V4.remove(*forward_key);
    if forward.flags & CT_FLAG_SNAT != 0 {
        snat::remove(forward_key, forward.nat_addr, forward.nat_port);
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
    use proxy_common::{
        maps::IPPROTO_TCP,
        packet::{TCP_FIN, TCP_RST, TCP_SYN},
    };
    // SAFETY: per the contract above.
    let mirrored = unsafe { (*entry).state };
    if flow.proto != IPPROTO_TCP
        || (flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0 && mirrored == CtState::Established as u8)
    {
        return;
    }
    let forward = CtKeyV4 {
        saddr: client.0,
        daddr: frontend.0,
        sport: client.1,
        dport: frontend.1,
        proto: flow.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    if let Some(fwd) = lookup(&forward) {
        // SAFETY: both are map values valid for this program run.
        unsafe {
            let state = CtState::from_u8((*fwd).state).unwrap_or(CtState::Open);
            let next = state.next(flow.proto, flow.tcp_flags, CT_DIR_REPLY) as u8;
            (*fwd).state = next;
            (*entry).state = next;
        }
    }
}

/// Where a new flow's replies come back to, besides the client itself.
#[derive(Clone, Copy)]
pub enum ReplyTo {
    Client,
    /// The hairpin address (a pod reaching itself).
    Hairpin([u8; 4]),
    /// A node address and SNAT port.
    Snat([u8; 4], [u8; 2]),
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
    choice: &Choice,
    rev_nat_id: u16,
    now: u64,
    reply_to: ReplyTo,
) -> Result<(), Verdict> {
    let state = CtState::initial(flow.proto, flow.tcp_flags) as u8;
    let mut reply_key = forward_key.reply_of(choice.backend.addr, choice.backend.port);
    let mut flags = 0;
    match reply_to {
        ReplyTo::Client => {}
        ReplyTo::Hairpin(addr) => {
            reply_key.daddr = addr;
            flags = CT_FLAG_HAIRPIN;
        }
        ReplyTo::Snat(addr, port) => {
            reply_key = snat_reply_key(flow.proto, choice.backend.addr, choice.backend.port, addr, port);
            flags = CT_FLAG_SNAT;
        }
    }
    let reply = CtEntryV4 {
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
    CONNTRACK_V4.insert(reply_key, reply, 0).map_err(|_| Verdict::Pass(Stat::ConntrackInsertFailed))?;
    let forward = CtEntryV4 {
        packets: 1,
        bytes: u64::from(flow.ip_total_len),
        nat_addr: choice.backend.addr,
        nat_port: choice.backend.port,
        tcp_flags_seen: flow.tcp_flags,
        ..reply
    };
    CONNTRACK_V4.insert(forward_key, forward, 0).map_err(|_| Verdict::Pass(Stat::ConntrackInsertFailed))?;
    Ok(())
}
