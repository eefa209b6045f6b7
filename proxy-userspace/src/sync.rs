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
use aya::maps::{HashMap, MapData, MapError};
use proxy_common::maps::*;

use crate::model::{BackendAddr, Cidr4, Desired, Frontend, FrontendKind, Protocol, Scope};

/// A frontend as the maps key it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub vip: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
    /// [`SCOPE_INTERNAL`] or [`SCOPE_EXTERNAL`].
    pub scope: u8,
}

impl FrontendKey {
    pub fn of(frontend: &Frontend) -> Self {
        let scope = match frontend.scope {
            Scope::Internal => SCOPE_INTERNAL,
            Scope::External => SCOPE_EXTERNAL,
        };
        Self { vip: frontend.vip, port: frontend.port, proto: frontend.proto, scope }
    }

    fn slot(&self, slot: u16) -> ServiceKeyV4 {
        ServiceKeyV4::new(self.vip.octets(), self.port.to_be_bytes(), self.proto.number(), self.scope, slot)
    }
}

/// The SOURCE_RANGES_V4 key of one of a frontend's loadBalancerSourceRanges.
pub fn source_range_key(rev_nat_id: u16, range: Cidr4) -> aya::maps::lpm_trie::Key<SourceRangeV4> {
    aya::maps::lpm_trie::Key::new(
        SOURCE_RANGE_ID_BITS + u32::from(range.prefix_len),
        SourceRangeV4::new(rev_nat_id, range.addr.octets()),
    )
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

/// The map operations the syncer needs: [`BpfStore`] on the real maps, and a
/// recording in-memory store in the unit tests (the apply order is tested
/// without BPF). Deleting a missing key is not an error.
pub trait Store {
    fn read_services(&self) -> Result<Vec<(ServiceKeyV4, ServiceValueV4)>>;
    fn read_backends(&self) -> Result<Vec<(u32, BackendV4)>>;
    /// Empty when the store does not manage VIPS_V4.
    fn read_vips(&self) -> Result<Vec<([u8; 4], VipV4)>>;
    fn read_name(&self, rev_nat_id: u16) -> Option<String>;
    fn put_service(&mut self, key: ServiceKeyV4, value: ServiceValueV4) -> Result<()>;
    fn del_service(&mut self, key: &ServiceKeyV4) -> Result<()>;
    fn put_backend(&mut self, id: u32, value: BackendV4) -> Result<()>;
    fn del_backend(&mut self, id: u32) -> Result<()>;
    fn put_rev_nat(&mut self, id: u16, value: RevNatV4) -> Result<()>;
    fn del_rev_nat(&mut self, id: u16) -> Result<()>;
    fn put_name(&mut self, id: u16, name: &str) -> Result<()>;
    fn del_name(&mut self, id: u16) -> Result<()>;
    fn put_vip(&mut self, vip: [u8; 4], value: VipV4) -> Result<()>;
    fn del_vip(&mut self, vip: [u8; 4]) -> Result<()>;
    /// Every frontend's loadBalancerSourceRanges. The defaults are for
    /// stores that do not keep SOURCE_RANGES_V4.
    fn read_source_ranges(&self) -> Result<Vec<(u16, Cidr4)>> {
        Ok(Vec::new())
    }
    fn put_source_range(&mut self, _rev_nat_id: u16, _range: Cidr4) -> Result<()> {
        Ok(())
    }
    fn del_source_range(&mut self, _rev_nat_id: u16, _range: Cidr4) -> Result<()> {
        Ok(())
    }
    /// One entry of MAGLEV_V4 (the default is for stores without it).
    fn put_maglev(&mut self, _index: u32, _backend_id: u32) -> Result<()> {
        Ok(())
    }
}

/// `--lb-algorithm=maglev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevSettings {
    /// Shared by all nodes.
    pub seed: u32,
    /// Tables in MAGLEV_V4: external frontends beyond it use random selection.
    pub tables: u32,
}

