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
//!
//! This file holds the [`Syncer`], what it reports and the order of one [`Syncer::apply`]; `mirror` reads the
//! maps into what it knows of them (and hands out ids), `write` holds each step's writes.

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr};

use anyhow::Result;
use proxy_common::maps::*;

use crate::bpf::{BpfStore, Store};
use crate::model::{BackendAddr, Desired, Frontend, FrontendKind, ServiceName};
use crate::net::{Cidr, Protocol};

mod family;
pub mod image;
mod incremental;
#[cfg(test)]
pub(crate) mod mem_store;
mod mirror;
#[cfg(test)]
mod tests;
mod write;

pub use image::{
    FrontendKey, MaglevSettings, ServicePortKey, affinity_id, build_maglev_table, cluster_ip_frontends,
    desired_backend_flags, frontend_flags, service_port, slot_layout,
};

#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    rev_nat_id: RevNatId,
    name: String,
    /// Slots `1..=count`: backends for new connections.
    backend_ids: Vec<u32>,
    /// Slots `count+1..=count+terminating_count`: backends that keep their
    /// flows but get no new ones.
    terminating_ids: Vec<u32>,
    flags: u16,
    affinity_timeout_s: u32,
    /// The rev-NAT id its clients' affinity is kept under when not its own ([`image::affinity_id`]).
    affinity_id: RevNatId,
    /// Sorted.
    source_ranges: Vec<Cidr>,
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
    vips: BTreeMap<IpAddr, u32>,
    next_backend_id: u32,
    next_rev_nat_id: RevNatId,
    /// Whether the id counters wrapped around: until then every id at or
    /// above the counter is free, and allocation needs no search.
    backend_ids_wrapped: bool,
    rev_nat_ids_wrapped: bool,
    maglev: Option<MaglevSettings>,
    /// The maps hold the state the last apply was given (it wrote everything): an endpoint change
    /// may be applied alone ([`Syncer::apply_changed`]).
    in_step: bool,
    /// Each backend's uses by that state's frontends, once [`Syncer::apply_changed`] needed them.
    backend_uses: Option<incremental::BackendUses>,
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
        vip: IpAddr,
        vip_port: u16,
        cause: String,
    },
    #[error("removing {vip}:{port}/{}: {cause}", proto.name())]
    FrontendNotRemoved { vip: IpAddr, port: u16, proto: Protocol, cause: String },
    #[error(
        "Service {service} ({vip}:{port}): all {tables} Maglev tables are in use (--maglev-tables): random selection"
    )]
    MaglevTablesExhausted { service: ServiceName, vip: IpAddr, port: u16, tables: u32 },
    #[error("updating backend {backend}/{}: {cause}", proto.name())]
    BackendNotUpdated { backend: BackendAddr, proto: Protocol, cause: String },
    #[error("removing backend {}:{}: {cause}", backend.addr, backend.port)]
    BackendNotRemoved { backend: BackendAddr, cause: String },
    #[error("VIP {vip}: {cause}")]
    VipNotWritten { vip: IpAddr, cause: String },
    #[error("removing VIP {vip}: {cause}")]
    VipNotRemoved { vip: IpAddr, cause: String },
}

impl SyncError {
    /// `frontend`, at `key`, was refused by the maps with `error`.
    fn frontend_not_programmed(key: &FrontendKey, frontend: &Frontend, error: &anyhow::Error) -> Self {
        SyncError::FrontendNotProgrammed {
            service: frontend.service.clone(),
            port: frontend.port,
            proto: key.proto,
            vip: key.vip,
            vip_port: key.port,
            cause: format!("{error:#}"),
        }
    }
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.frontends_added + self.frontends_updated + self.frontends_removed > 0
            || self.backends_added + self.backends_removed + self.backends_updated > 0
    }
}

impl Syncer<BpfStore> {
    /// Adopts what the maps already hold (a previous agent's work), so a restart rewrites nothing that is
    /// still wanted. Keeps VIPS_V4 and SOURCE_RANGES_V4 in step with the service maps.
    pub fn from_maps(maps: crate::bpf::Maps) -> Result<Self> {
        Self::from_maps_with(maps, None)
    }

    /// [`Syncer::from_maps`], with Maglev tables for external frontends when `maglev` is set
    /// (as many as `settings.tables`, and as the pinned MAGLEV_V4 holds).
    pub fn from_maps_with(maps: crate::bpf::Maps, maglev: Option<MaglevSettings>) -> Result<Self> {
        let store = BpfStore::from_maps(maps, maglev.is_some());
        let Some(settings) = maglev else { return Self::with_store(store) };
        let tables = store.maglev_tables();
        if tables < settings.tables {
            tracing::warn!(
                pinned = tables,
                wanted = settings.tables,
                "the pinned Maglev map keeps its size; --maglev-tables applies after `kproxy unload`"
            );
        }
        Ok(Self::with_store(store)?
            .with_maglev(MaglevSettings { tables: tables.min(settings.tables), ..settings }))
    }
}

