//! IPv6 north–south through real nodes (issue 19): the two-node sandbox of `north_south.rs`
//! (`sandbox::multinode`: node namespaces on an underlay bridge, an external client) with IPv6 on
//! the underlay (`fd00:192:168:100::/64`: node i at `::(10+i)`, the client at `::200`), each node's
//! pod prefix `fd00:10:244:i::/64` routed via that node, dual-stack nginx pods, one real `kproxy
//! agent` per node programmed from manifests of dual-stack NodePort Services, and `curl -6` run in
//! the external client. What is asserted is what the client and the backends observe: who
//! answered, the source address the backend saw (the client's own for a local backend, the node's
//! IPv6 address for one on the other node: source NAT), that `externalTrafficPolicy: Local`
//! leaves a node without a local endpoint silent, and that its health check node port answers
//! IPv6 probes as it answers IPv4 ones.
//!
//! The IPv6 addresses are added by this test to the namespaces the sandbox made (nothing outside
//! them), before the agents start; XDP stays on (its default), which passes IPv6 to tc.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use sandbox::{Pod, Spawned, multinode::MultiNode};

mod common;
use common::cluster::{TempDir, Trace, kproxy_bin, unique_pin_dir};

const WEB_A: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const WEB_B: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const WEB_A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0x11);
const WEB_B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x11);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x100, 0, 0, 0, 0x200);
/// `web6-local`'s `healthCheckNodePort`.
const HEALTH_PORT: u16 = 32091;
/// `web6`'s external IP; the client routes fd00:192:168:200::/64 via node 0.
const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x200, 0, 0, 0, 0x20);

/// Node `i`'s IPv6 address on the underlay.
fn node_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x100, 0, 0, 0, 0x10 + i as u16)
}

/// `web6`: dual-stack, NodePort 30080 and an IPv6 external IP, policy Cluster, web-a (node 0) and
/// web-b (node 1) behind it; `web6-local`: dual-stack, NodePort 30081, policy Local with
/// `healthCheckNodePort` [`HEALTH_PORT`], web-b alone;
/// `web6-b`: dual-stack, NodePort 30082, policy Cluster, web-b alone.
fn web6_manifests() -> String {
    let service = |name: &str, v4: &str, v6: &str, node_port: u16, policy: &str| {
        let external_ips = if policy == "Cluster" {
            format!("  externalIPs: [\"{EXTERNAL_IP6}\"]\n")
        } else {
            String::new()
        };
        let policy = policy.trim_end_matches("-b");
        let health =
            if policy == "Local" { format!("  healthCheckNodePort: {HEALTH_PORT}\n") } else { String::new() };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: NodePort\n{external_ips}  externalTrafficPolicy: {policy}\n{health}  clusterIP: {v4}\n  clusterIPs: [{v4}, \"{v6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 80, nodePort: {node_port}}}]\n"
        )
    };
    let slice = |name: &str, service: &str, family: &str, endpoints: &[(String, usize)]| {
        let endpoints: String = endpoints
            .iter()
            .map(|(addr, node)| {
                format!("- addresses: [\"{addr}\"]\n  conditions: {{ready: true}}\n  nodeName: node-{node}\n")
            })
            .collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {service}}}\naddressType: {family}\nendpoints:\n{endpoints}ports: [{{name: http, port: 80, protocol: TCP}}]\n"
        )
    };
    let both4 = [(WEB_A.to_string(), 0), (WEB_B.to_string(), 1)];
    let both6 = [(WEB_A6.to_string(), 0), (WEB_B6.to_string(), 1)];
    [
        service("web6", "10.96.0.60", "fd00:10:96::60", 30080, "Cluster"),
        slice("web6-v4", "web6", "IPv4", &both4),
        slice("web6-v6", "web6", "IPv6", &both6),
        service("web6-local", "10.96.0.61", "fd00:10:96::61", 30081, "Local"),
        slice("web6-local-v4", "web6-local", "IPv4", &[(WEB_B.to_string(), 1)]),
        slice("web6-local-v6", "web6-local", "IPv6", &[(WEB_B6.to_string(), 1)]),
        service("web6-b", "10.96.0.62", "fd00:10:96::62", 30082, "Cluster-b"),
        slice("web6-b-v4", "web6-b", "IPv4", &[(WEB_B.to_string(), 1)]),
        slice("web6-b-v6", "web6-b", "IPv6", &[(WEB_B6.to_string(), 1)]),
    ]
    .join("---\n")
}

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn sysctl(netns: &str, settings: &[&str]) {
    for setting in settings {
        run(&["ip", "netns", "exec", netns, "sysctl", "-qw", setting]);
    }
}

