//! The agent's side of the datapath: loading it at start, with the maps opened once ([`prepare`]), and the
//! background tasks that keep it attached to the interfaces, measured for /metrics and garbage-collected,
//! each on handles of its own ([`Maps::try_clone`]).

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex, PoisonError, atomic::AtomicBool},
    time::Duration,
};

use anyhow::{Context as _, Result};
use proxy_common::maps::ConfigV4;

use super::{AgentConfig, ConntrackOptions, SocketLbMode, SocketLbOptions, gc, nodeport};
use crate::{
    agent::http::metrics::Metrics,
    agent::nodeport::NorthSouthOptions,
    bpf::{self, Capacities, InterfaceSelector, Maps, PinDir},
    coverage,
};

/// Loads (or reloads) the datapath, opens its maps (the one time the agent does), writes their
/// configuration and attaches or detaches the socket hooks. Returns the socket-level load balancing in
/// effect and the maps.
pub(super) fn prepare(config: &AgentConfig) -> Result<(SocketLbOptions, Maps)> {
    let capacities = Capacities {
        services: config.lb_map_max,
        backends: config.lb_map_max,
        rev_nat: config.lb_map_max,
        conntrack: config.conntrack.max,
        maglev_tables: config.maglev.map_or(1, |m| m.tables),
        ..Default::default()
    };
    if bpf::load_with(&config.pins, &capacities)? {
        tracing::info!(pins = %config.pins.root().display(), "loaded and pinned the datapath");
    } else {
        tracing::info!(pins = %config.pins.root().display(), "reloaded the programs; reusing the pinned maps and links");
    }
    let mut maps = Maps::from_pins(&config.pins)?;
    let pinned = bpf::conntrack::capacity(&maps);
    if pinned != u64::from(config.conntrack.max) {
        tracing::warn!(
            pinned,
            wanted = config.conntrack.max,
            "the pinned conntrack map keeps its size; --conntrack-max applies after `kproxy unload`"
        );
    }
    let pinned = bpf::rev_nat_capacity(&maps);
    if pinned != u64::from(config.lb_map_max) {
        tracing::warn!(
            pinned,
            wanted = config.lb_map_max,
            "the pinned load-balancing maps keep their size; --bpf-lb-map-max applies after `kproxy unload`"
        );
    }
    if write_config(&mut maps, &config.conntrack.config())? {
        tracing::info!(timeouts = ?config.conntrack.timeouts, "wrote the datapath configuration");
    }
    let socket_lb = config.socket_lb.effective()?;
    maps.socket_lb_config.set(0, socket_lb.config()?, 0).context("writing SOCKET_LB_CONFIG[0]")?;
    attach_socket_hooks(config, &socket_lb)?;
    Ok((socket_lb, maps))
}

fn attach_socket_hooks(config: &AgentConfig, socket_lb: &SocketLbOptions) -> Result<()> {
    match (&socket_lb.mode, &socket_lb.cgroup) {
        (SocketLbMode::Off, _) => {
            let detached = bpf::detach_socket_lb(&config.pins)?;
            if !detached.is_empty() {
                tracing::info!(cgroups = ?detached, "socket-level load balancing off: detached");
            }
        }
        (_, None) => anyhow::bail!("--socket-lb needs a cgroup2 hierarchy: mount one or pass --cgroup-root"),
        (mode, Some(cgroup)) => {
            let attached = bpf::attach_socket_lb(&config.pins, cgroup)?;
            tracing::info!(cgroup = %cgroup.display(), ?mode, hooks = attached.len(), "socket-level load balancing on");
        }
    }
    Ok(())
}

/// Writes CONFIG[0] unless it already holds `wanted`. Returns whether it wrote.
fn write_config(maps: &mut Maps, wanted: &ConfigV4) -> Result<bool> {
    if maps.config.get(&0, 0).ok().as_ref() == Some(wanted) {
        return Ok(false);
    }
    maps.config.set(0, *wanted, 0).context("writing CONFIG[0]")?;
    Ok(true)
}

/// The datapath log, interface attachment, datapath metrics and conntrack GC, each on its own task (the
/// last two with handles of their own on `maps`). Returns the flag that stops the log forwarding.
pub(super) fn spawn_background(
    config: &AgentConfig,
    selector: &InterfaceSelector,
    metrics: &Metrics,
    coverage: coverage::Coverage,
    maps: &Maps,
) -> Result<Arc<AtomicBool>> {
    let (metrics_maps, gc_maps) = (maps.try_clone()?, maps.try_clone()?);
    let stop_logs = Arc::new(AtomicBool::new(false));
    {
        let (pins, stop) = (config.pins.clone(), Arc::clone(&stop_logs));
        tokio::task::spawn_blocking(move || {
            if let Err(e) = bpf::forward_bpf_logs(&pins, &stop) {
                tracing::debug!(error = %format!("{e:#}"), "datapath log not forwarded");
            }
        });
    }
    tokio::spawn(attach_loop(
        config.pins.clone(),
        selector.clone(),
        config.north_south.clone(),
        coverage,
        config.poll,
    ));
    tokio::spawn(datapath_metrics_loop(metrics_maps, metrics.clone()));
    tokio::spawn(gc_loop(gc_maps, config.conntrack, metrics.clone()));
    Ok(stop_logs)
}

