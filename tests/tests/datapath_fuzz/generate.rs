//! The packets: a seeded mix of what pods, backends, external clients, routers and the node send,
//! with ports from small sets so that flows collide and tuples are reused. Replies, continued
//! flows and ICMP errors are drawn from the flows the oracle saw (the port a remap or a SNAT
//! picked is only known from the datapath's output), so a run replays exactly from its seed as
//! long as the datapath picks the same backends; every reported failure carries its packets as
//! bytes.

use super::{
    frame::{self, ACK, FIN, Macs, PSH, RST, SYN, Spec, TCP, Tuple, UDP},
    oracle::Oracle,
    topology::*,
};

/// SplitMix64: small, seedable, and good enough to pick packets.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }

    /// True `per_mille` times in a thousand.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        self.below(1000) < per_mille as usize
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub fn pick_cloned<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    pub fn weighted<T: Copy>(&mut self, items: &[(u32, T)]) -> T {
        let total: u32 = items.iter().map(|(w, _)| w).sum();
        let mut at = self.below(total as usize) as u32;
        for (w, item) in items {
            if at < *w {
                return *item;
            }
            at -= w;
        }
        unreachable!()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Where a packet enters the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Sent by a local pod: its host veth's tc ingress.
    Pod,
    /// Arriving on the external interface: XDP (when `xdp`), then tc.
    Wire { xdp: bool },
    /// Sent by the node itself: straight to the egress of the interface it is routed to.
    Node,
}

#[derive(Clone, Debug)]
pub struct Packet {
    pub entry: Entry,
    pub frame: Vec<u8>,
    /// A first fragment's L4 bytes that its later fragments carry (for its checksum).
    pub rest: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
pub enum Action {
    Packet(Packet),
    /// Reprogram the Services as topology::VARIANTS[n].
    Configure(usize),
}

const CLIENT_PORTS: [u16; 8] = [40000, 40000, 40001, 40001, 40002, 33333, 53, 8080];
const EXTERNAL_PORTS: [u16; 5] = [40000, 40001, 50000, 50000, 61001];
const FRAGMENT_IDS: [u16; 6] = [0x0101, 0x0102, 0x0103, 0x0104, 0x0105, 0x0106];

#[derive(Clone, Copy)]
enum What {
    PodToService,
    PodDirect,
    ContinueFlow,
    Reply,
    IcmpError,
    External,
    PodToSnatPort,
    NodeConnection,
    Odd,
}

pub struct Generator {
    rng: Rng,
    /// Later fragments (and reordered first ones) waiting for their turn.
    pending: Vec<(u64, Packet)>,
    count: u64,
    next_configure: u64,
    variant: usize,
}

impl Generator {
    pub fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let next_configure = 1500 + rng.below(2500) as u64;
        Self { rng, pending: Vec::new(), count: 0, next_configure, variant: 0 }
    }

    pub fn next(&mut self, oracle: &Oracle) -> Action {
        self.count += 1;
        if let Some(i) = self.pending.iter().position(|(due, _)| *due <= self.count) {
            return Action::Packet(self.pending.swap_remove(i).1);
        }
        if self.count >= self.next_configure {
            self.next_configure = self.count + 1500 + self.rng.below(2500) as u64;
            let variant = if self.variant != 0 && self.rng.chance(400) {
                0
            } else {
                (self.variant + 1 + self.rng.below(VARIANTS.len() - 1)) % VARIANTS.len()
            };
            self.variant = variant;
            return Action::Configure(variant);
        }
        let what = self.rng.weighted(&[
            (220, What::PodToService),
            (130, What::PodDirect),
            (150, What::ContinueFlow),
            (220, What::Reply),
            (70, What::IcmpError),
            (80, What::External),
            (30, What::PodToSnatPort),
            (20, What::NodeConnection),
            (40, What::Odd),
        ]);
        let packet = match what {
            What::PodToService => self.pod_to_service(),
            What::PodDirect => self.pod_direct(),
            What::ContinueFlow => self.continue_flow(oracle),
            What::Reply => self.reply(oracle),
            What::IcmpError => self.icmp_error(oracle),
            What::External => self.external(),
            What::PodToSnatPort => self.pod_to_snat_port(),
            What::NodeConnection => self.node_connection(),
            What::Odd => self.odd(),
        };
        Action::Packet(packet)
    }

