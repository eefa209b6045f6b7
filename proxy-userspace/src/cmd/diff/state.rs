//! The service maps' contents, read once into plain values.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::Result;
use proxy_common::maps::{
    BackendV4, FrontendNameV4, RevNatId, RevNatV4, SVC_FLAG_MAGLEV, ServiceKeyV4, ServiceValueV4,
};
use proxy_common::maps_v6::{BackendV6, RevNatV6, ServiceKeyV6};

use crate::{
    bpf::{Maps, read_entries, read_source_ranges, read_source_ranges6},
    model::BackendAddr,
    net::Cidr,
};

/// A services map key of either family (SERVICES_V4 or SERVICES_V6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotKey {
    pub vip: IpAddr,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
}

/// A backends map entry of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendEntry {
    pub addr: BackendAddr,
    pub proto: u8,
    pub flags: u8,
}

/// A rev-NAT entry of either family: the frontend a translated flow belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevNatEntry {
    pub vip: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl From<ServiceKeyV4> for SlotKey {
    fn from(k: ServiceKeyV4) -> Self {
        let vip = Ipv4Addr::from(k.vip).into();
        Self { vip, port: u16::from_be_bytes(k.port), proto: k.proto, scope: k.scope, slot: k.slot }
    }
}

impl From<ServiceKeyV6> for SlotKey {
    fn from(k: ServiceKeyV6) -> Self {
        let vip = Ipv6Addr::from(k.vip).into();
        Self { vip, port: u16::from_be_bytes(k.port), proto: k.proto, scope: k.scope, slot: k.slot }
    }
}

impl From<BackendV4> for BackendEntry {
    fn from(b: BackendV4) -> Self {
        let addr = BackendAddr { addr: Ipv4Addr::from(b.addr).into(), port: u16::from_be_bytes(b.port) };
        Self { addr, proto: b.proto, flags: b.flags }
    }
}

impl From<BackendV6> for BackendEntry {
    fn from(b: BackendV6) -> Self {
        let addr = BackendAddr { addr: Ipv6Addr::from(b.addr).into(), port: u16::from_be_bytes(b.port) };
        Self { addr, proto: b.proto, flags: b.flags }
    }
}

impl From<RevNatV4> for RevNatEntry {
    fn from(r: RevNatV4) -> Self {
        Self { vip: Ipv4Addr::from(r.vip).into(), port: u16::from_be_bytes(r.port), proto: r.proto }
    }
}

impl From<RevNatV6> for RevNatEntry {
    fn from(r: RevNatV6) -> Self {
        Self { vip: Ipv6Addr::from(r.vip).into(), port: u16::from_be_bytes(r.port), proto: r.proto }
    }
}

/// The service maps' contents, as plain values, both families together (ids are shared between them).
#[derive(Clone, Debug, Default)]
pub struct MapState {
    pub services: Vec<(SlotKey, ServiceValueV4)>,
    pub backends: BTreeMap<u32, BackendEntry>,
    pub rev_nat: BTreeMap<RevNatId, RevNatEntry>,
    pub names: BTreeMap<RevNatId, String>,
    /// VIP → the number of frontends VIPS_V4 or VIPS_V6 counts on it.
    pub vips: BTreeMap<IpAddr, u32>,
    /// rev-NAT id → its source ranges.
    pub source_ranges: BTreeMap<RevNatId, BTreeSet<Cidr>>,
    /// Maglev table number → its entries (backend ids), for the tables slot 0s name.
    pub maglev: BTreeMap<u32, Vec<u32>>,
    /// NODEPORT_CONFIG's Maglev seed (every table is built with it).
    pub maglev_seed: u32,
    /// What SERVICE_CIDRS_V4 and SERVICE_CIDRS_V6 hold.
    pub service_cidrs: Vec<Cidr>,
}

impl MapState {
    pub fn read(maps: &Maps) -> Result<Self> {
        let services4 = read_entries(&maps.services, "services")?.into_iter().map(|(k, v)| (k.into(), v));
        let services6 =
            read_entries(&maps.services_v6, "IPv6 services")?.into_iter().map(|(k, v)| (k.into(), v));
        let backends4 = read_entries(&maps.backends, "backends")?.into_iter().map(|(id, b)| (id, b.into()));
        let backends6 =
            read_entries(&maps.backends_v6, "IPv6 backends")?.into_iter().map(|(id, b)| (id, b.into()));
        let rev_nat4 = read_entries(&maps.rev_nat, "rev_nat")?.into_iter().map(|(id, r)| (id, r.into()));
        let rev_nat6 =
            read_entries(&maps.rev_nat_v6, "IPv6 rev_nat")?.into_iter().map(|(id, r)| (id, r.into()));
        let vips4 =
            read_entries(&maps.vips, "VIPs")?.into_iter().map(|(vip, v)| (IpAddr::from(vip), v.frontends));
        let vips6 = read_entries(&maps.vips_v6, "IPv6 VIPs")?
            .into_iter()
            .map(|(vip, v)| (IpAddr::from(vip), v.frontends));
        Ok(Self {
            services: services4.chain(services6).collect(),
            backends: backends4.chain(backends6).collect(),
            rev_nat: rev_nat4.chain(rev_nat6).collect(),
            names: read_entries(&maps.names, "names")?
                .into_iter()
                .map(|(id, n): (RevNatId, FrontendNameV4)| (id, n.as_str().to_owned()))
                .collect(),
            vips: vips4.chain(vips6).collect(),
            source_ranges: BTreeMap::new(),
            maglev: BTreeMap::new(),
            maglev_seed: maps.nodeport_config.get(&0, 0).map(|c| c.maglev_seed).unwrap_or(0),
            service_cidrs: crate::bpf::service_cidrs::read_both(maps)?,
        }
        .with_source_ranges(maps)?
        .with_maglev_tables(maps))
    }

    fn with_source_ranges(mut self, maps: &Maps) -> Result<Self> {
        for (rev_nat_id, range) in read_source_ranges(&maps.source_ranges)? {
            self.source_ranges.entry(rev_nat_id).or_default().insert(Cidr::V4(range));
        }
        for (rev_nat_id, range) in read_source_ranges6(&maps.source_ranges_v6)? {
            self.source_ranges.entry(rev_nat_id).or_default().insert(Cidr::V6(range));
        }
        Ok(self)
    }

    /// Reads the tables slot 0s point at (unreadable entries are left out: the diff reports them).
    fn with_maglev_tables(mut self, maps: &Maps) -> Self {
        let size = proxy_common::maglev::MAGLEV_TABLE_SIZE;
        let tables: BTreeSet<u32> = self
            .services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.flags & SVC_FLAG_MAGLEV != 0)
            .filter_map(|(_, v)| v.maglev_table())
            .collect();
        for table in tables {
            let entries: Option<Vec<u32>> =
                (0..size).map(|i| maps.maglev.get(&(table * size + i), 0).ok()).collect();
            if let Some(entries) = entries {
                self.maglev.insert(table, entries);
            }
        }
        self
    }
}
