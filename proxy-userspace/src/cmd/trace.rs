//! `kproxy trace`: NAT events from the datapath's ring buffer, printed the way
//! tcpdump would show the packet before and after each step that changed it —
//! the answer to "who un-NATs the return packet?" for a live flow.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use proxy_common::{
    maps::{CT_FLAG_HAIRPIN, IPPROTO_TCP, IPPROTO_UDP, RevNatId},
    trace::{
        EV_DNAT_ESTABLISHED, EV_DNAT_NEW, EV_DROP_INVALID, EV_ICMP_UNNAT, EV_REJECT, EV_UNNAT,
        SLOT_BY_AFFINITY, SLOT_BY_MAGLEV, TraceEvent,
    },
};
use serde::Serialize;

use crate::bpf::{
    PinDir,
    conntrack::monotonic_ns,
    trace::{EventRing, Listening, TraceFlag, frontend_names},
};

#[derive(clap::Args, Debug, Default)]
pub struct TraceArgs {
    /// Only flows of this Service (namespace/name).
    #[arg(long)]
    pub service: Option<String>,
    /// Only flows of this client address (IPv4 or IPv6).
    #[arg(long)]
    pub client: Option<IpAddr>,
    /// Only packets with this port on either side (before or after NAT).
    #[arg(long)]
    pub port: Option<u16>,
    /// Stop after this many events (each prints its before and after lines).
    #[arg(long)]
    pub count: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One printed step.
#[derive(Debug, Serialize, PartialEq)]
pub struct Step {
    /// Wall-clock time of the event, RFC 3339.
    pub time: String,
    /// `pre-DNAT`, `post-DNAT`, `reply`, `un-NAT`, `refused`, `dropped`.
    pub step: &'static str,
    pub source: String,
    pub destination: String,
    pub protocol: &'static str,
    /// What the step did, for people.
    pub note: String,
}

/// An address and port as tcpdump and `ss` write them: `10.96.0.10:53`, `[fd00:10:96::a]:53`.
fn endpoint(addr: IpAddr, port: [u8; 2]) -> String {
    std::net::SocketAddr::new(addr, u16::from_be_bytes(port)).to_string()
}

fn protocol(p: u8) -> &'static str {
    match p {
        IPPROTO_TCP => "tcp",
        IPPROTO_UDP => "udp",
        _ => "?",
    }
}

fn age(ns: u64) -> String {
    let ms = ns as f64 / 1e6;
    if ms < 1000.0 { format!("{ms:.1} ms") } else { format!("{:.1} s", ms / 1000.0) }
}

