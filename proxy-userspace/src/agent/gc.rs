//! Conntrack and affinity garbage collection, UDP purges and flushes.
//!
//! The datapath treats an idle flow as expired when it next sees it, but an
//! entry whose flow never sends again would otherwise stay until the LRU
//! evicts it. The agent scans CONNTRACK_V4 and CONNTRACK_V6 every [`Interval::current`] and
//! deletes pairs idle for longer than their state's timeout (CONFIG[0], one set for both families),
//! orphan reply entries (their forward entry was evicted), SNAT translations whose flow is gone,
//! and expired sessionAffinity entries.
//!
//! The decisions ([`plan_conntrack`], [`plan_affinity`], [`plan_purge`], [`plan_stale_snat`],
//! [`Interval::next`]) are pure and unit-tested; [`run`],
//! [`purge_backends`] do the map I/O. All times are
//! CLOCK_MONOTONIC nanoseconds ([`monotonic_ns`](crate::bpf::conntrack::monotonic_ns)), the clock of
//! `bpf_ktime_get_ns`.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    hash::Hash,
    time::Duration,
};

use anyhow::{Context as _, Result};
use proxy_common::{
    conntrack::Timeouts,
    maps::{
        AffinityKeyV4, AffinityValueV4, CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_REMAP, CT_FLAG_SNAT, CtEntryV4,
        CtKeyV4, RevNatId, SVC_FLAG_AFFINITY, SnatEntryV4, legacy_snat_forward_key, reply_key_in_snat,
    },
    maps_v6::{AffinityKeyV6, CtEntryV6, CtKeyV6, SnatEntryV6},
};

use crate::bpf::{
    Maps,
    conntrack::{
        CtEntry, CtKey, Snat6Index, SnatIndex, capacity, capacity6, count6, delete, delete_snat,
        delete_snat6, delete6, delete6_flows, get6, hairpin_addr, monotonic_ns, owns_snat6, pair_expired,
        read_config, read_conntrack, read_conntrack6, reply_key, reply_key6, select, select_pairs,
        snat_index, snat6_index, state_name,
    },
    remove_present,
};

const SECOND_NS: u64 = 1_000_000_000;

/// What one conntrack scan of one family decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtPlan<K = CtKeyV4> {
    /// Expired flows: (forward key, reply key if the reply entry exists).
    /// Delete the forward entry first: a reply arriving in between is still
    /// un-NATed, and a forward packet simply starts a new flow.
    pub pairs: Vec<(K, Option<K>)>,
    /// Reply entries without a forward entry, idle past their own timeout.
    pub orphans: Vec<K>,
    /// Entries the plan deletes, by state name (forward state for pairs).
    pub by_state: BTreeMap<&'static str, u64>,
    /// Entries scanned.
    pub scanned: u64,
}

impl<K> Default for CtPlan<K> {
    fn default() -> Self {
        Self { pairs: Vec::new(), orphans: Vec::new(), by_state: BTreeMap::new(), scanned: 0 }
    }
}

impl<K> CtPlan<K> {
    pub fn entries(&self) -> u64 {
        self.by_state.values().sum()
    }
}

/// Decides which conntrack entries are dead at `now`.
pub fn plan_conntrack(
    entries: &[(CtKeyV4, CtEntryV4)],
    timeouts: &Timeouts,
    hairpin_addr: [u8; 4],
    snat: &SnatIndex,
    now: u64,
) -> CtPlan {
    plan_conntrack_pairs(entries, timeouts, |key, entry| reply_key(key, entry, hairpin_addr, snat), now)
}

/// [`plan_conntrack`] for either family: `reply_of` names a forward entry's reply key.
pub fn plan_conntrack_pairs<K: CtKey, E: CtEntry>(
    entries: &[(K, E)],
    timeouts: &Timeouts,
    reply_of: impl Fn(&K, &E) -> K,
    now: u64,
) -> CtPlan<K> {
    let mut plan = CtPlan { scanned: entries.len() as u64, ..Default::default() };
    let replies: HashMap<K, &E> =
        entries.iter().filter(|(k, _)| k.direction() == CT_DIR_REPLY).map(|(k, v)| (*k, v)).collect();
    let mut claimed: BTreeSet<usize> = BTreeSet::new();
    let reply_index: HashMap<K, usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, (k, _))| k.direction() == CT_DIR_REPLY)
        .map(|(i, (k, _))| (*k, i))
        .collect();
    for (key, fwd) in entries.iter().filter(|(k, _)| k.direction() == CT_DIR_FORWARD) {
        let rkey = reply_of(key, fwd);
        let reply = replies.get(&rkey).copied();
        if reply.is_some() {
            claimed.insert(reply_index[&rkey]);
        }
        if pair_expired(timeouts, fwd, reply, now) {
            let n = 1 + u64::from(reply.is_some());
            *plan.by_state.entry(state_name(fwd.state())).or_default() += n;
            plan.pairs.push((*key, reply.map(|_| rkey)));
        }
    }
    for (i, (key, entry)) in entries.iter().enumerate() {
        if key.direction() != CT_DIR_REPLY || claimed.contains(&i) {
            continue;
        }
        if timeouts.expired(entry.state(), entry.last_seen_ns(), now) {
            *plan.by_state.entry(state_name(entry.state())).or_default() += 1;
            plan.orphans.push(*key);
        }
    }
    // Entries of an unknown direction are not the datapath's; leave them.
    plan
}

/// An AFFINITY_V4 or AFFINITY_V6 key: both name their frontend by the shared rev-NAT id.
pub trait AffinityKey: Copy {
    fn rev_nat_id(&self) -> RevNatId;
}

impl AffinityKey for AffinityKeyV4 {
    fn rev_nat_id(&self) -> RevNatId {
        self.rev_nat_id
    }
}

impl AffinityKey for AffinityKeyV6 {
    fn rev_nat_id(&self) -> RevNatId {
        self.rev_nat_id
    }
}

/// Affinity entries to delete: those of frontends that are gone or no longer
/// have sessionAffinity, and those unused for longer than their frontend's
/// timeout. `frontends` maps rev-NAT id → slot 0 `(flags, affinity_timeout_s)`,
/// of both families' frontends (the ids are shared).
pub fn plan_affinity<K: AffinityKey>(
    entries: &[(K, AffinityValueV4)],
    frontends: &BTreeMap<RevNatId, (u16, u32)>,
    now: u64,
) -> Vec<K> {
    entries
        .iter()
        .filter(|(key, value)| match frontends.get(&key.rev_nat_id()) {
            None => true,
            Some((flags, _)) if flags & SVC_FLAG_AFFINITY == 0 => true,
            Some((_, timeout_s)) => {
                now.saturating_sub(value.last_used_ns) > u64::from(*timeout_s) * SECOND_NS
            }
        })
        .map(|(key, _)| *key)
        .collect()
}

