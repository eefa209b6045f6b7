//! Established connections outlive changes to their Service, as through kube-proxy: a TCP
//! stream through a ClusterIP keeps going to its pod when the pod turns unready and ready
//! again, when it leaves the EndpointSlice while still serving (a relabelled pod), and when the
//! Service itself is deleted. kube-proxy never touches a TCP flow's conntrack entry (it clears
//! stale UDP entries only), so its clients see every line. With socket-level load balancing the
//! same holds for a TCP socket, while a connected UDP socket to the removed backend is still
//! destroyed (its owner reconnects through the Service).
//!
//! The stream: a Python server in each web pod writes a numbered line every 100 ms — at least
//! 80 lines (8 s), and on until the test lets it finish — then `end <count>`. A Python client in
//! the client pod prints what it reads. The test changes the Service after the first lines and
//! waits for more lines after each change, so every change lands mid-stream.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    time::{Duration, Instant},
};

mod common;
use common::cluster::{Cluster, WEB_PODS};
use sandbox::Spawned;

const STREAM_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 160);
const STREAM_PORT: u16 = 9000;
const STREAM_FRONTEND: &str = "10.96.0.160:9000";

/// Each pod's server: TCP streams on STREAM_PORT, and a UDP echo of the pod's name on the same
/// port (for the socket LB test). argv: pod name, the file whose existence lets streams end.
const SERVER: &str = r#"
import os, socket, sys, threading, time
name, finish, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def stream(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 0
    try:
        while n < 80 or not os.path.exists(finish):
            conn.sendall(f'{name} {n}\n'.encode())
            n += 1
            time.sleep(0.1)
        conn.sendall(f'end {n}\n'.encode())
    finally:
        conn.close()
def echo():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(('0.0.0.0', port))
    while True:
        _, peer = u.recvfrom(64)
        u.sendto(name.encode(), peer)
threading.Thread(target=echo, daemon=True).start()
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(('0.0.0.0', port))
l.listen(16)
while True:
    conn, _ = l.accept()
    threading.Thread(target=stream, args=(conn,), daemon=True).start()
"#;

/// The client: prints every line of one stream through the Service, then `eof`; a read that
/// waits 5 s (50 lines' worth) or fails prints `error ...` instead.
const CLIENT: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
try:
    for line in s.makefile('r'):
        print(line.strip(), flush=True)
    print('eof', flush=True)
except OSError as e:
    print('error', type(e).__name__, e, flush=True)
"#;

/// The client for the socket LB test: the TCP stream as [`CLIENT`], plus a connected UDP socket
/// on the stream's backend (new sockets until one lands there), queried every 100 ms until it
/// fails: `udp <pod>` once connected, `udp error <errno>` when destroyed.
const SOCKET_LB_CLIENT: &str = r#"
import errno, socket, sys, threading, time
vip, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((vip, port), timeout=5)
lines = s.makefile('r')
first = lines.readline().strip()
print(first, flush=True)
backend = first.split()[0]
for _ in range(100):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(2)
    u.connect((vip, port))
    u.send(b'who')
    if u.recv(64).decode() == backend:
        break
    u.close()
else:
    print('udp never reached', backend, flush=True)
    sys.exit(1)
print('udp', backend, flush=True)
def query():
    while True:
        try:
            u.send(b'who')
            u.recv(64)
        except socket.timeout:
            pass
        except OSError as e:
            print('udp error', errno.errorcode.get(e.errno, e), flush=True)
            return
        time.sleep(0.1)
threading.Thread(target=query, daemon=True).start()
try:
    for line in lines:
        print(line.strip(), flush=True)
    print('eof', flush=True)
except OSError as e:
    print('error', type(e).__name__, e, flush=True)
time.sleep(1)
"#;

/// How an endpoint appears in the stream Service's EndpointSlice.
#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Ready,
    /// `ready: false`: a failing readiness probe, the pod still runs and serves its connections.
    NotReady,
    /// Not in the slice: a relabelled pod, still running.
    Absent,
}

/// The stream Service (TCP and UDP on STREAM_PORT) and its EndpointSlice over the web pods.
fn manifest(endpoints: &[Endpoint; 3]) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: stream\n  namespace: default\nspec:\n  \
         clusterIP: {STREAM_VIP}\n  ports:\n  - name: tcp\n    port: {STREAM_PORT}\n    protocol: TCP\n  \
         - name: udp\n    port: {STREAM_PORT}\n    protocol: UDP\n---\napiVersion: discovery.k8s.io/v1\n\
         kind: EndpointSlice\nmetadata:\n  name: stream-abc12\n  namespace: default\n  labels:\n    \
         kubernetes.io/service-name: stream\naddressType: IPv4\nports:\n- name: tcp\n  port: {STREAM_PORT}\n  \
         protocol: TCP\n- name: udp\n  port: {STREAM_PORT}\n  protocol: UDP\nendpoints:\n"
    );
    for ((name, ip), endpoint) in WEB_PODS.iter().zip(endpoints) {
        let ready = match endpoint {
            Endpoint::Ready => true,
            Endpoint::NotReady => false,
            Endpoint::Absent => continue,
        };
        yaml += &format!(
            "- addresses:\n  - {ip}\n  conditions:\n    ready: {ready}\n    serving: {ready}\n    \
             terminating: false\n  nodeName: node-1\n  targetRef:\n    kind: Pod\n    name: {name}\n    \
             namespace: default\n"
        );
    }
    yaml
}

