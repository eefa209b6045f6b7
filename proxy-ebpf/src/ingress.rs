//! The tc ingress stages: `kproxy_ingress` (packets leaving a pod) and
//! `kproxy_external_ingress` (packets arriving on an external interface).
//! [`classify`] looks the packet up; each case is a stage of its own, called
//! from [`ingress`].
use aya_ebpf::programs::TcContext;
use aya_log_ebpf::debug;
use proxy_common::{
    conntrack::{Clash, direct_may_clash, starts_tcp_flow},
    maps::{
        BackendV4, CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, CT_FLAG_SNAT, CtKeyV4,
        IPPROTO_TCP, SCOPE_EXTERNAL, SVC_FLAG_EXTERNAL_ADDR, SVC_FLAG_NO_LOCAL_ENDPOINTS,
        SVC_FLAG_SOURCE_RANGES, ServiceValueV4, reply_key_in_snat,
    },
    stats::Stat,
    trace::{EV_DROP_INVALID, EV_REJECT},
};

use crate::{
    config,
    conntrack::{self, ReplyTo},
    events, fib,
    fib::ingress_ifindex,
    icmp, inherited, lb,
    maps::{EXTERNAL_IFACES, FLOW_SCRATCH},
    nat, parse, reject, snat, stats,
    verdict::Verdict,
};

/// What [`classify`] decided for a packet leaving a pod or arriving on an
/// external interface. Each case is carried out by a function of its own,
/// called from the program itself: the BPF stack limit (512 bytes) counts a
/// whole call chain, so no stage may call another.
///
/// Aligned to a whole stack slot: [`classify`] writes it through a pointer,
/// and the verifier forgets a value that shares its 8-byte slot with another
/// spilled one — it would then follow every arm of the match, some with
/// [`Found`] unset.
#[repr(align(8))]
enum Step {
    Pass(Stat),
    Drop(Stat),
    /// A pod's reply to its own hairpin connection.
    HairpinReply,
    /// A backend's reply to a source-NATed flow.
    SnatReply,
    /// A Service without endpoints, or a port it does not have.
    Refuse,
    /// A packet of a known flow ([`Found::entry`]).
    Established,
    /// The first packet of a flow to [`Found::frontend`].
    NewFlow,
    /// A packet to no Service (a pod, most often).
    Direct,
}

/// What [`classify`] looked up, for the step that follows. Raw pointers,
/// null when absent: an `Option` would copy undefined bytes, which the
/// verifier refuses.
struct Found {
    frontend: *const proxy_common::maps::ServiceValueV4,
    scope: u8,
    entry: *mut proxy_common::maps::CtEntryV4,
    /// The packet's time and the hairpin address, read once per packet.
    now: u64,
    hairpin_addr: [u8; 4],
}