/// The VIPS_V4/V6 entry of every frontend address, from its frontends as `(address, north–south)`:
/// what the Syncer writes and `kproxy dump diff` expects.
pub fn vip_entries(frontends: impl IntoIterator<Item = (IpAddr, bool)>) -> BTreeMap<IpAddr, VipV4> {
    let mut entries: BTreeMap<IpAddr, VipV4> = BTreeMap::new();
    for (addr, north_south) in frontends {
        let entry = entries.entry(addr).or_default();
        *entry = entry.with_frontend(north_south);
    }
    entries
}

impl<S: Store> Syncer<S> {
    /// Uses Maglev tables for external frontends (`--lb-algorithm=maglev`); the store must keep them
    /// ([`BpfStore::with_maglev`]).
    pub fn with_maglev(mut self, settings: MaglevSettings) -> Self {
        self.maglev = Some(settings);
        self
    }

    /// Adopts what `store` already holds (a previous agent's work), so a restart rewrites nothing that is
    /// still wanted.
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
            in_step: false,
            backend_uses: None,
        };
        syncer.reload()?;
        Ok(syncer)
    }

    pub fn store(&self) -> &S {
        &self.store
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

        // Every frontend's address, written before its first frontend: the datapath looks up
        // frontends only on these. Only cluster IPs refuse unknown ports: node addresses, external
        // and LB IPs carry other traffic too.
        let per_vip = vip_entries(wanted.iter().map(|(fk, f)| (fk.vip, f.kind != FrontendKind::ClusterIp)));
        // Cluster IPs first: a Service port's other frontends name their rev-NAT id (session affinity).
        let cluster_ips = cluster_ip_frontends(wanted.values().copied());
        let cluster_ips_first = wanted
            .iter()
            .filter(|(_, f)| f.kind == FrontendKind::ClusterIp)
            .chain(wanted.iter().filter(|(_, f)| f.kind != FrontendKind::ClusterIp));
        // One buffer for every frontend's name: most syncs change nothing of most frontends, and a
        // name formatted afresh for each was an allocation per frontend per sync.
        let mut name = String::new();
        for (fk, frontend) in cluster_ips_first {
            name.clear();
            let _ = write!(name, "{}:{}", frontend.service, frontend.port_name);
            let vip = match per_vip.get(&fk.vip) {
                Some(entry) => self.ensure_vip(fk.vip, entry.frontends),
                None => Ok(()),
            };
            let affinity =
                affinity_id(frontend, &cluster_ips, |ck| self.frontends.get(ck).map(|p| p.rev_nat_id));
            let result =
                vip.and_then(|()| self.apply_frontend(*fk, frontend, &name, affinity, &flags, &mut report));
            if let Err(e) = result {
                report.errors.push(SyncError::frontend_not_programmed(fk, frontend, &e));
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
        self.in_step = report.errors.is_empty();
        self.backend_uses = None;
        report
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// The entries the service maps hold, by the map names of `kproxy_bpf_map_entries`, as this Syncer
    /// wrote them: counted from its mirror rather than by walking the maps (tens of thousands of
    /// syscalls at 10k Services), which only the Syncer writes.
    pub fn map_fill(&self) -> [(&'static str, u64); 8] {
        let (mut services, mut rev_nat) = ([0u64; 2], [0u64; 2]);
        for (key, programmed) in &self.frontends {
            let family = usize::from(!key.vip.is_ipv4());
            services[family] += 1 + programmed.slot_count() as u64;
            rev_nat[family] += 1;
        }
        let count = |ipv4: bool, n: &mut [u64; 2]| n[usize::from(!ipv4)] += 1;
        let mut backends = [0u64; 2];
        self.backends.keys().for_each(|(b, _)| count(b.addr.is_ipv4(), &mut backends));
        let mut vips = [0u64; 2];
        self.vips.keys().for_each(|vip| count(vip.is_ipv4(), &mut vips));
        [
            ("services_v4", services[0]),
            ("backends_v4", backends[0]),
            ("rev_nat_v4", rev_nat[0]),
            ("vips_v4", vips[0]),
            ("services_v6", services[1]),
            ("backends_v6", backends[1]),
            ("rev_nat_v6", rev_nat[1]),
            ("vips_v6", vips[1]),
        ]
    }
}
