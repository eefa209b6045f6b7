//! Every difference between the desired state and the maps: each wanted frontend against its slots and the
//! entries they name, then what no wanted frontend explains (extra frontends, orphan entries), then the VIP
//! counts.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Display,
    net::IpAddr,
};

use proxy_common::maps::{RevNatId, SVC_FLAG_EXTERNAL_ADDR, SVC_FLAG_MAGLEV, ServiceValueV4, VipV4};

use super::render::{
    Key, backend_addr, backend_label, backend_state, frontend_label, list, proto_name, rev_nat_label,
    wanted_name,
};
use super::{Difference, MapState};
use crate::{
    model::{BackendAddr, Desired, Frontend},
    net::{Cidr, Protocol},
    sync::{
        FrontendKey, ServicePortKey, affinity_id, build_maglev_table, cluster_ip_frontends,
        desired_backend_flags, frontend_flags, vip_entries,
    },
};

/// One frontend's services map entries, by slot.
type Slots = BTreeMap<u16, ServiceValueV4>;

/// Every difference between `desired` and `state`, frontends in address order, then orphans.
pub fn compare(desired: &Desired, state: &MapState) -> Vec<Difference> {
    let frontends = &desired.frontends;
    let mut grouped = group_by_frontend(state);
    // Before anything is taken out.
    let per_vip = wanted_vip_entries(&grouped);
    let slot0s: BTreeMap<Key, ServiceValueV4> =
        grouped.iter().filter_map(|(key, slots)| Some((*key, *slots.get(&0)?))).collect();
    let mut comparison = Comparison {
        state,
        out: Vec::new(),
        referenced: BTreeSet::new(),
        used_rev_nat: BTreeSet::new(),
        cluster_ips: cluster_ip_frontends(frontends),
        slot0s,
    };
    for frontend in frontends {
        comparison.wanted_frontend(frontend, &mut grouped);
    }
    comparison.extra_frontends(&grouped);
    comparison.orphan_backends();
    comparison.backend_flags(&desired_backend_flags(frontends));
    comparison.orphan_entries();
    comparison.vip_counts(&per_vip);
    comparison.out
}

/// SERVICE_CIDRS_V4 and SERVICE_CIDRS_V6 (`have`) against the service CIDRs the agent would program (`want`).
pub fn service_cidrs(want: &[Cidr], have: &[Cidr]) -> Option<Difference> {
    let want: BTreeSet<Cidr> = want.iter().copied().collect();
    let have: BTreeSet<Cidr> = have.iter().copied().collect();
    (want != have).then(|| Difference {
        kind: "service-cidrs",
        frontend: String::new(),
        service: String::new(),
        detail: missing_and_extra(&have, &want).join("; "),
    })
}

fn group_by_frontend(state: &MapState) -> BTreeMap<Key, Slots> {
    let mut grouped: BTreeMap<Key, Slots> = BTreeMap::new();
    for (key, value) in &state.services {
        let k = (key.vip, key.port, key.proto, key.scope);
        grouped.entry(k).or_default().insert(key.slot, *value);
    }
    grouped
}

/// What VIPS_V4 (VIPS_V6) should hold for each address with a frontend (slot 0): its cluster-IP
/// frontends, and whether it has north–south ones ([`VipV4`]'s encoding).
fn wanted_vip_entries(grouped: &BTreeMap<Key, Slots>) -> BTreeMap<IpAddr, u32> {
    let masters = grouped.iter().filter_map(|(key, slots)| {
        slots.get(&0).map(|master| (key.0, master.flags & SVC_FLAG_EXTERNAL_ADDR != 0))
    });
    vip_entries(masters).into_iter().map(|(vip, entry)| (vip, entry.frontends)).collect()
}

/// `missing …` for what `want` holds and `have` does not, `extra …` for the reverse; each left out when empty.
fn missing_and_extra<T: Ord + Display>(have: &BTreeSet<T>, want: &BTreeSet<T>) -> Vec<String> {
    let mut parts = Vec::new();
    let missing: Vec<_> = want.difference(have).collect();
    let extra: Vec<_> = have.difference(want).collect();
    if !missing.is_empty() {
        parts.push(format!("missing {}", list(missing)));
    }
    if !extra.is_empty() {
        parts.push(format!("extra {}", list(extra)));
    }
    parts
}

/// Slot 0's flags (but the Maglev bit, the syncer's choice), affinity timeout and affinity id against the wanted
/// ones.
fn slot0_problems(frontend: &Frontend, master: &ServiceValueV4, affinity_id: RevNatId) -> Vec<String> {
    let mut problems = Vec::new();
    let flags = frontend_flags(frontend);
    if master.flags & !SVC_FLAG_MAGLEV != flags {
        problems.push(format!("flags {:#x}, want {flags:#x}", master.flags & !SVC_FLAG_MAGLEV));
    }
    let timeout = frontend.session_affinity_timeout.unwrap_or(0);
    if master.affinity_timeout_s != timeout {
        problems.push(format!("affinity timeout {} s, want {timeout} s", master.affinity_timeout_s));
    }
    if master.named_affinity_id() != affinity_id {
        let id = |id: RevNatId| if id == 0 { "its own".to_owned() } else { format!("rev-NAT id {id}'s") };
        problems.push(format!(
            "keeps affinity under {}, want {} (the Service port's cluster IP)",
            id(master.named_affinity_id()),
            id(affinity_id)
        ));
    }
    problems
}