/// `EXTERNAL`: the packet arrived on an external interface rather than from
/// a pod. `route`: where a stage that ends in [`Verdict::REDIRECT`] sends the
/// packet.
#[inline(always)]
pub fn ingress<const EXTERNAL: bool>(ctx: &TcContext, route: &mut fib::Route) -> Result<Verdict, Verdict> {
    let flow = FLOW_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    let flow: &parse::Flow = match parse::flow(ctx, flow) {
        Ok(()) => flow,
        Err(Stat::PassNotTcpUdp) if lb::unallocated_other_protocol(ctx) => {
            return Err(Verdict::drop(Stat::DropUnallocatedServiceIp));
        }
        Err(Stat::PassNotTcpUdp) if EXTERNAL => return icmp::unnat_snat_error(ctx, route),
        Err(stat) => return Err(Verdict::pass(stat)),
    };
    let mut found = Found {
        frontend: core::ptr::null(),
        scope: 0,
        entry: core::ptr::null_mut(),
        now: 0,
        hairpin_addr: [0; 4],
    };
    match classify::<EXTERNAL>(ctx, flow, &mut found) {
        Step::Pass(stat) => Err(Verdict::pass(stat)),
        Step::Drop(stat) => Err(Verdict::drop(stat)),
        Step::HairpinReply => hairpin_reply(ctx, flow),
        Step::SnatReply => snat_reply(ctx, flow, route),
        // A later fragment follows the translation its first fragment made; it
        // never starts a flow nor answers for a refused one.
        Step::Refuse | Step::NewFlow if !flow.has_l4_header() => Err(Verdict::pass(Stat::PassFragment)),
        Step::Refuse => refuse(ctx, flow),
        Step::Established => established(ctx, flow, &found, route),
        Step::NewFlow => {
            let mut plan = NewFlowPlan {
                choice: lb::Choice { backend_id: 0, backend: BackendV4::default(), slot: 0 },
                reply_to: ReplyTo::CLIENT,
            };
            plan_new_flow::<EXTERNAL>(ctx, flow, &found, &mut plan, route)?;
            let backend = &plan.choice.backend;
            let mut reply_key = flow.ct_key(CT_DIR_FORWARD).reply_of(backend.addr, backend.port);
            reply_key.daddr = plan.reply_to.client_addr(reply_key.daddr);
            // Source-NATed flows have ports of their own, taken free. A reply
            // tuple netfilter still holds for a flow it translated would make
            // netfilter drop this one.
            if !plan.reply_to.is(CT_FLAG_SNAT)
                && (conntrack::claim(flow, &reply_key).is_some() || inherited::holds_reply(&reply_key))
            {
                plan.reply_to = plan.reply_to.with_port([0; 2]);
            }
            new_flow(ctx, flow, &found, &plan)
        }
        Step::Direct => {
            let reply_key = flow.ct_key(CT_DIR_FORWARD).reply_of(flow.daddr, flow.dport);
            match conntrack::claim(flow, &reply_key) {
                Some(Clash::Remap) => direct(ctx, flow),
                _ => Err(Verdict::pass(Stat::PassNoService)),
            }
        }
    }
}

#[inline(never)]
fn classify<const EXTERNAL: bool>(ctx: &TcContext, flow: &parse::Flow, found: &mut Found) -> Step {
    let hairpin_addr = config::hairpin_addr();
    if !EXTERNAL && flow.daddr == hairpin_addr {
        return Step::HairpinReply;
    }
    let (snat_min, snat_max) = config::nodeport().port_range();
    let dport = u16::from_be_bytes(flow.dport);
    if dport >= snat_min && dport <= snat_max && is_snat_reply(flow) {
        return Step::SnatReply;
    }
    let key = flow.ct_key(CT_DIR_FORWARD);
    found.hairpin_addr = hairpin_addr;

    // A known flow before its frontend: as with netfilter's conntrack, it
    // continues after its Service (or the port) is deleted, and so does a
    // direct flow whose source port was remapped.
    if known_flow(ctx, flow, &key, found) {
        return Step::Established;
    }
    // Every address with a frontend has an entry: a packet to any other (a pod's) looks up no
    // service map.
    let Some(vip) = lb::vip_entry(&flow.daddr) else { return no_frontend(flow, &key, false) };
    let frontend = if EXTERNAL { lb::lookup_external_frontend(flow) } else { lb::lookup_frontend(flow) };
    let Some(frontend) = frontend else { return no_frontend(flow, &key, vip.is_cluster_ip()) };
    // A connection opened through kube-proxy's rules before kproxy attached:
    // netfilter translates it until it ends (and un-NATs its replies).
    if inherited::is_open(&key) {
        return Step::Pass(Stat::PassInheritedFlow);
    }
    let now = conntrack::now();
    found.now = now;
    let value = frontend.value;
    // Pods are filtered too: kube-proxy checks every source before DNAT, so an
    // allow-list cannot be bypassed from inside the cluster.
    if value.flags & SVC_FLAG_SOURCE_RANGES != 0 && !lb::source_allowed(value.rev_nat_id, flow.saddr) {
        return Step::Drop(Stat::DropSourceRange);
    }
    found.frontend = value;
    found.scope = frontend.scope;
    new_flow_step(ctx, flow, value, now)
}

