//! The service maps' contents, read once into plain values.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use anyhow::Result;
use proxy_common::maps::{
    BackendV4, FrontendNameV4, RevNatV4, SVC_FLAG_MAGLEV, ServiceKeyV4, ServiceValueV4,
};

use crate::{
    bpf::{Maps, read_entries, read_source_ranges},
    net::Cidr4,
};

/// The service maps' contents, as plain values.
#[derive(Clone, Debug, Default)]
pub struct MapState {
    pub services: Vec<(ServiceKeyV4, ServiceValueV4)>,
    pub backends: BTreeMap<u32, BackendV4>,
    pub rev_nat: BTreeMap<u16, RevNatV4>,
    pub names: BTreeMap<u16, String>,
    /// VIP → the number of frontends VIPS_V4 counts on it.
    pub vips: BTreeMap<Ipv4Addr, u32>,
    /// rev-NAT id → its source ranges.
    pub source_ranges: BTreeMap<u16, BTreeSet<Cidr4>>,
    /// Maglev table number → its entries (backend ids), for the tables slot 0s name.
    pub maglev: BTreeMap<u32, Vec<u32>>,
    /// NODEPORT_CONFIG's Maglev seed (every table is built with it).
    pub maglev_seed: u32,
    /// What SERVICE_CIDRS_V4 holds.
    pub service_cidrs: Vec<Cidr4>,
}

impl MapState {
    pub fn read(maps: &Maps) -> Result<Self> {
        Ok(Self {
            services: read_entries(&maps.services, "services")?,
            backends: read_entries(&maps.backends, "backends")?.into_iter().collect(),
            rev_nat: read_entries(&maps.rev_nat, "rev_nat")?.into_iter().collect(),
            names: read_entries(&maps.names, "names")?
                .into_iter()
                .map(|(id, n): (u16, FrontendNameV4)| (id, n.as_str().to_owned()))
                .collect(),
            vips: read_entries(&maps.vips, "VIPs")?
                .into_iter()
                .map(|(vip, v)| (Ipv4Addr::from(vip), v.frontends))
                .collect(),
            source_ranges: BTreeMap::new(),
            maglev: BTreeMap::new(),
            maglev_seed: maps.nodeport_config.get(&0, 0).map(|c| c.maglev_seed).unwrap_or(0),
            service_cidrs: crate::bpf::service_cidrs::read(&maps.service_cidrs)?,
        }
        .with_source_ranges(maps)?
        .with_maglev_tables(maps))
    }

    fn with_source_ranges(mut self, maps: &Maps) -> Result<Self> {
        for (rev_nat_id, range) in read_source_ranges(&maps.source_ranges)? {
            self.source_ranges.entry(rev_nat_id).or_default().insert(range);
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
