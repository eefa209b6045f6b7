//! IPv6 header rewrites. IPv6 has no header checksum; the L4 checksum covers the addresses through
//! the pseudo-header. An address is 16 bytes, beyond what `bpf_l4_csum_replace` takes as a field,
//! so its checksum difference comes from `bpf_csum_diff` and is applied as a difference (field size
//! 0) with `BPF_F_PSEUDO_HDR`; the kernel still decides how a partial (offloaded) checksum takes
//! it, and `BPF_F_MARK_MANGLED_0` sends a UDP checksum that comes out 0 as 0xffff.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::generated::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::{
    maps::IPPROTO_UDP,
    packet::{ETH_HLEN, L4_OFF_DPORT, L4_OFF_SPORT},
    packet6::{IP6_OFF_DADDR, IP6_OFF_SADDR},
    stats::Stat,
};

use crate::{parse6::Flow6, verdict::Verdict};

/// `BPF_F_IPV6` (Linux 6.16): a pseudo-header change of an IPv6 packet leaves `skb->csum` of a
/// CHECKSUM_COMPLETE packet alone (the address is inside what it sums, unlike IPv4's, whose header
/// checksum compensates). Older kernels refuse the flag; the rewrite is then retried without it.
const BPF_F_IPV6: u64 = 1 << 7;

#[inline(always)]
fn l4_flags(flow: &Flow6) -> u64 {
    if flow.proto == IPPROTO_UDP { u64::from(BPF_F_MARK_MANGLED_0) } else { 0 }
}

#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    flow: &Flow6,
    ip_field: usize,
    old: &[u8; 16],
    new: &[u8; 16],
) -> Result<(), Verdict> {
    // A later fragment has no L4 checksum: the first fragment's covers the whole datagram and
    // took the pseudo-header change.
    let check = if flow.has_l4_header() { Some(flow.l4_check_offset) } else { None };
    replace_addr(ctx, check, ETH_HLEN + ip_field, old, new, l4_flags(flow) | u64::from(BPF_F_PSEUDO_HDR))
}

/// Writes the 16-byte address at frame offset `field` (`old` → `new`) and accounts for it in the
/// checksum at `check` with `flags` (`BPF_F_PSEUDO_HDR` for an address the checksum covers through
/// the pseudo-header: then `BPF_F_IPV6` too, where the kernel knows it).
#[inline(always)]
pub fn replace_addr(
    ctx: &TcContext,
    check: Option<usize>,
    field: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    flags: u64,
) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let mut from = [0u32; 4];
    let mut to = [0u32; 4];
    for i in 0..4 {
        from[i] = u32::from_ne_bytes([old[4 * i], old[4 * i + 1], old[4 * i + 2], old[4 * i + 3]]);
        to[i] = u32::from_ne_bytes([new[4 * i], new[4 * i + 1], new[4 * i + 2], new[4 * i + 3]]);
    }
    if let Some(check) = check {
        // SAFETY: both buffers are 16 bytes of this frame.
        let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(Verdict::drop(Stat::RewriteFailed));
        }
        let diff = u64::from(diff as u32);
        let ipv6 = if flags & u64::from(BPF_F_PSEUDO_HDR) != 0 { BPF_F_IPV6 } else { 0 };
        if ctx.l4_csum_replace(check, 0, diff, flags | ipv6).is_err() {
            ctx.l4_csum_replace(check, 0, diff, flags).map_err(failed)?;
        }
    }
    ctx.store(field, &to, 0).map_err(failed)
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    flow: &Flow6,
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

/// DNAT: the destination becomes the backend (or, for a hairpin reply, the pod at its own port).
#[inline(always)]
pub fn rewrite_destination(
    ctx: &TcContext,
    flow: &Flow6,
    addr: &[u8; 16],
    port: [u8; 2],
) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP6_OFF_DADDR, &flow.daddr, addr)?;
    rewrite_port(ctx, flow, L4_OFF_DPORT, flow.dport, port)
}

/// Reverse NAT: the source becomes the Service the client talked to.
#[inline(always)]
pub fn rewrite_source(ctx: &TcContext, flow: &Flow6, addr: &[u8; 16], port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP6_OFF_SADDR, &flow.saddr, addr)?;
    rewrite_port(ctx, flow, L4_OFF_SPORT, flow.sport, port)
}

/// Hairpin SNAT: only the source address changes; the port stays.
#[inline(always)]
pub fn rewrite_source_addr(ctx: &TcContext, flow: &Flow6, addr: &[u8; 16]) -> Result<(), Verdict> {
    rewrite_addr(ctx, flow, IP6_OFF_SADDR, &flow.saddr, addr)
}

/// A remapped flow (port reuse): the client's source port becomes the remapped one.
#[inline(always)]
pub fn rewrite_source_port(ctx: &TcContext, flow: &Flow6, port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_port(ctx, flow, L4_OFF_SPORT, flow.sport, port)
}

/// A reply of a remapped flow: the destination port goes back to the client's own.
#[inline(always)]
pub fn rewrite_destination_port(ctx: &TcContext, flow: &Flow6, port: [u8; 2]) -> Result<(), Verdict> {
    rewrite_port(ctx, flow, L4_OFF_DPORT, flow.dport, port)
}