/// The Maglev table of `backends` (ids aligned with their addresses): the
/// backend id of each of its [`MAGLEV_TABLE_SIZE`] entries.
pub fn build_maglev_table(backends: &[(BackendAddr, u32)], proto: Protocol, seed: u32) -> Result<Vec<u32>> {
    use proxy_common::maglev::{BackendIdentityV4, MAGLEV_TABLE_SIZE, populate, scratch_len};
    let identities: Vec<BackendIdentityV4> = backends
        .iter()
        .map(|(b, _)| BackendIdentityV4::new(b.addr.octets(), b.port.to_be_bytes(), proto.number()))
        .collect();
    let mut table = vec![0u32; MAGLEV_TABLE_SIZE as usize];
    let mut scratch = vec![0u32; scratch_len(identities.len())];
    populate(&identities, seed, MAGLEV_TABLE_SIZE, &mut table, &mut scratch)
        .map_err(|e| anyhow::anyhow!("Maglev table: {e}"))?;
    Ok(table.into_iter().map(|i| backends[i as usize].1).collect())
}

/// The pinned (or freshly loaded) BPF maps.
pub struct BpfStore {
    pub services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
    pub backends: HashMap<MapData, u32, BackendV4>,
    pub rev_nat: HashMap<MapData, u16, RevNatV4>,
    pub names: HashMap<MapData, u16, FrontendNameV4>,
    /// `None`: VIPS_V4 is not maintained (callers of [`Syncer::new`] that did
    /// not add it with [`Syncer::with_vips`]).
    pub vips: Option<HashMap<MapData, [u8; 4], VipV4>>,
    /// `None`: SOURCE_RANGES_V4 is not maintained.
    pub source_ranges: Option<aya::maps::LpmTrie<MapData, SourceRangeV4, u8>>,
    /// `None`: MAGLEV_V4 is not maintained.
    pub maglev: Option<aya::maps::Array<MapData, u32>>,
}

impl Store for BpfStore {
    fn read_services(&self) -> Result<Vec<(ServiceKeyV4, ServiceValueV4)>> {
        self.services.iter().map(|e| e.context("reading the services map")).collect()
    }
    fn read_backends(&self) -> Result<Vec<(u32, BackendV4)>> {
        self.backends.iter().map(|e| e.context("reading the backends map")).collect()
    }
    fn read_vips(&self) -> Result<Vec<([u8; 4], VipV4)>> {
        match &self.vips {
            Some(vips) => vips.iter().map(|e| e.context("reading the VIPs map")).collect(),
            None => Ok(Vec::new()),
        }
    }
    fn read_name(&self, rev_nat_id: u16) -> Option<String> {
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
    fn put_rev_nat(&mut self, id: u16, value: RevNatV4) -> Result<()> {
        self.rev_nat.insert(id, value, 0).map_err(map_full)
    }
    fn del_rev_nat(&mut self, id: u16) -> Result<()> {
        ignore_missing(self.rev_nat.remove(&id))
    }
    fn put_name(&mut self, id: u16, name: &str) -> Result<()> {
        self.names.insert(id, FrontendNameV4::new(name), 0).map_err(map_full)
    }
    fn del_name(&mut self, id: u16) -> Result<()> {
        ignore_missing(self.names.remove(&id))
    }
    fn put_vip(&mut self, vip: [u8; 4], value: VipV4) -> Result<()> {
        match &mut self.vips {
            Some(vips) => vips.insert(vip, value, 0).map_err(map_full),
            None => Ok(()),
        }
    }
    fn del_vip(&mut self, vip: [u8; 4]) -> Result<()> {
        match &mut self.vips {
            Some(vips) => ignore_missing(vips.remove(&vip)),
            None => Ok(()),
        }
    }
    fn read_source_ranges(&self) -> Result<Vec<(u16, Cidr4)>> {
        let Some(trie) = &self.source_ranges else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for key in trie.keys() {
            let key = key.context("reading the source ranges map")?;
            let data = key.data();
            let prefix_len = key.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
            if let Some(range) = Cidr4::new(Ipv4Addr::from(data.addr), prefix_len) {
                out.push((u16::from_be_bytes(data.rev_nat_id), range));
            }
        }
        Ok(out)
    }
    fn put_source_range(&mut self, rev_nat_id: u16, range: Cidr4) -> Result<()> {
        match &mut self.source_ranges {
            Some(trie) => trie.insert(&source_range_key(rev_nat_id, range), 1, 0).map_err(map_full),
            None => Ok(()),
        }
    }
    fn del_source_range(&mut self, rev_nat_id: u16, range: Cidr4) -> Result<()> {
        match &mut self.source_ranges {
            Some(trie) => ignore_missing(trie.remove(&source_range_key(rev_nat_id, range))),
            None => Ok(()),
        }
    }
    fn put_maglev(&mut self, index: u32, backend_id: u32) -> Result<()> {
        match &mut self.maglev {
            Some(array) => array.set(index, backend_id, 0).context("MAGLEV_V4"),
            None => Ok(()),
        }
    }
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
    pub errors: Vec<String>,
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.frontends_added + self.frontends_updated + self.frontends_removed > 0
            || self.backends_added + self.backends_removed + self.backends_updated > 0
    }
}

