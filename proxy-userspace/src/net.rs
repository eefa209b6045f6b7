//! Network vocabulary every module may use: a transport [`Protocol`] and an IPv4 prefix ([`Cidr4`]).
//! A leaf: it imports nothing of the crate.

use std::fmt;
use std::net::Ipv4Addr;

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
