//! Refusing a connection: the offending packet is overwritten with a TCP RST
//! or an ICMP port unreachable (built by proxy_common::reject) and bounced
//! back to the pod that sent it (`Verdict::BOUNCE`: the MAC addresses are swapped).
use aya_ebpf::{helpers::bpf_skb_change_tail, programs::TcContext};
use proxy_common::{
    maps::IPPROTO_TCP,
    packet::{ETH_HLEN, IPV4_MIN_HLEN, TCP_RST},
    reject,
    stats::Stat,
};

use crate::{parse::Flow, stats, verdict::Verdict};

#[inline(always)]
fn resize(ctx: &TcContext, len: usize) -> Result<(), Verdict> {
    // SAFETY: the context pointer the kernel handed to this program.
    let ret = unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) };
    if ret != 0 { Err(Verdict::drop(Stat::RewriteFailed)) } else { Ok(()) }
}

/// Answers `flow`'s packet with a refusal. Packets from sources that name no
/// single host or sent to a link-layer group (`reject::may_refuse`), packets
/// with IP options, and TCP resets (never answered) are dropped instead.
#[inline(always)]
pub fn refuse(ctx: &TcContext, flow: &Flow) -> Result<Verdict, Verdict> {
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let dest_mac_first: u8 = ctx.load(0).map_err(failed)?;
    if !reject::may_refuse(dest_mac_first, flow.saddr) {
        return Err(Verdict::drop(Stat::RejectUnanswerable));
    }
    let tcp = flow.proto == IPPROTO_TCP;
    let stat = if tcp { Stat::RejectTcp } else { Stat::RejectUdp };
    if flow.l4_offset != ETH_HLEN + IPV4_MIN_HLEN || (tcp && flow.tcp_flags & TCP_RST != 0) {
        return Err(Verdict::drop(stat));
    }
    let ip: [u8; 20] = ctx.load(ETH_HLEN).map_err(failed)?;
    if tcp {
        let header: [u8; 20] = ctx.load(flow.l4_offset).map_err(failed)?;
        let reply = reject::tcp_reset(&ip, &header, flow.ip_total_len.saturating_sub(IPV4_MIN_HLEN as u16));
        resize(ctx, ETH_HLEN + reject::TCP_RESET_LEN)?;
        ctx.store(ETH_HLEN, &reply, 0).map_err(failed)?;
    } else {
        let header: [u8; 8] = ctx.load(flow.l4_offset).map_err(failed)?;
        let reply = reject::icmp_port_unreachable(&ip, &header);
        resize(ctx, ETH_HLEN + reject::ICMP_UNREACHABLE_LEN)?;
        ctx.store(ETH_HLEN, &reply, 0).map_err(failed)?;
    }
    stats::count(stat);
    Ok(Verdict::BOUNCE)
}
