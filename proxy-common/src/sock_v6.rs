//! Socket-level load balancing for IPv6 sockets (`connect6`, `sendmsg6`, `recvmsg6`,
//! `getpeername6`): the reverse map of sockets translated to an IPv6 backend, the program names, and
//! the address helpers the hooks share with userspace.
//!
//! A dual-stack (AF_INET6) socket reaches an IPv4 cluster IP through its IPv4-mapped address
//! `::ffff:a.b.c.d`; the kernel then sends IPv4 packets, which no IPv6 Service map knows. The hooks
//! send such an address through the IPv4 Service maps and keep its reverse entry in
//! `SOCK_REVNAT_V4`, as for an AF_INET socket; [`SockRevNatKeyV6`] holds native IPv6 backends only.

/// Map name as it appears in the object file and, lower-cased, as a pin name.
pub const MAP_SOCK_REVNAT_V6: &str = "SOCK_REVNAT_V6";
pub const SOCK_REVNAT_V6_CAPACITY: u32 = 262_144;

/// Program names (the function names in proxy-ebpf).
pub const PROG_CONNECT6: &str = "kproxy_connect6";
pub const PROG_SENDMSG6: &str = "kproxy_sendmsg6";
pub const PROG_RECVMSG6: &str = "kproxy_recvmsg6";
pub const PROG_GETPEERNAME6: &str = "kproxy_getpeername6";

/// `(socket cookie, IPv6 backend, port)` → the Service address the socket asked for: what recvmsg and
/// getpeername show instead of the backend, as [`crate::maps::SockRevNatKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNatKeyV6 {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub _pad: [u8; 6],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SockRevNatV6 {
    pub vip: [u8; 16],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
    pub rev_nat_id: crate::maps::RevNatId,
}

/// The third 32-bit word of an IPv4-mapped address (`::ffff:0:0/96`), as it sits in memory.
const MAPPED_PREFIX_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// The IPv4 address inside an IPv4-mapped IPv6 address, given as the four 32-bit words the kernel's
/// `bpf_sock_addr.user_ip6` holds (network byte order in memory); `None` for any other address.
pub const fn ipv4_of_mapped(words: [u32; 4]) -> Option<[u8; 4]> {
    if words[0] == 0 && words[1] == 0 && words[2] == MAPPED_PREFIX_WORD {
        Some(words[3].to_ne_bytes())
    } else {
        None
    }
}

/// The address as 16 bytes, from `user_ip6`'s words.
pub const fn bytes_of_words(words: [u32; 4]) -> [u8; 16] {
    let [a, b, c, d] =
        [words[0].to_ne_bytes(), words[1].to_ne_bytes(), words[2].to_ne_bytes(), words[3].to_ne_bytes()];
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3]]
}

/// The address as `user_ip6`'s words (the kernel allows only 32-bit writes there).
pub const fn words_of_bytes(addr: [u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

/// Four bytes standing for an IPv6 address in [`crate::maglev::flow_hash`], which hashes IPv4
/// tuples: its words folded together. Only for spreading sockets over backends (a UDP socket keeps
/// the backend its cookie and the Service give it), never for a table that must agree between nodes.
pub const fn fold(words: [u32; 4]) -> [u8; 4] {
    (words[0] ^ words[1] ^ words[2] ^ words[3]).to_ne_bytes()
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: repr(C), integers and byte arrays with explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for SockRevNatKeyV6 {}
    unsafe impl aya::Pod for SockRevNatV6 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn words(addr: Ipv6Addr) -> [u32; 4] {
        words_of_bytes(addr.octets())
    }

    #[test]
    fn layouts_have_no_implicit_holes() {
        assert_eq!(size_of::<SockRevNatKeyV6>(), 8 + 16 + 2 + 6);
        assert_eq!(size_of::<SockRevNatV6>(), 16 + 2 + 2 + 4);
    }

    #[test]
    fn an_ipv4_mapped_address_names_its_ipv4_address() {
        let mapped = Ipv4Addr::new(10, 96, 0, 10).to_ipv6_mapped();
        assert_eq!(ipv4_of_mapped(words(mapped)), Some([10, 96, 0, 10]));
        // The words the kernel hands over: the bytes of the address in memory.
        assert_eq!(bytes_of_words(words(mapped)), mapped.octets());
    }

    #[test]
    fn other_addresses_are_not_mapped() {
        for addr in [
            "fd00:10:96::a",
            "::a60:a",        // IPv4-compatible (deprecated), not mapped
            "::ffff:0:a60:a", // SIIT's IPv4-translated ::ffff:0:0:0/96
            "64:ff9b::a60:a", // NAT64
            "::1",
            "::",
            "ffff::ffff:a60:a", // the prefix word in the wrong place
        ] {
            let addr: Ipv6Addr = addr.parse().unwrap();
            assert_eq!(ipv4_of_mapped(words(addr)), None, "{addr}");
        }
    }

    #[test]
    fn words_and_bytes_round_trip() {
        let addr: Ipv6Addr = "fd00:10:244::1f".parse().unwrap();
        assert_eq!(bytes_of_words(words_of_bytes(addr.octets())), addr.octets());
    }

    #[test]
    fn the_fold_tells_service_addresses_apart() {
        let a: Ipv6Addr = "fd00:10:96::53".parse().unwrap();
        let b: Ipv6Addr = "fd00:10:96::200".parse().unwrap();
        assert_ne!(fold(words(a)), fold(words(b)));
        assert_eq!(fold(words(a)), fold(words(a)));
    }
}
