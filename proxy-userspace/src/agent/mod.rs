//! `kproxy agent`: keeps the datapath equal to the cluster (or to manifests on
//! disk) and attached to every pod-facing interface, with kube-proxy's health
//! and metrics endpoints, until SIGTERM or Ctrl-C.

pub mod gc;
pub mod http;
pub mod inherited;
pub mod kube_proxy_config;
pub mod nodeport;
mod reconcile;
pub mod sockdiag;

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{SignalKind, signal};

use proxy_common::{
    conntrack::Timeouts,
    maps::{ConfigV4, DEFAULT_HAIRPIN_ADDR},
};

use crate::{
    agent::http::health::{self, Health},
    agent::http::metrics::Metrics,
    agent::nodeport::NorthSouthOptions,
    bpf::{self, Capacities, InterfaceSelector, Maps, PinDir},
    coverage,
    k8s::api_watch::{self, Changes, KubeOptions},
    model::ModelOptions,
    net::Protocol,
    sync::{SyncReport, Syncer},
};
use reconcile::SyncLoop;

pub enum Source {
    /// Manifests on disk, re-read when a file changes (no cluster needed).
    Files(PathBuf),
    /// The API server.
    Cluster(KubeOptions),
}

pub struct AgentConfig {
    pub pins: PinDir,
    pub source: Source,
    pub interfaces: Vec<String>,
    /// How often interfaces (and manifest files) are checked for changes.
    pub poll: Duration,
    /// Changes arriving closer together than this are applied in one sync.
    pub min_sync_period: Duration,
    /// A full resync (re-read the maps, repair any drift) at least this often.
    pub sync_period: Duration,
    pub healthz_bind: Option<SocketAddr>,
    pub metrics_bind: Option<SocketAddr>,
    /// `--bind-address-hard-fail`: a port that cannot be bound stops the agent instead of being
    /// retried.
    pub bind_address_hard_fail: bool,
    pub model: ModelOptions,
    pub conntrack: ConntrackOptions,
    pub north_south: NorthSouthOptions,
    pub socket_lb: SocketLbOptions,
    /// `--lb-algorithm=maglev`: tables for NodePort, ExternalIP and LB frontends.
    pub maglev: Option<crate::sync::MaglevSettings>,
    /// How long the API watches may show no progress before /healthz is 503.
    pub watch: api_watch::WatchOptions,
    /// Taking the pin directory: how long to wait for another agent, a private bpffs allowed.
    pub claim: bpf::ClaimOptions,
}

/// `--socket-lb` and where its programs attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketLbOptions {
    pub mode: SocketLbMode,
    /// The cgroup (v2) whose processes' sockets are translated, with its
    /// descendants: the cgroup2 root on a node.
    pub cgroup: Option<PathBuf>,
    /// `--socket-lb` was given. The default (host-only) gives way on a node
    /// without cgroup2 instead of stopping the agent.
    pub asked: bool,
    /// `--pod-veth-tc`: whether the veths of pods the hooks cover keep the tc programs.
    pub pod_veth_tc: PodVethTc,
}

/// `--pod-veth-tc`: tc programs on the veths of pods the socket hooks cover.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PodVethTc {
    /// With `--socket-lb on`, none on the veths of pods whose every process is in
    /// `--cgroup-root` (their sockets are translated at connect()/sendmsg()); tc everywhere else.
    Auto,
    /// On every pod veth, whatever the socket hooks cover. The default: a masqueraded flow from
    /// outside the cluster to a cluster IP is un-NATed only by the backend veth's program.
    #[default]
    On,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLbMode {
    /// Translate at connect()/sendmsg() for every process in the cgroup.
    On,
    /// Only for processes in the host's network namespace (hostNetwork pods,
    /// node daemons); pods keep the tc path.
    HostOnly,
    /// The tc path translates everything.
    Off,
}

impl SocketLbOptions {
    /// What the agent does: these options, or off when the default mode has no
    /// cgroup2 hierarchy to attach to.
    fn effective(&self) -> Result<Self> {
        match (self.mode, &self.cgroup) {
            (SocketLbMode::Off, _) | (_, Some(_)) => Ok(self.clone()),
            (_, None) if self.asked => {
                anyhow::bail!("--socket-lb needs a cgroup2 hierarchy: mount one or pass --cgroup-root")
            }
            (_, None) => {
                tracing::warn!(
                    "no cgroup2 hierarchy: socket-level load balancing off, so the node's own processes \
                     (hostNetwork pods, kubelet) cannot reach cluster IPs; mount cgroup2 or pass --cgroup-root"
                );
                Ok(Self { mode: SocketLbMode::Off, ..self.clone() })
            }
        }
    }

