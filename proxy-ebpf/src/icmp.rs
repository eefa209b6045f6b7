//! ICMP errors about translated flows, on their way to the client: the quoted
//! packet becomes the one the client sent (see `proxy_common::icmp`).
//!
//! Rewriting a quoted address together with the quote's header checksum leaves
//! the ICMP checksum as it was; quoted ports are accounted for in it. The
//! quote's own L4 checksum is left stale: receivers do not check a quote's.
//!
//! Only an error addressed to the quoted packet's source is rewritten, and
//! only inside its IP datagram (`proxy_common::icmp::error_message_offset`):
//! what follows the IP total length is padding, never read as the quote.
use aya_ebpf::programs::TcContext;
use proxy_common::{
    icmp::{
        ICMP_ERROR_SPAN, ICMP_OFF_CHECK, QUOTE_OFF_CHECK, QUOTE_OFF_DADDR, QUOTE_OFF_DPORT, QUOTE_OFF_SADDR,
        QUOTE_OFF_SPORT, Quote, error_message_offset, quoted,
    },
    maps::{CT_FLAG_DIRECT, CT_FLAG_REMAP, CT_FLAG_SNAT},
    packet::{ETH_HLEN, IP_OFF_CHECK, IP_OFF_DADDR, IP_OFF_SADDR},
    stats::Stat,
};

use crate::{conntrack, events, fib, snat, stats, verdict::Verdict};

/// An ICMP error's outer header, where its message starts, and what it quotes.
struct Error {
    outer: [u8; 20],
    at: usize,
    quote: Quote,
}

/// Every access to the message stays inside the IP datagram: the span read
/// (and the fields rewritten in it) must fit in the IP total length.
#[inline(always)]
fn read(ctx: &TcContext) -> Result<Error, Verdict> {
    let not_ours = || Verdict::pass(Stat::PassNotTcpUdp);
    let outer: [u8; 20] = ctx.load(ETH_HLEN).map_err(|_| not_ours())?;
    let header_len = error_message_offset(&outer).ok_or_else(not_ours)?;
    // Bounded for the verifier: IHL is at most 15 words.
    let at = ETH_HLEN + (header_len & 0x3c);
    let message: [u8; ICMP_ERROR_SPAN] = ctx.load(at).map_err(|_| not_ours())?;
    let quote = quoted(&outer, &message).ok_or_else(not_ours)?;
    Ok(Error { outer, at, quote })
}

#[inline(always)]
fn failed(_: i64) -> Verdict {
    Verdict::drop(Stat::RewriteFailed)
}

/// An address of the quote, with the quote's header checksum.
#[inline(always)]
fn quoted_addr(
    ctx: &TcContext,
    error: &Error,
    field: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), Verdict> {
    let (old, new) = (u64::from(u32::from_ne_bytes(old)), u64::from(u32::from_ne_bytes(new)));
    ctx.l3_csum_replace(error.at + QUOTE_OFF_CHECK, old, new, 4).map_err(failed)?;
    ctx.store(error.at + field, &(new as u32), 0).map_err(failed)
}

/// A port of the quote, with the ICMP checksum.
#[inline(always)]
fn quoted_port(
    ctx: &TcContext,
    error: &Error,
    field: usize,
    old: [u8; 2],
    new: [u8; 2],
) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (u64::from(u16::from_ne_bytes(old)), u64::from(u16::from_ne_bytes(new)));
    ctx.l4_csum_replace(error.at + ICMP_OFF_CHECK, old, new, 2).map_err(failed)?;
    ctx.store(error.at + field, &(new as u16), 0).map_err(failed)
}

/// An address of the outer header, with its checksum.
#[inline(always)]
fn outer_addr(ctx: &TcContext, field: usize, old: [u8; 4], new: [u8; 4]) -> Result<(), Verdict> {
    let (old, new) = (u64::from(u32::from_ne_bytes(old)), u64::from(u32::from_ne_bytes(new)));
    ctx.l3_csum_replace(ETH_HLEN + IP_OFF_CHECK, old, new, 4).map_err(failed)?;
    ctx.store(ETH_HLEN + field, &(new as u32), 0).map_err(failed)
}

#[inline(always)]
fn outer_saddr(error: &Error) -> [u8; 4] {
    [error.outer[12], error.outer[13], error.outer[14], error.outer[15]]
}

