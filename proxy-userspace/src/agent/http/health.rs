//! kube-proxy compatible health and metrics HTTP endpoints.
//!
//! * `--healthz-bind-address` (kube-proxy default `0.0.0.0:10256`): `/healthz`
//!   and `/livez`, JSON bodies, 200 when healthy and 503 when not.
//! * `--metrics-bind-address` (kube-proxy default `127.0.0.1:10249`):
//!   `/metrics` (Prometheus text format) and `/proxyMode` (`ebpf`).
//!
//! Health follows kube-proxy's proxier health server: the proxy is unhealthy
//! while a queued change has waited longer than the health timeout
//! (kube-proxy uses 2 × `--sync-period`) without a successful sync. Starting
//! up with nothing queued is healthy.
//!
//! `/healthz` (not `/livez`: restarting the agent does not bring the API server
//! back) is also 503 while the agent cannot see the cluster: a watched kind has
//! shown no progress (a complete list, an event, a bookmark or a watch the
//! server accepted) for its progress timeout, or needs a list and has failed
//! [`LIST_FAILURES_BLIND`] in a row. An unhealthy body says why in `reason`.
//!
//! Both servers answer GET and HEAD only; other methods get 405 with `Allow`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use anyhow::anyhow;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::agent::http::metrics::{self, Metrics};
use crate::k8s::api_watch::{WatchObserver, WatchProgress};
use crate::k8s::time::rfc3339;

/// Body of `/proxyMode`.
pub const PROXY_MODE: &str = "ebpf";

/// How long in-flight requests may take to finish after shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Slow or idle clients are dropped if they do not send headers in time.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Failed lists in a row after which a watched kind counts as blind before its
/// progress timeout: it needs a list (it never had one, or the server said its
/// resourceVersion is gone, so changes are being missed) and cannot get one.
/// With kube-runtime's default backoff (0.8 s doubling, up to twice that with
/// its jitter) the fifth failure comes 12 to 24 s after the first.
pub const LIST_FAILURES_BLIND: u32 = 5;

/// Shared proxier health state; cheap to clone.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Mutex<HealthState>>,
}

struct HealthState {
    health_timeout: Duration,
    started: SystemTime,
    /// Time of the last successful sync, if any.
    last_updated: Option<SystemTime>,
    /// When the oldest change not yet applied was queued.
    oldest_pending: Option<SystemTime>,
    /// Whether the node may receive traffic (kube-proxy: not being deleted
    /// and not tainted ToBeDeletedByClusterAutoscaler). Only `/healthz` uses it.
    node_eligible: bool,
    /// The API watches, by name ("Service watch"). Only `/healthz` uses them.
    sources: BTreeMap<&'static str, SourceState>,
}

/// How one watched kind is faring.
struct SourceState {
    progress_timeout: Duration,
    /// The last complete list, event, bookmark or accepted watch (or when the
    /// watch was registered, before any).
    last_progress: SystemTime,
    /// Failed lists since the last complete one.
    list_failures: u32,
    last_list_error: String,
    /// What went wrong since the last progress, if anything.
    last_error: Option<String>,
    /// When the list under way was asked for.
    listing_since: Option<SystemTime>,
}

impl SourceState {
    /// Why this watch cannot see the cluster as of `now`, if it cannot.
    fn blind(&self, name: &str, now: SystemTime) -> Option<String> {
        if self.list_failures >= LIST_FAILURES_BLIND {
            return Some(format!(
                "{name}: list failed {} times: {}",
                self.list_failures, self.last_list_error
            ));
        }
        let silent = now.duration_since(self.last_progress).unwrap_or_default();
        if silent < self.progress_timeout {
            return None;
        }
        let mut reason = format!(
            "{name}: no list, event or bookmark for {} (limit {})",
            seconds(silent),
            seconds(self.progress_timeout)
        );
        if let Some(asked) = self.listing_since {
            let waited = now.duration_since(asked).unwrap_or_default();
            reason.push_str(&format!("; a list has waited {} for an answer", seconds(waited)));
        }
        if let Some(error) = &self.last_error {
            reason.push_str("; last error: ");
            reason.push_str(error);
        }
        Some(reason)
    }
}

/// `4s`, `2.5s`, `120s`: whole seconds when they are.
fn seconds(duration: Duration) -> String {
    if duration.subsec_millis() == 0 || duration >= Duration::from_secs(10) {
        format!("{}s", duration.as_secs())
    } else {
        format!("{:.1}s", duration.as_secs_f64())
    }
}

