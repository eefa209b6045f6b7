//! The writes of each step of [`Syncer::apply`]: backends (new, flags rewritten, orphans deleted), VIP counts,
//! and a frontend's rev-NAT entry, name, source ranges, Maglev table and slots, in the order that drops no
//! packet.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::{Context as _, Result};
use proxy_common::maps::*;

use super::{
    BackendEntry, FrontendKey, MaglevSettings, Programmed, Store, SyncError, SyncReport, Syncer,
    build_maglev_table, frontend_flags, slot_layout,
};
use crate::model::{BackendAddr, Frontend, FrontendKind};
use crate::net::{Cidr, Protocol};

impl<S: Store> Syncer<S> {
    /// Rewrites in place the backends that should now carry `target`.
    pub(super) fn update_backend_flags(
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
            match self.put_backend_entry(entry.id, key.0, key.1, target) {
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
    pub(super) fn ensure_vip(&mut self, vip: IpAddr, frontends: u32) -> Result<()> {
        if self.vips.contains_key(&vip) {
            return Ok(());
        }
        self.put_vip_entry(vip, frontends).context("VIPs map")?;
        self.vips.insert(vip, frontends);
        Ok(())
    }

    /// Makes VIPS_V4 count the frontends programmed now; deletes VIPs left
    /// without any (after their frontends' slot 0 are gone).
    pub(super) fn reconcile_vips(&mut self, report: &mut SyncReport) {
        let entries = super::vip_entries(
            self.frontends.iter().map(|(fk, p)| (fk.vip, p.flags & SVC_FLAG_EXTERNAL_ADDR != 0)),
        );
        let counts: BTreeMap<IpAddr, u32> = entries.into_iter().map(|(vip, e)| (vip, e.frontends)).collect();
        for (vip, count) in &counts {
            if self.vips.get(vip) == Some(count) {
                continue;
            }
            match self.put_vip_entry(*vip, *count) {
                Ok(()) => {
                    self.vips.insert(*vip, *count);
                }
                Err(e) => report.errors.push(SyncError::VipNotWritten { vip: *vip, cause: format!("{e:#}") }),
            }
        }
        let gone: Vec<IpAddr> = self.vips.keys().filter(|v| !counts.contains_key(v)).copied().collect();
        for vip in gone {
            match self.del_vip_entry(vip) {
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
        self.put_backend_entry(id, backend, proto, flag).with_context(|| format!("backend {backend}"))?;
        self.backends.insert((backend, proto), BackendEntry { id, flags: flag });
        report.backends_added += 1;
        Ok(id)
    }

    /// The ids of a frontend's active and terminating backends, writing the backends that are new.
    fn frontend_backend_ids(
        &mut self,
        fk: FrontendKey,
        frontend: &Frontend,
        wanted_flags: &BTreeMap<(BackendAddr, Protocol), u8>,
        report: &mut SyncReport,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
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
        Ok((ids, terminating_ids))
    }

    /// Programs one wanted frontend: its new backends, then, unless what is programmed is already so, its
    /// Maglev table and its entries (see [`Syncer::write_frontend`]).
    pub(super) fn apply_frontend(
        &mut self,
        fk: FrontendKey,
        frontend: &Frontend,
        name: &str,
        affinity_id: RevNatId,
        wanted_flags: &BTreeMap<(BackendAddr, Protocol), u8>,
        report: &mut SyncReport,
    ) -> Result<()> {
        let (ids, terminating_ids) = self.frontend_backend_ids(fk, frontend, wanted_flags, report)?;
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
                && p.affinity_id == affinity_id
                && p.source_ranges == source_ranges
                && (maglev.is_none() || !p.maglev_entries.is_empty())
        }) {
            return Ok(());
        }
        let previous = self.frontends.get(&fk).cloned();
        let rev_nat_id = match &previous {
            Some(p) => p.rev_nat_id,
            None => self.allocate_rev_nat_id().context("every rev-NAT id is in use")?,
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
        slots[0].1 = slots[0].1.with_slot0_ids(maglev_table, affinity_id);
        let flags = slots[0].1.flags;
        self.write_frontend(fk, rev_nat_id, name, previous.as_ref(), &slots, &source_ranges)?;
        if previous.is_some() {
            report.frontends_updated += 1;
        } else {
            report.frontends_added += 1;
        }
        self.frontends.insert(
            fk,
            Programmed {
                rev_nat_id,
                name: name.to_owned(),
                backend_ids: ids,
                terminating_ids,
                flags,
                affinity_timeout_s,
                affinity_id,
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
        rev_nat_id: RevNatId,
        name: &str,
        previous: Option<&Programmed>,
        slots: &[(u16, ServiceValueV4)],
        source_ranges: &[Cidr],
    ) -> Result<()> {
        if previous.is_none() {
            self.put_rev_nat_entry(&fk, rev_nat_id).context("rev_nat map")?;
        }
        if previous.is_none_or(|p| p.name != name) {
            self.store.put_name(rev_nat_id, name).context("names map")?;
        }
        // New ranges go in before slot 0 may carry the flag that makes the
        // datapath check them; stale ones leave after it.
        let old_ranges: Vec<Cidr> = previous.map(|p| p.source_ranges.clone()).unwrap_or_default();
        for range in source_ranges.iter().filter(|r| !old_ranges.contains(r)) {
            self.store.put_source_range(rev_nat_id, *range).context("source ranges map")?;
        }
        let old_ids: Vec<u32> = previous.map(|p| p.slot_ids().copied().collect()).unwrap_or_default();
        for (slot, value) in &slots[1..] {
            if old_ids.get(usize::from(*slot) - 1) == Some(&value.backend_id) {
                continue;
            }
            self.put_slot(&fk, *slot, *value).context("services map (slot)")?;
        }
        self.put_slot(&fk, 0, slots[0].1).context("services map (slot 0)")?;
        for slot in slots.len()..=old_ids.len() {
            self.del_slot(&fk, slot as u16)?;
        }
        for range in old_ranges.iter().filter(|r| !source_ranges.contains(r)) {
            self.store.del_source_range(rev_nat_id, *range)?;
        }
        Ok(())
    }

    /// The lowest Maglev table no frontend uses.
    fn free_maglev_table(&self, tables: u32) -> Option<u32> {
        let used: BTreeSet<u32> = self.frontends.values().filter_map(|p| p.maglev_table).collect();
        (0..tables.min(MAGLEV_TABLES_MAX)).find(|t| !used.contains(t))
    }

    pub(super) fn remove_frontend(&mut self, fk: FrontendKey) -> Result<()> {
        let Some(programmed) = self.frontends.get(&fk).cloned() else { return Ok(()) };
        self.del_slot(&fk, 0)?;
        for slot in 1..=programmed.slot_count() {
            self.del_slot(&fk, slot as u16)?;
        }
        // Established flows keep their VIP in the conntrack reply entry, so
        // dropping the rev-NAT entry only loses the name in dumps.
        self.del_rev_nat_entry(&fk, programmed.rev_nat_id)?;
        self.store.del_name(programmed.rev_nat_id)?;
        for range in &programmed.source_ranges {
            self.store.del_source_range(programmed.rev_nat_id, *range)?;
        }
        self.frontends.remove(&fk);
        Ok(())
    }

    pub(super) fn remove_orphan_backends(&mut self, report: &mut SyncReport) {
        let referenced: BTreeSet<u32> = self.frontends.values().flat_map(|f| f.slot_ids().copied()).collect();
        let orphans: Vec<((BackendAddr, Protocol), u32)> = self
            .backends
            .iter()
            .filter(|(_, b)| !referenced.contains(&b.id))
            .map(|(k, b)| (*k, b.id))
            .collect();
        for (key, id) in orphans {
            match self.del_backend_entry(id, key.0) {
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
}