/// The flag each backend of `frontends` should carry: active when any
/// frontend sends new connections to it, terminating when frontends only keep
/// its existing flows. (With `publishNotReadyAddresses` one Service may see
/// an endpoint as ready that another sees as terminating; active wins, since
/// the flag only stops new connections from following affinity to it.)
pub fn desired_backend_flags<'a>(
    frontends: impl IntoIterator<Item = &'a Frontend>,
) -> BTreeMap<(BackendAddr, Protocol), u8> {
    let mut flags = BTreeMap::new();
    for fe in frontends {
        for b in &fe.backends {
            flags.insert((*b, fe.proto), BACKEND_FLAG_ACTIVE);
        }
        for b in &fe.terminating_backends {
            flags.entry((*b, fe.proto)).or_insert(BACKEND_FLAG_TERMINATING);
        }
    }
    flags
}

/// Slot 0 and slots `1..=active+terminating` of a frontend: active backends
/// first (the datapath picks among `1..=count`), then the terminating ones.
pub fn slot_layout(
    active: &[u32],
    terminating: &[u32],
    rev_nat_id: u16,
    flags: u16,
    affinity_timeout_s: u32,
) -> Result<Vec<(u16, ServiceValueV4)>> {
    let total = active.len() + terminating.len();
    if total > usize::from(u16::MAX) {
        anyhow::bail!("{total} endpoints exceed the 65535 slots of a frontend");
    }
    let mut slots = Vec::with_capacity(total + 1);
    slots.push((
        0,
        ServiceValueV4 {
            count: active.len() as u16,
            terminating_count: terminating.len() as u16,
            rev_nat_id,
            flags,
            affinity_timeout_s,
            ..Default::default()
        },
    ));
    for (i, id) in active.iter().chain(terminating).enumerate() {
        slots.push((i as u16 + 1, ServiceValueV4 { backend_id: *id, rev_nat_id, ..Default::default() }));
    }
    Ok(slots)
}

