//! Keeps the service maps equal to the desired state, in an order that drops
//! no packet: backends turning active → VIP entry (a new VIP) → new backends →
//! rev-NAT entries → slots 1..N+T → slot 0 (the new counts) → slots above the
//! total → backends turning terminating → removed frontends → VIP counts
//! (a VIP without frontends last) → orphan backends. The datapath never
//! picks a slot above slot 0's count for a new flow, so every intermediate
//! state is one a packet may safely see.
//!
//! Slots `1..=count` hold the backends new connections use; slots
//! `count+1..=count+terminating_count` the serving-and-terminating ones,
//! which keep their flows (their BACKENDS_V4 entry stays, flagged
//! [`BACKEND_FLAG_TERMINATING`]) but get no new ones.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::maps::*;

use crate::model::{BackendAddr, Desired, Frontend, FrontendKind, ServiceName};
use crate::net::{Cidr4, Protocol};

pub mod image;
#[cfg(test)]
pub(crate) mod mem_store;
pub mod service_cidrs;
mod store;
#[cfg(test)]
mod tests;

pub use image::{
    FrontendKey, MaglevSettings, build_maglev_table, desired_backend_flags, frontend_flags, slot_layout,
    source_range_key,
};
pub use store::{BpfStore, Store};

#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    rev_nat_id: u16,
    name: String,
    /// Slots `1..=count`: backends for new connections.
    backend_ids: Vec<u32>,
    /// Slots `count+1..=count+terminating_count`: backends that keep their
    /// flows but get no new ones.
    terminating_ids: Vec<u32>,
    flags: u16,
    affinity_timeout_s: u32,
    /// Sorted.
    source_ranges: Vec<Cidr4>,
    /// The Maglev table this frontend uses, and the backend ids written to it
    /// (empty when not known, e.g. after a restart: rewritten in full).
    maglev_table: Option<u32>,
    maglev_entries: Vec<u32>,
}

impl Programmed {
    fn slot_count(&self) -> usize {
        self.backend_ids.len() + self.terminating_ids.len()
    }

    fn slot_ids(&self) -> impl Iterator<Item = &u32> {
        self.backend_ids.iter().chain(&self.terminating_ids)
    }
}

/// A backend as the mirror knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BackendEntry {
    id: u32,
    flags: u8,
}

/// The service maps' contents as this process last wrote (or read) them.
pub struct Syncer<S: Store = BpfStore> {
    store: S,
    frontends: BTreeMap<FrontendKey, Programmed>,
    backends: BTreeMap<(BackendAddr, Protocol), BackendEntry>,
    /// VIP → frontends on it, as written to VIPS_V4.
    vips: BTreeMap<Ipv4Addr, u32>,
    next_backend_id: u32,
    next_rev_nat_id: u16,
    /// Whether the id counters wrapped around: until then every id at or
    /// above the counter is free, and allocation needs no search.
    backend_ids_wrapped: bool,
    rev_nat_ids_wrapped: bool,
    maglev: Option<MaglevSettings>,
}

/// What one sync changed, and what it could not do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub frontends_added: usize,
    pub frontends_updated: usize,
    pub frontends_removed: usize,
    pub backends_added: usize,
    pub backends_removed: usize,
    /// Backends whose flags changed in place (active ↔ terminating).
    pub backends_updated: usize,
    /// Ids of the backends deleted by this sync, with their protocol: the
    /// agent purges the conntrack entries of the UDP ones.
    pub removed_backends: Vec<(u32, Protocol)>,
    /// The same backends by address, for destroying the sockets connected to
    /// them (socket-level load balancing).
    pub removed_backend_addrs: Vec<(BackendAddr, Protocol)>,
    /// Frontends left as they were because a map refused a write.
    pub errors: Vec<SyncError>,
}

