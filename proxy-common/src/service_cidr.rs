//! The service CIDRs (ServiceCIDR objects, `--service-cidr`): a packet to an
//! address inside one that is no Service's is dropped, as kube-proxy's
//! nftables `cluster-ips-check` chain drops it, so that it never leaves the
//! node. The datapath checks them only after the frontend lookup missed and
//! the address is no VIP: a few prefixes compared in a bounded loop, cheaper
//! than an LPM trie walk for the direct traffic that pays for it.

/// How many prefixes SERVICE_CIDRS_V4 holds. A cluster has one per family,
/// plus one for each range an operator added to grow it.
pub const SERVICE_CIDRS_MAX: usize = 8;

/// One prefix, in network byte order, its address already masked.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceCidrV4 {
    pub addr: [u8; 4],
    pub mask: [u8; 4],
}

impl ServiceCidrV4 {
    /// `addr/prefix_len` (a prefix above 32 counts as 32).
    pub const fn new(addr: [u8; 4], prefix_len: u8) -> Self {
        let prefix_len = if prefix_len > 32 { 32 } else { prefix_len as u32 };
        let mask = if prefix_len == 0 { 0 } else { u32::MAX << (32 - prefix_len) };
        let addr = u32::from_be_bytes(addr) & mask;
        Self { addr: addr.to_be_bytes(), mask: mask.to_be_bytes() }
    }

    pub const fn prefix_len(&self) -> u8 {
        u32::from_be_bytes(self.mask).count_ones() as u8
    }

    #[inline(always)]
    pub fn contains(&self, addr: [u8; 4]) -> bool {
        // Byte order does not matter to a bitwise AND: both sides are in network order.
        u32::from_ne_bytes(addr) & u32::from_ne_bytes(self.mask) == u32::from_ne_bytes(self.addr)
    }
}

/// The one entry of SERVICE_CIDRS_V4: `count` prefixes in use. Zero (before
/// any CIDR is known) drops nothing, as kube-proxy adds its drop rule only
/// once it knows a CIDR.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceCidrsV4 {
    pub count: u32,
    pub cidrs: [ServiceCidrV4; SERVICE_CIDRS_MAX],
}

impl ServiceCidrsV4 {
    /// The first [`SERVICE_CIDRS_MAX`] of `prefixes`; the caller reports the rest.
    pub fn from_prefixes(prefixes: &[ServiceCidrV4]) -> Self {
        let mut value = Self::default();
        for (slot, prefix) in value.cidrs.iter_mut().zip(prefixes) {
            *slot = *prefix;
            value.count += 1;
        }
        value
    }

    /// The prefixes in use.
    pub fn prefixes(&self) -> &[ServiceCidrV4] {
        &self.cidrs[..(self.count as usize).min(SERVICE_CIDRS_MAX)]
    }

    /// Whether `addr` is inside one of the prefixes.
    #[inline(always)]
    pub fn contains(&self, addr: [u8; 4]) -> bool {
        for (i, cidr) in self.cidrs.iter().enumerate() {
            if i as u32 >= self.count {
                return false;
            }
            if cidr.contains(addr) {
                return true;
            }
        }
        false
    }
}

#[cfg(feature = "user")]
// SAFETY: repr(C), made of integers and byte arrays without padding, so every
// bit pattern is valid.
unsafe impl aya::Pod for ServiceCidrsV4 {}

/// One IPv6 prefix, as [`ServiceCidrV4`]: the address (already masked) and the mask as two words
/// each, the 16 network-order bytes read as native-endian `u64`s, so that the datapath compares
/// four aligned words per prefix (a bitwise AND does not care about byte order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceCidrV6 {
    pub addr: [u64; 2],
    pub mask: [u64; 2],
}

/// `addr` as the two words [`ServiceCidrV6`] compares.
#[inline(always)]
pub fn words6(addr: &[u8; 16]) -> [u64; 2] {
    let [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15] = *addr;
    [
        u64::from_ne_bytes([a0, a1, a2, a3, a4, a5, a6, a7]),
        u64::from_ne_bytes([a8, a9, a10, a11, a12, a13, a14, a15]),
    ]
}

impl ServiceCidrV6 {
    /// `addr/prefix_len` (a prefix above 128 counts as 128).
    pub fn new(addr: [u8; 16], prefix_len: u8) -> Self {
        let prefix_len = u32::from(prefix_len.min(128));
        let mask = if prefix_len == 0 { 0 } else { u128::MAX << (128 - prefix_len) };
        let masked = (u128::from_be_bytes(addr) & mask).to_be_bytes();
        Self { addr: words6(&masked), mask: words6(&mask.to_be_bytes()) }
    }

