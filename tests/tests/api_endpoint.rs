//! A node where nothing translates ClusterIPs (no kube-proxy), with the API server reachable only at
//! a node address: the agent on its in-cluster defaults is blind, and given the API server's own
//! address (`--api-server-host/--api-server-port`, or the ConfigMap's `KPROXY_API_SERVER_HOST/PORT`)
//! it lists and programs every Service.
//!
//! The scenario is a pod's: the agent has the environment the kubelet gives a pod
//! (`KUBERNETES_SERVICE_HOST=10.96.0.1`, `KUBERNETES_SERVICE_PORT=443`) and a service-account
//! directory with a token, the cluster CA and the namespace (`KPROXY_SERVICE_ACCOUNT_DIR` points at
//! it: the test cannot write /var/run/secrets). The API server is the in-process one (plain HTTP on
//! the node's 127.0.0.1) behind a TLS front on port 6443 of the node address, with a certificate the
//! CA signed for 10.0.0.1, 10.96.0.1 and kubernetes.default.svc, as kubeadm's; the front records
//! each request's headers, so the test sees the token arrive. The cluster has the `kubernetes`
//! Service (10.96.0.1:443 → 10.0.0.1:6443), as every cluster does. Needs root and `openssl`.

mod common;

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use common::cluster::{Cluster, Mode, kproxy_bin};
use sandbox::{NODE_DEVICE, NODE_IP, Spawned, find_tool};
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::rustls;

const KUBERNETES_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
const API_PORT: u16 = 6443;
const TOKEN: &str = "kproxy-test-token";

const KUBERNETES_SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: kubernetes
  namespace: default
  labels: {component: apiserver, provider: kubernetes}
spec:
  clusterIP: 10.96.0.1
  ports:
  - {name: https, port: 443, protocol: TCP, targetPort: 6443}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes}
addressType: IPv4
ports:
- {name: https, port: 6443, protocol: TCP}
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
";

/// `openssl` with `args` in `dir`; panics with its stderr.
fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new(find_tool("openssl").unwrap())
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A cluster CA, a serving certificate it signed (as kubeadm's apiserver.crt: the node address, the
/// `kubernetes` ClusterIP, kubernetes.default.svc) and the service-account directory of a pod:
/// `serviceaccount/{token,ca.crt,namespace}`. Returns that directory.
fn pki(dir: &Path) -> PathBuf {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kubernetes"]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]);
    openssl(dir, &ca);
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend(["-keyout", "apiserver.key", "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver"]);
    openssl(dir, &csr);
    std::fs::write(
        dir.join("apiserver.ext"),
        format!(
            "subjectAltName=IP:{NODE_IP},IP:{KUBERNETES_VIP},DNS:kubernetes.default.svc\n\
             extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"
        ),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "apiserver.crt",
            "-days",
            "2",
            "-extfile",
            "apiserver.ext",
        ],
    );
    let service_account = dir.join("serviceaccount");
    std::fs::create_dir_all(&service_account).unwrap();
    std::fs::copy(dir.join("ca.crt"), service_account.join("ca.crt")).unwrap();
    std::fs::write(service_account.join("token"), TOKEN).unwrap();
    std::fs::write(service_account.join("namespace"), "kproxy-system").unwrap();
    service_account
}

