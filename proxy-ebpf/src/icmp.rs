//! ICMP errors about translated flows, on their way to the client: the quoted
//! client → backend packet becomes client → Service (see `proxy_common::icmp`).
use aya_ebpf::programs::TcContext;
use proxy_common::{
    icmp::{
        ICMP_ERROR_SPAN, ICMP_OFF_CHECK, IPPROTO_ICMP, QUOTE_OFF_CHECK, QUOTE_OFF_DADDR, QUOTE_OFF_DPORT,
        quoted,
    },
    packet::{ETH_HLEN, IP_OFF_CHECK, IP_OFF_SADDR},
    stats::Stat,
};

use crate::{Done, Verdict, conntrack, stats};

/// Un-NATs an ICMP error whose quote matches a conntrack reply entry: the
/// quoted destination (address, header checksum, port) goes back to the
/// Service, and so does the outer source when the backend itself sent the
/// error. Rewriting the quoted address together with its header checksum
/// leaves the ICMP checksum as it was; the quoted port is accounted for in it.
/// The quoted L4 checksum is left stale: receivers do not check a quote's.
/// Not inlined: a packet that is no ICMP error costs the caller one call.
#[inline(never)]
pub fn unnat_error(ctx: &TcContext) -> Result<Done, Verdict> {
    let outer: [u8; 20] = ctx.load(ETH_HLEN).map_err(|_| Verdict::Pass(Stat::PassNotTcpUdp))?;
    // Fragmented errors do not happen in practice; their quote would be cut.
    if outer[9] != IPPROTO_ICMP || outer[6] & 0x3f != 0 || outer[7] != 0 {
        return Err(Verdict::Pass(Stat::PassNotTcpUdp));
    }
    let icmp_at = ETH_HLEN + ((usize::from(outer[0] & 0x0f) * 4) & 0x3c);
    let message: [u8; ICMP_ERROR_SPAN] = ctx.load(icmp_at).map_err(|_| Verdict::Pass(Stat::PassNotTcpUdp))?;
    let quote = quoted(&message).ok_or(Verdict::Pass(Stat::PassNotTcpUdp))?;
    let entry = conntrack::lookup(&quote.reply_key()).ok_or(Verdict::Pass(Stat::PassNoService))?;
    // SAFETY: a map value valid for this program run; copied out at once.
    let (service, service_port, flags) = unsafe { ((*entry).nat_addr, (*entry).nat_port, (*entry).flags) };
    if flags != 0 {
        // Hairpin and source-NATed flows quote other addresses.
        return Err(Verdict::Pass(Stat::PassNoService));
    }
    let failed = |_| Verdict::Drop(Stat::RewriteFailed);
    let (backend, service_addr) =
        (u64::from(u32::from_ne_bytes(quote.daddr)), u64::from(u32::from_ne_bytes(service)));
    ctx.l3_csum_replace(icmp_at + QUOTE_OFF_CHECK, backend, service_addr, 4).map_err(failed)?;
    ctx.store(icmp_at + QUOTE_OFF_DADDR, &(service_addr as u32), 0).map_err(failed)?;
    if quote.dport != service_port {
        let (old, new) =
            (u64::from(u16::from_ne_bytes(quote.dport)), u64::from(u16::from_ne_bytes(service_port)));
        ctx.l4_csum_replace(icmp_at + ICMP_OFF_CHECK, old, new, 2).map_err(failed)?;
        ctx.store(icmp_at + QUOTE_OFF_DPORT, &(new as u16), 0).map_err(failed)?;
    }
    if outer[12..16] == quote.daddr {
        ctx.l3_csum_replace(ETH_HLEN + IP_OFF_CHECK, backend, service_addr, 4).map_err(failed)?;
        ctx.store(ETH_HLEN + IP_OFF_SADDR, &(service_addr as u32), 0).map_err(failed)?;
    }
    stats::count(Stat::IcmpErrorUnnat);
    Ok(Done::Next)
}
