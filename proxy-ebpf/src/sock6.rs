//! Socket-level load balancing for IPv6 sockets (`connect6`, `sendmsg6`, `recvmsg6`,
//! `getpeername6`), with the IPv4 hooks' semantics (`sock.rs`): which sockets are translated
//! (`--socket-lb host-only|on`, the netns cookie), a backend picked at connect() (TCP at random, UDP
//! by the socket cookie, sessionAffinity per client), ECONNREFUSED without endpoints or on a port
//! the cluster IP lacks, source-ranged frontends left alone, the Service shown again by recvmsg()
//! and getpeername().
//!
//! A dual-stack socket reaching an IPv4 cluster IP names it `::ffff:a.b.c.d` (kubelet, Java, Go):
//! the kernel sends IPv4 packets, so such an address goes through the IPv4 Service
//! (`sock::translate_v4`) and becomes `::ffff:<backend>`, its reverse entry in SOCK_REVNAT_V4
//! keyed by the IPv4 backend as for an AF_INET socket. Only connect6 and the reverse hooks see
//! mapped addresses: an unconnected sendmsg() to one is handed to the IPv4 UDP code, which runs
//! sendmsg4. Native IPv6 addresses go through SERVICES_V6/BACKENDS_V6 and SOCK_REVNAT_V6.
//!
//! `user_ip6` is read and written as four 32-bit words: the only size the kernel allows for writes.
use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::{bpf_get_prandom_u32, generated::bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use proxy_common::{
    maglev::flow_hash,
    maps::{
        IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL, SVC_FLAG_AFFINITY, SVC_FLAG_SOURCE_RANGES, ServiceValueV4,
    },
    maps_v6::{BackendV6, ServiceKeyV6},
    packet::Fragment,
    slots::select_slot,
    sock_v6::{SockRevNatKeyV6, SockRevNatV6, bytes_of_words, fold, ipv4_of_mapped, words_of_bytes},
    stats::Stat,
};

use crate::{
    conntrack, lb6,
    maps::{BACKENDS_V6, SERVICES_V6, SOCK_REVNAT_V6},
    parse6::Flow6,
    sock::{self, Owner, PROCEED, Translation},
    stats,
};

#[inline(always)]
fn read_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
    // SAFETY: the context the kernel passed; `user_ip6` is readable in the IPv6 hooks, word by word.
    unsafe {
        let ip6 = &raw const (*sa).user_ip6;
        [
            core::ptr::read_volatile(&raw const (*ip6)[0]),
            core::ptr::read_volatile(&raw const (*ip6)[1]),
            core::ptr::read_volatile(&raw const (*ip6)[2]),
            core::ptr::read_volatile(&raw const (*ip6)[3]),
        ]
    }
}

#[inline(always)]
fn write_ip6(sa: *mut bpf_sock_addr, words: [u32; 4], port: u32) {
    // SAFETY: as in `read_ip6`; `user_ip6` and `user_port` are writable in these hooks, `user_ip6`
    // in 32-bit stores only (volatile: the compiler must not merge them).
    unsafe {
        let ip6 = &raw mut (*sa).user_ip6;
        core::ptr::write_volatile(&raw mut (*ip6)[0], words[0]);
        core::ptr::write_volatile(&raw mut (*ip6)[1], words[1]);
        core::ptr::write_volatile(&raw mut (*ip6)[2], words[2]);
        core::ptr::write_volatile(&raw mut (*ip6)[3], words[3]);
        (*sa).user_port = port;
    }
}

/// connect6 and sendmsg6: the destination becomes a backend.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let words = read_ip6(sa);
    // SAFETY: as in `read_ip6`.
    let port = unsafe { (*sa).user_port };
    if let Some(ip4) = ipv4_of_mapped(words) {
        return match sock::translate_v4(ctx, u32::from_ne_bytes(ip4), port) {
            Translation::Unchanged(verdict) => verdict,
            Translation::To { ip, port } => {
                write_ip6(sa, [words[0], words[1], words[2], ip], port);
                PROCEED
            }
        };
    }
    translate_native(ctx, words, port)
}

/// A call to a native IPv6 address.
#[inline(always)]
fn translate_native(ctx: &SockAddrContext, words: [u32; 4], port: u32) -> i32 {
    let owner = sock::owner(ctx);
    if owner == Owner::None {
        return PROCEED;
    }
    let sa = ctx.sock_addr;
    // SAFETY: as in `read_ip6`.
    let proto = unsafe { (*sa).protocol } as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return PROCEED;
    }
    let vip = bytes_of_words(words);
    let dport = (port as u16).to_ne_bytes();
    let key = ServiceKeyV6::new(vip, dport, proto, SCOPE_INTERNAL, 0);
    // SAFETY: entries are replaced whole by userspace, never freed under us for longer than the
    // RCU section this program runs in.
    let Some(frontend) = (unsafe { SERVICES_V6.get(key) }) else {
        return no_frontend(ctx, &vip, dport, proto);
    };
    if frontend.flags & SVC_FLAG_SOURCE_RANGES != 0 {
        return PROCEED;
    }
    if frontend.count == 0 {
        return sock::refuse();
    }
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let Some(backend) = backend_of(&key, frontend, owner, cookie, words) else { return PROCEED };
    write_ip6(sa, words_of_bytes(backend.addr), u32::from(u16::from_ne_bytes(backend.port)));
    remember_service(cookie, &backend, vip, dport, frontend.rev_nat_id);
    stats::count(Stat::SockTranslated);
    PROCEED
}

