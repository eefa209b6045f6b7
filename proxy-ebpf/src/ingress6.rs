//! The IPv6 path of `kproxy_ingress` (packets leaving a pod): ClusterIP DNAT with the semantics of
//! the IPv4 stages in `ingress.rs` — a known flow first (expired → a new flow; a UDP flow whose
//! backend is gone → rebalanced), then the frontend; refusal for a VIP without endpoints or on a
//! port it lacks; a TCP segment that is no SYN, with no flow, to a Service dropped; a local
//! backend's reply to a client masqueraded to a node address (a cluster IP reached from outside
//! `--cluster-cidr`) turned back and sent out to the client (`external6::snat_reply`). A chain of
//! its own (`run` is not inlined): its stages never share a call chain with IPv4's, so each family
//! has the 512-byte stack to itself beside the entry point's frame.
use core::ptr::null;

use aya_ebpf::programs::TcContext;
use proxy_common::{
    conntrack::{Clash, direct_may_clash, starts_tcp_flow},
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, IPPROTO_TCP,
        SVC_FLAG_NO_LOCAL_ENDPOINTS, SVC_FLAG_SOURCE_RANGES, ServiceValueV4,
    },
    maps_v6::{BackendV6, CtEntryV6, HAIRPIN_ADDR_V6},
    stats::Stat,
    trace::{EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_DROP_INVALID, EV_REJECT, EV_UNNAT},
};

use crate::{
    config, conntrack,
    conntrack6::{self, ReplyTo6},
    events, external6, fib, lb6,
    maps::{CHOICE6_SCRATCH, FLOW6_SCRATCH},
    nat6, parse6, reject6, snat6, stats,
    verdict::{Verdict, finish},
};

/// What [`classify`] decided; each case is a stage of its own, called from [`run`] (see
/// `ingress::Step` for why, and for the alignment).
#[repr(align(8))]
enum Step {
    Pass(Stat),
    Drop(Stat),
    /// A pod's reply to its own hairpin connection.
    HairpinReply,
    /// A local backend's reply to a flow masqueraded to a node address (`external6::source_nated`).
    SnatReply,
    Refuse,
    Established,
    NewFlow,
    /// A packet to no Service (a pod, most often).
    Direct,
}

/// What [`classify`] looked up, for the stage that follows: raw pointers, null when absent.
struct Found {
    frontend: *const ServiceValueV4,
    entry: *mut CtEntryV6,
    now: u64,
    /// Where a new flow's replies come back to: the client's port, or its remapped one.
    reply_to: ReplyTo6,
}

/// An IPv6 packet leaving a pod, carried out to the end: the kernel's action.
#[inline(never)]
pub fn run(ctx: &TcContext) -> i32 {
    let result = ingress(ctx);
    // Only a masqueraded flow's reply is redirected, along the route `external6::snat_reply` wrote:
    // the other packets of a pod veth pay no lookup for it.
    let route = if result == Ok(Verdict::REDIRECT) { external6::redirect_route() } else { &fib::Route::NONE };
    finish(ctx, result, route)
}

