//! Network vocabulary every module may use: a transport [`Protocol`] and an IPv4 prefix ([`Cidr4`]).
//! A leaf: it imports nothing of the crate.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => IPPROTO_TCP,
            Protocol::Udp => IPPROTO_UDP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            IPPROTO_TCP => Some(Protocol::Tcp),
            IPPROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

/// An IPv4 prefix such as `10.0.0.0/8`, with the host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr4 {
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

impl Cidr4 {
    pub fn new(addr: Ipv4Addr, prefix_len: u8) -> Option<Self> {
        if prefix_len > 32 {
            return None;
        }
        let mask = if prefix_len == 0 { 0 } else { u32::MAX << (32 - prefix_len) };
        Some(Cidr4 { addr: Ipv4Addr::from(u32::from(addr) & mask), prefix_len })
    }

    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        let mask = if self.prefix_len == 0 { 0 } else { u32::MAX << (32 - self.prefix_len) };
        u32::from(addr) & mask == u32::from(self.addr)
    }
}

impl std::str::FromStr for Cidr4 {
    type Err = String;

    /// `a.b.c.d/len`, or a bare address (a /32).
    fn from_str(text: &str) -> Result<Self, String> {
        let (addr, len) = match text.split_once('/') {
            Some((addr, len)) => {
                (addr, len.parse::<u8>().map_err(|_| format!("{text:?}: bad prefix length"))?)
            }
            None => (text, 32),
        };
        let addr = addr.trim().parse::<Ipv4Addr>().map_err(|_| format!("{text:?} is not an IPv4 CIDR"))?;
        Cidr4::new(addr, len).ok_or_else(|| format!("{text:?}: prefix length above 32"))
    }
}

impl fmt::Display for Cidr4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// An IPv6 prefix such as `fd00:10::/64`, with the host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr6 {
    pub addr: Ipv6Addr,
    pub prefix_len: u8,
}

impl Cidr6 {
    pub fn new(addr: Ipv6Addr, prefix_len: u8) -> Option<Self> {
        if prefix_len > 128 {
            return None;
        }
        Some(Cidr6 { addr: Ipv6Addr::from(u128::from(addr) & mask6(prefix_len)), prefix_len })
    }

    pub fn contains(&self, addr: Ipv6Addr) -> bool {
        u128::from(addr) & mask6(self.prefix_len) == u128::from(self.addr)
    }
}

fn mask6(prefix_len: u8) -> u128 {
    if prefix_len == 0 { 0 } else { u128::MAX << (128 - u32::from(prefix_len)) }
}

/// A prefix of either family: a Service's `loadBalancerSourceRanges` mix them, and each
/// family's frontends are filtered by the ranges of their own family (kube-proxy's per-family
/// proxiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cidr {
    V4(Cidr4),
    V6(Cidr6),
}

impl Cidr {
    pub fn is_ipv4(&self) -> bool {
        matches!(self, Cidr::V4(_))
    }

    /// Whether `addr` is inside; an address of the other family never is.
    pub fn contains(&self, addr: IpAddr) -> bool {
        match (self, addr) {
            (Cidr::V4(range), IpAddr::V4(addr)) => range.contains(addr),
            (Cidr::V6(range), IpAddr::V6(addr)) => range.contains(addr),
            _ => false,
        }
    }

    /// The prefix holding `addr` alone (a /32 or /128).
    pub fn host(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(addr) => Cidr::V4(Cidr4 { addr, prefix_len: 32 }),
            IpAddr::V6(addr) => Cidr::V6(Cidr6 { addr, prefix_len: 128 }),
        }
    }
}

impl From<Cidr4> for Cidr {
    fn from(range: Cidr4) -> Self {
        Cidr::V4(range)
    }
}

impl From<Cidr6> for Cidr {
    fn from(range: Cidr6) -> Self {
        Cidr::V6(range)
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    /// `address/len` of either family, or a bare address (a /32 or /128).
    fn from_str(text: &str) -> Result<Self, String> {
        let (addr, len) = match text.split_once('/') {
            Some((addr, len)) => {
                (addr, Some(len.parse::<u8>().map_err(|_| format!("{text:?}: bad prefix length"))?))
            }
            None => (text, None),
        };
        match addr.trim().parse::<IpAddr>().map_err(|_| format!("{text:?} is not a CIDR"))? {
            IpAddr::V4(addr) => Cidr4::new(addr, len.unwrap_or(32))
                .map(Cidr::V4)
                .ok_or_else(|| format!("{text:?}: prefix length above 32")),
            IpAddr::V6(addr) => Cidr6::new(addr, len.unwrap_or(128))
                .map(Cidr::V6)
                .ok_or_else(|| format!("{text:?}: prefix length above 128")),
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cidr::V4(range) => range.fmt(f),
            Cidr::V6(range) => write!(f, "{}/{}", range.addr, range.prefix_len),
        }
    }
}

#[cfg(test)]
mod cidr_tests {
    use super::*;

    #[test]
    fn cidrs_of_both_families_parse_clear_host_bits_and_contain() {
        let v6: Cidr = "fd00:10:0:1::5/64".parse().unwrap();
        assert_eq!(v6.to_string(), "fd00:10:0:1::/64");
        assert!(v6.contains("fd00:10:0:1::ffff".parse().unwrap()));
        assert!(!v6.contains("fd00:10:0:2::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()), "another family is never inside");
        let all6: Cidr = "::/0".parse().unwrap();
        assert!(all6.contains("2001:db8::1".parse().unwrap()));
        let v4: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!((v4.to_string(), v4.is_ipv4()), ("10.0.0.0/8".to_owned(), true));
        assert_eq!("2001:db8::7".parse::<Cidr>().unwrap(), Cidr::host("2001:db8::7".parse().unwrap()));
        assert!("fd00::/129".parse::<Cidr>().unwrap_err().contains("above 128"));
        assert!("10.0.0.0/33".parse::<Cidr>().unwrap_err().contains("above 32"));
        assert!("bogus/8".parse::<Cidr>().is_err());
    }
}
