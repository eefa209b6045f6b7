//! kube-proxy's per-Service health check node ports (`healthCheckNodePort`).
//!
//! A LoadBalancer Service with `externalTrafficPolicy: Local` gets a health
//! check node port. The cloud load balancer probes it on every node and sends
//! the Service's traffic only to nodes answering 200, i.e. nodes with a ready
//! endpoint of the Service; a node whose local endpoints are all terminating
//! answers 503 so that it is drained. As in kube-proxy, the path and method of
//! the probe do not matter (load balancers differ in what they send).
//!
//! The body has kube-proxy's JSON fields in kube-proxy's order, written
//! compactly (kube-proxy indents it; probes read the status, and JSON readers
//! do not care). `X-Load-Balancing-Endpoint-Weight` carries the local endpoint
//! count for load balancers that weight nodes by it. `serviceProxyHealthy` is
//! always true here and the status depends on the local endpoints only, whereas
//! recent kube-proxy also answers 503 while its own `/healthz` is failing.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use hyper::header::{HeaderName, HeaderValue};
use hyper::{Response, StatusCode};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::http::health::{self, Body, Respond};
use crate::agent::http::listen::bind_like_kube_proxy;
use crate::model::{HealthCheck, ServiceName};

/// The listeners for every wanted health check node port, one per port.
///
/// [`ServiceHealthServers::update`] is async because it waits until removed
/// listeners are closed, so that their ports are free when it returns. It must
/// run on a tokio runtime (listeners are spawned on the current one).
/// Dropping the value stops every listener gracefully.
pub struct ServiceHealthServers {
    bind_address: IpAddr,
    served: BTreeMap<u16, Server>,
    /// Ports that could not be bound at the last update, with the Service that
    /// wanted them: warned about once, not on every sync while the port stays
    /// taken.
    failing: BTreeMap<u16, ServiceName>,
    /// Never sent on: dropping it (with `self`) is what stops the listeners
    /// still running.
    _stop: watch::Sender<bool>,
    stop_rx: watch::Receiver<bool>,
}

struct Server {
    /// Read by each request, so count changes need no restart.
    answer: watch::Sender<Answer>,
    task: JoinHandle<()>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Answer {
    service: ServiceName,
    local_ready: usize,
}

impl ServiceHealthServers {
    /// Listen on `bind_address`. kube-proxy listens on `0.0.0.0`, which its Go listener turns
    /// into every address of both families; an unspecified address of either family does so here
    /// too, so a dual-stack node answers probes on its IPv6 addresses as well.
    pub fn new(bind_address: impl Into<IpAddr>) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        ServiceHealthServers {
            bind_address: bind_address.into(),
            served: BTreeMap::new(),
            failing: BTreeMap::new(),
            _stop: stop,
            stop_rx,
        }
    }

    /// The ports being served, in ascending order.
    pub fn ports(&self) -> Vec<u16> {
        self.served.keys().copied().collect()
    }

    /// Serve exactly `checks`: stop the listeners of ports no longer wanted
    /// (closing their connections, as kube-proxy does), start listeners for new
    /// ports, and change the answers of the others in place. A port that cannot
    /// be bound is logged and tried again on the next update; the other ports
    /// are unaffected.
    pub async fn update(&mut self, checks: &[HealthCheck]) {
        let wanted = by_port(checks);

        let gone: Vec<u16> = self.served.keys().filter(|port| !wanted.contains_key(port)).copied().collect();
        for port in gone {
            if let Some(server) = self.served.remove(&port) {
                server.task.abort();
                // The listener closes when the aborted task is dropped, which
                // the runtime does later; waiting for it frees the port now.
                let _ = server.task.await;
                tracing::info!(
                    service = %server.answer.borrow().service,
                    port,
                    "stopped serving the health check node port"
                );
            }
        }
        self.failing.retain(|port, _| wanted.contains_key(port));

        for (port, check) in wanted {
            if let Some(server) = self.served.get(&port) {
                server.answer.send_if_modified(|answer| {
                    let changed = answer.service != check.service || answer.local_ready != check.local_ready;
                    if changed {
                        *answer = Answer { service: check.service.clone(), local_ready: check.local_ready };
                    }
                    changed
                });
                continue;
            }
            self.start(port, check).await;
        }
    }

    async fn start(&mut self, port: u16, check: &HealthCheck) {
        let address = SocketAddr::from((self.bind_address, port));
        let listener = match bind_like_kube_proxy(address).await {
            Ok(listener) => listener,
            Err(e) => {
                if self.failing.get(&port) == Some(&check.service) {
                    tracing::debug!(service = %check.service, port, error = %e, "health check node port still unavailable");
                } else {
                    tracing::warn!(
                        service = %check.service,
                        port,
                        %address,
                        error = %e,
                        "cannot serve the Service's health check node port; retrying on the next sync"
                    );
                    self.failing.insert(port, check.service.clone());
                }
                return;
            }
        };
        // `[::]:port` when the unspecified IPv4 address was asked for: what the node answers on.
        let address = listener.local_addr().unwrap_or(address);
        let (answer, answers) =
            watch::channel(Answer { service: check.service.clone(), local_ready: check.local_ready });
        let task = tokio::spawn(health::accept_loop(listener, Responder(answers), self.stop_rx.clone()));
        self.served.insert(port, Server { answer, task });
        if self.failing.remove(&port).is_some() {
            tracing::info!(service = %check.service, %address, "serving the health check node port after all");
        } else {
            tracing::info!(service = %check.service, %address, "serving the health check node port");
        }
    }
}

