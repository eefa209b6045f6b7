//! The IPv6 maps, parallel to the IPv4 ones in [`crate::maps`] (as Cilium keeps `lb6_*` beside `lb4_*`):
//! the same slot scheme, conntrack states, flags and timeouts, with 16-byte addresses.
//!
//! Ids are shared between the families: the syncer hands out one rev-NAT id space and one backend id
//! space, so a `rev_nat_id` or `backend_id` names one frontend or backend whatever its family, and
//! maps keyed by id alone (`FRONTEND_NAMES_V4`, the stats) serve both. The values that name no address
//! are the IPv4 types themselves ([`ServiceValueV4`], [`VipV4`]).
use crate::maps::{CT_DIR_REPLY, ServiceValueV4, VipV4};

pub const MAP_SERVICES_V6: &str = "SERVICES_V6";
pub const MAP_BACKENDS_V6: &str = "BACKENDS_V6";
pub const MAP_REV_NAT_V6: &str = "REV_NAT_V6";
pub const MAP_CONNTRACK_V6: &str = "CONNTRACK_V6";
pub const MAP_VIPS_V6: &str = "VIPS_V6";
pub const MAP_FRAGMENTS_V6: &str = "FRAGMENTS_V6";
pub const MAP_AFFINITY_V6: &str = "AFFINITY_V6";
pub const MAP_SNAT_V6: &str = "SNAT_V6";
pub const MAP_EXTERNAL_IFACES_V6: &str = "EXTERNAL_IFACES_V6";
pub const MAP_SOURCE_RANGES_V6: &str = "SOURCE_RANGES_V6";
pub const MAP_SERVICE_CIDRS_V6: &str = "SERVICE_CIDRS_V6";
pub const MAP_NODEPORT_CONFIG_V6: &str = "NODEPORT_CONFIG_V6";

pub const SERVICES_V6_CAPACITY: u32 = 65_536;
pub const BACKENDS_V6_CAPACITY: u32 = 65_536;
pub const REV_NAT_V6_CAPACITY: u32 = 65_536;
pub const CONNTRACK_V6_CAPACITY: u32 = 262_144;
pub const VIPS_V6_CAPACITY: u32 = 65_536;
pub const FRAGMENTS_V6_CAPACITY: u32 = 8_192;
pub const AFFINITY_V6_CAPACITY: u32 = 65_536;
/// One forward and one reverse entry per remapped flow, as SNAT_V4 beside CONNTRACK_V4.
pub const SNAT_V6_CAPACITY: u32 = CONNTRACK_V6_CAPACITY;
pub const EXTERNAL_IFACES_V6_CAPACITY: u32 = crate::maps::EXTERNAL_IFACES_CAPACITY;
pub const SOURCE_RANGES_V6_CAPACITY: u32 = crate::maps::SOURCE_RANGES_V4_CAPACITY;

/// The source of a pod's packets to itself through its IPv6 Service (hairpin), as
/// [`crate::maps::DEFAULT_HAIRPIN_ADDR`] for IPv4: `100::42:1`, in RFC 6666's discard-only prefix
/// `100::/64`, which no host holds and routers drop, so it names nobody else. The pod's reply to it
/// takes its default route to the node's veth, where the ingress program turns it back.
pub const HAIRPIN_ADDR_V6: [u8; 16] = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42, 0, 1];

/// `(vip, port, proto, scope, slot)`, as [`crate::maps::ServiceKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceKeyV6 {
    pub vip: [u8; 16],
    pub port: [u8; 2],
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: [u8; 2],
}

impl ServiceKeyV6 {
    pub const fn new(vip: [u8; 16], port: [u8; 2], proto: u8, scope: u8, slot: u16) -> Self {
        Self { vip, port, proto, scope, slot, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }
}

/// A SERVICES_V6 value: the IPv4 one, which names no address.
pub type ServiceValueV6 = ServiceValueV4;
/// A VIPS_V6 value: how many frontends the VIP has.
pub type VipV6 = VipV4;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BackendV6 {
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub proto: u8,
    pub flags: u8,
}

/// `rev_nat_id` → the IPv6 frontend a translated flow belongs to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNatV6 {
    pub vip: [u8; 16],
    pub port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKeyV6 {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub direction: u8,
    pub _pad: [u8; 2],
}

impl CtKeyV6 {
    /// The key under which the reply to a flow DNATed to `backend` is found.
    pub const fn reply_of(&self, backend_addr: [u8; 16], backend_port: [u8; 2]) -> Self {
        Self {
            saddr: backend_addr,
            daddr: self.saddr,
            sport: backend_port,
            dport: self.sport,
            proto: self.proto,
            direction: CT_DIR_REPLY,
            _pad: [0; 2],
        }
    }
}

/// One direction of a translated IPv6 flow, as [`crate::maps::CtEntryV4`]: the forward entry holds the
/// backend, the reply entry the VIP.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtEntryV6 {
    pub created_ns: u64,
    pub last_seen_ns: u64,
    pub packets: u64,
    pub bytes: u64,
    pub backend_id: u32,
    /// Forward: backend address; reply: VIP.
    pub nat_addr: [u8; 16],
    /// Forward: backend port; reply: VIP port.
    pub nat_port: [u8; 2],
    pub state: u8,
    pub flags: u8,
    pub rev_nat_id: crate::maps::RevNatId,
    /// Union of the TCP flags seen in this direction.
    pub tcp_flags_seen: u8,
    /// Up to the struct's 8-byte alignment, as a field: an implicit hole would be bytes the kernel and
    /// userspace need not agree on.
    pub _pad: [u8; 3],
}