/// Every entry of the flows sent to one of `backend_ids` (both directions),
/// for the UDP purge after a backend is deleted. Reply entries are found
/// through their forward entry and also by their own `backend_id`, so an
/// orphan reply is purged too.
pub fn plan_purge(
    entries: &[(CtKeyV4, CtEntryV4)],
    backend_ids: &BTreeSet<u32>,
    hairpin_addr: [u8; 4],
    snat: &SnatIndex,
) -> Vec<CtKeyV4> {
    select(entries, hairpin_addr, snat, |_, entry| backend_ids.contains(&entry.backend_id))
}

/// [`plan_purge`] for CONNTRACK_V6: backend ids are shared between the families, so the ids a sync
/// removed select the IPv6 flows to its IPv6 backends.
pub fn plan_purge6(
    entries: &[(CtKeyV6, CtEntryV6)],
    backend_ids: &BTreeSet<u32>,
    snat6: &Snat6Index,
) -> Vec<CtKeyV6> {
    select_pairs(entries, |k, e| reply_key6(k, e, snat6), |_, entry| backend_ids.contains(&entry.backend_id))
}

/// How long a fresh SNAT_V4 or SNAT_V6 entry is kept without its conntrack entry: the datapath takes
/// a flow's port (both translations) before it records the flow in conntrack.
pub const SNAT_RECORD_GRACE_NS: u64 = SECOND_NS;

/// A SNAT_V4 or SNAT_V6 translation, keyed as one of its flow's conntrack entries.
pub trait Translation: Copy {
    type Key: CtKey;
    /// What a flow's two translations share and no other flow's do: (proto, the address:port the
    /// client became, the client's address:port).
    type Link: Eq + Hash;
    fn link(key: &Self::Key, to: &Self) -> Self::Link;
    fn created_ns(&self) -> u64;
}

macro_rules! translation {
    ($entry:ty, $key:ty, $addr:ty) => {
        impl Translation for $entry {
            type Key = $key;
            type Link = (u8, $addr, [u8; 2], $addr, [u8; 2]);
            fn link(key: &$key, to: &$entry) -> Self::Link {
                if key.direction == CT_DIR_FORWARD {
                    (key.proto, to.addr, to.port, key.saddr, key.sport)
                } else {
                    (key.proto, key.daddr, key.dport, to.addr, to.port)
                }
            }
            fn created_ns(&self) -> u64 {
                self.created_ns
            }
        }
    };
}

translation!(SnatEntryV4, CtKeyV4, [u8; 4]);
translation!(SnatEntryV6, CtKeyV6, [u8; 16]);

/// The SNAT_V4 or SNAT_V6 entries whose flow is gone, with the `created_ns` each had when read (so
/// that one created again under the same key since is left alone). A flow's two translations — its
/// forward entry, keyed as its conntrack forward entry, `→ {address, port it became}`, and its
/// reverse one, keyed as its reply entry (`backend → that address:port`) `→ {client, client port}`
/// — are told apart from other flows' by [`Translation::link`], and go only when neither of the
/// flow's conntrack entries is left (`tracked`): the datapath puts an evicted half of a live pair
/// back from the other on its next packet, and needs both translations for it. Entries younger
/// than [`SNAT_RECORD_GRACE_NS`] stay: a flow takes its port before it is recorded.
pub fn plan_stale_snat<T: Translation>(
    translations: &[(T::Key, T)],
    tracked: impl Fn(&T::Key) -> bool,
    now: u64,
) -> Vec<(T::Key, u64)> {
    let live: HashSet<T::Link> =
        translations.iter().filter(|(key, _)| tracked(key)).map(|(key, to)| T::link(key, to)).collect();
    translations
        .iter()
        .filter(|(key, to)| {
            now.saturating_sub(to.created_ns()) >= SNAT_RECORD_GRACE_NS && !live.contains(&T::link(key, to))
        })
        .map(|(key, to)| (*key, to.created_ns()))
        .collect()
}

/// The keys under which kproxy before the per-flow key kept a source-NATed flow's forward SNAT_V4
/// entry (the tuple after DNAT, [`legacy_snat_forward_key`]), for each such flow still `tracked`: no
/// conntrack entry has that key, so without it such a flow counted as gone once its reply entry was
/// evicted. (A remapped flow's forward entry was always keyed by its own tuple.)
fn legacy_forward_keys<'a>(
    entries: &'a [(CtKeyV4, CtEntryV4)],
    tracked: &'a HashSet<CtKeyV4>,
) -> impl Iterator<Item = CtKeyV4> + 'a {
    entries
        .iter()
        .filter(|(key, entry)| {
            key.direction == CT_DIR_FORWARD
                && entry.flags & CT_FLAG_SNAT != 0
                && entry.flags & CT_FLAG_REMAP == 0
                && tracked.contains(key)
        })
        .map(|(key, entry)| legacy_snat_forward_key(key, entry.nat_addr, entry.nat_port))
}

/// Cilium-style adaptive GC interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub current: Duration,
    pub min: Duration,
    pub max: Duration,
}

impl Interval {
    pub const MIN: Duration = Duration::from_secs(5);
    pub const MAX: Duration = Duration::from_secs(300);

    /// Starts at `initial` (--conntrack-gc-interval). The bounds are 5 s and
    /// 5 min, widened to include `initial` so a short interval asked for
    /// (tests) or a long one is honoured.
    pub fn new(initial: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(100));
        Self { current: initial, min: Self::MIN.min(initial), max: Self::MAX.max(initial) }
    }

    /// The interval after a run that deleted `deleted` of `scanned` entries
    /// and left `remaining` in a table of `capacity`: halved after a run
    /// that deleted more than 25 % or when the table is over 90 % full,
    /// grown by 1.5× after one that deleted under 5 %, kept otherwise;
    /// always within `[min, max]`.
    pub fn next(&mut self, deleted: u64, scanned: u64, remaining: u64, capacity: u64) -> Duration {
        let deleted_ratio = if scanned == 0 { 0.0 } else { deleted as f64 / scanned as f64 };
        let full = capacity > 0 && remaining as f64 > 0.9 * capacity as f64;
        let next = if deleted_ratio > 0.25 || full {
            self.current / 2
        } else if deleted_ratio < 0.05 {
            self.current.mul_f64(1.5)
        } else {
            self.current
        };
        self.current = next.clamp(self.min, self.max);
        self.current
    }
}