/// Slot 0 flags of a frontend.
pub fn frontend_flags(frontend: &Frontend) -> u16 {
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
    if frontend.kind != FrontendKind::ClusterIp {
        flags |= SVC_FLAG_EXTERNAL_ADDR;
    }
    if frontend.external_local {
        flags |= SVC_FLAG_EXTERNAL_LOCAL;
    }
    if !frontend.source_ranges.is_empty() {
        flags |= SVC_FLAG_SOURCE_RANGES;
    }
    if frontend.no_local_endpoints {
        flags |= SVC_FLAG_NO_LOCAL_ENDPOINTS;
    }
    flags
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

    pub fn from_maps(maps: crate::datapath::Maps) -> Result<Self> {
        Self::from_maps_with(maps, None)
    }

    /// [`Syncer::from_maps`], with Maglev tables for external frontends when `maglev` is set
    /// (as many as `settings.tables`, and as the pinned MAGLEV_V4 holds).
    pub fn from_maps_with(maps: crate::datapath::Maps, maglev: Option<MaglevSettings>) -> Result<Self> {
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
                report.errors.push(format!(
                    "Service {} port {}/{} ({}:{}): not programmed: {e:#}",
                    frontend.service,
                    frontend.port,
                    fk.proto.name(),
                    fk.vip,
                    fk.port
                ));
            }
        }

        self.update_backend_flags(&flags, BACKEND_FLAG_TERMINATING, &mut report);

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
                Err(e) => report.errors.push(format!("updating backend {}/{}: {e:#}", key.0, key.1.name())),
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
                Err(e) => report.errors.push(format!("VIP {vip}: {e:#}")),
            }
        }
        let gone: Vec<Ipv4Addr> = self.vips.keys().filter(|v| !counts.contains_key(v)).copied().collect();
        for vip in gone {
            match self.store.del_vip(vip.octets()) {
                Ok(()) => {
                    self.vips.remove(&vip);
                }
                Err(e) => report.errors.push(format!("removing VIP {vip}: {e:#}")),
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
        let mut maglev_table = None;
        let mut maglev_entries = Vec::new();
        if let Some(settings) = maglev {
            let table = previous
                .as_ref()
                .and_then(|p| p.maglev_table)
                .or_else(|| self.free_maglev_table(settings.tables));
            match table {
                Some(table) => {
                    let pairs: Vec<(BackendAddr, u32)> =
                        frontend.backends.iter().copied().zip(ids.iter().copied()).collect();
                    maglev_entries = build_maglev_table(&pairs, fk.proto, settings.seed)?;
                    let old = previous
                        .as_ref()
                        .filter(|p| p.maglev_table == Some(table))
                        .map(|p| &p.maglev_entries);
                    let base = table * proxy_common::maglev::MAGLEV_TABLE_SIZE;
                    for (i, id) in maglev_entries.iter().enumerate() {
                        if old.and_then(|o| o.get(i)) != Some(id) {
                            self.store.put_maglev(base + i as u32, *id)?;
                        }
                    }
                    slots[0].1.backend_id = table + 1;
                    maglev_table = Some(table);
                }
                None => {
                    report.errors.push(format!(
                        "Service {} ({}:{}): all {} Maglev tables are in use (--maglev-tables): random selection",
                        frontend.service, fk.vip, fk.port, settings.tables
                    ));
                    slots[0].1.flags &= !SVC_FLAG_MAGLEV;
                }
            }
        }
        let flags = slots[0].1.flags;
        if previous.is_none() {
            let rev = RevNatV4 {
                vip: fk.vip.octets(),
                port: fk.port.to_be_bytes(),
                proto: fk.proto.number(),
                _pad: 0,
            };
            self.store.put_rev_nat(rev_nat_id, rev).context("rev_nat map")?;
        }
        if previous.as_ref().is_none_or(|p| p.name != name) {
            self.store.put_name(rev_nat_id, &name).context("names map")?;
        }
        // New ranges go in before slot 0 may carry the flag that makes the
        // datapath check them; stale ones leave after it.
        let old_ranges: Vec<Cidr4> = previous.as_ref().map(|p| p.source_ranges.clone()).unwrap_or_default();
        for range in source_ranges.iter().filter(|r| !old_ranges.contains(r)) {
            self.store.put_source_range(rev_nat_id, *range).context("source ranges map")?;
        }
        let old_ids: Vec<u32> =
            previous.as_ref().map(|p| p.slot_ids().copied().collect()).unwrap_or_default();
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
                Err(e) => {
                    report.errors.push(format!("removing backend {}:{}: {e:#}", key.0.addr, key.0.port))
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceName;

    type FakeStore = crate::mem_store::MemStore;

    const VIP: [u8; 4] = [10, 96, 0, 100];

    fn be(addr: [u8; 4], port: u16) -> BackendAddr {
        BackendAddr { addr: Ipv4Addr::from(addr), port }
    }

    fn web(port: u16, proto: Protocol, active: &[u8], terminating: &[u8]) -> Frontend {
        let mut fe = Frontend::new(
            ServiceName { namespace: "default".into(), name: "web".into() },
            format!("p{port}"),
            Ipv4Addr::from(VIP),
            port,
            proto,
            active.iter().map(|last| be([10, 244, 0, *last], 8080)).collect(),
        );
        fe.terminating_backends = terminating.iter().map(|last| be([10, 244, 0, *last], 8080)).collect();
        fe
    }

    fn slot0(store: &FakeStore, port: u16, proto: Protocol) -> ServiceValueV4 {
        store.services[&(VIP, port, proto.number(), SCOPE_INTERNAL, 0)]
    }

    fn slot_backends(store: &FakeStore, port: u16, proto: Protocol) -> Vec<[u8; 4]> {
        let master = slot0(store, port, proto);
        (1..=master.count + master.terminating_count)
            .map(|s| {
                store.backends[&store.services[&(VIP, port, proto.number(), SCOPE_INTERNAL, s)].backend_id]
                    .addr
            })
            .collect()
    }

    fn flags_of(store: &FakeStore, last: u8) -> u8 {
        store.backends.values().find(|b| b.addr == [10, 244, 0, last]).expect("backend present").flags
    }

    fn id_of(store: &FakeStore, last: u8) -> u32 {
        *store.backends.iter().find(|(_, b)| b.addr == [10, 244, 0, last]).unwrap().0
    }

    fn position(log: &[String], entry: &str) -> usize {
        log.iter().position(|l| l == entry).unwrap_or_else(|| panic!("{entry:?} not in {log:#?}"))
    }

    #[test]
    fn terminating_backends_get_slots_after_the_count_and_their_flag() {
        let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
        let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[3])]));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.backends_added, 3);
        let store = syncer.store();
        let master = slot0(store, 80, Protocol::Tcp);
        assert_eq!((master.count, master.terminating_count), (2, 1));
        assert_eq!(
            slot_backends(store, 80, Protocol::Tcp),
            [[10, 244, 0, 1], [10, 244, 0, 2], [10, 244, 0, 3]]
        );
        assert_eq!(flags_of(store, 1), BACKEND_FLAG_ACTIVE);
        assert_eq!(flags_of(store, 3), BACKEND_FLAG_TERMINATING);
        assert_eq!(store.vips[&VIP].frontends, 1);
        // The VIP entry exists before slot 0 of its first frontend.
        assert!(
            position(&store.log, "put vip 10.96.0.100 1") < position(&store.log, "put slot 10.96.0.100:80#0")
        );

        // A restarted agent adopts the terminating slots: nothing is rewritten.
        let store = std::mem::take(&mut syncer.store);
        let mut syncer = Syncer::with_store(FakeStore { log: vec![], ..store }).unwrap();
        let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[3])]));
        assert!(!report.changed(), "{report:?}");
        assert!(syncer.store().log.is_empty(), "{:?}", syncer.store().log);
        assert_eq!(syncer.backend_count(), 3);
    }

    #[test]
    fn a_backend_changing_state_keeps_its_id_and_flips_its_flag_in_place() {
        let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
        syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[])]));
        let id2 = id_of(syncer.store(), 2);

        // Pod .2 starts terminating: it leaves the active slots, stays as a terminating one.
        syncer.store.log.clear();
        let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[2])]));
        assert_eq!((report.backends_added, report.backends_removed, report.backends_updated), (0, 0, 1));
        assert!(report.removed_backends.is_empty());
        let store = syncer.store();
        assert_eq!(id_of(store, 2), id2);
        assert_eq!(flags_of(store, 2), BACKEND_FLAG_TERMINATING);
        let master = slot0(store, 80, Protocol::Tcp);
        assert_eq!((master.count, master.terminating_count), (1, 1));
        // Flag goes terminating only after slot 0 no longer counts it as active.
        let flip = position(&store.log, &format!("put backend {id2} flags {BACKEND_FLAG_TERMINATING}"));
        assert!(position(&store.log, "put slot 10.96.0.100:80#0") < flip, "{:#?}", store.log);

        // ... and back (readiness restored): active before any slot names it for new flows.
        syncer.store.log.clear();
        let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1, 2], &[])]));
        assert_eq!(report.backends_updated, 1);
        let store = syncer.store();
        assert_eq!(id_of(store, 2), id2);
        assert_eq!(flags_of(store, 2), BACKEND_FLAG_ACTIVE);
        let flip = position(&store.log, &format!("put backend {id2} flags {BACKEND_FLAG_ACTIVE}"));
        assert!(flip < position(&store.log, "put slot 10.96.0.100:80#0"), "{:#?}", store.log);
        assert_eq!(slot0(store, 80, Protocol::Tcp).terminating_count, 0);
        assert_eq!(store.services.len(), 3, "no slot above the total is left");
    }

    #[test]
    fn active_wins_when_two_frontends_disagree_about_a_backend() {
        let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
        let a = web(80, Protocol::Tcp, &[1], &[2]);
        let b = web(81, Protocol::Tcp, &[2], &[]);
        let report = syncer.apply(&Desired::new(vec![a, b]));
        assert!(report.errors.is_empty());
        assert_eq!(syncer.backend_count(), 2);
        assert_eq!(flags_of(syncer.store(), 2), BACKEND_FLAG_ACTIVE);
        assert_eq!(syncer.store().vips[&VIP].frontends, 2);
    }

    #[test]
    fn removed_backends_are_reported_with_their_protocol() {
        let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
        syncer.apply(&Desired::new(vec![
            web(53, Protocol::Udp, &[1, 2], &[]),
            web(80, Protocol::Tcp, &[1], &[3]),
        ]));
        let udp2 = *syncer.backends.get(&(be([10, 244, 0, 2], 8080), Protocol::Udp)).map(|b| &b.id).unwrap();
        let tcp3 = *syncer.backends.get(&(be([10, 244, 0, 3], 8080), Protocol::Tcp)).map(|b| &b.id).unwrap();
        // .2 is deleted; .3 finished terminating and disappears.
        let report = syncer
            .apply(&Desired::new(vec![web(53, Protocol::Udp, &[1], &[]), web(80, Protocol::Tcp, &[1], &[])]));
        let mut removed = report.removed_backends.clone();
        removed.sort();
        let mut expected = vec![(udp2, Protocol::Udp), (tcp3, Protocol::Tcp)];
        expected.sort();
        assert_eq!(removed, expected);
        assert_eq!(report.backends_removed, 2);
        // A terminating backend stays referenced (not an orphan) while listed.
        let report = syncer
            .apply(&Desired::new(vec![web(53, Protocol::Udp, &[], &[1]), web(80, Protocol::Tcp, &[1], &[])]));
        assert!(report.removed_backends.is_empty(), "{report:?}");
    }

    #[test]
    fn vips_count_frontends_and_go_after_the_last_one() {
        let mut syncer = Syncer::with_store(FakeStore::default()).unwrap();
        syncer
            .apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[]), web(80, Protocol::Udp, &[], &[])]));
        assert_eq!(syncer.store().vips[&VIP].frontends, 2);
        syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
        assert_eq!(syncer.store().vips[&VIP].frontends, 1);

        syncer.store.log.clear();
        syncer.apply(&Desired::new(vec![]));
        let store = syncer.store();
        assert!(store.vips.is_empty());
        assert!(
            position(&store.log, "del slot 10.96.0.100:80#0") < position(&store.log, "del vip 10.96.0.100")
        );
        assert!(store.services.is_empty() && store.backends.is_empty() && store.rev_nat.is_empty());

        // Drift is repaired by a reload: a VIP entry removed behind our back comes back.
        syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
        syncer.store.vips.clear();
        syncer.reload().unwrap();
        syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
        assert_eq!(syncer.store().vips[&VIP].frontends, 1);
    }

    #[test]
    fn a_frontend_that_cannot_be_written_leaves_no_vip_behind() {
        let store = FakeStore { backend_capacity: Some(0), ..Default::default() };
        let mut syncer = Syncer::with_store(store).unwrap();
        let report = syncer.apply(&Desired::new(vec![web(80, Protocol::Tcp, &[1], &[])]));
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert!(report.errors[0].contains("default/web"), "{}", report.errors[0]);
        assert!(syncer.store().vips.is_empty());
        assert_eq!(syncer.frontend_count(), 0);
    }

    #[test]
    fn slot_layout_and_flags() {
        let slots = slot_layout(&[7, 8], &[9], 3, SVC_FLAG_AFFINITY, 60).unwrap();
        assert_eq!(slots.len(), 4);
        assert_eq!(slots[0].1.count, 2);
        assert_eq!(slots[0].1.terminating_count, 1);
        assert_eq!(slots[0].1.affinity_timeout_s, 60);
        assert_eq!(
            slots.iter().skip(1).map(|(s, v)| (*s, v.backend_id)).collect::<Vec<_>>(),
            [(1, 7), (2, 8), (3, 9)]
        );
        assert!(slots.iter().all(|(_, v)| v.rev_nat_id == 3));
        assert!(slot_layout(&vec![1; 40_000], &vec![2; 30_000], 1, 0, 0).is_err());

        let mut fe = web(80, Protocol::Tcp, &[1], &[]);
        assert_eq!(frontend_flags(&fe), 0);
        fe.session_affinity_timeout = Some(10);
        fe.local_only = true;
        fe.terminating_fallback = true;
        assert_eq!(
            frontend_flags(&fe),
            SVC_FLAG_AFFINITY | SVC_FLAG_LOCAL_ONLY | SVC_FLAG_TERMINATING_FALLBACK
        );
    }
}
