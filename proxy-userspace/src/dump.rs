//! `kproxy dump`: the maps as people (tables) and machines (`--json`) read them.

use std::{collections::BTreeMap, fmt::Write as _, net::Ipv4Addr};

use anyhow::{Context as _, Result};
use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY},
    stats::Stat,
};
use serde::Serialize;

use crate::{datapath::Maps, model::Protocol};

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ServiceRow {
    pub frontend: String,
    pub protocol: &'static str,
    pub slot: u16,
    pub service: String,
    pub rev_nat_id: u16,
    /// Slot 0: number of active backends; other slots: 0.
    pub count: u16,
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

fn names(maps: &Maps) -> BTreeMap<u16, String> {
    maps.names.iter().filter_map(|e| e.ok()).map(|(id, n)| (id, n.as_str().to_owned())).collect()
}

pub fn services(maps: &Maps) -> Result<Vec<ServiceRow>> {
    let names = names(maps);
    let mut rows = Vec::new();
    for entry in maps.services.iter() {
        let (key, value) = entry.context("reading the services map")?;
        let backend = if key.slot == 0 {
            None
        } else {
            Some(match maps.backends.get(&value.backend_id, 0) {
                Ok(b) => endpoint(b.addr, b.port),
                Err(_) => "(missing)".to_owned(),
            })
        };
        rows.push(ServiceRow {
            frontend: endpoint(key.vip, key.port),
            protocol: proto_name(key.proto),
            slot: key.slot,
            service: names.get(&value.rev_nat_id).cloned().unwrap_or_default(),
            rev_nat_id: value.rev_nat_id,
            count: if key.slot == 0 { value.count } else { 0 },
            backend_id: (key.slot != 0).then_some(value.backend_id),
            backend,
        });
    }
    rows.sort_by(|a, b| {
        (Ipv4Addr::from(parse_ip(&a.frontend)), &a.frontend, a.protocol, a.slot).cmp(&(
            Ipv4Addr::from(parse_ip(&b.frontend)),
            &b.frontend,
            b.protocol,
            b.slot,
        ))
    });
    Ok(rows)
}

fn parse_ip(endpoint: &str) -> [u8; 4] {
    endpoint.split(':').next().and_then(|ip| ip.parse::<Ipv4Addr>().ok()).map_or([0; 4], |ip| ip.octets())
}

pub fn backends(maps: &Maps) -> Result<Vec<BackendRow>> {
    let mut rows = Vec::new();
    for entry in maps.backends.iter() {
        let (id, b) = entry.context("reading the backends map")?;
        rows.push(BackendRow {
            id,
            address: endpoint(b.addr, b.port),
            protocol: proto_name(b.proto),
            state: if b.flags & proxy_common::maps::BACKEND_FLAG_TERMINATING != 0 {
                "terminating"
            } else {
                "active"
            },
        });
    }
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn conntrack(maps: &Maps) -> Result<Vec<ConntrackRow>> {
    let names = names(maps);
    let now = monotonic_ns();
    let mut forward = Vec::new();
    let mut reply = std::collections::HashMap::new();
    for entry in maps.conntrack.iter() {
        let (key, value) = entry.context("reading the conntrack map")?;
        match key.direction {
            CT_DIR_FORWARD => forward.push((key, value)),
            CT_DIR_REPLY => {
                reply.insert(key, value);
            }
            _ => {}
        }
    }
    let mut rows = Vec::new();
    for (key, fwd) in forward {
        let back = reply.get(&key.reply_of(fwd.nat_addr, fwd.nat_port));
        let seconds = |ns: u64| now.saturating_sub(ns) as f64 / 1e9;
        let last_seen = back.map_or(fwd.last_seen_ns, |r| r.last_seen_ns.max(fwd.last_seen_ns));
        rows.push(ConntrackRow {
            original: format!("{} -> {}", endpoint(key.saddr, key.sport), endpoint(key.daddr, key.dport)),
            translated: format!(
                "{} -> {}",
                endpoint(key.saddr, key.sport),
                endpoint(fwd.nat_addr, fwd.nat_port)
            ),
            protocol: proto_name(key.proto),
            service: names.get(&fwd.rev_nat_id).cloned().unwrap_or_default(),
            backend_id: fwd.backend_id,
            state: CtState::from_u8(fwd.state).map_or("?", CtState::name),
            age_seconds: seconds(fwd.created_ns),
            idle_seconds: seconds(last_seen),
            packets_out: fwd.packets,
            bytes_out: fwd.bytes,
            packets_reply: back.map_or(0, |r| r.packets),
            bytes_reply: back.map_or(0, |r| r.bytes),
        });
    }
    rows.sort_by(|a, b| a.original.cmp(&b.original));
    Ok(rows)
}

/// `(map, entries, capacity)` for every map with a fixed capacity.
pub fn map_usage(maps: &Maps) -> Vec<(&'static str, u64, u64)> {
    fn capacity<K: aya::Pod, V, M: aya::maps::IterableMap<K, V>>(map: &M) -> u64 {
        map.map().info().map_or(0, |info| u64::from(info.max_entries()))
    }
    vec![
        ("services_v4", maps.services.keys().count() as u64, capacity(&maps.services)),
        ("backends_v4", maps.backends.keys().count() as u64, capacity(&maps.backends)),
        ("rev_nat_v4", maps.rev_nat.keys().count() as u64, capacity(&maps.rev_nat)),
        ("conntrack_v4", maps.conntrack.keys().count() as u64, capacity(&maps.conntrack)),
    ]
}

pub fn stats(maps: &Maps) -> Result<Vec<StatRow>> {
    Stat::ALL
        .iter()
        .map(|stat| {
            let per_cpu = maps.stats.get(&(*stat as u32), 0).context("reading the stats map")?;
            Ok(StatRow { reason: stat.name(), packets: per_cpu.iter().sum() })
        })
        .collect()
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
                _ => format!("{} backends", r.count),
            };
            vec![
                r.frontend.clone(),
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
            "PKTS OUT/REPLY",
            "BYTES OUT/REPLY",
            "BACKEND",
            "SERVICE",
        ],
        &cells,
    )
}

pub fn stats_table(rows: &[StatRow]) -> String {
    let cells: Vec<Vec<String>> =
        rows.iter().map(|r| vec![r.reason.to_owned(), r.packets.to_string()]).collect();
    table(&["REASON", "PACKETS"], &cells)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "1".into()], vec!["q".into(), "22".into()]]);
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
    }
}