/// Attaches to matching interfaces (and the external ones) as they appear, and detaches from
/// (or re-attaches to) the veths of pods as the socket hooks start (or stop) covering them;
/// blocking aya calls run off the async workers.
async fn attach_loop(
    pins: PinDir,
    selector: InterfaceSelector,
    north_south: NorthSouthOptions,
    coverage: coverage::Coverage,
    poll: Duration,
) {
    let mut untranslated = BTreeSet::new();
    let mut coverage_error: Option<String> = None;
    loop {
        let (p, s, ns, c) = (pins.clone(), selector.clone(), north_south.clone(), coverage.clone());
        type Attached = (bpf::AttachReport, BTreeSet<String>, Option<String>);
        let attach = move || -> Result<Attached> {
            let external = nodeport::select(&ns, &nodeport::local_addresses()?, &s, None).interface_names();
            let pods: Vec<String> =
                bpf::interfaces()?.into_iter().filter(|i| s.matches(&i.name)).map(|i| i.name).collect();
            // Not knowing who is covered keeps tc everywhere: a pod's packets are never left
            // untranslated by mistake.
            let (covered, error) = match c.covered(&pods) {
                Ok(covered) => (covered, None),
                Err(e) => (BTreeSet::new(), Some(format!("{e:#}"))),
            };
            Ok((bpf::attach_all(&p, &s, &external, ns.xdp, &covered)?, covered, error))
        };
        match tokio::task::spawn_blocking(attach).await {
            Ok(Ok((report, covered, error))) => {
                // Once per distinct error, not every pass.
                if error.is_some() && error != coverage_error {
                    tracing::warn!(
                        error = error.as_deref().unwrap_or_default(),
                        "cannot tell which pods the socket hooks cover; tc on every pod veth"
                    );
                }
                coverage_error = error;
                for name in covered.difference(&untranslated) {
                    tracing::info!(interface = %name, "pod covered by the socket hooks: no tc program on its veth");
                }
                for name in untranslated.difference(&covered) {
                    tracing::info!(interface = %name, "pod no longer covered by the socket hooks: tc on its veth");
                }
                for label in &report.attached {
                    tracing::info!(hook = %label, "attached");
                }
                for label in &report.pruned {
                    let name = label.split('@').next().unwrap_or_default().replace("%2E", ".");
                    if covered.contains(&name) {
                        tracing::info!(link = %label, "link removed: the socket hooks cover the pod");
                    } else {
                        tracing::info!(link = %label, "interface gone, link removed");
                    }
                }
                untranslated = covered;
                for (label, error) in &report.failed {
                    tracing::warn!(hook = %label, %error, "attach failed; will retry");
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), "listing interfaces failed"),
            Err(e) => tracing::warn!(error = %e, "attach task failed"),
        }
        tokio::time::sleep(poll).await;
    }
}

/// The maps whose entries others count as they go, so that the metrics loop does not walk them: the
/// service maps (the Syncer's mirror, at every sync) and the conntrack and affinity tables (the GC's
/// scan). At 10k Services and a full conntrack table, walking them every 2 s cost hundreds of thousands
/// of syscalls.
const COUNTED_ELSEWHERE: [&str; 12] = [
    "services_v4",
    "backends_v4",
    "rev_nat_v4",
    "vips_v4",
    "services_v6",
    "backends_v6",
    "rev_nat_v6",
    "vips_v6",
    "conntrack_v4",
    "conntrack_v6",
    "affinity_v4",
    "affinity_v6",
];

/// Map capacities, the fill of the maps nobody else counts, and the datapath counters for /metrics,
/// every 2 s.
async fn datapath_metrics_loop(maps: Maps, metrics: Metrics) {
    let maps = Arc::new(maps);
    loop {
        let (maps, m) = (Arc::clone(&maps), metrics.clone());
        let _ = tokio::task::spawn_blocking(move || -> Result<()> {
            for (name, entries, capacity) in
                bpf::map_usage_where(&maps, |name| !COUNTED_ELSEWHERE.contains(&name))
            {
                m.set_map_capacity(name, capacity);
                if let Some(entries) = entries {
                    m.set_map_entries(name, entries);
                }
            }
            let counters = bpf::read_stats(&maps)?;
            let pairs: Vec<(&str, u64)> =
                counters.iter().map(|(stat, packets)| (stat.name(), *packets)).collect();
            m.set_datapath_counters(&pairs);
            Ok(())
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Conntrack and affinity garbage collection at an adaptive interval
/// ([`gc::Interval`]); each run is blocking map I/O, off the async workers.
async fn gc_loop(maps: Maps, options: ConntrackOptions, metrics: Metrics) {
    let maps = Arc::new(Mutex::new(maps));
    let mut interval = gc::Interval::new(options.gc_interval);
    metrics.set_gc_interval(interval.current);
    loop {
        tokio::time::sleep(interval.current).await;
        let maps = Arc::clone(&maps);
        let result = tokio::task::spawn_blocking(move || -> Result<gc::GcReport> {
            // A run that panicked left the maps as they are: the next one carries on.
            let mut maps = maps.lock().unwrap_or_else(PoisonError::into_inner);
            // Re-assert CONFIG (another writer may have changed it).
            write_config(&mut maps, &options.config())?;
            gc::run(&mut maps)
        })
        .await;
        match result {
            Ok(Ok(report)) => {
                let deleted = report.deleted_total();
                let next = interval.next(deleted, report.scanned, report.remaining, report.capacity);
                metrics.observe_gc(&report.deleted, report.affinity_deleted, next);
                for (map, entries) in &report.fill {
                    metrics.set_map_entries(map, *entries);
                }
                tracing::debug!(
                    scanned = report.scanned,
                    deleted,
                    affinity_deleted = report.affinity_deleted,
                    remaining = report.remaining,
                    next_s = next.as_secs_f64(),
                    "conntrack gc"
                );
            }
            Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), "conntrack gc failed"),
            Err(e) => tracing::warn!(error = %e, "conntrack gc task failed"),
        }
    }
}
