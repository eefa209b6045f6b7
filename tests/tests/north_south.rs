//! North–south traffic through real nodes: a two-node sandbox (`sandbox::multinode`: node
//! namespaces on an underlay bridge, pod CIDR routes between them, an external client at
//! 192.168.100.200), one real `kproxy agent` per node programmed from `examples/north-south`,
//! nginx and dnsmasq pods, and curl / dig run in the external client. What is asserted is what
//! the client and the backends observe: who answered, and which source address the backend saw.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use sandbox::{Pod, Spawned, multinode::MultiNode};

mod common;
use common::cluster::{TempDir, Trace, kproxy_bin, unique_pin_dir};

const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 200);
/// A second address of the external client, outside web-ranges' loadBalancerSourceRanges.
const OTHER_CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 201);
const WEB_A: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const WEB_B: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const DNS_B: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
/// Where the DNS pod of node 1 moves when it is replaced.
const DNS_B2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 22);
const LB_LOCAL: Ipv4Addr = Ipv4Addr::new(192, 168, 200, 10);
const LB_RANGES: Ipv4Addr = Ipv4Addr::new(192, 168, 200, 11);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 200, 20);

struct NorthSouth {
    agents: Vec<Spawned>,
    pins: Vec<PathBuf>,
    _pods: Vec<Pod>,
    multi: MultiNode,
    /// A copy of `examples/north-south` the agents read and a test may change.
    manifests: PathBuf,
    _manifest_dir: TempDir,
    /// Each agent's `--cgroup-root` (its socket hooks, host-only by default), removed after it.
    _cgroups: Vec<sandbox::cgroup::ChildCgroup>,
}

impl Drop for NorthSouth {
    fn drop(&mut self) {
        for agent in &self.agents {
            let _ = agent.terminate(Duration::from_secs(5));
        }
        for (i, pins) in self.pins.iter().enumerate() {
            let bin = kproxy_bin();
            let _ = self.multi.node(i).node_exec([
                bin.to_str().unwrap(),
                "--pin-dir",
                pins.to_str().unwrap(),
                "unload",
            ]);
        }
    }
}

impl NorthSouth {
    fn start(tag: &str) -> Self {
        Self::start_with(tag, &[])
    }