    fn client(&mut self) -> ([u8; 4], u16) {
        let addr = self.rng.pick(&[C1, C1, C2, W1, D1]);
        (addr, self.rng.pick(&CLIENT_PORTS))
    }

    fn forward_flags(&mut self) -> u8 {
        let random = self.rng.next() as u8;
        self.rng.weighted(&[
            (30, SYN),
            (25, ACK),
            (10, PSH | ACK),
            (10, FIN | ACK),
            (6, RST),
            (3, RST | ACK),
            (3, SYN | FIN),
            (2, SYN | ACK),
            (2, 0),
            (2, FIN),
            (7, random),
        ])
    }

    fn reply_flags(&mut self) -> u8 {
        let random = self.rng.next() as u8;
        self.rng.weighted(&[
            (25, SYN | ACK),
            (30, ACK),
            (10, PSH | ACK),
            (12, FIN | ACK),
            (8, RST),
            (4, RST | ACK),
            (4, SYN),
            (7, random),
        ])
    }

    fn pod_to_service(&mut self) -> Packet {
        let (src, sport) = self.client();
        let (dst, dport, proto) = self.rng.weighted(&[
            (4, (WEB, 80, TCP)),
            (3, (WEB2, 80, TCP)),
            (4, (DNS, 53, UDP)),
            (2, (DNS, 53, TCP)),
            (2, (DNS2, 53, UDP)),
            (1, (EMPTY, 80, TCP)),
            (1, (EMPTY, 53, UDP)),
            (1, (WEB, 443, TCP)),
            (1, (DNS, 5353, UDP)),
            (1, (WEB2, 8000, TCP)),
            (2, (NODE, 30080, TCP)),
            (2, (NODE, 30053, UDP)),
        ]);
        let flags = self.forward_flags();
        self.emit(Tuple::new(src, sport, dst, dport, proto), flags, Entry::Pod)
    }

    fn pod_direct(&mut self) -> Packet {
        let (src, sport) = self.client();
        let (mut dst, dport, proto) = self.rng.weighted(&[
            (3, (W1, 8080, TCP)),
            (1, (W2, 8080, TCP)),
            (2, (W3, 8080, TCP)),
            (1, (W4, 8080, TCP)),
            (3, (D1, 53, UDP)),
            (1, (D2, 53, UDP)),
            (2, (D3, 53, UDP)),
            (1, (D1, 53, TCP)),
            (1, (C2, 40000, UDP)),
            (1, (NODE, 22, TCP)),
            (1, (EXTERNAL_CLIENTS[0], 443, TCP)),
            (1, (R1, 9000, UDP)),
        ]);
        if dst == src {
            dst = C2;
        }
        let flags = self.forward_flags();
        self.emit(Tuple::new(src, sport, dst, dport, proto), flags, Entry::Pod)
    }

    fn entry_of(&mut self, src: [u8; 4]) -> Entry {
        if is_local_pod(src) {
            Entry::Pod
        } else if src == NODE {
            Entry::Node
        } else {
            Entry::Wire { xdp: self.rng.chance(500) }
        }
    }

    /// The next segment or datagram of a flow the oracle saw translated, from its client.
    fn continue_flow(&mut self, oracle: &Oracle) -> Packet {
        let pick = self.rng.below(usize::MAX >> 1);
        if oracle.alive.is_empty() {
            return self.pod_to_service();
        }
        let flow = &oracle.flows[oracle.alive[pick % oracle.alive.len()]];
        let orig = flow.orig;
        let flags = self.weighted_continue_flags();
        let entry = self.entry_of(orig.src);
        self.emit(orig, flags, entry)
    }

    fn weighted_continue_flags(&mut self) -> u8 {
        let random = self.rng.next() as u8;
        self.rng.weighted(&[
            (40, ACK),
            (17, PSH | ACK),
            (15, FIN | ACK),
            (8, RST),
            (10, SYN),
            (3, SYN | FIN),
            (7, random),
        ])
    }

