//! Frames for the fuzzer: built with checksums from `proxy_common::checksum`'s reference math,
//! parsed back to the fields a NAT may change, and checked byte by byte against the frame that
//! went in. Nothing here knows what the datapath does.

use std::{fmt, ops::Range};

use proxy_common::checksum;

pub const ICMP: u8 = 1;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;
pub const URG: u8 = 0x20;

pub const ETH_HLEN: usize = 14;

/// An address and port pair in both directions of a flow.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub src: [u8; 4],
    pub sport: u16,
    pub dst: [u8; 4],
    pub dport: u16,
    pub proto: u8,
}

impl Tuple {
    pub fn new(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, proto: u8) -> Self {
        Self { src, sport, dst, dport, proto }
    }

    pub fn reverse(&self) -> Tuple {
        Tuple { src: self.dst, sport: self.dport, dst: self.src, dport: self.sport, proto: self.proto }
    }
}

pub fn ip(a: [u8; 4]) -> String {
    format!("{}.{}.{}.{}", a[0], a[1], a[2], a[3])
}

pub fn proto_name(p: u8) -> String {
    match p {
        TCP => "TCP".into(),
        UDP => "UDP".into(),
        ICMP => "ICMP".into(),
        other => format!("proto {other}"),
    }
}

pub fn flags_name(f: u8) -> String {
    let names = [(SYN, "SYN"), (ACK, "ACK"), (FIN, "FIN"), (RST, "RST"), (PSH, "PSH"), (URG, "URG")];
    let mut out: Vec<&str> = names.iter().filter(|(b, _)| f & b != 0).map(|(_, n)| *n).collect();
    if f & 0xc0 != 0 {
        out.push(if f & 0xc0 == 0xc0 {
            "ECE|CWR"
        } else if f & 0x40 != 0 {
            "ECE"
        } else {
            "CWR"
        });
    }
    if out.is_empty() { "none".into() } else { out.join("|") }
}

impl fmt::Debug for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}:{} → {}:{}",
            proto_name(self.proto),
            ip(self.src),
            self.sport,
            ip(self.dst),
            self.dport
        )
    }
}

/// A TCP or UDP packet to build. The IP header and L4 checksum are always right.
#[derive(Clone, Debug)]
pub struct Spec {
    pub tuple: Tuple,
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
    /// TCP options (a multiple of 4 bytes).
    pub tcp_options: Vec<u8>,
    pub payload: Vec<u8>,
    /// IP options (a multiple of 4 bytes).
    pub ip_options: Vec<u8>,
    pub ttl: u8,
    pub tos: u8,
    pub id: u16,
    pub dont_fragment: bool,
    pub udp_zero_checksum: bool,
}

impl Spec {
    pub fn new(tuple: Tuple) -> Self {
        Self {
            tuple,
            tcp_flags: 0,
            seq: 0x0102_0304,
            ack: 0,
            window: 64240,
            tcp_options: Vec::new(),
            payload: Vec::new(),
            ip_options: Vec::new(),
            ttl: 64,
            tos: 0,
            id: 0x1c46,
            dont_fragment: true,
            udp_zero_checksum: false,
        }
    }

    /// The whole L4 segment (header and payload) with its checksum.
    pub fn segment(&self) -> Vec<u8> {
        let t = &self.tuple;
        let mut seg = Vec::new();
        seg.extend_from_slice(&t.sport.to_be_bytes());
        seg.extend_from_slice(&t.dport.to_be_bytes());
        let check_at = if t.proto == TCP {
            seg.extend_from_slice(&self.seq.to_be_bytes());
            seg.extend_from_slice(&self.ack.to_be_bytes());
            seg.push(((5 + self.tcp_options.len() / 4) as u8) << 4);
            seg.push(self.tcp_flags);
            seg.extend_from_slice(&self.window.to_be_bytes());
            seg.extend_from_slice(&[0, 0, 0, 0]);
            seg.extend_from_slice(&self.tcp_options);
            16
        } else {
            let len = (8 + self.payload.len()) as u16;
            seg.extend_from_slice(&len.to_be_bytes());
            seg.extend_from_slice(&[0, 0]);
            6
        };
        seg.extend_from_slice(&self.payload);
        if !(t.proto == UDP && self.udp_zero_checksum) {
            let check = checksum::l4_checksum(t.src, t.dst, t.proto, &seg);
            seg[check_at..check_at + 2].copy_from_slice(&check.to_be_bytes());
        }
        seg
    }

