//! Socket-level load balancing: a connect() (TCP, connected UDP) or a
//! sendmsg() (unconnected UDP) to a Service is sent to a backend before any
//! packet exists, so the flow needs no per-packet NAT at all; recvmsg() and
//! getpeername() show the Service address again. Session affinity is kept per
//! client: a pod is one client (its network namespace), the node's own
//! sockets another. Source-ranged load-balancer IPs are never short-circuited:
//! a pod's connection is left to the tc path on its veth, which knows the
//! client address, or — on a veth without tc (`--pod-veth-tc auto`) — goes to
//! the load balancer, which enforces its ranges, as the node's connections do
//! (kube-proxy enforces them for the node unless a range holds a node
//! address).
use aya_ebpf::{
    helpers::{
        bpf_get_prandom_u32,
        generated::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    },
    programs::SockAddrContext,
};
use proxy_common::{
    maglev::flow_hash,
    maps::{
        BackendV4, CT_DIR_FORWARD, CtKeyV4, IPPROTO_TCP, IPPROTO_UDP, RevNatId, SOCKET_LB_ALL,
        SOCKET_LB_HOST_ONLY, SVC_FLAG_AFFINITY, SVC_FLAG_SOURCE_RANGES, SockRevNatKeyV4, SockRevNatV4,
    },
    packet::Fragment,
    stats::Stat,
};

use crate::{
    conntrack, lb,
    maps::{SOCK_REVNAT_V4, SOCKET_LB_CONFIG},
    parse::Flow,
    stats,
};

const ECONNREFUSED: i32 = 111;
const EPERM: i32 = 1;
/// What a cgroup sock_addr program returns to let the call go on (the kernel
/// has no name for it; aya's bindings neither).
pub const PROCEED: i32 = 1;
/// What it returns to make the call fail (with the error `bpf_set_retval` set).
const REFUSE: i32 = 0;

/// Which sockets the hooks translate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// Not translated.
    None,
    /// A process in the node's own network namespace.
    Node,
    /// A pod's (`--socket-lb on`): its network namespace's cookie.
    Pod(u64),
}

#[inline(always)]
pub fn owner(ctx: &SockAddrContext) -> Owner {
    let Some(config) = SOCKET_LB_CONFIG.get(0) else { return Owner::None };
    if config.mode != SOCKET_LB_ALL && config.mode != SOCKET_LB_HOST_ONLY {
        return Owner::None;
    }
    // SAFETY: a helper reading the context's socket.
    let netns = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    match (netns == config.host_netns_cookie, config.mode) {
        (true, _) => Owner::Node,
        (false, SOCKET_LB_ALL) => Owner::Pod(netns),
        _ => Owner::None,
    }
}

/// The client address session affinity is keyed by, for sockets that have none
/// yet: `0.0.0.0` for the node, `0.x.y.z` from the low 24 bits of a pod's
/// network namespace cookie (one pod, one client, as its address would be;
/// 0.0.0.0/8 is no real client's source, so it never shares an entry with one).
#[inline(always)]
fn affinity_client(owner: Owner) -> [u8; 4] {
    match owner {
        Owner::Pod(netns) => [0, (netns >> 16) as u8, (netns >> 8) as u8, netns as u8],
        _ => [0; 4],
    }
}

#[inline(always)]
pub fn enabled(ctx: &SockAddrContext) -> bool {
    owner(ctx) != Owner::None
}

/// A UDP socket that reached a backend through a Service now talks to that
/// backend's own address: its answers must show the backend again, not the
/// Service (netfilter would remap the direct exchange's port; a socket has
/// one). The last exchange wins: a Service answer still on its way then shows
/// the backend's address.
#[inline(always)]
fn forget_service_of(ctx: &SockAddrContext, ip: u32, port: u32) {
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let key =
        SockRevNatKeyV4 { cookie, addr: ip.to_ne_bytes(), port: (port as u16).to_ne_bytes(), _pad: [0; 2] };
    // SAFETY: only tested for presence.
    if unsafe { SOCK_REVNAT_V4.get(key) }.is_some() {
        let _ = SOCK_REVNAT_V4.remove(key);
    }
}

/// What connect() or sendmsg() does with a call to an IPv4 destination.
pub enum Translation {
    /// The call goes on to its destination (`PROCEED`), or fails (`REFUSE`, its error set).
    Unchanged(i32),
    /// The call goes on to this backend address and port (as the context's `user_ip4` and
    /// `user_port` hold them).
    To { ip: u32, port: u32 },
}

/// connect4 and sendmsg4: the destination becomes a backend.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: the context the kernel passed; these fields are readable.
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    match translate_v4(ctx, ip, port) {
        Translation::Unchanged(verdict) => verdict,
        Translation::To { ip, port } => {
            // SAFETY: as above; user_ip4 and user_port are writable in these hooks.
            unsafe {
                (*sa).user_ip4 = ip;
                (*sa).user_port = port;
            }
            PROCEED
        }
    }
}

