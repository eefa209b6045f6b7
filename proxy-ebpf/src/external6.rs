//! The IPv6 path of `kproxy_external_ingress` (packets arriving on an external interface):
//! NodePorts, ExternalIPs and LoadBalancer IPs with the semantics of the IPv4 stages in
//! `ingress.rs` —
//! - a backend's reply to a source-NATed flow (to a node address and a port of the SNAT range,
//!   with a `CT_FLAG_SNAT` reply entry) goes back to the client from the frontend, sent out
//!   directly (`snat_reply`);
//! - a known flow first (expired → a new flow; a UDP flow whose backend is gone → rebalanced);
//! - then the frontend, its `externalTrafficPolicy: Local` entry (`SCOPE_EXTERNAL`: this node's
//!   endpoints only, dropped when it has none) before the internal one;
//! - a new flow to a backend reached back out of the interface it came in on (another node) is
//!   source-NATed to the interface's IPv6 address (EXTERNAL_IFACES_V6) and a free port of the SNAT
//!   range (`snat6::remap`, the port-reuse search with the node's address), recorded with
//!   `CT_FLAG_SNAT` and sent out with the route's MACs (`fib6`); one to a local backend is DNATed
//!   only and its replies are un-NATed by the external interface's egress (`egress6`).
//!
//! - traffic to no frontend passes, unless it reuses the reply tuple of a live translated flow of the
//!   same client (an outside client reaching a pod's address directly, on a routed pod network):
//!   its source port is then remapped, as on the pod veths (`ingress6::direct`).
//!
//! A chain of its own, as `ingress6`: `run` is not inlined, so its stages never share a call chain
//! with IPv4's. The packet (`FLOW6_SCRATCH`), a new flow's backend (`CHOICE6_SCRATCH`) and the
//! route and node address (`EXTERNAL6_SCRATCH`) live in per-CPU maps. A client outside
//! `--cluster-cidr`'s IPv6 prefix reaching a cluster IP is masqueraded to a local backend too
//! (`source_nated`; the backend's reply is turned back on its veth, `ingress6`). Source ranges are SOURCE_RANGES_V6's (`lb6::source_allowed`), Maglev tables
//! MAGLEV_V4's (`lb6::select_backend_in`).
use aya_ebpf::programs::TcContext;
use proxy_common::{
    conntrack::{Clash, direct_may_clash, starts_tcp_flow},
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_REMAP, CT_FLAG_SNAT, IPPROTO_TCP, SCOPE_EXTERNAL,
        SCOPE_INTERNAL, SVC_FLAG_EXTERNAL_ADDR, SVC_FLAG_NO_LOCAL_ENDPOINTS, SVC_FLAG_SOURCE_RANGES,
        ServiceValueV4,
    },
    maps_v6::CtEntryV6,
    stats::Stat,
    trace::{EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_REJECT, EV_UNNAT},
};

use crate::{
    config, conntrack,
    conntrack6::{self, ReplyTo6},
    events,
    fib::{self, ingress_ifindex},
    fib6, icmp6, ingress6, lb6,
    maps::{CHOICE6_SCRATCH, EXTERNAL_IFACES_V6, EXTERNAL6_SCRATCH, FLOW6_SCRATCH},
    nat6, parse6, reject6, snat6, stats,
    verdict::{Verdict, finish},
};

/// What the stages of one packet share besides [`Found`]: where a redirected packet goes, and the
/// node address a new flow is source-NATed to. In a per-CPU map (not pinned): on the stack they
/// would take 36 of the chain's 512 bytes.
#[repr(C)]
pub struct External6 {
    pub route: fib::Route,
    pub node_addr: [u8; 16],
}

/// What [`classify`] decided; each case is a stage of its own, called from [`run`] (see
/// `ingress::Step` for why, and for the alignment).
#[repr(align(8))]
enum Step {
    Pass(Stat),
    Drop(Stat),
    /// A backend's reply to a source-NATed flow.
    SnatReply,
    Refuse,
    Established,
    NewFlow,
    /// A packet to no frontend (a pod's address, on a routed pod network).
    Direct,
}