    /// A backend's (or any pod's) packet back to a client: most often the reply tuple of a flow
    /// the oracle saw, else a tuple that may or may not be one.
    fn reply(&mut self, oracle: &Oracle) -> Packet {
        let pick = self.rng.below(usize::MAX >> 1);
        let known = self.rng.chance(700);
        let flags = self.reply_flags();
        if known && !oracle.alive.is_empty() {
            let flow = &oracle.flows[oracle.alive[pick % oracle.alive.len()]];
            let reply = flow.reply();
            let entry = self.entry_of(reply.src);
            return self.emit(reply, flags, entry);
        }
        let (src, sport, proto) = self.rng.pick(&[
            (W1, 8080, TCP),
            (W2, 8080, TCP),
            (W3, 8080, TCP),
            (D1, 53, UDP),
            (D3, 53, UDP),
            (R1, 9000, UDP),
            (C2, 40000, UDP),
        ]);
        let mut dst = self.rng.pick(&[C1, C2, W1, D1, NODE, EXTERNAL_CLIENTS[0]]);
        if dst == src {
            dst = C1;
        }
        let dport = if self.rng.chance(200) {
            SNAT_RANGE.0 + self.rng.below(8) as u16
        } else if dst == NODE {
            self.rng.pick(&[45000, 45001, 22])
        } else {
            self.rng.pick(&CLIENT_PORTS)
        };
        let entry = self.entry_of(src);
        self.emit(Tuple::new(src, sport, dst, dport, proto), flags, entry)
    }

    fn icmp_error(&mut self, oracle: &Oracle) -> Packet {
        let pick = self.rng.below(usize::MAX >> 1);
        let candidates: Vec<usize> =
            oracle.alive.iter().copied().filter(|&id| !oracle.flows[id].hairpin).collect();
        let quoted = if self.rng.chance(700) && !candidates.is_empty() {
            oracle.flows[candidates[pick % candidates.len()]].wire
        } else {
            let (src, sport) = self.client();
            let (dst, dport, proto) = self.rng.pick(&[
                (W1, 8080, TCP),
                (W3, 8080, TCP),
                (D1, 53, UDP),
                (D3, 53, UDP),
                (C2, 40000, UDP),
            ]);
            Tuple::new(src, sport, if dst == src { C2 } else { dst }, dport, proto)
        };
        let mut spec = Spec::new(quoted);
        spec.tcp_flags = self.forward_flags();
        let len = self.rng.pick(&[0, 12, 40]);
        spec.payload = self.rng.bytes(len);
        if self.rng.chance(50) {
            spec.ip_options = vec![1, 1, 1, 1];
        }
        let sent = spec.frame(Macs { dst: [0; 6], src: [0; 6] });
        let header = 20 + spec.ip_options.len();
        let quote_len = if self.rng.chance(300) { sent.len() - 14 } else { header + 8 };
        let quote = frame::quote_of(&sent, quote_len);
        let sender = if self.rng.chance(500) { quoted.dst } else { self.rng.pick(&ROUTERS) };
        let outer_dst = if self.rng.chance(900) {
            quoted.src
        } else {
            self.rng.pick(&[C1, C2, D1, NODE, EXTERNAL_CLIENTS[1]])
        };
        let (kind, code) = self.rng.weighted(&[
            (4, (3, 3)),
            (3, (3, 4)),
            (1, (3, 1)),
            (2, (11, 0)),
            (1, (3, 13)),
            (1, (0, 0)),
        ]);
        let rest = if (kind, code) == (3, 4) { 1400 } else { 0 };
        let entry = self.entry_of(sender);
        let macs = self.macs(entry, sender);
        let ttl = 64 - self.rng.below(8) as u8;
        let mut frame = frame::icmp(macs, sender, outer_dst, kind, code, rest, &quote, ttl, &[]);
        if self.rng.chance(120) {
            // The datagram ends inside the quote; what follows is Ethernet padding that
            // happens to hold the rest of it.
            let cut = 8 + self.rng.below(24);
            let total = (20 + cut) as u16;
            frame[16..18].copy_from_slice(&total.to_be_bytes());
            frame::fix_ip_checksum(&mut frame);
            let msg = 34..34 + cut;
            frame[36..38].copy_from_slice(&[0, 0]);
            let check = proxy_common::checksum::checksum(&frame[msg]);
            frame[36..38].copy_from_slice(&check.to_be_bytes());
        } else if self.rng.chance(250) {
            let pad = 1 + self.rng.below(24);
            frame.extend(self.rng.bytes(pad));
        }
        Packet { entry, frame, rest: None }
    }