/// The backend for a call to IPv4 address `ip` and `port` (as the context holds them): the IPv4
/// hooks' and, for an IPv4-mapped address, the IPv6 hooks' (`sock6`). The caller writes the backend
/// into its own fields (the IPv6 hooks may not touch `user_ip4`).
#[inline(always)]
pub fn translate_v4(ctx: &SockAddrContext, ip: u32, port: u32) -> Translation {
    let owner = owner(ctx);
    if owner == Owner::None {
        return Translation::Unchanged(PROCEED);
    }
    let sa = ctx.sock_addr;
    // SAFETY: the context the kernel passed; `protocol` is readable.
    let proto = unsafe { (*sa).protocol } as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Translation::Unchanged(PROCEED);
    }
    let mut flow = destination(proto, ip, port);
    let Some(found) = lb::lookup_frontend(&flow) else {
        return Translation::Unchanged(no_frontend(ctx, &flow, ip, port));
    };
    if proto == IPPROTO_UDP && sends_inherited_flow(ctx, &flow) {
        // Untranslated, so that netfilter's entry for this port goes on
        // carrying it; tc tells this sender's flow from others by address.
        stats::count(Stat::PassInheritedFlow);
        return Translation::Unchanged(PROCEED);
    }
    let frontend = found.value;
    if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0 {
        return Translation::Unchanged(PROCEED);
    }
    if frontend.count == 0 {
        return Translation::Unchanged(refuse());
    }
    // Only now, for connections to a Service: every connect() on the node runs
    // this hook.
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    stand_in_client(&mut flow, owner, frontend.flags & SVC_FLAG_AFFINITY != 0, cookie);
    let Ok(choice) = lb::select_backend_by(&flow, &found, conntrack::now(), backend_pick(&flow)) else {
        return Translation::Unchanged(PROCEED);
    };
    remember_service(cookie, &choice.backend, &flow, frontend.rev_nat_id);
    stats::count(Stat::SockTranslated);
    Translation::To {
        ip: u32::from_ne_bytes(choice.backend.addr),
        port: u32::from(u16::from_ne_bytes(choice.backend.port)),
    }
}

/// The call's destination as a flow, for the frontend lookup (its client filled in later).
#[inline(always)]
fn destination(proto: u8, ip: u32, port: u32) -> Flow {
    Flow {
        saddr: [0; 4],
        daddr: ip.to_ne_bytes(),
        sport: [0; 2],
        dport: (port as u16).to_ne_bytes(),
        proto,
        tcp_flags: 0,
        l4_offset: 0,
        l4_check_offset: 0,
        ip_total_len: 0,
        fragment: Fragment::Whole,
        _pad1: 0,
        _pad2: 0,
        _pad4: 0,
    }
}

/// A call to no frontend: refused for a port a Service does not have or an unallocated service address,
/// untranslated otherwise.
#[inline(always)]
fn no_frontend(ctx: &SockAddrContext, flow: &Flow, ip: u32, port: u32) -> i32 {
    if lb::is_vip(&flow.daddr) {
        // A port the Service does not have: refused, as on the tc path.
        return refuse();
    }
    // The node's own packets cross no tc program of kproxy's, nor do a
    // covered pod's (`--pod-veth-tc auto`): an unallocated service address
    // is refused here, so that nothing leaves the node. A socket call can
    // only fail: EPERM, what netfilter's drop in OUTPUT gives a UDP sendmsg
    // (a TCP connect() through kube-proxy retries its SYN until it times
    // out instead).
    if lb::in_service_cidr(&flow.daddr) {
        stats::count(Stat::DropUnallocatedServiceIp);
        return refuse_unallocated();
    }
    if flow.proto == IPPROTO_UDP && !is_connected_peer(ctx, ip, port) {
        forget_service_of(ctx, ip, port);
    }
    PROCEED
}

/// Whether `ip`:`port` is the peer the socket is connected to. A dual-stack socket connected to an
/// IPv4-mapped Service address (connect6 put the backend there) reaches sendmsg4 with every
/// send(): the kernel hands such a datagram to the IPv4 UDP code with the peer as its explicit
/// destination. That is the Service's exchange going on, not a direct one with the backend.
#[inline(always)]
fn is_connected_peer(ctx: &SockAddrContext, ip: u32, port: u32) -> bool {
    // SAFETY: the context's socket, always set in these hooks; `dst_ip4` and `dst_port` are
    // readable (network byte order; zero while unconnected).
    let (peer_ip, peer_port) = unsafe {
        let sk = (*ctx.sock_addr).__bindgen_anon_1.sk;
        ((*sk).dst_ip4, (*sk).dst_port)
    };
    peer_ip == ip && peer_port == port as u16
}