/// Result of [`Health::check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    /// No change has waited past the health timeout (kube-proxy's health).
    pub healthy: bool,
    /// Last successful sync, or the start time if there was none yet.
    pub last_updated: SystemTime,
    pub current_time: SystemTime,
    /// Why `healthy` is false.
    pub unsynced: Option<String>,
    /// Why the agent cannot see the cluster, if it cannot (`/healthz` only).
    pub blind: Option<String>,
    /// Set until the first successful sync (`/healthz` only): a node whose datapath holds nothing yet
    /// is not ready for traffic, but the process is alive.
    pub not_synced_yet: Option<String>,
}

impl Health {
    /// Healthy until a change stays pending for longer than `health_timeout`.
    /// The start time (reported as `last_updated` before the first sync) is now.
    pub fn new(health_timeout: Duration) -> Self {
        Health {
            inner: Arc::new(Mutex::new(HealthState {
                health_timeout,
                started: SystemTime::now(),
                last_updated: None,
                oldest_pending: None,
                node_eligible: true,
                sources: BTreeMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HealthState> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A change arrived at `at` that the datapath does not carry yet. The
    /// oldest pending time is kept until [`Health::updated`].
    pub fn queued(&self, at: SystemTime) {
        let mut state = self.lock();
        state.oldest_pending = Some(match state.oldest_pending {
            Some(oldest) => oldest.min(at),
            None => at,
        });
    }

    /// A sync completed successfully at `at`: every pending change is applied.
    pub fn updated(&self, at: SystemTime) {
        let mut state = self.lock();
        state.last_updated = Some(at);
        state.oldest_pending = None;
    }

    /// Mark whether this node should receive load-balancer traffic. While
    /// false, `/healthz` answers 503 (`/livez` is unaffected). Defaults to true.
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// Registers an API watch called `name` ("Service watch"): from `now` on,
    /// it must show progress through the returned handle at least every
    /// `progress_timeout`, or `/healthz` reports it blind.
    pub fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> SourceHealth {
        let source = SourceState {
            progress_timeout,
            last_progress: now,
            list_failures: 0,
            last_list_error: String::new(),
            last_error: None,
            listing_since: None,
        };
        self.lock().sources.insert(name, source);
        SourceHealth { health: self.clone(), name }
    }

    /// Why the agent cannot see the cluster as of `now`, if it cannot: every
    /// blind watch's reason.
    pub fn blind(&self, now: SystemTime) -> Option<String> {
        let state = self.lock();
        let reasons: Vec<String> =
            state.sources.iter().filter_map(|(name, source)| source.blind(name, now)).collect();
        (!reasons.is_empty()).then(|| reasons.join("; "))
    }

    /// Health as of `now`: unhealthy iff a change has been pending for at
    /// least the health timeout; and whether the agent is blind.
    pub fn check(&self, now: SystemTime) -> HealthReport {
        let blind = self.blind(now);
        let state = self.lock();
        // A pending time in the future (clock step) counts as just queued.
        let waited = state.oldest_pending.map(|oldest| now.duration_since(oldest).unwrap_or_default());
        let unsynced = waited.filter(|waited| *waited >= state.health_timeout).map(|waited| {
            format!(
                "a change has waited {} for a successful sync (limit {})",
                seconds(waited),
                seconds(state.health_timeout)
            )
        });
        let not_synced_yet = state.last_updated.is_none().then(|| {
            let since = now.duration_since(state.started).unwrap_or_default();
            format!("no sync has been programmed yet (started {} ago)", seconds(since))
        });
        HealthReport {
            healthy: unsynced.is_none(),
            last_updated: state.last_updated.unwrap_or(state.started),
            current_time: now,
            unsynced,
            blind,
            not_synced_yet,
        }
    }
}

/// One API watch's handle on the health state (see [`Health::watch_source`]).
#[derive(Clone)]
pub struct SourceHealth {
    health: Health,
    name: &'static str,
}

impl SourceHealth {
    fn update(&self, change: impl FnOnce(&mut SourceState)) {
        if let Some(source) = self.health.lock().sources.get_mut(self.name) {
            change(source);
        }
    }

    /// An event, a bookmark, or a watch the server accepted at `at`: the
    /// agent is current as of then.
    pub fn progress(&self, at: SystemTime) {
        self.update(|source| {
            source.last_progress = source.last_progress.max(at);
            source.last_error = None;
        });
    }

    /// A list was asked for at `at`.
    pub fn listing(&self, at: SystemTime) {
        self.update(|source| source.listing_since = Some(at));
    }

    /// A complete list at `at`: the snapshot was replaced.
    pub fn listed(&self, at: SystemTime) {
        self.progress(at);
        self.update(|source| {
            source.list_failures = 0;
            source.listing_since = None;
        });
    }

    /// A list failed with `error`.
    pub fn list_failed(&self, error: &str) {
        self.update(|source| {
            source.listing_since = None;
            source.list_failures += 1;
            source.last_list_error = error.to_owned();
            source.last_error = Some(format!("list failed: {error}"));
        });
    }

    /// A watch request or stream failed (`error` says which and how).
    pub fn failed(&self, error: &str) {
        self.update(|source| source.last_error = Some(error.to_owned()));
    }
}

/// The API watchers report through [`WatchObserver`] (defined beside them, in `k8s`), so that they
/// never import the agent.
impl WatchObserver for Health {
    fn queued(&self, at: SystemTime) {
        Health::queued(self, at);
    }

    fn node_eligible(&self) -> bool {
        Health::node_eligible(self)
    }

    fn set_node_eligible(&self, eligible: bool) {
        Health::set_node_eligible(self, eligible);
    }

    fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> Arc<dyn WatchProgress> {
        Arc::new(Health::watch_source(self, name, progress_timeout, now))
    }

    fn blind(&self, now: SystemTime) -> Option<String> {
        Health::blind(self, now)
    }
}

impl WatchProgress for SourceHealth {
    fn progress(&self, at: SystemTime) {
        SourceHealth::progress(self, at);
    }

    fn listing(&self, at: SystemTime) {
        SourceHealth::listing(self, at);
    }

    fn listed(&self, at: SystemTime) {
        SourceHealth::listed(self, at);
    }

    fn list_failed(&self, error: &str) {
        SourceHealth::list_failed(self, error);
    }

    fn failed(&self, error: &str) {
        SourceHealth::failed(self, error);
    }
}

/// Serve `/healthz` + `/livez` on `health_addr` and `/metrics` + `/proxyMode`
/// on `metrics_addr` until `shutdown` resolves.
pub async fn serve(
    health_addr: SocketAddr,
    metrics_addr: SocketAddr,
    health: Health,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    bind(health_addr, metrics_addr).await?.serve(health, metrics, shutdown).await
}

/// Both listeners, bound; see [`bind`].
pub struct Bound {
    health: TcpListener,
    metrics: TcpListener,
    health_addr: SocketAddr,
    metrics_addr: SocketAddr,
}

/// Bind both listeners (port 0 picks a free port). Errors name the flag and
/// address, e.g. `--healthz-bind-address 0.0.0.0:10256: Address in use`.
pub async fn bind(health_addr: SocketAddr, metrics_addr: SocketAddr) -> anyhow::Result<Bound> {
    let (health, health_addr) = listen("--healthz-bind-address", health_addr).await?;
    let (metrics, metrics_addr) = listen("--metrics-bind-address", metrics_addr).await?;
    Ok(Bound { health, metrics, health_addr, metrics_addr })
}

async fn listen(flag: &str, addr: SocketAddr) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow!("{flag} {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| anyhow!("{flag} {addr}: {e}"))?;
    Ok((listener, local))
}

impl Bound {
    /// The bound health address (with the real port if 0 was asked for).
    pub fn health_addr(&self) -> SocketAddr {
        self.health_addr
    }

    /// The bound metrics address (with the real port if 0 was asked for).
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Serve until `shutdown` resolves; then stop accepting, let in-flight
    /// requests finish (up to a few seconds) and return.
    pub async fn serve(
        self,
        health: Health,
        metrics: Metrics,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        tracing::info!(address = %self.health_addr, "serving /healthz and /livez");
        tracing::info!(address = %self.metrics_addr, "serving /metrics and /proxyMode");
        let (stop_tx, stop_rx) = watch::channel(false);
        let signal = async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        };
        tokio::join!(
            accept_loop(self.health, Router::Health(health), stop_rx.clone()),
            accept_loop(self.metrics, Router::Metrics(metrics), stop_rx),
            signal,
        );
        Ok(())
    }
}

/// One of the two servers, for those started apart ([`serve_retrying`]): an empty
/// `--metrics-bind-address` turns off the metrics server only, as in kube-proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// `/healthz` and `/livez` on `--healthz-bind-address`.
    Health,
    /// `/metrics` and `/proxyMode` on `--metrics-bind-address`.
    Metrics,
}

/// How often a server whose port is taken tries again (kube-proxy's `wait.Until` period).
pub const BIND_RETRY: Duration = Duration::from_secs(5);

impl Server {
    fn flag(self) -> &'static str {
        match self {
            Server::Health => "--healthz-bind-address",
            Server::Metrics => "--metrics-bind-address",
        }
    }
}

/// Binds `server`'s listener; the error names the flag and address.
pub async fn bind_server(server: Server, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    Ok(listen(server.flag(), addr).await?.0)
}

/// Serves `server` until `stop` turns true, on `first` if the caller bound it, else binding
/// `addr` every [`BIND_RETRY`] with an error line each time it fails: while kube-proxy still
/// holds the port during a migration, the agent works and takes the port when it is free (kube-proxy
/// with `--bind-address-hard-fail=false`, the default).
pub async fn serve_retrying(
    server: Server,
    addr: SocketAddr,
    first: Option<TcpListener>,
    health: Health,
    metrics: Metrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut listener = first;
    let listener = loop {
        if let Some(listener) = listener.take() {
            break listener;
        }
        tokio::select! {
            _ = stopped(&mut stop) => return,
            _ = tokio::time::sleep(BIND_RETRY) => {}
        }
        match bind_server(server, addr).await {
            Ok(bound) => {
                tracing::info!(%addr, "bound {} after retrying", server.flag());
                listener = Some(bound);
            }
            Err(e) => tracing::error!(error = %format!("{e:#}"), "binding failed; retrying in 5s"),
        }
    };
    let address = listener.local_addr().unwrap_or(addr);
    match server {
        Server::Health => {
            tracing::info!(%address, "serving /healthz and /livez");
            accept_loop(listener, Router::Health(health), stop).await;
        }
        Server::Metrics => {
            tracing::info!(%address, "serving /metrics and /proxyMode");
            accept_loop(listener, Router::Metrics(metrics), stop).await;
        }
    }
}

#[derive(Clone)]
enum Router {
    Health(Health),
    Metrics(Metrics),
}

pub(crate) type Body = Full<Bytes>;

/// What a listener answers, cloned into each connection; lets other HTTP
/// endpoints (e.g. [`crate::agent::http::service_health`]) share the connection handling
/// (timeouts, graceful stop) below.
pub(crate) trait Respond: Clone + Send + Sync + 'static {
    fn respond(&self, path: &str) -> Response<Body>;

    /// Whether methods other than GET and HEAD get 405. The health check node
    /// ports answer any method, as kube-proxy's do (load balancers differ).
    fn get_and_head_only(&self) -> bool {
        false
    }
}

impl Respond for Router {
    fn get_and_head_only(&self) -> bool {
        true
    }