struct Stream {
    cluster: Cluster,
    /// Created to let the servers end their streams (in the sandbox's directory, removed with it).
    finish: PathBuf,
}

impl Stream {
    /// The cluster with the stream servers in the web pods and the stream Service programmed.
    fn start(tag: &str, agent_args: &[&str]) -> Self {
        let mut cluster = Cluster::start(tag);
        if !agent_args.is_empty() {
            cluster.stop_agent();
            cluster.extra_agent_args = agent_args.iter().map(|a| (*a).to_owned()).collect();
            cluster.start_agent();
        }
        let finish = cluster.sandbox.dir().join("stream-finish");
        for pod in &cluster.web {
            let server = pod
                .spawn([
                    "python3",
                    "-c",
                    SERVER,
                    pod.name(),
                    &finish.display().to_string(),
                    &STREAM_PORT.to_string(),
                ])
                .unwrap();
            pod.wait_listening("tcp", STREAM_PORT, Some(&server), Duration::from_secs(10)).unwrap();
            pod.wait_listening("udp", STREAM_PORT, Some(&server), Duration::from_secs(10)).unwrap();
        }
        let stream = Self { cluster, finish };
        stream.write_manifest(&[Endpoint::Ready; 3]);
        stream.wait_for_stream_frontends(3);
        stream
    }

    fn write_manifest(&self, endpoints: &[Endpoint; 3]) {
        std::fs::write(self.cluster.manifest("stream.yaml"), manifest(endpoints)).unwrap();
    }

    fn wait_for_stream_frontends(&self, backends: u64) {
        self.cluster
            .wait_for_frontends(&[(STREAM_FRONTEND, "TCP", backends), (STREAM_FRONTEND, "UDP", backends)]);
    }