    pub fn l4_header_len(&self) -> usize {
        if self.tuple.proto == TCP { 20 + self.tcp_options.len() } else { 8 }
    }

    fn frag_field(&self, more: bool, offset_bytes: usize) -> u16 {
        let mut field = (offset_bytes / 8) as u16;
        if self.dont_fragment && !more && offset_bytes == 0 {
            field |= 0x4000;
        }
        if more {
            field |= 0x2000;
        }
        field
    }

    /// The frame of the whole packet.
    pub fn frame(&self, macs: Macs) -> Vec<u8> {
        let seg = self.segment();
        let header = ipv4_header(
            self.tuple.src,
            self.tuple.dst,
            self.tuple.proto,
            self.ttl,
            self.tos,
            self.id,
            self.frag_field(false, 0),
            &self.ip_options,
            seg.len(),
        );
        ethernet(macs, 0x0800, &[header, seg].concat())
    }

    /// The two fragments of the packet, split `first_len` bytes into its segment (a multiple of
    /// 8, at least the L4 header), and the bytes of the segment the first one lacks.
    pub fn fragments(&self, macs: Macs, first_len: usize) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let seg = self.segment();
        assert!(first_len.is_multiple_of(8) && first_len >= self.l4_header_len() && first_len < seg.len());
        let t = &self.tuple;
        let (head, rest) = seg.split_at(first_len);
        let first_header = ipv4_header(
            t.src,
            t.dst,
            t.proto,
            self.ttl,
            self.tos,
            self.id,
            0x2000,
            &self.ip_options,
            head.len(),
        );
        // Options without the copy bit stay in the first fragment only (RFC 791); the
        // fuzzer's later fragments carry none.
        let later_header = ipv4_header(
            t.src,
            t.dst,
            t.proto,
            self.ttl,
            self.tos,
            self.id,
            (first_len / 8) as u16,
            &[],
            rest.len(),
        );
        (
            ethernet(macs, 0x0800, &[first_header, head.to_vec()].concat()),
            ethernet(macs, 0x0800, &[later_header, rest.to_vec()].concat()),
            rest.to_vec(),
        )
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Macs {
    pub dst: [u8; 6],
    pub src: [u8; 6],
}

pub fn ethernet(macs: Macs, ethertype: u16, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(14 + body.len());
    frame.extend_from_slice(&macs.dst);
    frame.extend_from_slice(&macs.src);
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(body);
    frame
}

#[allow(clippy::too_many_arguments)]
pub fn ipv4_header(
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    ttl: u8,
    tos: u8,
    id: u16,
    frag_field: u16,
    options: &[u8],
    payload_len: usize,
) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0);
    let ihl = 5 + options.len() / 4;
    let total = (ihl * 4 + payload_len) as u16;
    let mut h = vec![(4 << 4) | ihl as u8, tos];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(&frag_field.to_be_bytes());
    h.extend_from_slice(&[ttl, proto, 0, 0]);
    h.extend_from_slice(&src);
    h.extend_from_slice(&dst);
    h.extend_from_slice(options);
    let check = checksum::checksum(&h);
    h[10..12].copy_from_slice(&check.to_be_bytes());
    h
}

/// Recomputes the IPv4 header checksum of a frame in place (after a field was changed on purpose).
pub fn fix_ip_checksum(frame: &mut [u8]) {
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    frame[24..26].copy_from_slice(&[0, 0]);
    let check = checksum::checksum(&frame[14..14 + ihl]);
    frame[24..26].copy_from_slice(&check.to_be_bytes());
}