    /// The pods whose veths need no tc program: those the hooks cover, with `--socket-lb on` and
    /// `--pod-veth-tc auto`.
    pub fn coverage(&self) -> coverage::Coverage {
        match (self.mode, self.pod_veth_tc, &self.cgroup) {
            (SocketLbMode::On, PodVethTc::Auto, Some(cgroup)) => coverage::Coverage::of_cgroup(cgroup),
            _ => coverage::Coverage::Nothing,
        }
    }

    fn config(&self) -> Result<proxy_common::maps::SocketLbConfigV4> {
        use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF, SocketLbConfigV4};
        let mode = match self.mode {
            SocketLbMode::On => SOCKET_LB_ALL,
            SocketLbMode::HostOnly => SOCKET_LB_HOST_ONLY,
            SocketLbMode::Off => SOCKET_LB_OFF,
        };
        Ok(SocketLbConfigV4 { host_netns_cookie: own_netns_cookie()?, mode, _pad: 0 })
    }
}

/// This process's network namespace cookie (SO_NETNS_COOKIE), as
/// bpf_get_netns_cookie() reports it for sockets in the same namespace.
fn own_netns_cookie() -> Result<u64> {
    const SO_NETNS_COOKIE: i32 = 71;
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").context("a socket to read the netns cookie")?;
    crate::agent::sockdiag::socket_cookie_option(&socket, SO_NETNS_COOKIE)
        .context("getsockopt(SO_NETNS_COOKIE)")
}

/// Conntrack timeouts, table size and garbage collection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackOptions {
    pub timeouts: Timeouts,
    /// CONNTRACK_V4 entries (two per flow); only used when this agent loads a
    /// fresh datapath: a pinned map keeps its size.
    pub max: u32,
    /// First interval of the adaptive GC.
    pub gc_interval: Duration,
}

impl Default for ConntrackOptions {
    fn default() -> Self {
        Self {
            timeouts: Timeouts::DEFAULT,
            max: proxy_common::maps::CONNTRACK_V4_CAPACITY,
            gc_interval: Duration::from_secs(30),
        }
    }
}

impl ConntrackOptions {
    /// CONFIG[0] for these options.
    pub fn config(&self) -> ConfigV4 {
        ConfigV4 {
            timeout_tcp_syn_ns: self.timeouts.tcp_syn_ns,
            timeout_tcp_established_ns: self.timeouts.tcp_established_ns,
            timeout_tcp_closing_ns: self.timeouts.tcp_closing_ns,
            timeout_udp_ns: self.timeouts.udp_ns,
            hairpin_addr: DEFAULT_HAIRPIN_ADDR,
            _pad: 0,
        }
    }
}

/// Writes CONFIG[0] unless it already holds `wanted`. Returns whether it wrote.
pub fn write_config(maps: &mut Maps, wanted: &ConfigV4) -> Result<bool> {
    if maps.config.get(&0, 0).ok().as_ref() == Some(wanted) {
        return Ok(false);
    }
    maps.config.set(0, *wanted, 0).context("writing CONFIG[0]")?;
    Ok(true)
}

/// Deletes at once the conntrack entries of the UDP backends a sync removed
/// (TCP flows keep their backend, as kube-proxy's; see [`gc::purge_backends`]).
pub fn purge_removed_udp_backends(maps: &mut Maps, report: &SyncReport) -> Result<u64> {
    let udp: Vec<u32> = report
        .removed_backends
        .iter()
        .filter(|(_, proto)| *proto == Protocol::Udp)
        .map(|(id, _)| *id)
        .collect();
    gc::purge_backends(maps, &udp)
}

pub fn run(config: AgentConfig) -> Result<()> {
    // Held until the agent returns: one agent per pin directory.
    let _pins_held = bpf::claim(&config.pins, &config.claim)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run_async(config))
}

