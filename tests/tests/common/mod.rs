//! Packet building for BPF_PROG_TEST_RUN tests: frames with checksums computed
//! from scratch by proxy_common's reference math, so an expected frame is
//! "what a correct NAT would have produced", independent of the datapath.
#![allow(dead_code)]

pub mod cluster;
pub mod dual_stack;
pub mod external_node;
pub mod harness;

use proxy_common::{
    checksum,
    maps::{IPPROTO_TCP, IPPROTO_UDP},
};

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

#[derive(Clone, Debug)]
pub struct Packet {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// IP options (length a multiple of 4).
    pub options: Vec<u8>,
    /// UDP only: send without a checksum (zero).
    pub udp_no_checksum: bool,
    pub ip_id: u16,
    pub frag_field: u16,
}

impl Packet {
    pub fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            proto: IPPROTO_TCP,
            tcp_flags: flags,
            payload: Vec::new(),
            options: Vec::new(),
            udp_no_checksum: false,
            ip_id: 0x1c46,
            frag_field: 0x4000,
        }
    }

    pub fn udp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, payload: &[u8]) -> Self {
        Self { proto: IPPROTO_UDP, payload: payload.to_vec(), ..Self::tcp(src, sport, dst, dport, 0) }
    }

    pub fn with_payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    /// The L4 segment with a correct checksum.
    fn segment(&self) -> Vec<u8> {
        let mut seg = Vec::new();
        seg.extend_from_slice(&self.sport.to_be_bytes());
        seg.extend_from_slice(&self.dport.to_be_bytes());
        let check_at = if self.proto == IPPROTO_TCP {
            seg.extend_from_slice(&0x0102_0304u32.to_be_bytes()); // seq
            seg.extend_from_slice(&0u32.to_be_bytes()); // ack
            seg.push(5 << 4);
            seg.push(self.tcp_flags);
            seg.extend_from_slice(&64240u16.to_be_bytes());
            seg.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
            16
        } else {
            let len = (8 + self.payload.len()) as u16;
            seg.extend_from_slice(&len.to_be_bytes());
            seg.extend_from_slice(&[0, 0]);
            6
        };
        seg.extend_from_slice(&self.payload);
        if !(self.proto == IPPROTO_UDP && self.udp_no_checksum) {
            let check = checksum::l4_checksum(self.src, self.dst, self.proto, &seg);
            seg[check_at..check_at + 2].copy_from_slice(&check.to_be_bytes());
        }
        seg
    }

    /// The full Ethernet frame.
    pub fn frame(&self) -> Vec<u8> {
        let seg = self.segment();
        let ihl = 5 + self.options.len() / 4;
        let total = (ihl * 4 + seg.len()) as u16;
        let mut ip = vec![(4 << 4) | ihl as u8, 0];
        ip.extend_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&self.ip_id.to_be_bytes());
        ip.extend_from_slice(&self.frag_field.to_be_bytes());
        ip.extend_from_slice(&[64, self.proto, 0, 0]);
        ip.extend_from_slice(&self.src);
        ip.extend_from_slice(&self.dst);
        ip.extend_from_slice(&self.options);
        let check = checksum::checksum(&ip);
        ip[10..12].copy_from_slice(&check.to_be_bytes());

        let mut frame = Vec::new();
        frame.extend_from_slice(&NODE_MAC);
        frame.extend_from_slice(&CLIENT_MAC);
        frame.extend_from_slice(&0x0800u16.to_be_bytes());
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&seg);
        frame
    }
}

/// Verifies the IPv4 header checksum and the L4 checksum of a frame.
pub fn checksums_valid(frame: &[u8]) -> bool {
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if !checksum::is_valid(checksum::add_words(0, &ip[..ihl])) {
        return false;
    }
    let proto = ip[9];
    let seg = &ip[ihl..total];
    if proto == IPPROTO_UDP && seg[6..8] == [0, 0] {
        return true;
    }
    let src: [u8; 4] = ip[12..16].try_into().unwrap();
    let dst: [u8; 4] = ip[16..20].try_into().unwrap();
    checksum::is_valid(checksum::add_words(
        checksum::pseudo_header_sum(src, dst, proto, seg.len() as u16),
        seg,
    ))
}

/// An Ethernet frame with an ICMP error of `kind`/`code` from `src` to `dst` quoting `quote`,
/// checksums computed from scratch.
pub fn icmp_error(src: [u8; 4], dst: [u8; 4], kind: u8, code: u8, quote: &[u8]) -> Vec<u8> {
    let mut icmp = vec![kind, code, 0, 0, 0, 0, 0, 0];
    if code == 4 {
        icmp[6..8].copy_from_slice(&1400u16.to_be_bytes());
    }
    icmp.extend_from_slice(quote);
    let check = proxy_common::checksum::checksum(&icmp);
    icmp[2..4].copy_from_slice(&check.to_be_bytes());
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let check = proxy_common::checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&check.to_be_bytes());
    let mut frame = Packet::udp(src, 1, dst, 1, b"").frame()[..14].to_vec();
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}