/// What [`classify`] looked up, for the stage that follows: raw pointers, null when absent.
struct Found {
    frontend: *const ServiceValueV4,
    entry: *mut CtEntryV6,
    now: u64,
    /// Where a new flow's replies come back to: the client's port, a remapped one, or the SNAT port.
    reply_to: ReplyTo6,
    /// The frontend entry's scope (`SCOPE_EXTERNAL` for policy Local's).
    scope: u8,
    _pad: [u8; 3],
}

/// This CPU's [`External6`]: the stages that use it look it up themselves rather than have it
/// passed, which would keep one more pointer in [`run`]'s frame. A stage that ends in
/// `Verdict::REDIRECT` has written its route.
#[inline(always)]
fn shared() -> Result<&'static mut External6, Verdict> {
    let shared = shared_ptr();
    if shared.is_null() {
        return Err(Verdict::drop(Stat::FibLookupFailed));
    }
    // SAFETY: a per-CPU value, used by this program run alone.
    Ok(unsafe { &mut *shared })
}

/// Not inlined, so that the map key has a stack slot of its own (see `stats::count_index`): in a
/// stage's frame it may land on a dead local that held a pointer, which the verifier refuses to
/// programs without CAP_PERFMON. Null when the map has no entry.
#[inline(never)]
fn shared_ptr() -> *mut External6 {
    EXTERNAL6_SCRATCH.get_ptr_mut(0).unwrap_or_default()
}

/// Where this CPU's redirected packet goes: the route the stage that redirected it wrote (none when
/// the map has no entry).
#[inline(always)]
pub(crate) fn redirect_route() -> &'static fib::Route {
    match shared() {
        Ok(shared) => &shared.route,
        Err(_) => &fib::Route::NONE,
    }
}

/// An IPv6 packet arriving on an external interface, carried out to the end: the kernel's action.
#[inline(never)]
pub fn run(ctx: &TcContext) -> i32 {
    let result = ingress(ctx);
    finish(ctx, result, redirect_route())
}

#[inline(always)]
fn ingress(ctx: &TcContext) -> Result<Verdict, Verdict> {
    let flow = FLOW6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    match parse6::flow(ctx, flow) {
        Ok(()) => {}
        // An ICMPv6 error about a source-NATed flow goes to its client; other ICMPv6 (neighbour
        // discovery above all) is never touched.
        Err(Stat::PassNotTcpUdp) if lb6::unallocated_other_protocol(ctx) => {
            return Err(Verdict::drop(Stat::DropUnallocatedServiceIp));
        }
        Err(Stat::PassNotTcpUdp) => return icmp6::unnat_snat_error(ctx, shared_ptr().cast()),
        Err(stat) => return Err(Verdict::pass(stat)),
    }
    let mut found = Found {
        frontend: core::ptr::null(),
        entry: core::ptr::null_mut(),
        now: 0,
        reply_to: ReplyTo6::client(flow.sport),
        scope: SCOPE_INTERNAL,
        _pad: [0; 3],
    };
    let step = classify(flow, &mut found);
    let kind = match step {
        Step::SnatReply => EV_UNNAT,
        Step::Refuse => EV_REJECT,
        Step::Established => EV_DNAT_ESTABLISHED,
        Step::NewFlow => EV_DNAT_NEW,
        _ => 0,
    };
    let result = take_step(ctx, flow, &mut found, step);
    // After the stage: the event's "after" is the packet as the stage left it (a refusal's is
    // its answer, so only the tuple it was about is written).
    if kind != 0 && result.is_ok() {
        let frontend = if kind == EV_DNAT_ESTABLISHED { core::ptr::null() } else { found.frontend };
        events::step6(ctx, flow, kind, frontend);
    }
    result
}

