//! Inherited flows: connections netfilter translated before kproxy took over
//! (kube-proxy's DNAT, its masquerade), read from nf_conntrack over ctnetlink
//! and marked in `INHERITED_V4`, so that the datapath leaves them to netfilter
//! until they end (see `proxy_common::inherited` for the keys and what each is
//! for). Without this, every connection opened through kube-proxy would stall
//! the moment kproxy programs its Service: a TCP segment to a Service with no
//! kproxy conntrack entry that is not a SYN is dropped.
//!
//! When: once before the first sync programs a frontend (until then the
//! attached programs pass everything, so netfilter still carries every flow),
//! once right after it (flows opened in between), then every
//! [`SCAN_PERIOD`] while any is left, and every [`IDLE_SCAN_PERIOD`] after
//! that (kube-proxy may still be running and translating what kproxy does not
//! see first: the node's own connections in tc mode).
//!
//! Only entries netfilter destination-NATed are taken: a flow it only
//! source-NATed (a pod's masqueraded connection to the internet) can neither
//! be a Service's nor clash with one of kproxy's translations.

use std::{
    collections::HashMap as StdHashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use anyhow::{Context as _, Result};
use proxy_common::{
    inherited::{NfTuple, keys},
    maps::{CtKeyV4, INHERITED_V4_CAPACITY, IPPROTO_TCP, IPPROTO_UDP, InheritedFlowV4},
};

use crate::{
    agent::http::{health::Health, metrics::Metrics},
    bpf,
    net::Protocol,
    nf_conntrack::{self, Entry},
};

/// How often nf_conntrack is read while inherited flows remain.
pub const SCAN_PERIOD: Duration = Duration::from_secs(2);
/// ...and once none is left.
pub const IDLE_SCAN_PERIOD: Duration = Duration::from_secs(30);

/// What a scan found and changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Inherited flows still open (their packets are netfilter's).
    pub open: usize,
    /// Inherited TCP flows that are over, kept for their reply tuple.
    pub over: usize,
    pub marked: usize,
    pub unmarked: usize,
    /// Entries left out because the map was full.
    pub left_out: usize,
}

/// The map's desired contents for these nf_conntrack entries.
pub fn desired(entries: &[Entry]) -> (StdHashMap<CtKeyV4, InheritedFlowV4>, ScanReport) {
    let mut want = StdHashMap::new();
    let mut report = ScanReport::default();
    for entry in entries.iter().filter(|e| e.is_dst_nat()) {
        let open = !entry.is_over();
        let proto = match entry.proto {
            Protocol::Tcp => IPPROTO_TCP,
            Protocol::Udp => IPPROTO_UDP,
        };
        let (entry_keys, n) = keys(proto, tuple(&entry.orig), tuple(&entry.reply), open);
        if want.len() + n > INHERITED_V4_CAPACITY as usize {
            report.left_out += 1;
            continue;
        }
        if open {
            report.open += 1;
        } else {
            report.over += 1;
        }
        want.extend(entry_keys[..n].iter().copied());
    }
    (want, report)
}

fn tuple(t: &nf_conntrack::Tuple) -> NfTuple {
    NfTuple {
        src: t.src.octets(),
        dst: t.dst.octets(),
        sport: t.sport.to_be_bytes(),
        dport: t.dport.to_be_bytes(),
    }
}

/// Reads nf_conntrack (of the calling thread's network namespace) and makes
/// `INHERITED_V4` hold its translated flows, and nothing else.
pub fn scan(inherited: &mut bpf::InheritedMap) -> Result<ScanReport> {
    let entries = nf_conntrack::dump_v4().context("reading nf_conntrack")?;
    let (want, mut report) = desired(&entries);
    let have: Vec<(CtKeyV4, InheritedFlowV4)> = inherited.iter().filter_map(|r| r.ok()).collect();
    for (key, value) in &have {
        if want.get(key) != Some(value) && inherited.remove(key).is_ok() {
            report.unmarked += 1;
        }
    }
    let have: StdHashMap<CtKeyV4, InheritedFlowV4> = have.into_iter().collect();
    for (key, value) in &want {
        if have.get(key) != Some(value) {
            inherited.insert(key, value, 0).context("writing INHERITED_V4")?;
            report.marked += 1;
        }
    }
    Ok(report)
}