    fn start_with(tag: &str, extra_args: &[&str]) -> Self {
        let multi = MultiNode::new(tag, 2).expect("building the two-node sandbox (needs root)");
        let mut pods = Vec::new();
        for (node, name, ip) in [(0, "web-a", WEB_A), (1, "web-b", WEB_B)] {
            let pod = multi.add_pod(node, name, ip).unwrap();
            pod.start_nginx(&format!("{name}\n")).unwrap();
            pods.push(pod);
        }
        let dns = multi.add_pod(1, "dns-b", DNS_B).unwrap();
        dns.start_dnsmasq(WEB_B).unwrap();
        pods.push(dns);

        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/north-south");
        let manifests = std::env::temp_dir().join(format!("{}-manifests", multi.name()));
        let manifest_dir = TempDir(manifests.clone());
        std::fs::create_dir_all(&manifests).unwrap();
        for entry in std::fs::read_dir(&examples).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, manifests.join(path.file_name().unwrap())).unwrap();
        }
        let mut agents = Vec::new();
        let mut pins = Vec::new();
        let mut cgroups = Vec::new();
        for node in 0..multi.node_count() {
            let pin_dir = unique_pin_dir();
            let cgroup = sandbox::cgroup::ChildCgroup::new("kproxy-test").unwrap();
            let mut args: Vec<String> = vec![
                kproxy_bin().display().to_string(),
                "--pin-dir".into(),
                pin_dir.display().to_string(),
                "agent".into(),
                "--manifests".into(),
                manifests.display().to_string(),
                "--interfaces".into(),
                "veth*".into(),
                "--external-interfaces".into(),
                "eth0".into(),
                "--cluster-cidr".into(),
                "10.244.0.0/16".into(),
                "--hostname-override".into(),
                format!("node-{node}"),
                "--poll-ms".into(),
                "100".into(),
                "--cgroup-root".into(),
                cgroup.path().display().to_string(),
            ];
            args.extend(extra_args.iter().map(|a| a.to_string()));
            agents.push(multi.node(node).node_spawn(&args).unwrap());
            pins.push(pin_dir);
            cgroups.push(cgroup);
        }
        let cluster = NorthSouth {
            agents,
            pins,
            _pods: pods,
            multi,
            manifests,
            _manifest_dir: manifest_dir,
            _cgroups: cgroups,
        };
        let xdp = !extra_args.windows(2).any(|w| w == ["--xdp", "off"]);
        for node in 0..2 {
            let ip = cluster.multi.node_ip(node);
            cluster.wait_for_frontend(node, &format!("{ip}:30080"), "TCP", 2);
            cluster.wait_for_frontend(node, &format!("{ip}:30053"), "UDP", 1);
            cluster.wait_for_frontend(node, &format!("{LB_RANGES}:80"), "TCP", 2);
            // The agent attaches within its --poll-ms of starting, apart from programming the maps.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let link = cluster.multi.node(node).node_exec(["ip", "link", "show", "eth0"]).unwrap();
                let links = std::fs::read_dir(cluster.pins[node].join("links")).map_or(0, |d| d.count());
                if links >= 2 && (!xdp || link.contains("prog/xdp")) {
                    break;
                }
                assert!(Instant::now() < deadline, "node {node}: programs not attached: {link}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    fn kproxy(&self, node: usize, args: &[&str]) -> std::process::Output {
        let bin = kproxy_bin();
        let pins = self.pins[node].display().to_string();
        let mut full = vec![bin.to_str().unwrap(), "--pin-dir", &pins];
        full.extend(args);
        self.multi.node(node).node_exec_output(&full).unwrap()
    }

    fn services(&self, node: usize) -> Vec<serde_json::Value> {
        let out = self.kproxy(node, &["dump", "services", "--json"]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }

    fn wait_for_frontend(&self, node: usize, frontend: &str, proto: &str, count: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let found = self.services(node).iter().any(|r| {
                r["frontend"] == frontend && r["protocol"] == proto && r["slot"] == 0 && r["count"] == count
            });
            if found {
                return;
            }
            assert!(
                self.agents[node].is_running(),
                "agent of node {node} exited:\n{}",
                self.agents[node].log()
            );
            assert!(
                Instant::now() < deadline,
                "node {node}: {frontend}/{proto} with {count} backends not programmed; agent log:\n{}",
                self.agents[node].log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A NodePort Service `name` (`cluster_ip`, TCP `port`, `node_port`) whose only endpoint is
    /// web-b on node 1; returns once node 0 has programmed it.
    fn add_node_port_to_web_b(&self, name: &str, cluster_ip: &str, port: u16, node_port: u16) {
        let manifest = format!(
            "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  clusterIP: {cluster_ip}
  ports: [{{name: tcp, port: {port}, protocol: TCP, nodePort: {node_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
endpoints: [{{addresses: [{WEB_B}], conditions: {{ready: true}}, nodeName: node-1}}]
ports: [{{name: tcp, port: {port}, protocol: TCP}}]
"
        );
        std::fs::write(self.manifests.join(format!("{name}.yaml")), manifest).unwrap();
        self.wait_for_frontend(0, &format!("{}:{node_port}", self.multi.node_ip(0)), "TCP", 1);
    }

    /// `healthCheckNodePort` of `node` from the external client: (HTTP status, JSON body).
    fn health_check(&self, node: usize, port: u16) -> (String, serde_json::Value) {
        let url = format!("http://{}:{port}/", self.multi.node_ip(node));
        let out = self
            .multi
            .external_exec(["curl", "-sS", "--max-time", "2", "-w", "\n%{http_code}", &url])
            .unwrap_or_else(|e| panic!("health check of node {node}: {e:#}\n{}", self.agent_logs()));
        let (body, status) = out.trim_end().rsplit_once('\n').unwrap();
        (status.to_owned(), serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}")))
    }

    fn wait_for_no_frontend(&self, node: usize, frontend: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.services(node).iter().any(|r| r["frontend"] == frontend) {
            assert!(
                Instant::now() < deadline,
                "node {node}: {frontend} still programmed; agent log:\n{}",
                self.agents[node].log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The DNS pod answering a UDP query from the external client's `source_port` to the
    /// NodePort 30053 of `node`, if any answers.
    fn dns_pod_from_port(&self, node: usize, source_port: u16) -> Option<String> {
        let out = self
            .multi
            .external_exec_output([
                "dig",
                "+short",
                "+time=1",
                "+tries=1",
                "-b",
                &format!("0.0.0.0#{source_port}"),
                &format!("@{}", self.multi.node_ip(node)),
                "-p",
                "30053",
                "whoami.kproxy.test",
                "TXT",
            ])
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().trim_matches('"').to_owned();
        (out.status.success() && !text.is_empty()).then_some(text)
    }

    /// curl from the external client; `Ok((backend, source seen by it))` from `/whoami`.
    /// `dig +short +time=2` (and `extra`) from the external client for ip.kproxy.test at NodePort
    /// 30053 of `node`: the answer, or dig's failure.
    fn dig_node_port(&self, node: usize, extra: &[&str]) -> anyhow::Result<String> {
        let server = format!("@{}", self.multi.node_ip(node));
        let mut args = vec!["dig", "+short", "+time=2"];
        args.extend(extra);
        args.extend([server.as_str(), "-p", "30053", "ip.kproxy.test"]);
        self.multi.external_exec(args)
    }

    fn whoami(&self, url: &str, extra: &[&str]) -> Result<(Ipv4Addr, Ipv4Addr), String> {
        let mut args = vec!["curl", "-sS", "--max-time", "2"];
        args.extend(extra);
        args.push(url);
        let out = self.multi.external_exec_output(&args).unwrap();
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut parts = text.split_whitespace();
        let parse = |p: Option<&str>| p.and_then(|p| p.parse().ok()).ok_or_else(|| format!("page {text:?}"));
        Ok((parse(parts.next())?, parse(parts.next())?))
    }

    fn stat(&self, node: usize, reason: &str) -> u64 {
        let out = self.kproxy(node, &["dump", "stats", "--json"]);
        let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        rows.as_array()
            .unwrap()
            .iter()
            .find(|r| r["reason"] == reason)
            .and_then(|r| r["packets"].as_u64())
            .unwrap_or_else(|| panic!("no counter {reason} in {rows}"))
    }

    /// A 2 KB DNS query from the external client to `node`'s UDP NodePort, answered from the DNS
    /// pod on node 1 with the NodePort as its source: (query, answer) lengths in bytes.
    fn big_dns_query_via(&self, node: usize) -> (usize, usize) {
        let node_ip = self.multi.node_ip(node);
        let script = sandbox::big_dns_query_script(node_ip, 30053);
        let out = self
            .multi
            .external_exec(["python3", "-c", &script])
            .unwrap_or_else(|e| panic!("via node {node}: {e:#}\n{}", self.agent_logs()));
        let fields: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(fields.len(), 4, "{out}");
        assert_eq!((fields[2], fields[3]), (node_ip.to_string().as_str(), "dns-b"), "via node {node}");
        (fields[0].parse().unwrap(), fields[1].parse().unwrap())
    }

    /// Moves every process of each pod into its node's `--cgroup-root` (`--socket-lb on`) and
    /// waits until the agent has taken tc off the pod's veth (`--pod-veth-tc auto`), eth0 keeping
    /// its programs.
    fn cover_every_pod(&self) {
        // web-a on node 0, web-b and dns-b on node 1.
        for (pod, node) in self._pods.iter().zip([0, 1, 1]) {
            use std::os::unix::fs::MetadataExt;
            let netns = std::fs::metadata(pod.netns_path()).unwrap().ino();
            let procs = self._cgroups[node].path().join("cgroup.procs");
            for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                    continue;
                };
                if std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == netns) {
                    // A process may exit meanwhile.
                    let _ = std::fs::write(&procs, pid.to_string());
                }
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let links: Vec<String> = std::fs::read_dir(self.pins[node].join("links"))
                    .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                    .unwrap_or_default();
                let veth = format!("{}@", pod.host_veth());
                if !links.iter().any(|l| l.starts_with(&veth)) {
                    assert!(
                        links.iter().any(|l| l.starts_with("eth0@")),
                        "node {node}: eth0 keeps tc: {links:?}"
                    );
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {node}: {} keeps tc: {links:?}\n{}",
                    pod.host_veth(),
                    self.agents[node].log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn agent_logs(&self) -> String {
        self.agents.iter().enumerate().map(|(i, a)| format!("--- node {i}\n{}", a.log())).collect()
    }
}

/// Which node a backend lives on.
fn home_node(backend: Ipv4Addr) -> usize {
    usize::from(backend.octets()[2])
}

#[test]
fn nodeport_through_tc_alone_reaches_every_backend_with_snat_for_remote_ones() {
    let cluster = NorthSouth::start_with("np-tc", &["--xdp", "off"]);
    nodeport_reaches_backends_on_every_node_and_only_remote_ones_are_source_natted(&cluster);
    let link = cluster.multi.node(0).node_exec(["ip", "link", "show", "eth0"]).unwrap();
    assert!(!link.contains("prog/xdp"), "--xdp off attached XDP: {link}");
    assert_eq!(cluster.stat(0, "xdp_forwarded"), 0);
}

#[test]
fn nodeport_through_xdp_reaches_every_backend_with_snat_for_remote_ones() {
    let cluster = NorthSouth::start("np-xdp");
    for node in 0..2 {
        // The agent attaches within its --poll-ms after it starts.
        let deadline = Instant::now() + Duration::from_secs(10);
        let link = loop {
            let link = cluster.multi.node(node).node_exec(["ip", "-d", "link", "show", "eth0"]).unwrap();
            if link.contains("kproxy_xdp") || Instant::now() > deadline {
                break link;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(link.contains("prog/xdp") && link.contains("kproxy_xdp"), "node {node}: {link}");
        assert!(link.contains(" xdp ") || link.contains("xdp qdisc"), "native XDP on veth expected: {link}");
    }
    nodeport_reaches_backends_on_every_node_and_only_remote_ones_are_source_natted(&cluster);
    // XDP's choice is the datapath's choice: local and remote backends share new flows evenly
    // (a choice XDP made and tc made again would favour the remote one 3 to 1).
    let node0 = cluster.multi.node_ip(0);
    let local = (0..40)
        .filter(|_| cluster.whoami(&format!("http://{node0}:30080/whoami"), &[]).unwrap().0 == WEB_A)
        .count();
    assert!((8..=32).contains(&local), "{local} of 40 new flows went to the local backend");
    // Remote-backend flows (their SYN, the backend's answers, later segments) went through XDP.
    assert!(cluster.stat(0, "xdp_forwarded") >= 3, "XDP forwarded {}", cluster.stat(0, "xdp_forwarded"));
}

fn nodeport_reaches_backends_on_every_node_and_only_remote_ones_are_source_natted(cluster: &NorthSouth) {
    for node in 0..2 {
        let node_ip = cluster.multi.node_ip(node);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..24 {
            let (backend, source) = cluster
                .whoami(&format!("http://{node_ip}:30080/whoami"), &[])
                .unwrap_or_else(|e| panic!("NodePort via node {node}: {e}\n{}", cluster.agent_logs()));
            // A remote backend must answer through this node, so it sees the node's address;
            // a local one sees the client itself (as with Cilium's kube-proxy replacement).
            let expected = if home_node(backend) == node { CLIENT } else { node_ip };
            assert_eq!(source, expected, "backend {backend} reached through node {node}");
            seen.insert(backend);
        }
        assert_eq!(seen, [WEB_A, WEB_B].into(), "both backends answer through node {node}");
    }
    assert!(cluster.stat(0, "snat_new_flow") > 0);
    assert!(cluster.stat(0, "snat_reverse") > 0);
}

#[test]
fn nodeport_serves_udp_and_tcp_on_the_same_port_number() {
    let cluster = NorthSouth::start("np-dns");
    for node in 0..2 {
        for transport in ["+notcp", "+tcp"] {
            let answer = cluster.dig_node_port(node, &["+tries=1", transport, "A"]).unwrap_or_else(|e| {
                panic!("dig {transport} via node {node}: {e:#}\n{}", cluster.agent_logs())
            });
            assert_eq!(answer.trim(), DNS_B.to_string(), "dig {transport} via node {node}");
        }
    }
}

/// The CoreDNS problem through a NodePort: a client that keeps its source port reaches the
/// replacement of a replaced DNS pod — through the node without the pod (remote backend, source
/// NAT, XDP) and through the node with it — and a deleted NodePort Service goes silent while the
/// others keep serving.
#[test]
fn a_fixed_port_udp_client_follows_a_replaced_nodeport_backend_and_a_deleted_nodeport_goes_silent() {
    let cluster = NorthSouth::start("np-replace");
    let replacement = cluster.multi.add_pod(1, "dns-b2", DNS_B2).unwrap();
    replacement.start_dnsmasq(WEB_B).unwrap();
    // Node 0 forwards to the remote pod, node 1 to its own.
    let flows = [(0, 12345), (1, 12346)];
    for (node, port) in flows {
        for _ in 0..3 {
            assert_eq!(
                cluster.dns_pod_from_port(node, port).as_deref(),
                Some("dns-b"),
                "via node {node}\n{}",
                cluster.agent_logs()
            );
        }
    }

    let dns = cluster.manifests.join("dns.yaml");
    let text = std::fs::read_to_string(&dns).unwrap();
    assert!(text.contains(&format!("  - {DNS_B}\n")));
    std::fs::write(&dns, text.replace(&format!("  - {DNS_B}\n"), &format!("  - {DNS_B2}\n"))).unwrap();
    let changed = Instant::now();
    for (node, port) in flows {
        loop {
            if cluster.dns_pod_from_port(node, port).as_deref() == Some("dns-b2") {
                break;
            }
            assert!(
                changed.elapsed() < Duration::from_secs(20),
                "the flow from port {port} via node {node} still ends at the replaced pod\n{}",
                cluster.agent_logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    std::fs::remove_file(&dns).unwrap();
    for node in 0..2 {
        cluster.wait_for_no_frontend(node, &format!("{}:30053", cluster.multi.node_ip(node)));
    }
    for (node, port) in flows {
        assert_eq!(cluster.dns_pod_from_port(node, port), None, "deleted NodePort answered via node {node}");
        assert_eq!(
            cluster.dns_pod_from_port(node, port + 10),
            None,
            "deleted NodePort answered via node {node}"
        );
    }
    for node in 0..2 {
        let url = format!("http://{}:30080/whoami", cluster.multi.node_ip(node));
        assert!(cluster.whoami(&url, &[]).is_ok(), "web's NodePort via node {node} stopped too");
    }
}

/// A 2 KB UDP query and its 2 KB answer, both in fragments, through the NodePort of the node
/// without the DNS pod (source NAT; XDP leaves fragments to tc) and of the node with it.
#[test]
fn fragmented_udp_through_a_node_port_reaches_the_dns_pod_and_comes_back() {
    let cluster = NorthSouth::start("np-frag");
    for node in 0..2 {
        let (query_len, answer_len) = cluster.big_dns_query_via(node);
        assert!(query_len > 1500 && answer_len > 1500, "via node {node}: {query_len} and {answer_len} bytes");
        assert!(cluster.stat(node, "fragment_followed") >= 2, "node {node}");
    }
}

/// A 10 MB download from the pod on node 1 through node 0's NodePort: every segment of the
/// answer is un-NATed by node 0 (XDP, or tc alone) and reaches the client intact.
#[test]
fn a_10_mb_download_through_a_node_port_from_another_node_arrives_intact() {
    for (tag, args) in [("np-big", &[][..]), ("np-big-tc", &["--xdp", "off"][..])] {
        let cluster = NorthSouth::start_with(tag, args);
        cluster.add_node_port_to_web_b("web-b-only", "10.96.0.91", 80, 30091);
        let node0 = cluster.multi.node_ip(0);
        let out = cluster.manifests.join("big.bin");
        let url = format!("http://{node0}:30091{}", sandbox::BIG_FILE_PATH);
        cluster
            .multi
            .external_exec(["curl", "-sS", "--max-time", "60", "-o", out.to_str().unwrap(), &url])
            .unwrap_or_else(|e| panic!("{tag}: {e:#}\n{}", cluster.agent_logs()));
        let got = std::fs::read(&out).unwrap();
        std::fs::remove_file(&out).unwrap();
        assert!(got == sandbox::big_file_contents(), "{tag}: the 10 MB file arrived corrupted");
        assert_eq!(cluster.stat(0, "rewrite_failed"), 0, "{tag}");
        assert_eq!(cluster.stat(0, "fib_lookup_failed"), 0, "{tag}");
        if args.is_empty() {
            assert!(cluster.stat(0, "xdp_forwarded") > 5000, "{tag}: XDP carried the download");
        }
    }
}

/// Counts what a connection sends until it is shut, then answers the count.
const SINK_SERVER: &str = "
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(('0.0.0.0', 9000))
server.listen(8)
while True:
    conn, _ = server.accept()
    count = 0
    while True:
        data = conn.recv(65536)
        if not data:
            break
        count += len(data)
    conn.sendall(str(count).encode())
    conn.close()
";

/// Node 1 reaches web-b over a link with a smaller MTU (1400): it answers the client's 1500-byte
/// segments — source-NATed by node 0 — with "fragmentation needed" to node 0. Unless node 0
/// passes that on to the client, un-NATed, the upload stalls (a path-MTU black hole).
#[test]
fn a_client_uploading_through_a_node_port_learns_a_smaller_path_mtu_behind_it() {
    upload_learning_a_smaller_path_mtu("np-pmtu", &[]);
}

/// The same when tc alone translates (the client's segments are GRO aggregates there).
#[test]
fn a_client_uploading_through_a_node_port_learns_a_smaller_path_mtu_with_tc_alone() {
    upload_learning_a_smaller_path_mtu("np-pmtu-tc", &["--xdp", "off"]);
}

fn upload_learning_a_smaller_path_mtu(tag: &str, agent_args: &[&str]) {
    let cluster = NorthSouth::start_with(tag, agent_args);
    let web_b = &cluster._pods[1];
    let sink = web_b.spawn(["python3", "-c", SINK_SERVER]).unwrap();
    web_b.wait_listening("tcp", 9000, Some(&sink), Duration::from_secs(10)).unwrap();
    cluster.add_node_port_to_web_b("sink", "10.96.0.90", 9000, 30090);
    let node0 = cluster.multi.node_ip(0);
    cluster.multi.node(1).node_exec(["ip", "link", "set", "dev", web_b.host_veth(), "mtu", "1400"]).unwrap();

    let upload = format!(
        "
import socket
s = socket.create_connection(('{node0}', 30090), timeout=10)
s.sendall(bytes(300000))
s.shutdown(socket.SHUT_WR)
answer = b''
while True:
    data = s.recv(64)
    if not data:
        break
    answer += data
print(answer.decode())
"
    );
    let before = cluster.stat(0, "icmp_error_unnat");
    let out = cluster
        .multi
        .external_exec(["python3", "-c", &upload])
        .unwrap_or_else(|e| panic!("the upload stalled: {e:#}\n{}", cluster.agent_logs()));
    assert_eq!(out.trim(), "300000", "the sink got every byte");
    assert!(cluster.stat(0, "icmp_error_unnat") > before, "no ICMP error went on to the client");
    if agent_args.is_empty() {
        assert!(cluster.stat(0, "xdp_forwarded") > 100, "XDP carried the upload");
    }
}

#[test]
fn external_traffic_policy_local_keeps_the_client_drops_without_a_local_endpoint_and_drains_a_terminating_one()
 {
    let cluster = NorthSouth::start("etp-local");
    let node1 = cluster.multi.node_ip(1);
    for _ in 0..5 {
        let (backend, source) = cluster.whoami(&format!("http://{node1}:30081/whoami"), &[]).unwrap();
        assert_eq!((backend, source), (WEB_B, CLIENT), "no SNAT: the backend sees the real client");
    }
    let node0 = cluster.multi.node_ip(0);
    let dropped_before = cluster.stat(0, "drop_no_local_endpoint");
    let refused = cluster.whoami(&format!("http://{node0}:30081/whoami"), &[]);
    assert!(refused.is_err(), "node 0 has no endpoint of web-local and must drop: {refused:?}");
    // The LB IP is routed to node 0 by the client: dropped the same way.
    assert!(cluster.whoami(&format!("http://{LB_LOCAL}/whoami"), &[]).is_err());
    assert!(cluster.stat(0, "drop_no_local_endpoint") > dropped_before);

    // The load balancer's view: healthCheckNodePort 32081 on each node.
    for (node, code, count) in [(0, "503", 0), (1, "200", 1)] {
        let (status, json) = cluster.health_check(node, 32081);
        assert_eq!(status, code, "node {node}: {json}");
        assert_eq!(json["localEndpoints"], count, "node {node}: {json}");
        assert_eq!(json["service"]["name"], "web-local");
    }

    // The pod on node 1 starts terminating (still serving): the load balancer is told to drain
    // the node, and connections that still arrive are served by that pod, the client kept.
    let path = cluster.manifests.join("web-local.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let ready = "    ready: true\n    serving: true\n    terminating: false\n";
    assert!(text.contains(ready));
    let terminating = "    ready: false\n    serving: true\n    terminating: true\n";
    std::fs::write(&path, text.replace(ready, terminating)).unwrap();
    let changed = Instant::now();
    loop {
        let (status, json) = cluster.health_check(1, 32081);
        if status == "503" {
            assert_eq!(json["localEndpoints"], 0, "{json}");
            break;
        }
        assert!(changed.elapsed() < Duration::from_secs(20), "node 1 still healthy: {json}");
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        let (backend, source) = cluster.whoami(&format!("http://{node1}:30081/whoami"), &[]).unwrap();
        assert_eq!((backend, source), (WEB_B, CLIENT), "the terminating local pod serves, client kept");
    }
}

#[test]
fn load_balancer_source_ranges_drop_other_clients_but_not_the_node_port() {
    let cluster = NorthSouth::start("ranges");
    cluster.multi.external_exec(["ip", "addr", "add", &format!("{OTHER_CLIENT}/24"), "dev", "eth0"]).unwrap();
    let url = format!("http://{LB_RANGES}/whoami");
    cluster.whoami(&url, &[]).unwrap_or_else(|e| panic!("allowed client: {e}\n{}", cluster.agent_logs()));
    let before = cluster.stat(0, "drop_source_range");
    let other = cluster.whoami(&url, &["--interface", &OTHER_CLIENT.to_string()]);
    assert!(other.is_err(), "a client outside loadBalancerSourceRanges got through: {other:?}");
    assert!(cluster.stat(0, "drop_source_range") > before);
    // The Service's NodePort is not filtered (kube-proxy filters LB IPs only).
    let node0 = cluster.multi.node_ip(0);
    cluster
        .whoami(&format!("http://{node0}:30082/whoami"), &["--interface", &OTHER_CLIENT.to_string()])
        .expect("the NodePort of a Service with source ranges is open");
    // A pod outside the ranges is dropped too: kube-proxy filters every source before DNAT, so
    // the allow-list cannot be bypassed from inside the cluster.
    let before = cluster.stat(0, "drop_source_range");
    let from_pod = cluster._pods[0].curl(&url);
    assert!(from_pod.is_err(), "a pod outside loadBalancerSourceRanges got through: {from_pod:?}");
    assert!(cluster.stat(0, "drop_source_range") > before);
}

/// kube-proxy's `allowFromNode` (pkg/proxy/nftables/proxier.go, the firewall chain): when a
/// `loadBalancerSourceRanges` range holds the node's IP, the Service's load-balancer IPs are admitted
/// as sources too — a VIP-style load balancer whose IP is local to the node loops the node's own
/// requests back with that IP as their source. The client here owns web-ranges' second LB IP and
/// sends from it.
#[test]
fn a_source_range_holding_the_nodes_address_admits_the_services_own_load_balancer_ips() {
    const SECOND_LB_IP: &str = "192.168.200.12";
    let cluster = NorthSouth::start("fromnode");
    let ranges = cluster.manifests.join("web-ranges.yaml");
    let text = std::fs::read_to_string(&ranges).unwrap();
    let two_ips = text.replacen(
        "    - ip: 192.168.200.11\n",
        &format!("    - ip: 192.168.200.11\n    - ip: {SECOND_LB_IP}\n"),
        1,
    );
    assert_ne!(two_ips, text);
    std::fs::write(&ranges, &two_ips).unwrap();
    cluster.wait_for_frontend(0, &format!("{SECOND_LB_IP}:80"), "TCP", 2);
    cluster.multi.external_exec(["ip", "addr", "add", &format!("{SECOND_LB_IP}/32"), "dev", "eth0"]).unwrap();
    cluster.multi.external_exec(["ip", "addr", "add", &format!("{OTHER_CLIENT}/24"), "dev", "eth0"]).unwrap();
    let client = CLIENT.to_string();
    cluster
        .multi
        .node(0)
        .node_exec([
            "ip",
            "route",
            "add",
            &format!("{SECOND_LB_IP}/32"),
            "via",
            client.as_str(),
            "dev",
            "eth0",
        ])
        .unwrap();
    let url = format!("http://{LB_RANGES}/whoami");
    let from = |source: &str| cluster.whoami(&url, &["--interface", source]);

    // 192.168.100.200/32 holds no node address: the LB IP as a source is dropped like any other.
    cluster.whoami(&url, &[]).unwrap_or_else(|e| panic!("allowed client: {e}\n{}", cluster.agent_logs()));
    let before = cluster.stat(0, "drop_source_range");
    assert!(from(SECOND_LB_IP).is_err(), "the LB IP got through a range that holds no node address");
    assert!(cluster.stat(0, "drop_source_range") > before);

    // A range holding both nodes' addresses (192.168.100.10 and .11), not the client's.
    std::fs::write(&ranges, two_ips.replacen("  - 192.168.100.200/32\n", "  - 192.168.100.10/31\n", 1))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.whoami(&url, &[]).is_ok() {
        assert!(Instant::now() < deadline, "the old range stayed:\n{}", cluster.agent_logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (backend, seen) = from(SECOND_LB_IP).unwrap_or_else(|e| {
        panic!("the Service's own LB IP was not admitted: {e}\n{}", cluster.agent_logs())
    });
    assert!([WEB_A, WEB_B].contains(&backend), "{backend}");
    let expected_source =
        if home_node(backend) == 0 { SECOND_LB_IP.parse().unwrap() } else { cluster.multi.node_ip(0) };
    assert_eq!(seen, expected_source, "local backends see the client's address, remote ones the node's");
    let before = cluster.stat(0, "drop_source_range");
    assert!(from(&OTHER_CLIENT.to_string()).is_err(), "a source in no range and no LB IP got through");
    assert!(cluster.stat(0, "drop_source_range") > before);
}

#[test]
fn external_ips_are_served_and_cluster_ips_from_outside_are_masqueraded() {
    let cluster = NorthSouth::start("extip");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let (backend, _) = cluster.whoami(&format!("http://{EXTERNAL_IP}/whoami"), &[]).unwrap();
        seen.insert(backend);
    }
    assert_eq!(seen, [WEB_A, WEB_B].into());

    // A router that sends the service CIDR to node 0: the client is outside --cluster-cidr,
    // so even the local backend sees node 0's address (kube-proxy's masquerade rule).
    let node0 = cluster.multi.node_ip(0);
    cluster.multi.external_exec(["ip", "route", "add", "10.96.0.0/12", "via", &node0.to_string()]).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let (backend, source) = cluster.whoami("http://10.96.0.100/whoami", &[]).unwrap();
        assert_eq!(source, node0, "backend {backend} saw the client unmasqueraded");
        seen.insert(backend);
    }
    assert_eq!(seen, [WEB_A, WEB_B].into());
}

/// `kproxy trace` on the entry node shows a NodePort flow that XDP translated: the client's
/// query, the same query leaving as the node's address and SNAT port toward the remote DNS pod,
/// the pod's answer to that port, and the answer going back to the client from the NodePort.
#[test]
fn trace_shows_an_xdp_translated_nodeport_flow_with_its_snat() {
    let cluster = NorthSouth::start("ns-trace");
    let node0 = cluster.multi.node_ip(0);
    // A first query makes node 0 resolve node 1's MAC: until a neighbour is known XDP leaves the
    // packet to tc, whose redirect resolves it.
    let dig = || cluster.dig_node_port(0, &["+tries=1"]).unwrap();
    assert_eq!(dig().trim(), DNS_B.to_string());
    let trace = Trace::start(cluster.multi.node(0), &cluster.pins[0], &["--client", &CLIENT.to_string()]);
    let forwarded_before = cluster.stat(0, "xdp_forwarded");
    assert_eq!(dig().trim(), DNS_B.to_string());
    let steps = trace.steps();
    assert!(
        cluster.stat(0, "xdp_forwarded") >= forwarded_before + 2,
        "the query and its answer went through XDP"
    );

    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "{steps:#?}");
    let client_end = steps[0]["source"].as_str().unwrap().to_owned();
    assert!(client_end.starts_with(&format!("{CLIENT}:")), "{steps:#?}");
    assert_eq!(steps[0]["destination"], format!("{node0}:30053"));
    let snat = steps[1]["source"].as_str().unwrap().to_owned();
    assert!(
        snat.starts_with(&format!("{node0}:6")),
        "source NAT to the node's address and a SNAT port: {steps:#?}"
    );
    assert_eq!(steps[1]["destination"], format!("{DNS_B}:53"));
    assert_eq!(steps[2]["source"], format!("{DNS_B}:53"));
    assert_eq!(steps[2]["destination"], snat);
    assert_eq!(steps[3]["source"], format!("{node0}:30053"));
    assert_eq!(steps[3]["destination"], client_end);
}

/// With `--lb-algorithm maglev`, `kproxy trace` says the frontend's Maglev table chose a NodePort
/// flow's backend — not session affinity, which the Service does not have (the trace said
/// "by session affinity" for every pick that drew no slot).
#[test]
fn trace_names_maglev_as_what_chose_a_nodeport_flows_backend() {
    let cluster = NorthSouth::start_with("ns-maglev", &["--lb-algorithm", "maglev"]);
    let trace = Trace::start(cluster.multi.node(0), &cluster.pins[0], &["--client", &CLIENT.to_string()]);
    let answer = cluster.dig_node_port(0, &["+tries=3"]).unwrap();
    assert_eq!(answer.trim(), DNS_B.to_string());
    let steps = trace.steps();
    let note = steps[1]["note"].as_str().unwrap();
    assert!(note.contains(" by Maglev, new flow"), "{steps:#?}");
    assert!(!note.contains("affinity"), "{steps:#?}");
}

/// `--socket-lb on` with every pod covered by its node's socket hooks (the pods' processes moved
/// into the node's cgroup), so no pod veth has a tc program (`--pod-veth-tc auto`): NodePorts and
/// ExternalIPs from outside still reach local backends un-NATed (their replies are un-NATed by
/// the external interface's egress program) and remote ones SNATed, fragments included.
#[test]
fn nodeport_and_external_ips_reach_backends_whose_veths_have_no_tc_program() {
    let cluster = NorthSouth::start_with("np-notc", &["--socket-lb", "on", "--pod-veth-tc", "auto"]);
    cluster.cover_every_pod();
    nodeport_reaches_backends_on_every_node_and_only_remote_ones_are_source_natted(&cluster);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let (backend, _) = cluster.whoami(&format!("http://{EXTERNAL_IP}/whoami"), &[]).unwrap();
        seen.insert(backend);
    }
    assert_eq!(seen, [WEB_A, WEB_B].into(), "the ExternalIP reaches both backends");
    for node in 0..2 {
        cluster.big_dns_query_via(node);
    }
    // A covered pod (web-a, node 0) reaching a NodePort of the other node, the ExternalIP and the
    // cluster IP: its connect() is translated by the hooks, with no tc on its veth to do it.
    let node1 = cluster.multi.node_ip(1);
    for url in [format!("http://{node1}:30080/whoami"), format!("http://{EXTERNAL_IP}/whoami")] {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..12 {
            let out = cluster._cgroups[0]
                .command(cluster._pods[0].netns(), &["curl", "-sS", "--max-time", "5", &url])
                .output()
                .unwrap();
            assert!(out.status.success(), "{url} from web-a: {}", String::from_utf8_lossy(&out.stderr));
            let page = String::from_utf8_lossy(&out.stdout).into_owned();
            seen.insert(page.split_whitespace().next().unwrap_or_default().to_owned());
        }
        assert_eq!(seen, [WEB_A.to_string(), WEB_B.to_string()].into(), "{url} from web-a");
    }
}

/// `--socket-lb on --pod-veth-tc auto` with every pod covered, and a router sending the service
/// CIDR to node 0: an outside client reaching the cluster IP is answered from it by both backends.
/// The remote one (web-b) is masqueraded as with tc and sees node 0's address; the local one
/// (web-a, no tc program on its veth to turn a reply to node 0's SNAT port back) is reached
/// un-SNATed — it sees the client's own address, and its reply is un-NATed by eth0's egress.
#[test]
fn cluster_ips_from_outside_reach_backends_whose_veths_have_no_tc_program() {
    let cluster = NorthSouth::start_with("cip-notc", &["--socket-lb", "on", "--pod-veth-tc", "auto"]);
    cluster.cover_every_pod();
    let node0 = cluster.multi.node_ip(0);
    cluster.multi.external_exec(["ip", "route", "add", "10.96.0.0/12", "via", &node0.to_string()]).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..16 {
        let (backend, source) = cluster
            .whoami("http://10.96.0.100/whoami", &[])
            .unwrap_or_else(|e| panic!("the cluster IP from outside: {e}\n{}", cluster.agent_logs()));
        assert_eq!(seen.insert(backend, source).unwrap_or(source), source, "backend {backend}");
    }
    assert_eq!(seen, [(WEB_A, CLIENT), (WEB_B, node0)].into(), "backend → the source it saw");
}

/// A kept-alive connection from the external client through node 0's NodePort to web-b on node 1
/// (source-NATed to node 0) whose reply conntrack entry is evicted — as the LRU evicts an entry
/// under pressure — while it idles between two requests: the agent's garbage collection runs in
/// the meantime (every second) and must leave the flow's two SNAT_V4 translations alone, for the
/// next request puts the reply entry back from them. Both requests are answered by web-b, which
/// sees node 0's address. (The collection deleted the translations of any flow whose reply
/// entry was missing, and the second request went unanswered.)
fn a_source_nated_flow_survives_the_gc_after_its_reply_entry_is_evicted(tag: &str, extra: &[&str]) {
    let mut args = vec!["--conntrack-gc-interval", "1s"];
    args.extend(extra);
    let cluster = NorthSouth::start_with(tag, &args);
    cluster.add_node_port_to_web_b("web-b-only", "10.96.0.91", 80, 30091);
    let node0 = cluster.multi.node_ip(0);
    // Asks, says from which port, waits for the test to evict (until `go` exists), asks again.
    let go = TempDir(std::env::temp_dir().join(format!("{}-go", cluster.multi.name())));
    let _ = std::fs::remove_dir_all(&go.0);
    let script = format!(
        "import os, socket, sys, time\n\
         s = socket.create_connection(('{node0}', 30091), timeout=5)\n\
         def ask():\n\
         \x20   s.sendall(b'GET /whoami HTTP/1.1\\r\\nHost: web\\r\\n\\r\\n')\n\
         \x20   answer = b''\n\
         \x20   while not answer.partition(b'\\r\\n\\r\\n')[2].endswith(b'\\n'):\n\
         \x20       answer += s.recv(4096) or sys.exit('closed after ' + repr(answer))\n\
         \x20   return answer\n\
         first = ask()\n\
         print(s.getsockname()[1], flush=True)\n\
         while not os.path.exists('{}'): time.sleep(0.05)\n\
         second = ask()\n\
         print(first.split(b'\\r\\n\\r\\n', 1)[1].decode().strip(), flush=True)\n\
         print(second.split(b'\\r\\n\\r\\n', 1)[1].decode().strip(), flush=True)\n",
        go.0.display()
    );
    let client = cluster.multi.external_spawn(["python3", "-c", &script]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let port: u16 = loop {
        if let Some(port) = client.log().lines().next().and_then(|l| l.trim().parse().ok()) {
            break port;
        }
        assert!(client.is_running(), "the client failed: {}\n{}", client.log(), cluster.agent_logs());
        assert!(Instant::now() < deadline, "no answer through node 0: {}", client.log());
        std::thread::sleep(Duration::from_millis(50));
    };

    let pins = kproxy::bpf::PinDir::new(&cluster.pins[0]);
    let mut maps = kproxy::bpf::Maps::from_pins(&pins).unwrap();
    let replies: Vec<proxy_common::maps::CtKeyV4> = maps
        .conntrack
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| {
            k.direction == proxy_common::maps::CT_DIR_REPLY
                && k.saddr == WEB_B.octets()
                && k.daddr == node0.octets()
                && k.proto == proxy_common::maps::IPPROTO_TCP
        })
        .collect();
    assert_eq!(replies.len(), 1, "the flow's one reply entry, keyed to node 0's SNAT port: {replies:?}");
    maps.conntrack.remove(&replies[0]).unwrap();
    let snat = |maps: &kproxy::bpf::Maps| maps.snat.keys().filter_map(|k| k.ok()).collect::<Vec<_>>();
    assert_eq!(snat(&maps).len(), 2, "the flow's forward and reverse translations");
    // A canary: the reverse translation of a flow long gone (nothing in conntrack, created at boot).
    // Once it is swept, a collection has judged the live flow with its reply entry missing.
    let canary = proxy_common::maps::CtKeyV4 { sport: 8080u16.to_be_bytes(), ..replies[0] };
    let to = proxy_common::maps::SnatEntryV4 {
        created_ns: 0,
        addr: [192, 168, 100, 250],
        port: [0, 1],
        _pad: [0; 2],
    };
    maps.snat.insert(canary, to, 0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while snat(&maps).contains(&canary) {
        assert!(Instant::now() < deadline, "no collection swept the canary\n{}", cluster.agent_logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(snat(&maps).len(), 2, "the gc left the live flow's translations\n{}", cluster.agent_logs());

    std::fs::create_dir(&go.0).unwrap();
    let status = client.wait_timeout(Duration::from_secs(10)).unwrap().expect("the client exits");
    let log = client.log();
    let answers: Vec<&str> = log.lines().skip(1).collect();
    assert!(status.success(), "from :{port}: {log}\n{}", cluster.agent_logs());
    assert_eq!(answers.len(), 2, "{log}");
    for answer in answers {
        assert_eq!(answer, format!("{WEB_B} {node0}"), "web-b answered and saw node 0: {log}");
    }
    assert!(maps.conntrack.get(&replies[0], 0).is_ok(), "the second request put the reply entry back");
}

#[test]
fn a_source_nated_flow_survives_the_gc_after_its_reply_entry_is_evicted_through_xdp() {
    a_source_nated_flow_survives_the_gc_after_its_reply_entry_is_evicted("evict-xdp", &[]);
}

#[test]
fn a_source_nated_flow_survives_the_gc_after_its_reply_entry_is_evicted_through_tc() {
    a_source_nated_flow_survives_the_gc_after_its_reply_entry_is_evicted("evict-tc", &["--xdp", "off"]);
}
