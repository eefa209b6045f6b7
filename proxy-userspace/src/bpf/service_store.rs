//! Where the syncer writes: the [`Store`] trait, and [`BpfStore`] over the service maps. The trait lives
//! here, at the kernel boundary, so that `sync` programs the maps without naming aya's map types; its
//! unit tests use an in-memory store (`sync::mem_store`) instead.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap, IterableMap as _, LpmTrie, MapData, MapError, lpm_trie};
use proxy_common::maps::*;
use proxy_common::maps_v6::{BackendV6, RevNatV6, ServiceKeyV6, SourceRangeV6};

use super::Maps;
use crate::net::{Cidr, Cidr4, Cidr6};

/// The map operations the syncer needs: [`BpfStore`] on the real maps, and a
/// recording in-memory store in the unit tests (the apply order is tested
/// without BPF). Deleting a missing key is not an error.
pub trait Store {
    fn read_services(&self) -> Result<Vec<(ServiceKeyV4, ServiceValueV4)>>;
    fn read_backends(&self) -> Result<Vec<(u32, BackendV4)>>;
    /// Every address with a frontend ([`VipV4`]).
    fn read_vips(&self) -> Result<Vec<([u8; 4], VipV4)>>;
    fn read_name(&self, rev_nat_id: RevNatId) -> Option<String>;
    fn put_service(&mut self, key: ServiceKeyV4, value: ServiceValueV4) -> Result<()>;
    fn del_service(&mut self, key: &ServiceKeyV4) -> Result<()>;
    fn put_backend(&mut self, id: u32, value: BackendV4) -> Result<()>;
    fn del_backend(&mut self, id: u32) -> Result<()>;
    fn put_rev_nat(&mut self, id: RevNatId, value: RevNatV4) -> Result<()>;
    fn del_rev_nat(&mut self, id: RevNatId) -> Result<()>;
    fn put_name(&mut self, id: RevNatId, name: &str) -> Result<()>;
    fn del_name(&mut self, id: RevNatId) -> Result<()>;
    fn put_vip(&mut self, vip: [u8; 4], value: VipV4) -> Result<()>;
    fn del_vip(&mut self, vip: [u8; 4]) -> Result<()>;
    /// Every frontend's loadBalancerSourceRanges, of both families (SOURCE_RANGES_V4 and
    /// SOURCE_RANGES_V6). The defaults are for stores that do not keep them.
    fn read_source_ranges(&self) -> Result<Vec<(RevNatId, Cidr)>> {
        Ok(Vec::new())
    }
    fn put_source_range(&mut self, _rev_nat_id: RevNatId, _range: Cidr) -> Result<()> {
        Ok(())
    }
    fn del_source_range(&mut self, _rev_nat_id: RevNatId, _range: Cidr) -> Result<()> {
        Ok(())
    }
    /// One entry of MAGLEV_V4 (the default is for stores without it).
    fn put_maglev(&mut self, _index: u32, _backend_id: u32) -> Result<()> {
        Ok(())
    }
    /// The IPv6 maps (SERVICES_V6, BACKENDS_V6, REV_NAT_V6, VIPS_V6), keyed by the same ids as IPv4's. A
    /// store without them reads nothing and refuses every write, so an IPv6 frontend is reported, not lost.
    fn read_services6(&self) -> Result<Vec<(ServiceKeyV6, ServiceValueV4)>> {
        Ok(Vec::new())
    }
    fn read_backends6(&self) -> Result<Vec<(u32, BackendV6)>> {
        Ok(Vec::new())
    }
    fn read_vips6(&self) -> Result<Vec<([u8; 16], VipV4)>> {
        Ok(Vec::new())
    }
    fn put_service6(&mut self, _key: ServiceKeyV6, _value: ServiceValueV4) -> Result<()> {
        Err(no_ipv6_maps())
    }
    fn del_service6(&mut self, _key: &ServiceKeyV6) -> Result<()> {
        Ok(())
    }
    fn put_backend6(&mut self, _id: u32, _value: BackendV6) -> Result<()> {
        Err(no_ipv6_maps())
    }
    fn del_backend6(&mut self, _id: u32) -> Result<()> {
        Ok(())
    }
    fn put_rev_nat6(&mut self, _id: RevNatId, _value: RevNatV6) -> Result<()> {
        Err(no_ipv6_maps())
    }
    fn del_rev_nat6(&mut self, _id: RevNatId) -> Result<()> {
        Ok(())
    }
    fn put_vip6(&mut self, _vip: [u8; 16], _value: VipV4) -> Result<()> {
        Err(no_ipv6_maps())
    }
    fn del_vip6(&mut self, _vip: [u8; 16]) -> Result<()> {
        Ok(())
    }
}

