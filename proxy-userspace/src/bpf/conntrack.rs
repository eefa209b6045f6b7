//! The conntrack view shared by the agent's garbage collection and the operator commands: the pairs of
//! CONNTRACK_V4 (a forward entry and its reply, found through SNAT_V4 for source-NATed flows) and of
//! CONNTRACK_V6 (a remapped or source-NATed flow's reply found through SNAT_V6), their age and time
//! left, reading and deleting them. The decisions are generic over the family ([`CtKey`], [`CtEntry`]); the families differ only in how a forward entry
//! names its reply ([`reply_key`], [`reply_key6`]). Times are CLOCK_MONOTONIC nanoseconds
//! ([`monotonic_ns`]), the clock of `bpf_ktime_get_ns`.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    hash::Hash,
};

use anyhow::{Context as _, Result};
use aya::maps::{IterableMap as _, MapError};
use proxy_common::{
    conntrack::{CtState, Timeouts},
    maps::{
        CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, ConfigV4, CtEntryV4, CtKeyV4, DEFAULT_HAIRPIN_ADDR,
        RevNatId, SnatEntryV4, reply_key_in_snat, snat_forward_key, snat_reply_key,
    },
    maps_v6::{CtEntryV6, CtKeyV6, HAIRPIN_ADDR_V6, SnatEntryV6},
};

use super::{Maps, remove_present};

/// What the conntrack view reads of a key, whatever its family.
pub trait CtKey: Copy + Eq + Hash {
    fn direction(&self) -> u8;
}

/// What the conntrack view reads of an entry, whatever its family.
pub trait CtEntry {
    fn last_seen_ns(&self) -> u64;
    fn state(&self) -> u8;
    fn backend_id(&self) -> u32;
    fn rev_nat_id(&self) -> RevNatId;
}

macro_rules! conntrack_family {
    ($key:ty, $entry:ty) => {
        impl CtKey for $key {
            fn direction(&self) -> u8 {
                self.direction
            }
        }
        impl CtEntry for $entry {
            fn last_seen_ns(&self) -> u64 {
                self.last_seen_ns
            }
            fn state(&self) -> u8 {
                self.state
            }
            fn backend_id(&self) -> u32 {
                self.backend_id
            }
            fn rev_nat_id(&self) -> RevNatId {
                self.rev_nat_id
            }
        }
    };
}
conntrack_family!(CtKeyV4, CtEntryV4);
conntrack_family!(CtKeyV6, CtEntryV6);

/// SNAT_V4's forward entries (`client → backend` after DNAT), by key.
pub type SnatIndex = BTreeMap<KeyOrd, SnatEntryV4>;

/// For callers with no source-NATed flows to resolve.
pub static NO_SNAT: SnatIndex = BTreeMap::new();

/// The forward entries of SNAT_V4, for [`reply_key`].
pub fn snat_index(maps: &Maps) -> SnatIndex {
    maps.snat
        .iter()
        .filter_map(|e| e.ok())
        .filter(|(k, _)| k.direction == CT_DIR_FORWARD)
        .map(|(k, v)| (key_ord(&k), v))
        .collect()
}

/// The reply key of a forward entry: `backend → client`; for a hairpin
/// flow (the client reached itself; its source was rewritten)
/// `backend → hairpin address`, with the client's port either way; for a
/// source-NATed flow `backend → node address:SNAT port`, and for a remapped
/// one `backend → client:remapped port`, from `snat`.
pub fn reply_key(forward: &CtKeyV4, entry: &CtEntryV4, hairpin_addr: [u8; 4], snat: &SnatIndex) -> CtKeyV4 {
    let mut key = forward.reply_of(entry.nat_addr, entry.nat_port);
    if entry.flags & CT_FLAG_HAIRPIN != 0 {
        key.daddr = hairpin_addr;
    }
    if reply_key_in_snat(entry.flags)
        && let Some(to_node) = snat.get(&key_ord(&snat_forward_key(forward)))
    {
        key = snat_reply_key(forward.proto, entry.nat_addr, entry.nat_port, to_node.addr, to_node.port);
    }
    key
}

/// SNAT_V6's forward entries: a remapped or source-NATed IPv6 flow's own key → the address and
/// port it became (the client's own address for a remapped port, a node address for source NAT).
pub type Snat6Index = HashMap<CtKeyV6, SnatEntryV6>;

/// The forward entries of SNAT_V6, for [`reply_key6`].
pub fn snat6_index(maps: &Maps) -> Snat6Index {
    maps.snat_v6.iter().filter_map(|e| e.ok()).filter(|(k, _)| k.direction == CT_DIR_FORWARD).collect()
}