/// The differences found so far, and what the frontends in the services map were found to use.
struct Comparison<'a> {
    state: &'a MapState,
    out: Vec<Difference>,
    /// Backend ids some slot points at.
    referenced: BTreeSet<u32>,
    /// The rev-NAT ids of the frontends in the services map.
    used_rev_nat: BTreeSet<RevNatId>,
    /// Each wanted Service port's cluster-IP frontend, whose rev-NAT id its other frontends keep affinity under.
    cluster_ips: BTreeMap<ServicePortKey, FrontendKey>,
    /// Slot 0 of every frontend in the services map.
    slot0s: BTreeMap<Key, ServiceValueV4>,
}

/// A wanted frontend, with what its differences name it by.
struct Named<'f> {
    frontend: &'f Frontend,
    key: Key,
    label: String,
    service: String,
}

/// The backends a frontend's slots point at: the active ones (slots `1..=count`) and the terminating ones.
#[derive(Default)]
struct SlotBackends {
    active: BTreeSet<BackendAddr>,
    terminating: BTreeSet<BackendAddr>,
}

impl Comparison<'_> {
    fn push(&mut self, kind: &'static str, frontend: String, service: String, detail: String) {
        self.out.push(Difference { kind, frontend, service, detail });
    }

    fn push_for(&mut self, named: &Named, kind: &'static str, detail: String) {
        self.push(kind, named.label.clone(), named.service.clone(), detail);
    }

    /// One wanted frontend against its slots, the backends they name, its Maglev table, source ranges, slot 0,
    /// and its rev-NAT and names entries.
    fn wanted_frontend(&mut self, frontend: &Frontend, grouped: &mut BTreeMap<Key, Slots>) {
        let key: Key =
            (frontend.vip, frontend.port, frontend.proto.number(), FrontendKey::of(frontend).scope);
        let named = Named { frontend, key, label: frontend_label(&key), service: wanted_name(frontend) };
        let slots = grouped.remove(&key).unwrap_or_default();
        let Some(master) = slots.get(&0).copied() else {
            self.missing_frontend(&named, &slots);
            return;
        };
        self.used_rev_nat.insert(master.rev_nat_id);
        let backends = self.slots(&named, &master, &slots);
        self.backend_sets(&named, &backends);
        if master.flags & SVC_FLAG_MAGLEV != 0 {
            self.maglev_table(&named, &master, &slots);
        }
        self.source_ranges(&named, &master);
        let slot0s = &self.slot0s;
        let affinity_id = affinity_id(frontend, &self.cluster_ips, |ck| {
            slot0s.get(&(ck.vip, ck.port, ck.proto.number(), ck.scope)).map(|v| v.rev_nat_id)
        });
        let slot0 = slot0_problems(frontend, &master, affinity_id);
        if !slot0.is_empty() {
            self.push_for(&named, "slot0", slot0.join("; "));
        }
        self.rev_nat(&named, &master);
        self.name(&named, &master);
    }

    fn missing_frontend(&mut self, named: &Named, slots: &Slots) {
        let frontend = named.frontend;
        let wants = if frontend.backends.is_empty() {
            "no backends (refuses)".to_owned()
        } else {
            format!("{} backends: {}", frontend.backends.len(), list(&frontend.backends))
        };
        let mut detail = format!("not in the services map (wants {wants})");
        if !slots.is_empty() {
            detail.push_str(&format!("; {} slots without slot 0", slots.len()));
            self.referenced.extend(slots.values().map(|v| v.backend_id));
        }
        self.push_for(named, "missing-frontend", detail);
    }

    /// Slots `1..=total`: present, pointing at known backends of the right protocol, with slot 0's rev-NAT id;
    /// and none above the total.
    fn slots(&mut self, named: &Named, master: &ServiceValueV4, slots: &Slots) -> SlotBackends {
        let state = self.state;
        let count = u32::from(master.count);
        let total = count + u32::from(master.terminating_count);
        let mut problems = Vec::new();
        let mut backends = SlotBackends::default();
        for slot in 1..=total {
            let Some(value) = u16::try_from(slot).ok().and_then(|s| slots.get(&s)) else {
                problems.push(format!("slot {slot} missing (count {count}, {total} slots in all)"));
                continue;
            };
            self.referenced.insert(value.backend_id);
            if value.rev_nat_id != master.rev_nat_id {
                problems.push(format!(
                    "slot {slot} has rev-NAT id {}, slot 0 has {}",
                    value.rev_nat_id, master.rev_nat_id
                ));
            }
            let Some(b) = state.backends.get(&value.backend_id) else {
                problems.push(format!(
                    "slot {slot} points at backend {}, not in the backends map",
                    value.backend_id
                ));
                continue;
            };
            if b.proto != named.key.2 {
                problems.push(format!(
                    "slot {slot}: backend {} {} is {}",
                    value.backend_id,
                    backend_label(b),
                    proto_name(b.proto)
                ));
            }
            let set = if slot <= count { &mut backends.active } else { &mut backends.terminating };
            set.insert(backend_addr(b));
        }
        let above: Vec<u16> = slots.keys().copied().filter(|s| u32::from(*s) > total).collect();
        if !above.is_empty() {
            for s in &above {
                self.referenced.insert(slots[s].backend_id);
            }
            problems.push(format!("stale slots {} above the {total} in use", list(&above)));
        }
        if !problems.is_empty() {
            self.push_for(named, "slots", problems.join("; "));
        }
        backends
    }

    /// The active and the terminating backends the slots name against the wanted ones.
    fn backend_sets(&mut self, named: &Named, backends: &SlotBackends) {
        let frontend = named.frontend;
        for (kind, have, want, what) in [
            ("backends", &backends.active, &frontend.backends, "backends"),
            (
                "terminating-backends",
                &backends.terminating,
                &frontend.terminating_backends,
                "terminating backends",
            ),
        ] {
            let want: BTreeSet<BackendAddr> = want.iter().copied().collect();
            if *have == want {
                continue;
            }
            let mut parts = vec![format!("{} {what}, want {}", have.len(), want.len())];
            parts.extend(missing_and_extra(have, &want));
            self.push_for(named, kind, parts.join("; "));
        }
    }

    /// The Maglev table slot 0 names against the table of its active backends, built as the syncer builds it.
    fn maglev_table(&mut self, named: &Named, master: &ServiceValueV4, slots: &Slots) {
        let state = self.state;
        let pairs: Vec<(BackendAddr, u32)> = (1..=master.count)
            .filter_map(|s| slots.get(&s))
            .filter_map(|v| state.backends.get(&v.backend_id).map(|b| (backend_addr(b), v.backend_id)))
            .collect();
        let Some(table) = master.maglev_table() else {
            self.push_for(named, "maglev", "slot 0 has the Maglev flag but names no table".to_owned());
            return;
        };
        let detail = match (
            state.maglev.get(&table),
            build_maglev_table(&pairs, named.frontend.proto, state.maglev_seed),
        ) {
            (None, _) => Some(format!("slot 0 names Maglev table {table}, which cannot be read")),
            (Some(_), Err(e)) => Some(format!("the table of its backends cannot be built: {e:#}")),
            (Some(have), Ok(want)) => {
                let differ = have.iter().zip(&want).filter(|(h, w)| h != w).count();
                (differ > 0).then(|| {
                    format!(
                        "{differ} of {} entries of Maglev table {table} differ from the table of its {} active backends (seed {:#x})",
                        want.len(),
                        pairs.len(),
                        state.maglev_seed
                    )
                })
            }
        };
        if let Some(detail) = detail {
            self.push_for(named, "maglev", detail);
        }
    }

    fn source_ranges(&mut self, named: &Named, master: &ServiceValueV4) {
        let want: BTreeSet<Cidr> = named.frontend.source_ranges.iter().copied().collect();
        let have = self.state.source_ranges.get(&master.rev_nat_id).cloned().unwrap_or_default();
        if want != have {
            self.push_for(named, "source-ranges", missing_and_extra(&have, &want).join("; "));
        }
    }

    fn rev_nat(&mut self, named: &Named, master: &ServiceValueV4) {
        let frontend = named.frontend;
        let id = master.rev_nat_id;
        let want = (frontend.vip, frontend.port, frontend.proto.number());
        let detail = match self.state.rev_nat.get(&id) {
            None => format!("rev-NAT id {id} is not in the rev_nat map"),
            Some(r) if (r.vip, r.port, r.proto) != want => {
                format!("rev-NAT id {id} holds {}", rev_nat_label(r))
            }
            Some(_) => return,
        };
        self.push_for(named, "rev-nat", detail);
    }

    fn name(&mut self, named: &Named, master: &ServiceValueV4) {
        let id = master.rev_nat_id;
        let detail = match self.state.names.get(&id) {
            Some(name) if *name == named.service => return,
            Some(name) => format!("names map has {name:?} for rev-NAT id {id}"),
            None => format!("rev-NAT id {id} has no entry in the names map"),
        };
        self.push_for(named, "name", detail);
    }

    /// The frontends of the services map no wanted frontend took.
    fn extra_frontends(&mut self, grouped: &BTreeMap<Key, Slots>) {
        let state = self.state;
        for (key, slots) in grouped {
            self.referenced.extend(slots.iter().filter(|(s, _)| **s != 0).map(|(_, v)| v.backend_id));
            let label = frontend_label(key);
            let Some(master) = slots.get(&0) else {
                self.push(
                    "extra-frontend",
                    label,
                    String::new(),
                    format!("{} slots without slot 0", slots.len()),
                );
                continue;
            };
            self.used_rev_nat.insert(master.rev_nat_id);
            let ids: Vec<String> = (1..=u32::from(master.count))
                .filter_map(|s| u16::try_from(s).ok().and_then(|s| slots.get(&s)))
                .map(|v| {
                    state
                        .backends
                        .get(&v.backend_id)
                        .map_or_else(|| format!("#{}", v.backend_id), backend_label)
                })
                .collect();
            let backends =
                if ids.is_empty() { "no backends".to_owned() } else { format!("backends {}", list(ids)) };
            self.push(
                "extra-frontend",
                label,
                state.names.get(&master.rev_nat_id).cloned().unwrap_or_default(),
                format!("in the services map but not wanted ({backends})"),
            );
        }
    }

    fn orphan_backends(&mut self) {
        let state = self.state;
        for (id, b) in &state.backends {
            if !self.referenced.contains(id) {
                let detail = format!(
                    "backend {id} {}/{} ({}) is in no slot",
                    backend_label(b),
                    proto_name(b.proto),
                    backend_state(b.flags)
                );
                self.push("orphan-backend", String::new(), String::new(), detail);
            }
        }
    }

    /// The flags of the backends the desired state uses (each backend once).
    fn backend_flags(&mut self, wanted: &BTreeMap<(BackendAddr, Protocol), u8>) {
        let by_addr: BTreeMap<(BackendAddr, u8), (u32, u8)> =
            self.state.backends.iter().map(|(id, b)| ((backend_addr(b), b.proto), (*id, b.flags))).collect();
        for ((addr, proto), flag) in wanted {
            if let Some((id, have)) = by_addr.get(&(*addr, proto.number()))
                && have != flag
            {
                let detail = format!(
                    "backend {id} {addr}/{proto} is {}, want {}",
                    backend_state(*have),
                    backend_state(*flag)
                );
                self.push("backend-flags", String::new(), String::new(), detail);
            }
        }
    }

    /// rev-NAT, source-range and names entries of no frontend.
    fn orphan_entries(&mut self) {
        let state = self.state;
        let name_of = |id: &RevNatId| state.names.get(id).cloned().unwrap_or_default();
        for (id, r) in &state.rev_nat {
            if !self.used_rev_nat.contains(id) {
                let detail = format!("rev-NAT id {id} belongs to no frontend");
                self.push("orphan-rev-nat", rev_nat_label(r), name_of(id), detail);
            }
        }
        for (id, ranges) in &state.source_ranges {
            if !self.used_rev_nat.contains(id) {
                let detail = format!(
                    "source ranges {} of rev-NAT id {id}, which belongs to no frontend",
                    list(ranges)
                );
                self.push("orphan-source-range", String::new(), name_of(id), detail);
            }
        }
        for (id, name) in &state.names {
            if !self.used_rev_nat.contains(id) && !state.rev_nat.contains_key(id) {
                let detail = format!("names entry {id} belongs to no frontend");
                self.push("orphan-name", String::new(), name.clone(), detail);
            }
        }
    }

    /// VIPS_V4 against the services map: what the datapath looks up and refuses must match what it translates.
    fn vip_counts(&mut self, per_vip: &BTreeMap<IpAddr, u32>) {
        let state = self.state;
        for vip in per_vip.keys().chain(state.vips.keys()).collect::<BTreeSet<_>>() {
            let have = state.vips.get(vip).copied();
            let map = if vip.is_ipv4() { "VIPS_V4" } else { "VIPS_V6" };
            let want = per_vip.get(vip).copied();
            if have == want {
                continue;
            }
            let told = |entry: u32| {
                let entry = VipV4 { frontends: entry };
                let north_south = if entry.has_north_south() { " and north–south ones" } else { "" };
                format!("{} cluster-IP frontend(s){north_south}", entry.cluster_ip_frontends())
            };
            let detail = match (have, want) {
                (None, Some(want)) => format!(
                    "{map} has no entry for {vip}, which has {} (its packets are never looked up in the services map: they pass untranslated)",
                    told(want)
                ),
                (Some(have), None) => format!(
                    "{map} has an entry for {vip} ({}), which has no frontend (its ports are refused or looked up for nothing)",
                    told(have)
                ),
                (Some(have), Some(want)) => {
                    format!("{map} holds {} on {vip}, the services map has {}", told(have), told(want))
                }
                (None, None) => continue,
            };
            self.push("vip", vip.to_string(), String::new(), detail);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proxy_common::maps::{
        BACKEND_FLAG_ACTIVE, BackendV4, IPPROTO_TCP, RevNatV4, SCOPE_CLUSTER_IP, SVC_FLAG_AFFINITY,
        ServiceKeyV4, VipV4,
    };

    use super::super::table;
    use super::*;
    use crate::{
        bpf::Store,
        model::{self, ServiceName},
        sync::Syncer,
    };

    /// The maps in memory, so a real [`Syncer`] programs them.
    type Mem = crate::sync::mem_store::MemStore;

    fn state_of(mem: &Mem) -> MapState {
        let services6 = mem.read_services6().unwrap().into_iter().map(|(k, v)| (k.into(), v));
        MapState {
            services: mem
                .read_services()
                .unwrap()
                .into_iter()
                .map(|(k, v)| (k.into(), v))
                .chain(services6)
                .collect(),
            backends: mem
                .backends
                .iter()
                .map(|(id, b)| (*id, (*b).into()))
                .chain(mem.backends6.iter().map(|(id, b)| (*id, (*b).into())))
                .collect(),
            rev_nat: mem
                .rev_nat
                .iter()
                .map(|(id, r)| (*id, (*r).into()))
                .chain(mem.rev_nat6.iter().map(|(id, r)| (*id, (*r).into())))
                .collect(),
            names: mem.names.clone(),
            vips: mem
                .vips
                .iter()
                .map(|(k, v)| (IpAddr::from(*k), v.frontends))
                .chain(mem.vips6.iter().map(|(k, v)| (IpAddr::from(*k), v.frontends)))
                .collect(),
            source_ranges: mem.read_source_ranges().unwrap().into_iter().fold(
                BTreeMap::new(),
                |mut m, (id, r)| {
                    m.entry(id).or_insert_with(BTreeSet::new).insert(r);
                    m
                },
            ),
            maglev: {
                let size = proxy_common::maglev::MAGLEV_TABLE_SIZE;
                let mut tables: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
                for (index, id) in &mem.maglev {
                    let entries = tables.entry(index / size).or_insert_with(|| vec![0; size as usize]);
                    entries[(index % size) as usize] = *id;
                }
                tables
            },
            maglev_seed: MAGLEV_SEED,
            service_cidrs: Vec::new(),
        }
    }

    const MAGLEV_SEED: u32 = 0x6b70_726f;

    fn b(last: u8, port: u16) -> BackendAddr {
        BackendAddr { addr: Ipv4Addr::new(10, 244, 0, last).into(), port }
    }

    fn web(backends: Vec<BackendAddr>) -> Frontend {
        Frontend::new(
            ServiceName { namespace: "default".into(), name: "web".into() },
            "http",
            Ipv4Addr::new(10, 96, 0, 100),
            80,
            Protocol::Tcp,
            backends,
        )
    }

    fn dns(proto: Protocol) -> Frontend {
        Frontend::new(
            ServiceName { namespace: "kube-system".into(), name: "kube-dns".into() },
            if proto == Protocol::Udp { "dns" } else { "dns-tcp" },
            Ipv4Addr::new(10, 96, 0, 10),
            53,
            proto,
            vec![b(21, 53), b(22, 53)],
        )
    }

    fn programmed(desired: &Desired) -> Mem {
        let mut syncer = Syncer::with_store(Mem::default()).unwrap();
        let report = syncer.apply(desired);
        assert!(report.errors.is_empty(), "{report:?}");
        syncer.store().clone()
    }

    #[test]
    fn what_the_syncer_programs_has_no_difference() {
        let mut affinity = web(vec![b(11, 80), b(12, 80)]);
        affinity.session_affinity_timeout = Some(10800);
        affinity.terminating_backends = vec![b(13, 80)];
        let desired = Desired::new(vec![affinity, dns(Protocol::Udp), dns(Protocol::Tcp)]);
        let mem = programmed(&desired);
        assert_eq!(compare(&desired, &state_of(&mem)), vec![]);
        assert_eq!(table(&[]), "no differences\n");
    }

    #[test]
    fn ipv6_frontends_are_compared_with_the_ipv6_maps() {
        let b6 = |last: u16| BackendAddr {
            addr: std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last).into(),
            port: 80,
        };
        let mut web6 = web(vec![b6(0x11), b6(0x12)]);
        web6.vip = "fd00:10:96::100".parse::<IpAddr>().unwrap();
        let desired = Desired::new(vec![web(vec![b(11, 80), b(12, 80)]), web6]);
        let mut mem = programmed(&desired);
        assert_eq!(
            compare(&desired, &state_of(&mem)),
            vec![],
            "a dual-stack Service as the syncer programs it"
        );

        // One IPv6 backend entry lost and the IPv6 VIP count wrong: named with the IPv6 frontend and map.
        let lost = *mem.backends6.keys().next().unwrap();
        mem.backends6.remove(&lost);
        mem.vips6.values_mut().for_each(|v| v.frontends = 2);
        let diff = compare(&desired, &state_of(&mem));
        let kinds: Vec<(&str, &str)> = diff.iter().map(|d| (d.kind, d.frontend.as_str())).collect();
        assert!(kinds.contains(&("slots", "[fd00:10:96::100]:80/TCP")), "{diff:#?}");
        let vip = diff.iter().find(|d| d.kind == "vip").unwrap_or_else(|| panic!("{diff:#?}"));
        assert_eq!(vip.frontend, "fd00:10:96::100");
        assert!(vip.detail.starts_with("VIPS_V6 holds 2 cluster-IP frontend(s)"), "{}", vip.detail);
        // The IPv4 frontend of the same Service is untouched.
        assert!(!diff.iter().any(|d| d.frontend.starts_with("10.96.0.100")), "{diff:#?}");
    }

    /// A NodePort on two node addresses with `externalTrafficPolicy: Local` (its own external-scope
    /// entry), a LoadBalancer IP with source ranges, and Maglev tables for both internal entries.
    fn north_south() -> Desired {
        let mut frontends = Vec::new();
        for vip in [Ipv4Addr::new(192, 168, 1, 10), Ipv4Addr::new(10, 0, 0, 5)] {
            let mut internal = web(vec![b(11, 80), b(12, 80)]);
            (internal.vip, internal.port, internal.kind) = (vip.into(), 30080, model::FrontendKind::NodePort);
            internal.external_local = true;
            let mut external = internal.clone();
            external.scope = model::Scope::External;
            (external.backends, external.local_only) = (vec![b(11, 80)], true);
            frontends.extend([internal, external]);
        }
        let mut lb = web(vec![b(11, 80), b(12, 80)]);
        (lb.vip, lb.kind) = (Ipv4Addr::new(203, 0, 113, 7).into(), model::FrontendKind::LoadBalancer);
        lb.source_ranges = vec!["10.0.0.0/8".parse().unwrap(), "192.168.0.0/16".parse().unwrap()];
        frontends.extend([web(vec![b(11, 80), b(12, 80)]), lb]);
        Desired::new(frontends)
    }

    fn programmed_north_south(desired: &Desired) -> Mem {
        let settings = crate::sync::MaglevSettings { seed: MAGLEV_SEED, tables: 8 };
        let mut syncer = Syncer::with_store(Mem::default()).unwrap().with_maglev(settings);
        let report = syncer.apply(desired);
        assert!(report.errors.is_empty(), "{report:?}");
        syncer.store().clone()
    }

    #[test]
    fn north_south_frontends_as_the_syncer_programs_them_have_no_difference() {
        let desired = north_south();
        let mem = programmed_north_south(&desired);
        assert!(
            mem.services.keys().any(|k| k.3 == proxy_common::maps::SCOPE_EXTERNAL),
            "an external-scope entry"
        );
        assert!(!mem.source_ranges.is_empty() && !mem.maglev.is_empty());
        // Before: every ETP=Local external entry was missing (keyed at scope 0) and extra, every NodePort and
        // LB frontend a VIPS_V4 difference, and every Maglev slot 0 a flags difference.
        assert_eq!(compare(&desired, &state_of(&mem)), vec![]);
    }

    #[test]
    fn ipv6_node_ports_get_maglev_tables_of_their_own_family() {
        let b6 = |last: u16| BackendAddr {
            addr: std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last).into(),
            port: 80,
        };
        let mut node_port6 = web(vec![b6(0x11), b6(0x12), b6(0x13)]);
        (node_port6.vip, node_port6.port, node_port6.kind) =
            ("2001:db8::10".parse::<IpAddr>().unwrap(), 30080, model::FrontendKind::NodePort);
        let mut node_port4 = web(vec![b(11, 80), b(12, 80)]);
        (node_port4.vip, node_port4.port, node_port4.kind) =
            (Ipv4Addr::new(192, 168, 1, 10).into(), 30080, model::FrontendKind::NodePort);
        let desired = Desired::new(vec![node_port4, node_port6]);
        let mut mem = programmed_north_south(&desired);
        let master6 = mem.services6.iter().find(|(k, _)| k.4 == 0).map(|(_, v)| *v).unwrap();
        assert_ne!(master6.flags & SVC_FLAG_MAGLEV, 0, "the IPv6 NodePort uses Maglev");
        let table = master6.maglev_table().expect("a table of its own");
        let base = table * proxy_common::maglev::MAGLEV_TABLE_SIZE;
        let entries: BTreeSet<u32> =
            (0..proxy_common::maglev::MAGLEV_TABLE_SIZE).map(|i| mem.maglev[&(base + i)]).collect();
        let ids6: BTreeSet<u32> = mem.backends6.keys().copied().collect();
        assert_eq!(entries, ids6, "every IPv6 backend has entries, and nothing else does");
        assert_eq!(compare(&desired, &state_of(&mem)), vec![]);

        let entry = base + 5;
        let other = *ids6.iter().find(|id| **id != mem.maglev[&entry]).unwrap();
        mem.maglev.insert(entry, other);
        let diff = compare(&desired, &state_of(&mem));
        assert_eq!(diff.len(), 1, "{diff:#?}");
        assert_eq!((diff[0].kind, diff[0].frontend.as_str()), ("maglev", "[2001:db8::10]:30080/TCP"));
        assert!(diff[0].detail.starts_with("1 of 16381 entries"), "{}", diff[0].detail);
    }

    #[test]
    fn ipv6_source_ranges_are_programmed_in_their_own_trie_and_compared() {
        let b6 = BackendAddr {
            addr: std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0x11).into(),
            port: 80,
        };
        let mut lb6 = web(vec![b6]);
        (lb6.vip, lb6.kind) =
            ("2001:db8:10::10".parse::<IpAddr>().unwrap(), model::FrontendKind::LoadBalancer);
        lb6.source_ranges = vec!["2001:db8:99::/48".parse().unwrap(), "fd00:192:168::/48".parse().unwrap()];
        let desired = Desired::new(vec![lb6]);
        let mut mem = programmed(&desired);
        let master = mem.services6.iter().find(|(k, _)| k.4 == 0).map(|(_, v)| *v).unwrap();
        assert_ne!(master.flags & proxy_common::maps::SVC_FLAG_SOURCE_RANGES, 0);
        let held: Vec<String> = mem
            .source_ranges
            .iter()
            .filter(|(id, _)| *id == master.rev_nat_id)
            .map(|(_, r)| r.to_string())
            .collect();
        assert_eq!(held, ["2001:db8:99::/48", "fd00:192:168::/48"]);
        assert_eq!(compare(&desired, &state_of(&mem)), vec![]);

        mem.source_ranges.remove(&(master.rev_nat_id, "2001:db8:99::/48".parse().unwrap()));
        let diff = compare(&desired, &state_of(&mem));
        assert_eq!(diff.len(), 1, "{diff:#?}");
        assert_eq!(diff[0].frontend, "[2001:db8:10::10]:80/TCP");
        assert_eq!(diff[0].detail, "missing 2001:db8:99::/48");
    }

    #[test]
    fn source_ranges_and_maglev_tables_that_drifted_are_named() {
        let desired = north_south();
        let mut mem = programmed_north_south(&desired);
        let lb = mem.services.iter().find(|(k, _)| k.0 == [203, 0, 113, 7] && k.4 == 0).unwrap().1.rev_nat_id;
        mem.source_ranges.remove(&(lb, "10.0.0.0/8".parse().unwrap()));
        mem.source_ranges.insert((lb, "0.0.0.0/0".parse().unwrap()));
        mem.source_ranges.insert((999, "172.16.0.0/12".parse().unwrap()));
        let first_table_entry = *mem.maglev.keys().next().unwrap();
        let stale = mem.maglev[&first_table_entry];
        let other = mem.backends.keys().copied().find(|id| *id != stale).unwrap();
        mem.maglev.insert(first_table_entry, other);

        let diff = compare(&desired, &state_of(&mem));
        let kinds: Vec<&str> = diff.iter().map(|d| d.kind).collect();
        assert_eq!(kinds, ["maglev", "source-ranges", "orphan-source-range"], "{diff:#?}");
        assert!(diff[0].detail.starts_with("1 of "), "{}", diff[0].detail);
        assert_eq!(diff[1].frontend, "203.0.113.7:80/TCP");
        assert_eq!(diff[1].detail, "missing 10.0.0.0/8; extra 0.0.0.0/0");
        assert!(diff[2].detail.contains("172.16.0.0/12"), "{}", diff[2].detail);
    }

    #[test]
    fn names_missing_and_extra_frontends_and_backends() {
        let before = Desired::new(vec![web(vec![b(11, 80), b(12, 80), b(13, 80)]), dns(Protocol::Udp)]);
        let state = state_of(&programmed(&before));
        // An endpoint went away, the DNS Service is gone and a new Service appeared.
        let mut new = web(vec![]);
        new.service.name = "empty".into();
        new.vip = Ipv4Addr::new(10, 96, 0, 200).into();
        let after = Desired::new(vec![web(vec![b(11, 80), b(12, 80)]), new]);
        let diff = compare(&after, &state);
        let kinds: Vec<(&str, &str)> = diff.iter().map(|d| (d.kind, d.frontend.as_str())).collect();
        assert_eq!(
            kinds,
            vec![
                ("backends", "10.96.0.100:80/TCP"),
                ("missing-frontend", "10.96.0.200:80/TCP"),
                ("extra-frontend", "10.96.0.10:53/UDP"),
            ],
            "{diff:#?}"
        );
        assert_eq!(diff[0].service, "default/web:http");
        assert_eq!(diff[0].detail, "3 backends, want 2; extra 10.244.0.13:80");
        assert!(diff[1].detail.contains("no backends"), "{}", diff[1].detail);
        assert_eq!(diff[2].service, "kube-system/kube-dns:dns");
        let text = table(&diff);
        assert!(text.starts_with("KIND"), "{text}");
        assert!(text.ends_with("3 differences\n"), "{text}");
        let json = serde_json::to_value(&diff).unwrap();
        assert_eq!(json[0]["kind"], "backends");
        assert_eq!(json[1]["frontend"], "10.96.0.200:80/TCP");
    }

    #[test]
    fn service_cidrs_that_differ_are_named() {
        let cidr = |text: &str| text.parse::<Cidr>().unwrap();
        let want = [cidr("10.96.0.0/16"), cidr("10.97.0.0/16")];
        assert_eq!(service_cidrs(&want, &[cidr("10.97.0.0/16"), cidr("10.96.0.0/16")]), None);
        let diff = service_cidrs(&want, &[cidr("10.96.0.0/16"), cidr("192.0.2.0/24")]).unwrap();
        assert_eq!(diff.kind, "service-cidrs");
        assert!(
            diff.detail.contains("10.97.0.0/16") && diff.detail.contains("192.0.2.0/24"),
            "{}",
            diff.detail
        );
        assert!(diff.detail.find("10.97.0.0/16") < diff.detail.find("192.0.2.0/24"), "missing, then extra");
        assert!(service_cidrs(&[], &want).is_some(), "the map holds ranges nothing wants");
        assert!(service_cidrs(&want, &[]).is_some(), "the map holds none");
    }

    #[test]
    fn names_broken_entries() {
        let desired = Desired::new(vec![web(vec![b(11, 80), b(12, 80)]), dns(Protocol::Udp)]);
        let mut mem = programmed(&desired);
        let web_key = |slot| {
            ServiceKeyV4::new([10, 96, 0, 100], 80u16.to_be_bytes(), IPPROTO_TCP, SCOPE_CLUSTER_IP, slot)
        };
        // Slot 0: affinity flag set behind the agent's back; a stale slot 3.
        let mut master = mem.services[&crate::sync::mem_store::ord(&web_key(0))];
        master.flags = SVC_FLAG_AFFINITY;
        master.affinity_timeout_s = 60;
        mem.services.insert(crate::sync::mem_store::ord(&web_key(0)), master);
        let slot1 = mem.services[&crate::sync::mem_store::ord(&web_key(1))];
        mem.services.insert(crate::sync::mem_store::ord(&web_key(3)), slot1);
        // Names and rev-NAT entries lost or wrong, an orphan backend, a wrong VIP count.
        let rev = master.rev_nat_id;
        mem.names.insert(rev, "default/other:http".into());
        let dns_rev = mem.rev_nat.keys().copied().find(|id| *id != rev).unwrap();
        mem.rev_nat.remove(&dns_rev);
        mem.backends.insert(
            99,
            BackendV4 {
                addr: [10, 244, 0, 99],
                port: 80u16.to_be_bytes(),
                proto: IPPROTO_TCP,
                flags: BACKEND_FLAG_ACTIVE,
            },
        );
        mem.vips.insert([10, 96, 0, 10], VipV4 { frontends: 2 });
        mem.rev_nat.insert(
            500,
            RevNatV4 { vip: [10, 96, 0, 7], port: 80u16.to_be_bytes(), proto: IPPROTO_TCP, _pad: 0 },
        );
        let diff = compare(&desired, &state_of(&mem));
        let kinds: Vec<&str> = diff.iter().map(|d| d.kind).collect();
        assert_eq!(
            kinds,
            vec!["rev-nat", "slots", "slot0", "name", "orphan-backend", "orphan-rev-nat", "vip"],
            "{diff:#?}"
        );
        assert!(diff[1].detail.contains("stale slots 3"), "{}", diff[1].detail);
        assert!(diff[2].detail.contains("flags 0x1, want 0x0"), "{}", diff[2].detail);
        assert!(diff[2].detail.contains("affinity timeout 60 s, want 0 s"), "{}", diff[2].detail);
        assert!(diff[3].detail.contains("default/other:http"), "{}", diff[3].detail);
        assert!(diff[4].detail.contains("10.244.0.99:80/TCP"), "{}", diff[4].detail);
        assert!(
            diff[6].detail.contains("holds 2 cluster-IP frontend(s) on 10.96.0.10, the services map has 1"),
            "{}",
            diff[6].detail
        );
    }

    #[test]
    fn names_dangling_slots_and_terminating_sets() {
        let mut frontend = web(vec![b(11, 80)]);
        frontend.terminating_backends = vec![b(12, 80)];
        let desired = Desired::new(vec![frontend]);
        let mut mem = programmed(&desired);
        // The terminating backend's entry disappears: its slot dangles.
        let id = mem.backends.iter().find(|(_, v)| v.addr == [10, 244, 0, 12]).map(|(k, _)| *k).unwrap();
        mem.backends.remove(&id);
        let diff = compare(&desired, &state_of(&mem));
        let kinds: Vec<&str> = diff.iter().map(|d| d.kind).collect();
        assert_eq!(kinds, vec!["slots", "terminating-backends"], "{diff:#?}");
        assert!(diff[0].detail.contains("not in the backends map"), "{}", diff[0].detail);
        assert!(diff[1].detail.contains("missing 10.244.0.12:80"), "{}", diff[1].detail);
    }
}