/// An ICMP message of `kind`/`code` (`rest` is its second word) quoting `quote`, in a frame.
#[allow(clippy::too_many_arguments)]
pub fn icmp(
    macs: Macs,
    src: [u8; 4],
    dst: [u8; 4],
    kind: u8,
    code: u8,
    rest: u32,
    quote: &[u8],
    ttl: u8,
    ip_options: &[u8],
) -> Vec<u8> {
    let mut msg = vec![kind, code, 0, 0];
    msg.extend_from_slice(&rest.to_be_bytes());
    msg.extend_from_slice(quote);
    let check = checksum::checksum(&msg);
    msg[2..4].copy_from_slice(&check.to_be_bytes());
    let header = ipv4_header(src, dst, ICMP, ttl, 0xc0, 0, 0, ip_options, msg.len());
    ethernet(macs, 0x0800, &[header, msg].concat())
}

/// The first `len` bytes of the IP packet a frame carries (what an ICMP error quotes).
pub fn quote_of(frame: &[u8], len: usize) -> Vec<u8> {
    let end = (ETH_HLEN + len).min(frame.len());
    frame[ETH_HLEN..end].to_vec()
}

/// Which part of its datagram a packet carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Whole,
    First,
    Later,
}

/// An IPv4 frame's header, when the frame holds one.
#[derive(Clone, Copy, Debug)]
pub struct Ipv4 {
    pub header_len: usize,
    pub total_len: usize,
    pub proto: u8,
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub id: u16,
    pub part: Part,
    /// The total length fits in the frame and covers the header.
    pub lengths_consistent: bool,
}

impl Ipv4 {
    /// Where the IP datagram ends in the frame.
    pub fn end(&self) -> usize {
        ETH_HLEN + self.total_len
    }

    pub fn l4(&self) -> usize {
        ETH_HLEN + self.header_len
    }
}

pub fn ipv4(frame: &[u8]) -> Option<Ipv4> {
    if frame.len() < ETH_HLEN + 20 || frame[12..14] != [0x08, 0x00] || frame[14] >> 4 != 4 {
        return None;
    }
    let header_len = usize::from(frame[14] & 0x0f) * 4;
    if header_len < 20 || frame.len() < ETH_HLEN + header_len {
        return None;
    }
    let total_len = usize::from(u16::from_be_bytes([frame[16], frame[17]]));
    let frag = u16::from_be_bytes([frame[20], frame[21]]);
    let part = match (frag & 0x1fff != 0, frag & 0x2000 != 0) {
        (true, _) => Part::Later,
        (false, true) => Part::First,
        (false, false) => Part::Whole,
    };
    Some(Ipv4 {
        header_len,
        total_len,
        proto: frame[23],
        src: frame[26..30].try_into().unwrap(),
        dst: frame[30..34].try_into().unwrap(),
        id: u16::from_be_bytes([frame[18], frame[19]]),
        part,
        lengths_consistent: total_len >= header_len && ETH_HLEN + total_len <= frame.len(),
    })
}

/// What kind of packet a frame is, as a proxy must see it.
#[derive(Clone, Debug)]
pub enum Kind {
    NotIpv4,
    /// IPv4 whose lengths contradict each other or the frame, or whose L4 header is cut short.
    Malformed,
    /// A TCP or UDP packet with its L4 header (whole, or a first fragment).
    L4 {
        tuple: Tuple,
        flags: u8,
        part: Part,
    },
    /// A later fragment of a TCP or UDP datagram: addresses only.
    LaterFragment {
        src: [u8; 4],
        dst: [u8; 4],
        proto: u8,
        id: u16,
    },
    /// An ICMP error (destination unreachable, time exceeded) whose quote's option-less header
    /// and ports lie inside the IP datagram.
    IcmpError {
        outer_src: [u8; 4],
        outer_dst: [u8; 4],
        quote: Tuple,
        quote_has_options: bool,
    },
    /// Any other IPv4 packet (other ICMP, other protocols, an ICMP error with a cut quote).
    OtherIpv4,
}