/// The stage [`classify`] chose, carried out.
#[inline(always)]
fn take_step(
    ctx: &TcContext,
    flow: &parse6::Flow6,
    found: &mut Found,
    step: Step,
) -> Result<Verdict, Verdict> {
    match step {
        Step::Pass(stat) => Err(Verdict::pass(stat)),
        Step::Drop(stat) => Err(Verdict::drop(stat)),
        Step::SnatReply => snat_reply(ctx, flow),
        // A later fragment follows the translation its first fragment made; it never starts a
        // flow nor answers for a refused one.
        Step::Refuse | Step::NewFlow if !flow.has_l4_header() => Err(Verdict::pass(Stat::PassFragment)),
        Step::Refuse => refuse(ctx, flow),
        Step::Established => established(ctx, flow, found),
        // Untouched, unless a translated flow of this client already has its reply tuple: the
        // client reused a source port for a pod it had reached through a frontend.
        Step::Direct => match conntrack6::claim(flow, &flow.daddr, flow.dport, false) {
            Some(Clash::Remap) => {
                let now = conntrack::now();
                let port = snat6::remap(flow, &flow.daddr, flow.dport, &flow.saddr, now)?;
                ingress6::direct(ctx, flow, now, port)
            }
            _ => Err(Verdict::pass(Stat::PassNoService)),
        },
        Step::NewFlow => {
            let choice = CHOICE6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::NoBackend))?;
            // SAFETY: a per-CPU value, used by this program run alone; `classify` set the
            // frontend to a map value before choosing this step.
            let (choice, frontend) = unsafe { (&mut *choice, &*found.frontend) };
            lb6::select_backend_in(flow, frontend, found.now, choice, found.scope)?;
            let backend = &choice.backend;
            // Policy Local's backends are this node's: never source-NATed.
            if found.scope != SCOPE_EXTERNAL && source_nated(ctx, flow, &backend.addr, frontend.flags)? {
                let node_addr = &shared()?.node_addr;
                let port = snat6::remap(flow, &backend.addr, backend.port, node_addr, found.now)?;
                found.reply_to = ReplyTo6::snat(port);
            } else if conntrack6::claim(flow, &backend.addr, backend.port, false).is_some() {
                // A live flow of this client already has the reply tuple (the same backend
                // through another frontend): this one's source port is remapped.
                let port = snat6::remap(flow, &backend.addr, backend.port, &flow.saddr, found.now)?;
                found.reply_to = ReplyTo6::remap(port, false);
            }
            let verdict = new_flow(ctx, flow, found, choice)?;
            // The source is rewritten in stages of their own: `new_flow` has no room left.
            if found.reply_to.is(CT_FLAG_SNAT) {
                return snat_source(ctx, flow, found.reply_to.port);
            }
            if found.reply_to.is(CT_FLAG_REMAP) {
                return remapped_source(ctx, flow, found.reply_to.port);
            }
            Ok(verdict)
        }
    }
}

