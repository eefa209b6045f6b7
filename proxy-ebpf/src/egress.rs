//! The tc egress stage (`kproxy_egress`, packets entering a pod): a reply of
//! a translated flow comes from the Service again, and an ICMP error about
//! one quotes what the client sent.
use aya_ebpf::programs::TcContext;
use proxy_common::{
    maps::{CT_DIR_REPLY, CT_FLAG_DIRECT, CT_FLAG_REMAP},
    stats::Stat,
};

use crate::{conntrack, events, icmp, maps::FLOW_SCRATCH, nat, parse, snat, stats, verdict::Verdict};

pub fn egress(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let flow = FLOW_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    let flow: &parse::Flow = match parse::flow(ctx, flow) {
        Ok(()) => flow,
        Err(Stat::PassNotTcpUdp) => return icmp::unnat_error(ctx),
        Err(stat) => return Err(Verdict::pass(stat)),
    };
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let now = conntrack::now();
    // SAFETY: as in `ingress`.
    let reply = unsafe { *entry };
    // Where the client sent the flow, and from which port (a remapped flow's
    // is in SNAT_V4).
    let client_port = if reply.flags & CT_FLAG_REMAP != 0 {
        snat::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?.port
    } else {
        flow.dport
    };
    // SAFETY: as in `ingress`.
    unsafe {
        conntrack::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack::track_reply(entry, flow, (flow.daddr, client_port), (reply.nat_addr, reply.nat_port));
    }
    nat::rewrite_tuple(ctx, flow, (reply.nat_addr, flow.daddr, reply.nat_port, client_port))?;
    if reply.flags & CT_FLAG_DIRECT == 0 {
        stats::count(Stat::ReverseNat);
    }
    // SAFETY: as in `ingress`.
    let entry = unsafe { &*entry };
    events::unnat(flow, entry, ((reply.nat_addr, reply.nat_port), (flow.daddr, client_port)), now);
    Ok(Verdict::NEXT)
}
