//! Refusing an IPv6 connection, as `reject.rs` does for IPv4: the offending packet is overwritten
//! with a TCP RST or an ICMPv6 port unreachable (built by `proxy_common::reject6`) and bounced back
//! to the pod that sent it.
use aya_ebpf::{
    helpers::{bpf_skb_change_tail, generated::bpf_csum_diff},
    programs::TcContext,
};
use proxy_common::{
    maps::IPPROTO_TCP,
    packet::{ETH_HLEN, TCP_RST},
    packet6::{IPPROTO_ICMPV6, IPV6_HLEN, may_refuse6},
    reject6::{
        ICMP6_CHECK_AT, ICMP6_UNREACHABLE_LEN, TCP_CHECK_AT, TCP_RESET6_LEN, icmp6_port_unreachable_unsummed,
        tcp_reset6_unsummed,
    },
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

/// Fills in the upper-layer checksum of the reply in `packet` (an IPv6 header, then the L4 message
/// whose checksum field at `check_at` is zero) with the kernel's checksum helper: the pseudo-header's
/// addresses and the message straight from the per-CPU buffer, its length and next header from a word
/// pair on the stack. Helper calls with constant offsets, no loop over the buffer: a loop's variable
/// pointer into a map value is refused to a loader without CAP_PERFMON.
#[inline(always)]
fn fill_l4_checksum<const N: usize>(
    packet: &mut [u8; N],
    next_header: u8,
    check_at: usize,
) -> Result<(), Verdict> {
    let failed = Verdict::drop(Stat::RewriteFailed);
    let l4_len = (N - IPV6_HLEN) as u32;
    let len = l4_len.to_be_bytes();
    let mut length_and_next_header = [len[0], len[1], len[2], len[3], 0, 0, 0, next_header];
    let base = packet.as_mut_ptr();
    // SAFETY: the ranges lie inside `packet` (addresses at 8..40, the message at IPV6_HLEN..N), whose
    // sizes (32, 8, N − 40) are multiples of 4 as the helper needs.
    let sum = unsafe {
        let addresses = bpf_csum_diff(core::ptr::null_mut(), 0, base.add(8).cast(), 32, 0);
        let words = length_and_next_header.as_mut_ptr().cast();
        let with_length = bpf_csum_diff(core::ptr::null_mut(), 0, words, 8, addresses as u32);
        bpf_csum_diff(core::ptr::null_mut(), 0, base.add(IPV6_HLEN).cast(), l4_len, with_length as u32)
    };
    if sum < 0 {
        return Err(failed);
    }
    // The helper sums 32-bit words as they lie in memory: folded, the value's bytes in memory order
    // are the field's.
    // Two folds take any 32-bit sum to 16 bits (a loop here would be one the verifier walks
    // thousands of times).
    let sum = sum as u64 & 0xffff_ffff;
    let folded = (sum & 0xffff) + (sum >> 16);
    let folded = (folded & 0xffff) + (folded >> 16);
    let check = (!(folded as u16)).to_ne_bytes();
    packet[IPV6_HLEN + check_at] = check[0];
    packet[IPV6_HLEN + check_at + 1] = check[1];
    Ok(())
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
        tcp_reset6_unsummed(&scratch.ip, &scratch.l4, flow.payload_len, &mut scratch.tcp_reset);
        fill_l4_checksum(&mut scratch.tcp_reset, IPPROTO_TCP, TCP_CHECK_AT)?;
        resize(ctx, ETH_HLEN + TCP_RESET6_LEN)?;
        ctx.store(ETH_HLEN, &scratch.tcp_reset, 0).map_err(failed)?;
    } else {
        load_into(ctx, flow.l4_offset, &mut scratch.udp).map_err(|_| Verdict::drop(Stat::RewriteFailed))?;
        icmp6_port_unreachable_unsummed(&scratch.ip, &scratch.udp, &mut scratch.icmp);
        fill_l4_checksum(&mut scratch.icmp, IPPROTO_ICMPV6, ICMP6_CHECK_AT)?;
        resize(ctx, ETH_HLEN + ICMP6_UNREACHABLE_LEN)?;
        ctx.store(ETH_HLEN, &scratch.icmp, 0).map_err(failed)?;
    }
    stats::count(stat);
    Ok(Verdict::BOUNCE)
}