#[inline(never)]
fn classify(flow: &parse6::Flow6, found: &mut Found) -> Step {
    let (snat_min, snat_max) = config::nodeport().port_range();
    let dport = u16::from_be_bytes(flow.dport);
    if dport >= snat_min && dport <= snat_max && is_snat_reply(flow) {
        return Step::SnatReply;
    }
    let key = flow.ct_key(CT_DIR_FORWARD);
    // A known flow before its frontend: it continues after its Service (or the port) is deleted.
    if let Some(entry) = conntrack6::known_flow(&key, flow.proto, &mut found.now) {
        found.entry = entry;
        return Step::Established;
    }
    let (frontend, scope) = match lb6::lookup_scope(flow, SCOPE_EXTERNAL) {
        Some(frontend) => (frontend, SCOPE_EXTERNAL),
        None => match lb6::lookup_scope(flow, SCOPE_INTERNAL) {
            Some(frontend) => (frontend, SCOPE_INTERNAL),
            // A cluster IP routed to the node, on a port the Service does not have.
            None if lb6::is_vip(&flow.daddr) => return Step::Refuse,
            // An unallocated address of the service range, routed to the node: dropped (cluster-ips-check).
            None if lb6::in_service_cidr(&flow.daddr) => return Step::Drop(Stat::DropUnallocatedServiceIp),
            // Only a packet that may start a flow can clash (UDP, a bare TCP SYN).
            None if flow.has_l4_header() && direct_may_clash(flow.proto, flow.tcp_flags) => {
                return Step::Direct;
            }
            None => return Step::Pass(Stat::PassNoService),
        },
    };
    found.now = conntrack::now();
    if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0 && !lb6::source_allowed(frontend.rev_nat_id, flow.saddr) {
        return Step::Drop(Stat::DropSourceRange);
    }
    if flow.proto == IPPROTO_TCP && !starts_tcp_flow(flow.tcp_flags) {
        // No connection is known for this segment: translating it would start a flow
        // mid-stream, and passing it would leak it to the frontend.
        return Step::Drop(Stat::DropInvalidTcp);
    }
    if frontend.count == 0 {
        // Policy Local without a local endpoint: dropped, so that the load balancer's health
        // check, not a refusal, steers clients away (kube-proxy's behaviour).
        if frontend.flags & SVC_FLAG_NO_LOCAL_ENDPOINTS != 0 {
            return Step::Drop(Stat::DropNoLocalEndpoint);
        }
        return Step::Refuse;
    }
    found.frontend = frontend;
    found.scope = scope;
    Step::NewFlow
}

/// Whether a packet to a port of the SNAT range is a backend's reply to a source-NATed flow.
#[inline(always)]
pub(crate) fn is_snat_reply(flow: &parse6::Flow6) -> bool {
    // SAFETY: a map value valid for this program run.
    conntrack6::lookup(&flow.ct_key(CT_DIR_REPLY))
        .is_some_and(|entry| unsafe { (*entry).flags } & CT_FLAG_SNAT != 0)
}

/// Whether a new flow to `backend` is source-NATed to the address of the interface it came in on,
/// written into [`External6`] with the backend's route: when the backend is reached back out of
/// that interface (another node's pod: its replies would not come back through this node
/// otherwise), or — kube-proxy's masquerade, as IPv4's `plan_new_flow` — when a client outside
/// `--cluster-cidr` reaches a cluster IP (`frontend_flags` without `SVC_FLAG_EXTERNAL_ADDR`), but
/// not a local backend (on the interface's own link) when covered pods' veths may carry no program
/// to turn its reply back (the external egress un-NATs it instead). Not inlined: a stage of its
/// own, called from the program.
#[inline(never)]
fn source_nated(
    ctx: &TcContext,
    flow: &parse6::Flow6,
    backend: &[u8; 16],
    frontend_flags: u16,
) -> Result<bool, Verdict> {
    let shared = shared()?;
    let ifindex = ingress_ifindex(ctx);
    fib6::route(ctx, ifindex, &flow.saddr, backend, &mut shared.route)?;
    if shared.route.ifindex != ifindex {
        let local = fib6::last_route_was_direct(backend);
        let masquerade = frontend_flags & SVC_FLAG_EXTERNAL_ADDR == 0
            && config::outside_cluster_cidr6(&flow.saddr)
            && !(local && config::bare_covered_veths());
        if !masquerade {
            return Ok(false);
        }
    }
    // SAFETY: the value is copied out at once.
    let node = unsafe { EXTERNAL_IFACES_V6.get(ifindex) }.ok_or(Verdict::pass(Stat::PassNoNodeAddress))?;
    shared.node_addr = node.addr;
    Ok(true)
}

