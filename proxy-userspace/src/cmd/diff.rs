//! `kproxy dump diff`: what the agent wants against what the maps hold.
//!
//! The desired state is computed exactly as `kproxy agent` computes it (the
//! same sources, label selector and [`model::build_with`]); the maps are read
//! once. Every difference names its frontend (`vip:port/PROTO`) and Service:
//!
//! | kind | meaning |
//! |---|---|
//! | `missing-frontend` | wanted, but the services map has no slot 0 for it |
//! | `extra-frontend` | in the services map, not wanted |
//! | `backends` | the active backends (slots `1..=count`) differ: missing / extra addresses |
//! | `terminating-backends` | the serving-and-terminating ones (slots after `count`) differ |
//! | `slot0` | slot 0's flags or affinity timeout differ |
//! | `slots` | a slot is missing, above the total, points at an unknown backend or another rev-NAT id |
//! | `backend-flags` | a backend is active where it should be terminating, or the reverse |
//! | `rev-nat` | the frontend's rev-NAT entry is missing or names another VIP |
//! | `name` | the names map does not hold `namespace/name:port` for the frontend |
//! | `orphan-backend` | a backend no slot points at |
//! | `orphan-rev-nat`, `orphan-name` | entries of no frontend |
//! | `vip` | VIPS_V4 does not count the cluster-IP frontends the services map holds on a VIP |
//! | `source-ranges` | the source ranges of a LoadBalancer frontend differ: missing / extra ranges |
//! | `orphan-source-range` | a source range of no frontend |
//! | `maglev` | the Maglev table slot 0 names does not hold the table of its active backends |
//!
//! Frontends are keyed as the syncer keys them ([`FrontendKey::of`]: the
//! `externalTrafficPolicy: Local` entry of a north–south address has its own
//! scope), and flags are compared with [`frontend_flags`]; the Maglev bit is
//! the syncer's choice (it depends on free tables) and is checked through
//! the table it points at. VIPS_V4 is checked against the services map (what
//! the datapath refuses must match what it translates) and, as the syncer
//! writes it, counts cluster-IP frontends only, so a missing frontend is
//! reported once, not again as a VIP count.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::PathBuf,
};

use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData, MapError};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::maps::{
    BACKEND_FLAG_TERMINATING, BackendV4, FrontendNameV4, RevNatV4, SCOPE_CLUSTER_IP, SVC_FLAG_EXTERNAL_ADDR,
    SVC_FLAG_MAGLEV, ServiceKeyV4, ServiceValueV4,
};
use serde::Serialize;

use crate::{
    bpf::Maps,
    k8s::api_watch::KubeOptions,
    k8s::manifest::{self, ManifestError, Sourced},
    model::{self, BackendAddr, Desired, Frontend, ModelOptions},
    net::Cidr4,
    net::Protocol,
    sync::{FrontendKey, build_maglev_table, desired_backend_flags, frontend_flags},
};

/// Where the desired state comes from (as `kproxy agent` would read it).
#[derive(clap::Args, Debug, Default)]
pub struct DiffArgs {
    /// dump diff: read Services and EndpointSlices from this file or directory
    /// (as `kproxy agent --manifests`) instead of the API server.
    #[arg(long, conflicts_with_all = ["kubeconfig", "master"])]
    pub manifests: Option<PathBuf>,
    /// dump diff: kubeconfig file (default: in-cluster config, then ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// dump diff: API server URL; overrides the kubeconfig's.
    #[arg(long)]
    pub master: Option<String>,
    /// dump diff: this node's name, for internalTrafficPolicy: Local (as the agent's).
    #[arg(long, env = "NODE_NAME")]
    pub hostname_override: Option<String>,
    /// dump diff: only Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long)]
    pub service_proxy_name: Option<String>,
}

/// One difference between the desired state and the maps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub kind: &'static str,
    /// `vip:port/PROTO`; empty for entries of no frontend (orphans).
    pub frontend: String,
    /// `namespace/name:port` (the wanted one, or the names map's for extras).
    pub service: String,
    pub detail: String,
}

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
}

