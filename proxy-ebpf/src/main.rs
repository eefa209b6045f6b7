//! kproxy's tc programs. `kproxy_ingress` runs on packets leaving a pod (tc
//! ingress of its host-side veth): it DNATs Service traffic to a backend,
//! refuses traffic to Services without endpoints, and handles hairpin flows;
//! `kproxy_egress` runs on packets entering a pod and un-NATs replies back to
//! the VIP. Both are thin: parse → look up → rewrite; the decisions they share
//! with userspace live in proxy-common.
#![no_std]
#![no_main]

mod config;
mod conntrack;
mod events;
mod lb;
mod maps;
mod nat;
mod parse;
mod reject;
mod stats;

use aya_ebpf::{helpers::bpf_redirect, macros::classifier, programs::TcContext};
use aya_log_ebpf::debug;
use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, CtKeyV4, IPPROTO_TCP},
    packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    stats::Stat,
    trace::{EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_DROP_INVALID, EV_REJECT, EV_UNNAT},
};

/// Let the next program in the TCX chain (or the stack) have the packet.
const TC_NEXT: i32 = -1;
const TC_DROP: i32 = 2;

/// What to do with a packet the program handled.
pub enum Done {
    /// Continue on its way (rewritten or not).
    Next,
    /// Send it back out of the interface it came in on (reject replies and
    /// hairpin flows, which must not be routed by the node).
    Bounce,
}

/// Why a program stopped early.
pub enum Verdict {
    /// Leave the packet as it is.
    Pass(Stat),
    /// Drop the packet: it was partly rewritten, or must not get through.
    Drop(Stat),
}

#[inline(always)]
fn finish(ctx: &TcContext, result: Result<Done, Verdict>) -> i32 {
    match result {
        Ok(Done::Next) => TC_NEXT,
        Ok(Done::Bounce) => {
            // Back to the sender: the frame must be addressed to its MAC.
            if swap_macs(ctx).is_err() {
                stats::count(Stat::RewriteFailed);
                return TC_DROP;
            }
            // SAFETY: reading the context field the kernel filled in.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            // SAFETY: a helper taking plain values.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        Err(Verdict::Pass(stat)) => {
            stats::count(stat);
            TC_NEXT
        }
        Err(Verdict::Drop(stat)) => {
            stats::count(stat);
            TC_DROP
        }
    }
}

#[inline(always)]
fn swap_macs(ctx: &TcContext) -> Result<(), i64> {
    let macs: [u8; 12] = ctx.load(0)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0)
}

#[classifier]
pub fn kproxy_ingress(ctx: TcContext) -> i32 {
    let result = ingress(&ctx);
    finish(&ctx, result)
}

#[classifier]
pub fn kproxy_egress(ctx: TcContext) -> i32 {
    let result = egress(&ctx);
    finish(&ctx, result)
}

fn ingress(ctx: &TcContext) -> Result<Done, Verdict> {
    let flow = parse::flow(ctx).map_err(Verdict::Pass)?;
    let config = config::get();
    if flow.daddr == config.hairpin_addr {
        return hairpin_reply(ctx, &flow);
    }
    let Some(frontend) = lb::lookup_frontend(&flow) else {
        if lb::is_vip(&flow.daddr) {
            // A port the Service does not have.
            if events::enabled() {
                events::emit(&events::from_flow(&flow, EV_REJECT, conntrack::now()));
            }
            return reject::refuse(ctx, &flow);
        }
        return Err(Verdict::Pass(Stat::PassNoService));
    };
    let key = flow.ct_key(CT_DIR_FORWARD);
    let now = conntrack::now();

    let mut rebalance = false;
    if let Some(entry) = conntrack::lookup(&key) {
        // SAFETY: map values stay valid for the program's run; concurrent
        // writers only race on counters and timestamps.
        let entry_copy = unsafe { *entry };
        if conntrack::expired(&key, &entry_copy, &config, now) {
            conntrack::remove_pair(&key, &entry_copy, &config.hairpin_addr);
            stats::count(Stat::ConntrackExpired);
        } else if lb::backend_is_current(&entry_copy) {
            // SAFETY: as above.
            unsafe { conntrack::touch(entry, &flow, CT_DIR_FORWARD, now) };
            let hairpin = entry_copy.flags & CT_FLAG_HAIRPIN != 0;
            nat::rewrite_destination(ctx, &flow, entry_copy.nat_addr, entry_copy.nat_port)?;
            stats::count(Stat::DnatEstablished);
            if events::enabled() {
                let mut event = events::from_flow(&flow, EV_DNAT_ESTABLISHED, now);
                event.after_daddr = entry_copy.nat_addr;
                event.after_dport = entry_copy.nat_port;
                if hairpin {
                    event.after_saddr = config.hairpin_addr;
                }
                event.ct_created_ns = entry_copy.created_ns;
                event.ct_flags = entry_copy.flags;
                event.backend_id = entry_copy.backend_id;
                event.rev_nat_id = entry_copy.rev_nat_id;
                events::emit(&event);
            }
            if hairpin {
                nat::rewrite_source_addr(ctx, &flow, flow.saddr, config.hairpin_addr)?;
                return Ok(Done::Bounce);
            }
            return Ok(Done::Next);
        } else {
            // The backend is gone: send the flow elsewhere. UDP simply moves;
            // a TCP segment reaches a backend without the connection, which
            // answers with a RST, so the client learns at once.
            conntrack::remove_pair(&key, &entry_copy, &config.hairpin_addr);
            stats::count(Stat::Rebalanced);
            debug!(ctx, "backend {} of a flow is gone: rebalancing", entry_copy.backend_id);
            rebalance = true;
        }
    }

    if flow.proto == IPPROTO_TCP && !rebalance && flow.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN {
        // No connection is known for this segment: translating it would start
        // a flow mid-stream, and passing it would leak it to the VIP.
        if events::enabled() {
            let mut event = events::from_flow(&flow, EV_DROP_INVALID, now);
            event.rev_nat_id = frontend.rev_nat_id;
            events::emit(&event);
        }
        return Err(Verdict::Drop(Stat::DropInvalidTcp));
    }
    if frontend.count == 0 {
        debug!(ctx, "frontend {} has no endpoints: refusing", frontend.rev_nat_id);
        if events::enabled() {
            let mut event = events::from_flow(&flow, EV_REJECT, now);
            event.rev_nat_id = frontend.rev_nat_id;
            events::emit(&event);
        }
        return reject::refuse(ctx, &flow);
    }
    let choice = lb::select_backend(&flow, frontend, now)?;
    let hairpin = choice.backend.addr == flow.saddr;
    conntrack::create(
        &flow,
        &key,
        &choice,
        frontend.rev_nat_id,
        now,
        hairpin.then_some(config.hairpin_addr),
    )?;
    nat::rewrite_destination(ctx, &flow, choice.backend.addr, choice.backend.port)?;
    stats::count(Stat::DnatNew);
    debug!(
        ctx,
        "new flow to frontend {} sent to backend {} (slot {})",
        frontend.rev_nat_id,
        choice.backend_id,
        choice.slot
    );
    if events::enabled() {
        let mut event = events::from_flow(&flow, EV_DNAT_NEW, now);
        event.after_daddr = choice.backend.addr;
        event.after_dport = choice.backend.port;
        if hairpin {
            event.after_saddr = config.hairpin_addr;
            event.ct_flags = CT_FLAG_HAIRPIN;
        }
        event.ct_created_ns = now;
        event.backend_id = choice.backend_id;
        event.backend_slot = choice.slot;
        event.backend_count = frontend.count;
        event.rev_nat_id = frontend.rev_nat_id;
        events::emit(&event);
    }
    if hairpin {
        nat::rewrite_source_addr(ctx, &flow, flow.saddr, config.hairpin_addr)?;
        stats::count(Stat::Hairpin);
        return Ok(Done::Bounce);
    }
    Ok(Done::Next)
}