/// The backend a socket's call to frontend `key` (slot 0) goes to. With sessionAffinity, the
/// client's sticky one (`lb6::select_backend`, as tc picks it) for the client this socket stands
/// for: the node `::`, a pod `::<its network namespace cookie>` (`::/64` is no real client's
/// source). Otherwise a UDP socket keeps its backend from one sendmsg to the next while the
/// backends stay (by its cookie), and TCP picks at random, as the IPv4 hooks do.
#[inline(always)]
fn backend_of(
    key: &ServiceKeyV6,
    frontend: &ServiceValueV4,
    owner: Owner,
    cookie: u64,
    words: [u32; 4],
) -> Option<BackendV6> {
    if frontend.flags & SVC_FLAG_AFFINITY != 0 {
        let netns = match owner {
            Owner::Pod(netns) => netns,
            _ => 0,
        };
        let mut saddr = [0u8; 16];
        saddr[8..].copy_from_slice(&netns.to_be_bytes());
        let flow = Flow6 {
            l4_offset: 0,
            l4_check_offset: 0,
            saddr,
            daddr: key.vip,
            sport: [0; 2],
            dport: key.port,
            proto: key.proto,
            tcp_flags: 0,
            payload_len: 0,
            fragment: Fragment::Whole,
            extension_headers: 0,
            _pad2: 0,
            _pad4: 0,
        };
        let mut choice = lb6::Choice6 { backend_id: 0, backend: BackendV6::default(), slot: 0 };
        return lb6::select_backend(&flow, frontend, conntrack::now(), &mut choice)
            .ok()
            .map(|()| choice.backend);
    }
    let pick = if key.proto == IPPROTO_UDP {
        flow_hash(
            (cookie as u32).to_ne_bytes(),
            fold(words),
            ((cookie >> 32) as u16).to_ne_bytes(),
            key.port,
            key.proto,
            0,
        )
    } else {
        // SAFETY: a helper without side effects.
        unsafe { bpf_get_prandom_u32() }
    };
    let slot = select_slot(pick, frontend.count)?;
    // SAFETY: as in `translate_native`.
    let backend_id = unsafe { SERVICES_V6.get(key.with_slot(slot)) }?.backend_id;
    // SAFETY: as above; the value is copied out.
    unsafe { BACKENDS_V6.get(backend_id) }.copied()
}

/// A call to no IPv6 frontend: refused on a port a Service's cluster IP does not have, untranslated
/// otherwise (no IPv6 service CIDR is known to refuse unallocated addresses with).
#[inline(always)]
fn no_frontend(ctx: &SockAddrContext, vip: &[u8; 16], port: [u8; 2], proto: u8) -> i32 {
    if lb6::is_vip(vip) {
        return sock::refuse();
    }
    // An unallocated service address: refused with EPERM, as `sock.rs` does for IPv4 (the node's and
    // covered pods' packets cross no tc program of kproxy's).
    if lb6::in_service_cidr(vip) {
        stats::count(Stat::DropUnallocatedServiceIp);
        return sock::refuse_unallocated();
    }
    if proto == IPPROTO_UDP {
        forget_service_of(ctx, vip, port);
    }
    PROCEED
}

/// A UDP socket that reached a backend through a Service now talks to that backend's own address:
/// its answers show the backend again (see `sock::forget_service_of`).
#[inline(always)]
fn forget_service_of(ctx: &SockAddrContext, addr: &[u8; 16], port: [u8; 2]) {
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    let key = SockRevNatKeyV6 { cookie, addr: *addr, port, _pad: [0; 6] };
    // SAFETY: only tested for presence.
    if unsafe { SOCK_REVNAT_V6.get(key) }.is_some() {
        let _ = SOCK_REVNAT_V6.remove(key);
    }
}

/// Records the Service this socket's backend stands for, so that recvmsg() and getpeername() show
/// it again.
#[inline(always)]
fn remember_service(
    cookie: u64,
    backend: &BackendV6,
    vip: [u8; 16],
    port: [u8; 2],
    rev_nat_id: proxy_common::maps::RevNatId,
) {
    let key = SockRevNatKeyV6 { cookie, addr: backend.addr, port: backend.port, _pad: [0; 6] };
    let value = SockRevNatV6 { vip, port, _pad: [0; 2], rev_nat_id };
    // As SOCK_REVNAT_V4: a lookup is cheaper than rewriting the LRU entry for every datagram.
    // SAFETY: the value is compared at once.
    if unsafe { SOCK_REVNAT_V6.get(key) } != Some(&value) {
        let _ = SOCK_REVNAT_V6.insert(key, value, 0);
    }
}

/// recvmsg6 and getpeername6: a backend's address becomes the Service's — `::ffff:<VIP>` for an
/// IPv4 backend the socket reached through its mapped address.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    if !sock::enabled(ctx) {
        return PROCEED;
    }
    let sa = ctx.sock_addr;
    let words = read_ip6(sa);
    // SAFETY: as in `read_ip6`.
    let port = unsafe { (*sa).user_port };
    if let Some(ip4) = ipv4_of_mapped(words) {
        if let Some(service) = sock::service_of(ctx, u32::from_ne_bytes(ip4), port) {
            let vip = u32::from_ne_bytes(service.vip);
            write_ip6(sa, [words[0], words[1], words[2], vip], u32::from(u16::from_ne_bytes(service.port)));
            stats::count(Stat::SockReverse);
        }
        return PROCEED;
    }
    // SAFETY: a helper reading the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let key = SockRevNatKeyV6 {
        cookie,
        addr: bytes_of_words(words),
        port: (port as u16).to_ne_bytes(),
        _pad: [0; 6],
    };
    // SAFETY: the value is copied out at once.
    if let Some(service) = unsafe { SOCK_REVNAT_V6.get(key) }.copied() {
        write_ip6(sa, words_of_bytes(service.vip), u32::from(u16::from_ne_bytes(service.port)));
        stats::count(Stat::SockReverse);
    }
    PROCEED
}
