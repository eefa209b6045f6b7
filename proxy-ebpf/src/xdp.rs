//! The XDP fast path on external interfaces: the NodePort / ExternalIP / LB
//! flows whose backend is on another node (DNAT + SNAT, sent straight back
//! out with a redirect) and the replies to them. It shares every map
//! and decision with the tc path (`kproxy_external_ingress`); anything else —
//! local backends, externalTrafficPolicy: Local, refusals, expired or
//! rebalanced flows, IP options, unresolved neighbours — is passed untouched
//! to the stack, where the tc program handles it.
use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::{bpf_redirect, generated::bpf_xdp_get_buff_len},
    programs::XdpContext,
};
use proxy_common::{
    checksum,
    conntrack::starts_tcp_flow,
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_SNAT, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL,
        SVC_FLAG_EXTERNAL_ADDR, SVC_FLAG_SOURCE_RANGES,
    },
    packet::{
        ETH_HLEN, ETH_P_IP, Fragment, IP_OFF_CHECK, IPV4_MIN_HLEN, TCP_OFF_CHECK, TCP_OFF_FLAGS,
        UDP_OFF_CHECK, classify_ipv4,
    },
    stats::Stat,
};

use crate::{
    config,
    conntrack::{self, ReplyTo},
    events, fib, lb,
    maps::EXTERNAL_IFACES,
    parse::{self, Flow},
    snat, stats,
    verdict::{Action, Verdict},
};

#[inline(always)]
pub(crate) fn pointer<T>(ctx: &XdpContext, offset: usize) -> Result<*mut T, Verdict> {
    let start = ctx.data();
    if start + offset + core::mem::size_of::<T>() > ctx.data_end() {
        return Err(Verdict::pass(Stat::PassTruncated));
    }
    Ok((start + offset) as *mut T)
}

/// Only option-less IPv4 headers: their L4 header sits at a fixed offset.
const L4: usize = ETH_HLEN + IPV4_MIN_HLEN;

