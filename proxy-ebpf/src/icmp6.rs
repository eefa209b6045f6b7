//! ICMPv6 errors about translated IPv6 flows, on their way to the client (the egress program): the
//! quoted client → backend packet becomes the one the client sent — its destination back to the
//! Service, address and port, with the ICMPv6 checksum — and the outer source too when the backend
//! itself sent the error. Which messages, and the checks: `proxy_common::icmp6::quoted6`. The
//! quote's own L4 checksum is left stale, as for IPv4: receivers do not check a quote's.
use aya_ebpf::{bindings::BPF_F_PSEUDO_HDR, programs::TcContext};
use proxy_common::{
    icmp6::{ICMP6_OFF_CHECK, QUOTE6_OFF_DADDR, QUOTE6_OFF_DPORT, quoted6},
    maps_v6::CtKeyV6,
    packet::ETH_HLEN,
    packet6::{IP6_OFF_SADDR, IPV6_HLEN},
    stats::Stat,
};

use crate::{
    conntrack6, maps::ICMP6_SCRATCH, nat6::replace_addr, parse6::load_into, stats, verdict::Verdict,
};

/// Where an ICMPv6 error's outer header and the span of its message kproxy reads are loaded (a
/// per-CPU map: they would not fit on the egress chain's stack).
#[repr(C)]
pub struct Icmp6Scratch {
    pub outer: [u8; IPV6_HLEN],
    pub message: [u8; proxy_common::icmp6::ICMP6_ERROR_SPAN],
}

/// Not inlined: a stage of the IPv6 egress chain, for packets `parse6::flow` left alone.
#[inline(never)]
pub fn unnat_error(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let not_ours = Verdict::pass(Stat::PassNotTcpUdp);
    let scratch = ICMP6_SCRATCH.get_ptr_mut(0).ok_or(not_ours)?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let scratch = unsafe { &mut *scratch };
    load_into(ctx, ETH_HLEN, &mut scratch.outer).map_err(|_| not_ours)?;
    let at = ETH_HLEN + IPV6_HLEN;
    load_into(ctx, at, &mut scratch.message).map_err(|_| not_ours)?;
    let key: CtKeyV6 = quoted6(&scratch.outer, &scratch.message).ok_or(not_ours)?;
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let check = Some(at + ICMP6_OFF_CHECK);
    // SAFETY: a map value valid for this program run, read in place.
    let (vip, vip_port) = unsafe { (&(*entry).nat_addr, (*entry).nat_port) };
    // The quoted destination: inside the message, so in the ICMPv6 checksum as data.
    replace_addr(ctx, check, at + QUOTE6_OFF_DADDR, &key.saddr, vip, 0)?;
    if key.sport != vip_port {
        let (old, new) = (u64::from(u16::from_ne_bytes(key.sport)), u64::from(u16::from_ne_bytes(vip_port)));
        ctx.l4_csum_replace(at + ICMP6_OFF_CHECK, old, new, 2).map_err(failed)?;
        ctx.store(at + QUOTE6_OFF_DPORT, &(new as u16), 0).map_err(failed)?;
    }
    // Sent by the backend itself (a port unreachable): from the Service, through the pseudo-header.
    if scratch.outer[IP6_OFF_SADDR..IP6_OFF_SADDR + 16] == key.saddr {
        let flags = u64::from(BPF_F_PSEUDO_HDR);
        replace_addr(ctx, check, ETH_HLEN + IP6_OFF_SADDR, &key.saddr, vip, flags)?;
    }
    stats::count(Stat::IcmpErrorUnnat);
    Ok(Verdict::NEXT)
}