#[inline(always)]
fn ingress(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let flow = FLOW6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    match parse6::flow(ctx, flow) {
        Ok(()) => {}
        Err(Stat::PassNotTcpUdp) if lb6::unallocated_other_protocol(ctx) => {
            return Err(Verdict::drop(Stat::DropUnallocatedServiceIp));
        }
        Err(stat) => return Err(Verdict::pass(stat)),
    }
    let mut found = Found {
        frontend: core::ptr::null(),
        entry: core::ptr::null_mut(),
        now: 0,
        reply_to: ReplyTo6::client(flow.sport),
    };
    match classify(flow, &mut found) {
        Step::Pass(stat) => Err(Verdict::pass(stat)),
        Step::Drop(stat) => {
            if matches!(stat, Stat::DropInvalidTcp) {
                events::step6(ctx, flow, EV_DROP_INVALID, found.frontend);
            }
            Err(Verdict::drop(stat))
        }
        // A later fragment follows the translation its first fragment made; it never starts a
        // flow nor answers for a refused one.
        Step::Refuse | Step::NewFlow if !flow.has_l4_header() => Err(Verdict::pass(Stat::PassFragment)),
        Step::HairpinReply => {
            hairpin_reply(ctx, flow).inspect(|_| events::step6(ctx, flow, EV_UNNAT, null()))
        }
        Step::SnatReply => {
            external6::snat_reply(ctx, flow).inspect(|_| events::step6(ctx, flow, EV_UNNAT, null()))
        }
        Step::Refuse => {
            events::step6(ctx, flow, EV_REJECT, found.frontend);
            refuse(ctx, flow)
        }
        Step::Established => {
            established(ctx, flow, &found).inspect(|_| events::step6(ctx, flow, EV_DNAT_ESTABLISHED, null()))
        }
        Step::NewFlow => new_flow_stages(ctx, flow, &mut found)
            .inspect(|_| events::step6(ctx, flow, EV_DNAT_NEW, found.frontend)),
        // Untouched, unless a translated flow of the same client already has its reply tuple: the
        // client reused a source port for a pod it had reached through a Service. The translated
        // flow yields the tuple if it is over; otherwise this flow's source port is remapped, so
        // that the replies of each reach the right socket (netfilter's clash resolution).
        Step::Direct => match conntrack6::claim(flow, &flow.daddr, flow.dport, false) {
            Some(Clash::Remap) => {
                let now = conntrack::now();
                let port = snat6::remap(flow, &flow.daddr, flow.dport, &flow.saddr, now)?;
                direct(ctx, flow, now, port)
            }
            _ => Err(Verdict::pass(Stat::PassNoService)),
        },
    }
}

/// A new flow's stages: its backend picked, its reply tuple claimed (or its source port remapped),
/// recorded and DNATed.
#[inline(always)]
fn new_flow_stages(ctx: &TcContext, flow: &parse6::Flow6, found: &mut Found) -> Result<Verdict, Verdict> {
    // In a per-CPU map rather than this frame: the chain through `new_flow` would otherwise take
    // the whole 512 bytes.
    let choice = CHOICE6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::NoBackend))?;
    // SAFETY: a per-CPU value, used by this program run alone; `classify` set the frontend to a
    // map value before choosing this step.
    let (choice, frontend) = unsafe { (&mut *choice, &*found.frontend) };
    lb6::select_backend(flow, frontend, found.now, choice)?;
    // A live flow of this client may already have the reply tuple (the same backend through
    // another Service, or directly from this port; for a pod reaching itself, its hairpin flow
    // from this port to another of its Services): this one's source port is then remapped.
    let backend = &choice.backend;
    let hairpin = backend.addr == flow.saddr;
    if conntrack6::claim(flow, &backend.addr, backend.port, hairpin).is_some() {
        let source = if hairpin { &HAIRPIN_ADDR_V6 } else { &flow.saddr };
        let port = snat6::remap(flow, &backend.addr, backend.port, source, found.now)?;
        found.reply_to = ReplyTo6::remap(port, false);
    }
    let verdict = new_flow(ctx, flow, found, choice)?;
    if found.reply_to.is(CT_FLAG_REMAP) {
        // In a stage of its own: `new_flow` has no room left for it. A hairpin flow is still
        // bounced back to the pod.
        return remapped_source(ctx, flow, found.reply_to.port).map(|_| verdict);
    }
    Ok(verdict)
}