async fn run_async(config: AgentConfig) -> Result<()> {
    let selector = InterfaceSelector::new(&config.interfaces)?;
    // Without a Node object, `primary` is the default route's interface address, read once as
    // kube-proxy reads the node IP once; with the API server it follows the Node.
    let fixed_primary = match (&config.source, &config.north_south.nodeport_addresses) {
        (Source::Files(_), nodeport::NodePortAddresses::Primary) => Some(nodeport::default_route_address()?),
        _ => None,
    };
    let socket_lb = prepare_datapath(&config)?;
    // Before the first sync gives any Service a frontend: until then the
    // programs pass every packet and netfilter carries every flow.
    let inherited_first = inherit_flows(&config.pins);
    let mut syncer = Syncer::from_maps_with(Maps::from_pins(&config.pins)?, config.maglev)
        .context("reading the pinned maps")?;
    tracing::info!(
        frontends = syncer.frontend_count(),
        backends = syncer.backend_count(),
        "adopted the maps' contents"
    );

    // kube-proxy reports unhealthy when a change waits longer than two sync periods.
    let health = Health::new(config.sync_period * 2);
    let metrics = Metrics::new();
    let changes = Arc::new(
        Changes::with_health(Arc::new(health.clone())).with_queue_metrics(Arc::new(metrics.clone())),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    serve_http(&config, &health, &metrics, &stop_rx).await?;
    start_source(&config, &changes).await?;
    let stop_logs = spawn_background(&config, &selector, &metrics, socket_lb.coverage());
    if let Some(first) = inherited_first {
        tokio::spawn(inherited_loop(config.pins.clone(), health.clone(), metrics.clone(), first));
    }

    let loop_state = SyncLoop {
        fixed_primary,
        syncer: &mut syncer,
        metrics: &metrics,
        health: &health,
        full_sync_due: true,
        logged: BTreeSet::new(),
        pins: config.pins.clone(),
        cache: matches!(config.source, Source::Cluster(_)).then(crate::model::cache::ModelCache::default),
        north_south: config.north_south.clone(),
        socket_lb: socket_lb.mode,
        pod_interfaces: selector,
        node_addresses: None,
        last_good: Default::default(),
        service_cidrs: None,
    };
    sync_until_stopped(&config, &changes, loop_state).await?;
    let _ = stop_tx.send(true);
    stop_logs.store(true, std::sync::atomic::Ordering::Relaxed);
    tracing::info!("stopping; the pinned datapath stays in place");
    Ok(())
}

/// Loads (or reloads) the datapath, writes its configuration and attaches or detaches the socket
/// hooks. Returns the socket-level load balancing in effect.
fn prepare_datapath(config: &AgentConfig) -> Result<SocketLbOptions> {
    let capacities = Capacities {
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
    if write_config(&mut maps, &config.conntrack.config())? {
        tracing::info!(timeouts = ?config.conntrack.timeouts, "wrote the datapath configuration");
    }
    let socket_lb = config.socket_lb.effective()?;
    maps.socket_lb_config.set(0, socket_lb.config()?, 0).context("writing SOCKET_LB_CONFIG[0]")?;
    drop(maps);
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
    Ok(socket_lb)
}

/// The /healthz and /metrics servers; a port that cannot be bound is retried, unless
/// `--bind-address-hard-fail`.
async fn serve_http(
    config: &AgentConfig,
    health: &Health,
    metrics: &Metrics,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    for (server, addr) in
        [(health::Server::Health, config.healthz_bind), (health::Server::Metrics, config.metrics_bind)]
    {
        let Some(addr) = addr else { continue };
        let first = match health::bind_server(server, addr).await {
            Ok(listener) => Some(listener),
            Err(e) if config.bind_address_hard_fail => return Err(e.context("--bind-address-hard-fail")),
            Err(e) => {
                tracing::error!(
                    error = %format!("{e:#}"),
                    "binding failed; retrying every 5s (--bind-address-hard-fail exits instead)"
                );
                None
            }
        };
        let (health, metrics, stop) = (health.clone(), metrics.clone(), stop_rx.clone());
        tokio::spawn(health::serve_retrying(server, addr, first, health, metrics, stop));
    }
    Ok(())
}

/// Starts reading the manifests or watching the API server into `changes`.
async fn start_source(config: &AgentConfig, changes: &Arc<Changes>) -> Result<()> {
    match &config.source {
        Source::Files(path) => {
            tokio::spawn(crate::k8s::manifest_watch::watch_files(
                path.clone(),
                config.poll,
                Arc::clone(changes),
            ));
        }
        Source::Cluster(options) => {
            let client = api_watch::client(options).await?;
            let (changes, node, watch) = (Arc::clone(changes), config.model.node_name.clone(), config.watch);
            let proxy_name = config.model.service_proxy_name.clone();
            tokio::spawn(async move {
                if let Err(e) = api_watch::watch_cluster(client, node, proxy_name, changes, watch).await {
                    tracing::error!(error = %format!("{e:#}"), "watching the API server stopped");
                }
            });
        }
    }
    Ok(())
}

/// The datapath log, interface attachment, datapath metrics and conntrack GC, each on its own task.
/// Returns the flag that stops the log forwarding.
fn spawn_background(
    config: &AgentConfig,
    selector: &InterfaceSelector,
    metrics: &Metrics,
    coverage: coverage::Coverage,
) -> Arc<std::sync::atomic::AtomicBool> {
    let stop_logs = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
    tokio::spawn(datapath_metrics_loop(config.pins.clone(), metrics.clone()));
    tokio::spawn(gc_loop(config.pins.clone(), config.conntrack, metrics.clone()));
    stop_logs
}

/// Syncs on every change (no closer together than `--min-sync-period`) and fully every
/// `--sync-period`, until SIGTERM or SIGINT.
async fn sync_until_stopped(
    config: &AgentConfig,
    changes: &Changes,
    mut loop_state: SyncLoop<'_>,
) -> Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    // healthCheckNodePorts answer on every address, as kube-proxy's do when
    // --nodeport-addresses is not restricted.
    let mut service_health =
        crate::agent::http::service_health::ServiceHealthServers::new(std::net::Ipv4Addr::UNSPECIFIED);
    let mut last_sync: Option<Instant> = None;
    let mut next_full_resync = Instant::now() + config.sync_period;
    loop {
        let full_resync = tokio::select! {
            _ = changes.notify.notified() => false,
            _ = tokio::time::sleep_until(next_full_resync.into()) => true,
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        };
        if !changes.is_ready() {
            continue;
        }
        if let Some(last) = last_sync {
            let wait = config.min_sync_period.saturating_sub(last.elapsed());
            if !wait.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = sigterm.recv() => break,
                    _ = sigint.recv() => break,
                }
            }
        }
        if full_resync {
            if let Err(e) = loop_state.syncer.reload() {
                tracing::error!(error = %format!("{e:#}"), "re-reading the maps for a full resync failed");
            }
            next_full_resync = Instant::now() + config.sync_period;
            loop_state.full_sync_due = true;
        }
        let health_checks = loop_state.sync(changes, &config.model);
        service_health.update(&health_checks).await;
        last_sync = Some(Instant::now());
    }
    Ok(())
}

