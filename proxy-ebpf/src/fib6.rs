//! Where a rewritten IPv6 packet goes, as `fib.rs` for IPv4: a packet whose source became a node
//! address (a source-NATed north–south flow) or whose destination became an outside client is
//! sent straight out of the interface the routing table names, since the stack drops a packet
//! arriving with one of its own addresses as source.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        bpf_fib_lookup as FibParams,
    },
    helpers::generated::bpf_fib_lookup,
};
use proxy_common::stats::Stat;

use crate::{
    fib::{CHECK_SKB, Route},
    maps::FIB_SCRATCH,
    verdict::Verdict,
};

const AF_INET6: u8 = 10;

/// Looks up the route for `saddr → daddr` as if the packet arrived on `ingress_ifindex`, into
/// `route`. tc's: no length, so that the kernel checks the packet itself against the route's MTU
/// (GRO/GSO aggregates, see [`CHECK_SKB`]). The kernel answers only where IPv6 forwarding is on
/// for the ingress interface (`net.ipv6.conf.<if>.forwarding`), as the node needs for its pods.
#[inline(always)]
pub fn route<C: EbpfContext>(
    ctx: &C,
    ingress_ifindex: u32,
    saddr: &[u8; 16],
    daddr: &[u8; 16],
    route: &mut Route,
) -> Result<(), Verdict> {
    route_for_len(ctx, ingress_ifindex, saddr, daddr, CHECK_SKB, route)
}

/// [`route`] checking `ip_len` against the route's MTU, as `fib::route` does: XDP's, whose frames
/// are single packets (no aggregates) and which the kernel cannot check itself. A packet too big
/// for the route is an error (`BPF_FIB_LKUP_RET_FRAG_NEEDED`): XDP leaves it to tc.
#[inline(always)]
pub fn route_for_len<C: EbpfContext>(
    ctx: &C,
    ingress_ifindex: u32,
    saddr: &[u8; 16],
    daddr: &[u8; 16],
    ip_len: u16,
    route: &mut Route,
) -> Result<(), Verdict> {
    let params = FIB_SCRATCH.get_ptr_mut(0).ok_or(Verdict::drop(Stat::FibLookupFailed))?;
    // Cleared word by word, as in `fib::route`.
    let words = params as *mut u64;
    for i in 0..core::mem::size_of::<FibParams>() / 8 {
        // SAFETY: inside this CPU's 64-byte scratch entry.
        unsafe { words.add(i).write_volatile(0) };
    }
    // SAFETY: this CPU's scratch entry, used by nothing else while the program runs.
    let params = unsafe { &mut *params };
    params.family = AF_INET6;
    params.ifindex = ingress_ifindex;
    params.__bindgen_anon_1.tot_len = ip_len;
    // SAFETY: plain integer arrays in the union.
    unsafe {
        let (src, dst) = (&mut params.__bindgen_anon_3.ipv6_src, &mut params.__bindgen_anon_4.ipv6_dst);
        for i in 0..4 {
            src[i] = u32::from_ne_bytes([saddr[4 * i], saddr[4 * i + 1], saddr[4 * i + 2], saddr[4 * i + 3]]);
            dst[i] = u32::from_ne_bytes([daddr[4 * i], daddr[4 * i + 1], daddr[4 * i + 2], daddr[4 * i + 3]]);
        }
    }
    // SAFETY: the helper reads and writes `params`, whose size is passed.
    let ret = unsafe { bpf_fib_lookup(ctx.as_ptr(), params, core::mem::size_of::<FibParams>() as i32, 0) };
    match ret as u32 {
        BPF_FIB_LKUP_RET_SUCCESS => {
            route.macs[..6].copy_from_slice(&params.dmac);
            route.macs[6..].copy_from_slice(&params.smac);
            route.ifindex = params.ifindex;
            route.neighbour_known = true;
            Ok(())
        }
        BPF_FIB_LKUP_RET_NO_NEIGH => {
            route.ifindex = params.ifindex;
            route.neighbour_known = false;
            Ok(())
        }
        // Too big for the route, checked by length (XDP's): not a failure, tc's to handle.
        BPF_FIB_LKUP_RET_FRAG_NEEDED if ip_len != CHECK_SKB => Err(Verdict::pass(Stat::XdpToTc)),
        _ => Err(Verdict::drop(Stat::FibLookupFailed)),
    }
}

/// Whether the last [`route`] of this CPU found `daddr` on the interface's own link (no gateway), as
/// `fib::last_route_was_direct`: a local pod on its veth, not a pod of another node behind a tunnel
/// or a gateway. The helper replaces the destination with the route's gateway, when it has one.
#[inline(always)]
pub fn last_route_was_direct(daddr: &[u8; 16]) -> bool {
    let Some(params) = FIB_SCRATCH.get(0) else { return false };
    // SAFETY: this CPU's scratch entry, which `route` filled in on this run of the program.
    let dst = unsafe { &params.__bindgen_anon_4.ipv6_dst };
    (0..4).all(|i| {
        dst[i] == u32::from_ne_bytes([daddr[4 * i], daddr[4 * i + 1], daddr[4 * i + 2], daddr[4 * i + 3]])
    })
}