#[inline(never)]
fn classify(flow: &parse6::Flow6, found: &mut Found) -> Step {
    if flow.daddr == HAIRPIN_ADDR_V6 {
        return Step::HairpinReply;
    }
    let (snat_min, snat_max) = config::nodeport().port_range();
    let dport = u16::from_be_bytes(flow.dport);
    if dport >= snat_min && dport <= snat_max && external6::is_snat_reply(flow) {
        return Step::SnatReply;
    }
    let key = flow.ct_key(CT_DIR_FORWARD);
    // A known flow before its frontend: it continues after its Service (or the port) is deleted.
    if let Some(entry) = conntrack6::known_flow(&key, flow.proto, &mut found.now) {
        found.entry = entry;
        return Step::Established;
    }

    let Some(frontend) = lb6::lookup_frontend(flow) else {
        if lb6::is_vip(&flow.daddr) {
            // A port the Service does not have.
            return Step::Refuse;
        }
        // kube-proxy's cluster-ips-check, as IPv4's: an unallocated address of the service range
        // never leaves the node.
        if lb6::in_service_cidr(&flow.daddr) {
            return Step::Drop(Stat::DropUnallocatedServiceIp);
        }
        // Only a packet that may start a flow can clash (UDP, a bare TCP SYN): established TCP to
        // a pod pays no lookup for it (the SYN that opened it had the clash resolved).
        if flow.has_l4_header() && direct_may_clash(flow.proto, flow.tcp_flags) {
            return Step::Direct;
        }
        return Step::Pass(Stat::PassNoService);
    };
    found.now = conntrack::now();
    // Named in the trace events of a refusal or a dropped segment too.
    found.frontend = frontend;
    // Pods are filtered too, as IPv4's (kube-proxy checks every source before DNAT).
    if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0 && !lb6::source_allowed(frontend.rev_nat_id, flow.saddr) {
        return Step::Drop(Stat::DropSourceRange);
    }
    if flow.proto == IPPROTO_TCP && !starts_tcp_flow(flow.tcp_flags) {
        // No connection is known for this segment: translating it would start a flow
        // mid-stream, and passing it would leak it to the VIP.
        return Step::Drop(Stat::DropInvalidTcp);
    }
    if frontend.count == 0 {
        if frontend.flags & SVC_FLAG_NO_LOCAL_ENDPOINTS != 0 {
            return Step::Drop(Stat::DropNoLocalEndpoint);
        }
        return Step::Refuse;
    }
    Step::NewFlow
}

/// A packet of a known flow: to the backend its forward entry records.
#[inline(never)]
fn established(ctx: &TcContext, flow: &parse6::Flow6, found: &Found) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_FORWARD);
    let entry = found.entry;
    // SAFETY: `classify` set it to a map value before choosing this step. The flow's translation
    // lives or dies as one: a busy forward entry keeps its reply entry from being evicted first.
    let (backend, backend_port, flags) = unsafe {
        conntrack6::touch(entry, flow, CT_DIR_FORWARD, found.now);
        conntrack6::keep_reply(&key, entry);
        (&(*entry).nat_addr, (*entry).nat_port, (*entry).flags)
    };
    nat6::rewrite_destination(ctx, flow, backend, backend_port)?;
    stats::count(Stat::DnatEstablished);
    if flags & CT_FLAG_REMAP != 0 {
        // The remapped port was evicted: nothing could un-NAT the replies.
        let port = snat6::forward(&key).ok_or(Verdict::drop(Stat::ConntrackInsertFailed))?;
        nat6::rewrite_source_port(ctx, flow, port)?;
    }
    if flags & CT_FLAG_HAIRPIN != 0 {
        nat6::rewrite_source_addr(ctx, flow, &HAIRPIN_ADDR_V6)?;
        return Ok(Verdict::BOUNCE);
    }
    Ok(Verdict::NEXT)
}

