//! The XDP fast path for IPv6 on external interfaces, as `xdp.rs` is IPv4's: a NodePort /
//! ExternalIP / LB flow whose backend is on another node (DNAT + SNAT to the interface's IPv6
//! address, sent straight back out with a redirect), its later packets and the backend's replies.
//! It shares every map and decision with the tc path (`external6`): the same port search
//! (`snat6::remap`), the same conntrack entries (`conntrack6::create_to`, `CT_FLAG_SNAT`), the same
//! backend choice (`lb6::select_backend_in`). A new flow whose backend is local is recorded and
//! passed, so that tc follows the choice as an established flow. Anything else is passed untouched
//! to the stack, where tc handles it: extension headers and fragments, ICMPv6 (neighbour discovery,
//! errors about translated flows), policy Local, cluster IPs reached from outside, refusals,
//! invalid TCP, expired or rebalanced flows, unresolved neighbours, packets too big for the route.
//!
//! A chain of its own, as tc's IPv6 one: [`run`] is not inlined. The packet lives in
//! `FLOW6_SCRATCH`, the rewrite and route in `XDP6_SCRATCH` and a new flow's backend in
//! `CHOICE6_SCRATCH` (per-CPU: XDP runs to completion before tc sees the packet on that CPU).
use aya_ebpf::{helpers::generated::bpf_xdp_get_buff_len, programs::XdpContext};
use proxy_common::{
    checksum,
    conntrack::starts_tcp_flow,
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_SNAT, IPPROTO_TCP, IPPROTO_UDP, RevNatId, SCOPE_EXTERNAL,
        SCOPE_INTERNAL, SVC_FLAG_EXTERNAL_ADDR, SVC_FLAG_SOURCE_RANGES, ServiceValueV4,
    },
    maps_v6::CtEntryV6,
    packet::{ETH_HLEN, Fragment, TCP_OFF_CHECK, TCP_OFF_FLAGS, UDP_OFF_CHECK},
    packet6::{ETH_P_IPV6, IPV6_HLEN, locate_l4},
    stats::Stat,
    trace::{EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_UNNAT},
};

use crate::{
    config, conntrack,
    conntrack6::{self, ReplyTo6},
    events, external6, fib, fib6, lb6,
    maps::{CHOICE6_SCRATCH, EXTERNAL_IFACES_V6, FLOW6_SCRATCH, XDP6_SCRATCH},
    parse::skip_stat,
    parse6::Flow6,
    snat6, stats,
    verdict::Verdict,
    xdp::{self, pointer},
};

/// Only packets with no extension header: their L4 header sits at a fixed offset.
const L4: usize = ETH_HLEN + IPV6_HLEN;

/// The bytes XDP needs in a TCP packet it rewrites: Ethernet, the IPv6 header and a TCP header.
const TCP_SPAN: usize = L4 + 20;
/// And in a UDP one: the UDP header (a short answer, an empty datagram are XDP's too).
const UDP_SPAN: usize = L4 + 8;

/// The rewrite a stage decided on and where it goes, carried out by [`finish`]: in a per-CPU map,
/// as the IPv6 tc chain keeps its route, since 56 bytes more in [`run`]'s frame would count against
/// every stage's.
#[repr(C)]
pub struct Xdp6 {
    pub route: fib::Route,
    pub tuple: checksum::FourTuple6,
}

/// Whether the frame is IPv6: the choice between this chain and IPv4's.
#[inline(always)]
pub fn is_ipv6(ctx: &XdpContext) -> bool {
    let start = ctx.data();
    if start + ETH_HLEN > ctx.data_end() {
        return false;
    }
    // SAFETY: inside the bounds just checked against data_end.
    let ethertype = unsafe { core::ptr::read_unaligned((start + 12) as *const [u8; 2]) };
    u16::from_be_bytes(ethertype) == ETH_P_IPV6
}

/// An IPv6 packet on an external interface, carried out to the end: the XDP action.
#[inline(never)]
pub fn run(ctx: &XdpContext) -> u32 {
    let Some(out) = XDP6_SCRATCH.get_ptr_mut(0) else {
        return xdp::act(Err(Verdict::pass(Stat::XdpToTc)), &fib::Route::NONE);
    };
    // SAFETY: this CPU's entry, used by this program run alone.
    let out = unsafe { &mut *out };
    out.route = fib::Route::NONE;
    let result = handle(ctx, out);
    xdp::act(result, &out.route)
}