/// A write the maps refused, and what was left as it was. `cause` is the map error with its context;
/// the message is the one the agent logs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    #[error("Service {service} port {port}/{} ({vip}:{vip_port}): not programmed: {cause}", proto.name())]
    FrontendNotProgrammed {
        service: ServiceName,
        port: u16,
        proto: Protocol,
        vip: Ipv4Addr,
        vip_port: u16,
        cause: String,
    },
    #[error("removing {vip}:{port}/{}: {cause}", proto.name())]
    FrontendNotRemoved { vip: Ipv4Addr, port: u16, proto: Protocol, cause: String },
    #[error(
        "Service {service} ({vip}:{port}): all {tables} Maglev tables are in use (--maglev-tables): random selection"
    )]
    MaglevTablesExhausted { service: ServiceName, vip: Ipv4Addr, port: u16, tables: u32 },
    #[error("updating backend {backend}/{}: {cause}", proto.name())]
    BackendNotUpdated { backend: BackendAddr, proto: Protocol, cause: String },
    #[error("removing backend {}:{}: {cause}", backend.addr, backend.port)]
    BackendNotRemoved { backend: BackendAddr, cause: String },
    #[error("VIP {vip}: {cause}")]
    VipNotWritten { vip: Ipv4Addr, cause: String },
    #[error("removing VIP {vip}: {cause}")]
    VipNotRemoved { vip: Ipv4Addr, cause: String },
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.frontends_added + self.frontends_updated + self.frontends_removed > 0
            || self.backends_added + self.backends_removed + self.backends_updated > 0
    }
}

impl Syncer<BpfStore> {
    /// Adopts what the maps already hold (a previous agent's work), so a
    /// restart rewrites nothing that is still wanted. VIPS_V4 is not
    /// maintained unless added with [`Syncer::with_vips`] ([`Syncer::from_maps`]
    /// does).
    pub fn new(
        services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
        backends: HashMap<MapData, u32, BackendV4>,
        rev_nat: HashMap<MapData, u16, RevNatV4>,
        names: HashMap<MapData, u16, FrontendNameV4>,
    ) -> Result<Self> {
        Self::with_store(BpfStore {
            services,
            backends,
            rev_nat,
            names,
            vips: None,
            source_ranges: None,
            maglev: None,
        })
    }

    /// Also keeps VIPS_V4 (VIP → number of frontends) in step.
    pub fn with_vips(mut self, vips: HashMap<MapData, [u8; 4], VipV4>) -> Result<Self> {
        self.store.vips = Some(vips);
        self.reload()?;
        Ok(self)
    }

    /// Also keeps SOURCE_RANGES_V4 (loadBalancerSourceRanges) in step.
    pub fn with_source_ranges(
        mut self,
        trie: aya::maps::LpmTrie<MapData, SourceRangeV4, u8>,
    ) -> Result<Self> {
        self.store.source_ranges = Some(trie);
        self.reload()?;
        Ok(self)
    }

    /// Uses Maglev tables for external frontends (`--lb-algorithm=maglev`).
    pub fn with_maglev(mut self, array: aya::maps::Array<MapData, u32>, settings: MaglevSettings) -> Self {
        self.store.maglev = Some(array);
        self.maglev = Some(settings);
        self
    }

    pub fn from_maps(maps: crate::bpf::Maps) -> Result<Self> {
        Self::from_maps_with(maps, None)
    }

    /// [`Syncer::from_maps`], with Maglev tables for external frontends when `maglev` is set
    /// (as many as `settings.tables`, and as the pinned MAGLEV_V4 holds).
    pub fn from_maps_with(maps: crate::bpf::Maps, maglev: Option<MaglevSettings>) -> Result<Self> {
        let syncer = Self::new(maps.services, maps.backends, maps.rev_nat, maps.names)?
            .with_vips(maps.vips)?
            .with_source_ranges(maps.source_ranges)?;
        let Some(settings) = maglev else { return Ok(syncer) };
        use aya::maps::IterableMap as _;
        let capacity = maps.maglev.map().info().map(|i| i.max_entries()).unwrap_or(0);
        let tables = capacity / proxy_common::maglev::MAGLEV_TABLE_SIZE;
        if tables < settings.tables {
            tracing::warn!(
                pinned = tables,
                wanted = settings.tables,
                "the pinned Maglev map keeps its size; --maglev-tables applies after `kproxy unload`"
            );
        }
        Ok(syncer
            .with_maglev(maps.maglev, MaglevSettings { tables: tables.min(settings.tables), ..settings }))
    }
}