/// A packet of a known flow: to the backend its forward entry records, from the node address and
/// port of a source-NATed flow (then sent out directly).
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
    if flags & (CT_FLAG_SNAT | CT_FLAG_REMAP) == 0 {
        return Ok(Verdict::NEXT);
    }
    // The translation was evicted: nothing could un-NAT the replies.
    let to = snat6::forward_entry(&key).ok_or(Verdict::drop(Stat::ConntrackInsertFailed))?;
    // SAFETY: a map value valid for this program run, read in place.
    let (source, port) = unsafe { (&(*to).addr, (*to).port) };
    if flags & CT_FLAG_REMAP != 0 {
        nat6::rewrite_source_port(ctx, flow, port)?;
        return Ok(Verdict::NEXT);
    }
    nat6::rewrite_source(ctx, flow, source, port)?;
    fib6::route(ctx, ingress_ifindex(ctx), source, backend, &mut shared()?.route)?;
    Ok(Verdict::REDIRECT)
}

/// The first packet of a flow, its backend picked and its reply tuple settled: the flow recorded
/// (reply entry first, keyed by the node address `source_nated` chose when it is
/// source-NATed), DNAT. Four arguments at most: a fifth would go on the stack, which BPF has not.
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
    let backend = &choice.backend;
    let reply_addr = if found.reply_to.is(CT_FLAG_SNAT) { &shared()?.node_addr } else { &flow.saddr };
    conntrack6::create_to(
        flow,
        &key,
        backend,
        choice.backend_id,
        frontend.rev_nat_id,
        found.now,
        found.reply_to,
        reply_addr,
    )?;
    nat6::rewrite_destination(ctx, flow, &backend.addr, backend.port)?;
    stats::count(Stat::DnatNew);
    Ok(Verdict::NEXT)
}

/// A new source-NATed flow: its source becomes the node address and SNAT port, and it is sent out
/// along the route `source_nated` found (the stack would drop a packet from its own address).
#[inline(never)]
fn snat_source(ctx: &TcContext, flow: &parse6::Flow6, port: [u8; 2]) -> Result<Verdict, Verdict> {
    nat6::rewrite_source(ctx, flow, &shared()?.node_addr, port)?;
    stats::count(Stat::SnatNew);
    Ok(Verdict::REDIRECT)
}

/// A new flow's source port becomes its remapped one.
#[inline(never)]
fn remapped_source(ctx: &TcContext, flow: &parse6::Flow6, port: [u8; 2]) -> Result<Verdict, Verdict> {
    nat6::rewrite_source_port(ctx, flow, port)?;
    stats::count(Stat::PortRemapped);
    Ok(Verdict::NEXT)
}

/// A backend's reply to a source-NATed flow (addressed to a node address and SNAT port): back to
/// the frontend as source and the client as destination, and out of the node directly — from an
/// external interface (a remote backend's) or a pod veth (a local backend's, masqueraded).
#[inline(never)]
pub(crate) fn snat_reply(ctx: &TcContext, flow: &parse6::Flow6) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let client = snat6::reverse_entry(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    let now = conntrack::now();
    // SAFETY: map values valid for this program run, read in place.
    let (frontend, frontend_port, client, client_port) = unsafe {
        conntrack6::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack6::track_reply(
            entry,
            flow,
            &((*client).addr, (*client).port),
            &((*entry).nat_addr, (*entry).nat_port),
        );
        (&(*entry).nat_addr, (*entry).nat_port, &(*client).addr, (*client).port)
    };
    nat6::rewrite_source(ctx, flow, frontend, frontend_port)?;
    nat6::rewrite_destination(ctx, flow, client, client_port)?;
    stats::count(Stat::SnatReverse);
    fib6::route(ctx, ingress_ifindex(ctx), frontend, client, &mut shared()?.route)?;
    Ok(Verdict::REDIRECT)
}

/// Not inlined, so that the packet buffers of a refusal are not part of [`run`]'s frame.
#[inline(never)]
fn refuse(ctx: &TcContext, flow: &parse6::Flow6) -> Result<Verdict, Verdict> {
    reject6::refuse(ctx, flow)
}
