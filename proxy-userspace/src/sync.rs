//! Keeps the service maps equal to the desired state, in an order that drops
//! no packet: new backends → rev-NAT entries → slots 1..N → slot 0 (the new
//! count) → slots above the count → removed frontends → orphan backends. The
//! datapath never reads a slot above slot 0's count, so every intermediate
//! state is one a packet may safely see.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData, MapError};
use proxy_common::maps::*;

use crate::model::{BackendAddr, Desired, Frontend, Protocol};

/// A frontend as the maps key it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub vip: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl FrontendKey {
    pub fn of(frontend: &Frontend) -> Self {
        Self { vip: frontend.vip, port: frontend.port, proto: frontend.proto }
    }

    fn slot(&self, slot: u16) -> ServiceKeyV4 {
        ServiceKeyV4::new(
            self.vip.octets(),
            self.port.to_be_bytes(),
            self.proto.number(),
            SCOPE_CLUSTER_IP,
            slot,
        )
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

#[derive(Clone, Debug, PartialEq, Eq)]
struct Programmed {
    rev_nat_id: u16,
    name: String,
    backend_ids: Vec<u32>,
    flags: u16,
    affinity_timeout_s: u32,
}

/// The service maps' contents as this process last wrote (or read) them.
pub struct Syncer {
    services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
    backends: HashMap<MapData, u32, BackendV4>,
    rev_nat: HashMap<MapData, u16, RevNatV4>,
    names: HashMap<MapData, u16, FrontendNameV4>,
    frontends: BTreeMap<FrontendKey, Programmed>,
    backend_ids: BTreeMap<(BackendAddr, Protocol), u32>,
    next_backend_id: u32,
    next_rev_nat_id: u16,
}

/// What one sync changed, and what it could not do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub frontends_added: usize,
    pub frontends_updated: usize,
    pub frontends_removed: usize,
    pub backends_added: usize,
    pub backends_removed: usize,
    /// Frontends left as they were because a map refused a write.
    pub errors: Vec<String>,
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.frontends_added + self.frontends_updated + self.frontends_removed > 0
            || self.backends_added + self.backends_removed > 0
    }
}

impl Syncer {
    /// Adopts what the maps already hold (a previous agent's work), so a
    /// restart rewrites nothing that is still wanted.
    pub fn new(
        services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
        backends: HashMap<MapData, u32, BackendV4>,
        rev_nat: HashMap<MapData, u16, RevNatV4>,
        names: HashMap<MapData, u16, FrontendNameV4>,
    ) -> Result<Self> {
        let mut syncer = Self {
            services,
            backends,
            rev_nat,
            names,
            frontends: BTreeMap::new(),
            backend_ids: BTreeMap::new(),
            next_backend_id: 1,
            next_rev_nat_id: 1,
        };
        syncer.reload()?;
        Ok(syncer)
    }

    /// Forgets the mirror and reads the maps again, so the next apply repairs
    /// anything changed behind this process's back (the periodic full resync).
    pub fn reload(&mut self) -> Result<()> {
        let mut backend_ids = BTreeMap::new();
        for entry in self.backends.iter() {
            let (id, b) = entry.context("reading the backends map")?;
            if let Some(proto) = Protocol::from_number(b.proto) {
                let addr = BackendAddr { addr: Ipv4Addr::from(b.addr), port: u16::from_be_bytes(b.port) };
                backend_ids.insert((addr, proto), id);
            }
        }
        let mut slots: BTreeMap<FrontendKey, BTreeMap<u16, ServiceValueV4>> = BTreeMap::new();
        for entry in self.services.iter() {
            let (key, value) = entry.context("reading the services map")?;
            let Some(proto) = Protocol::from_number(key.proto) else { continue };
            let fk = FrontendKey { vip: Ipv4Addr::from(key.vip), port: u16::from_be_bytes(key.port), proto };
            slots.entry(fk).or_default().insert(key.slot, value);
        }
        let mut frontends = BTreeMap::new();
        for (fk, slots) in slots {
            let Some(master) = slots.get(&0) else { continue };
            let backend_ids =
                (1..=master.count).filter_map(|s| slots.get(&s).map(|v| v.backend_id)).collect();
            let name =
                self.names.get(&master.rev_nat_id, 0).map(|n| n.as_str().to_owned()).unwrap_or_default();
            let programmed = Programmed {
                rev_nat_id: master.rev_nat_id,
                name,
                backend_ids,
                flags: master.flags,
                affinity_timeout_s: master.affinity_timeout_s,
            };
            frontends.insert(fk, programmed);
        }
        self.next_backend_id = backend_ids.values().max().map_or(1, |m: &u32| m.wrapping_add(1).max(1));
        self.next_rev_nat_id = frontends
            .values()
            .map(|f: &Programmed| f.rev_nat_id)
            .max()
            .map_or(1, |m| m.wrapping_add(1).max(1));
        self.backend_ids = backend_ids;
        self.frontends = frontends;
        Ok(())
    }

