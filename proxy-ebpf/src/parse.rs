use aya_ebpf::programs::TcContext;
use proxy_common::{
    maps::{CtKeyV4, IPPROTO_TCP},
    packet::{self, ETH_HLEN, ETH_P_IP, L4_OFF_SPORT, Skip, TCP_OFF_FLAGS},
    stats::Stat,
};

/// The parts of an IPv4 TCP/UDP packet the datapath reads and rewrites.
pub struct Flow {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame.
    pub l4_offset: usize,
    /// Offset of the L4 checksum field from the start of the frame.
    pub l4_check_offset: usize,
    pub ip_total_len: u16,
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

#[inline(always)]
pub fn flow(ctx: &TcContext) -> Result<Flow, Stat> {
    let ethertype: [u8; 2] = load(ctx, 12, Stat::PassNotIpv4)?;
    if u16::from_be_bytes(ethertype) != ETH_P_IP {
        return Err(Stat::PassNotIpv4);
    }
    // The fixed part of the header, in one helper call.
    let header: [u8; 20] = load(ctx, ETH_HLEN, Stat::PassTruncated)?;
    let total_len = u16::from_be_bytes([header[2], header[3]]);
    let frag = u16::from_be_bytes([header[6], header[7]]);
    let available = (ctx.len() as usize).saturating_sub(ETH_HLEN);
    let loc = packet::classify_ipv4(header[0], total_len, frag, header[9], available).map_err(skip_stat)?;
    // Bounded for the verifier: IHL is at most 15 words.
    let l4_offset = ETH_HLEN + (loc.ip_header_len & 0x3c);
    let ports: [u8; 4] = load(ctx, l4_offset + L4_OFF_SPORT, Stat::PassTruncated)?;
    let tcp_flags = if loc.proto == IPPROTO_TCP {
        load::<u8>(ctx, l4_offset + TCP_OFF_FLAGS, Stat::PassTruncated)?
    } else {
        0
    };
    Ok(Flow {
        saddr: [header[12], header[13], header[14], header[15]],
        daddr: [header[16], header[17], header[18], header[19]],
        sport: [ports[0], ports[1]],
        dport: [ports[2], ports[3]],
        proto: loc.proto,
        tcp_flags,
        l4_offset,
        l4_check_offset: ETH_HLEN + (loc.checksum_offset() & 0x7f),
        ip_total_len: total_len,
    })
}