impl MapState {
    pub fn read(maps: &Maps) -> Result<Self> {
        Ok(Self {
            services: read_all(&maps.services, "services")?,
            backends: read_all(&maps.backends, "backends")?.into_iter().collect(),
            rev_nat: read_all(&maps.rev_nat, "rev_nat")?.into_iter().collect(),
            names: read_all(&maps.names, "names")?
                .into_iter()
                .map(|(id, n): (u16, FrontendNameV4)| (id, n.as_str().to_owned()))
                .collect(),
            vips: read_all(&maps.vips, "VIPs")?
                .into_iter()
                .map(|(vip, v)| (Ipv4Addr::from(vip), v.frontends))
                .collect(),
            source_ranges: BTreeMap::new(),
            maglev: BTreeMap::new(),
            maglev_seed: maps.nodeport_config.get(&0, 0).map(|c| c.maglev_seed).unwrap_or(0),
        }
        .with_source_ranges(maps)?
        .with_maglev_tables(maps))
    }

    fn with_source_ranges(mut self, maps: &Maps) -> Result<Self> {
        for key in maps.source_ranges.keys() {
            let key = key.context("reading the source ranges map")?;
            let data = key.data();
            let prefix_len = key.prefix_len().saturating_sub(proxy_common::maps::SOURCE_RANGE_ID_BITS) as u8;
            if let Some(range) = Cidr4::new(Ipv4Addr::from(data.addr), prefix_len) {
                self.source_ranges.entry(u16::from_be_bytes(data.rev_nat_id)).or_default().insert(range);
            }
        }
        Ok(self)
    }

    /// Reads the tables slot 0s point at (unreadable entries are left out: the diff reports them).
    fn with_maglev_tables(mut self, maps: &Maps) -> Self {
        let size = proxy_common::maglev::MAGLEV_TABLE_SIZE;
        let tables: BTreeSet<u32> = self
            .services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.flags & SVC_FLAG_MAGLEV != 0 && v.backend_id > 0)
            .map(|(_, v)| v.backend_id - 1)
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

/// Every entry; entries deleted while iterating are skipped.
fn read_all<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>, name: &str) -> Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for entry in map.iter() {
        match entry {
            Ok(pair) => out.push(pair),
            Err(MapError::KeyNotFound) => continue,
            Err(e) => return Err(e).with_context(|| format!("reading the {name} map")),
        }
    }
    Ok(out)
}

/// The report, and whether anything differs.
pub fn run(maps: &Maps, args: &DiffArgs, json: bool) -> Result<(String, bool)> {
    let desired = desired(args)?;
    let state = MapState::read(maps)?;
    let differences = compare(&desired, &state);
    let text = if json { serde_json::to_string_pretty(&differences)? + "\n" } else { table(&differences) };
    Ok((text, !differences.is_empty()))
}

/// The differences as a table, or "no differences".
pub fn table(differences: &[Difference]) -> String {
    if differences.is_empty() {
        return "no differences\n".to_owned();
    }
    let rows: Vec<Vec<String>> = differences
        .iter()
        .map(|d| vec![d.kind.to_owned(), d.frontend.clone(), d.service.clone(), d.detail.clone()])
        .collect();
    let mut out = crate::cmd::dump::table(&["KIND", "FRONTEND", "SERVICE", "DETAIL"], &rows);
    let n = differences.len();
    out.push_str(&format!("{n} difference{}\n", if n == 1 { "" } else { "s" }));
    out
}