/// The API server's TLS side: terminates TLS on `0.0.0.0:6443` in the node namespace (so at the
/// node address, and on its loopback) and forwards each connection to the plain in-process
/// server. Every request's head, as the client sent it, is kept. Stops on drop.
struct TlsFront {
    heads: Arc<Mutex<Vec<u8>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TlsFront {
    fn start(netns: &Path, dir: &Path, backend: SocketAddr) -> TlsFront {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(dir.join("apiserver.crt")).unwrap().map(Result::unwrap).collect();
        let key = PrivateKeyDer::from_pem_file(dir.join("apiserver.key")).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (netns, seen) = (netns.to_path_buf(), heads.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            // Every socket this thread (and its one-thread runtime) makes is in the node namespace.
            let ns = std::fs::File::open(&netns).unwrap();
            // SAFETY: plain syscall on a valid fd; it changes only this thread.
            assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind(("0.0.0.0", API_PORT)).await.unwrap();
                ready_tx.send(()).unwrap();
                tokio::pin!(stopped);
                loop {
                    let (tcp, _) = tokio::select! {
                        _ = &mut stopped => return,
                        accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                    };
                    let (acceptor, seen) = (acceptor.clone(), seen.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else { return };
                        let Ok(plain) = tokio::net::TcpStream::connect(backend).await else { return };
                        forward(tls, plain, seen).await;
                    });
                }
            });
        });
        ready_rx.recv_timeout(Duration::from_secs(10)).expect("the TLS front listens");
        TlsFront { heads, stop: Some(stop), thread: Some(thread) }
    }

    /// The request heads seen so far (GET requests: no bodies).
    fn requests(&self) -> Vec<String> {
        let bytes = self.heads.lock().unwrap().clone();
        String::from_utf8_lossy(&bytes)
            .split("\r\n\r\n")
            .filter(|head| head.starts_with("GET "))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Copies both ways; what the client sends is also appended to `seen`.
async fn forward(
    tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    plain: tokio::net::TcpStream,
    seen: Arc<Mutex<Vec<u8>>>,
) {
    let (mut tls_read, mut tls_write) = tokio::io::split(tls);
    let (mut plain_read, mut plain_write) = plain.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match tls_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            seen.lock().unwrap().extend_from_slice(&buf[..n]);
            if plain_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = plain_write.shutdown().await;
    };
    let downstream = async {
        let _ = tokio::io::copy(&mut plain_read, &mut tls_write).await;
        let _ = tls_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}

/// `kproxy agent` as the DaemonSet runs it in a pod (in-cluster environment, service account),
/// with `extra` arguments.
fn start_agent(cluster: &mut Cluster, service_account: &Path, extra: &[&str]) {
    let mut args: Vec<String> = vec![
        kproxy_bin().display().to_string(),
        "--pin-dir".into(),
        cluster.pin_dir.display().to_string(),
        "agent".into(),
        "--interfaces".into(),
        "veth*".into(),
        "--poll-ms".into(),
        "100".into(),
        "--hostname-override".into(),
        "node-1".into(),
        "--cgroup-root".into(),
        cluster.cgroup.path().display().to_string(),
        "--min-sync-period".into(),
        "50ms".into(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let mut command = cluster.sandbox.node_command(&args).unwrap();
    pod_environment(&mut command, service_account);
    cluster.agent = Some(cluster.sandbox.node_spawn_command(command).unwrap());
}

/// What the kubelet gives every pod, and where this one's service account is.
fn pod_environment(command: &mut std::process::Command, service_account: &Path) {
    command
        .env("KUBERNETES_SERVICE_HOST", KUBERNETES_VIP.to_string())
        .env("KUBERNETES_SERVICE_PORT", "443")
        .env("KPROXY_SERVICE_ACCOUNT_DIR", service_account)
        .env_remove("KPROXY_API_SERVER_HOST")
        .env_remove("KPROXY_API_SERVER_PORT")
        .env_remove("KUBECONFIG");
}

/// `kproxy doctor --json` in the node namespace, in the pod's environment: (exit status, report).
fn doctor(cluster: &Cluster, service_account: &Path, extra: &[&str], env: &[(&str, &str)]) -> (i32, Value) {
    let mut args = vec![
        kproxy_bin().display().to_string(),
        "--pin-dir".into(),
        cluster.pin_dir.display().to_string(),
        "doctor".into(),
        "--json".into(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let mut command = cluster.sandbox.node_command(&args).unwrap();
    pod_environment(&mut command, service_account);
    command.envs(env.iter().copied());
    let out = command.output().unwrap();
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), report)
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name}: {report:#}"))
}

fn text<'a>(check: &'a Value, field: &str) -> &'a str {
    check[field].as_str().unwrap_or_default()
}

/// Waits for `done(status, body of /healthz)`, with the agent still running.
fn wait_for_healthz(cluster: &Cluster, what: &str, secs: u64, done: impl Fn(u16, &Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        // Not listening yet is 000, not an answer.
        let out = cluster
            .sandbox
            .node_exec_output([
                "curl",
                "-s",
                "--max-time",
                "5",
                "-w",
                "\n%{http_code}",
                "http://127.0.0.1:10256/healthz",
            ])
            .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        let (code, body): (u16, Value) =
            (code.parse().unwrap_or(0), serde_json::from_str(body).unwrap_or(Value::Null));
        if code != 0 && done(code, &body) {
            return body;
        }
        let agent: &Spawned = cluster.agent.as_ref().unwrap();
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(Instant::now() < deadline, "{what}: last /healthz {code} {body}\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn with_the_api_servers_own_address_the_agent_programs_every_service_without_it_it_is_blind() {
    let mut cluster = Cluster::prepared("api-endpoint", Mode::Api);
    cluster.api().apply_yaml(KUBERNETES_SERVICE).unwrap();
    let pki_dir = cluster.sandbox.dir().join("pki");
    std::fs::create_dir_all(&pki_dir).unwrap();
    let service_account = pki(&pki_dir);
    let front = TlsFront::start(&cluster.sandbox.node_netns_path(), &pki_dir, cluster.api().addr());

    // (a) In-cluster defaults: https://10.96.0.1:443, which nothing on this node translates.
    start_agent(&mut cluster, &service_account, &[]);
    let blind = wait_for_healthz(&cluster, "/healthz names the failing lists", 60, |code, body| {
        assert_ne!(code, 200, "a node that programmed nothing is not ready: {body}");
        text(body, "reason").contains("Service watch: list failed")
    });
    let reason = text(&blind, "reason");
    eprintln!("(a) /healthz: {blind}");
    assert!(reason.contains("no sync has been programmed yet"), "{reason}");
    let log = cluster.agent_log();
    let endpoint_line = log
        .lines()
        .find(|l| l.contains("API server endpoint") && !l.contains("kproxy agent starting"))
        .unwrap_or_else(|| panic!("{log}"));
    eprintln!("(a) agent: {endpoint_line}");
    assert!(
        endpoint_line.contains("https://10.96.0.1:443") && endpoint_line.contains("in-cluster"),
        "{endpoint_line}"
    );
    assert!(endpoint_line.contains("--api-server-host"), "the log says what to set: {endpoint_line}");
    assert_eq!(cluster.dump_json("services"), serde_json::json!([]), "nothing programmed");
    assert!(cluster.client.curl("http://10.96.0.100/").is_err(), "no Service works on this node");
    assert!(front.requests().is_empty(), "nothing reached the API server: {:?}", front.requests());

    // Doctor says why, and what to set. The ClusterIP as a real node has it: a route, no answer.
    cluster.sandbox.node_exec(["ip", "route", "add", "10.96.0.0/12", "dev", NODE_DEVICE]).unwrap();
    let (code, report) = doctor(&cluster, &service_account, &[], &[]);
    assert_eq!(code, 1, "a FAIL: {report:#}");
    let api = check(&report, "api-server");
    eprintln!("(a) doctor: {api}\n(a) doctor: {}", check(&report, "agent"));
    assert_eq!(api["status"], "FAIL", "{api:#}");
    assert!(text(api, "finding").contains("https://10.96.0.1:443"), "{api:#}");
    assert!(text(api, "finding").contains("does not answer GET /version"), "{api:#}");
    assert!(
        text(api, "fix").contains("--api-server-host") && text(api, "fix").contains("kproxy-api-endpoint"),
        "{api:#}"
    );
    let agent = check(&report, "agent");
    assert_eq!(agent["status"], "FAIL", "{agent:#}");
    assert!(
        text(agent, "finding").contains("no sync has been programmed yet"),
        "the reason is quoted: {agent:#}"
    );
    assert!(text(agent, "fix").contains("api-server"), "{agent:#}");
    let _ = cluster.stop_agent();

    // (b) The API server's own address: the agent lists, programs and serves every Service.
    let host = NODE_IP.to_string();
    let port = API_PORT.to_string();
    start_agent(&mut cluster, &service_account, &["--api-server-host", &host, "--api-server-port", &port]);
    cluster.wait_for_frontends(&[
        ("10.96.0.100:80", "TCP", 3),
        ("10.96.0.10:53", "UDP", 2),
        ("10.96.0.10:53", "TCP", 2),
        ("10.96.0.1:443", "TCP", 1),
    ]);
    wait_for_healthz(&cluster, "/healthz 200 once synced", 20, |code, _| code == 200);
    let log = cluster.agent_log();
    let endpoint_line = log
        .lines()
        .rfind(|l| l.contains("API server endpoint") && !l.contains("kproxy agent starting"))
        .unwrap_or_else(|| panic!("{log}"));
    eprintln!("(b) agent: {endpoint_line}");
    assert!(
        endpoint_line.contains("https://10.0.0.1:6443") && endpoint_line.contains("--api-server-host"),
        "{endpoint_line}"
    );
    cluster.wait_for_attachment();
    let answer = cluster.client.curl("http://10.96.0.100/").unwrap();
    assert!(answer.starts_with("web-"), "a web pod answers: {answer:?}");
    // Every request carried the service account's token, over TLS the agent verified.
    let requests = front.requests();
    eprintln!("(b) {} requests through TLS, each with the token", requests.len());
    assert!(requests.iter().any(|r| r.starts_with("GET /api/v1/services?")), "{requests:#?}");
    let bearer = format!("authorization: bearer {TOKEN}");
    for request in &requests {
        assert!(request.to_lowercase().contains(&bearer), "a request without the token: {request}");
    }
    // And now the `kubernetes` ClusterIP works for pods: kproxy translates it.
    let ca = service_account.join("ca.crt").display().to_string();
    let version = cluster
        .client
        .exec(["curl", "-sS", "--max-time", "5", "--cacert", &ca, "https://10.96.0.1/version"])
        .unwrap();
    assert!(version.contains("v1.34.0-kproxy-fake"), "{version}");

    // Doctor with the ConfigMap's variables: the API server answers at the node address.
    let env = [("KPROXY_API_SERVER_HOST", host.as_str()), ("KPROXY_API_SERVER_PORT", port.as_str())];
    let (_, report) = doctor(&cluster, &service_account, &[], &env);
    let api = check(&report, "api-server");
    eprintln!("(b) doctor: {api}");
    assert_eq!(api["status"], "OK", "{api:#}");
    let finding = text(api, "finding");
    assert!(
        finding.contains("https://10.0.0.1:6443") && finding.contains("kproxy-api-endpoint"),
        "{finding}"
    );
    assert!(finding.contains("v1.34.0-kproxy-fake"), "{finding}");
    assert_eq!(check(&report, "agent")["status"], "OK", "{report:#}");
    // The certificate is checked against the host given: one it does not name is refused.
    let (_, report) = doctor(
        &cluster,
        &service_account,
        &["--api-server-host", "127.0.0.1", "--api-server-port", &port],
        &[],
    );
    let api = check(&report, "api-server");
    eprintln!("(b) doctor, a host the certificate does not name: {api}");
    assert_eq!(api["status"], "FAIL", "{api:#}");
    assert!(text(api, "finding").contains("certificate"), "{api:#}");
    drop(front);
}