pub fn kind(frame: &[u8]) -> Kind {
    let Some(h) = ipv4(frame) else { return Kind::NotIpv4 };
    if !h.lengths_consistent {
        return Kind::Malformed;
    }
    match h.proto {
        TCP | UDP => {
            if h.part == Part::Later {
                return Kind::LaterFragment { src: h.src, dst: h.dst, proto: h.proto, id: h.id };
            }
            let l4_min = if h.proto == TCP { 20 } else { 8 };
            if h.total_len < h.header_len + l4_min {
                return Kind::Malformed;
            }
            let l4 = h.l4();
            let port = |at: usize| u16::from_be_bytes([frame[at], frame[at + 1]]);
            let flags = if h.proto == TCP { frame[l4 + 13] } else { 0 };
            Kind::L4 { tuple: Tuple::new(h.src, port(l4), h.dst, port(l4 + 2), h.proto), flags, part: h.part }
        }
        ICMP if h.part == Part::Whole => match icmp_quote(frame, &h) {
            Some((quote, quote_has_options)) => {
                Kind::IcmpError { outer_src: h.src, outer_dst: h.dst, quote, quote_has_options }
            }
            None => Kind::OtherIpv4,
        },
        _ => Kind::OtherIpv4,
    }
}

/// The quoted TCP/UDP tuple of an ICMP error, when its header and ports are inside the datagram.
fn icmp_quote(frame: &[u8], h: &Ipv4) -> Option<(Tuple, bool)> {
    let at = h.l4();
    let end = h.end();
    if at + 8 + 20 > end || !matches!(frame[at], 3 | 11) {
        return None;
    }
    let q = at + 8;
    if frame[q] >> 4 != 4 {
        return None;
    }
    let qhl = usize::from(frame[q] & 0x0f) * 4;
    let proto = frame[q + 9];
    if qhl < 20 || q + qhl + 4 > end || !matches!(proto, TCP | UDP) {
        return None;
    }
    let p = q + qhl;
    let port = |at: usize| u16::from_be_bytes([frame[at], frame[at + 1]]);
    let src = frame[q + 12..q + 16].try_into().unwrap();
    let dst = frame[q + 16..q + 20].try_into().unwrap();
    Some((Tuple::new(src, port(p), dst, port(p + 2), proto), qhl > 20))
}

/// The fields a NAT may rewrite, as a frame has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fields {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    /// TCP/UDP ports, when the frame has its L4 header.
    pub ports: Option<(u16, u16)>,
    /// An ICMP error's quoted tuple.
    pub quote: Option<Tuple>,
}

impl Fields {
    pub fn of_tuple(t: &Tuple) -> Self {
        Self { src: t.src, dst: t.dst, ports: Some((t.sport, t.dport)), quote: None }
    }
}

impl fmt::Display for Fields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ports {
            Some((s, d)) => write!(f, "{}:{s} → {}:{d}", ip(self.src), ip(self.dst))?,
            None => write!(f, "{} → {}", ip(self.src), ip(self.dst))?,
        }
        if let Some(q) = &self.quote {
            write!(f, " quoting [{q:?}]")?;
        }
        Ok(())
    }
}

/// The rewritable fields of a frame whose kind is `kind` (computed on the frame that went in:
/// the output is read at the same offsets).
pub fn fields(frame: &[u8], kind: &Kind) -> Option<Fields> {
    let h = ipv4(frame)?;
    let port = |at: usize| u16::from_be_bytes([frame[at], frame[at + 1]]);
    match kind {
        Kind::L4 { .. } => {
            let l4 = h.l4();
            Some(Fields { src: h.src, dst: h.dst, ports: Some((port(l4), port(l4 + 2))), quote: None })
        }
        Kind::LaterFragment { .. } => Some(Fields { src: h.src, dst: h.dst, ports: None, quote: None }),
        Kind::IcmpError { quote, .. } => {
            let q = h.l4() + 8;
            let qhl = usize::from(frame[q] & 0x0f) * 4;
            let p = q + qhl;
            Some(Fields {
                src: h.src,
                dst: h.dst,
                ports: None,
                quote: Some(Tuple::new(
                    frame[q + 12..q + 16].try_into().unwrap(),
                    port(p),
                    frame[q + 16..q + 20].try_into().unwrap(),
                    port(p + 2),
                    quote.proto,
                )),
            })
        }
        _ => Some(Fields { src: h.src, dst: h.dst, ports: None, quote: None }),
    }
}