fn no_ipv6_maps() -> anyhow::Error {
    anyhow::anyhow!("this store has no IPv6 maps")
}

/// SERVICES_V6, BACKENDS_V6, REV_NAT_V6, VIPS_V6 and SOURCE_RANGES_V6.
pub struct V6Maps {
    services: HashMap<MapData, ServiceKeyV6, ServiceValueV4>,
    backends: HashMap<MapData, u32, BackendV6>,
    rev_nat: HashMap<MapData, RevNatId, RevNatV6>,
    vips: HashMap<MapData, [u8; 16], VipV4>,
    source_ranges: LpmTrie<MapData, SourceRangeV6, u8>,
}

/// The pinned (or freshly loaded) service maps. SOURCE_RANGES_V4 and MAGLEV_V4 are kept only when
/// added ([`BpfStore::with_source_ranges`] …; [`BpfStore::from_maps`] adds the first); VIPS_V4
/// always, as the datapath looks up frontends only on the addresses it holds.
pub struct BpfStore {
    services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
    backends: HashMap<MapData, u32, BackendV4>,
    rev_nat: HashMap<MapData, RevNatId, RevNatV4>,
    names: HashMap<MapData, RevNatId, FrontendNameV4>,
    vips: HashMap<MapData, [u8; 4], VipV4>,
    source_ranges: Option<LpmTrie<MapData, SourceRangeV4, u8>>,
    maglev: Option<Array<MapData, u32>>,
    v6: Option<V6Maps>,
}

impl BpfStore {
    /// SERVICES_V4, BACKENDS_V4, REV_NAT_V4, FRONTEND_NAMES_V4 and VIPS_V4 alone.
    pub fn new(
        services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
        backends: HashMap<MapData, u32, BackendV4>,
        rev_nat: HashMap<MapData, RevNatId, RevNatV4>,
        names: HashMap<MapData, RevNatId, FrontendNameV4>,
        vips: HashMap<MapData, [u8; 4], VipV4>,
    ) -> Self {
        Self { services, backends, rev_nat, names, vips, source_ranges: None, maglev: None, v6: None }
    }

    /// The service maps of `maps` with VIPS_V4, SOURCE_RANGES_V4 and the IPv6 maps, and MAGLEV_V4 when
    /// `maglev`.
    pub fn from_maps(maps: Maps, maglev: bool) -> Self {
        let v6 = V6Maps {
            services: maps.services_v6,
            backends: maps.backends_v6,
            rev_nat: maps.rev_nat_v6,
            vips: maps.vips_v6,
            source_ranges: maps.source_ranges_v6,
        };
        let mut store = Self::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips)
            .with_source_ranges(maps.source_ranges);
        store.v6 = Some(v6);
        if maglev { store.with_maglev(maps.maglev) } else { store }
    }

    /// Also keeps SOURCE_RANGES_V4 (loadBalancerSourceRanges).
    pub fn with_source_ranges(mut self, trie: LpmTrie<MapData, SourceRangeV4, u8>) -> Self {
        self.source_ranges = Some(trie);
        self
    }

    /// Also writes MAGLEV_V4 (`--lb-algorithm=maglev`).
    pub fn with_maglev(mut self, array: Array<MapData, u32>) -> Self {
        self.maglev = Some(array);
        self
    }

    /// The Maglev tables MAGLEV_V4 has room for (0 without it): a pinned map keeps its size.
    pub fn maglev_tables(&self) -> u32 {
        let capacity = self.maglev.as_ref().and_then(|m| m.map().info().ok()).map_or(0, |i| i.max_entries());
        capacity / proxy_common::maglev::MAGLEV_TABLE_SIZE
    }
}