    /// The address, in network byte order.
    pub fn addr_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.addr[0].to_ne_bytes());
        out[8..].copy_from_slice(&self.addr[1].to_ne_bytes());
        out
    }

    pub const fn prefix_len(&self) -> u8 {
        (self.mask[0].count_ones() + self.mask[1].count_ones()) as u8
    }

    /// Whether the address of [`words6`] `words` is inside.
    #[inline(always)]
    pub fn contains_words(&self, words: [u64; 2]) -> bool {
        words[0] & self.mask[0] == self.addr[0] && words[1] & self.mask[1] == self.addr[1]
    }

    pub fn contains(&self, addr: &[u8; 16]) -> bool {
        self.contains_words(words6(addr))
    }
}

/// The one entry of SERVICE_CIDRS_V6, as [`ServiceCidrsV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceCidrsV6 {
    pub count: u32,
    pub _pad: u32,
    pub cidrs: [ServiceCidrV6; SERVICE_CIDRS_MAX],
}

impl ServiceCidrsV6 {
    /// The first [`SERVICE_CIDRS_MAX`] of `prefixes`; the caller reports the rest.
    pub fn from_prefixes(prefixes: &[ServiceCidrV6]) -> Self {
        let mut value = Self::default();
        for (slot, prefix) in value.cidrs.iter_mut().zip(prefixes) {
            *slot = *prefix;
            value.count += 1;
        }
        value
    }

    /// The prefixes in use.
    pub fn prefixes(&self) -> &[ServiceCidrV6] {
        &self.cidrs[..(self.count as usize).min(SERVICE_CIDRS_MAX)]
    }

    /// Whether `addr` is inside one of the prefixes.
    #[inline(always)]
    pub fn contains(&self, addr: &[u8; 16]) -> bool {
        let words = words6(addr);
        for (i, cidr) in self.cidrs.iter().enumerate() {
            if i as u32 >= self.count {
                return false;
            }
            if cidr.contains_words(words) {
                return true;
            }
        }
        false
    }
}

#[cfg(feature = "user")]
// SAFETY: as for ServiceCidrsV4: repr(C) integers and byte arrays without padding.
unsafe impl aya::Pod for ServiceCidrsV6 {}

/// Whether a packet of neither TCP nor UDP (`proto`) to an unallocated address of a service CIDR is dropped.
/// kube-proxy's rule matches the address alone, whatever the protocol (`ip daddr { CIDRs } drop`, under `ct state
/// new`: pkg/proxy/nftables/proxier.go), so what it drops is what netfilter's conntrack calls a new connection:
/// every packet of a protocol it tracks generically (SCTP, GRE, ...: the address never answers, so none gets past
/// new), and of ICMP only the requests that open one (nf_conntrack_proto_icmp's `valid_new`: echo, timestamp,
/// information and address-mask requests). ICMP errors and unsolicited replies are related or invalid there, and
/// pass. `icmp_type` is `None` for a later fragment (no ICMP header): dropped, as its datagram's first fragment
/// was (netfilter reassembles before it looks).
pub const fn drops_other_protocol(proto: u8, icmp_type: Option<u8>) -> bool {
    const IPPROTO_ICMP: u8 = 1;
    if proto != IPPROTO_ICMP {
        return true;
    }
    matches!(icmp_type, None | Some(8 | 13 | 15 | 17))
}

