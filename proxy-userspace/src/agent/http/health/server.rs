//! The two HTTP servers: binding (or retrying while another process holds the port), accepting, each
//! connection with its timeouts and graceful stop, and what each path answers.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
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

use super::Health;
use crate::agent::http::metrics::{self, Metrics};
use crate::k8s::time::rfc3339;

/// Body of `/proxyMode`.
pub const PROXY_MODE: &str = "ebpf";

/// How long in-flight requests may take to finish after shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Slow or idle clients are dropped if they do not send headers in time.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

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
    let (health, health_addr) = listen(Server::Health.flag(), health_addr).await?;
    let (metrics, metrics_addr) = listen(Server::Metrics.flag(), metrics_addr).await?;
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
        Server::Health.announce(self.health_addr);
        Server::Metrics.announce(self.metrics_addr);
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

    /// The log line of a server that starts answering on `address`.
    fn announce(self, address: SocketAddr) {
        match self {
            Server::Health => tracing::info!(%address, "serving /healthz and /livez"),
            Server::Metrics => tracing::info!(%address, "serving /metrics and /proxyMode"),
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
    server.announce(listener.local_addr().unwrap_or(addr));
    let router = match server {
        Server::Health => Router::Health(health),
        Server::Metrics => Router::Metrics(metrics),
    };
    accept_loop(listener, router, stop).await;
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
    use super::super::LIST_FAILURES_BLIND;
    use super::*;
    use crate::testutil::http::{HttpResponse, get};

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