/// The reply key of an IPv6 forward entry: `backend → client`, or `backend → HAIRPIN_ADDR_V6` for a
/// hairpin flow, with the client's port — or, for a flow whose source was rewritten (a remapped
/// port, `CT_FLAG_REMAP`, or source NAT to a node address, `CT_FLAG_SNAT`), the address and port
/// it became, from `snat6`, as the datapath's `conntrack6::reply_key`.
pub fn reply_key6(forward: &CtKeyV6, entry: &CtEntryV6, snat6: &Snat6Index) -> CtKeyV6 {
    let mut key = forward.reply_of(entry.nat_addr, entry.nat_port);
    if entry.flags & CT_FLAG_HAIRPIN != 0 {
        key.daddr = HAIRPIN_ADDR_V6;
    }
    if reply_key_in_snat(entry.flags)
        && let Some(to) = snat6.get(forward)
    {
        key.daddr = to.addr;
        key.dport = to.port;
    }
    key
}

/// Whether a forward entry's flow owns SNAT_V6 entries (its source was rewritten and `snat6` has it).
pub fn owns_snat6(forward: &CtKeyV6, entry: &CtEntryV6, snat6: &Snat6Index) -> bool {
    forward.direction == CT_DIR_FORWARD && reply_key_in_snat(entry.flags) && snat6.contains_key(forward)
}

/// Forgets both SNAT_V6 entries of a remapped or source-NATed IPv6 flow: its own key and its reply key.
pub fn delete_snat6(maps: &mut Maps, forward: &CtKeyV6, reply: &CtKeyV6) -> Result<()> {
    remove_present(&mut maps.snat_v6, forward).context("deleting an SNAT_V6 entry")?;
    remove_present(&mut maps.snat_v6, reply).context("deleting an SNAT_V6 entry")?;
    Ok(())
}

/// Deletes the IPv6 conntrack entries `keys` (read as `entries`), and with a remapped or source-NATed
/// flow's forward entry its two SNAT_V6 entries. Returns the conntrack entries
/// deleted.
pub fn delete6_flows(
    maps: &mut Maps,
    entries: &[(CtKeyV6, CtEntryV6)],
    keys: &[CtKeyV6],
    snat6: &Snat6Index,
) -> Result<u64> {
    let remapped: HashMap<CtKeyV6, CtKeyV6> = entries
        .iter()
        .filter(|(k, e)| owns_snat6(k, e, snat6))
        .map(|(k, e)| (*k, reply_key6(k, e, snat6)))
        .collect();
    let mut deleted = 0;
    for key in keys {
        deleted += u64::from(delete6(maps, key)?);
        if let Some(reply) = remapped.get(key) {
            delete_snat6(maps, key, reply)?;
        }
    }
    Ok(deleted)
}

/// The hairpin address the datapath uses: CONFIG's, or the default when unset.
pub fn hairpin_addr(config: &ConfigV4) -> [u8; 4] {
    if config.hairpin_addr == [0; 4] { DEFAULT_HAIRPIN_ADDR } else { config.hairpin_addr }
}

/// The label of an entry's state in metrics and dumps.
pub fn state_name(state: u8) -> &'static str {
    CtState::from_u8(state).map_or("UNKNOWN", CtState::name)
}

/// When a flow was last active: the later `last_seen` of its two entries.
pub fn pair_last_seen<E: CtEntry>(forward: &E, reply: Option<&E>) -> u64 {
    reply.map_or(forward.last_seen_ns(), |r| r.last_seen_ns().max(forward.last_seen_ns()))
}

/// Whether a flow is dead at `now`: idle longer than the timeout of the
/// forward entry's state (where the state lives). A `last_seen` after `now`
/// (the datapath touched the entry after `now` was read) is not expiry.
pub fn pair_expired<E: CtEntry>(timeouts: &Timeouts, forward: &E, reply: Option<&E>, now: u64) -> bool {
    timeouts.expired(forward.state(), pair_last_seen(forward, reply), now)
}

/// Nanoseconds before the flow expires (0 when it already has).
pub fn time_left_ns<E: CtEntry>(timeouts: &Timeouts, forward: &E, reply: Option<&E>, now: u64) -> u64 {
    let timeout = match CtState::from_u8(forward.state()) {
        Some(state) => timeouts.for_state(state),
        None => timeouts.tcp_closing_ns,
    };
    let idle = now.saturating_sub(pair_last_seen(forward, reply));
    timeout.saturating_sub(idle)
}

/// Forward entries matching `wanted` (then their replies), and reply
/// entries matching it themselves; forward keys first, each key once.
pub fn select(
    entries: &[(CtKeyV4, CtEntryV4)],
    hairpin_addr: [u8; 4],
    snat: &SnatIndex,
    wanted: impl Fn(&CtKeyV4, &CtEntryV4) -> bool,
) -> Vec<CtKeyV4> {
    select_pairs(entries, |key, entry| reply_key(key, entry, hairpin_addr, snat), wanted)
}

