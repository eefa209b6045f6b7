//! What the syncer knows of the maps: read back from them (at start, and at every full resync, so a write
//! made behind this process's back is repaired), and the ids it hands out.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::Result;
use proxy_common::maps::{RevNatId, SVC_FLAG_MAGLEV, ServiceValueV4};

use super::{BackendEntry, FrontendKey, Programmed, Store, Syncer};
use crate::model::BackendAddr;
use crate::net::{Cidr, Protocol};

/// A frontend's services map entries, by slot.
type Slots = BTreeMap<u16, ServiceValueV4>;

impl<S: Store> Syncer<S> {
    /// Forgets the mirror and reads the maps again, so the next apply repairs
    /// anything changed behind this process's back (the periodic full resync).
    pub fn reload(&mut self) -> Result<()> {
        // What the maps hold is read afresh: the next apply compares every frontend.
        self.in_step = false;
        let backends = self.read_backends()?;
        let frontends = self.read_frontends()?;
        let vips4 = self.store.read_vips()?.into_iter().map(|(vip, v)| (IpAddr::from(vip), v.frontends));
        let vips6 = self.store.read_vips6()?.into_iter().map(|(vip, v)| (IpAddr::from(vip), v.frontends));
        self.vips = vips4.chain(vips6).collect();
        let max_backend_id = backends.values().map(|b: &BackendEntry| b.id).max();
        let max_rev_nat_id = frontends.values().map(|f: &Programmed| f.rev_nat_id).max();
        self.next_backend_id = max_backend_id.map_or(1, |m| m.wrapping_add(1).max(1));
        self.next_rev_nat_id = max_rev_nat_id.map_or(1, |m| m.wrapping_add(1).max(1));
        self.backend_ids_wrapped = max_backend_id == Some(u32::MAX);
        self.rev_nat_ids_wrapped = max_rev_nat_id == Some(RevNatId::MAX);
        self.backends = backends;
        self.frontends = frontends;
        Ok(())
    }

    /// The backends map's entries of a protocol kproxy knows.
    fn read_backends(&self) -> Result<BTreeMap<(BackendAddr, Protocol), BackendEntry>> {
        let mut backends = BTreeMap::new();
        let v4 = self
            .store
            .read_backends()?
            .into_iter()
            .map(|(id, b)| (id, IpAddr::V4(Ipv4Addr::from(b.addr)), b.port, b.proto, b.flags));
        let v6 = self
            .store
            .read_backends6()?
            .into_iter()
            .map(|(id, b)| (id, IpAddr::V6(Ipv6Addr::from(b.addr)), b.port, b.proto, b.flags));
        for (id, addr, port, proto, flags) in v4.chain(v6) {
            if let Some(proto) = Protocol::from_number(proto) {
                let addr = BackendAddr { addr, port: u16::from_be_bytes(port) };
                backends.insert((addr, proto), BackendEntry { id, flags });
            }
        }
        Ok(backends)
    }

    /// The frontends the services map holds (those with a slot 0), with their names and source ranges.
    fn read_frontends(&self) -> Result<BTreeMap<FrontendKey, Programmed>> {
        let mut slots: BTreeMap<FrontendKey, Slots> = BTreeMap::new();
        let v4 = self.store.read_services()?.into_iter().map(|(key, value)| {
            (IpAddr::V4(Ipv4Addr::from(key.vip)), key.port, key.proto, key.scope, key.slot, value)
        });
        let v6 = self.store.read_services6()?.into_iter().map(|(key, value)| {
            (IpAddr::V6(Ipv6Addr::from(key.vip)), key.port, key.proto, key.scope, key.slot, value)
        });
        for (vip, port, proto, scope, slot, value) in v4.chain(v6) {
            let Some(proto) = Protocol::from_number(proto) else { continue };
            let fk = FrontendKey { vip, port: u16::from_be_bytes(port), proto, scope };
            slots.entry(fk).or_default().insert(slot, value);
        }
        let mut ranges: BTreeMap<RevNatId, Vec<Cidr>> = BTreeMap::new();
        for (id, range) in self.store.read_source_ranges()? {
            ranges.entry(id).or_default().push(range);
        }
        let mut frontends = BTreeMap::new();
        for (fk, slots) in slots {
            let Some(master) = slots.get(&0) else { continue };
            let name = self.store.read_name(master.rev_nat_id).unwrap_or_default();
            let mut source_ranges = ranges.remove(&master.rev_nat_id).unwrap_or_default();
            source_ranges.sort();
            frontends.insert(fk, programmed(&slots, master, name, source_ranges));
        }
        Ok(frontends)
    }

    pub(super) fn allocate_backend_id(&mut self) -> u32 {
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

    pub(super) fn allocate_rev_nat_id(&mut self) -> Option<RevNatId> {
        if !self.rev_nat_ids_wrapped && self.next_rev_nat_id != 0 {
            let id = self.next_rev_nat_id;
            self.next_rev_nat_id = id.wrapping_add(1);
            self.rev_nat_ids_wrapped = self.next_rev_nat_id == 0;
            return Some(id);
        }
        let used: BTreeSet<RevNatId> = self.frontends.values().map(|f| f.rev_nat_id).collect();
        if used.len() as u64 >= u64::from(RevNatId::MAX) {
            return None;
        }
        while self.next_rev_nat_id == 0 || used.contains(&self.next_rev_nat_id) {
            self.next_rev_nat_id = self.next_rev_nat_id.wrapping_add(1);
        }
        let id = self.next_rev_nat_id;
        self.next_rev_nat_id = id.wrapping_add(1);
        Some(id)
    }
}

/// A frontend as its slots describe it. The Maglev entries are not read back: the table is rewritten in full.
fn programmed(slots: &Slots, master: &ServiceValueV4, name: String, source_ranges: Vec<Cidr>) -> Programmed {
    let ids = |range: std::ops::RangeInclusive<u32>| -> Vec<u32> {
        range
            .filter_map(|s| u16::try_from(s).ok())
            .filter_map(|s| slots.get(&s).map(|v| v.backend_id))
            .collect()
    };
    let count = u32::from(master.count);
    Programmed {
        rev_nat_id: master.rev_nat_id,
        name,
        backend_ids: ids(1..=count),
        terminating_ids: ids(count + 1..=count + u32::from(master.terminating_count)),
        flags: master.flags,
        affinity_timeout_s: master.affinity_timeout_s,
        affinity_id: master.named_affinity_id(),
        source_ranges,
        maglev_table: master.maglev_table().filter(|_| master.flags & SVC_FLAG_MAGLEV != 0),
        maglev_entries: Vec::new(),
    }
}