/// The check to serve on each port. Port 0 is skipped: binding it would pick
/// an arbitrary port. The API server gives each Service its own port, but
/// manifests (or a snapshot taken while a port changes hands) may not; the
/// smallest Service name wins so the answer does not depend on input order.
fn by_port(checks: &[HealthCheck]) -> BTreeMap<u16, &HealthCheck> {
    let mut wanted: BTreeMap<u16, &HealthCheck> = BTreeMap::new();
    for check in checks.iter().filter(|check| check.port != 0) {
        let kept = wanted.entry(check.port).or_insert(check);
        if kept.service != check.service {
            tracing::warn!(
                port = check.port,
                services = %format!("{}, {}", kept.service, check.service),
                "Services share a health check node port; serving the first by name"
            );
            if check.service < kept.service {
                *kept = check;
            }
        }
    }
    wanted
}

#[derive(Clone)]
struct Responder(watch::Receiver<Answer>);

/// kube-proxy's body, fields in its order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Json<'a> {
    service: JsonService<'a>,
    local_endpoints: usize,
    service_proxy_healthy: bool,
}

#[derive(Serialize)]
struct JsonService<'a> {
    namespace: &'a str,
    name: &'a str,
}

impl Respond for Responder {
    fn respond(&self, _path: &str) -> Response<Body> {
        let (body, local_ready) = {
            let answer = self.0.borrow();
            let json = Json {
                service: JsonService { namespace: &answer.service.namespace, name: &answer.service.name },
                local_endpoints: answer.local_ready,
                service_proxy_healthy: true,
            };
            (serde_json::to_string(&json).expect("strings and integers serialize"), answer.local_ready)
        };
        let status = if local_ready > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let mut response = health::text(status, "application/json", body);
        response.headers_mut().insert(
            HeaderName::from_static("x-load-balancing-endpoint-weight"),
            HeaderValue::from(local_ready),
        );
        response
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::testutil::http::{Connection, HttpResponse, get};

    const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

    fn check(name: &str, port: u16, local_ready: usize, local_terminating: usize) -> HealthCheck {
        HealthCheck {
            service: ServiceName { namespace: "ns".to_owned(), name: name.to_owned() },
            port,
            local_ready,
            local_terminating,
        }
    }

    /// Distinct ports that were free a moment ago: the kernel picks them, so
    /// tests running in parallel do not collide.
    fn free_ports<const N: usize>() -> [u16; N] {
        let listeners: Vec<_> = (0..N).map(|_| std::net::TcpListener::bind((LOOPBACK, 0)).unwrap()).collect();
        std::array::from_fn(|i| listeners[i].local_addr().unwrap().port())
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from((LOOPBACK, port))
    }

    fn body(name: &str, count: usize) -> String {
        format!(
            r#"{{"service":{{"namespace":"ns","name":"{name}"}},"localEndpoints":{count},"serviceProxyHealthy":true}}"#
        )
    }

    fn assert_answer(response: &HttpResponse, status: u16, name: &str, count: usize) {
        assert_eq!(response.status, status);
        assert_eq!(response.body, body(name, count));
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_eq!(response.header("x-content-type-options"), Some("nosniff"));
        let weight = count.to_string();
        assert_eq!(response.header("x-load-balancing-endpoint-weight"), Some(weight.as_str()));
    }

    async fn refused(port: u16) -> bool {
        matches!(
            tokio::net::TcpStream::connect(addr(port)).await,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }

    #[tokio::test]
    async fn ready_local_endpoints_answer_200_with_the_count_on_any_path() {
        let [port] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers.update(&[check("web", port, 2, 1)]).await;
        assert_eq!(servers.ports(), vec![port]);

        for path in ["/", "/healthz", "/anything/else?x=1"] {
            let response = get(addr(port), path).await;
            assert_answer(&response, 200, "web", 2);
        }
    }

    #[tokio::test]
    async fn an_ipv6_address_gets_the_same_answers() {
        let [ready, none] = free_ports();
        let mut servers = ServiceHealthServers::new(Ipv6Addr::LOCALHOST);
        servers.update(&[check("web", ready, 2, 0), check("elsewhere", none, 0, 0)]).await;
        let v6 = |port| SocketAddr::from((Ipv6Addr::LOCALHOST, port));
        assert_answer(&get(v6(ready), "/").await, 200, "web", 2);
        assert_answer(&get(v6(none), "/").await, 503, "elsewhere", 0);
    }

    #[tokio::test]
    async fn only_terminating_or_no_local_endpoints_answer_503() {
        let [terminating, none] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers.update(&[check("draining", terminating, 0, 3), check("elsewhere", none, 0, 0)]).await;

        assert_answer(&get(addr(terminating), "/").await, 503, "draining", 0);
        assert_answer(&get(addr(none), "/").await, 503, "elsewhere", 0);
    }

    #[tokio::test]
    async fn counts_change_without_restarting_the_listener() {
        let [port] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers.update(&[check("web", port, 1, 0)]).await;
        // A restarted listener would close this connection.
        let mut connection = Connection::open(addr(port)).await;
        assert_answer(&connection.get("/").await.unwrap(), 200, "web", 1);

        servers.update(&[check("web", port, 0, 1)]).await;
        assert_answer(&connection.get("/").await.expect("same connection"), 503, "web", 0);

        servers.update(&[check("web", port, 5, 0)]).await;
        assert_answer(&connection.get("/").await.expect("same connection"), 200, "web", 5);

        // The port passing to another Service is an update as well.
        servers.update(&[check("api", port, 3, 0)]).await;
        assert_answer(&connection.get("/").await.expect("same connection"), 200, "api", 3);
        assert_eq!(servers.ports(), vec![port]);
        assert_answer(&get(addr(port), "/").await, 200, "api", 3);
    }

    #[tokio::test]
    async fn a_removed_service_frees_its_port() {
        let [removed, kept] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers.update(&[check("old", removed, 1, 0), check("web", kept, 1, 0)]).await;
        let mut open = Connection::open(addr(removed)).await;
        assert_answer(&open.get("/").await.unwrap(), 200, "old", 1);

        servers.update(&[check("web", kept, 1, 0)]).await;
        assert_eq!(servers.ports(), vec![kept]);
        assert!(refused(removed).await, "nothing listens on {removed} any more");
        assert!(open.get("/").await.is_none(), "open connections are closed too");
        drop(std::net::TcpListener::bind(addr(removed)).expect("the port is free again"));
        assert_answer(&get(addr(kept), "/").await, 200, "web", 1);

        // Coming back binds the port again.
        servers.update(&[check("old", removed, 2, 0), check("web", kept, 1, 0)]).await;
        assert_answer(&get(addr(removed), "/").await, 200, "old", 2);

        servers.update(&[]).await;
        assert!(servers.ports().is_empty());
        assert!(refused(removed).await && refused(kept).await);
    }

    #[tokio::test]
    async fn dropping_the_servers_stops_them() {
        let [port] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers.update(&[check("web", port, 1, 0)]).await;
        drop(servers);
        tokio::time::timeout(Duration::from_secs(5), async {
            while !refused(port).await {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the listener closes after the servers are dropped");
    }

    /// Log lines, for asserting what an operator would read.
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl Logs {
        fn lines(&self) -> Vec<String> {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap().lines().map(str::to_owned).collect()
        }
    }

    impl Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
        type Writer = Logs;
        fn make_writer(&'a self) -> Logs {
            self.clone()
        }
    }

    #[tokio::test]
    async fn a_port_in_use_is_reported_and_retried_while_the_others_serve() {
        let logs = Logs::default();
        // The test runtime is single-threaded, so the scoped subscriber sees
        // the spawned listeners' logs too.
        let _logging = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(logs.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish(),
        );
        let [taken, free] = free_ports();
        let squatter = std::net::TcpListener::bind(addr(taken)).unwrap();
        let checks = [check("blocked", taken, 1, 0), check("web", free, 1, 0)];
        let mut servers = ServiceHealthServers::new(LOOPBACK);

        servers.update(&checks).await;
        assert_eq!(servers.ports(), vec![free]);
        assert_answer(&get(addr(free), "/").await, 200, "web", 1);
        let warnings = |logs: &Logs| -> Vec<String> {
            logs.lines().into_iter().filter(|line| line.contains("WARN")).collect()
        };
        let warned = warnings(&logs);
        assert_eq!(warned.len(), 1, "{warned:#?}");
        assert!(
            warned[0].contains("service=ns/blocked") && warned[0].contains(&format!("port={taken}")),
            "{}",
            warned[0]
        );

        // Still taken: tried again, without repeating the warning.
        servers.update(&checks).await;
        assert_eq!(servers.ports(), vec![free]);
        assert_eq!(warnings(&logs).len(), 1, "{:#?}", logs.lines());

        drop(squatter);
        servers.update(&checks).await;
        let mut both = vec![taken, free];
        both.sort_unstable();
        assert_eq!(servers.ports(), both);
        assert_answer(&get(addr(taken), "/").await, 200, "blocked", 1);
        assert_answer(&get(addr(free), "/").await, 200, "web", 1);
        assert_eq!(warnings(&logs).len(), 1, "{:#?}", logs.lines());
    }

    #[tokio::test]
    async fn a_shared_port_is_served_for_the_first_service_by_name() {
        let [port] = free_ports();
        let mut servers = ServiceHealthServers::new(LOOPBACK);
        servers
            .update(&[check("zeta", port, 0, 0), check("alpha", port, 4, 0), check("unset", 0, 1, 0)])
            .await;
        assert_eq!(servers.ports(), vec![port]);
        assert_answer(&get(addr(port), "/").await, 200, "alpha", 4);
    }
}
