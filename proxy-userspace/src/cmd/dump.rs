//! `kproxy dump`: the maps as people (tables) and machines (`--json`) read them.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context as _, Result};
use proxy_common::{
    conntrack::{CtState, Timeouts},
    maps::{
        AffinityKeyV4, AffinityValueV4, BackendV4, CT_DIR_FORWARD, CT_DIR_REPLY, CT_FLAG_HAIRPIN, ConfigV4,
        CtEntryV4, CtKeyV4, RevNatId, RevNatV4, SVC_FLAG_AFFINITY, ServiceValueV4,
    },
    maps_v6::{AffinityKeyV6, BackendV6, CtEntryV6, CtKeyV6, RevNatV6},
};
use serde::Serialize;

use crate::{bpf::Maps, net::Protocol};

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ServiceRow {
    pub frontend: String,
    pub protocol: &'static str,
    /// `internal` (pods and the node; external clients too unless an
    /// `external` entry exists) or `external` (externalTrafficPolicy: Local).
    pub scope: &'static str,
    pub slot: u16,
    pub service: String,
    pub rev_nat_id: RevNatId,
    /// Slot 0: number of active backends; other slots: 0.
    pub count: u16,
    /// Slot 0: number of terminating backends (slots after the active ones).
    pub terminating_count: u16,
    /// Slots > 0: the backend id and address.
    pub backend_id: Option<u32>,
    pub backend: Option<String>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct BackendRow {
    pub id: u32,
    pub address: String,
    pub protocol: &'static str,
    pub state: &'static str,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct ConntrackRow {
    /// The tuple the client sent: client → VIP.
    pub original: String,
    /// What the backend received: client → backend.
    pub translated: String,
    pub protocol: &'static str,
    pub service: String,
    pub backend_id: u32,
    pub state: &'static str,
    pub age_seconds: f64,
    pub idle_seconds: f64,
    pub packets_out: u64,
    pub bytes_out: u64,
    pub packets_reply: u64,
    pub bytes_reply: u64,
    /// Seconds before the flow expires: its state's timeout (CONFIG) minus
    /// the time since either direction was last seen; 0 when expired.
    pub time_left_seconds: f64,
    /// The client reached itself through its Service; its source was
    /// rewritten to the hairpin address.
    pub hairpin: bool,
}

/// One address translation in effect, per direction.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct NatRow {
    /// `DNAT` (client → VIP becomes client → backend), `SNAT` (the client's
    /// source becomes the hairpin address, or a node address and SNAT port)
    /// or `un-NAT` (the reply's source becomes the VIP again).
    pub kind: &'static str,
    pub protocol: &'static str,
    /// The tuple as it arrives.
    pub from: String,
    /// The tuple as it leaves.
    pub to: String,
    pub service: String,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct AffinityRow {
    pub client: String,
    /// `vip:port` of the frontend, when its rev-NAT entry still exists.
    pub frontend: String,
    pub protocol: &'static str,
    pub service: String,
    pub rev_nat_id: RevNatId,
    pub backend_id: u32,
    /// `addr:port`, or "(gone)" when the backend was deleted.
    pub backend: String,
    pub last_used_seconds_ago: f64,
    /// The frontend's affinity timeout minus the time since last use (0 when
    /// expired); `None` when the frontend is gone or has no affinity now.
    pub time_left_seconds: Option<f64>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct StatRow {
    pub reason: &'static str,
    pub packets: u64,
}

fn proto_name(n: u8) -> &'static str {
    Protocol::from_number(n).map_or("?", Protocol::name)
}

fn endpoint(addr: [u8; 4], port: [u8; 2]) -> String {
    format!("{}:{}", Ipv4Addr::from(addr), u16::from_be_bytes(port))
}

fn endpoint6(addr: [u8; 16], port: [u8; 2]) -> String {
    format!("[{}]:{}", Ipv6Addr::from(addr), u16::from_be_bytes(port))
}

/// A backend's `addr:port`, marked when terminating; `(missing)` when the id names none.
fn backend_label(found: Option<(String, u8)>) -> String {
    match found {
        Some((addr, flags)) if flags & proxy_common::maps::BACKEND_FLAG_TERMINATING != 0 => {
            format!("{addr} (terminating)")
        }
        Some((addr, _)) => addr,
        None => "(missing)".to_owned(),
    }
}

fn names(maps: &Maps) -> BTreeMap<RevNatId, String> {
    maps.names.iter().filter_map(|e| e.ok()).map(|(id, n)| (id, n.as_str().to_owned())).collect()
}

pub fn services(maps: &Maps) -> Result<Vec<ServiceRow>> {
    let names = names(maps);
    let mut rows = Vec::new();
    let row =
        |frontend: String, proto: u8, scope: u8, slot: u16, value: ServiceValueV4, backend| ServiceRow {
            frontend,
            protocol: proto_name(proto),
            scope: if scope == proxy_common::maps::SCOPE_EXTERNAL { "external" } else { "internal" },
            slot,
            service: names.get(&value.rev_nat_id).cloned().unwrap_or_default(),
            rev_nat_id: value.rev_nat_id,
            count: if slot == 0 { value.count } else { 0 },
            terminating_count: if slot == 0 { value.terminating_count } else { 0 },
            backend_id: (slot != 0).then_some(value.backend_id),
            backend,
        };
    for entry in maps.services.iter() {
        let (key, value) = entry.context("reading the services map")?;
        let backend = (key.slot != 0).then(|| {
            backend_label(
                maps.backends.get(&value.backend_id, 0).ok().map(|b| (endpoint(b.addr, b.port), b.flags)),
            )
        });
        rows.push(row(endpoint(key.vip, key.port), key.proto, key.scope, key.slot, value, backend));
    }
    let mut rows6 = Vec::new();
    for entry in maps.services_v6.iter() {
        let (key, value) = entry.context("reading the IPv6 services map")?;
        let backend = (key.slot != 0).then(|| {
            let found = maps.backends_v6.get(&value.backend_id, 0).ok();
            backend_label(found.map(|b| (endpoint6(b.addr, b.port), b.flags)))
        });
        rows6.push(row(endpoint6(key.vip, key.port), key.proto, key.scope, key.slot, value, backend));
    }
    rows.sort_by(|a, b| {
        (Ipv4Addr::from(parse_ip(&a.frontend)), &a.frontend, a.protocol, a.scope, a.slot).cmp(&(
            Ipv4Addr::from(parse_ip(&b.frontend)),
            &b.frontend,
            b.protocol,
            b.scope,
            b.slot,
        ))
    });
    // IPv6 frontends after the IPv4 ones.
    rows6.sort_by(|a, b| {
        (&a.frontend, a.protocol, a.scope, a.slot).cmp(&(&b.frontend, b.protocol, b.scope, b.slot))
    });
    rows.extend(rows6);
    Ok(rows)
}

fn parse_ip(endpoint: &str) -> [u8; 4] {
    endpoint.split(':').next().and_then(|ip| ip.parse::<Ipv4Addr>().ok()).map_or([0; 4], |ip| ip.octets())
}

pub fn backends(maps: &Maps) -> Result<Vec<BackendRow>> {
    let mut rows = Vec::new();
    let state = |flags: u8| {
        if flags & proxy_common::maps::BACKEND_FLAG_TERMINATING != 0 { "terminating" } else { "active" }
    };
    for entry in maps.backends.iter() {
        let (id, b) = entry.context("reading the backends map")?;
        rows.push(BackendRow {
            id,
            address: endpoint(b.addr, b.port),
            protocol: proto_name(b.proto),
            state: state(b.flags),
        });
    }
    // One id space for both families: an id is in one of the two maps.
    for entry in maps.backends_v6.iter() {
        let (id, b) = entry.context("reading the IPv6 backends map")?;
        rows.push(BackendRow {
            id,
            address: endpoint6(b.addr, b.port),
            protocol: proto_name(b.proto),
            state: state(b.flags),
        });
    }
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

pub fn conntrack(maps: &Maps) -> Result<Vec<ConntrackRow>> {
    let names = names(maps);
    let config = crate::bpf::conntrack::read_config(maps);
    let now = crate::bpf::conntrack::monotonic_ns();
    let entries = crate::bpf::conntrack::read_conntrack(maps)?;
    let mut rows = conntrack_rows(&entries, &names, &config, &crate::bpf::conntrack::snat_index(maps), now);
    // IPv6 flows after the IPv4 ones; rev-NAT ids are shared, so FRONTEND_NAMES_V4 names them too.
    let entries6 = crate::bpf::conntrack::read_conntrack6(maps)?;
    let snat6 = crate::bpf::conntrack::snat6_index(maps);
    rows.extend(conntrack_rows6(&entries6, &names, &config, &snat6, now));
    Ok(rows)
}

/// The IPv6 rows of `kproxy dump conntrack`, as [`conntrack_rows`]: one per forward entry of
/// CONNTRACK_V6 with its reply entry's counters, `[addr]:port` notation.
pub fn conntrack_rows6(
    entries: &[(CtKeyV6, CtEntryV6)],
    names: &BTreeMap<RevNatId, String>,
    config: &ConfigV4,
    snat6: &crate::bpf::conntrack::Snat6Index,
    now: u64,
) -> Vec<ConntrackRow> {
    let timeouts = Timeouts::from_config(config);
    let reply: std::collections::HashMap<CtKeyV6, &CtEntryV6> =
        entries.iter().filter(|(k, _)| k.direction == CT_DIR_REPLY).map(|(k, v)| (*k, v)).collect();
    let seconds = |ns: u64| now.saturating_sub(ns) as f64 / 1e9;
    let mut rows: Vec<ConntrackRow> = entries
        .iter()
        .filter(|(k, _)| k.direction == CT_DIR_FORWARD)
        .map(|(key, fwd)| {
            // The flow sends from its reply key's destination: the client, the hairpin address,
            // the client at a remapped port (port reuse), or a node address (source NAT).
            let reply_key = crate::bpf::conntrack::reply_key6(key, fwd, snat6);
            let back = reply.get(&reply_key).copied();
            let hairpin = fwd.flags & CT_FLAG_HAIRPIN != 0;
            ConntrackRow {
                original: format!(
                    "{} -> {}",
                    endpoint6(key.saddr, key.sport),
                    endpoint6(key.daddr, key.dport)
                ),
                translated: format!(
                    "{} -> {}",
                    endpoint6(reply_key.daddr, reply_key.dport),
                    endpoint6(fwd.nat_addr, fwd.nat_port)
                ),
                protocol: proto_name(key.proto),
                service: names.get(&fwd.rev_nat_id).cloned().unwrap_or_default(),
                backend_id: fwd.backend_id,
                state: CtState::from_u8(fwd.state).map_or("?", CtState::name),
                age_seconds: seconds(fwd.created_ns),
                idle_seconds: seconds(crate::bpf::conntrack::pair_last_seen(fwd, back)),
                packets_out: fwd.packets,
                bytes_out: fwd.bytes,
                packets_reply: back.map_or(0, |r| r.packets),
                bytes_reply: back.map_or(0, |r| r.bytes),
                time_left_seconds: crate::bpf::conntrack::time_left_ns(&timeouts, fwd, back, now) as f64
                    / 1e9,
                hairpin,
            }
        })
        .collect();
    rows.sort_by(|a, b| a.original.cmp(&b.original));
    rows
}

/// The rows of `kproxy dump conntrack`: one per forward entry, with its reply
/// entry's counters (found through the hairpin address for hairpin flows).
pub fn conntrack_rows(
    entries: &[(CtKeyV4, CtEntryV4)],
    names: &BTreeMap<RevNatId, String>,
    config: &ConfigV4,
    snat: &crate::bpf::conntrack::SnatIndex,
    now: u64,
) -> Vec<ConntrackRow> {
    let timeouts = Timeouts::from_config(config);
    let hairpin_addr = crate::bpf::conntrack::hairpin_addr(config);
    let reply: std::collections::HashMap<CtKeyV4, &CtEntryV4> =
        entries.iter().filter(|(k, _)| k.direction == CT_DIR_REPLY).map(|(k, v)| (*k, v)).collect();
    let seconds = |ns: u64| now.saturating_sub(ns) as f64 / 1e9;
    let mut rows = Vec::new();
    for (key, fwd) in entries.iter().filter(|(k, _)| k.direction == CT_DIR_FORWARD) {
        let back = reply.get(&crate::bpf::conntrack::reply_key(key, fwd, hairpin_addr, snat)).copied();
        let hairpin = fwd.flags & CT_FLAG_HAIRPIN != 0;
        let mut source = if hairpin { (hairpin_addr, key.sport) } else { (key.saddr, key.sport) };
        if proxy_common::maps::reply_key_in_snat(fwd.flags)
            && let Some(to_node) =
                snat.get(&crate::bpf::conntrack::key_ord(&proxy_common::maps::snat_forward_key(key)))
        {
            source = (to_node.addr, to_node.port);
        }
        rows.push(ConntrackRow {
            original: format!("{} -> {}", endpoint(key.saddr, key.sport), endpoint(key.daddr, key.dport)),
            translated: format!(
                "{} -> {}",
                endpoint(source.0, source.1),
                endpoint(fwd.nat_addr, fwd.nat_port)
            ),
            protocol: proto_name(key.proto),
            service: names.get(&fwd.rev_nat_id).cloned().unwrap_or_default(),
            backend_id: fwd.backend_id,
            state: CtState::from_u8(fwd.state).map_or("?", CtState::name),
            age_seconds: seconds(fwd.created_ns),
            idle_seconds: seconds(crate::bpf::conntrack::pair_last_seen(fwd, back)),
            packets_out: fwd.packets,
            bytes_out: fwd.bytes,
            packets_reply: back.map_or(0, |r| r.packets),
            bytes_reply: back.map_or(0, |r| r.bytes),
            time_left_seconds: crate::bpf::conntrack::time_left_ns(&timeouts, fwd, back, now) as f64 / 1e9,
            hairpin,
        });
    }
    rows.sort_by(|a, b| a.original.cmp(&b.original));
    rows
}

pub fn affinity(maps: &Maps) -> Result<Vec<AffinityRow>> {
    let names = names(maps);
    let mut frontends = BTreeMap::new();
    for entry in maps.services.iter() {
        let (key, value) = entry.context("reading the services map")?;
        if key.slot == 0 {
            frontends.insert(value.rev_nat_id, value);
        }
    }
    for entry in maps.services_v6.iter() {
        let (key, value) = entry.context("reading the IPv6 services map")?;
        if key.slot == 0 {
            frontends.insert(value.rev_nat_id, value);
        }
    }
    let ctx = AffinityContext {
        names,
        frontends,
        rev_nat: maps.rev_nat.iter().filter_map(|e| e.ok()).collect(),
        backends: maps.backends.iter().filter_map(|e| e.ok()).collect(),
        rev_nat_v6: maps.rev_nat_v6.iter().filter_map(|e| e.ok()).collect(),
        backends_v6: maps.backends_v6.iter().filter_map(|e| e.ok()).collect(),
    };
    let entries: Vec<(AffinityKeyV4, AffinityValueV4)> =
        maps.affinity.iter().filter_map(|e| e.ok()).collect();
    let entries6: Vec<(AffinityKeyV6, AffinityValueV4)> =
        maps.affinity_v6.iter().filter_map(|e| e.ok()).collect();
    let now = crate::bpf::conntrack::monotonic_ns();
    let mut rows = affinity_rows(&entries, &ctx, now);
    // IPv6 clients after the IPv4 ones, as dump conntrack orders its flows.
    rows.extend(affinity_rows6(&entries6, &ctx, now));
    Ok(rows)
}

/// What affinity rows are resolved against. Rev-NAT ids are shared between the families; backend ids too,
/// so an entry's backend is looked up in its own family's map.
#[derive(Default)]
pub struct AffinityContext {
    pub names: BTreeMap<RevNatId, String>,
    /// rev-NAT id → the frontend's slot 0, of either family.
    pub frontends: BTreeMap<RevNatId, ServiceValueV4>,
    pub rev_nat: BTreeMap<RevNatId, RevNatV4>,
    pub backends: BTreeMap<u32, BackendV4>,
    pub rev_nat_v6: BTreeMap<RevNatId, RevNatV6>,
    pub backends_v6: BTreeMap<u32, BackendV6>,
}

/// The frontend `rev_nat_id` names, `(vip:port, protocol)`: an entry is keyed by its Service port's cluster-IP
/// frontend, which may be of the other family than its client.
fn affinity_frontend(ctx: &AffinityContext, rev_nat_id: RevNatId) -> Option<(String, u8)> {
    ctx.rev_nat
        .get(&rev_nat_id)
        .map(|r| (endpoint(r.vip, r.port), r.proto))
        .or_else(|| ctx.rev_nat_v6.get(&rev_nat_id).map(|r| (endpoint6(r.vip, r.port), r.proto)))
}

fn affinity_row(
    client: IpAddr,
    rev_nat_id: RevNatId,
    value: &AffinityValueV4,
    backend: Option<String>,
    ctx: &AffinityContext,
    now: u64,
) -> AffinityRow {
    let idle_ns = now.saturating_sub(value.last_used_ns);
    let frontend = affinity_frontend(ctx, rev_nat_id);
    let time_left_seconds = ctx
        .frontends
        .get(&rev_nat_id)
        .filter(|f| f.flags & SVC_FLAG_AFFINITY != 0)
        .map(|f| (u64::from(f.affinity_timeout_s) * 1_000_000_000).saturating_sub(idle_ns) as f64 / 1e9);
    AffinityRow {
        client: client.to_string(),
        protocol: frontend.as_ref().map_or("?", |(_, proto)| proto_name(*proto)),
        frontend: frontend.map(|(f, _)| f).unwrap_or_default(),
        service: ctx.names.get(&rev_nat_id).cloned().unwrap_or_default(),
        rev_nat_id,
        backend_id: value.backend_id,
        backend: backend.unwrap_or_else(|| "(gone)".to_owned()),
        last_used_seconds_ago: idle_ns as f64 / 1e9,
        time_left_seconds,
    }
}

/// The address of a row's `vip:port` or `[vip]:port` frontend; `None` (first) when it is gone.
fn frontend_ip(frontend: &str) -> Option<IpAddr> {
    match frontend.strip_prefix('[') {
        Some(rest) => rest.split(']').next()?.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
        None => frontend.split(':').next()?.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
    }
}

fn sort_affinity(rows: &mut [AffinityRow]) {
    rows.sort_by_cached_key(|r| (frontend_ip(&r.frontend), r.rev_nat_id, r.client.parse::<IpAddr>().ok()));
}

pub fn affinity_rows(
    entries: &[(AffinityKeyV4, AffinityValueV4)],
    ctx: &AffinityContext,
    now: u64,
) -> Vec<AffinityRow> {
    let mut rows: Vec<AffinityRow> = entries
        .iter()
        .map(|(key, value)| {
            let backend = ctx.backends.get(&value.backend_id).map(|b| endpoint(b.addr, b.port));
            affinity_row(Ipv4Addr::from(key.client).into(), key.rev_nat_id, value, backend, ctx, now)
        })
        .collect();
    sort_affinity(&mut rows);
    rows
}

/// [`affinity_rows`] of AFFINITY_V6: the client an IPv6 address, the backend one of BACKENDS_V6.
pub fn affinity_rows6(
    entries: &[(AffinityKeyV6, AffinityValueV4)],
    ctx: &AffinityContext,
    now: u64,
) -> Vec<AffinityRow> {
    let mut rows: Vec<AffinityRow> = entries
        .iter()
        .map(|(key, value)| {
            let backend = ctx.backends_v6.get(&value.backend_id).map(|b| endpoint6(b.addr, b.port));
            affinity_row(Ipv6Addr::from(key.client).into(), key.rev_nat_id, value, backend, ctx, now)
        })
        .collect();
    sort_affinity(&mut rows);
    rows
}

/// The translations in effect, read from the conntrack entries that carry
/// them (kproxy keeps no separate NAT table for ClusterIP traffic: the
/// conntrack entry is the NAT record).
pub fn nat(maps: &Maps) -> Result<Vec<NatRow>> {
    let rows = conntrack(maps)?;
    let mut out = Vec::new();
    for row in rows {
        let (client, vip) = row.original.split_once(" -> ").unwrap_or((&row.original, ""));
        let (source, backend) = row.translated.split_once(" -> ").unwrap_or((&row.translated, ""));
        out.push(NatRow {
            kind: "DNAT",
            protocol: row.protocol,
            from: format!("{client} > {vip}"),
            to: format!("{source} > {backend}"),
            service: row.service.clone(),
        });
        // Hairpin flows and external flows sent to another node (or
        // masqueraded) leave with a new source too.
        if row.hairpin || source != client {
            out.push(NatRow {
                kind: "SNAT",
                protocol: row.protocol,
                from: format!("{client} > {backend}"),
                to: format!("{source} > {backend}"),
                service: row.service.clone(),
            });
        }
        out.push(NatRow {
            kind: "un-NAT",
            protocol: row.protocol,
            from: format!("{backend} > {source}"),
            to: format!("{vip} > {client}"),
            service: row.service,
        });
    }
    Ok(out)
}

pub fn nat_table(rows: &[NatRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![r.kind.to_owned(), r.protocol.to_owned(), r.from.clone(), r.to.clone(), r.service.clone()]
        })
        .collect();
    table(&["KIND", "PROTO", "FROM", "TO", "SERVICE"], &cells)
}

pub fn stats(maps: &Maps) -> Result<Vec<StatRow>> {
    Ok(crate::bpf::read_stats(maps)?
        .into_iter()
        .map(|(stat, packets)| StatRow { reason: stat.name(), packets })
        .collect())
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ServiceCidrRow {
    /// A service range whose addresses that are no Service's cluster IP are dropped.
    pub cidr: String,
}

/// SERVICE_CIDRS_V4 and SERVICE_CIDRS_V6: the service CIDRs in effect.
pub fn service_cidrs(maps: &Maps) -> Result<Vec<ServiceCidrRow>> {
    let cidrs = crate::bpf::service_cidrs::read_both(maps)?;
    Ok(cidrs.into_iter().map(|cidr| ServiceCidrRow { cidr: cidr.to_string() }).collect())
}

pub fn service_cidrs_table(rows: &[ServiceCidrRow]) -> String {
    if rows.is_empty() {
        return "no service CIDR known: no unallocated service address is dropped\n".to_owned();
    }
    let cells: Vec<Vec<String>> = rows.iter().map(|r| vec![r.cidr.clone()]).collect();
    table(&["SERVICE CIDR (unallocated addresses dropped)"], &cells)
}

/// Left-aligned columns sized to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let text: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", text.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

pub fn services_table(rows: &[ServiceRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let target = match (&r.backend_id, &r.backend) {
                (Some(id), Some(addr)) => format!("backend {id} {addr}"),
                _ if r.terminating_count > 0 => {
                    format!("{} backends, {} terminating", r.count, r.terminating_count)
                }
                _ => format!("{} backends", r.count),
            };
            let frontend =
                if r.scope == "external" { format!("{} (external)", r.frontend) } else { r.frontend.clone() };
            vec![
                frontend,
                r.protocol.to_owned(),
                r.slot.to_string(),
                target,
                r.rev_nat_id.to_string(),
                r.service.clone(),
            ]
        })
        .collect();
    table(&["FRONTEND", "PROTO", "SLOT", "TARGET", "REVNAT", "SERVICE"], &cells)
}

pub fn backends_table(rows: &[BackendRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| vec![r.id.to_string(), r.address.clone(), r.protocol.to_owned(), r.state.to_owned()])
        .collect();
    table(&["ID", "ADDRESS", "PROTO", "STATE"], &cells)
}

pub fn conntrack_table(rows: &[ConntrackRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.protocol.to_owned(),
                r.original.clone(),
                r.translated.clone(),
                r.state.to_owned(),
                format!("{:.1}s", r.age_seconds),
                format!("{:.1}s", r.time_left_seconds),
                if r.hairpin { "hairpin".to_owned() } else { "-".to_owned() },
                format!("{}/{}", r.packets_out, r.packets_reply),
                format!("{}/{}", r.bytes_out, r.bytes_reply),
                r.backend_id.to_string(),
                r.service.clone(),
            ]
        })
        .collect();
    table(
        &[
            "PROTO",
            "ORIGINAL",
            "TRANSLATED",
            "STATE",
            "AGE",
            "LEFT",
            "FLAGS",
            "PKTS OUT/REPLY",
            "BYTES OUT/REPLY",
            "BACKEND",
            "SERVICE",
        ],
        &cells,
    )
}