/// The byte ranges a NAT of a frame of `kind` may change besides the MAC addresses: addresses,
/// ports and the checksums covering them — each only where it lies inside the IP datagram.
fn rewritable(frame: &[u8], kind: &Kind) -> Vec<Range<usize>> {
    let Some(h) = ipv4(frame) else { return Vec::new() };
    let mut ranges = vec![24..26, 26..34];
    let end = h.end().min(frame.len());
    let mut inside = |r: Range<usize>| {
        if r.end <= end {
            ranges.push(r);
        }
    };
    match kind {
        Kind::L4 { tuple, .. } => {
            let l4 = h.l4();
            inside(l4..l4 + 4);
            inside(if tuple.proto == TCP { l4 + 16..l4 + 18 } else { l4 + 6..l4 + 8 });
        }
        Kind::IcmpError { .. } => {
            let at = h.l4();
            let q = at + 8;
            let qhl = usize::from(frame[q] & 0x0f) * 4;
            inside(at + 2..at + 4);
            inside(q + 10..q + 12);
            inside(q + 12..q + 20);
            inside(q + qhl..q + qhl + 4);
        }
        _ => {}
    }
    ranges
}

/// Where `output` differs from `input` outside what a NAT may change (MAC addresses excepted).
pub fn unexpected_changes(input: &[u8], output: &[u8], kind: &Kind) -> Option<String> {
    if input.len() != output.len() {
        return Some(format!("the frame's length changed from {} to {} bytes", input.len(), output.len()));
    }
    let mut masked = output.to_vec();
    masked[..12].copy_from_slice(&input[..12]);
    for r in rewritable(input, kind) {
        masked[r.clone()].copy_from_slice(&input[r]);
    }
    let changed: Vec<usize> = (0..input.len()).filter(|&i| masked[i] != input[i]).collect();
    if changed.is_empty() {
        return None;
    }
    let end = ipv4(input).map(|h| h.end());
    let past = end.map_or(0, |end| changed.iter().filter(|&&i| i >= end).count());
    let mut msg =
        format!("bytes at frame offsets {changed:?} changed, which no NAT of this packet may change");
    if past > 0 {
        msg += &format!(" ({past} of them past the IP datagram's end at offset {})", end.unwrap());
    }
    Some(msg)
}

/// The checksums of a frame that do not verify (recomputed from scratch). `rest`: the bytes of a
/// first fragment's L4 segment carried by its later fragments (the L4 checksum covers them).
pub fn bad_checksums(frame: &[u8], rest: Option<&[u8]>) -> Vec<&'static str> {
    let mut bad = Vec::new();
    let Some(h) = ipv4(frame) else { return bad };
    if !checksum::is_valid(checksum::add_words(0, &frame[14..14 + h.header_len])) {
        bad.push("IPv4 header");
    }
    if !h.lengths_consistent {
        return bad;
    }
    let l4 = &frame[h.l4()..h.end()];
    match (h.proto, h.part) {
        (TCP | UDP, Part::Whole) => {
            let min = if h.proto == TCP { 20 } else { 8 };
            if l4.len() >= min && !(h.proto == UDP && l4[6..8] == [0, 0]) && !l4_valid(&h, l4, &[]) {
                bad.push(if h.proto == TCP { "TCP" } else { "UDP" });
            }
        }
        (TCP | UDP, Part::First) => {
            let min = if h.proto == TCP { 20 } else { 8 };
            if let Some(rest) = rest
                && l4.len() >= min
                && !(h.proto == UDP && l4[6..8] == [0, 0])
                && !l4_valid(&h, l4, rest)
            {
                bad.push(if h.proto == TCP {
                    "TCP (over the whole datagram)"
                } else {
                    "UDP (over the whole datagram)"
                });
            }
        }
        (ICMP, Part::Whole) => {
            if l4.len() >= 4 && !checksum::is_valid(checksum::add_words(0, l4)) {
                bad.push("ICMP");
            }
            if l4.len() >= 8 + 20 && matches!(l4[0], 3 | 11) && l4[8] >> 4 == 4 {
                let qhl = usize::from(l4[8] & 0x0f) * 4;
                if qhl >= 20
                    && l4.len() >= 8 + qhl
                    && !checksum::is_valid(checksum::add_words(0, &l4[8..8 + qhl]))
                {
                    bad.push("quoted IPv4 header");
                }
            }
        }
        _ => {}
    }
    bad
}

