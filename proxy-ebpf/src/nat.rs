//! Header rewrites. Checksums are fixed through the kernel's csum_replace
//! helpers: only the kernel knows whether the L4 checksum is complete or a
//! partial (offloaded) one, and they handle both — as well as UDP's "no
//! checksum" zero — the way proxy_common::checksum's reference math does.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{
    maps::IPPROTO_UDP,
    packet::{ETH_HLEN, IP_OFF_CHECK, IP_OFF_DADDR, IP_OFF_SADDR, L4_OFF_DPORT, L4_OFF_SPORT},
    stats::Stat,
};

use crate::{parse::Flow, verdict::Verdict};

#[inline(always)]
fn l4_flags(flow: &Flow) -> u64 {
    if flow.proto == IPPROTO_UDP { u64::from(BPF_F_MARK_MANGLED_0) } else { 0 }
}

#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    flow: &Flow,
    ip_field: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (u64::from(u32::from_ne_bytes(old)), u64::from(u32::from_ne_bytes(new)));
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    // A later fragment has no L4 checksum: the first fragment's covers the
    // whole datagram and took the pseudo-header change.
    if flow.has_l4_header() {
        ctx.l4_csum_replace(flow.l4_check_offset, old, new, l4_flags(flow) | u64::from(BPF_F_PSEUDO_HDR) | 4)
            .map_err(failed)?;
    }
    ctx.l3_csum_replace(ETH_HLEN + IP_OFF_CHECK, old, new, 4).map_err(failed)?;
    ctx.store(ETH_HLEN + ip_field, &(new as u32), 0).map_err(failed)
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    flow: &Flow,
    l4_field: usize,
    old: [u8; 2],
    new: [u8; 2],
) -> Result<(), Verdict> {
    if old == new || !flow.has_l4_header() {
        return Ok(());
    }
    let (old, new) = (u64::from(u16::from_ne_bytes(old)), u64::from(u16::from_ne_bytes(new)));
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    ctx.l4_csum_replace(flow.l4_check_offset, old, new, l4_flags(flow) | 2).map_err(failed)?;
    ctx.store(flow.l4_offset + l4_field, &(new as u16), 0).map_err(failed)
}

/// DNAT: the destination becomes the backend.
#[inline(always)]
pub fn rewrite_destination(
    ctx: &TcContext,
    flow: &Flow,
    addr: [u8; 4],
    port: [u8; 2],
) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP_OFF_DADDR, flow.daddr, addr)?;
    rewrite_port(ctx, flow, L4_OFF_DPORT, flow.dport, port)
}

/// Reverse NAT: the source becomes the VIP the client talked to.
#[inline(always)]
pub fn rewrite_source(ctx: &TcContext, flow: &Flow, addr: [u8; 4], port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP_OFF_SADDR, flow.saddr, addr)?;
    rewrite_port(ctx, flow, L4_OFF_SPORT, flow.sport, port)
}

/// A remapped flow's source port (its address stays).
#[inline(always)]
pub fn rewrite_source_port(ctx: &TcContext, flow: &Flow, port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_port(ctx, flow, L4_OFF_SPORT, flow.sport, port)
}

/// A remapped flow's reply: the destination port goes back to the client's own.
#[inline(always)]
pub fn rewrite_destination_port(ctx: &TcContext, flow: &Flow, port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_port(ctx, flow, L4_OFF_DPORT, flow.dport, port)
}

/// Hairpin SNAT: only the source address changes; the port stays.
#[inline(always)]
pub fn rewrite_source_addr(ctx: &TcContext, flow: &Flow, old: [u8; 4], new: [u8; 4]) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP_OFF_SADDR, old, new)
}

/// Hairpin reply: the destination address goes back to the pod.
#[inline(always)]
pub fn rewrite_destination_addr(
    ctx: &TcContext,
    flow: &Flow,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP_OFF_DADDR, old, new)
}
