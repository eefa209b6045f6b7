//! ICMPv6 errors about translated IPv6 flows, on their way to the client (the egress program): the
//! quoted client → backend packet becomes the one the client sent — its destination back to the
//! Service, address and port, with the ICMPv6 checksum — and the outer source too when the backend
//! itself sent the error — and for a flow whose source port was remapped (port reuse) its source
//! port back to the client's own. Which messages, and the checks: `proxy_common::icmp6::quoted6`. The
//! quote's own L4 checksum is left stale, as for IPv4: receivers do not check a quote's.
//!
//! On an external interface (`unnat_snat_error`), an error addressed to the node about a flow it
//! source-NATed to a remote backend — packet too big from a link between the nodes above all — is
//! turned into one about the packet the client sent and sent straight to the client, as IPv4's
//! `icmp::unnat_snat_error`.
use aya_ebpf::{bindings::BPF_F_PSEUDO_HDR, programs::TcContext};
use proxy_common::{
    icmp6::{
        ICMP6_OFF_CHECK, QUOTE6_OFF_DADDR, QUOTE6_OFF_DPORT, QUOTE6_OFF_SADDR, QUOTE6_OFF_SPORT, quoted6,
    },
    maps::{CT_FLAG_REMAP, CT_FLAG_SNAT},
    maps_v6::CtKeyV6,
    packet::ETH_HLEN,
    packet6::{IP6_OFF_DADDR, IP6_OFF_SADDR, IPV6_HLEN},
    stats::Stat,
};

use crate::{
    conntrack6, events,
    fib::{self, ingress_ifindex},
    fib6,
    maps::ICMP6_SCRATCH,
    nat6::replace_addr,
    parse6::load_into,
    snat6, stats,
    verdict::Verdict,
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
    let check = Some(at + ICMP6_OFF_CHECK);
    // SAFETY: a map value valid for this program run, read in place.
    let (vip, vip_port, flags) = unsafe { (&(*entry).nat_addr, (*entry).nat_port, (*entry).flags) };
    // A flow whose source port was remapped (port reuse): the quote gets the client's own port, or
    // the client's stack finds no socket for it (a packet too big would be lost on the flow). Its
    // remapped port gone from SNAT_V6, nothing can say which port that was.
    if flags & CT_FLAG_REMAP != 0 {
        let client_port = snat6::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
        replace_port(ctx, at + QUOTE6_OFF_SPORT, key.dport, client_port)?;
    }
    // The quoted destination: inside the message, so in the ICMPv6 checksum as data.
    replace_addr(ctx, check, at + QUOTE6_OFF_DADDR, &key.saddr, vip, 0)?;
    replace_port(ctx, at + QUOTE6_OFF_DPORT, key.sport, vip_port)?;
    // Sent by the backend itself (a port unreachable): from the Service, through the pseudo-header.
    if scratch.outer[IP6_OFF_SADDR..IP6_OFF_SADDR + 16] == key.saddr {
        let flags = u64::from(BPF_F_PSEUDO_HDR);
        replace_addr(ctx, check, ETH_HLEN + IP6_OFF_SADDR, &key.saddr, vip, flags)?;
    }
    stats::count(Stat::IcmpErrorUnnat);
    events::icmp_step6(ctx, &key, entry);
    Ok(Verdict::NEXT)
}

/// An ICMPv6 error arriving on an external interface, addressed to a node address about a flow
/// source-NATed to a remote backend (the quote is `node:SNAT port → backend`, a `CT_FLAG_SNAT`
/// reply entry): the quote becomes the client's packet (`client:port → frontend`), the outer
/// destination the client, the outer source the frontend when the backend itself sent it, and the
/// error is sent out to the client along `route` (the program's, in a per-CPU map; null: none).
/// Anything else passes as it is. Not inlined: a
/// stage of the IPv6 external chain, for packets `parse6::flow` left alone.
#[inline(never)]
pub fn unnat_snat_error(ctx: &TcContext, route: *mut fib::Route) -> Result<Verdict, Verdict> {
    let not_ours = Verdict::pass(Stat::PassNotTcpUdp);
    if route.is_null() {
        return Err(not_ours);
    }
    let scratch = ICMP6_SCRATCH.get_ptr_mut(0).ok_or(not_ours)?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let scratch = unsafe { &mut *scratch };
    load_into(ctx, ETH_HLEN, &mut scratch.outer).map_err(|_| not_ours)?;
    let at = ETH_HLEN + IPV6_HLEN;
    load_into(ctx, at, &mut scratch.message).map_err(|_| not_ours)?;
    // The reply key `backend → node address:SNAT port`; `quoted6` checked the error is addressed to
    // the quote's source, the node address.
    let key: CtKeyV6 = quoted6(&scratch.outer, &scratch.message).ok_or(not_ours)?;
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let client = snat6::reverse_entry(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    let check = Some(at + ICMP6_OFF_CHECK);
    // SAFETY: map values valid for this program run, read in place.
    let (frontend, frontend_port, flags, client, client_port) =
        unsafe { (&(*entry).nat_addr, (*entry).nat_port, (*entry).flags, &(*client).addr, (*client).port) };
    if flags & CT_FLAG_SNAT == 0 {
        return Err(Verdict::pass(Stat::PassNoService));
    }
    // The quote, inside the message: in the ICMPv6 checksum as data.
    replace_addr(ctx, check, at + QUOTE6_OFF_SADDR, &key.daddr, client, 0)?;
    replace_port(ctx, at + QUOTE6_OFF_SPORT, key.dport, client_port)?;
    replace_addr(ctx, check, at + QUOTE6_OFF_DADDR, &key.saddr, frontend, 0)?;
    replace_port(ctx, at + QUOTE6_OFF_DPORT, key.sport, frontend_port)?;
    // The outer addresses, through the pseudo-header.
    let pseudo = u64::from(BPF_F_PSEUDO_HDR);
    replace_addr(ctx, check, ETH_HLEN + IP6_OFF_DADDR, &key.daddr, client, pseudo)?;
    let mut source = &scratch.outer[IP6_OFF_SADDR..IP6_OFF_SADDR + 16];
    if source == key.saddr {
        replace_addr(ctx, check, ETH_HLEN + IP6_OFF_SADDR, &key.saddr, frontend, pseudo)?;
        source = frontend;
    }
    let source: &[u8; 16] = source.try_into().map_err(|_| not_ours)?;
    stats::count(Stat::IcmpErrorUnnat);
    events::icmp_step6(ctx, &key, entry);
    // SAFETY: the caller's per-CPU route, written here alone.
    fib6::route(ctx, ingress_ifindex(ctx), source, client, unsafe { &mut *route })?;
    Ok(Verdict::REDIRECT)
}

/// A port inside the ICMPv6 message (the quote), `old` → `new`, with the message's checksum.
#[inline(always)]
fn replace_port(ctx: &TcContext, offset: usize, old: [u8; 2], new: [u8; 2]) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    let failed = |_| Verdict::drop(Stat::RewriteFailed);
    let (old, new) = (u64::from(u16::from_ne_bytes(old)), u64::from(u16::from_ne_bytes(new)));
    ctx.l4_csum_replace(ETH_HLEN + IPV6_HLEN + ICMP6_OFF_CHECK, old, new, 2).map_err(failed)?;
    ctx.store(offset, &(new as u16), 0).map_err(failed)
}
