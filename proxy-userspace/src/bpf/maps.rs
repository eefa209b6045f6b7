//! The maps, declared once. [`map_table!`] turns the table below into the typed [`Maps`] handles (opened
//! from the pins or taken from a freshly loaded object), the list of pinned maps ([`ALL_MAPS`]), the
//! key and value sizes a reused pin must have ([`expected_layout`]) and the fill level of the maps with
//! a fixed capacity ([`map_usage`]). A new map is one row here.

use std::os::fd::AsFd as _;

use anyhow::{Context as _, Result, anyhow};
use aya::{
    Ebpf,
    maps::{Array, HashMap, IterableMap, LpmTrie, Map, MapData, MapError, PerCpuArray, lpm_trie},
};
use proxy_common::maps::*;
use proxy_common::maps_v6::*;
use proxy_common::service_cidr::{ServiceCidrsV4, ServiceCidrsV6};
use proxy_common::sock_v6::{MAP_SOCK_REVNAT_V6, SockRevNatKeyV6, SockRevNatV6};
use proxy_common::trace::{MAP_EVENTS, MAP_TRACE, TraceConfig};

use super::pins::PinDir;

/// Rows: `field: handle type = map name, aya map kind, (key, value) layout, usage label`.
/// `pinned` lists the maps kproxy pins without a handle here, with their layout (`()` for none to check).
macro_rules! map_table {
    (
        handles {
            $( $(#[$doc:meta])* $field:ident: $ty:ty = $name:ident, $kind:ident, ($key:ty, $value:ty) $(, usage $usage:literal)?; )*
        }
        pinned { $( $pname:ident $(=> ($pkey:ty, $pvalue:ty))?; )* }
    ) => {
        /// Typed handles on the maps, from pins or from a freshly loaded object.
        pub struct Maps {
            $( $(#[$doc])* pub $field: $ty, )*
        }

        /// Every map kproxy pins, by name.
        pub const ALL_MAPS: &[&str] = &[$( $pname, )* $( $name, )*];

        /// Key and value sizes of each map, to refuse reusing a pinned map whose layout this kproxy does
        /// not share. `None` for a map without a fixed layout to check (the event ring).
        pub fn expected_layout(name: &str) -> Option<(u32, u32)> {
            use std::mem::size_of;
            $( if name == $name { return Some((size_of::<$key>() as u32, size_of::<$value>() as u32)); } )*
            $( $( if name == $pname { return Some((size_of::<$pkey>() as u32, size_of::<$pvalue>() as u32)); } )? )*
            None
        }

        impl Maps {
            pub fn from_pins(pins: &PinDir) -> Result<Self> {
                let open = |name: &str| open_pinned(pins, name);
                Ok(Self { $( $field: <$ty>::try_from(Map::$kind(open($name)?))?, )* })
            }

            /// Takes the maps out of an object from [`load_unpinned`](super::load_unpinned).
            pub fn from_ebpf(ebpf: &mut Ebpf) -> Result<Self> {
                let mut take = |name: &str| ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} missing"));
                Ok(Self { $( $field: <$ty>::try_from(take($name)?)?, )* })
            }

            /// Second handles on the same maps ([`second_handle`]), for a part of the agent that keeps its own.
            pub fn try_clone(&self) -> Result<Self> {
                Ok(Self { $( $field: second_handle(&self.$field)?, )* })
            }
        }

        /// `(map, entries, capacity)` for every map with a fixed capacity that the metrics and `kproxy
        /// doctor` report.
        pub fn map_usage(maps: &Maps) -> Vec<(&'static str, u64, u64)> {
            map_usage_where(maps, |_| true)
                .into_iter()
                .map(|(name, entries, capacity)| (name, entries.unwrap_or(0), capacity))
                .collect()
        }

        /// [`map_usage`] with the entries walked only for the maps `count` names (`None` for the rest):
        /// a capacity is one syscall, the entries one per key.
        pub fn map_usage_where(maps: &Maps, count: impl Fn(&str) -> bool) -> Vec<(&'static str, Option<u64>, u64)> {
            fn capacity<K: aya::Pod, V, M: aya::maps::IterableMap<K, V>>(map: &M) -> u64 {
                map.map().info().map_or(0, |info| u64::from(info.max_entries()))
            }
            vec![$( $( (
                $usage,
                count($usage).then(|| maps.$field.keys().count() as u64),
                capacity(&maps.$field),
            ), )? )*]
        }
    };
}

map_table! {
    handles {
        services: HashMap<MapData, ServiceKeyV4, ServiceValueV4> = MAP_SERVICES_V4, HashMap, (ServiceKeyV4, ServiceValueV4), usage "services_v4";
        backends: HashMap<MapData, u32, BackendV4> = MAP_BACKENDS_V4, HashMap, (u32, BackendV4), usage "backends_v4";
        rev_nat: HashMap<MapData, RevNatId, RevNatV4> = MAP_REV_NAT_V4, HashMap, (RevNatId, RevNatV4), usage "rev_nat_v4";
        names: HashMap<MapData, RevNatId, FrontendNameV4> = MAP_FRONTEND_NAMES_V4, HashMap, (RevNatId, FrontendNameV4);
        conntrack: HashMap<MapData, CtKeyV4, CtEntryV4> = MAP_CONNTRACK_V4, LruHashMap, (CtKeyV4, CtEntryV4), usage "conntrack_v4";
        stats: PerCpuArray<MapData, u64> = MAP_STATS, PerCpuArray, (u32, u64);
        config: Array<MapData, ConfigV4> = MAP_CONFIG, Array, (u32, ConfigV4);
        affinity: HashMap<MapData, AffinityKeyV4, AffinityValueV4> = MAP_AFFINITY_V4, LruHashMap, (AffinityKeyV4, AffinityValueV4), usage "affinity_v4";
        vips: HashMap<MapData, [u8; 4], VipV4> = MAP_VIPS_V4, HashMap, ([u8; 4], VipV4), usage "vips_v4";
        snat: HashMap<MapData, CtKeyV4, SnatEntryV4> = MAP_SNAT_V4, LruHashMap, (CtKeyV4, SnatEntryV4);
        source_ranges: LpmTrie<MapData, SourceRangeV4, u8> = MAP_SOURCE_RANGES_V4, LpmTrie, (lpm_trie::Key<SourceRangeV4>, u8);
        external_ifaces: HashMap<MapData, u32, ExternalIfaceV4> = MAP_EXTERNAL_IFACES, HashMap, (u32, ExternalIfaceV4);
        nodeport_config: Array<MapData, NodePortConfigV4> = MAP_NODEPORT_CONFIG, Array, (u32, NodePortConfigV4);
        sock_revnat: HashMap<MapData, SockRevNatKeyV4, SockRevNatV4> = MAP_SOCK_REVNAT_V4, LruHashMap, (SockRevNatKeyV4, SockRevNatV4);
        socket_lb_config: Array<MapData, SocketLbConfigV4> = MAP_SOCKET_LB_CONFIG, Array, (u32, SocketLbConfigV4);
        maglev: Array<MapData, u32> = MAP_MAGLEV_V4, Array, (u32, u32);
        /// Flows netfilter translated before kproxy attached (`agent::inherited` keeps it).
        inherited: HashMap<MapData, CtKeyV4, InheritedFlowV4> = MAP_INHERITED_V4, HashMap, (CtKeyV4, InheritedFlowV4), usage "inherited_v4";
        /// The service CIDRs (`bpf::service_cidrs` reads and writes them).
        service_cidrs: Array<MapData, ServiceCidrsV4> = MAP_SERVICE_CIDRS_V4, Array, (u32, ServiceCidrsV4);
        /// IPv6 (issue 19): the maps parallel to the IPv4 ones, ids shared with them.
        services_v6: HashMap<MapData, ServiceKeyV6, ServiceValueV6> = MAP_SERVICES_V6, HashMap, (ServiceKeyV6, ServiceValueV6), usage "services_v6";
        backends_v6: HashMap<MapData, u32, BackendV6> = MAP_BACKENDS_V6, HashMap, (u32, BackendV6), usage "backends_v6";
        rev_nat_v6: HashMap<MapData, RevNatId, RevNatV6> = MAP_REV_NAT_V6, HashMap, (RevNatId, RevNatV6), usage "rev_nat_v6";
        conntrack_v6: HashMap<MapData, CtKeyV6, CtEntryV6> = MAP_CONNTRACK_V6, LruHashMap, (CtKeyV6, CtEntryV6), usage "conntrack_v6";
        vips_v6: HashMap<MapData, [u8; 16], VipV6> = MAP_VIPS_V6, HashMap, ([u8; 16], VipV6), usage "vips_v6";
        affinity_v6: HashMap<MapData, AffinityKeyV6, AffinityValueV4> = MAP_AFFINITY_V6, LruHashMap, (AffinityKeyV6, AffinityValueV4), usage "affinity_v6";
        /// Remapped source ports of IPv6 flows (port-reuse clashes), as `snat` for IPv4.
        snat_v6: HashMap<MapData, CtKeyV6, SnatEntryV6> = MAP_SNAT_V6, LruHashMap, (CtKeyV6, SnatEntryV6);
        /// The IPv6 address each external interface source-NATs to, as `external_ifaces`.
        external_ifaces_v6: HashMap<MapData, u32, ExternalIfaceV6> = MAP_EXTERNAL_IFACES_V6, HashMap, (u32, ExternalIfaceV6);
        /// IPv6's cluster CIDR (`nodeport_config` holds the rest of the north–south settings).
        nodeport_config_v6: Array<MapData, NodePortConfigV6> = MAP_NODEPORT_CONFIG_V6, Array, (u32, NodePortConfigV6);
        /// The IPv6 service CIDRs, as `service_cidrs`.
        service_cidrs_v6: Array<MapData, ServiceCidrsV6> = MAP_SERVICE_CIDRS_V6, Array, (u32, ServiceCidrsV6);
        /// loadBalancerSourceRanges of IPv6 frontends, as `source_ranges`.
        source_ranges_v6: LpmTrie<MapData, SourceRangeV6, u8> = MAP_SOURCE_RANGES_V6, LpmTrie, (lpm_trie::Key<SourceRangeV6>, u8);
        /// IPv6 sockets the hooks connected to a native IPv6 backend, as `sock_revnat` (the agent
        /// destroys the UDP ones whose backend leaves).
        sock_revnat_v6: HashMap<MapData, SockRevNatKeyV6, SockRevNatV6> = MAP_SOCK_REVNAT_V6, LruHashMap, (SockRevNatKeyV6, SockRevNatV6);
    }
    pinned {
        MAP_EVENTS;
        MAP_TRACE => (u32, TraceConfig);
        MAP_FRAGMENTS_V4 => (FragmentKeyV4, FragmentPortsV4);
        MAP_FRAGMENTS_V6 => (FragmentKeyV6, FragmentPortsV4);
    }
}

/// Removes `key` from `map`: `Ok(false)` when it is not there (the datapath or the LRU deleted it
/// first; the kernel answers ENOENT).
pub fn remove_present<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
) -> Result<bool, MapError> {
    match map.remove(key) {
        Ok(()) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

pub(super) fn open_pinned(pins: &PinDir, name: &str) -> Result<MapData> {
    let path = pins.map(name);
    MapData::from_pin(&path)
        .with_context(|| format!("opening {} (is kproxy loaded? run `kproxy load`)", path.display()))
}

/// A handle on `INHERITED_V4`.
pub type InheritedMap = HashMap<MapData, CtKeyV4, InheritedFlowV4>;

/// A second handle on the kernel map behind `map`: its descriptor duplicated, the pin not read again (a
/// handle opened once at start stays on the map it opened).
pub fn second_handle<K: aya::Pod, V, M>(map: &M) -> Result<M>
where
    M: IterableMap<K, V> + TryFrom<Map, Error = MapError>,
{
    let fd = map.map().fd().as_fd().try_clone_to_owned().context("duplicating a map descriptor")?;
    Ok(M::try_from(Map::from_map_data(MapData::from_fd(fd)?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_map_is_listed_once_with_a_layout_but_the_event_ring() {
        let mut names = ALL_MAPS.to_vec();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL_MAPS.len());
        let without_layout: Vec<_> = ALL_MAPS.iter().filter(|m| expected_layout(m).is_none()).collect();
        assert_eq!(without_layout, [&MAP_EVENTS]);
        assert_eq!(expected_layout(MAP_SOURCE_RANGES_V4), Some((4 + size_of::<SourceRangeV4>() as u32, 1)));
        assert_eq!(expected_layout(MAP_SOURCE_RANGES_V6), Some((4 + size_of::<SourceRangeV6>() as u32, 1)));
    }
}
