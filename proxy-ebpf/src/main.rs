//! kproxy's tc programs. `kproxy_ingress` runs on packets leaving a pod (tc
//! ingress of its host-side veth) and DNATs Service traffic to a backend;
//! `kproxy_egress` runs on packets entering a pod and un-NATs replies back to
//! the VIP. Both are thin: parse → look up → rewrite; the decisions they share
//! with userspace live in proxy-common.
#![no_std]
#![no_main]

mod conntrack;
mod lb;
mod maps;
mod nat;
mod parse;
mod stats;

use aya_ebpf::{macros::classifier, programs::TcContext};
use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CtKeyV4, IPPROTO_TCP},
    packet::{TCP_FIN, TCP_RST, TCP_SYN},
    stats::Stat,
};

/// Let the next program in the TCX chain (or the stack) have the packet.
const TC_NEXT: i32 = -1;
const TC_DROP: i32 = 2;

#[classifier]
pub fn kproxy_ingress(ctx: TcContext) -> i32 {
    match ingress(&ctx) {
        Ok(()) => TC_NEXT,
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

#[classifier]
pub fn kproxy_egress(ctx: TcContext) -> i32 {
    match egress(&ctx) {
        Ok(()) => TC_NEXT,
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

/// Why a program stopped early.
pub enum Verdict {
    /// Leave the packet as it is.
    Pass(Stat),
    /// The packet was partly rewritten and must not leave half-translated.
    Drop(Stat),
}

fn ingress(ctx: &TcContext) -> Result<(), Verdict> {
    let flow = parse::flow(ctx).map_err(Verdict::Pass)?;
    let frontend = lb::lookup_frontend(&flow).ok_or(Verdict::Pass(Stat::PassNoService))?;
    let key = flow.ct_key(CT_DIR_FORWARD);
    let now = conntrack::now();

    if let Some(entry) = conntrack::lookup(&key) {
        // SAFETY: map values stay valid for the program's run; concurrent
        // writers only race on counters and timestamps.
        let (backend_addr, backend_port) = unsafe {
            conntrack::touch(entry, &flow, CT_DIR_FORWARD, now);
            ((*entry).nat_addr, (*entry).nat_port)
        };
        nat::rewrite_destination(ctx, &flow, backend_addr, backend_port)?;
        stats::count(Stat::DnatEstablished);
        return Ok(());
    }

    let (backend_id, backend) = lb::select_backend(&flow, frontend)?;
    conntrack::create(&flow, &key, backend_id, &backend, frontend.rev_nat_id, now)?;
    nat::rewrite_destination(ctx, &flow, backend.addr, backend.port)?;
    stats::count(Stat::DnatNew);
    Ok(())
}

fn egress(ctx: &TcContext) -> Result<(), Verdict> {
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
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