/// The socket stands in for the client address and port, which do not exist
/// yet: Maglev spreads sockets, not one constant "0.0.0.0:0". With session
/// affinity the client is the node or the pod (all its sockets stick
/// together, as its address would through kube-proxy).
#[inline(always)]
fn stand_in_client(flow: &mut Flow, owner: Owner, affinity: bool, cookie: u64) {
    flow.saddr = if affinity { affinity_client(owner) } else { (cookie as u32).to_ne_bytes() };
    flow.sport = ((cookie >> 32) as u16).to_ne_bytes();
}

/// A UDP socket keeps its backend from one sendmsg to the next (as long as the
/// backends stay), like a conntrack entry would keep its flow's; TCP
/// connects once and picks at random.
#[inline(always)]
fn backend_pick(flow: &Flow) -> u32 {
    if flow.proto == IPPROTO_UDP {
        flow_hash(flow.saddr, flow.daddr, flow.sport, flow.dport, flow.proto, 0)
    } else {
        // SAFETY: a helper without side effects.
        unsafe { bpf_get_prandom_u32() }
    }
}

/// Records the Service this socket's backend stands for, so that recvmsg()
/// and getpeername() show the Service again.
#[inline(always)]
fn remember_service(cookie: u64, backend: &BackendV4, flow: &Flow, rev_nat_id: RevNatId) {
    let key = SockRevNatKeyV4 { cookie, addr: backend.addr, port: backend.port, _pad: [0; 2] };
    let value = SockRevNatV4 { vip: flow.daddr, port: flow.dport, _pad: [0; 2], rev_nat_id };
    // A full LRU evicts an old socket's entry; the call still goes on.
    // Unconnected UDP sends many datagrams to the same backend: a lookup is
    // cheaper than rewriting the LRU entry each time.
    // SAFETY: the value is compared at once.
    if unsafe { SOCK_REVNAT_V4.get(key) } != Some(&value) {
        let _ = SOCK_REVNAT_V4.insert(key, value, 0);
    }
}

/// Whether a flow netfilter translated before kproxy attached still uses the
/// socket's port towards this Service address (whatever the client address:
/// an unbound socket's is not known here).
#[inline(always)]
fn sends_inherited_flow(ctx: &SockAddrContext, flow: &Flow) -> bool {
    // SAFETY: the context's socket, always set in these hooks; `src_port` is
    // readable (host byte order, 0 before the socket is bound).
    let port = unsafe { (*(*ctx.sock_addr).__bindgen_anon_1.sk).src_port } as u16;
    if port == 0 {
        return false;
    }
    let key = CtKeyV4 {
        saddr: [0; 4],
        daddr: flow.daddr,
        sport: port.to_be_bytes(),
        dport: flow.dport,
        proto: flow.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    crate::inherited::is_open_for_any_client(&key)
}

#[inline(always)]
pub fn refuse() -> i32 {
    stats::count(Stat::SockRefused);
    // SAFETY: a helper setting this program's return value to the caller.
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    REFUSE
}

/// Fails the call to an unallocated service address with EPERM (what netfilter's drop in OUTPUT
/// gives a UDP sendmsg); the caller counted it.
#[inline(always)]
pub fn refuse_unallocated() -> i32 {
    // SAFETY: as in `refuse`.
    unsafe { bpf_set_retval(-EPERM) };
    REFUSE
}

/// recvmsg4 and getpeername4: a backend's address becomes the Service's.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    if !enabled(ctx) {
        return PROCEED;
    }
    let sa = ctx.sock_addr;
    // SAFETY: as in `translate`.
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
    if let Some(vip) = service_of(ctx, ip, port) {
        // SAFETY: as in `translate`.
        unsafe {
            (*sa).user_ip4 = u32::from_ne_bytes(vip.vip);
            (*sa).user_port = u32::from(u16::from_ne_bytes(vip.port));
        }
        stats::count(Stat::SockReverse);
    }
    PROCEED
}

/// The Service this socket reached IPv4 backend `ip`:`port` through (the IPv4 hooks' and, for an
/// IPv4-mapped peer, the IPv6 hooks').
#[inline(always)]
pub fn service_of(ctx: &SockAddrContext, ip: u32, port: u32) -> Option<SockRevNatV4> {
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let key =
        SockRevNatKeyV4 { cookie, addr: ip.to_ne_bytes(), port: (port as u16).to_ne_bytes(), _pad: [0; 2] };
    // SAFETY: the value is copied out at once.
    unsafe { SOCK_REVNAT_V4.get(key) }.copied()
}