/// Whether `key` is a live flow that keeps its backend ([`Found::entry`] then points at its entry). An
/// expired entry, or a UDP flow whose backend is gone, is deleted: the packet is looked up as a new flow.
#[inline(always)]
fn known_flow(ctx: &TcContext, flow: &parse::Flow, key: &CtKeyV4, found: &mut Found) -> bool {
    let Some(entry) = conntrack::lookup(key) else { return false };
    let config = config::get();
    // The clock is read only for a packet that needs it: a packet to no
    // Service never does.
    let now = conntrack::now();
    found.now = now;
    // SAFETY: map values stay valid for the program's run; concurrent
    // writers only race on counters and timestamps.
    let entry_copy = unsafe { *entry };
    if conntrack::expired(key, &entry_copy, &config, now) {
        conntrack::remove_pair(key, &entry_copy, &config.hairpin_addr);
        stats::count(Stat::ConntrackExpired);
    } else if lb::keeps_backend(&entry_copy, flow.proto) {
        found.entry = entry;
        return true;
    } else {
        conntrack::remove_pair(key, &entry_copy, &config.hairpin_addr);
        stats::count(Stat::Rebalanced);
        debug!(ctx, "backend {} of a UDP flow is gone: rebalancing", entry_copy.backend_id);
    }
    false
}

/// A packet of no known flow to no frontend: a missing port of a Service (`cluster_ip`: its
/// destination is one), an unallocated service address, or traffic to a pod.
#[inline(always)]
fn no_frontend(flow: &parse::Flow, key: &CtKeyV4, cluster_ip: bool) -> Step {
    if cluster_ip {
        // The port may have been removed from the Service while
        // netfilter's connection through it goes on.
        if inherited::is_open(key) {
            return Step::Pass(Stat::PassInheritedFlow);
        }
        // A port the Service does not have.
        events::untranslated(flow, EV_REJECT, 0, conntrack::now());
        return Step::Refuse;
    }
    // kube-proxy's cluster-ips-check: an unallocated address of the service
    // range never leaves the node, pods' and external clients' alike
    // (netfilter's forward hook sees both). A flow netfilter still
    // translates to a since-deleted Service carries on, as conntrack
    // exempts it there.
    if lb::in_service_cidr(&flow.daddr) {
        if inherited::is_open(key) {
            return Step::Pass(Stat::PassInheritedFlow);
        }
        return Step::Drop(Stat::DropUnallocatedServiceIp);
    }
    // Established TCP to a pod stops here: no clash check can change it.
    if flow.has_l4_header() && direct_may_clash(flow.proto, flow.tcp_flags) {
        return Step::Direct;
    }
    Step::Pass(Stat::PassNoService)
}

/// The first packet of a flow to a frontend (`value`, allowed from this source): a new flow, unless it is
/// a TCP segment that opens none or the frontend has no endpoints.
#[inline(always)]
fn new_flow_step(ctx: &TcContext, flow: &parse::Flow, value: &ServiceValueV4, now: u64) -> Step {
    if flow.proto == IPPROTO_TCP && !starts_tcp_flow(flow.tcp_flags) {
        // No connection is known for this segment: translating it would start
        // a flow mid-stream, and passing it would leak it to the VIP.
        events::untranslated(flow, EV_DROP_INVALID, value.rev_nat_id, now);
        return Step::Drop(Stat::DropInvalidTcp);
    }
    if value.count == 0 {
        if value.flags & SVC_FLAG_NO_LOCAL_ENDPOINTS != 0 {
            return Step::Drop(Stat::DropNoLocalEndpoint);
        }
        debug!(ctx, "frontend {} has no endpoints: refusing", value.rev_nat_id);
        events::untranslated(flow, EV_REJECT, value.rev_nat_id, now);
        return Step::Refuse;
    }
    Step::NewFlow
}

/// A packet to an address that is no Service's (another pod, most
/// often). Untouched — unless a translated flow of the same client already
/// has its reply tuple: the client reused a source port for a pod it had
/// reached through a Service. Then the translated flow yields the tuple if it
/// is over, and otherwise this flow's source port is remapped, so that the
/// replies of each reach the right socket (netfilter's clash resolution).
#[inline(never)]
fn direct(ctx: &TcContext, flow: &parse::Flow) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_FORWARD);
    let now = conntrack::now();
    let port = snat::allocate(flow, &key, flow.daddr, flow.dport, flow.saddr, now)?;
    let choice = lb::Choice {
        backend_id: 0,
        backend: BackendV4 { addr: flow.daddr, port: flow.dport, proto: flow.proto, flags: 0 },
        slot: 0,
    };
    if let Err(e) = conntrack::create(flow, &key, &choice, 0, now, ReplyTo::remap(port, true)) {
        snat::remove(&key, flow.daddr, flow.dport, CT_FLAG_REMAP);
        return Err(e);
    }
    nat::rewrite_source_port(ctx, flow, port)?;
    stats::count(Stat::PortRemapped);
    Ok(Verdict::NEXT)
}