/// [`select`] for either family: `reply_of` names a forward entry's reply key.
pub fn select_pairs<K: CtKey, E: CtEntry>(
    entries: &[(K, E)],
    reply_of: impl Fn(&K, &E) -> K,
    wanted: impl Fn(&K, &E) -> bool,
) -> Vec<K> {
    let present: HashSet<K> = entries.iter().map(|(k, _)| *k).collect();
    let mut seen = HashSet::new();
    let mut forward = Vec::new();
    let mut reply = Vec::new();
    for (key, entry) in entries {
        if key.direction() == CT_DIR_FORWARD && wanted(key, entry) {
            if seen.insert(*key) {
                forward.push(*key);
            }
            let rkey = reply_of(key, entry);
            if present.contains(&rkey) && seen.insert(rkey) {
                reply.push(rkey);
            }
        }
    }
    for (key, entry) in entries {
        if key.direction() == CT_DIR_REPLY && wanted(key, entry) && seen.insert(*key) {
            reply.push(*key);
        }
    }
    forward.extend(reply);
    forward
}

pub type KeyOrd = ([u8; 4], [u8; 4], [u8; 2], [u8; 2], u8, u8);

pub fn key_ord(k: &CtKeyV4) -> KeyOrd {
    (k.saddr, k.daddr, k.sport, k.dport, k.proto, k.direction)
}

/// The timeouts in CONFIG[0] (defaults for zero fields or an unreadable map).
pub fn read_config(maps: &Maps) -> ConfigV4 {
    maps.config.get(&0, 0).unwrap_or_default()
}

pub fn read_conntrack(maps: &Maps) -> Result<Vec<(CtKeyV4, CtEntryV4)>> {
    let mut entries = Vec::new();
    for entry in maps.conntrack.iter() {
        match entry {
            Ok(pair) => entries.push(pair),
            // The datapath (or the LRU) deleted the key while we iterated.
            Err(MapError::KeyNotFound) => continue,
            Err(e) => return Err(e).context("reading the conntrack map"),
        }
    }
    Ok(entries)
}

pub fn read_conntrack6(maps: &Maps) -> Result<Vec<(CtKeyV6, CtEntryV6)>> {
    let mut entries = Vec::new();
    for entry in maps.conntrack_v6.iter() {
        match entry {
            Ok(pair) => entries.push(pair),
            Err(MapError::KeyNotFound) => continue,
            Err(e) => return Err(e).context("reading the IPv6 conntrack map"),
        }
    }
    Ok(entries)
}

/// Deletes both SNAT_V4 entries of a source-NATed flow.
pub fn delete_snat(maps: &mut Maps, forward_key: &CtKeyV4, forward: &CtEntryV4) {
    let key = snat_forward_key(forward_key);
    if let Ok(to_node) = maps.snat.get(&key, 0) {
        let reverse =
            snat_reply_key(key.proto, forward.nat_addr, forward.nat_port, to_node.addr, to_node.port);
        let _ = maps.snat.remove(&reverse);
    }
    let _ = maps.snat.remove(&key);
}

pub fn delete(maps: &mut Maps, key: &CtKeyV4) -> Result<bool> {
    remove_present(&mut maps.conntrack, key).context("deleting a conntrack entry")
}

pub fn delete6(maps: &mut Maps, key: &CtKeyV6) -> Result<bool> {
    remove_present(&mut maps.conntrack_v6, key).context("deleting an IPv6 conntrack entry")
}

/// An IPv6 entry as it is now (the datapath may have touched it since the scan).
pub fn get6(maps: &Maps, key: &CtKeyV6) -> Option<CtEntryV6> {
    maps.conntrack_v6.get(key, 0).ok()
}

/// CONNTRACK_V4's capacity (max entries); 0 when the kernel does not say.
pub fn capacity(maps: &Maps) -> u64 {
    maps.conntrack.map().info().map_or(0, |i| u64::from(i.max_entries()))
}

/// CONNTRACK_V6's capacity, as [`capacity`].
pub fn capacity6(maps: &Maps) -> u64 {
    maps.conntrack_v6.map().info().map_or(0, |i| u64::from(i.max_entries()))
}

/// The entries CONNTRACK_V6 holds.
pub fn count6(maps: &Maps) -> u64 {
    maps.conntrack_v6.keys().count() as u64
}

/// The estimate behind `kproxy_conntrack_evicted_total`: every new flow
/// creates two entries; those not deleted by GC, purges or flushes and not
/// present any more were evicted by the LRU (or replaced by the datapath).
/// Counters restart with the agent while `created` does not, so this is an
/// estimate; clamped at 0.
pub fn evicted_estimate(created_flows: u64, gc_deleted: u64, purged: u64, current_entries: u64) -> u64 {
    (2 * created_flows).saturating_sub(gc_deleted).saturating_sub(purged).saturating_sub(current_entries)
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