/// IPv6 on the sandbox's underlay: the bridge and its ports, each node's eth0 (with forwarding)
/// and the client's, addresses without duplicate address detection, and each node's route to the
/// other's pod prefix.
fn add_ipv6_underlay(multi: &MultiNode) {
    let u = multi.underlay_netns();
    sysctl(u, &["net.ipv6.conf.all.disable_ipv6=0", "net.ipv6.conf.default.disable_ipv6=0"]);
    let mut ports: Vec<String> = (0..multi.node_count()).map(|i| format!("n{i}")).collect();
    ports.push("x".into());
    for port in &ports {
        sysctl(u, &[&format!("net.ipv6.conf.{port}.disable_ipv6=0")]);
    }
    // No querier on this bridge: flood multicast (neighbour solicitations) rather than snoop it.
    run(&["ip", "-n", u, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0"]);
    for i in 0..multi.node_count() {
        let ns = multi.node(i).node_netns();
        sysctl(
            ns,
            &[
                "net.ipv6.conf.eth0.disable_ipv6=0",
                "net.ipv6.conf.eth0.accept_dad=0",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv6.conf.eth0.forwarding=1",
            ],
        );
        run(&["ip", "-n", ns, "-6", "addr", "add", &format!("{}/64", node_ip6(i)), "dev", "eth0", "nodad"]);
        for j in (0..multi.node_count()).filter(|&j| j != i) {
            let prefix = format!("fd00:10:244:{j}::/64");
            run(&[
                "ip",
                "-n",
                ns,
                "-6",
                "route",
                "add",
                &prefix,
                "via",
                &node_ip6(j).to_string(),
                "dev",
                "eth0",
            ]);
        }
    }
    let x = multi.external_netns();
    sysctl(
        x,
        &[
            "net.ipv6.conf.all.disable_ipv6=0",
            "net.ipv6.conf.eth0.disable_ipv6=0",
            "net.ipv6.conf.eth0.accept_dad=0",
        ],
    );
    run(&["ip", "-n", x, "-6", "addr", "add", &format!("{CLIENT6}/64"), "dev", "eth0", "nodad"]);
    let via = node_ip6(0).to_string();
    run(&["ip", "-n", x, "-6", "route", "add", "fd00:192:168:200::/64", "via", &via, "dev", "eth0"]);
}

struct NorthSouth6 {
    agents: Vec<Spawned>,
    pins: Vec<PathBuf>,
    _pods: Vec<Pod>,
    multi: MultiNode,
    _manifest_dir: TempDir,
    _cgroups: Vec<sandbox::cgroup::ChildCgroup>,
}

impl Drop for NorthSouth6 {
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

impl NorthSouth6 {
    fn start(tag: &str) -> Self {
        Self::start_with(tag, &[])
    }

    /// [`Self::start`] with more agent flags.
    fn start_with(tag: &str, agent_flags: &[&str]) -> Self {
        let multi = MultiNode::new(tag, 2).expect("building the two-node sandbox (needs root)");
        add_ipv6_underlay(&multi);
        let mut pods = Vec::new();
        for (node, name, ip, ip6) in [(0, "web-a", WEB_A, WEB_A6), (1, "web-b", WEB_B, WEB_B6)] {
            let mut pod = multi.add_pod(node, name, ip).unwrap();
            pod.add_ipv6(ip6).unwrap();
            pod.start_nginx(&format!("{name}\n")).unwrap();
            pods.push(pod);
        }
        let manifests = std::env::temp_dir().join(format!("{}-manifests6", multi.name()));
        let manifest_dir = TempDir(manifests.clone());
        std::fs::create_dir_all(&manifests).unwrap();
        std::fs::write(manifests.join("web6.yaml"), web6_manifests()).unwrap();
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
                "10.244.0.0/16,fd00:10:244::/56".into(),
                "--hostname-override".into(),
                format!("node-{node}"),
                "--poll-ms".into(),
                "100".into(),
                "--cgroup-root".into(),
                cgroup.path().display().to_string(),
            ];
            args.extend(agent_flags.iter().map(|f| f.to_string()));
            agents.push(multi.node(node).node_spawn(&args).unwrap());
            pins.push(pin_dir);
            cgroups.push(cgroup);
        }
        let cluster =
            NorthSouth6 { agents, pins, _pods: pods, multi, _manifest_dir: manifest_dir, _cgroups: cgroups };
        for node in 0..2 {
            cluster.wait_for_frontend(node, &format!("[{}]:30080", node_ip6(node)), 2);
            cluster.wait_for_frontend(node, &format!("[{}]:30081", node_ip6(node)), 1);
            cluster.wait_for_frontend(node, &format!("[{EXTERNAL_IP6}]:80"), 2);
            cluster.wait_for_frontend(node, &format!("[{}]:30082", node_ip6(node)), 1);
            // The agent attaches within its --poll-ms of starting, apart from programming the maps.
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::fs::read_dir(cluster.pins[node].join("links")).map_or(0, |d| d.count()) < 2 {
                assert!(Instant::now() < deadline, "node {node}: programs not attached");
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

    /// Waits until `node` has `frontend` (TCP) with `count` backends in one of its entries.
    fn wait_for_frontend(&self, node: usize, frontend: &str, count: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = self.kproxy(node, &["dump", "services", "--json"]);
            let rows: Vec<serde_json::Value> = serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .ok()
                .and_then(|v| v.as_array().cloned())
                .unwrap_or_default();
            if rows.iter().any(|r| {
                r["frontend"] == frontend && r["protocol"] == "TCP" && r["slot"] == 0 && r["count"] == count
            }) {
                return;
            }
            assert!(
                self.agents[node].is_running(),
                "agent of node {node} exited:\n{}",
                self.agents[node].log()
            );
            assert!(
                Instant::now() < deadline,
                "node {node}: {frontend} with {count} backends not programmed; agent log:\n{}",
                self.agents[node].log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `curl -6` from the external client to `/whoami` on `node`'s IPv6 address: `Ok((backend,
    /// source seen by it))`, or curl's error.
    fn whoami6(&self, node: usize, port: u16) -> Result<(IpAddr, IpAddr), String> {
        self.whoami_at(node_ip6(node), port)
    }

    /// `curl -6` from the external client to `/whoami` on `addr`.
    fn whoami_at(&self, addr: Ipv6Addr, port: u16) -> Result<(IpAddr, IpAddr), String> {
        let url = format!("http://[{addr}]:{port}/whoami");
        let out = self.multi.external_exec_output(["curl", "-6", "-sS", "--max-time", "2", &url]).unwrap();
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut parts = text.split_whitespace();
        let parse = |p: Option<&str>| p.and_then(|p| p.parse().ok()).ok_or_else(|| format!("page {text:?}"));
        Ok((parse(parts.next())?, parse(parts.next())?))
    }

    /// The health check node port of `node` from the external client, over IPv4 to the node's
    /// IPv4 address or with `curl -6` to its IPv6 one: (HTTP status, JSON body). Waits (with a
    /// deadline) for the agent to start serving it: its listeners follow its first sync.
    fn health_check(&self, node: usize, port: u16, v6: bool) -> (String, serde_json::Value) {
        let (family, url) = if v6 {
            ("-6", format!("http://[{}]:{port}/", node_ip6(node)))
        } else {
            ("-4", format!("http://{}:{port}/", self.multi.node_ip(node)))
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let out = loop {
            let out = self
                .multi
                .external_exec_output([
                    "curl",
                    family,
                    "-sS",
                    "--max-time",
                    "2",
                    "-w",
                    "\n%{http_code}",
                    &url,
                ])
                .unwrap();
            if out.status.success() {
                break String::from_utf8_lossy(&out.stdout).into_owned();
            }
            assert!(
                Instant::now() < deadline,
                "health check {url} of node {node}: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.agent_logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let (body, status) = out.trim_end().rsplit_once('\n').unwrap();
        (status.to_owned(), serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}")))
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

    fn agent_logs(&self) -> String {
        self.agents.iter().enumerate().map(|(i, a)| format!("--- node {i}\n{}", a.log())).collect()
    }
}

#[test]
fn a_v6_client_reaches_a_dual_stack_node_port_through_both_nodes_and_remote_backends_see_the_node() {
    let cluster = NorthSouth6::start("ns6");
    for node in 0..2 {
        // Random picks: ask until both backends have answered through this node (each does with
        // probability 1/2 per request; 40 requests miss one with odds of 2^-39).
        let mut seen = std::collections::BTreeMap::new();
        for _ in 0..40 {
            let (backend, source) = cluster
                .whoami6(node, 30080)
                .unwrap_or_else(|e| panic!("via node {node}: {e}\n{}", cluster.agent_logs()));
            seen.insert(backend, source);
            if seen.len() == 2 {
                break;
            }
        }
        let local = if node == 0 { WEB_A6 } else { WEB_B6 };
        let remote = if node == 0 { WEB_B6 } else { WEB_A6 };
        assert_eq!(seen.len(), 2, "via node {node}, only {seen:?} answered");
        assert_eq!(seen[&IpAddr::V6(local)], IpAddr::V6(CLIENT6), "a local backend sees the client itself");
        assert_eq!(
            seen[&IpAddr::V6(remote)],
            IpAddr::V6(node_ip6(node)),
            "a backend on the other node sees node {node}'s IPv6 address (source NAT)"
        );
        assert!(cluster.stat(node, "snat_new_flow") > 0, "node {node} counted its source-NATed flows");
        assert!(cluster.stat(node, "snat_reverse") > 0);
        // The remote backend's flows went through XDP (its SYN, the answers, later segments).
        assert!(
            cluster.stat(node, "xdp_forwarded") >= 3,
            "node {node}: XDP forwarded {}",
            cluster.stat(node, "xdp_forwarded")
        );
    }
}

#[test]
fn a_v6_node_port_through_tc_alone_reaches_both_backends_with_source_nat_for_the_remote_one() {
    let cluster = NorthSouth6::start_with("ns6tc", &["--xdp", "off"]);
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..40 {
        let (backend, source) =
            cluster.whoami6(0, 30080).unwrap_or_else(|e| panic!("{e}\n{}", cluster.agent_logs()));
        seen.insert(backend, source);
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen.get(&IpAddr::V6(WEB_A6)), Some(&IpAddr::V6(CLIENT6)), "{seen:?}");
    assert_eq!(seen.get(&IpAddr::V6(WEB_B6)), Some(&IpAddr::V6(node_ip6(0))), "{seen:?}");
    let link = cluster.multi.node(0).node_exec(["ip", "link", "show", "eth0"]).unwrap();
    assert!(!link.contains("prog/xdp"), "--xdp off attached XDP: {link}");
    assert_eq!(cluster.stat(0, "xdp_forwarded"), 0);
}

#[test]
fn external_traffic_policy_local_over_v6_answers_only_where_the_endpoint_is_and_keeps_the_client() {
    let cluster = NorthSouth6::start("ns6l");
    // Node 1 holds web-b: it answers itself, and web-b sees the client's own address.
    for _ in 0..5 {
        let answer = cluster.whoami6(1, 30081).unwrap_or_else(|e| panic!("{e}\n{}", cluster.agent_logs()));
        assert_eq!(answer, (IpAddr::V6(WEB_B6), IpAddr::V6(CLIENT6)));
    }
    // Node 0 has no endpoint of it: the SYN is dropped (no refusal, no forwarding to node 1), so
    // curl times out, while the same Service's policy-Cluster sibling answers there.
    let before = cluster.stat(0, "drop_no_local_endpoint");
    let error = cluster.whoami6(0, 30081).expect_err("node 0 has no local endpoint of web6-local");
    assert!(error.contains("timed out") || error.contains("Timeout"), "{error}");
    assert!(cluster.stat(0, "drop_no_local_endpoint") > before, "dropped by the datapath, counted");
    cluster.whoami6(0, 30080).unwrap_or_else(|e| panic!("{e}\n{}", cluster.agent_logs()));

    // The load balancer's view, on both families of each node: node 1 is healthy with its one
    // local endpoint, node 0 answers 503 so that it gets no traffic; IPv6 probes get exactly
    // what IPv4 ones do.
    for (node, status, local) in [(1, "200", 1), (0, "503", 0)] {
        let v4 = cluster.health_check(node, HEALTH_PORT, false);
        let v6 = cluster.health_check(node, HEALTH_PORT, true);
        assert_eq!(v4.0, status, "node {node} over IPv4: {}", v4.1);
        assert_eq!(v4.1["service"], serde_json::json!({"namespace": "default", "name": "web6-local"}));
        assert_eq!(v4.1["localEndpoints"], local, "node {node}: {}", v4.1);
        assert_eq!(v6, v4, "node {node}: the IPv6 probe differs from the IPv4 one");
    }
}

#[test]
fn a_v6_external_ip_routed_to_a_node_reaches_both_backends() {
    let cluster = NorthSouth6::start("ns6x");
    // The client routes the external IP via node 0, which does not hold it: the datapath
    // translates it before the node routes anything.
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..40 {
        let (backend, source) =
            cluster.whoami_at(EXTERNAL_IP6, 80).unwrap_or_else(|e| panic!("{e}\n{}", cluster.agent_logs()));
        seen.insert(backend, source);
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen.len(), 2, "only {seen:?} answered");
    assert_eq!(seen[&IpAddr::V6(WEB_A6)], IpAddr::V6(CLIENT6), "node 0's own pod sees the client");
    assert_eq!(seen[&IpAddr::V6(WEB_B6)], IpAddr::V6(node_ip6(0)), "node 1's sees node 0 (source NAT)");
}

#[test]
fn a_10_mb_download_over_v6_through_a_node_port_from_another_node_arrives_intact() {
    let cluster = NorthSouth6::start("ns6big");
    // web6-b's only backend is on node 1: through node 0 every segment is source-NATed and
    // redirected, the kernel's GSO/GRO aggregates and partial checksums included.
    // Beside the manifests (as north_south.rs does): removed with them.
    let out = cluster._manifest_dir.0.join("big6.bin");
    let url = format!("http://[{}]:30082{}", node_ip6(0), sandbox::BIG_FILE_PATH);
    cluster
        .multi
        .external_exec(["curl", "-6", "-sS", "--max-time", "60", "-o", out.to_str().unwrap(), &url])
        .unwrap_or_else(|e| panic!("{e:#}\n{}", cluster.agent_logs()));
    let got = std::fs::read(&out).unwrap();
    assert!(got == sandbox::big_file_contents(), "the 10 MB file arrived corrupted ({} bytes)", got.len());
    assert_eq!(cluster.stat(0, "rewrite_failed"), 0);
    assert_eq!(cluster.stat(0, "fib_lookup_failed"), 0);
    assert!(cluster.stat(0, "snat_reverse") > 100, "the answer came back through node 0's SNAT");
    assert!(cluster.stat(0, "xdp_forwarded") > 5000, "XDP carried the download");
}

/// Counts what a connection sends until it is shut, then answers the count (over IPv6 and IPv4).
const SINK_SERVER6: &str = "
import socket
server = socket.socket(socket.AF_INET6)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
server.bind(('::', 9000))
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
/// packets — source-NATed by node 0 — with an ICMPv6 packet too big to node 0's address. IPv6
/// routers never fragment, so unless node 0 passes that on to the client about the client's own
/// packet, the upload stalls (a path-MTU black hole).
#[test]
fn a_v6_client_uploading_through_a_node_port_learns_a_smaller_path_mtu_behind_it() {
    let cluster = NorthSouth6::start("ns6pmtu");
    let web_b = &cluster._pods[1];
    let sink = web_b.spawn(["python3", "-c", SINK_SERVER6]).unwrap();
    web_b.wait_listening("tcp", 9000, Some(&sink), Duration::from_secs(10)).unwrap();
    let sink_service = "apiVersion: v1\nkind: Service\nmetadata: {name: sink6, namespace: default}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.63\n  clusterIPs: [10.96.0.63, \"fd00:10:96::63\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports: [{name: sink, port: 9000, protocol: TCP, targetPort: 9000, nodePort: 30090}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: sink6-v6\n  namespace: default\n  labels: {kubernetes.io/service-name: sink6}\naddressType: IPv6\nendpoints:\n- addresses: [\"fd00:10:244:1::11\"]\n  conditions: {ready: true}\n  nodeName: node-1\nports: [{name: sink, port: 9000, protocol: TCP}]\n";
    std::fs::write(cluster._manifest_dir.0.join("sink6.yaml"), sink_service).unwrap();
    cluster.wait_for_frontend(0, &format!("[{}]:30090", node_ip6(0)), 1);
    cluster.multi.node(1).node_exec(["ip", "link", "set", "dev", web_b.host_veth(), "mtu", "1400"]).unwrap();

    let upload = format!(
        "
import socket
s = socket.create_connection(('{}', 30090), timeout=10)
s.sendall(bytes(300000))
s.shutdown(socket.SHUT_WR)
answer = b''
while True:
    data = s.recv(64)
    if not data:
        break
    answer += data
print(answer.decode())
",
        node_ip6(0)
    );
    let before = cluster.stat(0, "icmp_error_unnat");
    let out = cluster
        .multi
        .external_exec(["python3", "-c", &upload])
        .unwrap_or_else(|e| panic!("the upload stalled: {e:#}\n{}", cluster.agent_logs()));
    assert_eq!(out.trim(), "300000", "the sink got every byte");
    assert!(cluster.stat(0, "icmp_error_unnat") > before, "no packet too big went on to the client");
}

/// `kproxy trace` on each node while the external client reaches NodePort 30082 (web-b, on node 1)
/// over IPv6: through node 0 the query leaves as node 0's address and a SNAT port toward web-b and
/// the answer to that port goes back to the client from the NodePort; through node 1 web-b is
/// local and sees the client itself.
#[test]
fn trace_shows_a_v6_node_port_flow_with_its_snat_and_without_it() {
    let cluster = NorthSouth6::start("ns6-trace");
    let client = CLIENT6.to_string();
    for node in 0..2 {
        let node_ip = node_ip6(node);
        // One request first: on a fresh underlay node 0 has not resolved node 1's IPv6 neighbour
        // yet, and XDP then records its pick and leaves the send to tc — two events for the first
        // packet (XDP's choice, tc's send), which `north_south6_test_run`'s
        // `xdp_records_a_v6_remote_pick_whose_neighbour_is_unknown...` covers. This test reads
        // one flow's four steps.
        cluster.whoami6(node, 30082).unwrap_or_else(|e| panic!("via node {node}: {e}"));
        // Through node 1 web-b is local: XDP picks it and records the choice (its event), tc
        // translates the packet and tells of that too (an established flow's event), then the
        // reply's.
        let events = if node == 0 { 2 } else { 3 };
        let trace =
            Trace::start_for(cluster.multi.node(node), &cluster.pins[node], &["--client", &client], events);
        let (backend, source) =
            cluster.whoami6(node, 30082).unwrap_or_else(|e| panic!("via node {node}: {e}"));
        assert_eq!(backend, IpAddr::V6(WEB_B6));
        let mut steps = trace.steps();
        if node == 1 {
            let sent = steps.drain(2..4).collect::<Vec<_>>();
            let tuple = |step: &serde_json::Value| (step["source"].clone(), step["destination"].clone());
            assert_eq!(
                tuple(&sent[0]),
                tuple(&steps[0]),
                "tc's event is about the same packet: {sent:#?} {steps:#?}"
            );
            assert_eq!(
                (&sent[1]["source"], &sent[1]["destination"]),
                (&steps[1]["source"], &steps[1]["destination"]),
                "tc made XDP's translation: {sent:#?} {steps:#?}"
            );
            assert!(sent[1]["note"].as_str().unwrap().contains("conntrack entry created"), "{sent:#?}");
        }
        let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
        assert_eq!(names, ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "via node {node}: {steps:#?}");
        let client_end = steps[0]["source"].as_str().unwrap().to_owned();
        assert!(client_end.starts_with(&format!("[{CLIENT6}]:")), "{steps:#?}");
        let node_port = format!("[{node_ip}]:30082");
        let web_b = format!("[{WEB_B6}]:80");
        assert_eq!(steps[0]["destination"], node_port, "{steps:#?}");
        assert_eq!(steps[1]["destination"], web_b, "{steps:#?}");
        assert!(
            steps[1]["note"].as_str().unwrap().starts_with("default/web6-b:http, backend 1 of 1"),
            "{steps:#?}"
        );
        let translated_source = steps[1]["source"].as_str().unwrap().to_owned();
        if node == 0 {
            assert!(
                translated_source.starts_with(&format!("[{node_ip}]:")) && translated_source != client_end,
                "source NAT to node 0's address and a SNAT port: {steps:#?}"
            );
            assert_eq!(source, IpAddr::V6(node_ip), "web-b saw node 0");
        } else {
            assert_eq!(translated_source, client_end, "a local backend: the client kept, {steps:#?}");
            assert_eq!(source, IpAddr::V6(CLIENT6));
        }
        assert_eq!(steps[2]["source"], web_b, "{steps:#?}");
        assert_eq!(steps[2]["destination"], translated_source, "{steps:#?}");
        assert_eq!(steps[3]["source"], node_port, "un-NATed back to the NodePort: {steps:#?}");
        assert_eq!(steps[3]["destination"], client_end, "{steps:#?}");
    }
}

/// The number of entries in node `node`'s SNAT_V6 map.
fn snat6_entries(cluster: &NorthSouth6, node: usize) -> usize {
    let pin = cluster.pins[node].join("maps").join("snat_v6");
    let data = aya::maps::MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, proxy_common::maps_v6::CtKeyV6, proxy_common::maps_v6::SnatEntryV6> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).unwrap();
    map.keys().filter_map(|k| k.ok()).count()
}

/// Opens a kept-alive HTTP connection from the external client to node 0's NodePort 30082 (web-b,
/// on node 1: source-NATed), asks once, and holds it open: the client's own port, once answered.
fn hold_a_connection_through_node_0(cluster: &NorthSouth6) -> (Spawned, u16) {
    let script = format!(
        "import socket, time\n\
         s = socket.create_connection(('{}', 30082), timeout=5)\n\
         s.sendall(b'GET /whoami HTTP/1.1\\r\\nHost: web\\r\\n\\r\\n')\n\
         assert b' 200 ' in s.recv(4096)\n\
         print(s.getsockname()[1], flush=True)\n\
         time.sleep(120)\n",
        node_ip6(0)
    );
    let client = cluster.multi.external_spawn(["python3", "-c", &script]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(port) = client.log().lines().next().and_then(|l| l.trim().parse().ok()) {
            return (client, port);
        }
        assert!(client.is_running(), "the client failed: {}\n{}", client.log(), cluster.agent_logs());
        assert!(Instant::now() < deadline, "no answer through node 0: {}", client.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `kproxy dump conntrack` row on node 0 of the client's flow from `port`, if there is one.
fn conntrack_row(cluster: &NorthSouth6, port: u16) -> Option<serde_json::Value> {
    let out = cluster.kproxy(0, &["dump", "conntrack", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let original = format!("[{CLIENT6}]:{port} -> [{}]:30082", node_ip6(0));
    rows.into_iter().find(|r| r["original"] == original)
}

/// A source-NATed IPv6 flow as an operator reads and clears it on the node that translated it:
/// `kproxy dump conntrack` shows it leaving from the node's address and a SNAT port, with its
/// reply counted (the reply entry, keyed by that address and port, is paired with it);
/// `kproxy conntrack flush --service` takes it and its two SNAT_V6 translations; and the agent's
/// garbage collection, once a second such flow idles past the established timeout, takes that
/// flow and its translations too, leaving nothing behind in SNAT_V6.
#[test]
fn a_source_nated_v6_flow_is_dumped_from_the_node_address_and_flush_and_gc_take_its_translations() {
    let cluster = NorthSouth6::start_with(
        "ns6-snatct",
        &["--conntrack-tcp-timeout-established", "5s", "--conntrack-gc-interval", "1s"],
    );
    let (client, port) = hold_a_connection_through_node_0(&cluster);
    let row = conntrack_row(&cluster, port).unwrap_or_else(|| panic!("no row for :{port}"));
    let translated = row["translated"].as_str().unwrap();
    let (from, to) = translated.split_once(" -> ").unwrap();
    assert!(from.starts_with(&format!("[{}]:", node_ip6(0))), "source NAT to node 0: {row}");
    assert_ne!(from, format!("[{}]:{port}", node_ip6(0)), "{row}");
    assert_eq!(to, format!("[{WEB_B6}]:80"), "{row}");
    assert!(row["packets_reply"].as_u64().unwrap() >= 1, "the reply entry paired with it: {row}");
    assert_eq!(snat6_entries(&cluster, 0), 2, "the flow's forward and reverse translations");

    let out = cluster.kproxy(0, &["conntrack", "flush", "--service", "default/web6-b"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(conntrack_row(&cluster, port).is_none(), "flushed");
    assert_eq!(snat6_entries(&cluster, 0), 0, "the flush took the translations with the flow");
    client.kill().unwrap();

    let (_idle, port) = hold_a_connection_through_node_0(&cluster);
    assert!(conntrack_row(&cluster, port).is_some());
    assert_eq!(snat6_entries(&cluster, 0), 2);
    let deadline = Instant::now() + Duration::from_secs(45);
    while conntrack_row(&cluster, port).is_some() || snat6_entries(&cluster, 0) != 0 {
        assert!(
            Instant::now() < deadline,
            "the idle flow or its translations outlived the gc: {:?}, {} SNAT_V6 entries\n{}",
            conntrack_row(&cluster, port),
            snat6_entries(&cluster, 0),
            cluster.agent_logs()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A router that sends the IPv6 service range to node 0: the external client is outside
/// `--cluster-cidr`'s IPv6 prefix (fd00:10:244::/56), so both backends of web6's IPv6 cluster IP —
/// web-a on node 0 itself as well as web-b on node 1 — see node 0's address, as kube-proxy's
/// masquerade rule has it, and every request is answered (the local backend's answer is turned
/// back on its veth).
#[test]
fn a_v6_cluster_ip_reached_from_outside_the_cluster_cidr_is_masqueraded_to_local_and_remote_backends() {
    let cluster = NorthSouth6::start("ns6-masq");
    let via = node_ip6(0).to_string();
    cluster.multi.external_exec(["ip", "-6", "route", "add", "fd00:10:96::/112", "via", &via]).unwrap();
    let cluster_ip: Ipv6Addr = "fd00:10:96::60".parse().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let (backend, source) = cluster
            .whoami_at(cluster_ip, 80)
            .unwrap_or_else(|e| panic!("the cluster IP from outside: {e}\n{}", cluster.agent_logs()));
        assert_eq!(source, IpAddr::V6(node_ip6(0)), "backend {backend} saw the client unmasqueraded");
        seen.insert(backend);
    }
    assert_eq!(seen, [IpAddr::V6(WEB_A6), IpAddr::V6(WEB_B6)].into());
    assert!(cluster.stat(0, "snat_reverse") > 0);
}

/// Two LoadBalancer Services with an IPv6 LB IP each (routed to node 0 by the client): web6-ranges
/// lists the client's own IPv6 address in its `loadBalancerSourceRanges`, web6-ranges4 only an IPv4
/// range. `curl -6` from the client reaches both; from a second address of the client, web6-ranges
/// drops it (counted `drop_source_range`) while web6-ranges4 admits it — each family's LB IPs take
/// the ranges of their own family only, as kube-proxy's per-family proxiers do — and a pod outside
/// the ranges is dropped too (kube-proxy filters every source before DNAT).
#[test]
fn ipv6_load_balancer_source_ranges_admit_only_their_ipv6_clients_and_ipv4_ranges_leave_ipv6_open() {
    let cluster = NorthSouth6::start("ns6-ranges");
    let service = |name: &str, v4: &str, v6: &str, lb6: &str, ranges: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: LoadBalancer\n  clusterIP: {v4}\n  clusterIPs: [{v4}, \"{v6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  loadBalancerSourceRanges: [{ranges}]\n  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 80}}]\nstatus:\n  loadBalancer:\n    ingress: [{{ip: \"{lb6}\", ipMode: VIP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-v6\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv6\nendpoints:\n- addresses: [\"{WEB_A6}\"]\n  conditions: {{ready: true}}\n  nodeName: node-0\nports: [{{name: http, port: 80, protocol: TCP}}]\n"
        )
    };
    const RANGED: &str = "fd00:192:168:200::31";
    const OPEN: &str = "fd00:192:168:200::32";
    let yaml = [
        service("web6-ranges", "10.96.0.63", "fd00:10:96::63", RANGED, &format!("\"{CLIENT6}/128\"")),
        service("web6-ranges4", "10.96.0.64", "fd00:10:96::64", OPEN, "192.168.100.200/32"),
    ]
    .join("---\n");
    std::fs::write(cluster._manifest_dir.0.join("web6-ranges.yaml"), yaml).unwrap();
    cluster.wait_for_frontend(0, &format!("[{RANGED}]:80"), 1);
    cluster.wait_for_frontend(0, &format!("[{OPEN}]:80"), 1);
    let other = "fd00:192:168:100::201";
    cluster
        .multi
        .external_exec(["ip", "-6", "addr", "add", &format!("{other}/64"), "dev", "eth0", "nodad"])
        .unwrap();
    let curl = |addr: &str, source: &str| {
        let url = format!("http://[{addr}]/whoami");
        let args = ["curl", "-6", "-sS", "--max-time", "2", "--interface", source, &url];
        let out = cluster.multi.external_exec_output(args).unwrap();
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };

    // Each request names its source: with two addresses on one prefix the kernel may pick either.
    let client = CLIENT6.to_string();
    for lb in [RANGED, OPEN] {
        let page = curl(lb, &client)
            .unwrap_or_else(|| panic!("the client in range, [{lb}]\n{}", cluster.agent_logs()));
        assert!(page.starts_with(&WEB_A6.to_string()), "{page}");
    }
    let before = cluster.stat(0, "drop_source_range");
    assert_eq!(curl(RANGED, other), None, "a client outside web6-ranges' IPv6 range got through");
    assert!(cluster.stat(0, "drop_source_range") > before);
    let page = curl(OPEN, other).expect("an IPv4 range alone leaves the IPv6 LB IP open");
    assert!(page.starts_with(&WEB_A6.to_string()), "{page}");

    // web-b's pod, on node 1 (fd00:10:244:1::11), is outside the range too: dropped on its own node.
    let before = cluster.stat(1, "drop_source_range");
    let from_pod =
        cluster._pods[1].exec(["curl", "-6", "-sS", "--max-time", "2", &format!("http://[{RANGED}]/")]);
    assert!(from_pod.is_err(), "a pod outside loadBalancerSourceRanges got through: {from_pod:?}");
    assert!(cluster.stat(1, "drop_source_range") > before);
}