/// A fragmented IPv6 datagram, as [`crate::maps::FragmentKeyV4`]: RFC 8200's reassembly key (source,
/// destination, the fragment header's identification) and the protocol the fragment header names.
/// FRAGMENTS_V6 maps it to the datagram's ports ([`crate::maps::FragmentPortsV4`]), from its first
/// fragment.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragmentKeyV6 {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub id: [u8; 4],
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// sessionAffinity: ClientIP for IPv6 clients, as [`crate::maps::AffinityKeyV4`]: `(client, the
/// affinity id of the Service port)` → the backend it sticks to ([`crate::maps::AffinityValueV4`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityKeyV6 {
    pub client: [u8; 16],
    pub rev_nat_id: crate::maps::RevNatId,
}

/// A SOURCE_RANGES_V6 key, as [`crate::maps::SourceRangeV4`]: the frontend's rev-NAT id (big-endian,
/// [`crate::maps::SOURCE_RANGE_ID_BITS`] of the prefix) then the client address, so that one
/// longest-prefix lookup of `(rev_nat_id, client)` at `32 + 128` bits finds a range of that frontend
/// holding the client.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SourceRangeV6 {
    pub rev_nat_id: [u8; 4],
    pub addr: [u8; 16],
}

impl SourceRangeV6 {
    pub const fn new(rev_nat_id: crate::maps::RevNatId, addr: [u8; 16]) -> Self {
        Self { rev_nat_id: rev_nat_id.to_be_bytes(), addr }
    }
}

/// An external interface's IPv6 address, as [`crate::maps::ExternalIfaceV4`]: EXTERNAL_IFACES_V6 maps
/// the interface's index to the address an IPv6 flow source-NATed out of it takes (its first global
/// address).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ExternalIfaceV6 {
    pub addr: [u8; 16],
}

/// One direction of an IPv6 flow whose client tuple was rewritten, as [`crate::maps::SnatEntryV4`]:
/// SNAT_V6 maps the flow's own forward key (pre-DNAT) to the address and port the client became,
/// and the reply key (`backend → client or node address:port`) to the client's own address and
/// port. A remapped flow ([`crate::maps::CT_FLAG_REMAP`], a port-reuse clash) keeps the client's
/// address; a source-NATed one ([`crate::maps::CT_FLAG_SNAT`], north–south to a remote backend)
/// becomes the node's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SnatEntryV6 {
    pub created_ns: u64,
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub _pad: [u8; 6],
}

/// The one entry of NODEPORT_CONFIG_V6: IPv6's north–south settings beside NODEPORT_CONFIG's (whose
/// SNAT port range and Maglev seed serve both families).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodePortConfigV6 {
    /// `--cluster-cidr`'s IPv6 prefix: clients outside it reaching a cluster IP through an external
    /// interface are masqueraded, as IPv4's.
    pub cluster_cidr: crate::service_cidr::ServiceCidrV6,
    /// 1 when `cluster_cidr` holds a prefix (its zero value is `::/0`, which holds every address):
    /// with none known, no client is taken for an outside one, as IPv4's.
    pub has_cluster_cidr: u32,
    pub _pad: u32,
}

impl NodePortConfigV6 {
    pub fn new(cluster_cidr: Option<([u8; 16], u8)>) -> Self {
        match cluster_cidr {
            Some((addr, prefix_len)) => Self {
                cluster_cidr: crate::service_cidr::ServiceCidrV6::new(addr, prefix_len),
                has_cluster_cidr: 1,
                _pad: 0,
            },
            None => Self::default(),
        }
    }

    /// Whether `addr` is inside `--cluster-cidr`'s IPv6 prefix.
    #[inline(always)]
    pub fn in_cluster_cidr(&self, addr: &[u8; 16]) -> bool {
        self.has_cluster_cidr != 0 && self.cluster_cidr.contains(addr)
    }