impl Store for BpfStore {
    fn read_services(&self) -> Result<Vec<(ServiceKeyV4, ServiceValueV4)>> {
        self.services.iter().map(|e| e.context("reading the services map")).collect()
    }
    fn read_backends(&self) -> Result<Vec<(u32, BackendV4)>> {
        self.backends.iter().map(|e| e.context("reading the backends map")).collect()
    }
    fn read_vips(&self) -> Result<Vec<([u8; 4], VipV4)>> {
        self.vips.iter().map(|e| e.context("reading the VIPs map")).collect()
    }
    fn read_name(&self, rev_nat_id: RevNatId) -> Option<String> {
        self.names.get(&rev_nat_id, 0).ok().map(|n| n.as_str().to_owned())
    }
    fn put_service(&mut self, key: ServiceKeyV4, value: ServiceValueV4) -> Result<()> {
        self.services.insert(key, value, 0).map_err(map_full)
    }
    fn del_service(&mut self, key: &ServiceKeyV4) -> Result<()> {
        ignore_missing(self.services.remove(key))
    }
    fn put_backend(&mut self, id: u32, value: BackendV4) -> Result<()> {
        self.backends.insert(id, value, 0).map_err(map_full)
    }
    fn del_backend(&mut self, id: u32) -> Result<()> {
        ignore_missing(self.backends.remove(&id))
    }
    fn put_rev_nat(&mut self, id: RevNatId, value: RevNatV4) -> Result<()> {
        self.rev_nat.insert(id, value, 0).map_err(map_full)
    }
    fn del_rev_nat(&mut self, id: RevNatId) -> Result<()> {
        ignore_missing(self.rev_nat.remove(&id))
    }
    fn put_name(&mut self, id: RevNatId, name: &str) -> Result<()> {
        self.names.insert(id, FrontendNameV4::new(name), 0).map_err(map_full)
    }
    fn del_name(&mut self, id: RevNatId) -> Result<()> {
        ignore_missing(self.names.remove(&id))
    }
    fn put_vip(&mut self, vip: [u8; 4], value: VipV4) -> Result<()> {
        self.vips.insert(vip, value, 0).map_err(map_full)
    }
    fn del_vip(&mut self, vip: [u8; 4]) -> Result<()> {
        ignore_missing(self.vips.remove(&vip))
    }
    fn read_source_ranges(&self) -> Result<Vec<(RevNatId, Cidr)>> {
        let mut out = Vec::new();
        if let Some(trie) = &self.source_ranges {
            out.extend(read_source_ranges(trie)?.into_iter().map(|(id, range)| (id, Cidr::V4(range))));
        }
        if let Some(v6) = &self.v6 {
            out.extend(
                read_source_ranges6(&v6.source_ranges)?.into_iter().map(|(id, range)| (id, Cidr::V6(range))),
            );
        }
        Ok(out)
    }
    fn put_source_range(&mut self, rev_nat_id: RevNatId, range: Cidr) -> Result<()> {
        match range {
            Cidr::V4(range) => match &mut self.source_ranges {
                Some(trie) => trie.insert(&source_range_key(rev_nat_id, range), 1, 0).map_err(map_full),
                None => Ok(()),
            },
            Cidr::V6(range) => self
                .v6_mut()?
                .source_ranges
                .insert(&source_range_key6(rev_nat_id, range), 1, 0)
                .map_err(map_full),
        }
    }
    fn del_source_range(&mut self, rev_nat_id: RevNatId, range: Cidr) -> Result<()> {
        match range {
            Cidr::V4(range) => match &mut self.source_ranges {
                Some(trie) => ignore_missing(trie.remove(&source_range_key(rev_nat_id, range))),
                None => Ok(()),
            },
            Cidr::V6(range) => match &mut self.v6 {
                Some(v6) => ignore_missing(v6.source_ranges.remove(&source_range_key6(rev_nat_id, range))),
                None => Ok(()),
            },
        }
    }
    fn put_maglev(&mut self, index: u32, backend_id: u32) -> Result<()> {
        match &mut self.maglev {
            Some(array) => array.set(index, backend_id, 0).context("MAGLEV_V4"),
            None => Ok(()),
        }
    }
    fn read_services6(&self) -> Result<Vec<(ServiceKeyV6, ServiceValueV4)>> {
        let Some(v6) = &self.v6 else { return Ok(Vec::new()) };
        v6.services.iter().map(|e| e.context("reading the IPv6 services map")).collect()
    }
    fn read_backends6(&self) -> Result<Vec<(u32, BackendV6)>> {
        let Some(v6) = &self.v6 else { return Ok(Vec::new()) };
        v6.backends.iter().map(|e| e.context("reading the IPv6 backends map")).collect()
    }
    fn read_vips6(&self) -> Result<Vec<([u8; 16], VipV4)>> {
        let Some(v6) = &self.v6 else { return Ok(Vec::new()) };
        v6.vips.iter().map(|e| e.context("reading the IPv6 VIPs map")).collect()
    }
    fn put_service6(&mut self, key: ServiceKeyV6, value: ServiceValueV4) -> Result<()> {
        self.v6_mut()?.services.insert(key, value, 0).map_err(map_full)
    }
    fn del_service6(&mut self, key: &ServiceKeyV6) -> Result<()> {
        ignore_missing(self.v6_mut()?.services.remove(key))
    }
    fn put_backend6(&mut self, id: u32, value: BackendV6) -> Result<()> {
        self.v6_mut()?.backends.insert(id, value, 0).map_err(map_full)
    }
    fn del_backend6(&mut self, id: u32) -> Result<()> {
        ignore_missing(self.v6_mut()?.backends.remove(&id))
    }
    fn put_rev_nat6(&mut self, id: RevNatId, value: RevNatV6) -> Result<()> {
        self.v6_mut()?.rev_nat.insert(id, value, 0).map_err(map_full)
    }
    fn del_rev_nat6(&mut self, id: RevNatId) -> Result<()> {
        ignore_missing(self.v6_mut()?.rev_nat.remove(&id))
    }
    fn put_vip6(&mut self, vip: [u8; 16], value: VipV4) -> Result<()> {
        self.v6_mut()?.vips.insert(vip, value, 0).map_err(map_full)
    }
    fn del_vip6(&mut self, vip: [u8; 16]) -> Result<()> {
        ignore_missing(self.v6_mut()?.vips.remove(&vip))
    }
}