    fn external(&mut self) -> Packet {
        let src = self.rng.pick(&EXTERNAL_CLIENTS);
        let sport = self.rng.pick(&EXTERNAL_PORTS);
        let snat_port = SNAT_RANGE.0 + self.rng.below(4) as u16;
        let (dst, dport, proto) = self.rng.weighted(&[
            (3, (NODE, 30080, TCP)),
            (3, (NODE, 30053, UDP)),
            (2, (WEB, 80, TCP)),
            (1, (EMPTY, 80, TCP)),
            (1, (NODE, 22, TCP)),
            (1, (NODE, snat_port, TCP)),
            (2, (W1, 8080, TCP)),
            (1, (D1, 53, UDP)),
        ]);
        let flags = self.forward_flags();
        let entry = Entry::Wire { xdp: self.rng.chance(500) };
        self.emit(Tuple::new(src, sport, dst, dport, proto), flags, entry)
    }

    /// A pod talking to the node on a port of the SNAT range: a reply only if a flow has it.
    fn pod_to_snat_port(&mut self) -> Packet {
        let (src, sport, proto) =
            self.rng.pick(&[(W3, 8080, TCP), (D3, 53, UDP), (W1, 8080, TCP), (D1, 53, UDP)]);
        let dport = if self.rng.chance(500) {
            SNAT_RANGE.0 + self.rng.below(4) as u16
        } else {
            SNAT_RANGE.0 + self.rng.below(usize::from(SNAT_RANGE.1 - SNAT_RANGE.0) + 1) as u16
        };
        let flags = self.reply_flags();
        let entry = self.entry_of(src);
        self.emit(Tuple::new(src, sport, NODE, dport, proto), flags, entry)
    }

    /// The node's own connections (kubelet, node daemons) to pods.
    fn node_connection(&mut self) -> Packet {
        let sport = self.rng.pick(&[45000, 45001]);
        let (dst, dport, proto) = self.rng.pick(&[(W1, 8080, TCP), (W3, 8080, TCP), (D1, 53, UDP)]);
        let flags = self.forward_flags();
        self.emit(Tuple::new(NODE, sport, dst, dport, proto), flags, Entry::Node)
    }

    /// Frames no proxy translates, and sources no refusal may answer.
    fn odd(&mut self) -> Packet {
        let src = self.rng.pick(&[C1, C2]);
        let macs = self.macs(Entry::Pod, src);
        let choice = self.rng.below(8);
        let frame = match choice {
            0 => frame::ethernet(macs, 0x0806, &self.rng.bytes(28)),
            1 => frame::ethernet(macs, 0x86dd, &[vec![0x60], self.rng.bytes(59)].concat()),
            2 => {
                let mut inner = Spec::new(Tuple::new(src, 40000, WEB, 80, TCP));
                inner.tcp_flags = SYN;
                let f = inner.frame(macs);
                [&f[..12], &[0x81, 0x00, 0x00, 0x05], &f[12..]].concat()
            }
            3 | 4 => {
                // ICMP echo or SCTP to a cluster IP or a pod.
                let dst = self.rng.pick(&[WEB, DNS, W1]);
                let proto = if choice == 3 { 1 } else { 132 };
                let body = self.rng.bytes(24);
                let mut body = body;
                if proto == 1 {
                    body[0] = 8;
                    body[1] = 0;
                    body[2..4].copy_from_slice(&[0, 0]);
                    let c = proxy_common::checksum::checksum(&body);
                    body[2..4].copy_from_slice(&c.to_be_bytes());
                }
                let header = frame::ipv4_header(src, dst, proto, 64, 0, 7, 0x4000, &[], body.len());
                frame::ethernet(macs, 0x0800, &[header, body].concat())
            }
            _ => {
                // A source no refusal may be sent to, to a Service that refuses.
                let bogus =
                    self.rng.pick(&[[0, 0, 0, 0], [127, 0, 0, 1], [224, 0, 0, 5], [255, 255, 255, 255]]);
                let (dst, dport, proto) =
                    self.rng.pick(&[(EMPTY, 80, TCP), (EMPTY, 53, UDP), (WEB, 443, TCP), (DNS, 5353, UDP)]);
                let mut spec = Spec::new(Tuple::new(bogus, self.rng.pick(&CLIENT_PORTS), dst, dport, proto));
                spec.tcp_flags = SYN;
                let len = self.rng.below(16);
                spec.payload = self.rng.bytes(len);
                spec.frame(macs)
            }
        };
        Packet { entry: Entry::Pod, frame, rest: None }
    }