/// A pod's reply to its own hairpin connection, addressed to the hairpin
/// address: the source goes back to the VIP and the destination back to the
/// pod, and the packet returns to the pod.
fn hairpin_reply(ctx: &TcContext, flow: &parse::Flow) -> Result<Done, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack::lookup(&key).ok_or(Verdict::Pass(Stat::PassNoService))?;
    let now = conntrack::now();
    // SAFETY: as in `ingress`.
    let (vip, vip_port) = unsafe {
        conntrack::touch(entry, flow, CT_DIR_REPLY, now);
        ((*entry).nat_addr, (*entry).nat_port)
    };
    nat::rewrite_source(ctx, flow, vip, vip_port)?;
    nat::rewrite_destination_addr(ctx, flow, flow.daddr, flow.saddr)?;
    stats::count(Stat::ReverseNat);
    if events::enabled() {
        // SAFETY: as in `ingress`.
        emit_unnat(flow, unsafe { &*entry }, vip, vip_port, flow.saddr, now);
    }
    Ok(Done::Bounce)
}

fn egress(ctx: &TcContext) -> Result<Done, Verdict> {
    let flow = parse::flow(ctx).map_err(Verdict::Pass)?;
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack::lookup(&key).ok_or(Verdict::Pass(Stat::PassNoService))?;
    let now = conntrack::now();
    // SAFETY: as in `ingress`.
    let (vip, vip_port, mirrored_state) = unsafe {
        conntrack::touch(entry, &flow, CT_DIR_REPLY, now);
        ((*entry).nat_addr, (*entry).nat_port, (*entry).state)
    };
    if flow.proto == IPPROTO_TCP
        && (flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0
            || mirrored_state != CtState::Established as u8)
    {
        // The handshake and teardown are tracked on the forward entry; the
        // reply entry mirrors its state so steady traffic needs one lookup.
        let forward = CtKeyV4 {
            saddr: flow.daddr,
            daddr: vip,
            sport: flow.dport,
            dport: vip_port,
            proto: flow.proto,
            direction: CT_DIR_FORWARD,
            _pad: [0; 2],
        };
        if let Some(fwd) = conntrack::lookup(&forward) {
            // SAFETY: as above.
            unsafe {
                let state = CtState::from_u8((*fwd).state).unwrap_or(CtState::Open);
                let next = state.next(flow.proto, flow.tcp_flags, CT_DIR_REPLY) as u8;
                (*fwd).state = next;
                (*entry).state = next;
            }
        }
    }
    nat::rewrite_source(ctx, &flow, vip, vip_port)?;
    stats::count(Stat::ReverseNat);
    if events::enabled() {
        // SAFETY: as in `ingress`.
        emit_unnat(&flow, unsafe { &*entry }, vip, vip_port, flow.daddr, now);
    }
    Ok(Done::Next)
}

#[inline(always)]
fn emit_unnat(
    flow: &parse::Flow,
    entry: &proxy_common::maps::CtEntryV4,
    vip: [u8; 4],
    vip_port: [u8; 2],
    client: [u8; 4],
    now: u64,
) {
    let mut event = events::from_flow(flow, EV_UNNAT, now);
    event.after_saddr = vip;
    event.after_sport = vip_port;
    event.after_daddr = client;
    event.ct_created_ns = entry.created_ns;
    event.ct_flags = entry.flags;
    event.backend_id = entry.backend_id;
    event.rev_nat_id = entry.rev_nat_id;
    events::emit(&event);
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