/// What the agent would program, from the same source it would read.
fn desired(args: &DiffArgs) -> Result<Desired> {
    let (services, slices, source_errors) = match &args.manifests {
        Some(path) => {
            if !path.exists() {
                anyhow::bail!("--manifests {}: no such file or directory", path.display());
            }
            from_files(manifest::load_path(path))
        }
        None => from_cluster(
            &KubeOptions { kubeconfig: args.kubeconfig.clone(), master: args.master.clone(), ..Default::default() },
            args.service_proxy_name.as_deref(),
        )?,
    };
    let options = ModelOptions {
        node_name: args.hostname_override.clone(),
        service_proxy_name: args.service_proxy_name.clone(),
        ..Default::default()
    };
    let (desired, model_errors) = model::build_with(&services, &slices, &options);
    for error in source_errors.iter().chain(&model_errors) {
        tracing::warn!("{error}");
    }
    Ok(desired)
}

type Objects = (Vec<Sourced<Service>>, Vec<Sourced<EndpointSlice>>, Vec<ManifestError>);

/// In the order the agent's file source hands them to the model (by
/// namespace, name, then position), so conflicts resolve the same way.
fn from_files(objects: manifest::Objects) -> Objects {
    fn ordered<T>(
        items: Vec<Sourced<T>>,
        meta: impl Fn(&T) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> Vec<Sourced<T>> {
        let mut keyed: BTreeMap<(String, String, u32), Sourced<T>> = BTreeMap::new();
        for (i, item) in items.into_iter().enumerate() {
            let m = meta(&item.object);
            let key = (m.namespace.clone().unwrap_or_default(), m.name.clone().unwrap_or_default(), i as u32);
            keyed.insert(key, item);
        }
        keyed.into_values().collect()
    }
    (
        ordered(objects.services, |s: &Service| &s.metadata),
        ordered(objects.slices, |s: &EndpointSlice| &s.metadata),
        objects.errors,
    )
}

/// One list of Services and EndpointSlices, with the agent's label selector.
fn from_cluster(options: &KubeOptions, service_proxy_name: Option<&str>) -> Result<Objects> {
    use kube::{Api, api::ListParams};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(async {
        let client = crate::k8s::api_watch::client(options).await?;
        let params = ListParams::default().labels(&crate::k8s::api_watch::label_selector(service_proxy_name));
        let services = Api::<Service>::all(client.clone()).list(&params).await.context("listing Services")?;
        let slices =
            Api::<EndpointSlice>::all(client).list(&params).await.context("listing EndpointSlices")?;
        let sourced = |kind: &str, rv: Option<String>| {
            format!("api-server {kind} (resourceVersion {})", rv.unwrap_or_default())
        };
        let mut services: Vec<Sourced<Service>> = services
            .items
            .into_iter()
            .map(|s| Sourced { origin: sourced("Service", s.metadata.resource_version.clone()), object: s })
            .collect();
        let mut slices: Vec<Sourced<EndpointSlice>> = slices
            .items
            .into_iter()
            .map(|s| Sourced {
                origin: sourced("EndpointSlice", s.metadata.resource_version.clone()),
                object: s,
            })
            .collect();
        services.sort_by(|a, b| {
            (&a.object.metadata.namespace, &a.object.metadata.name)
                .cmp(&(&b.object.metadata.namespace, &b.object.metadata.name))
        });
        slices.sort_by(|a, b| {
            (&a.object.metadata.namespace, &a.object.metadata.name)
                .cmp(&(&b.object.metadata.namespace, &b.object.metadata.name))
        });
        Ok((services, slices, Vec::new()))
    })
}

/// A frontend as the services map keys it.
type Key = (Ipv4Addr, u16, u8, u8);

fn proto_name(n: u8) -> String {
    Protocol::from_number(n).map_or_else(|| format!("proto {n}"), |p| p.name().to_owned())
}

fn frontend_label(key: &Key) -> String {
    let scope = if key.3 == SCOPE_CLUSTER_IP { String::new() } else { format!(" scope {}", key.3) };
    format!("{}:{}/{}{scope}", key.0, key.1, proto_name(key.2))
}

fn backend_label(b: &BackendV4) -> String {
    format!("{}:{}", Ipv4Addr::from(b.addr), u16::from_be_bytes(b.port))
}

fn list<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items.into_iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

/// The wanted name of a frontend in the names map (truncated as the map stores it).
fn wanted_name(frontend: &Frontend) -> String {
    FrontendNameV4::new(&format!("{}:{}", frontend.service, frontend.port_name)).as_str().to_owned()
}

/// Every difference between `desired` and `state`, frontends in address order, then orphans.
pub fn compare(desired: &Desired, state: &MapState) -> Vec<Difference> {
    let mut out = Vec::new();
    let mut push = |kind: &'static str, frontend: String, service: String, detail: String| {
        out.push(Difference { kind, frontend, service, detail });
    };

    let mut grouped: BTreeMap<Key, BTreeMap<u16, ServiceValueV4>> = BTreeMap::new();
    for (key, value) in &state.services {
        let k = (Ipv4Addr::from(key.vip), u16::from_be_bytes(key.port), key.proto, key.scope);
        grouped.entry(k).or_default().insert(key.slot, *value);
    }
    // Frontends with slot 0 per VIP, for VIPS_V4 (before anything is taken out).
    let mut per_vip: BTreeMap<Ipv4Addr, u32> = BTreeMap::new();
    for (key, slots) in &grouped {
        if slots.get(&0).is_some_and(|master| master.flags & SVC_FLAG_EXTERNAL_ADDR == 0) {
            *per_vip.entry(key.0).or_default() += 1;
        }
    }

    let wanted_flags = desired_backend_flags(&desired.frontends);
    let mut referenced: BTreeSet<u32> = BTreeSet::new();
    let mut used_rev_nat: BTreeSet<u16> = BTreeSet::new();

    for frontend in &desired.frontends {
        let key: Key =
            (frontend.vip, frontend.port, frontend.proto.number(), FrontendKey::of(frontend).scope);
        let label = frontend_label(&key);
        let service = wanted_name(frontend);
        let slots = grouped.remove(&key).unwrap_or_default();
        let Some(master) = slots.get(&0).copied() else {
            let wants = if frontend.backends.is_empty() {
                "no backends (refuses)".to_owned()
            } else {
                format!("{} backends: {}", frontend.backends.len(), list(&frontend.backends))
            };
            let mut detail = format!("not in the services map (wants {wants})");
            if !slots.is_empty() {
                detail.push_str(&format!("; {} slots without slot 0", slots.len()));
                referenced.extend(slots.values().map(|v| v.backend_id));
            }
            push("missing-frontend", label, service, detail);
            continue;
        };
        used_rev_nat.insert(master.rev_nat_id);
        let count = u32::from(master.count);
        let total = count + u32::from(master.terminating_count);

        // Slots: present, pointing at known backends of the right protocol, same rev-NAT id.
        let mut slot_problems = Vec::new();
        let mut active: BTreeSet<BackendAddr> = BTreeSet::new();
        let mut terminating: BTreeSet<BackendAddr> = BTreeSet::new();
        for slot in 1..=total {
            let Some(value) = u16::try_from(slot).ok().and_then(|s| slots.get(&s)) else {
                slot_problems.push(format!("slot {slot} missing (count {count}, {total} slots in all)"));
                continue;
            };
            referenced.insert(value.backend_id);
            if value.rev_nat_id != master.rev_nat_id {
                slot_problems.push(format!(
                    "slot {slot} has rev-NAT id {}, slot 0 has {}",
                    value.rev_nat_id, master.rev_nat_id
                ));
            }
            match state.backends.get(&value.backend_id) {
                None => slot_problems.push(format!(
                    "slot {slot} points at backend {}, not in the backends map",
                    value.backend_id
                )),
                Some(b) => {
                    if b.proto != key.2 {
                        slot_problems.push(format!(
                            "slot {slot}: backend {} {} is {}",
                            value.backend_id,
                            backend_label(b),
                            proto_name(b.proto)
                        ));
                    }
                    let addr = BackendAddr { addr: Ipv4Addr::from(b.addr), port: u16::from_be_bytes(b.port) };
                    if slot <= count {
                        active.insert(addr)
                    } else {
                        terminating.insert(addr)
                    };
                }
            }
        }
        let above: Vec<u16> = slots.keys().copied().filter(|s| u32::from(*s) > total).collect();
        if !above.is_empty() {
            for s in &above {
                referenced.insert(slots[s].backend_id);
            }
            slot_problems.push(format!("stale slots {} above the {total} in use", list(&above)));
        }
        if !slot_problems.is_empty() {
            push("slots", label.clone(), service.clone(), slot_problems.join("; "));
        }

        for (kind, have, want, what) in [
            ("backends", &active, &frontend.backends, "backends"),
            ("terminating-backends", &terminating, &frontend.terminating_backends, "terminating backends"),
        ] {
            let want: BTreeSet<BackendAddr> = want.iter().copied().collect();
            if *have == want {
                continue;
            }
            let mut parts = vec![format!("{} {what}, want {}", have.len(), want.len())];
            let missing: Vec<_> = want.difference(have).collect();
            let extra: Vec<_> = have.difference(&want).collect();
            if !missing.is_empty() {
                parts.push(format!("missing {}", list(missing)));
            }
            if !extra.is_empty() {
                parts.push(format!("extra {}", list(extra)));
            }
            push(kind, label.clone(), service.clone(), parts.join("; "));
        }

        let mut slot0 = Vec::new();
        let flags = frontend_flags(frontend);
        if master.flags & !SVC_FLAG_MAGLEV != flags {
            slot0.push(format!("flags {:#x}, want {flags:#x}", master.flags & !SVC_FLAG_MAGLEV));
        }
        if master.flags & SVC_FLAG_MAGLEV != 0 {
            let pairs: Vec<(BackendAddr, u32)> = (1..=master.count)
                .filter_map(|s| slots.get(&s))
                .filter_map(|v| state.backends.get(&v.backend_id).map(|b| (b, v.backend_id)))
                .map(|(b, id)| {
                    (BackendAddr { addr: Ipv4Addr::from(b.addr), port: u16::from_be_bytes(b.port) }, id)
                })
                .collect();
            let table = master.backend_id.saturating_sub(1);
            let detail = match (
                state.maglev.get(&table),
                build_maglev_table(&pairs, frontend.proto, state.maglev_seed),
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
                push("maglev", label.clone(), service.clone(), detail);
            }
        }
        let want_ranges: BTreeSet<Cidr4> = frontend.source_ranges.iter().copied().collect();
        let have_ranges = state.source_ranges.get(&master.rev_nat_id).cloned().unwrap_or_default();
        if want_ranges != have_ranges {
            let mut parts = Vec::new();
            let missing: Vec<_> = want_ranges.difference(&have_ranges).collect();
            let extra: Vec<_> = have_ranges.difference(&want_ranges).collect();
            if !missing.is_empty() {
                parts.push(format!("missing {}", list(missing)));
            }
            if !extra.is_empty() {
                parts.push(format!("extra {}", list(extra)));
            }
            push("source-ranges", label.clone(), service.clone(), parts.join("; "));
        }
        let timeout = frontend.session_affinity_timeout.unwrap_or(0);
        if master.affinity_timeout_s != timeout {
            slot0.push(format!("affinity timeout {} s, want {timeout} s", master.affinity_timeout_s));
        }
        if !slot0.is_empty() {
            push("slot0", label.clone(), service.clone(), slot0.join("; "));
        }

        let rev = RevNatV4 {
            vip: frontend.vip.octets(),
            port: frontend.port.to_be_bytes(),
            proto: frontend.proto.number(),
            _pad: 0,
        };
        match state.rev_nat.get(&master.rev_nat_id) {
            None => push(
                "rev-nat",
                label.clone(),
                service.clone(),
                format!("rev-NAT id {} is not in the rev_nat map", master.rev_nat_id),
            ),
            Some(r) if (r.vip, r.port, r.proto) != (rev.vip, rev.port, rev.proto) => push(
                "rev-nat",
                label.clone(),
                service.clone(),
                format!(
                    "rev-NAT id {} holds {}",
                    master.rev_nat_id,
                    frontend_label(&(
                        Ipv4Addr::from(r.vip),
                        u16::from_be_bytes(r.port),
                        r.proto,
                        SCOPE_CLUSTER_IP
                    ))
                ),
            ),
            Some(_) => {}
        }
        match state.names.get(&master.rev_nat_id) {
            Some(name) if *name == service => {}
            Some(name) => push(
                "name",
                label.clone(),
                service.clone(),
                format!("names map has {name:?} for rev-NAT id {}", master.rev_nat_id),
            ),
            None => push(
                "name",
                label.clone(),
                service.clone(),
                format!("rev-NAT id {} has no entry in the names map", master.rev_nat_id),
            ),
        }
    }

    for (key, slots) in &grouped {
        referenced.extend(slots.iter().filter(|(s, _)| **s != 0).map(|(_, v)| v.backend_id));
        let label = frontend_label(key);
        match slots.get(&0) {
            Some(master) => {
                used_rev_nat.insert(master.rev_nat_id);
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
                push(
                    "extra-frontend",
                    label,
                    state.names.get(&master.rev_nat_id).cloned().unwrap_or_default(),
                    format!("in the services map but not wanted ({backends})"),
                );
            }
            None => {
                push("extra-frontend", label, String::new(), format!("{} slots without slot 0", slots.len()))
            }
        }
    }

    for (id, b) in &state.backends {
        if !referenced.contains(id) {
            let state_name = if b.flags & BACKEND_FLAG_TERMINATING != 0 { "terminating" } else { "active" };
            push(
                "orphan-backend",
                String::new(),
                String::new(),
                format!(
                    "backend {id} {}/{} ({state_name}) is in no slot",
                    backend_label(b),
                    proto_name(b.proto)
                ),
            );
        }
    }
    // Flags of backends the desired state uses (each backend once).
    let by_addr: BTreeMap<(BackendAddr, u8), (u32, u8)> = state
        .backends
        .iter()
        .map(|(id, b)| {
            (
                (BackendAddr { addr: Ipv4Addr::from(b.addr), port: u16::from_be_bytes(b.port) }, b.proto),
                (*id, b.flags),
            )
        })
        .collect();
    for ((addr, proto), flag) in &wanted_flags {
        if let Some((id, have)) = by_addr.get(&(*addr, proto.number()))
            && have != flag
        {
            let name = |f: u8| if f & BACKEND_FLAG_TERMINATING != 0 { "terminating" } else { "active" };
            push(
                "backend-flags",
                String::new(),
                String::new(),
                format!("backend {id} {addr}/{proto} is {}, want {}", name(*have), name(*flag)),
            );
        }
    }
    for (id, r) in &state.rev_nat {
        if !used_rev_nat.contains(id) {
            let fe = (Ipv4Addr::from(r.vip), u16::from_be_bytes(r.port), r.proto, SCOPE_CLUSTER_IP);
            push(
                "orphan-rev-nat",
                frontend_label(&fe),
                state.names.get(id).cloned().unwrap_or_default(),
                format!("rev-NAT id {id} belongs to no frontend"),
            );
        }
    }
    for (id, ranges) in &state.source_ranges {
        if !used_rev_nat.contains(id) {
            push(
                "orphan-source-range",
                String::new(),
                state.names.get(id).cloned().unwrap_or_default(),
                format!("source ranges {} of rev-NAT id {id}, which belongs to no frontend", list(ranges)),
            );
        }
    }
    for (id, name) in &state.names {
        if !used_rev_nat.contains(id) && !state.rev_nat.contains_key(id) {
            push(
                "orphan-name",
                String::new(),
                name.clone(),
                format!("names entry {id} belongs to no frontend"),
            );
        }
    }

    for vip in per_vip.keys().chain(state.vips.keys()).collect::<BTreeSet<_>>() {
        let have = state.vips.get(vip).copied();
        let frontends = per_vip.get(vip).copied().unwrap_or(0);
        let detail = match have {
            Some(n) if n == frontends => continue,
            None => format!(
                "VIPS_V4 has no entry for {vip}, which has {frontends} frontends (its other ports pass untranslated instead of being refused)"
            ),
            Some(n) if frontends == 0 => {
                format!("VIPS_V4 counts {n} frontends on {vip}, which has none (every port on it is refused)")
            }
            Some(n) => format!("VIPS_V4 counts {n} frontends on {vip}, the services map has {frontends}"),
        };
        push("vip", vip.to_string(), String::new(), detail);
    }
    out
}