impl BpfStore {
    fn v6_mut(&mut self) -> Result<&mut V6Maps> {
        self.v6.as_mut().ok_or_else(no_ipv6_maps)
    }
}

/// The SOURCE_RANGES_V4 key of one of a frontend's loadBalancerSourceRanges.
pub fn source_range_key(rev_nat_id: RevNatId, range: Cidr4) -> lpm_trie::Key<SourceRangeV4> {
    lpm_trie::Key::new(
        SOURCE_RANGE_ID_BITS + u32::from(range.prefix_len),
        SourceRangeV4::new(rev_nat_id, range.addr.octets()),
    )
}

/// Every `(rev-NAT id, source range)` SOURCE_RANGES_V4 holds.
pub fn read_source_ranges(trie: &LpmTrie<MapData, SourceRangeV4, u8>) -> Result<Vec<(RevNatId, Cidr4)>> {
    let mut out = Vec::new();
    for key in trie.keys() {
        let key = key.context("reading the source ranges map")?;
        let data = key.data();
        let prefix_len = key.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
        if let Some(range) = Cidr4::new(Ipv4Addr::from(data.addr), prefix_len) {
            out.push((RevNatId::from_be_bytes(data.rev_nat_id), range));
        }
    }
    Ok(out)
}

/// The SOURCE_RANGES_V6 key of one of an IPv6 frontend's loadBalancerSourceRanges.
pub fn source_range_key6(rev_nat_id: RevNatId, range: Cidr6) -> lpm_trie::Key<SourceRangeV6> {
    lpm_trie::Key::new(
        SOURCE_RANGE_ID_BITS + u32::from(range.prefix_len),
        SourceRangeV6::new(rev_nat_id, range.addr.octets()),
    )
}

/// Every `(rev-NAT id, source range)` SOURCE_RANGES_V6 holds.
pub fn read_source_ranges6(trie: &LpmTrie<MapData, SourceRangeV6, u8>) -> Result<Vec<(RevNatId, Cidr6)>> {
    let mut out = Vec::new();
    for key in trie.keys() {
        let key = key.context("reading the IPv6 source ranges map")?;
        let data = key.data();
        let prefix_len = key.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
        if let Some(range) = Cidr6::new(Ipv6Addr::from(data.addr), prefix_len) {
            out.push((RevNatId::from_be_bytes(data.rev_nat_id), range));
        }
    }
    Ok(out)
}

/// Every entry of `map`; entries deleted while iterating are skipped.
pub fn read_entries<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &str,
) -> Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for entry in map.iter() {
        match entry {
            Ok(pair) => out.push(pair),
            Err(MapError::KeyNotFound) => continue,
            Err(e) => return Err(e).with_context(|| format!("reading the {name} map")),
        }
    }
    Ok(out)
}

fn map_full(e: MapError) -> anyhow::Error {
    match &e {
        MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG) => {
            anyhow::anyhow!("the map is full ({e})")
        }
        _ => anyhow::Error::new(e),
    }
}

fn ignore_missing(result: Result<(), MapError>) -> Result<()> {
    match result {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map_err(anyhow::Error::new),
    }
}

/// Entries REV_NAT_V4 was created with: the frontends the datapath can hold (`--bpf-lb-map-max`).
pub fn rev_nat_capacity(maps: &Maps) -> u64 {
    maps.rev_nat.map().info().map_or(0, |info| u64::from(info.max_entries()))
}