fn l4_valid(h: &Ipv4, l4: &[u8], rest: &[u8]) -> bool {
    let len = (l4.len() + rest.len()) as u16;
    let sum = checksum::pseudo_header_sum(h.src, h.dst, h.proto, len);
    checksum::is_valid(checksum::add_words(checksum::add_words(sum, l4), rest))
}

/// A UDP checksum field of zero means "none": it must stay zero, and a real one must never
/// become zero.
pub fn udp_checksum_zero(frame: &[u8]) -> Option<bool> {
    let h = ipv4(frame)?;
    if h.proto != UDP || h.part == Part::Later || frame.len() < h.l4() + 8 || h.end() < h.l4() + 8 {
        return None;
    }
    Some(frame[h.l4() + 6..h.l4() + 8] == [0, 0])
}

pub fn hex(frame: &[u8]) -> String {
    frame.iter().map(|b| format!("{b:02x}")).collect()
}

/// One line describing a frame for people.
pub fn describe(frame: &[u8]) -> String {
    let k = kind(frame);
    let h = ipv4(frame);
    let extras = |h: &Ipv4| {
        let mut s = String::new();
        if h.header_len > 20 {
            s += &format!(" +{}B IP options", h.header_len - 20);
        }
        if h.lengths_consistent && frame.len() > h.end() {
            s += &format!(" +{}B padding", frame.len() - h.end());
        }
        s += &format!(" id {:#06x}", h.id);
        s
    };
    match (&k, h) {
        (Kind::NotIpv4, _) => {
            format!("non-IPv4 frame, ethertype {:02x}{:02x}, {} bytes", frame[12], frame[13], frame.len())
        }
        (Kind::Malformed, Some(h)) => format!(
            "malformed IPv4 {} {} → {} (total length {}, frame {} bytes)",
            proto_name(h.proto),
            ip(h.src),
            ip(h.dst),
            h.total_len,
            frame.len()
        ),
        (Kind::L4 { tuple, flags, part }, Some(h)) => {
            let mut s = format!("{tuple:?}");
            if tuple.proto == TCP {
                s += &format!(" [{}]", flags_name(*flags));
            }
            s += &format!(" {}B L4", h.total_len - h.header_len);
            if *part == Part::First {
                s += " (first fragment)";
            }
            s + &extras(&h)
        }
        (Kind::LaterFragment { src, dst, proto, .. }, Some(h)) => {
            format!(
                "{} {} → {} later fragment (offset {})",
                proto_name(*proto),
                ip(*src),
                ip(*dst),
                (u16::from_be_bytes([frame[20], frame[21]]) & 0x1fff) * 8
            ) + &extras(&h)
        }
        (Kind::IcmpError { outer_src, outer_dst, quote, .. }, Some(h)) => {
            format!(
                "ICMP {}/{} {} → {} quoting [{quote:?}]",
                frame[h.l4()],
                frame[h.l4() + 1],
                ip(*outer_src),
                ip(*outer_dst)
            ) + &extras(&h)
        }
        (_, Some(h)) => {
            let mut s = format!("{} {} → {} {}B", proto_name(h.proto), ip(h.src), ip(h.dst), h.total_len);
            if h.proto == ICMP && h.lengths_consistent && h.total_len >= h.header_len + 2 {
                s += &format!(" type {}/{}", frame[h.l4()], frame[h.l4() + 1]);
            }
            s + &extras(&h)
        }
        (_, None) => format!("{} bytes", frame.len()),
    }
}

