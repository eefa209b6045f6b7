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

/// `N` bytes at constant `offset` of a head [`linear_head`] returned.
///
/// # Safety
/// `offset + N` must not exceed [`DIRECT_HEAD_LEN`].
#[inline(always)]
unsafe fn read_head<const N: usize>(head: *const u8, offset: usize) -> [u8; N] {
    // SAFETY: per the contract above, inside the bounds checked against data_end.
    unsafe { core::ptr::read_unaligned(head.add(offset).cast::<[u8; N]>()) }
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

/// Not inlined: its temporaries (the header, a fragment's datagram key) would
/// otherwise sit in the program's frame, which shares the 512-byte stack
/// with the stage it calls next.
#[inline(never)]
pub fn flow(ctx: &TcContext) -> Result<Flow, Stat> {
    let head = linear_head(ctx);
    let ethertype: [u8; 2] = match head {
        // SAFETY: inside DIRECT_HEAD_LEN.
        Some(head) => unsafe { read_head(head, 12) },
        None => load(ctx, 12, Stat::PassNotIpv4)?,
    };
    if u16::from_be_bytes(ethertype) != ETH_P_IP {
        return Err(Stat::PassNotIpv4);
    }
    // The fixed part of the header, in place or in one helper call.
    let header: [u8; 20] = match head {
        // SAFETY: inside DIRECT_HEAD_LEN.
        Some(head) => unsafe { read_head(head, ETH_HLEN) },
        None => load(ctx, ETH_HLEN, Stat::PassTruncated)?,
    };
    let total_len = u16::from_be_bytes([header[2], header[3]]);
    let frag = u16::from_be_bytes([header[6], header[7]]);
    let available = (ctx.len() as usize).saturating_sub(ETH_HLEN);
    let loc = packet::classify_ipv4(header[0], total_len, frag, header[9], available).map_err(skip_stat)?;
    let saddr = [header[12], header[13], header[14], header[15]];
    let daddr = [header[16], header[17], header[18], header[19]];
    // Bounded for the verifier: IHL is at most 15 words.
    let l4_offset = ETH_HLEN + (loc.ip_header_len & 0x3c);
    let (ports, tcp_flags) = match loc.fragment {
        Fragment::Later => {
            let recalled = recall_ports(&header, loc.proto);
            if recalled == 0 {
                return Err(Stat::PassFragment);
            }
            stats::count(Stat::FragmentFollowed);
            ((recalled as u32).to_ne_bytes(), 0)
        }
        Fragment::First | Fragment::Whole => {
            // In place only at the constant offset of a header without
            // options: a variable one would need a bounds check of its own.
            let in_place = match head {
                Some(head) if loc.ip_header_len == 20 => Some(head),
                _ => None,
            };
            let ports: [u8; 4] = match in_place {
                // SAFETY: inside DIRECT_HEAD_LEN.
                Some(head) => unsafe { read_head(head, ETH_HLEN + 20 + L4_OFF_SPORT) },
                None => load(ctx, l4_offset + L4_OFF_SPORT, Stat::PassTruncated)?,
            };
            let tcp_flags = match in_place {
                // SAFETY: inside DIRECT_HEAD_LEN.
                Some(head) if loc.proto == IPPROTO_TCP => unsafe {
                    read_head::<1>(head, ETH_HLEN + 20 + TCP_OFF_FLAGS)[0]
                },
                None if loc.proto == IPPROTO_TCP => {
                    load::<u8>(ctx, l4_offset + TCP_OFF_FLAGS, Stat::PassTruncated)?
                }
                _ => 0,
            };
            if let Fragment::First = loc.fragment {
                remember_ports(&header, loc.proto, u32::from_ne_bytes(ports));
            }
            (ports, tcp_flags)
        }
    };
    Ok(Flow {
        saddr,
        daddr,
        sport: [ports[0], ports[1]],
        dport: [ports[2], ports[3]],
        proto: loc.proto,
        tcp_flags,
        l4_offset,
        l4_check_offset: ETH_HLEN + (loc.checksum_offset() & 0x7f),
        ip_total_len: total_len,
        fragment: loc.fragment,
        _pad1: 0,
        _pad2: 0,
        _pad4: 0,
    })
}

/// The key of the datagram an IPv4 `header` belongs to.
#[inline(always)]
fn datagram(header: &[u8; 20], proto: u8) -> FragmentKeyV4 {
    fragment_key(
        [header[12], header[13], header[14], header[15]],
        [header[16], header[17], header[18], header[19]],
        [header[4], header[5]],
        proto,
    )
}

/// Keeps a first fragment's ports for the rest of its datagram. Not inlined:
/// the key and value would otherwise sit in the ingress program's frame,
/// which shares the 512-byte stack with its stages.
/// Scalars in and out rather than arrays: they stay in registers.
#[inline(never)]
fn remember_ports(header: &[u8; 20], proto: u8, ports: u32) {
    let ports = ports.to_ne_bytes();
    let value = FragmentPortsV4 { sport: [ports[0], ports[1]], dport: [ports[2], ports[3]] };
    // A full LRU forgets the oldest datagram; this one's later fragments
    // would then pass untranslated.
    let _ = FRAGMENTS_V4.insert(datagram(header, proto), value, 0);
}

/// The ports of a later fragment's datagram (the bytes of sport and dport as
/// a native u32, bit 32 set), or 0 when its first fragment was not seen.
#[inline(never)]
fn recall_ports(header: &[u8; 20], proto: u8) -> u64 {
    // SAFETY: the value is copied out at once.
    match unsafe { FRAGMENTS_V4.get(datagram(header, proto)) } {
        Some(p) => {
            (1 << 32) | u64::from(u32::from_ne_bytes([p.sport[0], p.sport[1], p.dport[0], p.dport[1]]))
        }
        None => 0,
    }
}