/// Turns an event into the lines a person reads. `now_mono`/`now_wall` map the
/// kernel's monotonic timestamps to wall-clock time.
pub fn steps(event: &TraceEvent<IpAddr>, service: &str, now_mono: u64, now_wall: SystemTime) -> Vec<Step> {
    let wall = now_wall
        .checked_sub(Duration::from_nanos(now_mono.saturating_sub(event.timestamp_ns)))
        .unwrap_or(now_wall);
    let time = crate::k8s::time::rfc3339(wall);
    let proto = protocol(event.proto);
    let before_src = endpoint(event.before_saddr, event.before_sport);
    let before_dst = endpoint(event.before_daddr, event.before_dport);
    let after_src = endpoint(event.after_saddr, event.after_sport);
    let after_dst = endpoint(event.after_daddr, event.after_dport);
    let hairpin = if event.ct_flags & CT_FLAG_HAIRPIN != 0 { ", hairpin: source rewritten" } else { "" };
    let service = if service.is_empty() { "unnamed frontend".to_owned() } else { service.to_owned() };
    let step = |step, source: &String, destination: &String, note: String| Step {
        time: time.clone(),
        step,
        source: source.clone(),
        destination: destination.clone(),
        protocol: proto,
        note,
    };
    match event.kind {
        EV_DNAT_NEW | EV_DNAT_ESTABLISHED => {
            let which = if event.kind == EV_DNAT_NEW {
                match event.backend_slot {
                    SLOT_BY_AFFINITY => format!("backend {} by session affinity, new flow", event.backend_id),
                    SLOT_BY_MAGLEV => format!("backend {} by Maglev, new flow", event.backend_id),
                    slot => format!("backend {slot} of {}, new flow", event.backend_count),
                }
            } else {
                format!(
                    "backend {}, conntrack entry created {} ago",
                    event.backend_id,
                    age(event.timestamp_ns.saturating_sub(event.ct_created_ns))
                )
            };
            vec![
                step("pre-DNAT", &before_src, &before_dst, String::new()),
                step("post-DNAT", &after_src, &after_dst, format!("{service}, {which}{hairpin}")),
            ]
        }
        EV_UNNAT => vec![
            step("reply", &before_src, &before_dst, String::new()),
            step(
                "un-NAT",
                &after_src,
                &after_dst,
                format!(
                    "{service}, conntrack entry created {} ago{hairpin}",
                    age(event.timestamp_ns.saturating_sub(event.ct_created_ns))
                ),
            ),
        ],
        EV_REJECT => vec![step(
            "refused",
            &before_src,
            &before_dst,
            format!("{service} has no endpoint for this port: RST / ICMP port unreachable sent back"),
        )],
        EV_DROP_INVALID => vec![step(
            "dropped",
            &before_src,
            &before_dst,
            format!("{service}: TCP segment of no known connection (INVALID)"),
        )],
        EV_ICMP_UNNAT => vec![
            step("ICMP", &before_src, &before_dst, "an ICMP error quotes this packet".to_owned()),
            step(
                "un-NAT",
                &after_src,
                &after_dst,
                format!(
                    "{service}: the quote rewritten for the client, conntrack entry created {} ago",
                    age(event.timestamp_ns.saturating_sub(event.ct_created_ns))
                ),
            ),
        ],
        _ => vec![step("unknown", &before_src, &before_dst, format!("event kind {}", event.kind))],
    }
}

/// Whether an event passes the command line's filters.
pub fn matches(event: &TraceEvent<IpAddr>, args: &TraceArgs, service_ids: Option<&[RevNatId]>) -> bool {
    if let Some(ids) = service_ids
        && !ids.contains(&event.rev_nat_id)
    {
        return false;
    }
    if let Some(client) = args.client {
        let involved = [event.before_saddr, event.before_daddr, event.after_saddr, event.after_daddr];
        if !involved.contains(&client) {
            return false;
        }
    }
    if let Some(port) = args.port {
        let port = port.to_be_bytes();
        let ports = [event.before_sport, event.before_dport, event.after_sport, event.after_dport];
        if !ports.contains(&port) {
            return false;
        }
    }
    true
}

/// Text line for a step, aligned like tcpdump output.
pub fn line(step: &Step) -> String {
    let base =
        format!("{} {:<9} {} > {} {}", step.time, step.step, step.source, step.destination, step.protocol);
    if step.note.is_empty() { base } else { format!("{base} ({})", step.note) }
}