/// A packet of a known flow.
/// Not inlined: the ingress program's stack frame has no room for it.
#[inline(never)]
fn established(
    ctx: &TcContext,
    flow: &parse::Flow,
    found: &Found,
    route: &mut fib::Route,
) -> Result<Verdict, Verdict> {
    let key = &flow.ct_key(CT_DIR_FORWARD);
    let (entry, now, hairpin_addr) = (found.entry, found.now, found.hairpin_addr);
    // SAFETY: as in `ingress`.
    let entry_copy = unsafe { *entry };
    // SAFETY: as above.
    unsafe { conntrack::touch(entry, flow, CT_DIR_FORWARD, now) };
    // The flow's translation lives or dies as one: a busy forward entry keeps
    // its reply entry from being evicted first.
    conntrack::keep_reply(key, &entry_copy, &hairpin_addr);
    let hairpin = entry_copy.flags & CT_FLAG_HAIRPIN != 0;
    let to_node = if reply_key_in_snat(entry_copy.flags) {
        snat::forward(key, entry_copy.nat_addr, entry_copy.nat_port, entry_copy.flags)
    } else {
        None
    };
    nat::rewrite_destination(ctx, flow, entry_copy.nat_addr, entry_copy.nat_port)?;
    stats::count(Stat::DnatEstablished);
    let source = match &to_node {
        Some(to_node) => (to_node.addr, to_node.port),
        None if hairpin => (hairpin_addr, flow.sport),
        None => (flow.saddr, flow.sport),
    };
    events::dnat_established(flow, (source, (entry_copy.nat_addr, entry_copy.nat_port)), &entry_copy, now);
    if hairpin {
        if entry_copy.flags & CT_FLAG_REMAP != 0 {
            let to = to_node.ok_or(Verdict::drop(Stat::ConntrackInsertFailed))?;
            nat::rewrite_source_port(ctx, flow, to.port)?;
        }
        nat::rewrite_source_addr(ctx, flow, flow.saddr, hairpin_addr)?;
        return Ok(Verdict::BOUNCE);
    }
    if reply_key_in_snat(entry_copy.flags) {
        // The translation was evicted: nothing can un-NAT replies.
        let to_node = to_node.ok_or(Verdict::drop(Stat::ConntrackInsertFailed))?;
        if entry_copy.flags & CT_FLAG_REMAP != 0 {
            // The client's own address: the node routes it as it is.
            nat::rewrite_source_port(ctx, flow, to_node.port)?;
            return Ok(Verdict::NEXT);
        }
        nat::rewrite_source(ctx, flow, to_node.addr, to_node.port)?;
        *route = fib::route(ctx, ingress_ifindex(ctx), to_node.addr, entry_copy.nat_addr, fib::CHECK_SKB)?;
        return Ok(Verdict::REDIRECT);
    }
    Ok(Verdict::NEXT)
}

/// What the first stage of a new flow decided, for the second.
struct NewFlowPlan {
    choice: lb::Choice,
    reply_to: ReplyTo,
}