/// The first scan of nf_conntrack for flows to leave to netfilter, on a handle of its own on
/// `maps.inherited` (returned for [`scan_loop`]); `None` when there is nothing to inherit from (no
/// conntrack table here) or it cannot be read, which is logged.
pub fn first_scan(maps: &bpf::Maps) -> Option<(bpf::InheritedMap, ScanReport)> {
    if !available() {
        tracing::info!("nf_conntrack is not loaded here: no connection to inherit from netfilter");
        return None;
    }
    match bpf::second_handle(&maps.inherited).and_then(|mut map| Ok((scan(&mut map)?, map))) {
        Ok((report, map)) => {
            log(&report, None);
            Some((map, report))
        }
        Err(e) => {
            tracing::warn!(
                error = %format!("{e:#}"),
                "cannot read nf_conntrack: connections opened through kube-proxy stall when kproxy serves \
                 their Service"
            );
            None
        }
    }
}

/// Scans again once the first sync is programmed (flows opened before it),
/// then while inherited flows remain, and seldom after.
pub async fn scan_loop(map: bpf::InheritedMap, health: Health, metrics: Metrics, first: ScanReport) {
    let map = Arc::new(Mutex::new(map));
    metrics.set_inherited_open(first.open as u64);
    while health.check(std::time::SystemTime::now()).not_synced_yet.is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut previous = first;
    loop {
        let map = Arc::clone(&map);
        let scanned = tokio::task::spawn_blocking(move || {
            scan(&mut map.lock().unwrap_or_else(PoisonError::into_inner))
        });
        match scanned.await {
            Ok(Ok(report)) => {
                log(&report, Some(&previous));
                metrics.set_inherited_open(report.open as u64);
                previous = report;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "reading nf_conntrack failed; will retry")
            }
            Err(e) => tracing::warn!(error = %e, "nf_conntrack scan task failed"),
        }
        let idle = previous.open == 0 && previous.over == 0;
        tokio::time::sleep(if idle { IDLE_SCAN_PERIOD } else { SCAN_PERIOD }).await;
    }
}

/// Logs a scan's outcome when it says something new.
pub fn log(report: &ScanReport, previous: Option<&ScanReport>) {
    if report.left_out > 0 {
        tracing::warn!(
            left_out = report.left_out,
            capacity = INHERITED_V4_CAPACITY,
            "more connections translated by netfilter than INHERITED_V4 holds: those left out stall or are \
             re-translated when kproxy serves their Service"
        );
    }
    match previous {
        None if report.open > 0 => tracing::info!(
            open = report.open,
            "connections netfilter (kube-proxy) translated before kproxy took over are left to netfilter until \
             they end"
        ),
        Some(before) if before.open > 0 && report.open == 0 => {
            tracing::info!("every connection inherited from netfilter has ended")
        }
        Some(before) if before.open != report.open => {
            tracing::debug!(open = report.open, before = before.open, "inherited connections")
        }
        _ => {}
    }
}

/// Whether this network namespace has a conntrack table to inherit from.
pub fn available() -> bool {
    nf_conntrack::is_available()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use nf_conntrack::{TcpState, Tuple};

    fn entry(proto: Protocol, state: Option<TcpState>, dnat: bool) -> Entry {
        let client = Ipv4Addr::new(10, 244, 0, 5);
        let vip = Ipv4Addr::new(10, 96, 0, 10);
        let backend = Ipv4Addr::new(10, 244, 1, 7);
        let reply_src = if dnat { backend } else { vip };
        Entry {
            proto,
            orig: Tuple { src: client, dst: vip, sport: 40000, dport: 53 },
            reply: Tuple { src: reply_src, dst: client, sport: 53, dport: 40000 },
            status: if dnat { nf_conntrack::IPS_DST_NAT } else { 0 },
            tcp_state: state,
            timeout_secs: 100,
            mark: 0,
            zone: 0,
        }
    }

    #[test]
    fn translated_flows_are_marked_and_others_are_not() {
        let entries = [
            entry(Protocol::Tcp, Some(TcpState::Established), true),
            entry(Protocol::Udp, None, true),
            entry(Protocol::Tcp, Some(TcpState::TimeWait), true),
            entry(Protocol::Tcp, Some(TcpState::Established), false),
        ];
        let (want, report) = desired(&entries);
        assert_eq!((report.open, report.over, report.left_out), (2, 1, 0));
        // TCP open: reply + forward; UDP open: reply + forward + any-client; TCP over: its reply
        // key, the same tuple as the open TCP flow's (one entry).
        assert_eq!(want.len(), 2 + 3);
    }
}