    fn respond(&self, path: &str) -> Response<Body> {
        match (self, path) {
            (Router::Health(health), "/healthz") => health_response(health, true),
            (Router::Health(health), "/livez") => health_response(health, false),
            (Router::Metrics(metrics), "/metrics") => {
                text(StatusCode::OK, metrics::CONTENT_TYPE, metrics.render())
            }
            (Router::Metrics(_), "/proxyMode") => {
                text(StatusCode::OK, "text/plain; charset=utf-8", PROXY_MODE.to_owned())
            }
            _ => text(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "404 page not found\n".to_owned()),
        }
    }
}

/// kube-proxy's `/healthz` (`with_node` = true) and `/livez` responses. As in
/// kube-proxy, a healthy answer reports `lastUpdated` = `currentTime` (older
/// releases reported the last sync loop run, which was always recent); an
/// unhealthy one reports the last successful sync (or the start time).
///
/// An unhealthy body adds `reason`, e.g. `"Service watch: list failed 5
/// times: 500 Internal Server Error: …"`; `/livez` leaves out the node and the
/// cluster's visibility.
fn health_response(health: &Health, with_node: bool) -> Response<Body> {
    let report = health.check(SystemTime::now());
    let node_eligible = health.node_eligible();
    let mut reasons: Vec<String> = report.unsynced.iter().cloned().collect();
    if with_node {
        if !node_eligible {
            reasons.push(
                "this node is not eligible for traffic (being deleted, or tainted ToBeDeletedByClusterAutoscaler)"
                    .to_owned(),
            );
        }
        reasons.extend(report.blind.iter().cloned());
        // Readiness must not lie: kube-proxy's node is not ready until its rules are written once.
        reasons.extend(report.not_synced_yet.iter().cloned());
    }
    let healthy = reasons.is_empty();
    let last_updated = if healthy { report.current_time } else { report.last_updated };
    let mut body = format!(
        r#"{{"lastUpdated": "{}","currentTime": "{}""#,
        rfc3339(last_updated),
        rfc3339(report.current_time)
    );
    if with_node {
        body.push_str(&format!(r#", "nodeEligible": {node_eligible}"#));
    }
    if !healthy {
        let reason = serde_json::Value::String(reasons.join("; "));
        body.push_str(&format!(r#", "reason": {reason}"#));
    }
    body.push('}');
    let status = if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let probe = if with_node { metrics::Probe::Healthz } else { metrics::Probe::Livez };
    metrics::count_probe(probe, status.as_u16());
    text(status, "application/json", body)
}

/// A response with `X-Content-Type-Options: nosniff`, which every kube-proxy
/// endpoint sends.
pub(crate) fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(HeaderName::from_static("x-content-type-options"), HeaderValue::from_static("nosniff"));
    response
}

fn method_not_allowed() -> Response<Body> {
    let mut response = text(
        StatusCode::METHOD_NOT_ALLOWED,
        "text/plain; charset=utf-8",
        "405 method not allowed\n".to_owned(),
    );
    response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    response
}

/// Serve `listener` until `stop` turns true or its sender is dropped; then
/// close the listener and give open connections [`SHUTDOWN_GRACE`] to finish.
/// Aborting the task instead closes the listener and every connection at once.
pub(crate) async fn accept_loop<R: Respond>(
    listener: TcpListener,
    router: R,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    let for_connections = stop.clone();
    loop {
        tokio::select! {
            _ = stopped(&mut stop) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let stop = for_connections.clone();
                    connections.spawn(serve_connection(stream, router.clone(), stop));
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let drained =
        tokio::time::timeout(SHUTDOWN_GRACE, async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        connections.shutdown().await;
    }
}

/// Resolves once `stop` turns true (or its sender is gone). Unlike
/// `watch::Receiver::wait_for` it holds no lock guard across an await, so the
/// server future stays `Send`.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    loop {
        let done = *stop.borrow_and_update();
        if done || stop.changed().await.is_err() {
            return;
        }
    }
}

async fn serve_connection<R: Respond>(stream: TcpStream, router: R, mut stop: watch::Receiver<bool>) {
    let service = service_fn(move |request: Request<Incoming>| {
        // hyper sends no body in answer to HEAD (the headers stay those of GET).
        let response = match request.method() {
            &Method::GET | &Method::HEAD => router.respond(request.uri().path()),
            _ if !router.get_and_head_only() => router.respond(request.uri().path()),
            _ => method_not_allowed(),
        };
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
            return;
        }
        _ = stopped(&mut stop) => {}
    }
    connection.as_mut().graceful_shutdown();
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::http::{HttpResponse, get};
    use std::time::UNIX_EPOCH;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn healthy_initially_and_reports_start_time() {
        let before = SystemTime::now();
        let health = Health::new(Duration::from_secs(60));
        let report = health.check(SystemTime::now() + Duration::from_secs(3600));
        assert!(report.healthy, "nothing queued yet must be healthy");
        assert!(report.last_updated >= before && report.last_updated <= SystemTime::now());
        assert!(health.node_eligible());
    }

    #[test]
    fn unhealthy_when_pending_past_timeout_then_healthy_after_update() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        health.queued(t0);
        // Later changes do not move the oldest pending time forward...
        health.queued(t0 + Duration::from_secs(50));
        assert!(health.check(t0 + Duration::from_secs(59)).healthy);
        let late = health.check(t0 + Duration::from_secs(60));
        assert!(!late.healthy);
        assert_eq!(late.current_time, t0 + Duration::from_secs(60));
        // ...but an earlier-stamped one moves it back.
        health.queued(t0 - Duration::from_secs(30));
        assert!(!health.check(t0 + Duration::from_secs(35)).healthy);
        // A clock step back is not a timeout.
        assert!(health.check(t0 - Duration::from_secs(100)).healthy);

        let synced = t0 + Duration::from_secs(61);
        health.updated(synced);
        let report = health.check(t0 + Duration::from_secs(1000));
        assert!(report.healthy);
        assert_eq!(report.last_updated, synced);

        // The timeout restarts from the next queued change.
        health.queued(t0 + Duration::from_secs(2000));
        assert!(health.check(t0 + Duration::from_secs(2059)).healthy);
        assert!(!health.check(t0 + Duration::from_secs(2061)).healthy);
        assert_eq!(health.check(t0).last_updated, synced);
    }

    #[test]
    fn a_watch_without_progress_for_its_timeout_is_blind_until_it_shows_progress() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        let services = health.watch_source("Service watch", Duration::from_secs(4), t0);
        health.watch_source("EndpointSlice watch", Duration::from_secs(4), t0 + Duration::from_secs(100));
        assert_eq!(health.blind(t0 + Duration::from_millis(3_900)), None);
        assert_eq!(
            health.blind(t0 + Duration::from_secs(4)).as_deref(),
            Some("Service watch: no list, event or bookmark for 4s (limit 4s)")
        );
        services.failed("watch: client error (Connect): Connection refused");
        let report = health.check(t0 + Duration::from_millis(6_500));
        assert_eq!(
            report.blind.as_deref(),
            Some(
                "Service watch: no list, event or bookmark for 6.5s (limit 4s); \
                 last error: watch: client error (Connect): Connection refused"
            )
        );
        // Blindness is not kube-proxy's sync health (/livez).
        assert!(report.healthy && report.unsynced.is_none(), "{report:?}");

        // A bookmark (or an event, or an accepted watch) and it sees again, error forgotten.
        services.progress(t0 + Duration::from_secs(7));
        assert_eq!(health.blind(t0 + Duration::from_secs(10)), None);
        // Both watches blind: both named.
        let both = health.blind(t0 + Duration::from_secs(104)).unwrap();
        assert!(
            both.starts_with("EndpointSlice watch: no list") && both.contains("; Service watch: no list"),
            "{both}"
        );
        // A progress report older than the last one does not move it back.
        services.progress(t0);
        assert!(health.blind(t0 + Duration::from_secs(10)).is_none());
    }

    #[test]
    fn lists_that_keep_failing_are_blind_before_the_timeout_and_a_list_clears_them() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        let services = health.watch_source("Service watch", Duration::from_secs(120), t0);
        let error = "500 Internal Server Error: an error on the server";
        for _ in 1..LIST_FAILURES_BLIND {
            services.list_failed(error);
        }
        assert_eq!(health.blind(t0 + Duration::from_secs(1)), None);
        services.list_failed(error);
        assert_eq!(
            health.blind(t0 + Duration::from_secs(1)).as_deref(),
            Some("Service watch: list failed 5 times: 500 Internal Server Error: an error on the server")
        );
        // Watch progress alone does not clear it: the agent still needs a list.
        services.progress(t0 + Duration::from_secs(2));
        assert!(health.blind(t0 + Duration::from_secs(2)).is_some());
        services.listed(t0 + Duration::from_secs(3));
        assert_eq!(health.blind(t0 + Duration::from_secs(3)), None);
        // A list under way is named.
        services.listing(t0 + Duration::from_secs(195));
        let reason = health.blind(t0 + Duration::from_secs(200)).unwrap();
        assert!(reason.contains("(limit 120s); a list has waited 5s for an answer"), "{reason}");
        // Past the timeout the last list error is named.
        services.list_failed(error);
        let reason = health.blind(t0 + Duration::from_secs(200)).unwrap();
        assert!(reason.ends_with(&format!("last error: list failed: {error}")), "{reason}");
    }

    #[test]
    fn an_unsynced_change_is_named_in_the_report() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = at(1_700_000_000);
        health.queued(t0);
        let report = health.check(t0 + Duration::from_secs(65));
        assert!(!report.healthy);
        assert_eq!(
            report.unsynced.as_deref(),
            Some("a change has waited 65s for a successful sync (limit 60s)")
        );
        assert_eq!(report.blind, None);
    }