pub fn affinity_table(rows: &[AffinityRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.client.clone(),
                if r.frontend.is_empty() { format!("revnat {}", r.rev_nat_id) } else { r.frontend.clone() },
                r.protocol.to_owned(),
                r.service.clone(),
                format!("{} {}", r.backend_id, r.backend),
                format!("{:.1}s", r.last_used_seconds_ago),
                r.time_left_seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s")),
            ]
        })
        .collect();
    table(&["CLIENT", "FRONTEND", "PROTO", "SERVICE", "BACKEND", "LAST USED", "LEFT"], &cells)
}

pub fn stats_table(rows: &[StatRow]) -> String {
    let cells: Vec<Vec<String>> =
        rows.iter().map(|r| vec![r.reason.to_owned(), r.packets.to_string()]).collect();
    table(&["REASON", "PACKETS"], &cells)
}

#[cfg(test)]
mod tests {
    use proxy_common::maps_v6::{HAIRPIN_ADDR_V6, SnatEntryV6};

    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "1".into()], vec!["q".into(), "22".into()]]);
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }

    const S: u64 = 1_000_000_000;

    fn ct_key(s: [u8; 4], sp: u16, d: [u8; 4], dp: u16, direction: u8) -> CtKeyV4 {
        CtKeyV4 {
            saddr: s,
            daddr: d,
            sport: sp.to_be_bytes(),
            dport: dp.to_be_bytes(),
            proto: proxy_common::maps::IPPROTO_TCP,
            direction,
            _pad: [0; 2],
        }
    }

    #[test]
    fn conntrack_rows_show_time_left_and_hairpin() {
        let now = 100_000 * S;
        let pod = [10, 244, 0, 5];
        let vip = [10, 96, 0, 100];
        let fwd = CtEntryV4 {
            created_ns: now - 100 * S,
            last_seen_ns: now - 50 * S,
            packets: 3,
            backend_id: 2,
            nat_addr: pod,
            nat_port: 8080u16.to_be_bytes(),
            rev_nat_id: 1,
            state: CtState::SynSent as u8,
            flags: CT_FLAG_HAIRPIN,
            ..Default::default()
        };
        let fkey = ct_key(pod, 40000, vip, 80, CT_DIR_FORWARD);
        let hairpin = [169, 254, 42, 1];
        let rkey = ct_key(pod, 8080, hairpin, 40000, CT_DIR_REPLY);
        let reply = CtEntryV4 { last_seen_ns: now - 20 * S, packets: 2, nat_addr: vip, ..fwd };
        // A plain flow, idle past its timeout.
        let other = CtEntryV4 { flags: 0, last_seen_ns: now - 70 * S, ..fwd };
        let okey = ct_key([10, 244, 0, 6], 40001, vip, 80, CT_DIR_FORWARD);
        let names: BTreeMap<RevNatId, String> = [(1, "default/web:http".to_owned())].into();
        let config = ConfigV4 { timeout_tcp_syn_ns: 30 * S, ..Default::default() };
        let rows = conntrack_rows(
            &[(fkey, fwd), (rkey, reply), (okey, other)],
            &names,
            &config,
            &crate::bpf::conntrack::NO_SNAT,
            now,
        );
        assert_eq!(rows.len(), 2);
        let r = &rows[0];
        assert!(r.hairpin);
        assert_eq!(r.translated, "169.254.42.1:40000 -> 10.244.0.5:8080");
        assert_eq!(r.packets_reply, 2, "the reply entry is found under the hairpin address");
        assert_eq!(r.idle_seconds, 20.0);
        assert_eq!(r.time_left_seconds, 10.0);
        assert_eq!(r.service, "default/web:http");
        let o = &rows[1];
        assert!(!o.hairpin);
        assert_eq!(o.time_left_seconds, 0.0);
        let table = conntrack_table(&rows);
        assert!(table.lines().next().unwrap().contains("LEFT"));
        assert!(table.lines().nth(1).unwrap().contains("hairpin"));
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(json[0]["hairpin"], true);
        assert_eq!(json[0]["time_left_seconds"], 10.0);
    }

    #[test]
    fn ipv6_conntrack_rows_pair_the_reply_and_follow_the_ipv4_ones() {
        let now = 100_000 * S;
        let v6 = |last: u16| -> [u8; 16] {
            let mut a = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            a[14..].copy_from_slice(&last.to_be_bytes());
            a
        };
        let (client, vip, backend) = (v6(5), v6(0x96), v6(9));
        let forward = CtKeyV6 {
            saddr: client,
            daddr: vip,
            sport: 40000u16.to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: proxy_common::maps::IPPROTO_TCP,
            direction: CT_DIR_FORWARD,
            _pad: [0; 2],
        };
        let fwd = CtEntryV6 {
            created_ns: now - 10 * S,
            last_seen_ns: now - 4 * S,
            packets: 6,
            bytes: 600,
            backend_id: 12,
            nat_addr: backend,
            nat_port: 8080u16.to_be_bytes(),
            rev_nat_id: 7,
            state: CtState::Established as u8,
            ..Default::default()
        };
        let reply_key = forward.reply_of(backend, 8080u16.to_be_bytes());
        let reply = CtEntryV6 {
            last_seen_ns: now - S,
            packets: 5,
            bytes: 4000,
            nat_addr: vip,
            nat_port: 80u16.to_be_bytes(),
            ..fwd
        };
        // A reply entry alone is no row; a forward entry without its reply has no reply counters.
        let lonely = CtKeyV6 { sport: 40001u16.to_be_bytes(), ..forward };
        let names: BTreeMap<RevNatId, String> = [(7, "default/web:http".to_owned())].into();
        let config = ConfigV4::default();
        let none = crate::bpf::conntrack::Snat6Index::new();
        let rows = conntrack_rows6(
            &[(reply_key, reply), (forward, fwd), (lonely, fwd)],
            &names,
            &config,
            &none,
            now,
        );
        assert_eq!(rows.len(), 2);
        let r = &rows[0];
        assert_eq!(r.original, "[fd00:10:244::5]:40000 -> [fd00:10:244::96]:80");
        assert_eq!(r.translated, "[fd00:10:244::5]:40000 -> [fd00:10:244::9]:8080");
        assert_eq!((r.protocol, r.state, r.backend_id), ("TCP", "ESTABLISHED", 12));
        assert_eq!(r.service, "default/web:http", "named through the shared rev-NAT id");
        assert_eq!((r.packets_out, r.bytes_out, r.packets_reply, r.bytes_reply), (6, 600, 5, 4000));
        assert_eq!((r.age_seconds, r.idle_seconds), (10.0, 1.0));
        assert_eq!(r.time_left_seconds, Timeouts::DEFAULT.tcp_established_ns as f64 / 1e9 - 1.0);
        assert!(!r.hairpin);
        assert_eq!((rows[1].packets_reply, rows[1].idle_seconds), (0, 4.0));
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(json[0]["translated"], "[fd00:10:244::5]:40000 -> [fd00:10:244::9]:8080");
        // A hairpin flow's reply is addressed to the IPv6 hairpin address, its source shown as it.
        let hairpin = CtEntryV6 { flags: CT_FLAG_HAIRPIN, nat_addr: client, ..fwd };
        let mut hairpin_reply_key = forward.reply_of(client, 8080u16.to_be_bytes());
        hairpin_reply_key.daddr = HAIRPIN_ADDR_V6;
        let rows =
            conntrack_rows6(&[(forward, hairpin), (hairpin_reply_key, reply)], &names, &config, &none, now);
        assert!(rows[0].hairpin);
        assert_eq!(rows[0].translated, "[100::42:1]:40000 -> [fd00:10:244::5]:8080");
        assert_eq!(rows[0].packets_reply, 5);
        // A remapped flow (port reuse): shown from its remapped port, its reply (under that port,
        // named by SNAT_V6) paired for the counters.
        let remapped = CtEntryV6 { flags: proxy_common::maps::CT_FLAG_REMAP, ..fwd };
        let remapped_reply_key = CtKeyV6 { dport: 61_234u16.to_be_bytes(), ..reply_key };
        let to = |addr: [u8; 16], port: [u8; 2]| SnatEntryV6 { created_ns: 0, addr, port, _pad: [0; 6] };
        let snat6 =
            crate::bpf::conntrack::Snat6Index::from([(forward, to(client, remapped_reply_key.dport))]);
        let rows = conntrack_rows6(
            &[(forward, remapped), (remapped_reply_key, reply)],
            &names,
            &config,
            &snat6,
            now,
        );
        assert_eq!(rows[0].translated, "[fd00:10:244::5]:61234 -> [fd00:10:244::9]:8080");
        assert_eq!((rows[0].packets_reply, rows[0].idle_seconds), (5, 1.0));
        // A source-NATed north–south flow: shown from the node address and port it took, its reply
        // (addressed to them) paired for the counters.
        let node: [u8; 16] = "fd00:172:18::2".parse::<std::net::Ipv6Addr>().unwrap().octets();
        let nated = CtEntryV6 { flags: proxy_common::maps::CT_FLAG_SNAT, ..fwd };
        let nated_reply_key = CtKeyV6 { daddr: node, dport: 32_001u16.to_be_bytes(), ..reply_key };
        let snat6 = crate::bpf::conntrack::Snat6Index::from([(forward, to(node, nated_reply_key.dport))]);
        let rows =
            conntrack_rows6(&[(forward, nated), (nated_reply_key, reply)], &names, &config, &snat6, now);
        assert_eq!(rows[0].translated, "[fd00:172:18::2]:32001 -> [fd00:10:244::9]:8080");
        assert_eq!((rows[0].packets_reply, rows[0].idle_seconds), (5, 1.0));
    }

    #[test]
    fn affinity_rows_resolve_frontend_backend_and_time_left() {
        let now = 100_000 * S;
        let key =
            |client: u8, rev_nat_id: RevNatId| AffinityKeyV4 { client: [10, 244, 0, client], rev_nat_id };
        let value =
            |ago: u64, backend_id: u32| AffinityValueV4 { last_used_ns: now - ago * S, backend_id, slot: 0 };
        let ctx = AffinityContext {
            names: [(1, "default/web:http".to_owned())].into(),
            frontends: [(
                1,
                ServiceValueV4 {
                    flags: SVC_FLAG_AFFINITY,
                    affinity_timeout_s: 125,
                    rev_nat_id: 1,
                    ..Default::default()
                },
            )]
            .into(),
            rev_nat: [(1, RevNatV4 { vip: [10, 96, 0, 100], port: 80u16.to_be_bytes(), proto: 6, _pad: 0 })]
                .into(),
            backends: [(
                4,
                BackendV4 { addr: [10, 244, 1, 7], port: 8080u16.to_be_bytes(), proto: 6, flags: 0 },
            )]
            .into(),
            ..Default::default()
        };
        let rows = affinity_rows(&[(key(9, 1), value(25, 4)), (key(3, 2), value(1, 5))], &ctx, now);
        assert_eq!(rows.len(), 2);
        // The frontend that is gone sorts first (no VIP) and has no time left.
        assert_eq!(rows[0].rev_nat_id, 2);
        assert_eq!(rows[0].time_left_seconds, None);
        assert_eq!(rows[0].backend, "(gone)");
        let r = &rows[1];
        assert_eq!(r.client, "10.244.0.9");
        assert_eq!(r.frontend, "10.96.0.100:80");
        assert_eq!(r.protocol, "TCP");
        assert_eq!(r.service, "default/web:http");
        assert_eq!(r.backend, "10.244.1.7:8080");
        assert_eq!(r.last_used_seconds_ago, 25.0);
        assert_eq!(r.time_left_seconds, Some(100.0));
        let table = affinity_table(&rows);
        assert!(table.contains("revnat 2"), "{table}");
        assert!(table.contains("100.0s"), "{table}");
    }

    #[test]
    fn ipv6_affinity_rows_resolve_the_backend_in_backends_v6_and_the_frontend_by_the_shared_id() {
        let now = 100_000 * S;
        let v6 = |last: u16| -> [u8; 16] {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&[0xfd, 0x00, 0x00, 0x10]);
            a[14..].copy_from_slice(&last.to_be_bytes());
            a
        };
        let slot0 = ServiceValueV4 {
            flags: SVC_FLAG_AFFINITY,
            affinity_timeout_s: 60,
            rev_nat_id: 7,
            ..Default::default()
        };
        // Backend id 4 names an IPv4 backend too: an IPv6 entry's is BACKENDS_V6's.
        let ctx = AffinityContext {
            names: [(7, "default/web:http".to_owned())].into(),
            frontends: [(7, slot0)].into(),
            rev_nat_v6: [(7, RevNatV6 { vip: v6(0x96), port: 80u16.to_be_bytes(), proto: 6, _pad: 0 })]
                .into(),
            backends: [(
                4,
                BackendV4 { addr: [10, 244, 1, 7], port: 8080u16.to_be_bytes(), proto: 6, flags: 0 },
            )]
            .into(),
            backends_v6: [(4, BackendV6 { addr: v6(7), port: 8080u16.to_be_bytes(), proto: 6, flags: 0 })]
                .into(),
            ..Default::default()
        };
        let entries = [
            (
                AffinityKeyV6 { client: v6(0x905), rev_nat_id: 7 },
                AffinityValueV4 { last_used_ns: now - 15 * S, backend_id: 4, slot: 1 },
            ),
            (
                AffinityKeyV6 { client: v6(5), rev_nat_id: 7 },
                AffinityValueV4 { last_used_ns: now - 90 * S, backend_id: 9, slot: 1 },
            ),
        ];
        let rows = affinity_rows6(&entries, &ctx, now);
        assert_eq!(rows.len(), 2);
        // Same frontend: ordered by client address.
        let r = &rows[1];
        assert_eq!(r.client, "fd00:10::905");
        assert_eq!(r.frontend, "[fd00:10::96]:80");
        assert_eq!(r.protocol, "TCP");
        assert_eq!(r.service, "default/web:http");
        assert_eq!((r.backend_id, r.backend.as_str()), (4, "[fd00:10::7]:8080"));
        assert_eq!(r.last_used_seconds_ago, 15.0);
        assert_eq!(r.time_left_seconds, Some(45.0));
        let stale = &rows[0];
        assert_eq!(stale.client, "fd00:10::5");
        assert_eq!(stale.backend, "(gone)", "id 9 is in neither map");
        assert_eq!(stale.time_left_seconds, Some(0.0));
        let table = affinity_table(&rows);
        assert!(table.contains("fd00:10::905") && table.contains("4 [fd00:10::7]:8080"), "{table}");
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(json[1]["client"], "fd00:10::905");
        assert_eq!(json[1]["backend"], "[fd00:10::7]:8080");
    }
}
