//! Where a rewritten packet goes. Packets whose source became a node address
//! cannot be handed to the stack (it drops a packet arriving with one of its
//! own addresses as source), so they are sent straight out of the interface
//! the routing table names.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        bpf_fib_lookup as FibParams,
    },
    helpers::generated::bpf_fib_lookup,
    programs::TcContext,
};
use proxy_common::stats::Stat;

use crate::{maps::FIB_SCRATCH, verdict::Verdict};

const AF_INET: u8 = 2;

/// The interface to send a packet out of, and its Ethernet header when the
/// neighbour is known (destination then source MAC, as in the frame).
/// Not an `Option`, and its padding a field: a copy of bytes never written
/// (a `None`'s, or padding) is refused by the verifier to programs without
/// CAP_PERFMON.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Route {
    pub ifindex: u32,
    pub macs: [u8; 12],
    pub neighbour_known: bool,
    pub _pad: [u8; 3],
}

impl Route {
    /// No route yet: what a program starts with, for a stage to fill in.
    pub const NONE: Route = Route { ifindex: 0, macs: [0; 12], neighbour_known: false, _pad: [0; 3] };
}

/// For tc: no length, so that the kernel checks the packet itself against the
/// route's MTU (`is_skb_forwardable`), which knows GRO/GSO packets. Their IP
/// total length is the merged one, far above the MTU: checked by length, every
/// aggregated segment of a bulk transfer would be refused.
pub const CHECK_SKB: u16 = 0;

/// Looks up the route for `saddr → daddr` as if the packet arrived on
/// `ingress_ifindex`. `ip_total_len` is the length to check against the MTU:
/// the packet's own in XDP (no aggregation there), [`CHECK_SKB`] in tc.
#[inline(always)]
pub fn route<C: EbpfContext>(
    ctx: &C,
    ingress_ifindex: u32,
    saddr: [u8; 4],
    daddr: [u8; 4],
    ip_total_len: u16,
) -> Result<Route, Verdict> {
    let params = FIB_SCRATCH.get_ptr_mut(0).ok_or(Verdict::drop(Stat::FibLookupFailed))?;
    // Cleared word by word: a whole-struct assignment becomes a memset call
    // whose register use the verifier refuses.
    let words = params as *mut u64;
    for i in 0..core::mem::size_of::<FibParams>() / 8 {
        // SAFETY: inside this CPU's 64-byte scratch entry.
        unsafe { words.add(i).write_volatile(0) };
    }
    // SAFETY: this CPU's scratch entry, used by nothing else while the
    // program runs (BPF programs are not preempted on their CPU mid-run).
    let params = unsafe { &mut *params };
    params.family = AF_INET;
    params.ifindex = ingress_ifindex;
    params.__bindgen_anon_1.tot_len = ip_total_len;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(saddr);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(daddr);
    // SAFETY: the helper reads and writes `params`, whose size is passed.
    let ret = unsafe { bpf_fib_lookup(ctx.as_ptr(), params, core::mem::size_of::<FibParams>() as i32, 0) };
    match ret as u32 {
        BPF_FIB_LKUP_RET_SUCCESS => {
            let mut macs = [0u8; 12];
            macs[..6].copy_from_slice(&params.dmac);
            macs[6..].copy_from_slice(&params.smac);
            Ok(Route { ifindex: params.ifindex, macs, neighbour_known: true, _pad: [0; 3] })
        }
        BPF_FIB_LKUP_RET_NO_NEIGH => Ok(Route { ifindex: params.ifindex, ..Route::NONE }),
        // Too big for the route, checked by length (XDP's): not a failure, tc's to handle.
        BPF_FIB_LKUP_RET_FRAG_NEEDED if ip_total_len != CHECK_SKB => Err(Verdict::pass(Stat::XdpToTc)),
        _ => Err(Verdict::drop(Stat::FibLookupFailed)),
    }
}

/// Whether the last [`route`] of this CPU found `daddr` on the interface's own link (no gateway):
/// a local pod on its veth, not a pod of another node behind a tunnel or a gateway. The helper
/// replaces the destination it was given with the route's gateway, when the route has one.
#[inline(always)]
pub fn last_route_was_direct(daddr: [u8; 4]) -> bool {
    // SAFETY: this CPU's scratch entry, which `route` filled in on this run of the program.
    FIB_SCRATCH
        .get(0)
        .is_some_and(|params| unsafe { params.__bindgen_anon_4.ipv4_dst } == u32::from_ne_bytes(daddr))
}

/// The interface a tc program's packet arrived on.
#[inline(always)]
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: reading the context field the kernel filled in.
    unsafe { (*ctx.skb.skb).ifindex }
}