/// The first stage of a new flow: picks its backend and whether it is
/// source-NATed (then with its SNAT port, and in `route` where it is sent).
/// The clash check that follows (`conntrack::claim`) is called from the
/// program itself, between the two stages: it would not fit in the stack
/// beside either.
#[inline(never)]
fn plan_new_flow<const EXTERNAL: bool>(
    ctx: &TcContext,
    flow: &parse::Flow,
    found: &Found,
    plan: &mut NewFlowPlan,
    route: &mut fib::Route,
) -> Result<(), Verdict> {
    let key = &flow.ct_key(CT_DIR_FORWARD);
    let now = found.now;
    // SAFETY: `classify` set it to a map value before choosing this step.
    let frontend = unsafe { &*found.frontend };
    let found_frontend = lb::Frontend { value: frontend, scope: found.scope };
    let choice = lb::select_backend(flow, &found_frontend, now)?;
    if !EXTERNAL && choice.backend.addr == flow.saddr {
        plan.reply_to = ReplyTo::hairpin(found.hairpin_addr);
    }
    if EXTERNAL && found.scope != SCOPE_EXTERNAL {
        let ifindex = ingress_ifindex(ctx);
        let backend_route = fib::route(ctx, ifindex, flow.saddr, choice.backend.addr, fib::CHECK_SKB)?;
        // A backend reached through the interface the client came in on
        // would answer the client directly; a client outside the cluster
        // reaching a cluster IP is masqueraded like kube-proxy does — but not
        // to a local backend (on its own link, not behind a tunnel or gateway)
        // when covered pods' veths may have no program to turn its reply back
        // (the external egress un-NATs it instead).
        let remote = backend_route.ifindex == ifindex;
        let local = !remote && fib::last_route_was_direct(choice.backend.addr);
        let masquerade = frontend.flags & SVC_FLAG_EXTERNAL_ADDR == 0
            && config::nodeport().outside_cluster_cidr(flow.saddr)
            && !(local && config::bare_covered_veths());
        if remote || masquerade {
            // SAFETY: the value is copied out at once.
            let node_addr = unsafe { EXTERNAL_IFACES.get(ifindex) }
                .map(|i| i.addr)
                .ok_or(Verdict::pass(Stat::PassNoNodeAddress))?;
            let port = snat::allocate(flow, key, choice.backend.addr, choice.backend.port, node_addr, now)?;
            plan.reply_to = ReplyTo::snat(node_addr, port);
            *route = backend_route;
        }
    }
    plan.choice = choice;
    Ok(())
}

/// The second stage of a new flow: records it and translates the packet. A
/// plan with `CT_FLAG_REMAP` and no port yet gets its remapped port here.
/// Not inlined: the ingress program's stack frame has no room for it.
#[inline(never)]
fn new_flow(
    ctx: &TcContext,
    flow: &parse::Flow,
    found: &Found,
    plan: &NewFlowPlan,
) -> Result<Verdict, Verdict> {
    let key = &flow.ct_key(CT_DIR_FORWARD);
    let (now, hairpin_addr) = (found.now, found.hairpin_addr);
    // SAFETY: `classify` set it to a map value before choosing this step.
    let frontend = unsafe { &*found.frontend };
    let choice = &plan.choice;
    let mut reply_to = plan.reply_to;
    let hairpin = reply_to.is(CT_FLAG_HAIRPIN);
    if reply_to.is(CT_FLAG_REMAP) {
        // A live flow of this client already has the reply tuple (the same
        // backend through another Service, or directly from this port).
        let client = reply_to.client_addr(flow.saddr);
        let port = snat::allocate(flow, key, choice.backend.addr, choice.backend.port, client, now)?;
        reply_to = reply_to.with_port(port);
    }
    if let Err(e) = conntrack::create(flow, key, choice, frontend.rev_nat_id, now, reply_to) {
        if reply_key_in_snat(reply_to.flags) {
            snat::remove(key, choice.backend.addr, choice.backend.port, reply_to.flags);
        }
        return Err(e);
    }
    nat::rewrite_destination(ctx, flow, choice.backend.addr, choice.backend.port)?;
    stats::count(Stat::DnatNew);
    debug!(
        ctx,
        "new flow to frontend {} sent to backend {} (slot {})",
        frontend.rev_nat_id,
        choice.backend_id,
        choice.slot
    );
    let source_addr = if reply_to.is(CT_FLAG_SNAT) {
        reply_to.addr
    } else if hairpin {
        hairpin_addr
    } else {
        flow.saddr
    };
    let (source_port, ct_flags) = if reply_key_in_snat(reply_to.flags) {
        (reply_to.port, reply_to.flags)
    } else if hairpin {
        (flow.sport, CT_FLAG_HAIRPIN)
    } else {
        (flow.sport, 0)
    };
    let chosen = events::Chosen {
        backend_id: choice.backend_id,
        slot: choice.slot,
        count: frontend.count,
        rev_nat_id: frontend.rev_nat_id,
        ct_flags,
    };
    let after = ((source_addr, source_port), (choice.backend.addr, choice.backend.port));
    events::dnat_new(flow, after, chosen, now);
    if reply_to.is(CT_FLAG_REMAP) {
        nat::rewrite_source_port(ctx, flow, reply_to.port)?;
        stats::count(Stat::PortRemapped);
    }
    if hairpin {
        nat::rewrite_source_addr(ctx, flow, flow.saddr, hairpin_addr)?;
        stats::count(Stat::Hairpin);
        return Ok(Verdict::BOUNCE);
    }
    if reply_to.is(CT_FLAG_REMAP) {
        return Ok(Verdict::NEXT);
    }
    if reply_to.is(CT_FLAG_SNAT) {
        nat::rewrite_source(ctx, flow, reply_to.addr, reply_to.port)?;
        stats::count(Stat::SnatNew);
        // `plan_new_flow` wrote the route.
        return Ok(Verdict::REDIRECT);
    }
    Ok(Verdict::NEXT)
}