#[cfg(test)]
mod tests {
    use proxy_common::maps::{BACKEND_FLAG_ACTIVE, IPPROTO_TCP, SVC_FLAG_AFFINITY, VipV4};

    use super::*;
    use crate::{
        model::ServiceName,
        sync::{Store, Syncer},
    };

    /// The maps in memory, so a real [`Syncer`] programs them.
    type Mem = crate::sync::mem_store::MemStore;

    fn state_of(mem: &Mem) -> MapState {
        MapState {
            services: mem.read_services().unwrap().into_iter().collect(),
            backends: mem.backends.clone(),
            rev_nat: mem.rev_nat.clone(),
            names: mem.names.clone(),
            vips: mem.vips.iter().map(|(k, v)| (Ipv4Addr::from(*k), v.frontends)).collect(),
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
        }
    }

    const MAGLEV_SEED: u32 = 0x6b70_726f;

    fn b(last: u8, port: u16) -> BackendAddr {
        BackendAddr { addr: Ipv4Addr::new(10, 244, 0, last), port }
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

    /// A NodePort on two node addresses with `externalTrafficPolicy: Local` (its own external-scope
    /// entry), a LoadBalancer IP with source ranges, and Maglev tables for both internal entries.
    fn north_south() -> Desired {
        let mut frontends = Vec::new();
        for vip in [Ipv4Addr::new(192, 168, 1, 10), Ipv4Addr::new(10, 0, 0, 5)] {
            let mut internal = web(vec![b(11, 80), b(12, 80)]);
            (internal.vip, internal.port, internal.kind) = (vip, 30080, model::FrontendKind::NodePort);
            internal.external_local = true;
            let mut external = internal.clone();
            external.scope = model::Scope::External;
            (external.backends, external.local_only) = (vec![b(11, 80)], true);
            frontends.extend([internal, external]);
        }
        let mut lb = web(vec![b(11, 80), b(12, 80)]);
        (lb.vip, lb.kind) = (Ipv4Addr::new(203, 0, 113, 7), model::FrontendKind::LoadBalancer);
        lb.source_ranges = vec!["10.0.0.0/8".parse().unwrap(), "192.168.0.0/16".parse().unwrap()];
        frontends.extend([web(vec![b(11, 80), b(12, 80)]), lb]);
        Desired::new(frontends)
    }

    fn programmed_north_south(desired: &Desired) -> Mem {
        let settings = crate::sync::MaglevSettings { seed: MAGLEV_SEED, tables: 8 };
        let mut syncer = Syncer::with_store(Mem::default()).unwrap().with_maglev_settings(settings);
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
        new.vip = Ipv4Addr::new(10, 96, 0, 200);
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
        assert!(diff[6].detail.contains("counts 2 frontends on 10.96.0.10, the services map has 1"));
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

    #[test]
    fn manifests_are_ordered_like_the_agent() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: b, namespace: x}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: x}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";
        let (services, _, _) = from_files(manifest::parse_str(text, "test"));
        let names: Vec<_> = services.iter().map(|s| s.object.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["a", "b"]);
    }
}
