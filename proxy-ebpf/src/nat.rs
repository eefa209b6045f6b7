//! Header rewrites. Checksums are fixed through the kernel's csum_replace
//! helpers: only the kernel knows whether the L4 checksum is complete or a
//! partial (offloaded) one, and they handle both — as well as UDP's "no
//! checksum" zero — the way proxy_common::checksum's reference math does.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{
    checksum::update_addr,
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

/// The header from the IPv4 checksum to the L4 ports (checksum, source and
/// destination address, source and destination port), for a header without
/// options.
const TUPLE_OFFSET: usize = ETH_HLEN + IP_OFF_CHECK;
const TUPLE_LEN: usize = 14;

/// The packet's addresses and ports become `to` (source, destination, source
/// port, destination port) in one store: the L4 checksum through the kernel's
/// helper (it alone knows a partial checksum: one call for the address that
/// changed, one for the ports), the IPv4 header checksum computed here, and
/// the header from that checksum to the ports written at once — two to four
/// helper calls fewer than field by field, which a header with options, a
/// later fragment or a short linear part still takes. The old values are read
/// from the packet itself, so an earlier rewrite in the same run is no harm.
#[inline(always)]
pub fn rewrite_tuple(
    ctx: &TcContext,
    flow: &Flow,
    to: ([u8; 4], [u8; 4], [u8; 2], [u8; 2]),
) -> Result<(), Verdict> {
    let (saddr, daddr, sport, dport) = to;
    let start = ctx.data();
    if flow.l4_offset != ETH_HLEN + 20
        || !flow.has_l4_header()
        || start + TUPLE_OFFSET + TUPLE_LEN > ctx.data_end()
    {
        rewrite_addr(ctx, flow, IP_OFF_SADDR, flow.saddr, saddr)?;
        rewrite_addr(ctx, flow, IP_OFF_DADDR, flow.daddr, daddr)?;
        rewrite_port(ctx, flow, L4_OFF_SPORT, flow.sport, sport)?;
        return rewrite_port(ctx, flow, L4_OFF_DPORT, flow.dport, dport);
    }
    // SAFETY: inside the bounds just checked against data_end; read before
    // any helper call invalidates packet pointers.
    let old: [u8; TUPLE_LEN] =
        unsafe { core::ptr::read_unaligned((start + TUPLE_OFFSET) as *const [u8; TUPLE_LEN]) };
    let old_check = u16::from_be_bytes([old[0], old[1]]);
    let old_saddr = [old[2], old[3], old[4], old[5]];
    let old_daddr = [old[6], old[7], old[8], old[9]];
    let old_ports = [old[10], old[11], old[12], old[13]];
    let new_ports = [sport[0], sport[1], dport[0], dport[1]];
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let pseudo = l4_flags(flow) | u64::from(BPF_F_PSEUDO_HDR) | 4;
    let word = |b: [u8; 4]| u64::from(u32::from_ne_bytes(b));
    if old_saddr != saddr {
        ctx.l4_csum_replace(flow.l4_check_offset, word(old_saddr), word(saddr), pseudo).map_err(failed)?;
    }
    if old_daddr != daddr {
        ctx.l4_csum_replace(flow.l4_check_offset, word(old_daddr), word(daddr), pseudo).map_err(failed)?;
    }
    if old_ports != new_ports {
        ctx.l4_csum_replace(flow.l4_check_offset, word(old_ports), word(new_ports), l4_flags(flow) | 4)
            .map_err(failed)?;
    }
    let check = update_addr(update_addr(old_check, old_saddr, saddr), old_daddr, daddr).to_be_bytes();
    let new: [u8; TUPLE_LEN] = [
        check[0], check[1], saddr[0], saddr[1], saddr[2], saddr[3], daddr[0], daddr[1], daddr[2], daddr[3],
        sport[0], sport[1], dport[0], dport[1],
    ];
    ctx.store(TUPLE_OFFSET, &new, 0).map_err(failed)
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