    /// Waits until the Service has no frontend left in the maps.
    fn wait_for_service_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.cluster.backend_count(STREAM_FRONTEND, "TCP").is_some() {
            assert!(Instant::now() < deadline, "the Service was not removed:\n{}", self.cluster.agent_log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The client through the tc path (a process of the client pod, outside the test cgroup).
    fn client(&self) -> Spawned {
        let port = STREAM_PORT.to_string();
        self.cluster.client.spawn(["python3", "-c", CLIENT, &STREAM_VIP.to_string(), &port]).unwrap()
    }

    /// Waits until the client has printed `more` stream lines beyond those it had; returns the
    /// count then. Fails with the client's output if the stream ends or stalls first.
    fn wait_for_lines(&self, client: &Spawned, more: usize) -> usize {
        let had = stream_lines(&client.log()).len();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let log = client.log();
            let got = stream_lines(&log).len();
            if got >= had + more {
                return got;
            }
            assert!(
                !stream_ended(&log),
                "the stream ended after {got} lines, {more} more than {had} were wanted:\n{log}\nagent:\n{}",
                self.cluster.agent_log()
            );
            assert!(
                Instant::now() < deadline,
                "the stream stalled at {got} lines (wanted {}):\n{log}\nagent:\n{}",
                had + more,
                self.cluster.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Lets the servers end their streams and checks the client saw every line of one backend,
    /// in order, then `end <count>` and a clean end of stream. Returns the backend's name.
    fn finish_and_check(&self, client: &Spawned) -> String {
        std::fs::write(&self.finish, b"").unwrap();
        let status = client.wait_timeout(Duration::from_secs(30)).unwrap();
        let log = client.log();
        assert!(status.is_some(), "the client did not finish:\n{log}");
        let lines = stream_lines(&log);
        let backend = lines.first().map(|l| l.0.clone()).unwrap_or_else(|| panic!("no line:\n{log}"));
        for (n, (from, number)) in lines.iter().enumerate() {
            assert_eq!((from.as_str(), *number), (backend.as_str(), n), "line {n} out of place:\n{log}");
        }
        assert!(lines.len() >= 80, "{} lines:\n{log}", lines.len());
        let tail: Vec<&str> = log.lines().filter(|l| !l.is_empty() && !l.starts_with("udp")).collect();
        let end = format!("end {}", lines.len());
        assert_eq!(
            tail[tail.len().saturating_sub(2)..],
            [end.as_str(), "eof"],
            "every line arrived and the stream closed cleanly:\n{log}\nagent:\n{}",
            self.cluster.agent_log()
        );
        backend
    }
}

/// Whether the client's stream is over: its `end`, `eof` or `error` line (not the UDP socket's).
fn stream_ended(log: &str) -> bool {
    log.lines().any(|l| l == "eof" || l.starts_with("end ") || l.starts_with("error "))
}

/// The stream lines of a client's output: `(pod, number)`.
fn stream_lines(log: &str) -> Vec<(String, usize)> {
    log.lines()
        .filter_map(|line| {
            let (pod, n) = line.split_once(' ')?;
            WEB_PODS.iter().any(|(name, _)| *name == pod).then_some(())?;
            Some((pod.to_owned(), n.parse().ok()?))
        })
        .collect()
}

/// The slot of `pod` in [`WEB_PODS`] (and in the manifest's endpoints).
fn pod_index(pod: &str) -> usize {
    WEB_PODS.iter().position(|(name, _)| *name == pod).unwrap_or_else(|| panic!("unknown pod {pod}"))
}

fn backend_of(client: &Spawned) -> String {
    stream_lines(&client.log()).first().expect("a first line").0.clone()
}

#[test]
fn a_stream_survives_its_endpoint_turning_unready_and_ready_again() {
    let stream = Stream::start("flow-unready", &[]);
    let client = stream.client();
    stream.wait_for_lines(&client, 10);
    let mut endpoints = [Endpoint::Ready; 3];
    endpoints[pod_index(&backend_of(&client))] = Endpoint::NotReady;
    stream.write_manifest(&endpoints);
    stream.wait_for_stream_frontends(2);
    stream.wait_for_lines(&client, 10);
    stream.write_manifest(&[Endpoint::Ready; 3]);
    stream.wait_for_stream_frontends(3);
    stream.wait_for_lines(&client, 10);
    stream.finish_and_check(&client);
}

#[test]
fn a_stream_survives_its_pod_leaving_the_endpoint_slice_while_it_serves() {
    let stream = Stream::start("flow-relabel", &[]);
    let client = stream.client();
    stream.wait_for_lines(&client, 10);
    let backend = backend_of(&client);
    let mut endpoints = [Endpoint::Ready; 3];
    endpoints[pod_index(&backend)] = Endpoint::Absent;
    stream.write_manifest(&endpoints);
    stream.wait_for_stream_frontends(2);
    stream.wait_for_lines(&client, 10);
    // New connections go to the pods still in the slice.
    for _ in 0..6 {
        let other = stream.client();
        let first = stream.wait_for_lines(&other, 1);
        assert!(first >= 1);
        assert_ne!(backend_of(&other), backend, "a new connection reached the pod that left");
        other.kill().unwrap();
    }
    stream.wait_for_lines(&client, 5);
    stream.finish_and_check(&client);
}

#[test]
fn a_stream_survives_its_service_being_deleted() {
    let stream = Stream::start("flow-svc-gone", &[]);
    let client = stream.client();
    stream.wait_for_lines(&client, 10);
    std::fs::remove_file(stream.cluster.manifest("stream.yaml")).unwrap();
    stream.wait_for_service_gone();
    stream.wait_for_lines(&client, 10);
    stream.finish_and_check(&client);
}

/// `--socket-lb on`: the client's TCP socket is connected to its pod's own address by the
/// hooks; when the pod leaves the slice the agent destroys the connected UDP socket on that pod
/// (it would send into the void if the pod were gone) but never the TCP one.
#[test]
fn with_socket_lb_a_tcp_stream_survives_its_backend_leaving_while_a_udp_socket_is_destroyed() {
    let stream = Stream::start("flow-socklb", &["--socket-lb", "on"]);
    let cluster = &stream.cluster;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.agent_log().contains("socket-level load balancing on") {
        assert!(Instant::now() < deadline, "socket LB not attached:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let translated_before = cluster.stat("socket_lb_translated");
    let command = cluster.cgroup.command(
        cluster.client.netns(),
        &["python3", "-c", SOCKET_LB_CLIENT, &STREAM_VIP.to_string(), &STREAM_PORT.to_string()],
    );
    let client = cluster.client.spawn_command(command).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let backend = loop {
        let log = client.log();
        if let Some(line) = log.lines().find(|l| l.starts_with("udp ")) {
            break line.strip_prefix("udp ").unwrap().to_owned();
        }
        assert!(client.is_running() && Instant::now() < deadline, "no UDP socket on the backend:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        cluster.stat("socket_lb_translated") > translated_before,
        "the connections were translated by the socket hooks"
    );
    stream.wait_for_lines(&client, 5);

    let mut endpoints = [Endpoint::Ready; 3];
    endpoints[pod_index(&backend)] = Endpoint::Absent;
    stream.write_manifest(&endpoints);
    stream.wait_for_stream_frontends(2);
    let deadline = Instant::now() + Duration::from_secs(15);
    let verdict = loop {
        let log = client.log();
        if let Some(line) = log.lines().find(|l| l.starts_with("udp error")) {
            break line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "the UDP socket on {backend} was not destroyed:\n{log}\nagent:\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(verdict == "udp error ECONNABORTED" || verdict == "udp error EDESTADDRREQ", "{verdict}");
    stream.wait_for_lines(&client, 10);
    assert_eq!(stream.finish_and_check(&client), backend);
    assert!(
        cluster.agent_log().contains("destroyed the UDP sockets connected to removed backends"),
        "{}",
        cluster.agent_log()
    );
}