#[inline(always)]
fn handle(ctx: &XdpContext, out: &mut Xdp6) -> Result<Verdict, Verdict> {
    let flow = FLOW6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::PassMalformed))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let flow = unsafe { &mut *flow };
    // `parse` checked that the L4 header is inside the (linear) buffer: `finish` can rewrite what
    // the stages decide, its own bounds check (the verifier's) never fails.
    parse(ctx, flow)?;
    let (snat_min, snat_max) = config::nodeport().port_range();
    let dport = u16::from_be_bytes(flow.dport);
    if dport >= snat_min && dport <= snat_max && external6::is_snat_reply(flow) {
        snat_reply(ctx, flow, out)?;
        return finish(ctx, flow, out, EV_UNNAT, core::ptr::null());
    }
    // Each stage is called from here, none from another: the BPF stack limit counts a whole call
    // chain.
    if lb6::lookup_scope(flow, SCOPE_EXTERNAL).is_some() {
        // externalTrafficPolicy: Local (local backends only) is tc's.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let frontend = lb6::lookup_scope(flow, SCOPE_INTERNAL).ok_or(Verdict::pass(Stat::PassNoService))?;
    if frontend.flags & SVC_FLAG_EXTERNAL_ADDR == 0 {
        // A cluster IP reached from outside (masqueraded, whatever the backend) is tc's.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    match known(flow) {
        Some(entry) => {
            established(ctx, flow, entry, out)?;
            keep_reply(flow, entry);
            finish(ctx, flow, out, EV_DNAT_ESTABLISHED, core::ptr::null())
        }
        // Source ranges admit new flows only, as tc (which looks a known flow up first) does.
        None if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0
            && !lb6::source_allowed(frontend.rev_nat_id, flow.saddr) =>
        {
            Ok(Verdict::drop(Stat::DropSourceRange))
        }
        None => {
            new_flow(ctx, flow, frontend, out)?;
            if out.route.ifindex != ctx.ingress_ifindex() as u32 {
                if reply_tuple_taken(flow) {
                    // Another flow has the reply tuple: tc resolves the clash.
                    return Err(Verdict::pass(Stat::XdpToTc));
                }
                record_local(flow, frontend.rev_nat_id, out)?;
                // The choice is XDP's, so is its event; tc's, for the same packet, tells of the
                // send.
                events::xdp_step6(flow, EV_DNAT_NEW, frontend, &out.tuple);
                return Err(Verdict::pass(Stat::XdpToTc));
            }
            commit(ctx, flow, frontend.rev_nat_id, out)?;
            if !out.route.neighbour_known {
                // Recorded but not sent (picking again in tc would favour local backends): tc
                // finds the flow established, and its redirect resolves the neighbour. The choice
                // was XDP's, so is its event (as IPv4's; tc's tells of the send).
                events::xdp_step6(flow, EV_DNAT_NEW, frontend, &out.tuple);
                return Err(Verdict::pass(Stat::XdpToTc));
            }
            finish(ctx, flow, out, EV_DNAT_NEW, frontend)
        }
    }
}