    /// Whether `addr` is known to be outside `--cluster-cidr`'s IPv6 prefix (none known: no address
    /// is), so that its flows to a cluster IP are masqueraded.
    #[inline(always)]
    pub fn outside_cluster_cidr(&self, addr: &[u8; 16]) -> bool {
        self.has_cluster_cidr != 0 && !self.cluster_cidr.contains(addr)
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: repr(C), integers and byte arrays with explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for ServiceKeyV6 {}
    unsafe impl aya::Pod for BackendV6 {}
    unsafe impl aya::Pod for RevNatV6 {}
    unsafe impl aya::Pod for CtKeyV6 {}
    unsafe impl aya::Pod for CtEntryV6 {}
    unsafe impl aya::Pod for FragmentKeyV6 {}
    unsafe impl aya::Pod for AffinityKeyV6 {}
    unsafe impl aya::Pod for SnatEntryV6 {}
    unsafe impl aya::Pod for ExternalIfaceV6 {}
    unsafe impl aya::Pod for SourceRangeV6 {}
    unsafe impl aya::Pod for NodePortConfigV6 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_holes() {
        assert_eq!(size_of::<ServiceKeyV6>(), 16 + 2 + 1 + 1 + 2 + 2);
        assert_eq!(size_of::<BackendV6>(), 16 + 2 + 1 + 1);
        assert_eq!(size_of::<RevNatV6>(), 16 + 2 + 1 + 1);
        assert_eq!(size_of::<CtKeyV6>(), 16 + 16 + 2 + 2 + 1 + 1 + 2);
        assert_eq!(size_of::<CtEntryV6>(), 4 * 8 + 4 + 16 + 2 + 1 + 1 + 4 + 1 + 3);
        assert_eq!(size_of::<FragmentKeyV6>(), 16 + 16 + 4 + 1 + 3);
        assert_eq!(size_of::<AffinityKeyV6>(), 16 + 4);
        assert_eq!(size_of::<SnatEntryV6>(), 8 + 16 + 2 + 6);
        assert_eq!(size_of::<ExternalIfaceV6>(), 16);
        assert_eq!(size_of::<NodePortConfigV6>(), 32 + 4 + 4);
        assert_eq!(size_of::<SourceRangeV6>(), 4 + 16);
    }

    #[test]
    fn the_reply_key_swaps_the_translated_tuple() {
        let client = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        let vip = [0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a];
        let backend = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
        let forward = CtKeyV6 {
            saddr: client,
            daddr: vip,
            sport: [0x9c, 0x40],
            dport: [0, 53],
            proto: 17,
            ..Default::default()
        };
        let reply = forward.reply_of(backend, [0x14, 0xe9]);
        assert_eq!((reply.saddr, reply.daddr), (backend, client));
        assert_eq!((reply.sport, reply.dport), ([0x14, 0xe9], [0x9c, 0x40]));
        assert_eq!(reply.direction, CT_DIR_REPLY);
    }

    #[test]
    fn the_ipv6_cluster_cidr_holds_its_prefix_and_none_decides_nothing() {
        let v6 = |a: [u16; 8]| {
            let mut out = [0u8; 16];
            for (i, w) in a.iter().enumerate() {
                out[2 * i..2 * i + 2].copy_from_slice(&w.to_be_bytes());
            }
            out
        };
        let config = NodePortConfigV6::new(Some((v6([0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0]), 56)));
        assert!(config.in_cluster_cidr(&v6([0xfd00, 0x10, 0x244, 0x1, 0, 0, 0, 0x11])));
        assert!(config.in_cluster_cidr(&v6([0xfd00, 0x10, 0x244, 0xff, 0xffff, 0, 0, 1])));
        assert!(!config.in_cluster_cidr(&v6([0xfd00, 0x10, 0x244, 0x100, 0, 0, 0, 1])), "past the /56");
        assert!(!config.in_cluster_cidr(&v6([0xfd00, 0x192, 0x168, 0x100, 0, 0, 0, 0x200])));
        assert!(config.outside_cluster_cidr(&v6([0xfd00, 0x192, 0x168, 0x100, 0, 0, 0, 0x200])));
        assert!(!config.outside_cluster_cidr(&v6([0xfd00, 0x10, 0x244, 0x1, 0, 0, 0, 0x11])));
        let none = NodePortConfigV6::new(None);
        assert!(
            !none.in_cluster_cidr(&v6([0xfd00, 0x10, 0x244, 0x1, 0, 0, 0, 0x11])),
            "no prefix: nobody inside"
        );
        assert!(!none.in_cluster_cidr(&[0; 16]));
        assert!(
            !none.outside_cluster_cidr(&v6([0xfd00, 0x192, 0x168, 0x100, 0, 0, 0, 0x200])),
            "nor outside it"
        );
    }
}
