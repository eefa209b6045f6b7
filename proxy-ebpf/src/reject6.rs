//! Refusing an IPv6 connection, as `reject.rs` does for IPv4: the offending packet is overwritten
//! with a TCP RST or an ICMPv6 port unreachable (built by `proxy_common::reject6`) and bounced back
//! to the pod that sent it.
use aya_ebpf::{helpers::bpf_skb_change_tail, programs::TcContext};
use proxy_common::{
    maps::IPPROTO_TCP,
    packet::{ETH_HLEN, TCP_RST},
    packet6::{IPV6_HLEN, may_refuse6},
    reject6::{ICMP6_UNREACHABLE_LEN, TCP_RESET6_LEN, icmp6_port_unreachable, tcp_reset6},
    stats::Stat,
};

use crate::{
    maps::REFUSAL6_SCRATCH,
    parse6::{Flow6, load_into},
    stats,
    verdict::Verdict,
};

#[inline(always)]
fn resize(ctx: &TcContext, len: usize) -> Result<(), Verdict> {
    // SAFETY: the context pointer the kernel handed to this program.
    let ret = unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) };
    if ret != 0 { Err(Verdict::drop(Stat::RewriteFailed)) } else { Ok(()) }
}

/// Where a refusal is built: the offending headers and the reply, in a per-CPU map
/// (`maps::REFUSAL6_SCRATCH`), as they would not fit on the IPv6 chain's stack.
#[repr(C)]
pub struct Refusal6 {
    pub ip: [u8; IPV6_HLEN],
    pub l4: [u8; 20],
    pub udp: [u8; 8],
    pub tcp_reset: [u8; TCP_RESET6_LEN],
    pub icmp: [u8; ICMP6_UNREACHABLE_LEN],
}

/// Answers `flow`'s packet with a refusal. Packets from sources that name no single node or sent
/// to a link-layer group (`may_refuse6`), packets with extension headers (as IPv4 drops those with
/// options) and TCP resets (never answered) are dropped instead.
#[inline(always)]
pub fn refuse(ctx: &TcContext, flow: &Flow6) -> Result<Verdict, Verdict> {
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let dest_mac_first: u8 = ctx.load(0).map_err(failed)?;
    if !may_refuse6(dest_mac_first, &flow.saddr) {
        return Err(Verdict::drop(Stat::RejectUnanswerable));
    }
    let tcp = flow.proto == IPPROTO_TCP;
    let stat = if tcp { Stat::RejectTcp } else { Stat::RejectUdp };
    if flow.extension_headers != 0 || (tcp && flow.tcp_flags & TCP_RST != 0) {
        return Err(Verdict::drop(stat));
    }
    let scratch = REFUSAL6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::drop(Stat::RewriteFailed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let scratch = unsafe { &mut *scratch };
    load_into(ctx, ETH_HLEN, &mut scratch.ip).map_err(|_| Verdict::drop(Stat::RewriteFailed))?;
    if tcp {
        load_into(ctx, flow.l4_offset, &mut scratch.l4).map_err(|_| Verdict::drop(Stat::RewriteFailed))?;
        tcp_reset6(&scratch.ip, &scratch.l4, flow.payload_len, &mut scratch.tcp_reset);
        resize(ctx, ETH_HLEN + TCP_RESET6_LEN)?;
        ctx.store(ETH_HLEN, &scratch.tcp_reset, 0).map_err(failed)?;
    } else {
        load_into(ctx, flow.l4_offset, &mut scratch.udp).map_err(|_| Verdict::drop(Stat::RewriteFailed))?;
        icmp6_port_unreachable(&scratch.ip, &scratch.udp, &mut scratch.icmp);
        resize(ctx, ETH_HLEN + ICMP6_UNREACHABLE_LEN)?;
        ctx.store(ETH_HLEN, &scratch.icmp, 0).map_err(failed)?;
    }
    stats::count(stat);
    Ok(Verdict::BOUNCE)
}
