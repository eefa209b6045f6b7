//! Parsing an IPv6 TCP/UDP packet: the fixed header, the extension headers walked by
//! `proxy_common::packet6::locate_l4`, the ports and TCP flags.
use aya_ebpf::{helpers::bpf_skb_load_bytes, programs::TcContext};
use proxy_common::{
    maps::{FragmentPortsV4, IPPROTO_TCP},
    maps_v6::{CtKeyV6, FragmentKeyV6},
    packet::{ETH_HLEN, Fragment, L4_OFF_SPORT, TCP_OFF_FLAGS},
    packet6::{ETH_P_IPV6, IP6_OFF_DADDR, IP6_OFF_SADDR, IPV6_HLEN, locate_l4},
    stats::Stat,
};

use crate::{maps::FRAGMENTS_V6, parse::skip_stat, stats};

/// The parts of an IPv6 TCP/UDP packet the datapath reads and rewrites, as `parse::Flow` for
/// IPv4. Every byte is a field, padding included (copied between frames, see `parse::Flow`).
#[repr(C)]
pub struct Flow6 {
    /// Offset of the L4 header from the start of the frame.
    pub l4_offset: usize,
    /// Offset of the L4 checksum field from the start of the frame.
    pub l4_check_offset: usize,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub tcp_flags: u8,
    /// The IPv6 header's payload length (extension headers, L4 header and data).
    pub payload_len: u16,
    pub fragment: Fragment,
    /// 1 when extension headers sit between the IPv6 and the L4 header.
    pub extension_headers: u8,
    pub _pad2: u16,
    pub _pad4: u32,
}

impl Flow6 {
    /// Later fragments have no L4 header: their ports come from the first fragment, and only
    /// their addresses are rewritten.
    #[inline(always)]
    pub fn has_l4_header(&self) -> bool {
        !matches!(self.fragment, Fragment::Later)
    }

    #[inline(always)]
    pub fn ct_key(&self, direction: u8) -> CtKeyV6 {
        CtKeyV6 {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            direction,
            _pad: [0; 2],
        }
    }

    /// The bytes conntrack counts for a packet, as IPv4 counts its total length.
    #[inline(always)]
    pub fn ip_len(&self) -> u16 {
        self.payload_len.saturating_add(IPV6_HLEN as u16)
    }
}

/// Whether the frame is IPv6 (ethertype 0x86DD): read in place when the linear part holds the
/// Ethernet header, so that IPv4 packets pay no helper call for the choice.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    let start = ctx.data();
    if start + ETH_HLEN <= ctx.data_end() {
        // SAFETY: inside the bounds just checked against data_end.
        let ethertype = unsafe { core::ptr::read_unaligned((start + 12) as *const [u8; 2]) };
        return u16::from_be_bytes(ethertype) == ETH_P_IPV6;
    }
    ctx.load::<[u8; 2]>(12).is_ok_and(|t| u16::from_be_bytes(t) == ETH_P_IPV6)
}

/// `N` bytes of the packet at `offset`, straight into `dst` (a map value: no copy on the stack).
/// The helper itself rather than `load_bytes`, whose length the verifier cannot prove non-zero.
#[inline(always)]
pub fn load_into<const N: usize>(ctx: &TcContext, offset: usize, dst: &mut [u8; N]) -> Result<(), Stat> {
    // SAFETY: `dst` is N writable bytes; the helper checks the packet's bounds.
    let ret =
        unsafe { bpf_skb_load_bytes(ctx.skb.skb.cast(), offset as u32, dst.as_mut_ptr().cast(), N as u32) };
    if ret == 0 { Ok(()) } else { Err(Stat::PassTruncated) }
}