    pub fn from_maps(maps: crate::datapath::Maps) -> Result<Self> {
        Self::new(maps.services, maps.backends, maps.rev_nat, maps.names)
    }

    fn allocate_backend_id(&mut self) -> u32 {
        let used: BTreeSet<u32> = self.backend_ids.values().copied().collect();
        while self.next_backend_id == 0 || used.contains(&self.next_backend_id) {
            self.next_backend_id = self.next_backend_id.wrapping_add(1);
        }
        let id = self.next_backend_id;
        self.next_backend_id = id.wrapping_add(1);
        id
    }

    fn allocate_rev_nat_id(&mut self) -> Option<u16> {
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
    pub fn apply(&mut self, desired: &Desired) -> SyncReport {
        let mut report = SyncReport::default();
        let wanted: BTreeMap<FrontendKey, &Frontend> =
            desired.frontends.iter().map(|f| (FrontendKey::of(f), f)).collect();

        for (fk, frontend) in &wanted {
            let name = format!("{}:{}", frontend.service, frontend.port_name);
            match self.apply_frontend(*fk, frontend, name, &mut report) {
                Ok(()) => {}
                Err(e) => report.errors.push(format!(
                    "Service {} port {}/{} ({}:{}): not programmed: {e:#}",
                    frontend.service,
                    frontend.port,
                    fk.proto.name(),
                    fk.vip,
                    fk.port
                )),
            }
        }

        let stale: Vec<FrontendKey> =
            self.frontends.keys().filter(|k| !wanted.contains_key(k)).copied().collect();
        for fk in stale {
            match self.remove_frontend(fk) {
                Ok(()) => report.frontends_removed += 1,
                Err(e) => {
                    report.errors.push(format!("removing {}:{}/{}: {e:#}", fk.vip, fk.port, fk.proto.name()))
                }
            }
        }
        self.remove_orphan_backends(&mut report);
        report
    }

    fn apply_frontend(
        &mut self,
        fk: FrontendKey,
        frontend: &Frontend,
        name: String,
        report: &mut SyncReport,
    ) -> Result<()> {
        let mut ids = Vec::with_capacity(frontend.backends.len());
        for backend in &frontend.backends {
            let key = (*backend, fk.proto);
            let id = match self.backend_ids.get(&key) {
                Some(id) => *id,
                None => {
                    let id = self.allocate_backend_id();
                    let value = BackendV4 {
                        addr: backend.addr.octets(),
                        port: backend.port.to_be_bytes(),
                        proto: fk.proto.number(),
                        flags: BACKEND_FLAG_ACTIVE,
                    };
                    self.backends
                        .insert(id, value, 0)
                        .map_err(map_full)
                        .with_context(|| format!("backend {}:{}", backend.addr, backend.port))?;
                    self.backend_ids.insert(key, id);
                    report.backends_added += 1;
                    id
                }
            };
            ids.push(id);
        }
        if ids.len() > usize::from(u16::MAX) {
            anyhow::bail!("{} endpoints exceed the 65535 slots of a frontend", ids.len());
        }

        let mut flags = 0;
        if frontend.session_affinity_timeout.is_some() {
            flags |= SVC_FLAG_AFFINITY;
        }
        if frontend.local_only {
            flags |= SVC_FLAG_LOCAL_ONLY;
        }
        if frontend.terminating_fallback {
            flags |= SVC_FLAG_TERMINATING_FALLBACK;
        }
        let affinity_timeout_s = frontend.session_affinity_timeout.unwrap_or(0);
        let previous = self.frontends.get(&fk).cloned();
        if previous.as_ref().is_some_and(|p| {
            p.backend_ids == ids
                && p.name == name
                && p.flags == flags
                && p.affinity_timeout_s == affinity_timeout_s
        }) {
            return Ok(());
        }
        let rev_nat_id = match &previous {
            Some(p) => p.rev_nat_id,
            None => self.allocate_rev_nat_id().context("all 65535 rev-NAT ids are in use")?,
        };
        if previous.is_none() {
            let rev = RevNatV4 {
                vip: fk.vip.octets(),
                port: fk.port.to_be_bytes(),
                proto: fk.proto.number(),
                _pad: 0,
            };
            self.rev_nat.insert(rev_nat_id, rev, 0).map_err(map_full).context("rev_nat map")?;
        }
        if previous.as_ref().is_none_or(|p| p.name != name) {
            self.names
                .insert(rev_nat_id, FrontendNameV4::new(&name), 0)
                .map_err(map_full)
                .context("names map")?;
        }
        for (i, id) in ids.iter().enumerate() {
            let slot = i as u16 + 1;
            if previous.as_ref().and_then(|p| p.backend_ids.get(i)) == Some(id) {
                continue;
            }
            let value = ServiceValueV4 { backend_id: *id, rev_nat_id, ..Default::default() };
            self.services.insert(fk.slot(slot), value, 0).map_err(map_full).context("services map (slot)")?;
        }
        let master = ServiceValueV4 {
            count: ids.len() as u16,
            rev_nat_id,
            flags,
            affinity_timeout_s,
            ..Default::default()
        };
        self.services.insert(fk.slot(0), master, 0).map_err(map_full).context("services map (slot 0)")?;
        let old_count = previous.as_ref().map_or(0, |p| p.backend_ids.len());
        for slot in ids.len() + 1..=old_count {
            ignore_missing(self.services.remove(&fk.slot(slot as u16)))?;
        }
        if previous.is_some() {
            report.frontends_updated += 1;
        } else {
            report.frontends_added += 1;
        }
        self.frontends
            .insert(fk, Programmed { rev_nat_id, name, backend_ids: ids, flags, affinity_timeout_s });
        Ok(())
    }

    fn remove_frontend(&mut self, fk: FrontendKey) -> Result<()> {
        let Some(programmed) = self.frontends.get(&fk).cloned() else { return Ok(()) };
        ignore_missing(self.services.remove(&fk.slot(0)))?;
        for slot in 1..=programmed.backend_ids.len() {
            ignore_missing(self.services.remove(&fk.slot(slot as u16)))?;
        }
        // Established flows keep their VIP in the conntrack reply entry, so
        // dropping the rev-NAT entry only loses the name in dumps.
        ignore_missing(self.rev_nat.remove(&programmed.rev_nat_id))?;
        ignore_missing(self.names.remove(&programmed.rev_nat_id))?;
        self.frontends.remove(&fk);
        Ok(())
    }

    fn remove_orphan_backends(&mut self, report: &mut SyncReport) {
        let referenced: BTreeSet<u32> =
            self.frontends.values().flat_map(|f| f.backend_ids.iter().copied()).collect();
        let orphans: Vec<((BackendAddr, Protocol), u32)> = self
            .backend_ids
            .iter()
            .filter(|(_, id)| !referenced.contains(id))
            .map(|(k, id)| (*k, *id))
            .collect();
        for (key, id) in orphans {
            match ignore_missing(self.backends.remove(&id)) {
                Ok(()) => {
                    self.backend_ids.remove(&key);
                    report.backends_removed += 1;
                }
                Err(e) => {
                    report.errors.push(format!("removing backend {}:{}: {e:#}", key.0.addr, key.0.port))
                }
            }
        }
    }

    /// Frontend name by rev-NAT id, for logs.
    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backend_ids.len()
    }
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
