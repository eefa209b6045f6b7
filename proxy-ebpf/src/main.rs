//! kproxy's eBPF programs: the entry points, and nothing else. Each one runs
//! its stages and turns what they decided into the kernel's action:
//! - `kproxy_ingress` (tc ingress of a pod's host-side veth, packets leaving
//!   the pod) and `kproxy_external_ingress` (tc ingress of the node's external
//!   interfaces): DNAT to a backend, refusals, hairpin and SNAT replies
//!   (`ingress.rs`);
//! - `kproxy_egress` (tc egress of a pod's veth, packets entering the pod):
//!   replies un-NATed back to the Service (`egress.rs`);
//! - IPv6 on the pod veths: ClusterIP DNAT, refusals and un-NAT in chains of
//!   their own (`ingress6.rs`, `egress6.rs`), chosen by ethertype; on the
//!   external interfaces NodePorts, ExternalIPs and LB IPs with SNAT
//!   (`external6.rs`);
//! - `kproxy_xdp`: the north-south fast path for remote backends (`xdp.rs`; IPv6 in `xdp6.rs`);
//! - the cgroup socket hooks: socket-level load balancing (`sock.rs`; IPv6 sockets, with
//!   IPv4-mapped addresses, in `sock6.rs`).
//!
//! tc's stages end in a `verdict::Verdict`, which `verdict::finish` carries
//! out. The decisions the programs share with userspace live in proxy-common.
#![no_std]
#![no_main]

mod config;
mod conntrack;
mod conntrack6;
mod egress;
mod egress6;
mod events;
mod external6;
mod fib;
mod fib6;
mod icmp;
mod icmp6;
mod ingress;
mod ingress6;
mod inherited;
mod lb;
mod lb6;
mod maps;
mod nat;
mod nat6;
mod parse;
mod parse6;
mod reject;
mod reject6;
mod snat;
mod snat6;
mod sock;
mod sock6;
mod stats;
mod verdict;
mod xdp;
mod xdp6;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};

use crate::verdict::finish;

/// tc ingress of a pod's host-side veth: packets leaving the pod.
#[classifier]
pub fn kproxy_ingress(ctx: TcContext) -> i32 {
    // IPv6 takes a chain of its own (`ingress6`), so neither family's stages share a stack.
    if parse6::is_ipv6(&ctx) {
        return ingress6::run(&ctx);
    }
    let mut route = fib::Route::NONE;
    let result = ingress::ingress::<false>(&ctx, &mut route);
    finish(&ctx, result, &route)
}

/// tc ingress of the node's external interfaces: NodePorts, ExternalIPs and
/// LoadBalancer IPs (and cluster IPs routed to the node), with SNAT where the
/// reply would otherwise not come back through this node.
#[classifier]
pub fn kproxy_external_ingress(ctx: TcContext) -> i32 {
    // IPv6 takes a chain of its own (`external6`), as on the pod veths.
    if parse6::is_ipv6(&ctx) {
        return external6::run(&ctx);
    }
    let mut route = fib::Route::NONE;
    let result = ingress::ingress::<true>(&ctx, &mut route);
    finish(&ctx, result, &route)
}

/// XDP on the node's external interfaces: the same north-south path for
/// remote backends, before the stack sees the packet.
#[xdp]
pub fn kproxy_xdp(ctx: XdpContext) -> u32 {
    // IPv6 takes a chain of its own (`xdp6`), as in tc.
    if xdp6::is_ipv6(&ctx) {
        return xdp6::run(&ctx);
    }
    xdp::run(&ctx)
}

/// Socket-level load balancing: connect() to a Service goes to a backend.
#[cgroup_sock_addr(connect4)]
pub fn kproxy_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

/// Unconnected UDP: each sendmsg() to a Service goes to a backend.
#[cgroup_sock_addr(sendmsg4)]
pub fn kproxy_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx)
}

/// recvmsg() shows the Service as the source of a backend's datagram.
#[cgroup_sock_addr(recvmsg4)]
pub fn kproxy_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// getpeername() shows the Service a socket connected to.
#[cgroup_sock_addr(getpeername4)]
pub fn kproxy_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// connect() of an IPv6 socket: to an IPv6 Service, or to an IPv4 one by its IPv4-mapped address
/// (`::ffff:10.96.0.10`, a dual-stack socket's), goes to a backend.
#[cgroup_sock_addr(connect6)]
pub fn kproxy_connect6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx)
}

/// Unconnected UDP over IPv6: each sendmsg() to an IPv6 Service goes to a backend.
#[cgroup_sock_addr(sendmsg6)]
pub fn kproxy_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx)
}

/// recvmsg() of an IPv6 socket shows the Service as the source of a backend's datagram.
#[cgroup_sock_addr(recvmsg6)]
pub fn kproxy_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

/// getpeername() of an IPv6 socket shows the Service it connected to.
#[cgroup_sock_addr(getpeername6)]
pub fn kproxy_getpeername6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

/// tc egress of a pod's veth (and of the external interfaces): replies on
/// their way to the client.
#[classifier]
pub fn kproxy_egress(ctx: TcContext) -> i32 {
    if parse6::is_ipv6(&ctx) {
        return egress6::run(&ctx);
    }
    let result = egress::egress(&ctx);
    finish(&ctx, result, &fib::Route::NONE)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