/// Reads the packet into `flow`, which lives in a per-CPU map (`maps::FLOW6_SCRATCH`): on the
/// stack it would take a quarter of the 512 bytes the IPv6 chain shares with the entry point's
/// frame. Not inlined: the walk's temporaries stay out of the stages' frames. A first fragment's
/// ports are kept in FRAGMENTS_V6 for the later fragments of its datagram, which take them from
/// there (and pass untouched, `PassFragment`, when it was not seen), as IPv4's do.
#[inline(never)]
pub fn flow(ctx: &TcContext, flow: &mut Flow6) -> Result<(), Stat> {
    let fixed: [u8; 8] = ctx.load(ETH_HLEN).map_err(|_| Stat::PassTruncated)?;
    let payload_len = u16::from_be_bytes([fixed[4], fixed[5]]);
    let available = (ctx.len() as usize).saturating_sub(ETH_HLEN);
    let read = |offset: usize| ctx.load::<[u8; 8]>(ETH_HLEN + offset).ok();
    let loc = locate_l4(fixed[0], fixed[6], payload_len, available, read).map_err(skip_stat)?;
    load_into(ctx, ETH_HLEN + IP6_OFF_SADDR, &mut flow.saddr)?;
    load_into(ctx, ETH_HLEN + IP6_OFF_DADDR, &mut flow.daddr)?;
    let id = u32::from_ne_bytes(loc.fragment_id);
    // Bounded for the verifier: eight extension headers of at most 2 KiB each.
    let l4_offset = ETH_HLEN + (loc.l4_offset & 0x7fff);
    let (ports, tcp_flags) = match loc.fragment {
        Fragment::Later => {
            let recalled = recall_ports(&flow.saddr, &flow.daddr, id, loc.proto);
            if recalled == 0 {
                return Err(Stat::PassFragment);
            }
            stats::count(Stat::FragmentFollowed);
            ((recalled as u32).to_ne_bytes(), 0)
        }
        Fragment::First | Fragment::Whole => {
            let ports: [u8; 4] = ctx.load(l4_offset + L4_OFF_SPORT).map_err(|_| Stat::PassTruncated)?;
            let tcp_flags = if loc.proto == IPPROTO_TCP {
                ctx.load::<u8>(l4_offset + TCP_OFF_FLAGS).map_err(|_| Stat::PassTruncated)?
            } else {
                0
            };
            if let Fragment::First = loc.fragment {
                remember_ports(&flow.saddr, &flow.daddr, id, loc.proto, u32::from_ne_bytes(ports));
            }
            (ports, tcp_flags)
        }
    };
    flow.tcp_flags = tcp_flags;
    flow.l4_offset = l4_offset;
    flow.l4_check_offset = ETH_HLEN + (loc.checksum_offset() & 0x7fff);
    flow.sport = [ports[0], ports[1]];
    flow.dport = [ports[2], ports[3]];
    flow.proto = loc.proto;
    flow.payload_len = payload_len;
    flow.fragment = loc.fragment;
    flow.extension_headers = u8::from(loc.has_extension_headers());
    Ok(())
}

/// The key of the datagram a fragment belongs to. `id` as its bytes in a native u32.
#[inline(always)]
fn datagram(saddr: &[u8; 16], daddr: &[u8; 16], id: u32, proto: u8) -> FragmentKeyV6 {
    FragmentKeyV6 { saddr: *saddr, daddr: *daddr, id: id.to_ne_bytes(), proto, _pad: [0; 3] }
}

/// Keeps a first fragment's ports for the rest of its datagram. Not inlined: the 40-byte key
/// gets a frame of its own. Scalars in rather than arrays: they stay in registers.
#[inline(never)]
fn remember_ports(saddr: &[u8; 16], daddr: &[u8; 16], id: u32, proto: u8, ports: u32) {
    let ports = ports.to_ne_bytes();
    let value = FragmentPortsV4 { sport: [ports[0], ports[1]], dport: [ports[2], ports[3]] };
    // A full LRU forgets the oldest datagram; this one's later fragments then pass untranslated.
    let _ = FRAGMENTS_V6.insert(datagram(saddr, daddr, id, proto), value, 0);
}

/// The ports of a later fragment's datagram (the bytes of sport and dport as a native u32, bit 32
/// set), or 0 when its first fragment was not seen.
#[inline(never)]
fn recall_ports(saddr: &[u8; 16], daddr: &[u8; 16], id: u32, proto: u8) -> u64 {
    // SAFETY: the value is copied out at once.
    match unsafe { FRAGMENTS_V6.get(datagram(saddr, daddr, id, proto)) } {
        Some(p) => {
            (1 << 32) | u64::from(u32::from_ne_bytes([p.sport[0], p.sport[1], p.dport[0], p.dport[1]]))
        }
        None => 0,
    }
}