/// The outcome of one GC run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub scanned: u64,
    /// Conntrack entries deleted, by state.
    pub deleted: BTreeMap<&'static str, u64>,
    pub affinity_deleted: u64,
    /// SNAT translations deleted because their flow was gone.
    pub snat_deleted: u64,
    /// Conntrack entries left, and the capacity, of the fuller of CONNTRACK_V4 and CONNTRACK_V6
    /// (by fill): the interval shortens when either table nears its capacity, as either evicts.
    pub remaining: u64,
    pub capacity: u64,
    /// What the tables the run walked hold after it, by the names of `kproxy_bpf_map_entries`
    /// (conntrack and affinity, both families): the metrics take them from here rather than walk the
    /// tables again.
    pub fill: Vec<(&'static str, u64)>,
}

impl GcReport {
    pub fn deleted_total(&self) -> u64 {
        self.deleted.values().sum()
    }
}

/// One GC pass over CONNTRACK_V4, CONNTRACK_V6, AFFINITY_V4 and AFFINITY_V6. Blocking: run it in
/// `spawn_blocking`. Each pair is re-read and re-checked just before it is
/// deleted, so a flow that sent a packet during the scan survives.
pub fn run(maps: &mut Maps) -> Result<GcReport> {
    let config = read_config(maps);
    let timeouts = Timeouts::from_config(&config);
    let hairpin = hairpin_addr(&config);
    let now = monotonic_ns();
    let entries = read_conntrack(maps)?;
    let snat = snat_index(maps);
    let plan = plan_conntrack(&entries, &timeouts, hairpin, &snat, now);
    let mut report = GcReport { scanned: plan.scanned, ..Default::default() };

    for (fkey, rkey) in &plan.pairs {
        let Ok(fwd) = maps.conntrack.get(fkey, 0) else { continue };
        let reply = rkey.and_then(|k| maps.conntrack.get(&k, 0).ok());
        if !pair_expired(&timeouts, &fwd, reply.as_ref(), monotonic_ns()) {
            continue;
        }
        let mut n = u64::from(delete(maps, fkey)?);
        if let Some(rkey) = rkey {
            n += u64::from(delete(maps, rkey)?);
        }
        if reply_key_in_snat(fwd.flags) {
            delete_snat(maps, fkey, &fwd);
        }
        *report.deleted.entry(state_name(fwd.state)).or_default() += n;
    }
    for key in &plan.orphans {
        let Ok(entry) = maps.conntrack.get(key, 0) else { continue };
        if timeouts.expired(entry.state, entry.last_seen_ns, monotonic_ns()) && delete(maps, key)? {
            *report.deleted.entry(state_name(entry.state)).or_default() += 1;
        }
    }
    collect_ipv6(maps, &timeouts, now, &mut report)?;

    // One table for both families: an IPv6 frontend keys its clients by its own rev-NAT id or its Service
    // port's cluster-IP one, and the port's cluster IP may be of the other family.
    let mut frontends = BTreeMap::new();
    let slot0s =
        maps.services.iter().map(|e| e.map(|(k, v)| (k.slot, v)).context("reading the services map")).chain(
            maps.services_v6
                .iter()
                .map(|e| e.map(|(k, v)| (k.slot, v)).context("reading the IPv6 services map")),
        );
    for entry in slot0s {
        let (slot, value) = entry?;
        if slot == 0 {
            frontends.insert(value.rev_nat_id, (value.flags, value.affinity_timeout_s));
            // Entries are keyed by the Service port's cluster-IP frontend; should that one be gone, the
            // port's other frontends still keep theirs.
            frontends.entry(value.affinity_id()).or_insert((value.flags, value.affinity_timeout_s));
        }
    }
    let (deleted, affinity_left) = expire_affinity(&mut maps.affinity, &frontends, "affinity")?;
    // IPv6 clients' entries, counted with IPv4's: kproxy_affinity_gc_deleted_total has no family label.
    let (deleted6, affinity6_left) = expire_affinity(&mut maps.affinity_v6, &frontends, "IPv6 affinity")?;
    report.affinity_deleted += deleted + deleted6;

    // A walk cut short would make every translation it missed look stale: none is judged then.
    let translations: Vec<(CtKeyV4, SnatEntryV4)> =
        maps.snat.iter().collect::<Result<_, _>>().context("reading SNAT_V4")?;
    let mut tracked: HashSet<CtKeyV4> =
        maps.conntrack.keys().collect::<Result<_, _>>().context("reading CONNTRACK_V4")?;
    let legacy: Vec<CtKeyV4> = legacy_forward_keys(&entries, &tracked).collect();
    tracked.extend(legacy);
    for (key, created_ns) in plan_stale_snat(&translations, |k| tracked.contains(k), monotonic_ns()) {
        // Re-read before it goes: the key may have been taken again by a new flow since the scan. (A
        // flow that takes it between this read and the delete loses its translation: the window is
        // one syscall, and its next packet is dropped as a translation evicted would be.)
        let same = maps.snat.get(&key, 0).is_ok_and(|to| to.created_ns == created_ns);
        if same
            && maps.conntrack.get(&key, 0).is_err()
            && remove_present(&mut maps.snat, &key).context("deleting a stale SNAT_V4 entry")?
            && key.direction == CT_DIR_REPLY
        {
            report.snat_deleted += 1;
        }
    }

    let (remaining, remaining6) = (maps.conntrack.keys().count() as u64, count6(maps));
    (report.remaining, report.capacity) = fuller((remaining, capacity(maps)), (remaining6, capacity6(maps)));
    report.fill = vec![
        ("conntrack_v4", remaining),
        ("conntrack_v6", remaining6),
        ("affinity_v4", affinity_left),
        ("affinity_v6", affinity6_left),
    ];
    Ok(report)
}