/// Reads the packet into `flow`: only TCP or UDP right after the fixed header. Not inlined: its
/// temporaries stay out of [`run`]'s frame.
#[inline(never)]
fn parse(ctx: &XdpContext, flow: &mut Flow6) -> Result<(), Verdict> {
    let ip: *const [u8; IPV6_HLEN] = pointer(ctx, ETH_HLEN)?;
    // SAFETY: bounds checked by `pointer`.
    let (version_word, payload_len, next_header) =
        unsafe { ((*ip)[0], u16::from_be_bytes([(*ip)[4], (*ip)[5]]), (*ip)[6]) };
    if next_header != IPPROTO_TCP && next_header != IPPROTO_UDP {
        // Extension headers (fragments among them) and ICMPv6 are tc's, which walks them.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    // From the helper, not `data_end - data` (see `xdp::parse`).
    // SAFETY: a helper reading the context.
    let available = (unsafe { bpf_xdp_get_buff_len(ctx.ctx) } as usize).saturating_sub(ETH_HLEN);
    // The length checks tc makes: the payload within the frame, room for the L4 header.
    locate_l4(version_word, next_header, payload_len, available, |_| None)
        .map_err(|skip| Verdict::pass(skip_stat(skip)))?;
    let ports: *const [u8; 4] = pointer(ctx, L4)?;
    let (tcp_flags, check) = if next_header == IPPROTO_TCP {
        let flags: *const u8 = pointer(ctx, L4 + TCP_OFF_FLAGS)?;
        // SAFETY: as above.
        (unsafe { *flags }, L4 + TCP_OFF_CHECK)
    } else {
        (0, L4 + UDP_OFF_CHECK)
    };
    // SAFETY: as above; the addresses are at offsets 8 and 24 of the 40-byte header.
    unsafe {
        flow.saddr = core::ptr::read_unaligned((ip as *const u8).add(8) as *const [u8; 16]);
        flow.daddr = core::ptr::read_unaligned((ip as *const u8).add(24) as *const [u8; 16]);
        flow.sport = [(*ports)[0], (*ports)[1]];
        flow.dport = [(*ports)[2], (*ports)[3]];
    }
    flow.l4_offset = L4;
    flow.l4_check_offset = check;
    flow.proto = next_header;
    flow.tcp_flags = tcp_flags;
    flow.payload_len = payload_len;
    flow.fragment = Fragment::Whole;
    flow.extension_headers = 0;
    flow._pad2 = 0;
    flow._pad4 = 0;
    Ok(())
}

/// The forward entry of the packet's flow, if it has one. Not inlined: the key stays out of
/// [`run`]'s frame.
#[inline(never)]
fn known(flow: &Flow6) -> Option<*mut CtEntryV6> {
    conntrack6::lookup(&flow.ct_key(CT_DIR_FORWARD))
}

/// Rewrites the packet as a stage decided, then tells `kproxy trace` (`kind`, the frontend of a
/// new flow); [`run`] sends it.
#[inline(always)]
fn finish(
    ctx: &XdpContext,
    flow: &Flow6,
    out: &Xdp6,
    kind: u8,
    frontend: *const ServiceValueV4,
) -> Result<Verdict, Verdict> {
    // Checked by `handle` already: the verifier needs the check next to the access.
    if flow.proto == IPPROTO_UDP {
        rewrite::<UDP_SPAN, { L4 + UDP_OFF_CHECK }>(pointer(ctx, 0)?, flow.proto, out);
    } else {
        rewrite::<TCP_SPAN, { L4 + TCP_OFF_CHECK }>(pointer(ctx, 0)?, flow.proto, out);
    }
    events::xdp_step6(flow, kind, frontend, &out.tuple);
    Ok(Verdict::REDIRECT)
}

/// Rewrites the packet's four-tuple, its L4 checksum and its Ethernet header. `packet` is the start
/// of the frame, checked to hold `SPAN` bytes (the L4 header's end); `SPAN` and `L4_CHECK` are
/// constants of each instance (see `xdp::rewrite`).
#[inline(never)]
fn rewrite<const SPAN: usize, const L4_CHECK: usize>(packet: *mut [u8; SPAN], proto: u8, out: &Xdp6) {
    const ADDRS: usize = ETH_HLEN + 8;
    // SAFETY: every offset below is inside SPAN (the ports and checksum are in the L4 header),
    // which the caller checked against the end of the packet.
    unsafe {
        let p = &mut *packet;
        let old_addrs = &*(p.as_ptr().add(ADDRS) as *const [u8; 32]);
        let old_ports = [p[L4], p[L4 + 1], p[L4 + 2], p[L4 + 3]];
        let check = u16::from_be_bytes([p[L4_CHECK], p[L4_CHECK + 1]]);
        let check = checksum::translated_v6(check, proto, old_addrs, &old_ports, &out.tuple);
        p[L4_CHECK..L4_CHECK + 2].copy_from_slice(&check.to_be_bytes());
        p[ADDRS..L4].copy_from_slice(&out.tuple[..32]);
        p[L4..L4 + 4].copy_from_slice(&out.tuple[32..]);
        p[..12].copy_from_slice(&out.route.macs);
    }
}

#[inline(always)]
fn set_tuple(out: &mut Xdp6, saddr: &[u8; 16], daddr: &[u8; 16], sport: [u8; 2], dport: [u8; 2]) {
    out.tuple[..16].copy_from_slice(saddr);
    out.tuple[16..32].copy_from_slice(daddr);
    out.tuple[32..34].copy_from_slice(&sport);
    out.tuple[34..].copy_from_slice(&dport);
}

/// The route of a rewritten packet into `route`, when it leaves by the interface it came in on
/// toward a known neighbour — the only kind XDP sends (see `xdp::route_back_out`).
#[inline(always)]
fn route_back_out(
    ctx: &XdpContext,
    flow: &Flow6,
    saddr: &[u8; 16],
    daddr: &[u8; 16],
    route: &mut fib::Route,
) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    fib6::route_for_len(ctx, ingress, saddr, daddr, flow.ip_len(), route)?;
    if !route.neighbour_known || route.ifindex != ingress {
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    Ok(())
}

/// A backend's reply to a source-NATed flow: from the frontend, to the client.
#[inline(never)]
fn snat_reply(ctx: &XdpContext, flow: &Flow6, out: &mut Xdp6) -> Result<(), Verdict> {
    let key = flow.ct_key(CT_DIR_REPLY);
    let entry = conntrack6::lookup(&key).ok_or(Verdict::pass(Stat::PassNoService))?;
    let client = snat6::reverse_entry(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    // SAFETY: map values valid for this program run, read in place.
    unsafe {
        route_back_out(ctx, flow, &(*entry).nat_addr, &(*client).addr, &mut out.route)?;
        conntrack6::touch(entry, flow, CT_DIR_REPLY, conntrack::now());
        conntrack6::track_reply(
            entry,
            flow,
            &((*client).addr, (*client).port),
            &((*entry).nat_addr, (*entry).nat_port),
        );
        set_tuple(out, &(*entry).nat_addr, &(*client).addr, (*entry).nat_port, (*client).port);
    }
    stats::count(Stat::SnatReverse);
    Ok(())
}

/// A packet of a known flow: only source-NATed ones to a current backend are XDP's.
#[inline(never)]
fn established(ctx: &XdpContext, flow: &Flow6, entry: *mut CtEntryV6, out: &mut Xdp6) -> Result<(), Verdict> {
    let key = flow.ct_key(CT_DIR_FORWARD);
    let now = conntrack::now();
    // SAFETY: a map value valid for this program run, read in place.
    let for_tc = unsafe {
        (*entry).flags & CT_FLAG_SNAT == 0
            || conntrack6::expired(&key, entry, &config::get().timeouts, now)
            || !lb6::keeps_backend(&*entry, flow.proto)
    };
    if for_tc {
        // Not source-NATed (tc's flow), or tc must expire or re-balance it.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let to_node = snat6::forward_entry(&key).ok_or(Verdict::pass(Stat::SnatEntryMissing))?;
    // SAFETY: as above.
    unsafe {
        route_back_out(ctx, flow, &(*to_node).addr, &(*entry).nat_addr, &mut out.route)?;
        conntrack6::touch(entry, flow, CT_DIR_FORWARD, now);
        set_tuple(out, &(*to_node).addr, &(*entry).nat_addr, (*to_node).port, (*entry).nat_port);
    }
    stats::count(Stat::DnatEstablished);
    Ok(())
}

/// As tc does for the flows it sends: a reply entry the LRU evicted is put back, or the backend's
/// next answer would reach the node's own stack at the SNAT port, un-NATed by nothing.
#[inline(never)]
fn keep_reply(flow: &Flow6, entry: *const CtEntryV6) {
    let key = flow.ct_key(CT_DIR_FORWARD);
    // SAFETY: a map value of this program run.
    unsafe { conntrack6::keep_reply(&key, entry) };
}

/// Picks a new flow's backend (into CHOICE6_SCRATCH) and its route (into `out`).
#[inline(never)]
fn new_flow(
    ctx: &XdpContext,
    flow: &Flow6,
    frontend: &ServiceValueV4,
    out: &mut Xdp6,
) -> Result<(), Verdict> {
    if frontend.count == 0 || (flow.proto == IPPROTO_TCP && !starts_tcp_flow(flow.tcp_flags)) {
        // Refusals and invalid segments are tc's.
        return Err(Verdict::pass(Stat::XdpToTc));
    }
    let choice = CHOICE6_SCRATCH.get_ptr_mut(0).ok_or(Verdict::pass(Stat::NoBackend))?;
    // SAFETY: a per-CPU value, used by this program run alone.
    let choice = unsafe { &mut *choice };
    lb6::select_backend_in(flow, frontend, conntrack::now(), choice, SCOPE_INTERNAL)?;
    let ingress = ctx.ingress_ifindex() as u32;
    fib6::route_for_len(ctx, ingress, &flow.saddr, &choice.backend.addr, flow.ip_len(), &mut out.route)
}

/// Whether a live flow of the client already has the reply tuple of the local backend
/// `new_flow` picked (into CHOICE6_SCRATCH). Called from [`run`] rather than from [`record_local`]:
/// `conntrack6::claim`'s frame beside the flow's record would pass the stack limit.
#[inline(always)]
fn reply_tuple_taken(flow: &Flow6) -> bool {
    let Some(choice) = CHOICE6_SCRATCH.get_ptr(0) else { return true };
    // SAFETY: this CPU's entry, which `new_flow` filled in on this run, read in place.
    let backend = unsafe { &(*choice).backend };
    conntrack6::claim(flow, &backend.addr, backend.port, false).is_some()
}

/// A local backend, whose reply tuple no other flow has: tc translates and delivers it. The choice is recorded here, so that tc follows
/// it as an established flow instead of picking again (which would favour remote backends).
/// `out` gets the translation tc will make, for the event.
#[inline(never)]
fn record_local(flow: &Flow6, rev_nat_id: RevNatId, out: &mut Xdp6) -> Result<(), Verdict> {
    let choice = CHOICE6_SCRATCH.get_ptr(0).ok_or(Verdict::pass(Stat::NoBackend))?;
    // SAFETY: this CPU's entry, which `new_flow` filled in on this run.
    let choice = unsafe { &*choice };
    let backend = &choice.backend;
    let key = flow.ct_key(CT_DIR_FORWARD);
    let reply_to = ReplyTo6::client(flow.sport);
    let now = conntrack::now();
    conntrack6::create_to(flow, &key, backend, choice.backend_id, rev_nat_id, now, reply_to, &flow.saddr)?;
    set_tuple(out, &flow.saddr, &backend.addr, flow.sport, backend.port);
    Ok(())
}

/// Takes a SNAT port for a remote pick and records the flow in conntrack, as tc's `new_flow` does
/// for a source-NATed one. A port taken for a flow that cannot be recorded is left to SNAT_V6's LRU
/// and the GC's sweep, as tc leaves it.
#[inline(never)]
fn commit(ctx: &XdpContext, flow: &Flow6, rev_nat_id: RevNatId, out: &mut Xdp6) -> Result<(), Verdict> {
    let ingress = ctx.ingress_ifindex() as u32;
    let choice = CHOICE6_SCRATCH.get_ptr(0).ok_or(Verdict::pass(Stat::NoBackend))?;
    let node = EXTERNAL_IFACES_V6.get_ptr(ingress).ok_or(Verdict::pass(Stat::PassNoNodeAddress))?;
    let now = conntrack::now();
    // SAFETY: this CPU's entry, which `new_flow` filled in on this run, and a map value valid for
    // this program run, both read in place.
    let (choice, node) = unsafe { (&*choice, &(*node).addr) };
    let backend = &choice.backend;
    let port = snat6::remap(flow, &backend.addr, backend.port, node, now)?;
    let key = flow.ct_key(CT_DIR_FORWARD);
    conntrack6::create_to(
        flow,
        &key,
        backend,
        choice.backend_id,
        rev_nat_id,
        now,
        ReplyTo6::snat(port),
        node,
    )?;
    set_tuple(out, node, &backend.addr, port, backend.port);
    stats::count(Stat::DnatNew);
    stats::count(Stat::SnatNew);
    Ok(())
}
