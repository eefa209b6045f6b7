use aya_ebpf::programs::TcContext;
use proxy_common::{
    maps::{CtKeyV4, FragmentKeyV4, FragmentPortsV4, IPPROTO_TCP},
    packet::{self, ETH_HLEN, ETH_P_IP, Fragment, L4_OFF_SPORT, Skip, TCP_OFF_FLAGS, fragment_key},
    stats::Stat,
};

use crate::{maps::FRAGMENTS_V4, stats};

/// The parts of an IPv4 TCP/UDP packet the datapath reads and rewrites.
///
/// Every byte is a field, padding included: a `Flow` is returned by value and
/// copied between stack frames, and the verifier lets only CAP_PERFMON
/// holders read stack bytes the program never wrote ("invalid read from
/// stack"), which is what a copy of implicit padding is.
#[repr(C)]
pub struct Flow {
    /// Offset of the L4 header from the start of the frame.
    pub l4_offset: usize,
    /// Offset of the L4 checksum field from the start of the frame.
    pub l4_check_offset: usize,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub tcp_flags: u8,
    pub ip_total_len: u16,
    /// Later fragments have no L4 header: their ports come from the first
    /// fragment, and only their addresses are rewritten.
    pub fragment: Fragment,
    /// The padding up to the struct's alignment, as scalars: a byte array
    /// would be zeroed by a memset loop, whose pointer arithmetic the
    /// verifier refuses to programs without CAP_PERFMON.
    pub _pad1: u8,
    pub _pad2: u16,
    pub _pad4: u32,
}

impl Flow {
    #[inline(always)]
    pub fn has_l4_header(&self) -> bool {
        !matches!(self.fragment, Fragment::Later)
    }
}

impl Flow {
    #[inline(always)]
    pub fn ct_key(&self, direction: u8) -> CtKeyV4 {
        CtKeyV4 {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            direction,
            _pad: [0; 2],
        }
    }
}

#[inline(always)]
fn load<T>(ctx: &TcContext, offset: usize, on_error: Stat) -> Result<T, Stat> {
    ctx.load::<T>(offset).map_err(|_| on_error)
}

/// Bytes of the frame read in place when the skb's linear part holds them:
/// Ethernet, an IPv4 header without options, and a TCP header up to its
/// flags (UDP's ports are inside).
const DIRECT_HEAD_LEN: usize = ETH_HLEN + 20 + TCP_OFF_FLAGS + 1;

/// The start of the frame, when its first [`DIRECT_HEAD_LEN`] bytes can be
/// read in place (direct packet access): no helper call per field, which is
/// most of the cost of a packet the datapath leaves alone. `None`: the
/// helper reads them (a short or non-linear skb).
#[inline(always)]
fn linear_head(ctx: &TcContext) -> Option<*const u8> {
    let start = ctx.data();
    if start + DIRECT_HEAD_LEN > ctx.data_end() {
        return None;
    }
    Some(start as *const u8)
}

/// A `T` (an integer) at constant `offset` of a head [`linear_head`] returned, read with one load
/// of its width, as C reads `ip->saddr`. `read_unaligned` would be compiled into a load per byte
/// and the shifts that join them — most of the cost of a packet the datapath leaves alone — since
/// LLVM may not assume an aligned address (the IPv4 header starts 14 bytes into the frame). The
/// verifier allows packet accesses at any alignment on architectures with efficient unaligned
/// access (x86-64, arm64); stack accesses stay aligned (the values land in registers).
///
/// # Safety
/// `offset + size_of::<T>()` must not exceed [`DIRECT_HEAD_LEN`].
#[inline(always)]
unsafe fn read_word<T: Copy>(head: *const u8, offset: usize) -> T {
    // SAFETY: per the contract above, inside the bounds checked against data_end. Volatile: one
    // load of the width of `T` at this address, never split nor merged by LLVM.
    unsafe { core::ptr::read_volatile(head.add(offset).cast::<T>()) }
}

/// The fields of an IPv4 header the datapath reads.
struct Ipv4Head {
    version_ihl: u8,
    proto: u8,
    total_len: u16,
    /// Flags and fragment offset.
    frag: u16,
    id: [u8; 2],
    saddr: [u8; 4],
    daddr: [u8; 4],
}

impl Ipv4Head {
    /// From the header's first 20 bytes as read by the helper.
    #[inline(always)]
    fn from_bytes(h: &[u8; 20]) -> Self {
        Ipv4Head {
            version_ihl: h[0],
            proto: h[9],
            total_len: u16::from_be_bytes([h[2], h[3]]),
            frag: u16::from_be_bytes([h[6], h[7]]),
            id: [h[4], h[5]],
            saddr: [h[12], h[13], h[14], h[15]],
            daddr: [h[16], h[17], h[18], h[19]],
        }
    }

    /// In place, a word at a time.
    ///
    /// # Safety
    /// `head` is a head [`linear_head`] returned.
    #[inline(always)]
    unsafe fn read_in_place(head: *const u8) -> Self {
        // SAFETY: all inside the first ETH_HLEN + 20 bytes.
        let (w0, w1, w2, saddr, daddr) = unsafe {
            (
                read_word::<u32>(head, ETH_HLEN).to_ne_bytes(),
                read_word::<u32>(head, ETH_HLEN + 4).to_ne_bytes(),
                read_word::<u32>(head, ETH_HLEN + 8).to_ne_bytes(),
                read_word::<u32>(head, ETH_HLEN + 12).to_ne_bytes(),
                read_word::<u32>(head, ETH_HLEN + 16).to_ne_bytes(),
            )
        };
        Ipv4Head {
            version_ihl: w0[0],
            proto: w2[1],
            total_len: u16::from_be_bytes([w0[2], w0[3]]),
            frag: u16::from_be_bytes([w1[2], w1[3]]),
            id: [w1[0], w1[1]],
            saddr,
            daddr,
        }
    }