#[inline(always)]
fn outer_daddr(error: &Error) -> [u8; 4] {
    [error.outer[16], error.outer[17], error.outer[18], error.outer[19]]
}

/// On a pod's veth (egress): an error to the client about its DNATed flow,
/// from the backend or a router on the way. The quoted destination goes back
/// to the Service, and so does the outer source when the backend itself sent
/// the error.
/// Not inlined: a packet that is no ICMP error costs the caller one call.
#[inline(never)]
pub fn unnat_error(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let error = read(ctx)?;
    let quote = error.quote;
    let entry = conntrack::lookup(&quote.reply_key()).ok_or(Verdict::pass(Stat::PassNoService))?;
    // SAFETY: a map value valid for this program run; copied out at once.
    let (service, service_port, flags) = unsafe { ((*entry).nat_addr, (*entry).nat_port, (*entry).flags) };
    if flags & !(CT_FLAG_REMAP | CT_FLAG_DIRECT) != 0 {
        // Hairpin flows quote the hairpin address; source-NATed ones reach the
        // node, not a pod (see `unnat_snat_error`).
        return Err(Verdict::pass(Stat::PassNoService));
    }
    if flags & CT_FLAG_REMAP != 0 {
        // The client's socket knows its own port, not the remapped one.
        let client = snat::reverse(&quote.reply_key()).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
        quoted_port(ctx, &error, QUOTE_OFF_SPORT, quote.sport, client.port)?;
    }
    if service != quote.daddr {
        quoted_addr(ctx, &error, QUOTE_OFF_DADDR, quote.daddr, service)?;
    }
    quoted_port(ctx, &error, QUOTE_OFF_DPORT, quote.dport, service_port)?;
    let source = outer_saddr(&error);
    if source == quote.daddr {
        outer_addr(ctx, IP_OFF_SADDR, source, service)?;
    }
    stats::count(Stat::IcmpErrorUnnat);
    // SAFETY: a map value valid for this program run.
    events::icmp_unnat(&quote, unsafe { &*entry }, ((quote.saddr, quote.sport), (service, service_port)));
    Ok(Verdict::NEXT)
}

/// On an external interface (ingress): an error addressed to the node address
/// a flow was source-NATed to, about that flow to a remote backend —
/// "fragmentation needed" from a router on the way, above all, or the client's
/// TCP never learns the path's MTU. The quote becomes client → frontend, the
/// error goes to the client (from the frontend when the backend sent it) and
/// leaves at once.
#[inline(never)]
pub fn unnat_snat_error(ctx: &TcContext, route: &mut fib::Route) -> Result<Verdict, Verdict> {
    let error = read(ctx)?;
    let quote = error.quote;
    let key = quote.reply_key();
    let entry = conntrack::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    // SAFETY: a map value valid for this program run; copied out at once.
    let (frontend, frontend_port, flags) = unsafe { ((*entry).nat_addr, (*entry).nat_port, (*entry).flags) };
    if flags & CT_FLAG_SNAT == 0 {
        return Err(Verdict::pass(Stat::PassNoService));
    }
    let client = snat::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    quoted_addr(ctx, &error, QUOTE_OFF_SADDR, quote.saddr, client.addr)?;
    quoted_port(ctx, &error, QUOTE_OFF_SPORT, quote.sport, client.port)?;
    quoted_addr(ctx, &error, QUOTE_OFF_DADDR, quote.daddr, frontend)?;
    quoted_port(ctx, &error, QUOTE_OFF_DPORT, quote.dport, frontend_port)?;
    let mut source = outer_saddr(&error);
    if source == quote.daddr {
        outer_addr(ctx, IP_OFF_SADDR, source, frontend)?;
        source = frontend;
    }
    // The old value is the header's own: `quoted` took only errors addressed
    // to the quote's source, the node address the flow was source-NATed to.
    outer_addr(ctx, IP_OFF_DADDR, outer_daddr(&error), client.addr)?;
    stats::count(Stat::IcmpErrorUnnat);
    // SAFETY: as above.
    events::icmp_unnat(&quote, unsafe { &*entry }, ((client.addr, client.port), (frontend, frontend_port)));
    *route = fib::route(ctx, fib::ingress_ifindex(ctx), source, client.addr, fib::CHECK_SKB)?;
    Ok(Verdict::REDIRECT)
}