#[inline(always)]
fn parse(ctx: &XdpContext) -> Result<Flow, Verdict> {
    let eth: *mut [u8; 14] = pointer(ctx, 0)?;
    // SAFETY: bounds checked by `pointer`.
    let ethertype = unsafe { [(*eth)[12], (*eth)[13]] };
    if u16::from_be_bytes(ethertype) != ETH_P_IP {
        return Err(Verdict::pass(Stat::PassNotIpv4));
    }
    let ip: *mut [u8; 20] = pointer(ctx, ETH_HLEN)?;
    // SAFETY: as above.
    let ip = unsafe { *ip };
    if ip[0] != 0x45 {
        return Err(Verdict::pass(Stat::PassMalformed));
    }
    let total_len = u16::from_be_bytes([ip[2], ip[3]]);
    // From the helper, not `data_end - data`: the verifier allows pointer
    // subtraction only to CAP_PERFMON holders. The buffer is linear (the
    // program is not loaded for multi-buffer XDP), so both are its length.
    // SAFETY: a helper reading the context.
    let available = (unsafe { bpf_xdp_get_buff_len(ctx.ctx) } as usize).saturating_sub(ETH_HLEN);
    let loc = classify_ipv4(ip[0], total_len, u16::from_be_bytes([ip[6], ip[7]]), ip[9], available)
        .map_err(|skip| Verdict::pass(parse::skip_stat(skip)))?;
    if loc.fragment != Fragment::Whole {
        // Fragments are tc's, which follows a datagram from its first fragment.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let ports: *mut [u8; 4] = pointer(ctx, L4)?;
    // SAFETY: as above.
    let ports = unsafe { *ports };
    let (tcp_flags, check) = if loc.proto == IPPROTO_TCP {
        let flags: *mut u8 = pointer(ctx, L4 + TCP_OFF_FLAGS)?;
        // SAFETY: as above.
        (unsafe { *flags }, L4 + TCP_OFF_CHECK)
    } else {
        (0, L4 + UDP_OFF_CHECK)
    };
    Ok(Flow {
        saddr: [ip[12], ip[13], ip[14], ip[15]],
        daddr: [ip[16], ip[17], ip[18], ip[19]],
        sport: [ports[0], ports[1]],
        dport: [ports[2], ports[3]],
        proto: loc.proto,
        tcp_flags,
        l4_offset: L4,
        l4_check_offset: check,
        ip_total_len: total_len,
        fragment: Fragment::Whole,
        _pad1: 0,
        _pad2: 0,
        _pad4: 0,
    })
}

/// The bytes XDP needs in a packet it rewrites: Ethernet, an option-less IPv4
/// header and a TCP header (a UDP packet this short is left to tc).
const REWRITE_SPAN: usize = L4 + 20;

/// Rewrites the packet's four-tuple and Ethernet header, checksums included.
/// `packet` is the start of the frame, checked to hold [`REWRITE_SPAN`]
/// bytes: the verifier keeps that range across the call, while the context's
/// end pointer cannot be passed along.
///
/// `L4_CHECK`, the offset of the L4 checksum, is a constant of each instance:
/// the verifier lets a packet pointer move by a variable offset only in
/// programs of CAP_PERFMON holders.
#[inline(never)]
fn rewrite<const L4_CHECK: usize>(
    packet: *mut [u8; REWRITE_SPAN],
    flow: &Flow,
    new: &checksum::FourTuple,
    route: &fib::Route,
) {
    let l4_check = L4_CHECK;
    let mut old = [0u8; 12];
    old[..4].copy_from_slice(&flow.saddr);
    old[4..8].copy_from_slice(&flow.daddr);
    old[8..10].copy_from_slice(&flow.sport);
    old[10..].copy_from_slice(&flow.dport);
    // SAFETY: every offset below is inside REWRITE_SPAN, which the caller
    // checked against the end of the packet.
    unsafe {
        let p = &mut *packet;
        let ip_check = ETH_HLEN + IP_OFF_CHECK;
        let (ip, l4) = checksum::translated(
            u16::from_be_bytes([p[ip_check], p[ip_check + 1]]),
            u16::from_be_bytes([p[l4_check], p[l4_check + 1]]),
            flow.proto,
            &old,
            new,
        );
        p[ip_check..ip_check + 2].copy_from_slice(&ip.to_be_bytes());
        p[l4_check..l4_check + 2].copy_from_slice(&l4.to_be_bytes());
        // Addresses at IP offset 12, ports at L4 offset 0.
        p[ETH_HLEN + 12..ETH_HLEN + 20].copy_from_slice(&new[..8]);
        p[L4..L4 + 4].copy_from_slice(&new[8..]);
        p[..12].copy_from_slice(&route.macs);
    }
}

/// Sends the rewritten frame out of the route's interface — the one it came
/// in on, for a remote backend — with a redirect rather than XDP_TX: a
/// redirect ends with an explicit flush to the device (XDP_XMIT_FLUSH), while
/// veth only wakes its peer after XDP_TX when the peer runs an XDP program
/// itself, and NIC drivers with XDP support both.
#[inline(always)]
fn send(route: &fib::Route) -> u32 {
    stats::count(Stat::XdpForwarded);
    // SAFETY: a helper taking plain values.
    unsafe { bpf_redirect(route.ifindex, 0) as u32 }
}

/// The route of a rewritten packet, when it leaves by the interface it came in on toward a
/// known neighbour — the only kind XDP sends; anything else (a local pod of a masqueraded flow,
/// an unresolved neighbour) is tc's.
#[inline(always)]
fn route_back_out(
    ctx: &XdpContext,
    ingress: u32,
    saddr: [u8; 4],
    daddr: [u8; 4],
    flow: &Flow,
) -> Result<fib::Route, Verdict> {
    let route = fib::route(ctx, ingress, saddr, daddr, flow.ip_total_len)?;
    if !route.neighbour_known {
        // Not a failure: tc's redirect resolves the neighbour.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    if route.ifindex != ingress {
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    Ok(route)
}

#[inline(always)]
fn tuple(saddr: [u8; 4], daddr: [u8; 4], sport: [u8; 2], dport: [u8; 2]) -> checksum::FourTuple {
    let mut t = [0u8; 12];
    t[..4].copy_from_slice(&saddr);
    t[4..8].copy_from_slice(&daddr);
    t[8..10].copy_from_slice(&sport);
    t[10..].copy_from_slice(&dport);
    t
}

/// Not inlined: the IPv4 chain's frame is not the entry point's, which IPv6's (`xdp6`) shares.
#[inline(never)]
pub fn run(ctx: &XdpContext) -> u32 {
    let mut out = Translation { tuple: [0; 12], route: fib::Route::NONE };
    let result = handle(ctx, &mut out);
    act(result, &out.route)
}

/// The XDP action for what the stages decided (both families'): a redirect along `route`, a drop,
/// or the packet left to the stack and tc.
#[inline(always)]
pub(crate) fn act(result: Result<Verdict, Verdict>, route: &fib::Route) -> u32 {
    match result {
        Ok(verdict) if verdict.action() == Action::Redirect => {
            verdict.count();
            send(route)
        }
        Ok(verdict) if verdict.action() == Action::Drop => {
            verdict.count();
            XDP_DROP
        }
        // A stage that stopped has rewritten nothing: tc sees the packet next
        // and decides (a drop included), as it would without XDP.
        Ok(verdict) | Err(verdict) => {
            verdict.count();
            stats::count(Stat::XdpPass);
            XDP_PASS
        }
    }
}

/// `out`: the rewrite and route of a packet XDP sends.
#[inline(always)]
fn handle(ctx: &XdpContext, out: &mut Translation) -> Result<Verdict, Verdict> {
    let flow = parse(ctx)?;
    if ctx.data() + REWRITE_SPAN > ctx.data_end() {
        return Err(Verdict::pass(Stat::PassTruncated));
    }
    let (snat_min, snat_max) = config::nodeport().port_range();
    let dport = u16::from_be_bytes(flow.dport);
    if dport >= snat_min && dport <= snat_max {
        let key = flow.ct_key(CT_DIR_REPLY);
        if let Some(entry) = conntrack::lookup(&key)
            // SAFETY: a map value valid for this program run.
            && unsafe { (*entry).flags } & CT_FLAG_SNAT != 0
        {
            snat_reply(ctx, &flow, entry, out)?;
            return finish(ctx, &flow, out);
        }
    }
    // Each stage is called from here, none from another: the BPF stack limit
    // counts a whole call chain.
    let found = lb::lookup_external_frontend(&flow).ok_or(Verdict::pass(Stat::PassNoService))?;
    let frontend = found.value;
    if found.scope == SCOPE_EXTERNAL || frontend.flags & SVC_FLAG_EXTERNAL_ADDR == 0 {
        // externalTrafficPolicy: Local (local backends only) and cluster IPs
        // reached from outside (masqueraded from outside --cluster-cidr,
        // whatever the backend) are tc's.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    match conntrack::lookup(&flow.ct_key(CT_DIR_FORWARD)) {
        Some(entry) => {
            established(ctx, &flow, entry, out)?;
            keep_reply(&flow, entry);
        }
        // Netfilter's own flows (kube-proxy's, from before kproxy) are the tc
        // program's.
        None if crate::inherited::is_open_off_stack(&flow) => return Err(Verdict::pass(Stat::XdpToTc)),
        // Source ranges admit new flows only, as tc (which looks a known flow up first) and
        // kube-proxy's firewall rules do: narrowing them keeps established connections.
        None if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0
            && !lb::source_allowed(frontend.rev_nat_id, flow.saddr) =>
        {
            return Ok(Verdict::drop(Stat::DropSourceRange));
        }
        None => {
            let mut pick = Pick {
                choice: lb::Choice {
                    backend_id: 0,
                    backend: proxy_common::maps::BackendV4::default(),
                    slot: 0,
                },
                route: fib::Route::NONE,
                rev_nat_id: 0,
            };
            new_flow(ctx, &flow, &found, &mut pick)?;
            if pick.route.ifindex != ctx.ingress_ifindex() as u32 {
                return Err(record_local(&flow, &pick));
            }
            commit(ctx, &flow, &pick, out)?;
            if !pick.route.neighbour_known {
                // Recorded but not sent (picking again in tc would favour
                // local backends): tc finds the flow established, and its
                // redirect resolves the neighbour.
                return Err(Verdict::pass(Stat::XdpToTc));
            }
        }
    }
    finish(ctx, &flow, out)
}

/// Rewrites the packet as a stage decided; [`run`] sends it.
#[inline(always)]
fn finish(ctx: &XdpContext, flow: &Flow, out: &Translation) -> Result<Verdict, Verdict> {
    // Checked by `handle` already: the verifier needs the check next to the
    // access.
    let packet = pointer::<[u8; REWRITE_SPAN]>(ctx, 0)?;
    if flow.proto == IPPROTO_UDP {
        rewrite::<{ L4 + UDP_OFF_CHECK }>(packet, flow, &out.tuple, &out.route);
    } else {
        rewrite::<{ L4 + TCP_OFF_CHECK }>(packet, flow, &out.tuple, &out.route);
    }
    Ok(Verdict::REDIRECT)
}

/// The rewrite a stage decided on, carried out by [`finish`].
struct Translation {
    tuple: checksum::FourTuple,
    route: fib::Route,
}

#[inline(never)]
fn snat_reply(
    ctx: &XdpContext,
    flow: &Flow,
    entry: *mut proxy_common::maps::CtEntryV4,
    out: &mut Translation,
) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    let key = flow.ct_key(CT_DIR_REPLY);
    let client = snat::reverse(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    // SAFETY: a map value valid for this program run.
    let (frontend, frontend_port) = unsafe { ((*entry).nat_addr, (*entry).nat_port) };
    let route = route_back_out(ctx, ingress, frontend, client.addr, flow)?;
    let now = conntrack::now();
    // SAFETY: as above.
    unsafe {
        conntrack::touch(entry, flow, CT_DIR_REPLY, now);
        conntrack::track_reply(entry, flow, (client.addr, client.port), (frontend, frontend_port));
    }
    *out = Translation { tuple: tuple(frontend, client.addr, frontend_port, client.port), route };
    stats::count(Stat::SnatReverse);
    // SAFETY: as above.
    events::unnat(flow, unsafe { &*entry }, ((frontend, frontend_port), (client.addr, client.port)), now);
    Ok(())
}

/// A packet of a known flow: only source-NATed ones to a current backend
/// are XDP's.
#[inline(never)]
fn established(
    ctx: &XdpContext,
    flow: &Flow,
    entry: *mut proxy_common::maps::CtEntryV4,
    out: &mut Translation,
) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    let key = flow.ct_key(CT_DIR_FORWARD);
    let config = config::get();
    let now = conntrack::now();
    // SAFETY: a map value valid for this program run.
    let entry_copy = unsafe { *entry };
    if entry_copy.flags & CT_FLAG_SNAT == 0
        || conntrack::expired(&key, &entry_copy, &config, now)
        || !lb::keeps_backend(&entry_copy, flow.proto)
    {
        // Not source-NATed (tc's flow), or tc must expire or re-balance it.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let to_node = snat::forward(&key, entry_copy.nat_addr, entry_copy.nat_port, entry_copy.flags)
        .ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    let route = route_back_out(ctx, ingress, to_node.addr, entry_copy.nat_addr, flow)?;
    // SAFETY: as above.
    unsafe { conntrack::touch(entry, flow, CT_DIR_FORWARD, now) };
    let after = ((to_node.addr, to_node.port), (entry_copy.nat_addr, entry_copy.nat_port));
    events::dnat_established(flow, after, &entry_copy, now);
    *out = Translation {
        tuple: tuple(to_node.addr, entry_copy.nat_addr, to_node.port, entry_copy.nat_port),
        route,
    };
    stats::count(Stat::DnatEstablished);
    Ok(())
}

/// As tc does for the flows it sends: a reply entry the LRU evicted is put back, or the backend's
/// next answer would reach the node's own stack at the SNAT port, un-NATed by nothing.
#[inline(never)]
fn keep_reply(flow: &Flow, entry: *const proxy_common::maps::CtEntryV4) {
    // SAFETY: a map value valid for this program run.
    let entry = unsafe { *entry };
    conntrack::keep_reply(&flow.ct_key(CT_DIR_FORWARD), &entry, &config::hairpin_addr());
}

/// The backend a new flow goes to, when it is XDP's (remote).
struct Pick {
    choice: lb::Choice,
    route: fib::Route,
    rev_nat_id: proxy_common::maps::RevNatId,
}

/// Picks the backend of a new flow and its route; only a backend on another
/// node is XDP's to send.
#[inline(never)]
fn new_flow(ctx: &XdpContext, flow: &Flow, found: &lb::Frontend, pick: &mut Pick) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    let frontend = found.value;
    if frontend.count == 0 || (flow.proto == IPPROTO_TCP && !starts_tcp_flow(flow.tcp_flags)) {
        // Refusals and invalid segments are the tc program's.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let choice = lb::select_backend(flow, found, conntrack::now())?;
    let route = fib::route(ctx, ingress, flow.saddr, choice.backend.addr, flow.ip_total_len)?;
    *pick = Pick { choice, route, rev_nat_id: frontend.rev_nat_id };
    Ok(())
}

/// A local backend: tc translates and delivers it. The choice is recorded
/// here, so tc follows it as an established flow instead of picking again
/// (which would favour remote backends). Returns the packet's verdict.
#[inline(never)]
fn record_local(flow: &Flow, pick: &Pick) -> Verdict {
    let key = flow.ct_key(CT_DIR_FORWARD);
    let backend = pick.choice.backend;
    if conntrack::lookup(&key.reply_of(backend.addr, backend.port)).is_some()
        || crate::inherited::holds_reply_off_stack(&key, backend.addr, backend.port)
    {
        // Another flow has the reply tuple: tc resolves the clash.
        return Verdict::pass(Stat::XdpToTc);
    }
    let now = conntrack::now();
    match conntrack::create(flow, &key, &pick.choice, pick.rev_nat_id, now, ReplyTo::CLIENT) {
        Ok(()) => {
            // The choice is XDP's, so is its event; tc's, for the same packet, tells of the send.
            let chosen = events::Chosen {
                backend_id: pick.choice.backend_id,
                slot: pick.choice.slot,
                count: 0,
                rev_nat_id: pick.rev_nat_id,
                ct_flags: 0,
            };
            events::dnat_new(flow, ((flow.saddr, flow.sport), (backend.addr, backend.port)), chosen, now);
            Verdict::pass(Stat::XdpToTc)
        }
        Err(verdict) => verdict,
    }
}

/// Takes a SNAT port for a picked flow and records it in conntrack.
#[inline(never)]
fn commit(ctx: &XdpContext, flow: &Flow, pick: &Pick, out: &mut Translation) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    let now = conntrack::now();
    let backend = pick.choice.backend;
    // SAFETY: the value is copied out at once.
    let node_addr = unsafe { EXTERNAL_IFACES.get(ingress) }
        .map(|i| i.addr)
        .ok_or(Verdict::pass(Stat::PassNoNodeAddress))?;
    let key = flow.ct_key(CT_DIR_FORWARD);
    let port = snat::allocate(flow, &key, backend.addr, backend.port, node_addr, now)?;
    if let Err(verdict) =
        conntrack::create(flow, &key, &pick.choice, pick.rev_nat_id, now, ReplyTo::snat(node_addr, port))
    {
        snat::remove(&key, backend.addr, backend.port, CT_FLAG_SNAT);
        return Err(verdict);
    }
    *out = Translation {
        tuple: tuple(node_addr, backend.addr, port, backend.port),
        route: fib::Route { neighbour_known: true, ..pick.route },
    };
    stats::count(Stat::DnatNew);
    stats::count(Stat::SnatNew);
    // The frontend's backend count is not carried this far (an event shows 0).
    let chosen = events::Chosen {
        backend_id: pick.choice.backend_id,
        slot: pick.choice.slot,
        count: 0,
        rev_nat_id: pick.rev_nat_id,
        ct_flags: CT_FLAG_SNAT,
    };
    events::dnat_new(flow, ((node_addr, port), (backend.addr, backend.port)), chosen, now);
    Ok(())
}