/// [`drops_other_protocol`] for IPv6 (`ip6 daddr { CIDRs } drop` under `ct state new`): of ICMPv6 only what
/// nf_conntrack_proto_icmpv6's `valid_new` opens, echo request (128) and node information query (139). Errors
/// (below 128) and replies are related or invalid; neighbour discovery and MLD are never tracked at all
/// (its `noct_valid_new`), so they pass, as they must for the node to keep its neighbours. A later fragment
/// (`icmp6_type` `None`) is dropped with its datagram, and every other protocol is, as for IPv4.
pub const fn drops_other_protocol6(proto: u8, icmp6_type: Option<u8>) -> bool {
    const IPPROTO_ICMPV6: u8 = 58;
    if proto != IPPROTO_ICMPV6 {
        return true;
    }
    matches!(icmp6_type, None | Some(128 | 139))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_holds_the_addresses_it_covers_and_no_other() {
        let cidr = ServiceCidrV4::new([10, 96, 7, 9], 12);
        assert_eq!(cidr.addr, [10, 96, 0, 0], "the address is masked");
        assert_eq!(cidr.prefix_len(), 12);
        assert!(cidr.contains([10, 96, 0, 0]));
        assert!(cidr.contains([10, 111, 255, 255]));
        assert!(!cidr.contains([10, 112, 0, 0]));
        assert!(!cidr.contains([10, 95, 255, 255]));
        let host = ServiceCidrV4::new([192, 0, 2, 1], 32);
        assert!(host.contains([192, 0, 2, 1]));
        assert!(!host.contains([192, 0, 2, 2]));
        assert_eq!(ServiceCidrV4::new([1, 2, 3, 4], 40), ServiceCidrV4::new([1, 2, 3, 4], 32));
        assert!(ServiceCidrV4::new([1, 2, 3, 4], 0).contains([203, 0, 113, 1]));
    }

    #[test]
    fn an_empty_set_holds_nothing_not_even_what_its_unused_slots_would_cover() {
        let none = ServiceCidrsV4::default();
        // Unused slots are 0.0.0.0/0, which would match every address.
        assert!(!none.contains([0, 0, 0, 0]));
        assert!(!none.contains([10, 96, 0, 1]));
        assert!(none.prefixes().is_empty());
    }

    #[test]
    fn a_set_checks_each_of_its_prefixes_and_keeps_the_first_eight() {
        let set = ServiceCidrsV4::from_prefixes(&[
            ServiceCidrV4::new([10, 96, 0, 0], 16),
            ServiceCidrV4::new([172, 30, 0, 0], 24),
        ]);
        assert_eq!(set.count, 2);
        assert!(set.contains([10, 96, 200, 1]));
        assert!(set.contains([172, 30, 0, 255]));
        assert!(!set.contains([172, 30, 1, 0]));
        assert!(!set.contains([10, 97, 0, 1]));

        let many: std::vec::Vec<ServiceCidrV4> =
            (0..10u8).map(|i| ServiceCidrV4::new([10, i, 0, 0], 16)).collect();
        let set = ServiceCidrsV4::from_prefixes(&many);
        assert_eq!(set.count as usize, SERVICE_CIDRS_MAX);
        assert_eq!(set.prefixes(), &many[..SERVICE_CIDRS_MAX]);
        assert!(set.contains([10, 7, 1, 1]));
        assert!(!set.contains([10, 8, 1, 1]), "the ninth prefix is not held");
        // A corrupt count reads no further than the array.
        let corrupt = ServiceCidrsV4 { count: 99, ..set };
        assert_eq!(corrupt.prefixes().len(), SERVICE_CIDRS_MAX);
        assert!(!corrupt.contains([10, 9, 0, 1]));
    }

    #[test]
    fn ipv6_prefixes_and_sets_hold_what_they_cover_and_no_more() {
        let v6 = |text: &str| -> [u8; 16] { text.parse::<std::net::Ipv6Addr>().unwrap().octets() };
        let cidr = ServiceCidrV6::new(v6("fd00:10:96::7:9"), 108);
        assert_eq!(cidr.addr_bytes(), v6("fd00:10:96::"), "the address is masked");
        assert_eq!(cidr.prefix_len(), 108);
        assert!(cidr.contains(&v6("fd00:10:96::f:ffff")));
        assert!(!cidr.contains(&v6("fd00:10:96::10:0")));
        assert!(!cidr.contains(&v6("fd00:10:97::1")), "the first half differs");
        assert_eq!(ServiceCidrV6::new(v6("::1"), 200).prefix_len(), 128);
        assert!(ServiceCidrV6::new(v6("fd00::"), 0).contains(&v6("2001:db8::1")));

        assert!(!ServiceCidrsV6::default().contains(&v6("::")), "unused slots are ::/0 and hold nothing");
        let set = ServiceCidrsV6::from_prefixes(&[cidr, ServiceCidrV6::new(v6("2001:db8:96::"), 112)]);
        assert_eq!(set.count, 2);
        assert!(set.contains(&v6("2001:db8:96::5")));
        assert!(!set.contains(&v6("2001:db8:97::5")));
        assert_eq!(set.prefixes().len(), 2);
    }

    #[test]
    fn other_protocols_drop_what_conntrack_calls_new() {
        // Echo, timestamp, information and address-mask requests; a later fragment.
        for icmp_type in [Some(8), Some(13), Some(15), Some(17), None] {
            assert!(drops_other_protocol(1, icmp_type), "{icmp_type:?}");
        }
        // Errors and replies: related or invalid to conntrack.
        for icmp_type in [0, 3, 4, 5, 11, 12, 14] {
            assert!(!drops_other_protocol(1, Some(icmp_type)), "{icmp_type}");
        }
        // SCTP, GRE, ESP, an unassigned protocol.
        for proto in [132, 47, 50, 253] {
            assert!(drops_other_protocol(proto, None) && drops_other_protocol(proto, Some(8)), "{proto}");
        }
    }

    #[test]
    fn ipv6_other_protocols_drop_what_conntrack_calls_new() {
        // Echo request, node information query; a later fragment.
        for icmp6_type in [Some(128), Some(139), None] {
            assert!(drops_other_protocol6(58, icmp6_type), "{icmp6_type:?}");
        }
        // Errors (unreachable, too big, time exceeded, parameter problem), echo reply, MLD, neighbour
        // discovery (router and neighbour solicitation and advertisement, redirect), NI reply.
        for icmp6_type in [1, 2, 3, 4, 129, 130, 131, 132, 133, 134, 135, 136, 137, 140, 143] {
            assert!(!drops_other_protocol6(58, Some(icmp6_type)), "{icmp6_type}");
        }
        // SCTP, GRE, ESP, "no next header"; ICMP's numbers mean nothing in IPv6.
        for proto in [132, 47, 50, 59, 1] {
            assert!(drops_other_protocol6(proto, Some(129)), "{proto}");
        }
    }
}