/// The first packet of a flow, its backend picked (`lb6::select_backend`): the flow recorded
/// (reply entry first), DNAT.
#[inline(never)]
fn new_flow(
    ctx: &TcContext,
    flow: &parse6::Flow6,
    found: &Found,
    choice: &lb6::Choice6,
) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_FORWARD);
    // SAFETY: `classify` set it to a map value before choosing this step.
    let frontend = unsafe { &*found.frontend };
    let (backend_id, backend) = (choice.backend_id, &choice.backend);
    // The pod reached itself: its source becomes the hairpin address, so that its answer comes
    // back through this program (as IPv4's hairpin), and the packet goes straight back to it.
    let hairpin = backend.addr == flow.saddr;
    let reply_to = if hairpin { found.reply_to.with_flag(CT_FLAG_HAIRPIN) } else { found.reply_to };
    conntrack6::create(flow, &key, backend, backend_id, frontend.rev_nat_id, found.now, reply_to)?;
    nat6::rewrite_destination(ctx, flow, &backend.addr, backend.port)?;
    stats::count(Stat::DnatNew);
    if hairpin {
        nat6::rewrite_source_addr(ctx, flow, &HAIRPIN_ADDR_V6)?;
        stats::count(Stat::Hairpin);
        return Ok(Verdict::BOUNCE);
    }
    Ok(Verdict::NEXT)
}

/// A new flow's source port becomes its remapped one (`Found::reply_to`).
#[inline(never)]
fn remapped_source(ctx: &TcContext, flow: &parse6::Flow6, port: [u8; 2]) -> Result<Verdict, Verdict> {
    nat6::rewrite_source_port(ctx, flow, port)?;
    stats::count(Stat::PortRemapped);
    Ok(Verdict::NEXT)
}

/// A packet to a pod's own address whose reply tuple a live translated flow of the client has
/// (`Step::Direct`): recorded as a direct flow (`CT_FLAG_DIRECT`) on the remapped source `port`,
/// so that its replies get the client's port back and are never un-NATed to the Service. The
/// external chain's too (`external6`: an outside client reaching a pod's address directly, on a
/// routed pod network).
#[inline(never)]
pub fn direct(ctx: &TcContext, flow: &parse6::Flow6, now: u64, port: [u8; 2]) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_FORWARD);
    let pod = BackendV6 { addr: flow.daddr, port: flow.dport, proto: flow.proto, flags: 0 };
    conntrack6::create(flow, &key, &pod, 0, 0, now, ReplyTo6::remap(port, true))?;
    nat6::rewrite_source_port(ctx, flow, port)?;
    stats::count(Stat::PortRemapped);
    Ok(Verdict::NEXT)
}

/// A pod's reply to its own hairpin connection, addressed to the hairpin address: the source goes
/// back to the Service and the destination back to the pod (at its own port, for a remapped
/// flow), and the packet returns to the pod.
#[inline(never)]
fn hairpin_reply(ctx: &TcContext, flow: &parse6::Flow6) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let now = conntrack::now();
    // SAFETY: a map value valid for this program run, read in place.
    // SAFETY: as below.
    let remapped = unsafe { (*entry).flags } & CT_FLAG_REMAP != 0;
    // A remapped hairpin flow (the pod reused a port for another of its Services): its own port
    // back, from SNAT_V6.
    let client_port = if remapped {
        snat6::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?
    } else {
        flow.dport
    };
    let (vip, vip_port) = unsafe {
        conntrack6::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack6::track_reply(
            entry,
            flow,
            &(flow.saddr, client_port),
            &((*entry).nat_addr, (*entry).nat_port),
        );
        (&(*entry).nat_addr, (*entry).nat_port)
    };
    nat6::rewrite_source(ctx, flow, vip, vip_port)?;
    nat6::rewrite_destination(ctx, flow, &flow.saddr, client_port)?;
    stats::count(Stat::ReverseNat);
    Ok(Verdict::BOUNCE)
}

/// Not inlined, so that the packet buffers of a refusal are not part of [`run`]'s frame.
#[inline(never)]
fn refuse(ctx: &TcContext, flow: &parse6::Flow6) -> Result<Verdict, Verdict> {
    reject6::refuse(ctx, flow)
}