/// Deletes the entries of one affinity table that [`plan_affinity`] gives up; returns how many it
/// deleted and how many are left.
fn expire_affinity<K: AffinityKey + aya::Pod>(
    map: &mut aya::maps::HashMap<aya::maps::MapData, K, AffinityValueV4>,
    frontends: &BTreeMap<RevNatId, (u16, u32)>,
    what: &str,
) -> Result<(u64, u64)> {
    let entries: Vec<(K, AffinityValueV4)> = map.iter().filter_map(|e| e.ok()).collect();
    let mut deleted = 0;
    for key in plan_affinity(&entries, frontends, monotonic_ns()) {
        if remove_present(map, &key).with_context(|| format!("deleting an {what} entry"))? {
            deleted += 1;
        }
    }
    Ok((deleted, entries.len() as u64 - deleted))
}

/// The (entries, capacity) of the fuller table; a table of unknown capacity (0) counts as empty.
pub fn fuller(v4: (u64, u64), v6: (u64, u64)) -> (u64, u64) {
    let fill =
        |(entries, capacity): (u64, u64)| if capacity == 0 { 0.0 } else { entries as f64 / capacity as f64 };
    if fill(v6) > fill(v4) { v6 } else { v4 }
}

/// The IPv6 half of [`run`]: CONNTRACK_V6's expired pairs and orphans, each re-read before it is
/// deleted. A remapped (port reuse) or source-NATed flow is paired through SNAT_V6, whose two entries
/// go with it.
fn collect_ipv6(maps: &mut Maps, timeouts: &Timeouts, now: u64, report: &mut GcReport) -> Result<()> {
    let entries = read_conntrack6(maps)?;
    let snat6 = snat6_index(maps);
    let plan = plan_conntrack_pairs(&entries, timeouts, |k, e| reply_key6(k, e, &snat6), now);
    report.scanned += plan.scanned;
    for (fkey, rkey) in &plan.pairs {
        let Some(fwd) = get6(maps, fkey) else { continue };
        let reply = rkey.and_then(|k| get6(maps, &k));
        if !pair_expired(timeouts, &fwd, reply.as_ref(), monotonic_ns()) {
            continue;
        }
        let mut n = u64::from(delete6(maps, fkey)?);
        if let Some(rkey) = rkey {
            n += u64::from(delete6(maps, rkey)?);
        }
        if owns_snat6(fkey, &fwd, &snat6) {
            delete_snat6(maps, fkey, &reply_key6(fkey, &fwd, &snat6))?;
        }
        *report.deleted.entry(state_name(fwd.state)).or_default() += n;
    }
    for key in &plan.orphans {
        let Some(entry) = get6(maps, key) else { continue };
        if timeouts.expired(entry.state, entry.last_seen_ns, monotonic_ns()) && delete6(maps, key)? {
            *report.deleted.entry(state_name(entry.state)).or_default() += 1;
        }
    }
    // A walk cut short would make every translation it missed look stale: none is judged then.
    let translations: Vec<(CtKeyV6, SnatEntryV6)> =
        maps.snat_v6.iter().collect::<Result<_, _>>().context("reading SNAT_V6")?;
    let tracked: HashSet<CtKeyV6> =
        maps.conntrack_v6.keys().collect::<Result<_, _>>().context("reading CONNTRACK_V6")?;
    for (key, created_ns) in plan_stale_snat(&translations, |k| tracked.contains(k), monotonic_ns()) {
        // Re-read before it goes: the key may have been taken again by a new flow since the scan.
        let same = maps.snat_v6.get(&key, 0).is_ok_and(|to| to.created_ns == created_ns);
        if same
            && get6(maps, &key).is_none()
            && remove_present(&mut maps.snat_v6, &key).context("deleting a stale SNAT_V6 entry")?
            && key.direction == CT_DIR_REPLY
        {
            report.snat_deleted += 1;
        }
    }
    Ok(())
}

/// Deletes at once every conntrack entry (both directions) of flows sent to
/// these backends, in both families (backend ids are shared). Returns the entries deleted per family.
///
/// The agent calls it for deleted UDP backends only, as kube-proxy clears
/// stale UDP conntrack entries only: a UDP client that keeps its source port
/// (DNS resolvers do) would otherwise keep a dead backend until the entry
/// idles out. TCP flows keep their entries: a backend leaves the
/// EndpointSlice while its pod still serves (a readiness flap, a relabelled
/// pod), and the connection must carry on to it; a pod that is really gone
/// ends the connection itself (RST or the client's timeout). A purge would
/// turn the next segment into a drop (a non-SYN packet without conntrack
/// entry) and the stream into a stall.
pub fn purge_backends(maps: &mut Maps, backend_ids: &[u32]) -> Result<Purged> {
    if backend_ids.is_empty() {
        return Ok(Purged::default());
    }
    let hairpin = hairpin_addr(&read_config(maps));
    let ids: BTreeSet<u32> = backend_ids.iter().copied().collect();
    let entries = read_conntrack(maps)?;
    let mut purged = Purged::default();
    for key in plan_purge(&entries, &ids, hairpin, &snat_index(maps)) {
        purged.ipv4 += u64::from(delete(maps, &key)?);
    }
    let entries6 = read_conntrack6(maps)?;
    let snat6 = snat6_index(maps);
    let keys6 = plan_purge6(&entries6, &ids, &snat6);
    purged.ipv6 += delete6_flows(maps, &entries6, &keys6, &snat6)?;
    Ok(purged)
}

/// Conntrack entries a purge deleted, by family (kube-proxy's reconciler counts per family).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Purged {
    pub ipv4: u64,
    pub ipv6: u64,
}

impl Purged {
    pub fn total(&self) -> u64 {
        self.ipv4 + self.ipv6
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP};

    const S: u64 = SECOND_NS;
    use crate::bpf::conntrack::*;
    use crate::testutil::conntrack::*;
    use proxy_common::conntrack::CtState;
    use proxy_common::maps::{CT_FLAG_HAIRPIN, ConfigV4, DEFAULT_HAIRPIN_ADDR};

    #[test]
    fn hairpin_reply_key_uses_the_hairpin_address() {
        let [(fkey, mut fwd), (rkey, _)] = flow(BACKEND, 4000, IPPROTO_TCP, CtState::Established, 0, 0);
        assert_eq!(reply_key(&fkey, &fwd, HAIRPIN, &NO_SNAT), rkey);
        fwd.flags |= CT_FLAG_HAIRPIN;
        let hk = reply_key(&fkey, &fwd, HAIRPIN, &NO_SNAT);
        assert_eq!(
            (hk.saddr, hk.daddr, hk.sport, hk.dport),
            (BACKEND, HAIRPIN, 53u16.to_be_bytes(), 4000u16.to_be_bytes())
        );
        assert_eq!(hk.direction, CT_DIR_REPLY);
        assert_eq!(hairpin_addr(&ConfigV4::default()), DEFAULT_HAIRPIN_ADDR);
        assert_eq!(
            hairpin_addr(&ConfigV4 { hairpin_addr: [1, 2, 3, 4], ..Default::default() }),
            [1, 2, 3, 4]
        );
    }