    fn macs(&mut self, entry: Entry, src: [u8; 4]) -> Macs {
        match entry {
            Entry::Pod => Macs { dst: POD_GATEWAY_MAC, src: mac_of(src) },
            Entry::Wire { .. } => {
                Macs { dst: NODE_MAC, src: if is_remote_pod(src) { PEER_MAC } else { mac_of(src) } }
            }
            Entry::Node => Macs { dst: mac_of(src), src: NODE_MAC },
        }
    }

    /// Builds `tuple`'s packet with the decorations real traffic has now and then: payload, IP
    /// and TCP options, no UDP checksum, fragments, Ethernet padding, a cut frame.
    fn emit(&mut self, tuple: Tuple, flags: u8, entry: Entry) -> Packet {
        let macs = self.macs(entry, tuple.src);
        let mut spec = Spec::new(tuple);
        spec.tcp_flags = flags;
        spec.seq = self.rng.next() as u32;
        spec.ack = if flags & ACK != 0 { self.rng.next() as u32 } else { 0 };
        spec.window = self.rng.next() as u16;
        spec.ttl = 1 + self.rng.below(64) as u8;
        spec.id = self.rng.next() as u16;
        if self.rng.chance(100) {
            spec.tos = self.rng.next() as u8;
        }
        let (short, long) = (1 + self.rng.below(64), 65 + self.rng.below(340));
        let payload_len = self.rng.weighted(&[(60, 0), (30, short), (10, long)]);
        spec.payload = self.rng.bytes(payload_len);
        if self.rng.chance(70) {
            spec.ip_options =
                self.rng.pick_cloned(&[vec![1, 1, 1, 1], vec![0x94, 4, 0, 0], vec![1, 1, 1, 1, 1, 1, 1, 0]]);
        }
        if tuple.proto == TCP && self.rng.chance(150) {
            spec.tcp_options = self.rng.pick_cloned(&[
                vec![2, 4, 5, 0xb4],
                vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2],
                vec![2, 4, 5, 0xb4, 4, 2, 1, 0],
            ]);
        }
        if tuple.proto == UDP && self.rng.chance(100) {
            spec.udp_zero_checksum = true;
        }
        let segment_len = spec.l4_header_len() + spec.payload.len();
        let first_min = spec.l4_header_len().div_ceil(8) * 8;
        if self.rng.chance(70) && segment_len > first_min + 8 {
            spec.id = self.rng.pick(&FRAGMENT_IDS);
            spec.dont_fragment = false;
            let slots = (segment_len - 1 - first_min) / 8 + 1;
            let first_len = first_min + 8 * self.rng.below(slots);
            let (first, later, rest) = spec.fragments(macs, first_len);
            let first = Packet { entry, frame: self.pad(first), rest: Some(rest) };
            let later = Packet { entry, frame: self.pad(later), rest: None };
            let delay = 1 + self.rng.below(12) as u64;
            return match self.rng.below(20) {
                // Lost.
                0 => first,
                // Reordered: the later fragment arrives first.
                1 => {
                    self.pending.push((self.count + delay, first));
                    later
                }
                _ => {
                    self.pending.push((self.count + delay, later));
                    first
                }
            };
        }
        let mut frame = self.pad(spec.frame(macs));
        if self.rng.chance(30) && frame.len() > 35 {
            // Cut short: the IP total length promises more than the frame holds.
            let keep = 34 + self.rng.below(frame.len() - 34);
            frame.truncate(keep);
        } else if self.rng.chance(10) {
            // The IP total length ends inside the L4 header.
            let header = 20 + spec.ip_options.len();
            let total = (header + self.rng.below(spec.l4_header_len().min(20))) as u16;
            frame[16..18].copy_from_slice(&total.to_be_bytes());
            frame::fix_ip_checksum(&mut frame);
        }
        Packet { entry, frame, rest: None }
    }

    fn pad(&mut self, mut frame: Vec<u8>) -> Vec<u8> {
        if self.rng.chance(150) {
            let target = if frame.len() < 60 && self.rng.chance(500) {
                60
            } else {
                frame.len() + 1 + self.rng.below(24)
            };
            while frame.len() < target {
                frame.push(self.rng.next() as u8);
            }
        }
        frame
    }
}