impl<S: Store> Syncer<S> {
    /// Maglev tables in a store that keeps them itself (tests' in-memory store).
    #[cfg(test)]
    pub fn with_maglev_settings(mut self, settings: MaglevSettings) -> Self {
        self.maglev = Some(settings);
        self
    }

    pub fn with_store(store: S) -> Result<Self> {
        let mut syncer = Self {
            store,
            frontends: BTreeMap::new(),
            backends: BTreeMap::new(),
            vips: BTreeMap::new(),
            next_backend_id: 1,
            next_rev_nat_id: 1,
            backend_ids_wrapped: false,
            rev_nat_ids_wrapped: false,
            maglev: None,
        };
        syncer.reload()?;
        Ok(syncer)
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Forgets the mirror and reads the maps again, so the next apply repairs
    /// anything changed behind this process's back (the periodic full resync).
    pub fn reload(&mut self) -> Result<()> {
        let mut backends = BTreeMap::new();
        for (id, b) in self.store.read_backends()? {
            if let Some(proto) = Protocol::from_number(b.proto) {
                let addr = BackendAddr { addr: Ipv4Addr::from(b.addr), port: u16::from_be_bytes(b.port) };
                backends.insert((addr, proto), BackendEntry { id, flags: b.flags });
            }
        }
        let mut slots: BTreeMap<FrontendKey, BTreeMap<u16, ServiceValueV4>> = BTreeMap::new();
        for (key, value) in self.store.read_services()? {
            let Some(proto) = Protocol::from_number(key.proto) else { continue };
            let fk = FrontendKey {
                vip: Ipv4Addr::from(key.vip),
                port: u16::from_be_bytes(key.port),
                proto,
                scope: key.scope,
            };
            slots.entry(fk).or_default().insert(key.slot, value);
        }
        let mut ranges: BTreeMap<u16, Vec<Cidr4>> = BTreeMap::new();
        for (id, range) in self.store.read_source_ranges()? {
            ranges.entry(id).or_default().push(range);
        }
        let mut frontends = BTreeMap::new();
        for (fk, slots) in slots {
            let Some(master) = slots.get(&0) else { continue };
            let ids = |range: std::ops::RangeInclusive<u32>| -> Vec<u32> {
                range
                    .filter_map(|s| u16::try_from(s).ok())
                    .filter_map(|s| slots.get(&s).map(|v| v.backend_id))
                    .collect()
            };
            let count = u32::from(master.count);
            let backend_ids = ids(1..=count);
            let terminating_ids = ids(count + 1..=count + u32::from(master.terminating_count));
            let name = self.store.read_name(master.rev_nat_id).unwrap_or_default();
            let programmed = Programmed {
                rev_nat_id: master.rev_nat_id,
                name,
                backend_ids,
                terminating_ids,
                flags: master.flags,
                affinity_timeout_s: master.affinity_timeout_s,
                source_ranges: {
                    let mut r = ranges.remove(&master.rev_nat_id).unwrap_or_default();
                    r.sort();
                    r
                },
                maglev_table: (master.flags & SVC_FLAG_MAGLEV != 0 && master.backend_id != 0)
                    .then(|| master.backend_id - 1),
                maglev_entries: Vec::new(),
            };
            frontends.insert(fk, programmed);
        }
        self.vips =
            self.store.read_vips()?.into_iter().map(|(vip, v)| (Ipv4Addr::from(vip), v.frontends)).collect();
        let max_backend_id = backends.values().map(|b: &BackendEntry| b.id).max();
        let max_rev_nat_id = frontends.values().map(|f: &Programmed| f.rev_nat_id).max();
        self.next_backend_id = max_backend_id.map_or(1, |m| m.wrapping_add(1).max(1));
        self.next_rev_nat_id = max_rev_nat_id.map_or(1, |m| m.wrapping_add(1).max(1));
        self.backend_ids_wrapped = max_backend_id == Some(u32::MAX);
        self.rev_nat_ids_wrapped = max_rev_nat_id == Some(u16::MAX);
        self.backends = backends;
        self.frontends = frontends;
        Ok(())
    }

    fn allocate_backend_id(&mut self) -> u32 {
        if !self.backend_ids_wrapped && self.next_backend_id != 0 {
            let id = self.next_backend_id;
            self.next_backend_id = id.wrapping_add(1);
            self.backend_ids_wrapped = self.next_backend_id == 0;
            return id;
        }
        let used: BTreeSet<u32> = self.backends.values().map(|b| b.id).collect();
        while self.next_backend_id == 0 || used.contains(&self.next_backend_id) {
            self.next_backend_id = self.next_backend_id.wrapping_add(1);
        }
        let id = self.next_backend_id;
        self.next_backend_id = id.wrapping_add(1);
        id
    }

    fn allocate_rev_nat_id(&mut self) -> Option<u16> {
        if !self.rev_nat_ids_wrapped && self.next_rev_nat_id != 0 {
            let id = self.next_rev_nat_id;
            self.next_rev_nat_id = id.wrapping_add(1);
            self.rev_nat_ids_wrapped = self.next_rev_nat_id == 0;
            return Some(id);
        }
        let used: BTreeSet<u16> = self.frontends.values().map(|f| f.rev_nat_id).collect();
        if used.len() >= usize::from(u16::MAX) {
            return None;
        }
        while self.next_rev_nat_id == 0 || used.contains(&self.next_rev_nat_id) {
            self.next_rev_nat_id = self.next_rev_nat_id.wrapping_add(1);
        }
        let id = self.next_rev_nat_id;
        self.next_rev_nat_id = id.wrapping_add(1);
        Some(id)
    }

    /// Makes the maps hold exactly `desired`. A frontend whose write fails is
    /// reported and left as it was; the others are still applied.
    ///
    /// Order: backends turning active (flag rewritten in place, same id) →
    /// per frontend [VIP entry if the VIP is new → new backends → rev-NAT →
    /// changed slots → slot 0 → slots above the total] → backends turning
    /// terminating → removed frontends → VIP counts (a VIP without frontends
    /// is deleted last) → orphan backends.
    pub fn apply(&mut self, desired: &Desired) -> SyncReport {
        let mut report = SyncReport::default();
        let wanted: BTreeMap<FrontendKey, &Frontend> =
            desired.frontends.iter().map(|f| (FrontendKey::of(f), f)).collect();
        let flags = desired_backend_flags(wanted.values().copied());

        self.update_backend_flags(&flags, BACKEND_FLAG_ACTIVE, &mut report);

        // Only cluster IPs refuse unknown ports: node addresses, external
        // and LB IPs carry other traffic too.
        let mut per_vip: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
        for (fk, frontend) in &wanted {
            if frontend.kind == FrontendKind::ClusterIp {
                *per_vip.entry(fk.vip).or_default() += 1;
            }
        }
        for (fk, frontend) in &wanted {
            let name = format!("{}:{}", frontend.service, frontend.port_name);
            let vip = match per_vip.get(&fk.vip) {
                Some(count) if frontend.kind == FrontendKind::ClusterIp => self.ensure_vip(fk.vip, *count),
                _ => Ok(()),
            };
            let result = vip.and_then(|()| self.apply_frontend(*fk, frontend, name, &flags, &mut report));
            if let Err(e) = result {
                report.errors.push(SyncError::FrontendNotProgrammed {
                    service: frontend.service.clone(),
                    port: frontend.port,
                    proto: fk.proto,
                    vip: fk.vip,
                    vip_port: fk.port,
                    cause: format!("{e:#}"),
                });
            }
        }

        self.update_backend_flags(&flags, BACKEND_FLAG_TERMINATING, &mut report);

        let stale: Vec<FrontendKey> =
            self.frontends.keys().filter(|k| !wanted.contains_key(k)).copied().collect();
        for fk in stale {
            match self.remove_frontend(fk) {
                Ok(()) => report.frontends_removed += 1,
                Err(e) => report.errors.push(SyncError::FrontendNotRemoved {
                    vip: fk.vip,
                    port: fk.port,
                    proto: fk.proto,
                    cause: format!("{e:#}"),
                }),
            }
        }
        self.reconcile_vips(&mut report);
        self.remove_orphan_backends(&mut report);
        report
    }

    /// Rewrites in place the backends that should now carry `target`.
    fn update_backend_flags(
        &mut self,
        flags: &BTreeMap<(BackendAddr, Protocol), u8>,
        target: u8,
        report: &mut SyncReport,
    ) {
        for (key, flag) in flags {
            if *flag != target {
                continue;
            }
            let Some(entry) = self.backends.get(key).copied() else { continue };
            if entry.flags == target {
                continue;
            }
            let value = backend_value(key.0, key.1, target);
            match self.store.put_backend(entry.id, value) {
                Ok(()) => {
                    self.backends.insert(*key, BackendEntry { id: entry.id, flags: target });
                    report.backends_updated += 1;
                }
                Err(e) => report.errors.push(SyncError::BackendNotUpdated {
                    backend: key.0,
                    proto: key.1,
                    cause: format!("{e:#}"),
                }),
            }
        }
    }

    /// Writes the VIP entry before the first frontend on it appears.
    fn ensure_vip(&mut self, vip: Ipv4Addr, frontends: u32) -> Result<()> {
        if self.vips.contains_key(&vip) {
            return Ok(());
        }
        self.store.put_vip(vip.octets(), VipV4 { frontends }).context("VIPs map")?;
        self.vips.insert(vip, frontends);
        Ok(())
    }

    /// Makes VIPS_V4 count the frontends programmed now; deletes VIPs left
    /// without any (after their frontends' slot 0 are gone).
    fn reconcile_vips(&mut self, report: &mut SyncReport) {
        let mut counts: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
        for (fk, programmed) in &self.frontends {
            if programmed.flags & SVC_FLAG_EXTERNAL_ADDR == 0 {
                *counts.entry(fk.vip).or_default() += 1;
            }
        }
        for (vip, count) in &counts {
            if self.vips.get(vip) == Some(count) {
                continue;
            }
            match self.store.put_vip(vip.octets(), VipV4 { frontends: *count }) {
                Ok(()) => {
                    self.vips.insert(*vip, *count);
                }
                Err(e) => report.errors.push(SyncError::VipNotWritten { vip: *vip, cause: format!("{e:#}") }),
            }
        }
        let gone: Vec<Ipv4Addr> = self.vips.keys().filter(|v| !counts.contains_key(v)).copied().collect();
        for vip in gone {
            match self.store.del_vip(vip.octets()) {
                Ok(()) => {
                    self.vips.remove(&vip);
                }
                Err(e) => report.errors.push(SyncError::VipNotRemoved { vip, cause: format!("{e:#}") }),
            }
        }
    }

    fn backend_id(
        &mut self,
        backend: BackendAddr,
        proto: Protocol,
        flag: u8,
        report: &mut SyncReport,
    ) -> Result<u32> {
        if let Some(entry) = self.backends.get(&(backend, proto)) {
            return Ok(entry.id);
        }
        let id = self.allocate_backend_id();
        self.store
            .put_backend(id, backend_value(backend, proto, flag))
            .with_context(|| format!("backend {}:{}", backend.addr, backend.port))?;
        self.backends.insert((backend, proto), BackendEntry { id, flags: flag });
        report.backends_added += 1;
        Ok(id)
    }

    fn apply_frontend(
        &mut self,
        fk: FrontendKey,
        frontend: &Frontend,
        name: String,
        wanted_flags: &BTreeMap<(BackendAddr, Protocol), u8>,
        report: &mut SyncReport,
    ) -> Result<()> {
        let flag_of =
            |b: &BackendAddr| wanted_flags.get(&(*b, fk.proto)).copied().unwrap_or(BACKEND_FLAG_ACTIVE);
        let mut ids = Vec::with_capacity(frontend.backends.len());
        for backend in &frontend.backends {
            ids.push(self.backend_id(*backend, fk.proto, flag_of(backend), report)?);
        }
        let mut terminating_ids = Vec::with_capacity(frontend.terminating_backends.len());
        for backend in &frontend.terminating_backends {
            terminating_ids.push(self.backend_id(*backend, fk.proto, flag_of(backend), report)?);
        }

        let mut flags = frontend_flags(frontend);
        // Maglev where a flow may arrive at any node: the node-independent
        // entries of NodePorts, ExternalIPs and LB IPs.
        let maglev = self.maglev.filter(|_| {
            frontend.kind != FrontendKind::ClusterIp && fk.scope == SCOPE_INTERNAL && !ids.is_empty()
        });
        if maglev.is_some() {
            flags |= SVC_FLAG_MAGLEV;
        }
        let affinity_timeout_s = frontend.session_affinity_timeout.unwrap_or(0);
        let mut source_ranges = frontend.source_ranges.clone();
        source_ranges.sort();
        source_ranges.dedup();
        // The common case at scale is "nothing changed": decide it without
        // copying what is programmed.
        if self.frontends.get(&fk).is_some_and(|p| {
            p.backend_ids == ids
                && p.terminating_ids == terminating_ids
                && p.name == name
                && p.flags == flags
                && p.affinity_timeout_s == affinity_timeout_s
                && p.source_ranges == source_ranges
                && (maglev.is_none() || !p.maglev_entries.is_empty())
        }) {
            return Ok(());
        }
        let previous = self.frontends.get(&fk).cloned();
        let rev_nat_id = match &previous {
            Some(p) => p.rev_nat_id,
            None => self.allocate_rev_nat_id().context("all 65535 rev-NAT ids are in use")?,
        };
        let mut slots = slot_layout(&ids, &terminating_ids, rev_nat_id, flags, affinity_timeout_s)?;
        // The table is written before slot 0 points at it; its entries name
        // backends that exist already (new ones were written above).
        let (maglev_table, maglev_entries) = match maglev {
            Some(settings) => {
                self.write_maglev_table(fk, frontend, &ids, settings, previous.as_ref(), &mut slots, report)?
            }
            None => (None, Vec::new()),
        };
        let flags = slots[0].1.flags;
        self.write_frontend(fk, rev_nat_id, &name, previous.as_ref(), &slots, &source_ranges)?;
        if previous.is_some() {
            report.frontends_updated += 1;
        } else {
            report.frontends_added += 1;
        }
        self.frontends.insert(
            fk,
            Programmed {
                rev_nat_id,
                name,
                backend_ids: ids,
                terminating_ids,
                flags,
                affinity_timeout_s,
                source_ranges,
                maglev_table,
                maglev_entries,
            },
        );
        Ok(())
    }

    /// Writes the frontend's Maglev table (only the entries that changed) before slot 0 points at it;
    /// its entries name backends that exist already. Without a free table the frontend falls back to
    /// random selection, reported. Returns the table and its entries.
    #[allow(clippy::too_many_arguments)]
    fn write_maglev_table(
        &mut self,
        fk: FrontendKey,
        frontend: &Frontend,
        ids: &[u32],
        settings: MaglevSettings,
        previous: Option<&Programmed>,
        slots: &mut [(u16, ServiceValueV4)],
        report: &mut SyncReport,
    ) -> Result<(Option<u32>, Vec<u32>)> {
        let table = previous.and_then(|p| p.maglev_table).or_else(|| self.free_maglev_table(settings.tables));
        match table {
            Some(table) => {
                let pairs: Vec<(BackendAddr, u32)> =
                    frontend.backends.iter().copied().zip(ids.iter().copied()).collect();
                let maglev_entries = build_maglev_table(&pairs, fk.proto, settings.seed)?;
                let old = previous.filter(|p| p.maglev_table == Some(table)).map(|p| &p.maglev_entries);
                let base = table * proxy_common::maglev::MAGLEV_TABLE_SIZE;
                for (i, id) in maglev_entries.iter().enumerate() {
                    if old.and_then(|o| o.get(i)) != Some(id) {
                        self.store.put_maglev(base + i as u32, *id)?;
                    }
                }
                slots[0].1.backend_id = table + 1;
                Ok((Some(table), maglev_entries))
            }
            None => {
                report.errors.push(SyncError::MaglevTablesExhausted {
                    service: frontend.service.clone(),
                    vip: fk.vip,
                    port: fk.port,
                    tables: settings.tables,
                });
                slots[0].1.flags &= !SVC_FLAG_MAGLEV;
                Ok((None, Vec::new()))
            }
        }
    }

    /// Writes a frontend's entries in the order that drops no packet: rev-NAT and name, new source
    /// ranges, slots 1.., slot 0, then the slots and ranges it no longer has.
    fn write_frontend(
        &mut self,
        fk: FrontendKey,
        rev_nat_id: u16,
        name: &str,
        previous: Option<&Programmed>,
        slots: &[(u16, ServiceValueV4)],
        source_ranges: &[Cidr4],
    ) -> Result<()> {
        if previous.is_none() {
            let rev = RevNatV4 {
                vip: fk.vip.octets(),
                port: fk.port.to_be_bytes(),
                proto: fk.proto.number(),
                _pad: 0,
            };
            self.store.put_rev_nat(rev_nat_id, rev).context("rev_nat map")?;
        }
        if previous.is_none_or(|p| p.name != name) {
            self.store.put_name(rev_nat_id, name).context("names map")?;
        }
        // New ranges go in before slot 0 may carry the flag that makes the
        // datapath check them; stale ones leave after it.
        let old_ranges: Vec<Cidr4> = previous.map(|p| p.source_ranges.clone()).unwrap_or_default();
        for range in source_ranges.iter().filter(|r| !old_ranges.contains(r)) {
            self.store.put_source_range(rev_nat_id, *range).context("source ranges map")?;
        }
        let old_ids: Vec<u32> = previous.map(|p| p.slot_ids().copied().collect()).unwrap_or_default();
        for (slot, value) in &slots[1..] {
            if old_ids.get(usize::from(*slot) - 1) == Some(&value.backend_id) {
                continue;
            }
            self.store.put_service(fk.slot(*slot), *value).context("services map (slot)")?;
        }
        self.store.put_service(fk.slot(0), slots[0].1).context("services map (slot 0)")?;
        for slot in slots.len()..=old_ids.len() {
            self.store.del_service(&fk.slot(slot as u16))?;
        }
        for range in old_ranges.iter().filter(|r| !source_ranges.contains(r)) {
            self.store.del_source_range(rev_nat_id, *range)?;
        }
        Ok(())
    }

    /// The lowest Maglev table no frontend uses.
    fn free_maglev_table(&self, tables: u32) -> Option<u32> {
        let used: BTreeSet<u32> = self.frontends.values().filter_map(|p| p.maglev_table).collect();
        (0..tables).find(|t| !used.contains(t))
    }

    fn remove_frontend(&mut self, fk: FrontendKey) -> Result<()> {
        let Some(programmed) = self.frontends.get(&fk).cloned() else { return Ok(()) };
        self.store.del_service(&fk.slot(0))?;
        for slot in 1..=programmed.slot_count() {
            self.store.del_service(&fk.slot(slot as u16))?;
        }
        // Established flows keep their VIP in the conntrack reply entry, so
        // dropping the rev-NAT entry only loses the name in dumps.
        self.store.del_rev_nat(programmed.rev_nat_id)?;
        self.store.del_name(programmed.rev_nat_id)?;
        for range in &programmed.source_ranges {
            self.store.del_source_range(programmed.rev_nat_id, *range)?;
        }
        self.frontends.remove(&fk);
        Ok(())
    }

    fn remove_orphan_backends(&mut self, report: &mut SyncReport) {
        let referenced: BTreeSet<u32> = self.frontends.values().flat_map(|f| f.slot_ids().copied()).collect();
        let orphans: Vec<((BackendAddr, Protocol), u32)> = self
            .backends
            .iter()
            .filter(|(_, b)| !referenced.contains(&b.id))
            .map(|(k, b)| (*k, b.id))
            .collect();
        for (key, id) in orphans {
            match self.store.del_backend(id) {
                Ok(()) => {
                    self.backends.remove(&key);
                    report.backends_removed += 1;
                    report.removed_backends.push((id, key.1));
                    report.removed_backend_addrs.push(key);
                }
                Err(e) => report
                    .errors
                    .push(SyncError::BackendNotRemoved { backend: key.0, cause: format!("{e:#}") }),
            }
        }
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }
}

fn backend_value(backend: BackendAddr, proto: Protocol, flags: u8) -> BackendV4 {
    BackendV4 { addr: backend.addr.octets(), port: backend.port.to_be_bytes(), proto: proto.number(), flags }
}