    #[inline(always)]
    fn fragment_key(&self) -> FragmentKeyV4 {
        fragment_key(self.saddr, self.daddr, self.id, self.proto)
    }
}

/// The counter of a packet left untranslated for `skip`.
#[inline(always)]
pub fn skip_stat(skip: Skip) -> Stat {
    match skip {
        Skip::NotTcpUdp => Stat::PassNotTcpUdp,
        Skip::Fragment => Stat::PassFragment,
        Skip::Malformed => Stat::PassMalformed,
        Skip::Truncated => Stat::PassTruncated,
    }
}

/// The packet's [`Flow`], written into `out` (the per-CPU [`crate::maps::FLOW_SCRATCH`]: off the
/// stack, and not a returned `Result<Flow, _>`, whose address LLVM may hand back in r0, a stack
/// pointer the verifier refuses to return to the caller).
/// Not inlined: its temporaries (a fragment's datagram key) would otherwise sit in the program's
/// frame, which shares the 512-byte stack with the stage it calls next.
#[inline(never)]
pub fn flow(ctx: &TcContext, out: &mut Flow) -> Result<(), Stat> {
    let head = linear_head(ctx);
    let ethertype: [u8; 2] = match head {
        // SAFETY: inside DIRECT_HEAD_LEN.
        Some(head) => unsafe { read_word::<u16>(head, 12) }.to_ne_bytes(),
        None => load(ctx, 12, Stat::PassNotIpv4)?,
    };
    if u16::from_be_bytes(ethertype) != ETH_P_IP {
        return Err(Stat::PassNotIpv4);
    }
    let ip = match head {
        // SAFETY: a head linear_head returned.
        Some(head) => unsafe { Ipv4Head::read_in_place(head) },
        None => Ipv4Head::from_bytes(&load::<[u8; 20]>(ctx, ETH_HLEN, Stat::PassTruncated)?),
    };
    let available = (ctx.len() as usize).saturating_sub(ETH_HLEN);
    let loc = packet::classify_ipv4(ip.version_ihl, ip.total_len, ip.frag, ip.proto, available)
        .map_err(skip_stat)?;
    // Masked to what IHL can say (at most 60): the verifier needs the bound.
    let l4_offset = ETH_HLEN + (loc.ip_header_len & 0x3c);
    let (ports, tcp_flags) = match loc.fragment {
        Fragment::Later => {
            let recalled = recall_ports(&ip.fragment_key());
            if recalled == 0 {
                return Err(Stat::PassFragment);
            }
            stats::count(Stat::FragmentFollowed);
            ((recalled as u32).to_ne_bytes(), 0)
        }
        Fragment::First | Fragment::Whole => {
            let in_place = match head {
                Some(head) if loc.ip_header_len == 20 => Some(head),
                _ => None,
            };
            let ports: [u8; 4] = match in_place {
                // SAFETY: the ports end inside DIRECT_HEAD_LEN for a 20-byte header.
                Some(head) => unsafe { read_word::<u32>(head, ETH_HLEN + 20 + L4_OFF_SPORT) }.to_ne_bytes(),
                None => load(ctx, l4_offset + L4_OFF_SPORT, Stat::PassTruncated)?,
            };
            let tcp_flags = match in_place {
                // SAFETY: the flags byte is the last one of DIRECT_HEAD_LEN.
                Some(head) if loc.proto == IPPROTO_TCP => unsafe {
                    read_word::<u8>(head, ETH_HLEN + 20 + TCP_OFF_FLAGS)
                },
                None if loc.proto == IPPROTO_TCP => {
                    load::<u8>(ctx, l4_offset + TCP_OFF_FLAGS, Stat::PassTruncated)?
                }
                _ => 0,
            };
            if let Fragment::First = loc.fragment {
                remember_ports(&ip.fragment_key(), u32::from_ne_bytes(ports));
            }
            (ports, tcp_flags)
        }
    };
    *out = Flow {
        saddr: ip.saddr,
        daddr: ip.daddr,
        sport: [ports[0], ports[1]],
        dport: [ports[2], ports[3]],
        proto: loc.proto,
        tcp_flags,
        l4_offset,
        l4_check_offset: ETH_HLEN + (loc.checksum_offset() & 0x7f),
        ip_total_len: ip.total_len,
        fragment: loc.fragment,
        _pad1: 0,
        _pad2: 0,
        _pad4: 0,
    };
    Ok(())
}

/// Keeps a first fragment's ports for the rest of its datagram. Not inlined:
/// the value would otherwise sit in the ingress program's frame, which shares
/// the 512-byte stack with its stages.
#[inline(never)]
fn remember_ports(datagram: &FragmentKeyV4, ports: u32) {
    let ports = ports.to_ne_bytes();
    let value = FragmentPortsV4 { sport: [ports[0], ports[1]], dport: [ports[2], ports[3]] };
    // A full LRU forgets the oldest datagram; this one's later fragments
    // would then pass untranslated.
    let _ = FRAGMENTS_V4.insert(datagram, value, 0);
}

/// The ports of a later fragment's datagram (the bytes of sport and dport as
/// a native u32, bit 32 set), or 0 when its first fragment was not seen.
#[inline(never)]
fn recall_ports(datagram: &FragmentKeyV4) -> u64 {
    // SAFETY: the value is copied out at once.
    match unsafe { FRAGMENTS_V4.get(datagram) } {
        Some(p) => {
            (1 << 32) | u64::from(u32::from_ne_bytes([p.sport[0], p.sport[1], p.dport[0], p.dport[1]]))
        }
        None => 0,
    }
}