/// A backend's reply to a source-NATed flow (addressed to a node address and
/// SNAT port): back to the frontend as source and the client as destination,
/// and out of the node directly. `None` when the packet is not one.
/// Not inlined: its stack frame would not fit next to the ingress program's.
#[inline(never)]
fn snat_reply(ctx: &TcContext, flow: &parse::Flow, route: &mut fib::Route) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let Some(entry) = conntrack::lookup(&key) else { return Err(Verdict::pass(Stat::PassNoService)) };
    // SAFETY: as in `ingress`.
    let (frontend_addr, frontend_port, flags) =
        unsafe { ((*entry).nat_addr, (*entry).nat_port, (*entry).flags) };
    if flags & CT_FLAG_SNAT == 0 {
        return Err(Verdict::pass(Stat::PassNoService));
    }
    let Some(client) = snat::reverse(&key) else { return Err(Verdict::pass(Stat::SnatEntryMissing)) };
    let now = conntrack::now();
    // SAFETY: as in `ingress`.
    unsafe {
        conntrack::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack::track_reply(entry, flow, (client.addr, client.port), (frontend_addr, frontend_port));
    }
    nat::rewrite_source(ctx, flow, frontend_addr, frontend_port)?;
    nat::rewrite_destination(ctx, flow, client.addr, client.port)?;
    stats::count(Stat::SnatReverse);
    // SAFETY: as in `ingress`.
    let entry = unsafe { &*entry };
    events::unnat(flow, entry, ((frontend_addr, frontend_port), (client.addr, client.port)), now);
    *route = fib::route(ctx, ingress_ifindex(ctx), frontend_addr, client.addr, fib::CHECK_SKB)?;
    Ok(Verdict::REDIRECT)
}

/// Whether a packet to a SNAT port is a reply to a source-NATed flow.
#[inline(always)]
fn is_snat_reply(flow: &parse::Flow) -> bool {
    // SAFETY: a map value valid for this program run.
    conntrack::lookup(&flow.ct_key(CT_DIR_REPLY))
        .is_some_and(|entry| unsafe { (*entry).flags } & CT_FLAG_SNAT != 0)
}

/// Not inlined, so that the packet buffers of a refusal are not part of the
/// ingress program's stack frame.
#[inline(never)]
fn refuse(ctx: &TcContext, flow: &parse::Flow) -> Result<Verdict, Verdict> {
    reject::refuse(ctx, flow)
}

/// A pod's reply to its own hairpin connection, addressed to the hairpin
/// address: the source goes back to the VIP and the destination back to the
/// pod, and the packet returns to the pod.
#[inline(never)]
fn hairpin_reply(ctx: &TcContext, flow: &parse::Flow) -> Result<Verdict, Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let now = conntrack::now();
    // SAFETY: as in `ingress`.
    let (vip, vip_port, flags) = unsafe {
        conntrack::touch(entry, flow, CT_DIR_REPLY, now);
        ((*entry).nat_addr, (*entry).nat_port, (*entry).flags)
    };
    let client_port = if flags & CT_FLAG_REMAP != 0 {
        snat::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?.port
    } else {
        flow.dport
    };
    nat::rewrite_source(ctx, flow, vip, vip_port)?;
    nat::rewrite_destination_addr(ctx, flow, flow.daddr, flow.saddr)?;
    nat::rewrite_destination_port(ctx, flow, client_port)?;
    stats::count(Stat::ReverseNat);
    // SAFETY: as in `ingress`.
    events::unnat(flow, unsafe { &*entry }, ((vip, vip_port), (flow.saddr, client_port)), now);
    Ok(Verdict::BOUNCE)
}