/// Rewrites a TCP/UDP frame's tuple (a first fragment's L4 checksum over its whole datagram,
/// `rest` being the part its later fragments carry), checksums recomputed from scratch.
pub fn set_tuple(frame: &mut [u8], t: &Tuple, rest: Option<&[u8]>) {
    let Some(h) = ipv4(frame) else { return };
    frame[26..30].copy_from_slice(&t.src);
    frame[30..34].copy_from_slice(&t.dst);
    fix_ip_checksum(frame);
    let l4 = h.l4();
    if frame.len() < l4 + 4 {
        return;
    }
    frame[l4..l4 + 2].copy_from_slice(&t.sport.to_be_bytes());
    frame[l4 + 2..l4 + 4].copy_from_slice(&t.dport.to_be_bytes());
    let check_at = l4 + if t.proto == TCP { 16 } else { 6 };
    if !h.lengths_consistent
        || h.end() < check_at + 2
        || (t.proto == UDP && frame[check_at..check_at + 2] == [0, 0])
    {
        return;
    }
    frame[check_at..check_at + 2].copy_from_slice(&[0, 0]);
    let rest = rest.unwrap_or(&[]);
    let seg = &frame[l4..h.end()];
    let sum = checksum::pseudo_header_sum(t.src, t.dst, t.proto, (seg.len() + rest.len()) as u16);
    let mut check = checksum::fold(checksum::add_words(checksum::add_words(sum, seg), rest));
    if t.proto == UDP && check == 0 {
        check = 0xffff;
    }
    frame[check_at..check_at + 2].copy_from_slice(&check.to_be_bytes());
}

/// Rewrites an ICMP error's quoted tuple to `q` and its outer addresses to `src`/`dst`,
/// checksums recomputed from scratch.
pub fn set_icmp_error(frame: &mut [u8], src: [u8; 4], dst: [u8; 4], q: &Tuple) {
    let Some(h) = ipv4(frame) else { return };
    frame[26..30].copy_from_slice(&src);
    frame[30..34].copy_from_slice(&dst);
    fix_ip_checksum(frame);
    let at = h.l4();
    let quote = at + 8;
    let qhl = usize::from(frame[quote] & 0x0f) * 4;
    frame[quote + 12..quote + 16].copy_from_slice(&q.src);
    frame[quote + 16..quote + 20].copy_from_slice(&q.dst);
    frame[quote + 10..quote + 12].copy_from_slice(&[0, 0]);
    let check = checksum::checksum(&frame[quote..quote + qhl]);
    frame[quote + 10..quote + 12].copy_from_slice(&check.to_be_bytes());
    frame[quote + qhl..quote + qhl + 2].copy_from_slice(&q.sport.to_be_bytes());
    frame[quote + qhl + 2..quote + qhl + 4].copy_from_slice(&q.dport.to_be_bytes());
    frame[at + 2..at + 4].copy_from_slice(&[0, 0]);
    let check = checksum::checksum(&frame[at..h.end()]);
    frame[at + 2..at + 4].copy_from_slice(&check.to_be_bytes());
}

/// An ICMP error whose quoted header or ports end past the IP total length.
pub fn icmp_quote_cut(frame: &[u8]) -> bool {
    let Some(h) = ipv4(frame) else { return false };
    if h.proto != ICMP || !h.lengths_consistent || h.part != Part::Whole {
        return false;
    }
    let at = h.l4();
    if h.end() < at + 1 || !matches!(frame[at], 3 | 11) {
        return false;
    }
    let q = at + 8;
    let qhl = if frame.len() > q { usize::from(frame[q] & 0x0f) * 4 } else { 20 };
    h.end() < q + qhl.max(20) + 4
}
