//! `kproxy agent`: keeps the datapath equal to the cluster (or to manifests on
//! disk) and attached to every pod-facing interface, with kube-proxy's health
//! and metrics endpoints, until SIGTERM or Ctrl-C.
//!
//! [`run`] loads the datapath and opens its maps once ([`datapath::prepare`]); each part gets its own
//! handles on them: the [`Syncer`], the sync loop ([`reconcile`]), the inherited-flow scans, the
//! metrics and the garbage collection.

mod datapath;
pub mod gc;
pub mod http;
pub mod inherited;
pub mod kube_proxy_config;
pub mod nodeport;
mod options;
mod reconcile;
pub mod sockdiag;
mod topology;

use std::{collections::BTreeSet, sync::Arc, time::Instant};

use anyhow::{Context as _, Result};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    agent::http::health::{self, Health},
    agent::http::metrics::Metrics,
    bpf::{self, InterfaceSelector},
    k8s::api_watch::{self, Changes},
    sync::Syncer,
};
pub use options::{
    AgentConfig, ConntrackOptions, PodVethTc, SocketLbMode, SocketLbOptions, Source, host_name,
    parse_duration,
};
use reconcile::SyncLoop;

pub fn run(config: AgentConfig) -> Result<()> {
    one_malloc_arena();
    // Held until the agent returns: one agent per pin directory.
    let _pins_held = bpf::claim(&config.pins, &config.claim)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run_async(config))
}

/// One glibc malloc arena for all the agent's threads: the watchers decode objects on the runtime's
/// workers and the sync loop builds and frees on its own thread; with an arena per thread (glibc's
/// default, up to 8 per core) memory freed in one arena is not reused by the others, and the agent's
/// peak RSS carried every arena's high-water mark.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a parameter of the allocator, which is thread-safe.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

async fn run_async(config: AgentConfig) -> Result<()> {
    let selector = InterfaceSelector::new(&config.interfaces)?;
    // Without a Node object, `primary` is the default route's interface address, read once as
    // kube-proxy reads the node IP once; with the API server it follows the Node.
    let fixed_primary = match (&config.source, &config.north_south.nodeport_addresses) {
        (Source::Files(_), nodeport::NodePortAddresses::Primary) => Some(nodeport::default_route_address()?),
        _ => None,
    };
    let (socket_lb, maps) = datapath::prepare(&config)?;
    // Before the first sync gives any Service a frontend: until then the
    // programs pass every packet and netfilter carries every flow.
    let inherited_first = inherited::first_scan(&maps);
    let mut syncer =
        Syncer::from_maps_with(maps.try_clone()?, config.maglev).context("reading the pinned maps")?;
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
    let stop_logs = datapath::spawn_background(&config, &selector, &metrics, socket_lb.coverage(), &maps)?;
    if let Some((map, first)) = inherited_first {
        tokio::spawn(inherited::scan_loop(map, health.clone(), metrics.clone(), first));
    }

    let loop_state = SyncLoop {
        fixed_primary,
        syncer: &mut syncer,
        metrics: &metrics,
        health: &health,
        full_sync_due: true,
        logged: BTreeSet::new(),
        maps,
        cache: matches!(config.source, Source::Cluster(_)).then(crate::model::cache::ModelCache::default),
        north_south: config.north_south.clone(),
        socket_lb: socket_lb.mode,
        pod_interfaces: selector,
        node_addresses: None,
        last_good: Default::default(),
        service_cidrs: None,
        topology: Default::default(),
    };
    sync_until_stopped(&config, &changes, loop_state).await?;
    let _ = stop_tx.send(true);
    stop_logs.store(true, std::sync::atomic::Ordering::Relaxed);
    tracing::info!("stopping; the pinned datapath stays in place");
    Ok(())
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