/// The first scan of nf_conntrack for flows to leave to netfilter; `None` when
/// there is nothing to inherit from (no conntrack table here) or it cannot be
/// read, which is logged.
fn inherit_flows(pins: &PinDir) -> Option<inherited::ScanReport> {
    if !inherited::available() {
        tracing::info!("nf_conntrack is not loaded here: no connection to inherit from netfilter");
        return None;
    }
    match inherited::scan_pinned(pins) {
        Ok(report) => {
            inherited::log(&report, None);
            Some(report)
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
async fn inherited_loop(pins: PinDir, health: Health, metrics: Metrics, first: inherited::ScanReport) {
    metrics.set_inherited_open(first.open as u64);
    while health.check(std::time::SystemTime::now()).not_synced_yet.is_some() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut previous = first;
    loop {
        let p = pins.clone();
        match tokio::task::spawn_blocking(move || inherited::scan_pinned(&p)).await {
            Ok(Ok(report)) => {
                inherited::log(&report, Some(&previous));
                metrics.set_inherited_open(report.open as u64);
                previous = report;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "reading nf_conntrack failed; will retry")
            }
            Err(e) => tracing::warn!(error = %e, "nf_conntrack scan task failed"),
        }
        let idle = previous.open == 0 && previous.over == 0;
        tokio::time::sleep(if idle { inherited::IDLE_SCAN_PERIOD } else { inherited::SCAN_PERIOD }).await;
    }
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

/// Map fill and datapath counters for /metrics, read every few seconds rather
/// than per sync: counting a full conntrack table is not free.
async fn datapath_metrics_loop(pins: PinDir, metrics: Metrics) {
    loop {
        let (p, m) = (pins.clone(), metrics.clone());
        let _ = tokio::task::spawn_blocking(move || -> Result<()> {
            let maps = Maps::from_pins(&p)?;
            for (name, entries, capacity) in bpf::map_usage(&maps) {
                m.set_map_usage(name, entries, capacity);
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
async fn gc_loop(pins: PinDir, options: ConntrackOptions, metrics: Metrics) {
    let mut interval = gc::Interval::new(options.gc_interval);
    metrics.set_gc_interval(interval.current);
    loop {
        tokio::time::sleep(interval.current).await;
        let p = pins.clone();
        let result = tokio::task::spawn_blocking(move || -> Result<gc::GcReport> {
            let mut maps = Maps::from_pins(&p)?;
            // Re-assert CONFIG (a reloaded datapath starts with zeros).
            write_config(&mut maps, &options.config())?;
            gc::run(&mut maps)
        })
        .await;
        match result {
            Ok(Ok(report)) => {
                let deleted = report.deleted_total();
                let next = interval.next(deleted, report.scanned, report.remaining, report.capacity);
                metrics.observe_gc(&report.deleted, report.affinity_deleted, next);
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

/// Go-style durations as kube-proxy's flags take them: `250ms`, `1s`, `1m30s`.
/// The node name kube-proxy falls back to without `--hostname-override`: the host name, trimmed and
/// lowercased (`nodeutil.GetHostname`).
pub fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_lowercase();
    (!name.is_empty()).then_some(name)
}

pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest == "0" {
        return Ok(total);
    }
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let value: f64 = rest[..digits].parse().map_err(|_| format!("{text:?}: expected a number"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            unit => return Err(format!("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")),
        };
        total += Duration::from_secs_f64(value * seconds);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_socket_lb_gives_way_without_cgroup2_an_asked_one_does_not() {
        let defaulted = SocketLbOptions {
            mode: SocketLbMode::HostOnly,
            cgroup: None,
            asked: false,
            pod_veth_tc: PodVethTc::Auto,
        };
        assert_eq!(defaulted.effective().unwrap().mode, SocketLbMode::Off);
        let asked = SocketLbOptions { asked: true, ..defaulted.clone() };
        assert!(asked.effective().is_err(), "--socket-lb host-only without cgroup2 is an error");
        let attached = SocketLbOptions { cgroup: Some("/sys/fs/cgroup".into()), ..defaulted };
        assert_eq!(attached.effective().unwrap(), attached);
    }

    #[test]
    fn pod_veths_lose_tc_only_with_socket_lb_on_and_pod_veth_tc_auto() {
        use coverage::Coverage;
        let cgroup = PathBuf::from("/sys/fs/cgroup/no-such-child");
        let options = |mode, pod_veth_tc| SocketLbOptions {
            mode,
            cgroup: Some(cgroup.clone()),
            asked: true,
            pod_veth_tc,
        };
        assert_eq!(options(SocketLbMode::On, PodVethTc::Auto).coverage(), Coverage::Subtree(cgroup.clone()));
        assert_eq!(options(SocketLbMode::On, PodVethTc::On).coverage(), Coverage::Nothing);
        assert_eq!(options(SocketLbMode::HostOnly, PodVethTc::Auto).coverage(), Coverage::Nothing);
        assert_eq!(options(SocketLbMode::Off, PodVethTc::Auto).coverage(), Coverage::Nothing);
        assert_eq!(Coverage::Nothing.covered(&["veth0".into()]).unwrap(), BTreeSet::new());
        assert_eq!(
            Coverage::Everything.covered(&["veth0".into()]).unwrap(),
            BTreeSet::from(["veth0".into()])
        );
    }

    #[test]
    fn durations_like_kube_proxy_flags() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn config_carries_the_timeouts_and_the_hairpin_address() {
        let options = ConntrackOptions {
            timeouts: Timeouts { udp_ns: 5_000_000_000, ..Timeouts::DEFAULT },
            ..Default::default()
        };
        let config = options.config();
        assert_eq!(config.timeout_udp_ns, 5_000_000_000);
        assert_eq!(config.timeout_tcp_established_ns, Timeouts::DEFAULT.tcp_established_ns);
        assert_eq!(config.hairpin_addr, DEFAULT_HAIRPIN_ADDR);
        assert_eq!(Timeouts::from_config(&config), options.timeouts);
        assert_eq!(ConntrackOptions::default().config().timeout_tcp_syn_ns, 60_000_000_000);
    }
}