pub fn run(pins: &PinDir, args: &TraceArgs) -> Result<()> {
    let mut ring = EventRing::open(pins)?;
    let flag = TraceFlag::open(pins)?;
    let mut names = frontend_names(pins)?;
    let service_ids = |names: &BTreeMap<RevNatId, String>| -> Option<Vec<RevNatId>> {
        let wanted = args.service.as_ref()?;
        let prefix = format!("{wanted}:");
        Some(names.iter().filter(|(_, n)| n.starts_with(&prefix)).map(|(id, _)| *id).collect())
    };
    if let Some(ids) = service_ids(&names)
        && ids.is_empty()
    {
        bail!(
            "no Service {} is programmed (see `kproxy dump services`)",
            args.service.as_deref().unwrap_or("")
        );
    }

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).context("installing signal handlers")?;
    }
    let _listening = Listening::start(pins, flag)?;
    eprintln!("tracing NAT events (Ctrl-C to stop)");

    let started = Instant::now();
    let mut seen = 0u64;
    let mut last_names_refresh = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if args.timeout.is_some_and(|t| started.elapsed() >= Duration::from_secs(t)) {
            break;
        }
        let Some(event) = ring.next_event() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        if !names.contains_key(&event.rev_nat_id) && last_names_refresh.elapsed() > Duration::from_millis(200)
        {
            names = frontend_names(pins)?;
            last_names_refresh = Instant::now();
        }
        let ids = service_ids(&names);
        if !matches(&event, args, ids.as_deref()) {
            continue;
        }
        let service = names.get(&event.rev_nat_id).cloned().unwrap_or_default();
        for step in steps(&event, &service, monotonic_ns(), SystemTime::now()) {
            if args.json {
                println!("{}", serde_json::to_string(&step)?);
            } else {
                println!("{}", line(&step));
            }
        }
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns_event_of<A: Copy + Default>(kind: u8, client: A, vip: A, pod: A) -> TraceEvent<A> {
        let (cport, dns) = (56340u16.to_be_bytes(), 53u16.to_be_bytes());
        let base = TraceEvent::<A> {
            timestamp_ns: 2_000_400_000,
            ct_created_ns: 2_000_000_000,
            backend_id: 7,
            rev_nat_id: 3,
            backend_slot: 2,
            backend_count: 3,
            kind,
            proto: IPPROTO_UDP,
            ..Default::default()
        };
        if kind == EV_UNNAT {
            TraceEvent {
                before_saddr: pod,
                before_sport: dns,
                before_daddr: client,
                before_dport: cport,
                after_saddr: vip,
                after_sport: dns,
                after_daddr: client,
                after_dport: cport,
                ..base
            }
        } else {
            TraceEvent {
                before_saddr: client,
                before_sport: cport,
                before_daddr: vip,
                before_dport: dns,
                after_saddr: client,
                after_sport: cport,
                after_daddr: pod,
                after_dport: dns,
                ..base
            }
        }
    }

    fn dns_event(kind: u8) -> TraceEvent<IpAddr> {
        dns_event_of(kind, [10, 244, 0, 2], [10, 96, 0, 10], [10, 244, 0, 12]).map_addrs(IpAddr::from)
    }

    fn v6(text: &str) -> [u8; 16] {
        text.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }

    fn dns_event6(kind: u8) -> proxy_common::trace::TraceEventV6 {
        dns_event_of(kind, v6("fd00:10:244::2"), v6("fd00:10:96::a"), v6("fd00:10:244::c"))
    }

    /// The record as the datapath writes it into the ring buffer.
    fn record<A>(event: &TraceEvent<A>) -> Vec<u8> {
        // SAFETY: a repr(C) of integers and byte arrays, read as its bytes.
        unsafe {
            std::slice::from_raw_parts((event as *const TraceEvent<A>).cast::<u8>(), size_of_val(event))
        }
        .to_vec()
    }

    #[test]
    fn an_ipv6_dns_query_reads_from_the_ring_and_prints_bracketed_endpoints() {
        let now_wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_960_800);
        let svc = "kube-system/kube-dns:dns";
        let mut lines = Vec::new();
        for kind in [EV_DNAT_NEW, EV_UNNAT] {
            let event = crate::bpf::trace::decode(&record(&dns_event6(kind))).expect("an IPv6 record");
            lines.extend(steps(&event, svc, 2_000_400_000, now_wall).iter().map(line));
        }
        assert_eq!(
            lines,
            [
                "2026-11-29T14:00:00Z pre-DNAT  [fd00:10:244::2]:56340 > [fd00:10:96::a]:53 udp",
                "2026-11-29T14:00:00Z post-DNAT [fd00:10:244::2]:56340 > [fd00:10:244::c]:53 udp (kube-system/kube-dns:dns, backend 2 of 3, new flow)",
                "2026-11-29T14:00:00Z reply     [fd00:10:244::c]:53 > [fd00:10:244::2]:56340 udp",
                "2026-11-29T14:00:00Z un-NAT    [fd00:10:96::a]:53 > [fd00:10:244::2]:56340 udp (kube-system/kube-dns:dns, conntrack entry created 0.4 ms ago)",
            ]
        );
        let event = crate::bpf::trace::decode(&record(&dns_event6(EV_DNAT_NEW))).unwrap();
        let client = |c: &str| TraceArgs { client: Some(c.parse().unwrap()), ..Default::default() };
        assert!(matches(&event, &client("fd00:10:244::2"), None));
        assert!(!matches(&event, &client("fd00:10:244::3"), None));
        assert!(!matches(&event, &client("10.244.0.2"), None), "an IPv4 client is no IPv6 flow's");
    }

    #[test]
    fn ring_records_are_told_apart_by_length() {
        let v4: proxy_common::trace::TraceEventV4 =
            dns_event_of(EV_DNAT_NEW, [10, 244, 0, 2], [10, 96, 0, 10], [10, 244, 0, 12]);
        assert_eq!(crate::bpf::trace::decode(&record(&v4)), Some(dns_event(EV_DNAT_NEW)));
        let mut short = record(&v4);
        short.pop();
        assert_eq!(crate::bpf::trace::decode(&short), None, "a record of neither length is skipped");
        assert_eq!(crate::bpf::trace::decode(&[]), None);
    }

    #[test]
    fn the_four_steps_of_a_dns_query() {
        let now_wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_960_800);
        let svc = "kube-system/kube-dns:dns";
        let mut lines: Vec<String> =
            steps(&dns_event(EV_DNAT_NEW), svc, 2_000_400_000, now_wall).iter().map(line).collect();
        lines.extend(steps(&dns_event(EV_UNNAT), svc, 2_000_400_000, now_wall).iter().map(line));
        assert_eq!(
            lines,
            [
                "2026-11-29T14:00:00Z pre-DNAT  10.244.0.2:56340 > 10.96.0.10:53 udp",
                "2026-11-29T14:00:00Z post-DNAT 10.244.0.2:56340 > 10.244.0.12:53 udp (kube-system/kube-dns:dns, backend 2 of 3, new flow)",
                "2026-11-29T14:00:00Z reply     10.244.0.12:53 > 10.244.0.2:56340 udp",
                "2026-11-29T14:00:00Z un-NAT    10.96.0.10:53 > 10.244.0.2:56340 udp (kube-system/kube-dns:dns, conntrack entry created 0.4 ms ago)",
            ]
        );
    }

    /// A new flow's backend is named by how it was chosen: a drawn slot, the client's session
    /// affinity, or the frontend's Maglev table (which draws no slot either).
    #[test]
    fn a_new_flow_says_how_its_backend_was_chosen() {
        let now_wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_960_800);
        let note = |backend_slot: u16| {
            let event = TraceEvent { backend_slot, ..dns_event(EV_DNAT_NEW) };
            steps(&event, "default/web:http", 2_000_400_000, now_wall)[1].note.clone()
        };
        assert_eq!(note(2), "default/web:http, backend 2 of 3, new flow");
        assert_eq!(note(SLOT_BY_AFFINITY), "default/web:http, backend 7 by session affinity, new flow");
        assert_eq!(note(SLOT_BY_MAGLEV), "default/web:http, backend 7 by Maglev, new flow");
    }

    #[test]
    fn filters() {
        let e = dns_event(EV_DNAT_NEW);
        let args = |client: Option<&str>, port: Option<u16>| TraceArgs {
            client: client.map(|c| c.parse().unwrap()),
            port,
            ..Default::default()
        };
        assert!(matches(&e, &args(None, None), None));
        assert!(matches(&e, &args(Some("10.244.0.2"), Some(53)), None));
        assert!(!matches(&e, &args(Some("10.244.0.3"), None), None));
        assert!(!matches(&e, &args(None, Some(80)), None));
        assert!(matches(&e, &args(None, None), Some(&[3])));
        assert!(!matches(&e, &args(None, None), Some(&[4])));
    }
}