    /// One raw request on its own connection: the whole answer as sent.
    async fn raw(addr: SocketAddr, method: &str, path: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut answer))
            .await
            .expect("the server answers and closes")
            .unwrap();
        answer
    }

    #[tokio::test]
    async fn blind_healthz_says_why_and_only_get_and_head_are_answered() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let bound = bind(loopback, loopback).await.unwrap();
        let (health_addr, metrics_addr) = (bound.health_addr(), bound.metrics_addr());
        let health = Health::new(Duration::from_secs(60));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(bound.serve(health.clone(), Metrics::new(), async move {
            let _ = stop_rx.await;
        }));

        health.updated(SystemTime::now());
        // A Service watch that has failed its lists: /healthz 503 with the reason, /livez 200.
        let services = health.watch_source("Service watch", Duration::from_secs(120), SystemTime::now());
        for _ in 0..LIST_FAILURES_BLIND {
            services.list_failed("500 Internal Server Error: injected");
        }
        let response = get(health_addr, "/healthz").await;
        assert_eq!(response.status, 503);
        let body = json(&response);
        assert_eq!(body["reason"], "Service watch: list failed 5 times: 500 Internal Server Error: injected");
        assert_eq!(body["nodeEligible"], serde_json::Value::Bool(true));
        let livez = get(health_addr, "/livez").await;
        assert_eq!(livez.status, 200);
        assert!(json(&livez).get("reason").is_none());

        // An ineligible node is named too; a healthy answer has no reason.
        health.set_node_eligible(false);
        let reason = json(&get(health_addr, "/healthz").await)["reason"].as_str().unwrap().to_owned();
        assert!(
            reason.starts_with("this node is not eligible")
                && reason.contains("; Service watch: list failed")
        );
        health.set_node_eligible(true);
        services.listed(SystemTime::now());
        let response = get(health_addr, "/healthz").await;
        assert_eq!(response.status, 200);
        assert!(json(&response).get("reason").is_none());

        // HEAD: GET's status and headers, no body.
        for (addr, path) in [(health_addr, "/healthz"), (health_addr, "/livez"), (metrics_addr, "/metrics")] {
            let answer = raw(addr, "HEAD", path).await;
            let (head, body) = answer.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "HEAD {path}: {head}");
            assert!(head.to_ascii_lowercase().contains("content-length: "), "HEAD {path}: {head}");
            assert_eq!(body, "", "HEAD {path} sent a body");
        }
        // Anything else: 405 with Allow, on known and unknown paths alike.
        for (addr, method, path) in [
            (metrics_addr, "POST", "/metrics"),
            (metrics_addr, "PUT", "/proxyMode"),
            (health_addr, "POST", "/healthz"),
            (health_addr, "DELETE", "/livez"),
            (health_addr, "OPTIONS", "/nope"),
        ] {
            let answer = raw(addr, method, path).await;
            assert!(answer.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{method} {path}: {answer}");
            assert!(
                answer.to_ascii_lowercase().contains("\r\nallow: get, head\r\n"),
                "{method} {path}: {answer}"
            );
            assert!(answer.ends_with("405 method not allowed\n"), "{method} {path}: {answer}");
        }
        assert_eq!(get(health_addr, "/healthz").await.status, 200, "a 405 does not change the health");

        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(3), server).await.unwrap().unwrap().unwrap();
    }

    fn json(response: &HttpResponse) -> serde_json::Value {
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_eq!(response.header("x-content-type-options"), Some("nosniff"));
        serde_json::from_str(&response.body).expect("JSON body")
    }

    fn is_rfc3339(value: &serde_json::Value) -> bool {
        let s = value.as_str().unwrap_or_default();
        s.len() >= 20 && s.as_bytes()[4] == b'-' && s.as_bytes()[10] == b'T' && s.ends_with('Z')
    }

    #[tokio::test]
    async fn http_round_trip() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let bound = bind(loopback, loopback).await.unwrap();
        let (health_addr, metrics_addr) = (bound.health_addr(), bound.metrics_addr());
        assert_ne!(health_addr.port(), 0);
        assert_ne!(metrics_addr.port(), 0);

        let health = Health::new(Duration::from_secs(60));
        let metrics = Metrics::new();
        metrics.set_programmed(3, 9);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(bound.serve(health.clone(), metrics.clone(), async move {
            let _ = stop_rx.await;
        }));

        // Not ready until the first sync is programmed (readiness must not lie), alive all along.
        let healthz = get(health_addr, "/healthz").await;
        assert_eq!(healthz.status, 503);
        let reason = json(&healthz)["reason"].as_str().unwrap().to_owned();
        assert!(reason.starts_with("no sync has been programmed yet (started "), "{reason}");
        assert_eq!(get(health_addr, "/livez").await.status, 200);
        health.updated(SystemTime::now());
        let healthz = get(health_addr, "/healthz").await;
        assert_eq!(healthz.status, 200);
        let body = json(&healthz);
        assert!(is_rfc3339(&body["lastUpdated"]), "{body}");
        assert!(is_rfc3339(&body["currentTime"]), "{body}");
        assert_eq!(body["nodeEligible"], serde_json::Value::Bool(true));

        let livez = get(health_addr, "/livez?verbose").await;
        assert_eq!(livez.status, 200);
        let body = json(&livez);
        assert!(is_rfc3339(&body["lastUpdated"]) && is_rfc3339(&body["currentTime"]));
        assert!(body.get("nodeEligible").is_none());

        // A change pending for an hour with a 60 s timeout: 503 on both.
        let queued = SystemTime::now() - Duration::from_secs(3600);
        let synced = queued - Duration::from_secs(10);
        health.updated(synced);
        health.queued(queued);
        for path in ["/healthz", "/livez"] {
            let response = get(health_addr, path).await;
            assert_eq!(response.status, 503, "{path}");
            let body = json(&response);
            assert_eq!(body["lastUpdated"], rfc3339(synced).as_str(), "{path}");
            assert!(is_rfc3339(&body["currentTime"]));
        }

        // Synced again: 200.
        health.updated(SystemTime::now());
        assert_eq!(get(health_addr, "/healthz").await.status, 200);
        assert_eq!(get(health_addr, "/livez").await.status, 200);

        // An ineligible node fails /healthz only.
        health.set_node_eligible(false);
        let response = get(health_addr, "/healthz").await;
        assert_eq!(response.status, 503);
        assert_eq!(json(&response)["nodeEligible"], serde_json::Value::Bool(false));
        assert_eq!(get(health_addr, "/livez").await.status, 200);
        health.set_node_eligible(true);

        // Metrics side.
        let response = get(metrics_addr, "/metrics").await;
        assert_eq!(response.status, 200);
        assert_eq!(response.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
        assert!(response.body.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n"));
        assert!(response.body.contains("\nkproxy_frontends 3\n"));
        assert!(response.body.contains("\nkproxy_backends 9\n"));

        let response = get(metrics_addr, "/proxyMode").await;
        assert_eq!(response.status, 200);
        assert_eq!(response.body, "ebpf");

        // Unknown paths, and each server's paths on the other one, are 404.
        for (addr, path) in [
            (health_addr, "/"),
            (health_addr, "/metrics"),
            (health_addr, "/healthz/extra"),
            (metrics_addr, "/healthz"),
            (metrics_addr, "/nope"),
        ] {
            let response = get(addr, path).await;
            assert_eq!(response.status, 404, "{addr}{path}");
            assert_eq!(response.body, "404 page not found\n");
        }

        // An idle keep-alive connection must not hold up shutdown.
        let idle = TcpStream::connect(health_addr).await.unwrap();
        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(3), server)
            .await
            .expect("server stops promptly")
            .unwrap()
            .unwrap();
        drop(idle);
        assert!(TcpStream::connect(health_addr).await.is_err());
        assert!(TcpStream::connect(metrics_addr).await.is_err());
    }

    #[tokio::test]
    async fn a_taken_port_is_retried_until_free_and_each_server_stands_alone() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = bind_server(Server::Metrics, addr).await.expect_err("the port is taken");
        assert!(err.to_string().starts_with(&format!("--metrics-bind-address {addr}: ")), "{err}");

        // Only the metrics server, started while the port is held: it answers once freed.
        let (stop_tx, stop_rx) = watch::channel(false);
        let server = tokio::spawn(serve_retrying(
            Server::Metrics,
            addr,
            None,
            Health::new(Duration::from_secs(60)),
            Metrics::new(),
            stop_rx,
        ));
        drop(taken);
        let deadline = tokio::time::Instant::now() + BIND_RETRY * 3;
        let response = loop {
            if TcpStream::connect(addr).await.is_ok() {
                break get(addr, "/proxyMode").await;
            }
            assert!(tokio::time::Instant::now() < deadline, "{addr} never bound");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(response.body, PROXY_MODE);
        assert_eq!(get(addr, "/healthz").await.status, 404, "the health server is not on the metrics port");
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(3), server).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bind_errors_name_the_flag_and_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let free: SocketAddr = "127.0.0.1:0".parse().unwrap();

        let err = bind(addr, free).await.err().expect("health port is taken");
        let message = err.to_string();
        assert!(message.starts_with(&format!("--healthz-bind-address {addr}: ")), "{message}");

        let err = serve(free, addr, Health::new(Duration::from_secs(1)), Metrics::new(), async {})
            .await
            .expect_err("metrics port is taken");
        let message = err.to_string();
        assert!(message.starts_with(&format!("--metrics-bind-address {addr}: ")), "{message}");
    }
}