    #[test]
    fn a_pair_expires_on_the_later_last_seen_of_its_two_entries() {
        let t = Timeouts::DEFAULT;
        let now = 10_000 * S;
        // UDP (60 s): forward idle 100 s, but the backend answered 30 s ago: alive.
        let entries = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, now - 100 * S, now - 30 * S);
        let plan = plan_conntrack(&entries, &t, HAIRPIN, &NO_SNAT, now);
        assert!(plan.pairs.is_empty() && plan.orphans.is_empty(), "{plan:?}");
        // Both sides idle 61 s: both entries go, counted under OPEN.
        let entries = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, now - 61 * S, now - 70 * S);
        let plan = plan_conntrack(&entries, &t, HAIRPIN, &NO_SNAT, now);
        assert_eq!(plan.pairs, vec![(entries[0].0, Some(entries[1].0))]);
        assert_eq!(plan.by_state.get("OPEN"), Some(&2));
        assert_eq!(plan.entries(), 2);
        assert_eq!(plan.scanned, 2);
    }

    #[test]
    fn each_state_has_its_own_timeout() {
        let t = Timeouts::DEFAULT;
        let now = 100_000 * S;
        // (state, idle that survives, idle that expires)
        let cases = [
            (CtState::SynSent, 60 * S, 61 * S),
            (CtState::SynReceived, 59 * S, 61 * S),
            (CtState::Established, 6 * 3600 * S, 6 * 3600 * S + 1),
            (CtState::Closing, 10 * S, 11 * S),
            (CtState::Closed, 9 * S, 11 * S),
            (CtState::Open, 60 * S, 60 * S + 1),
        ];
        for (state, alive, dead) in cases {
            let e = flow(CLIENT, 5000, IPPROTO_TCP, state, now - alive, now - alive);
            assert!(plan_conntrack(&e, &t, HAIRPIN, &NO_SNAT, now).pairs.is_empty(), "{state:?} alive");
            let e = flow(CLIENT, 5000, IPPROTO_TCP, state, now - dead, now - dead);
            let plan = plan_conntrack(&e, &t, HAIRPIN, &NO_SNAT, now);
            assert_eq!(plan.pairs.len(), 1, "{state:?} dead");
            assert_eq!(plan.by_state.get(state.name()), Some(&2));
        }
        // Timeouts from CONFIG: UDP 5 s.
        let custom = Timeouts::from_config(&ConfigV4 { timeout_udp_ns: 5 * S, ..Default::default() });
        let e = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, now - 6 * S, now - 6 * S);
        assert_eq!(plan_conntrack(&e, &custom, HAIRPIN, &NO_SNAT, now).pairs.len(), 1);
        // An unknown state expires like closing.
        let mut e = flow(CLIENT, 5000, IPPROTO_TCP, CtState::Open, now - 11 * S, now - 11 * S);
        e[0].1.state = 0;
        let plan = plan_conntrack(&e, &t, HAIRPIN, &NO_SNAT, now);
        assert_eq!(plan.by_state.get("UNKNOWN"), Some(&2));
    }

    #[test]
    fn clock_skew_is_not_expiry() {
        // Entries touched after `now` was read (the datapath runs during the scan).
        let now = 1_000 * S;
        let entries = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, now + 5 * S, now + 3 * S);
        let plan = plan_conntrack(&entries, &Timeouts::DEFAULT, HAIRPIN, &NO_SNAT, now);
        assert!(plan.pairs.is_empty());
        // A monotonic clock near boot (now < timeout) never underflows.
        let entries = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, 0, 0);
        assert!(plan_conntrack(&entries, &Timeouts::DEFAULT, HAIRPIN, &NO_SNAT, 30 * S).pairs.is_empty());
        assert_eq!(time_left_ns(&Timeouts::DEFAULT, &entries[0].1, Some(&entries[1].1), 30 * S), 30 * S);
        assert_eq!(time_left_ns(&Timeouts::DEFAULT, &entries[0].1, None, 90 * S), 0);
    }

    #[test]
    fn orphans_and_lonely_forward_entries() {
        let t = Timeouts::DEFAULT;
        let now = 10_000 * S;
        // The forward entry was evicted: the reply is collected on its own last_seen.
        let [_, orphan_dead] = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, 0, now - 61 * S);
        let [_, orphan_alive] = flow(CLIENT, 5001, IPPROTO_UDP, CtState::Open, 0, now - 10 * S);
        // The reply entry was evicted: the forward entry alone decides.
        let [lonely, _] = flow(CLIENT, 5002, IPPROTO_UDP, CtState::Open, now - 61 * S, 0);
        let entries = [orphan_dead, orphan_alive, lonely];
        let plan = plan_conntrack(&entries, &t, HAIRPIN, &NO_SNAT, now);
        assert_eq!(plan.orphans, vec![orphan_dead.0]);
        assert_eq!(plan.pairs, vec![(lonely.0, None)]);
        assert_eq!(plan.entries(), 2);
    }

    #[test]
    fn a_hairpin_reply_is_paired_not_orphaned() {
        let t = Timeouts::DEFAULT;
        let now = 100_000 * S;
        let [(fkey, mut fwd), (_, reply)] =
            flow(BACKEND, 4000, IPPROTO_TCP, CtState::Established, now - 7 * 3600 * S, now - 5 * S);
        fwd.flags |= CT_FLAG_HAIRPIN;
        let hkey = reply_key(&fkey, &fwd, HAIRPIN, &NO_SNAT);
        let entries = [(fkey, fwd), (hkey, CtEntryV4 { flags: CT_FLAG_HAIRPIN, ..reply })];
        // The reply is recent, so the pair lives; without the hairpin key the
        // forward entry would look lonely and be deleted.
        let plan = plan_conntrack(&entries, &t, HAIRPIN, &NO_SNAT, now);
        assert!(plan.pairs.is_empty() && plan.orphans.is_empty(), "{plan:?}");
    }

    #[test]
    fn affinity_entries_expire_with_their_frontend() {
        let now = 10_000 * S;
        let entry = |client: u8, rev_nat_id: RevNatId, used_ago: u64| {
            (
                AffinityKeyV4 { client: [10, 244, 0, client], rev_nat_id },
                AffinityValueV4 { last_used_ns: now - used_ago, backend_id: 1, slot: 0 },
            )
        };
        let frontends: BTreeMap<RevNatId, (u16, u32)> =
            [(1, (SVC_FLAG_AFFINITY, 100)), (2, (0, 100)), (3, (SVC_FLAG_AFFINITY | 2, 10))].into();
        let entries = [
            entry(1, 1, 99 * S),  // kept
            entry(2, 1, 101 * S), // timed out
            entry(3, 2, 0),       // frontend lost its affinity
            entry(4, 9, 0),       // frontend gone
            entry(5, 3, 10 * S),  // kept (exactly the timeout)
            entry(6, 3, 11 * S),  // timed out
        ];
        let deleted: Vec<u8> = plan_affinity(&entries, &frontends, now).iter().map(|k| k.client[3]).collect();
        assert_eq!(deleted, [2, 3, 4, 6]);
    }

    #[test]
    fn ipv6_affinity_entries_expire_by_the_same_rule() {
        let now = 10_000 * S;
        let entry = |client: u8, rev_nat_id: RevNatId, used_ago: u64| {
            let mut addr = [0u8; 16];
            addr[..2].copy_from_slice(&[0xfd, 0x00]);
            addr[15] = client;
            (
                AffinityKeyV6 { client: addr, rev_nat_id },
                AffinityValueV4 { last_used_ns: now - used_ago, backend_id: 1, slot: 0 },
            )
        };
        // Ids are shared: 1 is an IPv4 frontend's, 7 an IPv6 one's, in the one table.
        let frontends: BTreeMap<RevNatId, (u16, u32)> =
            [(1, (SVC_FLAG_AFFINITY, 100)), (7, (SVC_FLAG_AFFINITY, 30)), (8, (0, 30))].into();
        let entries = [
            entry(1, 7, 30 * S), // kept (exactly the timeout)
            entry(2, 7, 31 * S), // timed out
            entry(3, 8, 0),      // frontend lost its affinity
            entry(4, 9, 0),      // frontend gone
            entry(5, 1, 99 * S), // kept: keyed by an IPv4 cluster IP's id
        ];
        let deleted: Vec<u8> =
            plan_affinity(&entries, &frontends, now).iter().map(|k| k.client[15]).collect();
        assert_eq!(deleted, [2, 3, 4]);
    }

    #[test]
    fn purge_takes_both_directions_of_the_backends_flows_only() {
        let a = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, 0, 0);
        let mut b = flow(CLIENT, 5001, IPPROTO_UDP, CtState::Open, 0, 0);
        b[0].1.backend_id = 8;
        b[1].1.backend_id = 8;
        // An orphan reply of backend 7.
        let [_, mut orphan] = flow(CLIENT, 5002, IPPROTO_UDP, CtState::Open, 0, 0);
        orphan.1.backend_id = 7;
        // A reply entry written without backend_id is still found through its forward entry.
        let mut c = flow(CLIENT, 5003, IPPROTO_UDP, CtState::Open, 0, 0);
        c[1].1.backend_id = 0;
        let entries = [a[0], a[1], b[0], b[1], orphan, c[0], c[1]];
        let keys = plan_purge(&entries, &[7].into(), HAIRPIN, &NO_SNAT);
        assert_eq!(keys, vec![a[0].0, c[0].0, a[1].0, c[1].0, orphan.0]);
        assert!(plan_purge(&entries, &BTreeSet::new(), HAIRPIN, &NO_SNAT).is_empty());
        // Forward keys come before reply keys.
        let first_reply = keys.iter().position(|k| k.direction == CT_DIR_REPLY).unwrap();
        assert!(keys[first_reply..].iter().all(|k| k.direction == CT_DIR_REPLY));
    }

    #[test]
    fn ipv6_pairs_expire_on_their_later_last_seen_and_orphans_on_their_own() {
        let t = Timeouts::DEFAULT;
        let now = 10_000 * S;
        let seen = |mut f: [(CtKeyV6, CtEntryV6); 2], fwd: u64, reply: u64| {
            f[0].1.last_seen_ns = fwd;
            f[1].1.last_seen_ns = reply;
            f
        };
        // UDP (60 s): the backend answered 30 s ago, so the pair lives though the client is idle 100 s.
        let alive = seen(flow6(5000, IPPROTO_UDP, 3), now - 100 * S, now - 30 * S);
        // Both sides idle past 60 s: both entries go, under OPEN.
        let dead = seen(flow6(5001, IPPROTO_UDP, 3), now - 61 * S, now - 70 * S);
        // A reply whose forward entry was evicted, idle 61 s; another idle 10 s.
        let [_, orphan_dead] = seen(flow6(5002, IPPROTO_UDP, 3), 0, now - 61 * S);
        let [_, orphan_alive] = seen(flow6(5003, IPPROTO_UDP, 3), 0, now - 10 * S);
        let entries = [alive[0], alive[1], dead[0], dead[1], orphan_dead, orphan_alive];
        let none = Snat6Index::new();
        let reply_of = |k: &CtKeyV6, e: &CtEntryV6| reply_key6(k, e, &none);
        let plan = plan_conntrack_pairs(&entries, &t, reply_of, now);
        assert_eq!(plan.pairs, vec![(dead[0].0, Some(dead[1].0))]);
        assert_eq!(plan.orphans, vec![orphan_dead.0]);
        assert_eq!((plan.by_state.get("OPEN"), plan.entries(), plan.scanned), (Some(&3), 3, 6));
        // A hairpin flow's reply (to HAIRPIN_ADDR_V6) is paired, not taken for an orphan.
        let [(fkey, mut fwd), (_, reply)] = seen(flow6(5004, IPPROTO_UDP, 3), now - 100 * S, now - 5 * S);
        fwd.flags |= CT_FLAG_HAIRPIN;
        let entries = [(fkey, fwd), (reply_of(&fkey, &fwd), reply)];
        let plan = plan_conntrack_pairs(&entries, &Timeouts { udp_ns: 6 * S, ..t }, reply_of, now);
        assert!(plan.pairs.is_empty() && plan.orphans.is_empty(), "{plan:?}");
    }

    /// A flow whose source port was remapped (port reuse) has its reply entry under the remapped
    /// port (SNAT_V6 names it): the pair lives on the reply's last_seen, and the reply is no orphan.
    /// Without SNAT_V6's entry the two would be judged apart — the forward entry expired under a
    /// live flow.
    #[test]
    fn a_remapped_ipv6_flow_is_paired_through_snat_v6() {
        let t = Timeouts::DEFAULT;
        let now = 10_000 * S;
        let [(fkey, mut fwd), (rkey, mut reply)] = flow6(5005, IPPROTO_UDP, 3);
        fwd.flags |= CT_FLAG_REMAP;
        fwd.last_seen_ns = now - 100 * S;
        reply.last_seen_ns = now - 5 * S;
        let remapped = CtKeyV6 { dport: 61_234u16.to_be_bytes(), ..rkey };
        let entries = [(fkey, fwd), (remapped, reply)];
        let to_client = SnatEntryV6 { created_ns: 0, addr: fkey.saddr, port: remapped.dport, _pad: [0; 6] };
        let snat6 = Snat6Index::from([(fkey, to_client)]);
        let plan = plan_conntrack_pairs(&entries, &t, |k, e| reply_key6(k, e, &snat6), now);
        assert!(plan.pairs.is_empty() && plan.orphans.is_empty(), "{plan:?}");
        // Idle on both sides: the pair goes together.
        let later = now + 61 * S;
        let plan = plan_conntrack_pairs(&entries, &t, |k, e| reply_key6(k, e, &snat6), later);
        assert_eq!((plan.pairs, plan.orphans), (vec![(fkey, Some(remapped))], vec![]));
        // The old pairing (no SNAT_V6 index): the forward entry expires alone under a live flow.
        let none = Snat6Index::new();
        let plan = plan_conntrack_pairs(&entries, &t, |k, e| reply_key6(k, e, &none), now);
        assert_eq!(plan.pairs, vec![(fkey, None)]);
    }

    /// A north–south flow source-NATed to a remote backend has its reply entry under the node
    /// address and port it took (SNAT_V6 names both): paired through them, as the datapath pairs
    /// it, and the purge of its backend takes both entries.
    #[test]
    fn a_source_nated_ipv6_flow_is_paired_through_snat_v6() {
        let t = Timeouts::DEFAULT;
        let now = 10_000 * S;
        let [(fkey, mut fwd), (rkey, mut reply)] = flow6(5006, IPPROTO_UDP, 3);
        fwd.flags |= CT_FLAG_SNAT;
        fwd.last_seen_ns = now - 100 * S;
        reply.last_seen_ns = now - 5 * S;
        let node = [0xfd, 0, 0, 0x72, 0, 0x18, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        let nated = CtKeyV6 { daddr: node, dport: 31_000u16.to_be_bytes(), ..rkey };
        let entries = [(fkey, fwd), (nated, reply)];
        let to_node = SnatEntryV6 { created_ns: 0, addr: node, port: nated.dport, _pad: [0; 6] };
        let snat6 = Snat6Index::from([(fkey, to_node)]);
        assert_eq!(reply_key6(&fkey, &fwd, &snat6), nated);
        assert!(owns_snat6(&fkey, &fwd, &snat6));
        let plan = plan_conntrack_pairs(&entries, &t, |k, e| reply_key6(k, e, &snat6), now);
        assert!(plan.pairs.is_empty() && plan.orphans.is_empty(), "the backend still answers: {plan:?}");
        let plan = plan_conntrack_pairs(&entries, &t, |k, e| reply_key6(k, e, &snat6), now + 61 * S);
        assert_eq!((plan.pairs, plan.orphans), (vec![(fkey, Some(nated))], vec![]));
        let purged = plan_purge6(&entries, &[fwd.backend_id].into(), &snat6);
        assert_eq!(purged, vec![fkey, nated]);
    }

    /// SNAT_V6 translations outlive their flow when the LRU evicts its conntrack entries: a flow's
    /// two go once neither of its conntrack entries is left — not while one is (the datapath puts
    /// the other back from it), and not in the moment between the datapath taking the port and
    /// recording the flow.
    #[test]
    fn stale_snat_v6_translations_go_with_the_last_of_their_flows_conntrack_entries() {
        let now = 1_000 * S;
        // A remapped flow from `sport` on `port`: its conntrack keys and its two translations.
        let remapped = |sport: u16, port: u16, created_ns: u64| {
            let [(fkey, _), (rkey, _)] = flow6(sport, IPPROTO_TCP, 3);
            let rkey = CtKeyV6 { dport: port.to_be_bytes(), ..rkey };
            let to =
                |addr, port: u16| SnatEntryV6 { created_ns, addr, port: port.to_be_bytes(), _pad: [0; 6] };
            ([fkey, rkey], [(fkey, to(fkey.saddr, port)), (rkey, to(fkey.saddr, sport))])
        };
        let (live, live_snat) = remapped(5007, 61_007, now - 60 * S);
        let (gone, gone_snat) = remapped(5008, 61_008, now - 60 * S);
        let (_, fresh_snat) = remapped(5009, 61_009, now - S / 10);
        let translations: Vec<_> = [live_snat, gone_snat, fresh_snat].concat();
        let keys = |stale: Vec<(CtKeyV6, u64)>| stale.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        // One conntrack entry of each of the two older flows is left: every translation stays.
        let tracked: HashSet<CtKeyV6> = [live[0], gone[1]].into();
        assert!(keys(plan_stale_snat(&translations, |k| tracked.contains(k), now)).is_empty());
        let tracked: HashSet<CtKeyV6> = [live[1], gone[0]].into();
        assert!(keys(plan_stale_snat(&translations, |k| tracked.contains(k), now)).is_empty());
        // Both of one flow's gone: its two translations go, the fresh flow's only a second later.
        let tracked: HashSet<CtKeyV6> = live.into();
        let stale = plan_stale_snat(&translations, |k| tracked.contains(k), now);
        assert_eq!(keys(stale.clone()), gone.to_vec());
        assert_eq!(stale[0].1, now - 60 * S, "with the created_ns it was read with");
        let later = keys(plan_stale_snat(&translations, |k| tracked.contains(k), now + S));
        assert_eq!(later, [gone.to_vec(), fresh_snat.map(|(k, _)| k).to_vec()].concat());
    }

    /// IPv4's source-NATed flows (a NodePort reached from outside, SNATed to the node): a flow
    /// whose reply entry alone was evicted keeps both translations — the next forward packet puts
    /// the reply entry back from them — and a flow with neither entry left loses both.
    #[test]
    fn stale_snat_v4_translations_go_with_the_last_of_their_flows_conntrack_entries() {
        let now = 1_000 * S;
        let node = [192, 168, 1, 10];
        let nated = |sport: u16, port: u16| {
            let [(fkey, _), (rkey, _)] = flow(CLIENT, sport, IPPROTO_TCP, CtState::Established, 0, 0);
            let rkey = CtKeyV4 { daddr: node, dport: port.to_be_bytes(), ..rkey };
            let to = |addr, port: u16| SnatEntryV4 {
                created_ns: now - 60 * S,
                addr,
                port: port.to_be_bytes(),
                _pad: [0; 2],
            };
            ([fkey, rkey], [(fkey, to(node, port)), (rkey, to(CLIENT, sport))])
        };
        let (half, half_snat) = nated(4001, 32_001);
        let (gone, gone_snat) = nated(4002, 32_002);
        let translations: Vec<_> = [half_snat, gone_snat].concat();
        // The first flow's reply entry was evicted, the second's two both.
        let tracked: HashSet<CtKeyV4> = [half[0]].into();
        let stale = plan_stale_snat(&translations, |k| tracked.contains(k), now);
        assert_eq!(stale, vec![(gone[0], now - 60 * S), (gone[1], now - 60 * S)]);

        // A flow translated before the per-flow key: its forward translation is keyed by the tuple
        // after DNAT, which no conntrack entry has; its forward conntrack entry still names it.
        let [(fkey, mut fwd), _] = flow(CLIENT, 4003, IPPROTO_TCP, CtState::Established, 0, 0);
        fwd.flags |= CT_FLAG_SNAT;
        let legacy = legacy_snat_forward_key(&fkey, fwd.nat_addr, fwd.nat_port);
        let (_, [(_, to_node), reverse]) = nated(4003, 32_003);
        let translations = [(legacy, to_node), reverse];
        let mut tracked: HashSet<CtKeyV4> = [fkey].into();
        assert!(
            !plan_stale_snat(&translations, |k| tracked.contains(k), now).is_empty(),
            "unknown without it"
        );
        let entries = [(fkey, fwd)];
        let legacy_keys: Vec<CtKeyV4> = legacy_forward_keys(&entries, &tracked).collect();
        assert_eq!(legacy_keys, vec![legacy]);
        tracked.extend(legacy_keys);
        assert!(plan_stale_snat(&translations, |k| tracked.contains(k), now).is_empty());
        // Gone altogether: both go.
        let none = HashSet::new();
        assert_eq!(legacy_forward_keys(&entries, &none).count(), 0);
        assert_eq!(plan_stale_snat(&translations, |k| none.contains(k), now).len(), 2);
    }

    #[test]
    fn ipv6_purge_takes_both_directions_of_the_removed_backends_flows() {
        let a = flow6(5000, IPPROTO_UDP, 3);
        let mut b = flow6(5001, IPPROTO_UDP, 3);
        b[0].1.backend_id = 18;
        b[1].1.backend_id = 18;
        let [_, orphan] = flow6(5002, IPPROTO_UDP, 3);
        let entries = [a[0], a[1], b[0], b[1], orphan];
        let none = Snat6Index::new();
        assert_eq!(plan_purge6(&entries, &[17].into(), &none), vec![a[0].0, a[1].0, orphan.0]);
        assert_eq!(plan_purge6(&entries, &[18].into(), &none), vec![b[0].0, b[1].0]);
        assert!(
            plan_purge6(&entries, &[7].into(), &none).is_empty(),
            "an IPv4 backend's id names no IPv6 flow"
        );
    }

    #[test]
    fn the_fuller_table_paces_the_gc() {
        assert_eq!(fuller((10, 100), (95, 100)), (95, 100));
        assert_eq!(fuller((950, 1000), (10, 262_144)), (950, 1000));
        assert_eq!(fuller((5, 100), (5, 0)), (5, 100), "a table of unknown capacity is not full");
    }

    #[test]
    fn interval_adapts_within_its_bounds() {
        let mut i = Interval::new(Duration::from_secs(30));
        assert_eq!((i.min, i.max), (Interval::MIN, Interval::MAX));
        // More than 25 % deleted: halve.
        assert_eq!(i.next(30, 100, 70, 1000), Duration::from_secs(15));
        assert_eq!(i.next(30, 100, 70, 1000), Duration::from_secs_f64(7.5));
        assert_eq!(i.next(30, 100, 70, 1000), Duration::from_secs(5), "never below the minimum");
        assert_eq!(i.next(30, 100, 70, 1000), Duration::from_secs(5));
        // Between 5 % and 25 %: unchanged.
        assert_eq!(i.next(10, 100, 90, 1000), Duration::from_secs(5));
        // Under 5 %: grow by 1.5×, up to 5 min.
        assert_eq!(i.next(1, 100, 99, 1000), Duration::from_secs_f64(7.5));
        for _ in 0..20 {
            i.next(0, 100, 100, 1000);
        }
        assert_eq!(i.current, Interval::MAX);
        // An empty table grows too.
        let mut e = Interval::new(Duration::from_secs(10));
        assert_eq!(e.next(0, 0, 0, 1000), Duration::from_secs(15));
        // A table over 90 % full halves even when little was deleted.
        assert_eq!(i.next(0, 950, 950, 1000), Duration::from_secs(150));
        assert_eq!(i.next(0, 900, 900, 1000), Duration::from_secs(225), "exactly 90 % is not over");
        // A short interval asked for (tests) lowers the minimum to it.
        let mut fast = Interval::new(Duration::from_secs(1));
        assert_eq!(fast.min, Duration::from_secs(1));
        assert_eq!(fast.next(50, 100, 50, 1000), Duration::from_secs(1));
        let slow = Interval::new(Duration::from_secs(600));
        assert_eq!(slow.max, Duration::from_secs(600));
    }

    #[test]
    fn eviction_estimate_is_clamped() {
        assert_eq!(evicted_estimate(100, 50, 10, 100), 40);
        assert_eq!(evicted_estimate(100, 150, 10, 100), 0);
        assert_eq!(evicted_estimate(0, 0, 0, 10), 0);
    }
}
