//! Zero-disruption migration from kube-proxy (issue 17): connections opened through kube-proxy
//! keep flowing when kproxy takes over and after `kproxy cleanup-kube-proxy --apply` removed
//! kube-proxy's rules.
//!
//! The sandbox is the two-node one of `--test north_south` (`sandbox::multinode`): a client pod
//! on node 0, a backend pod on each node running `tests/src/migration/exchange.py` (TCP and UDP),
//! the external client on the underlay. Each node first gets kube-proxy's own rules for the
//! Services (`sandbox::kube_proxy_rules`, iptables mode or nftables mode). Through them, three
//! exchanges start, each sending data every 100 ms in both directions and recording, at both
//! ends, bytes and sha256 of what it sent and received, the largest gap between two receipts,
//! resets and errors:
//!
//! 1. `clusterip-tcp`: a long-lived TCP connection from the client pod to a ClusterIP with a
//!    backend on each node;
//! 2. `clusterip-udp`: the CoreDNS case, datagrams from one fixed source port to a ClusterIP
//!    (`sendto` on an unconnected socket), each one answered;
//! 3. `nodeport-tcp`: a TCP connection from the external client to node 0's NodePort whose only
//!    backend is on node 1 (kube-proxy DNATs and masquerades it).
//!
//! Steps, each kept running until every exchange has made 3 s of progress at both ends (or a
//! deadline passed: then the figures show the stall): **kube-proxy** (the exchanges' nf_conntrack
//! entries show kube-proxy's DNAT: `[ASSURED]`, reply source a backend), **kproxy loaded** (the
//! agents of `--test north_south`, one per node, attached and programmed; a new TCP connection
//! and a new UDP exchange to the ClusterIPs are translated by kproxy: `kproxy trace` shows their
//! DNAT with the tc datapath, and their nf_conntrack entries show no netfilter NAT), **kube-proxy
//! rules removed** (`kproxy cleanup-kube-proxy --apply` on each node, its output in the log, no
//! translating rule of kube-proxy left). Then the exchanges stop cleanly and the test asserts
//! what their users would see: no reset or error, no gap over 1 s, every byte arrived (counts and
//! checksums equal at both ends, each way), every datagram answered by the backend the flow had,
//! which saw one client address and port throughout. Each step's figures are printed
//! (`--nocapture`): bytes each way, receipts, largest gaps, the exchanges' nf_conntrack entries
//! that netfilter NATed, the kproxy counters that moved.
//!
//! Four tests: iptables-mode or nftables-mode rules × kproxy's tc datapath (the agent's default
//! flags: `--socket-lb host-only` leaves pods to tc) or socket-level load balancing
//! (`--socket-lb on`, hooks on a child cgroup the test creates, the client pod's processes in
//! it). With socket LB a new connection is translated at `connect()`/`sendmsg()`: no packet is
//! NATed, so `kproxy trace` (tc and XDP events only) shows nothing for it; the test asserts that
//! instead, with the socket hooks' counter and `getpeername()`/`recvfrom()` showing the Service.
//!
//! What makes it pass (docs/architecture.md, "Inherited flows"): the agent marks nf_conntrack's
//! DNAT entries in INHERITED_V4 before its first sync, and kproxy's tc programs pass those flows'
//! packets to netfilter untouched (`pass_inherited_flow`) instead of dropping their TCP segments
//! as invalid (`drop_invalid_tcp`: both TCP streams stalled for good at attach) or translating
//! their datagrams anew (the UDP exchange moved to a random backend, or kept it with a source port
//! netfilter remapped); `cleanup-kube-proxy --apply` keeps conntrack and the NAT hooks running
//! (table ip kproxy-inherited-nat) while they are open (without it every inherited connection
//! stopped the moment kube-proxy's rules went).
//!
//! Run: `cargo xtask test -p kproxy-tests --test migration -- --nocapture` (root; one
//! combination: `-- --nocapture iptables_rules_tc`).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sandbox::{
    Pod, Spawned,
    cgroup::ChildCgroup,
    find_tool,
    kube_proxy_rules::{Svc, kube_proxy_iptables, kube_proxy_nftables},
    multinode::MultiNode,
};
use serde_json::Value;

mod common;
use common::cluster::{kproxy_bin, unique_pin_dir};

const EXCHANGE_PY: &str = include_str!("../src/migration/exchange.py");

const CLUSTER_CIDR: &str = "10.244.0.0/16";
const SERVICE_CIDR: &str = "10.96.0.0/12";
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 10);
/// Backend pods: (node, name, address). Each serves TCP on [`STREAM_PORT`], UDP on [`DNS_PORT`].
const BACKENDS: [(usize, &str, Ipv4Addr); 2] =
    [(0, "backend-0", Ipv4Addr::new(10, 244, 0, 11)), (1, "backend-1", Ipv4Addr::new(10, 244, 1, 11))];
const STREAM_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const STREAM_PORT: u16 = 7000;
const DNS_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DNS_PORT: u16 = 53;
const NODE_PORT_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);
const NODE_PORT: u16 = 30700;
/// The UDP exchange's fixed source port (a resolver that keeps its port).
const UDP_SOURCE_PORT: u16 = 40053;
/// Source ports of the connections opened after kproxy loaded, to find their events and entries;
/// the last one is a flow outside the socket hooks' cgroup, the trace's end marker.
const PROBE_TCP_PORT: u16 = 41000;
const PROBE_UDP_PORT: u16 = 41001;
const MARKER_UDP_PORT: u16 = 41002;
/// Where the node sends a ClusterIP nothing translated: a permanent neighbour on the port-less
/// node bridge, so such packets vanish as on a real node's default route (as in the
/// differential test's sandbox), instead of "network unreachable" that no cluster gives.
const DEAD_END_HOP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 254);
const DEAD_END_MAC: &str = "02:00:00:00:00:fe";

/// Receipts (100 ms apart) each end of each exchange makes within a step: 3 s of traffic.
const STEP_RECEIPTS: usize = 30;
/// How long a step waits for that before its figures record a stall.
const STEP_DEADLINE: Duration = Duration::from_secs(10);
const MAX_GAP_S: f64 = 1.0;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rules {
    Iptables,
    Nftables,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Datapath {
    /// The agent's defaults (as `--test north_south` starts it): pods go through tc.
    Tc,
    /// `--socket-lb on`: the client pod's sockets are translated at connect()/sendmsg().
    SocketLb,
}

#[test]
fn iptables_rules_tc_datapath_connections_survive_the_move_to_kproxy() {
    migrate(Rules::Iptables, Datapath::Tc);
}

#[test]
fn iptables_rules_socket_lb_connections_survive_the_move_to_kproxy() {
    migrate(Rules::Iptables, Datapath::SocketLb);
}

#[test]
fn nftables_rules_tc_datapath_connections_survive_the_move_to_kproxy() {
    migrate(Rules::Nftables, Datapath::Tc);
}

#[test]
fn nftables_rules_socket_lb_connections_survive_the_move_to_kproxy() {
    migrate(Rules::Nftables, Datapath::SocketLb);
}

/// One Service port, the source of both kube-proxy's rules and kproxy's manifests.
struct Service {
    namespace: &'static str,
    name: &'static str,
    vip: Ipv4Addr,
    port: u16,
    proto: &'static str,
    port_name: &'static str,
    node_port: Option<u16>,
    /// (node, address) of each endpoint.
    endpoints: Vec<(usize, Ipv4Addr)>,
}

fn services() -> Vec<Service> {
    let both: Vec<(usize, Ipv4Addr)> = BACKENDS.iter().map(|(node, _, ip)| (*node, *ip)).collect();
    vec![
        Service {
            namespace: "default",
            name: "stream",
            vip: STREAM_VIP,
            port: STREAM_PORT,
            proto: "TCP",
            port_name: "stream",
            node_port: None,
            endpoints: both.clone(),
        },
        Service {
            namespace: "kube-system",
            name: "kube-dns",
            vip: DNS_VIP,
            port: DNS_PORT,
            proto: "UDP",
            port_name: "dns",
            node_port: None,
            endpoints: both,
        },
        Service {
            namespace: "default",
            name: "stream-np",
            vip: NODE_PORT_VIP,
            port: STREAM_PORT,
            proto: "TCP",
            port_name: "stream",
            node_port: Some(NODE_PORT),
            endpoints: vec![(BACKENDS[1].0, BACKENDS[1].2)],
        },
    ]
}

fn kube_proxy_svcs(services: &[Service]) -> Vec<Svc> {
    services
        .iter()
        .map(|s| Svc {
            namespace: s.namespace.into(),
            name: s.name.into(),
            vip: s.vip,
            port: s.port,
            proto: s.proto,
            port_name: s.port_name,
            target_port: s.port,
            node_port: s.node_port,
            endpoints: s.endpoints.iter().map(|(_, ip)| *ip).collect(),
            ..Svc::default()
        })
        .collect()
}

fn manifest(s: &Service) -> String {
    let (kind, node_port) = match s.node_port {
        Some(port) => ("NodePort", format!(", nodePort: {port}")),
        None => ("ClusterIP", String::new()),
    };
    let mut endpoints = String::new();
    for (node, ip) in &s.endpoints {
        let _ = write!(
            endpoints,
            "- addresses: [{ip}]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: node-{node}\n"
        );
    }
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}}}
spec:
  type: {kind}
  clusterIP: {vip}
  clusterIPs: [{vip}]
  ports: [{{name: {pn}, port: {port}, protocol: {proto}, targetPort: {port}{node_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: {ns}
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
endpoints:
{endpoints}ports: [{{name: {pn}, port: {port}, protocol: {proto}}}]
",
        name = s.name,
        ns = s.namespace,
        vip = s.vip,
        pn = s.port_name,
        port = s.port,
        proto = s.proto,
    )
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The sandbox, kube-proxy's rules, the backends and (from step 2) the agents. Fields drop in
/// order after `Drop`: pods, the sandbox, then the cgroups (killing what is left in them).
struct World {
    rules: Rules,
    datapath: Datapath,
    agents: Vec<Spawned>,
    pins: Vec<PathBuf>,
    client: Pod,
    backends: Vec<Pod>,
    multi: MultiNode,
    script: PathBuf,
    manifests: PathBuf,
    /// Each agent's `--cgroup-root`; node 0's holds the client pod's processes.
    cgroups: Vec<ChildCgroup>,
}

impl Drop for World {
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

impl World {
    fn build(rules: Rules, datapath: Datapath) -> World {
        sandbox::require_tools(&["python3", "conntrack", "iptables-restore", "iptables-save", "nft"])
            .expect("tools of the migration test");
        let tag = format!(
            "mig-{}-{}",
            if rules == Rules::Iptables { "ipt" } else { "nft" },
            if datapath == Datapath::Tc { "tc" } else { "sock" }
        );
        let multi = MultiNode::new(&tag, 2).expect("building the two-node sandbox (needs root)");
        let work = multi.node(0).dir().join("migration");
        let manifests = work.join("manifests");
        std::fs::create_dir_all(&manifests).unwrap();
        let script = work.join("exchange.py");
        std::fs::write(&script, EXCHANGE_PY).unwrap();
        let cgroups: Vec<ChildCgroup> =
            (0..2).map(|_| ChildCgroup::new("kproxy-migration").expect("a child cgroup")).collect();

        let python = python();
        let mut backends = Vec::new();
        for (node, name, ip) in BACKENDS {
            let pod = multi.add_pod(node, name, ip).unwrap();
            let base = pod.dir().join("exchange");
            let server = pod
                .spawn([
                    python.as_str(),
                    "-u",
                    script.to_str().unwrap(),
                    "server",
                    name,
                    base.to_str().unwrap(),
                    &STREAM_PORT.to_string(),
                    &DNS_PORT.to_string(),
                ])
                .unwrap();
            pod.wait_listening("tcp", STREAM_PORT, Some(&server), Duration::from_secs(10)).unwrap();
            pod.wait_listening("udp", DNS_PORT, Some(&server), Duration::from_secs(10)).unwrap();
            backends.push(pod);
        }
        let client = multi.add_pod(0, "client", CLIENT_IP).unwrap();
        let world = World {
            rules,
            datapath,
            agents: Vec::new(),
            pins: Vec::new(),
            client,
            backends,
            multi,
            script,
            manifests,
            cgroups,
        };
        let services = services();
        for service in &services {
            std::fs::write(world.manifests.join(format!("{}.yaml", service.name)), manifest(service))
                .unwrap();
        }
        for node in 0..2 {
            world.install_kube_proxy(node, &services);
        }
        world
    }

    fn node_exec(&self, node: usize, args: &[&str]) -> String {
        self.multi.node(node).node_exec(args).unwrap_or_else(|e| panic!("node {node}: {args:?}: {e:#}"))
    }

    /// kube-proxy's rules for `services` in node `node`'s namespace, as its proxier writes them,
    /// and the dead-end route for the ServiceCIDR.
    fn install_kube_proxy(&self, node: usize, services: &[Service]) {
        let hop = DEAD_END_HOP.to_string();
        let bridge = sandbox::NODE_DEVICE;
        self.node_exec(
            node,
            &["ip", "neigh", "replace", &hop, "lladdr", DEAD_END_MAC, "dev", bridge, "nud", "permanent"],
        );
        self.node_exec(node, &["ip", "route", "add", SERVICE_CIDR, "via", &hop, "dev", bridge, "onlink"]);
        let svcs = kube_proxy_svcs(services);
        let dir = self.multi.node(node).dir();
        match self.rules {
            Rules::Iptables => {
                let file = dir.join("kube-proxy.iptables");
                std::fs::write(&file, kube_proxy_iptables(&svcs, CLUSTER_CIDR)).unwrap();
                self.node_exec(node, &["iptables-restore", file.to_str().unwrap()]);
                let nat = self.node_exec(node, &["iptables", "-t", "nat", "-S", "KUBE-SERVICES"]);
                assert!(nat.contains(&format!("{STREAM_VIP}/32")), "node {node}: {nat}");
            }
            Rules::Nftables => {
                let file = dir.join("kube-proxy.nft");
                std::fs::write(&file, kube_proxy_nftables(&svcs, CLUSTER_CIDR, SERVICE_CIDR)).unwrap();
                self.node_exec(node, &["nft", "-f", file.to_str().unwrap()]);
                let table = self.node_exec(node, &["nft", "list", "table", "ip", "kube-proxy"]);
                assert!(table.contains("dnat to"), "node {node}: {table}");
            }
        }
    }

    /// What is left of kube-proxy's translating rules in node `node`: its DNAT and masquerade
    /// rules and the chains or maps that dispatch Services to them.
    fn kube_proxy_leftovers(&self, node: usize) -> Vec<String> {
        let (ruleset, marks): (String, &[&str]) = match self.rules {
            Rules::Iptables => (
                self.node_exec(node, &["iptables-save"]),
                &[
                    "-j DNAT",
                    "MASQUERADE",
                    "KUBE-SERVICES",
                    "KUBE-NODEPORTS",
                    "KUBE-SVC-",
                    "KUBE-SEP-",
                    "KUBE-EXT-",
                ],
            ),
            Rules::Nftables => (
                self.node_exec(node, &["nft", "list", "ruleset"]),
                &["dnat to", "masquerade", "service-ips", "service-nodeports"],
            ),
        };
        ruleset.lines().filter(|l| marks.iter().any(|m| l.contains(m))).map(|l| l.trim().to_owned()).collect()
    }

    /// The client pod's processes run in node 0's agent cgroup (its socket hooks' root).
    fn client_command(&self, args: &[&str]) -> Command {
        self.cgroups[0].command(self.client.netns(), args)
    }

    fn start_agents(&mut self) {
        for node in 0..2 {
            let pin_dir = unique_pin_dir();
            let mut args: Vec<String> = vec![
                kproxy_bin().display().to_string(),
                "--pin-dir".into(),
                pin_dir.display().to_string(),
                "agent".into(),
                "--manifests".into(),
                self.manifests.display().to_string(),
                "--interfaces".into(),
                "veth*".into(),
                "--external-interfaces".into(),
                "eth0".into(),
                "--cluster-cidr".into(),
                CLUSTER_CIDR.into(),
                "--hostname-override".into(),
                format!("node-{node}"),
                "--poll-ms".into(),
                "100".into(),
                "--cgroup-root".into(),
                self.cgroups[node].path().display().to_string(),
            ];
            if self.datapath == Datapath::SocketLb {
                // tc stays on every pod veth (what these tests wait for and what `--socket-lb on`
                // meant before --pod-veth-tc): the move under `auto` is not covered here.
                args.extend(["--socket-lb".into(), "on".into(), "--pod-veth-tc".into(), "on".into()]);
            }
            self.agents.push(self.multi.node(node).node_spawn(&args).unwrap());
            self.pins.push(pin_dir);
        }
    }

    fn kproxy(&self, node: usize, args: &[&str]) -> std::process::Output {
        let bin = kproxy_bin();
        let pins = self.pins[node].display().to_string();
        let mut full = vec![bin.to_str().unwrap(), "--pin-dir", &pins];
        full.extend(args);
        self.multi.node(node).node_exec_output(&full).unwrap()
    }

    fn agent_logs(&self) -> String {
        self.agents.iter().enumerate().map(|(i, a)| format!("--- agent of node {i}\n{}", a.log())).collect()
    }

    /// Every node's agent has attached (pod veths, eth0 with XDP, the socket hooks when on) and
    /// programmed every Service.
    fn wait_for_agents(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        for node in 0..2 {
            let node_ip = self.multi.node_ip(node);
            let expected = [
                (format!("{STREAM_VIP}:{STREAM_PORT}"), "TCP", 2),
                (format!("{DNS_VIP}:{DNS_PORT}"), "UDP", 2),
                (format!("{node_ip}:{NODE_PORT}"), "TCP", 1),
            ];
            let veths: Vec<&str> = std::iter::once(&self.client)
                .chain(&self.backends)
                .filter(|p| self.multi.node(node).name() == node_of(&self.multi, p))
                .map(Pod::host_veth)
                .collect();
            loop {
                let out = self.kproxy(node, &["dump", "services", "--json"]);
                let rows: Vec<Value> = serde_json::from_slice::<Value>(&out.stdout)
                    .ok()
                    .and_then(|v| v.as_array().cloned())
                    .unwrap_or_default();
                let programmed = expected.iter().all(|(frontend, proto, count)| {
                    rows.iter().any(|r| {
                        r["frontend"] == *frontend
                            && r["protocol"] == *proto
                            && r["slot"] == 0
                            && r["count"] == *count
                    })
                });
                let links: Vec<String> = std::fs::read_dir(self.pins[node].join("links"))
                    .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                    .unwrap_or_default();
                let attached = |veth: &str, hook: &str| {
                    links
                        .iter()
                        .any(|l| l.starts_with(&format!("{veth}@")) && l.ends_with(&format!("-{hook}")))
                };
                let veths_attached = veths.iter().all(|v| attached(v, "ingress") && attached(v, "egress"));
                let link = self.node_exec(node, &["ip", "link", "show", "eth0"]);
                let socket_lb = self.datapath == Datapath::Tc
                    || self.agents[node].log().contains("socket-level load balancing on");
                if programmed && veths_attached && link.contains("prog/xdp") && socket_lb {
                    break;
                }
                assert!(
                    self.agents[node].is_running(),
                    "agent of node {node} exited:\n{}",
                    self.agent_logs()
                );
                assert!(
                    Instant::now() < deadline,
                    "node {node}: programmed {programmed}, pod veths attached {veths_attached} \
                     ({veths:?} in {links:?}), XDP on eth0 {}, socket hooks {socket_lb}\n{}",
                    link.contains("prog/xdp"),
                    self.agent_logs()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// kproxy's datapath counters of node `node` (empty before the agents run).
    fn stats(&self, node: usize) -> BTreeMap<String, u64> {
        if self.pins.len() <= node {
            return BTreeMap::new();
        }
        let out = self.kproxy(node, &["dump", "stats", "--json"]);
        let rows: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        rows.as_array()
            .map(|rows| {
                rows.iter()
                    .filter_map(|r| Some((r["reason"].as_str()?.to_owned(), r["packets"].as_u64()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn conntrack(&self, node: usize) -> Vec<CtEntry> {
        let out = self.node_exec(node, &["conntrack", "-L"]);
        out.lines().filter_map(CtEntry::parse).collect()
    }
}

/// The node sandbox a pod belongs to, by its namespace name (`<node name>-p-<pod>`).
fn node_of<'a>(multi: &'a MultiNode, pod: &Pod) -> &'a str {
    multi
        .nodes()
        .iter()
        .map(|n| n.name())
        .find(|name| pod.netns().starts_with(&format!("{name}-p-")))
        .expect("the pod belongs to a node")
}

fn python() -> String {
    find_tool("python3").expect("python3").display().to_string()
}

/// One nf_conntrack entry as `conntrack -L` prints it.
#[derive(Clone, Debug)]
struct CtEntry {
    /// (src, dst, sport, dport) of the original direction, then of the reply.
    orig: (Ipv4Addr, Ipv4Addr, u16, u16),
    reply: (Ipv4Addr, Ipv4Addr, u16, u16),
    assured: bool,
    line: String,
}

impl CtEntry {
    fn parse(line: &str) -> Option<CtEntry> {
        let values = |key: &str| -> Vec<&str> {
            line.split_whitespace().filter_map(|f| f.strip_prefix(key)).collect()
        };
        let (src, dst, sport, dport) = (values("src="), values("dst="), values("sport="), values("dport="));
        if src.len() < 2 || dst.len() < 2 || sport.len() < 2 || dport.len() < 2 {
            return None;
        }
        let tuple = |i: usize| -> Option<(Ipv4Addr, Ipv4Addr, u16, u16)> {
            Some((src[i].parse().ok()?, dst[i].parse().ok()?, sport[i].parse().ok()?, dport[i].parse().ok()?))
        };
        Some(CtEntry {
            orig: tuple(0)?,
            reply: tuple(1)?,
            assured: line.contains("[ASSURED]"),
            line: line.trim().to_owned(),
        })
    }

    /// netfilter translated this flow (DNAT: the reply comes from elsewhere; SNAT: it goes to
    /// elsewhere).
    fn natted(&self) -> bool {
        self.reply.0 != self.orig.1
            || self.reply.2 != self.orig.3
            || self.reply.1 != self.orig.0
            || self.reply.3 != self.orig.2
    }

    fn from(&self, ip: Ipv4Addr, port: u16) -> bool {
        self.orig.0 == ip && self.orig.2 == port
    }
}

/// One line of an end's `events.log`.
#[derive(Clone, Copy, Debug)]
struct Event {
    t: f64,
    receipt: bool,
    rx: u64,
    tx: u64,
}

fn read_events(dir: &Path) -> Vec<Event> {
    let text = std::fs::read_to_string(dir.join("events.log")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let t = f.next()?.parse().ok()?;
            let receipt = f.next()? == "rx";
            Some(Event { t, receipt, rx: f.next()?.parse().ok()?, tx: f.next()?.parse().ok()? })
        })
        .collect()
}

fn read_status(dir: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join("status.json")).ok()?).ok()
}

/// One end's figures over a time window.
#[derive(Default, Debug)]
struct Window {
    receipts: usize,
    rx: u64,
    tx: u64,
    max_gap: f64,
}

/// Figures over `[from, to]` of the ends whose logs are `logs` together (a UDP exchange's
/// datagrams may reach more than one backend).
fn window(logs: &[Vec<Event>], from: f64, to: f64) -> Window {
    let totals_at =
        |log: &[Event], t: f64| log.iter().take_while(|e| e.t <= t).last().map_or((0, 0), |e| (e.rx, e.tx));
    let mut w = Window::default();
    let mut times: Vec<f64> = Vec::new();
    for log in logs {
        let (rx0, tx0) = totals_at(log, from);
        let (rx1, tx1) = totals_at(log, to);
        w.rx += rx1 - rx0;
        w.tx += tx1 - tx0;
        times.extend(log.iter().filter(|e| e.receipt && e.t <= to).map(|e| e.t));
    }
    times.sort_by(f64::total_cmp);
    w.receipts = times.iter().filter(|t| **t > from).count();
    // Gaps between successive receipts that reach into the window, and the one still open at
    // its end (a stall); the time before the first receipt is not a gap.
    let mut previous = times.iter().copied().rfind(|t| *t <= from);
    for t in times.iter().copied().filter(|t| *t > from) {
        if let Some(p) = previous {
            w.max_gap = w.max_gap.max(t - p);
        }
        previous = Some(t);
    }
    if let Some(p) = previous {
        w.max_gap = w.max_gap.max(to - p);
    }
    w
}

/// One of the three long-lived exchanges.
struct Exchange {
    name: &'static str,
    what: String,
    tcp: bool,
    client_dir: PathBuf,
    /// Each backend and where it records this exchange (only those it reached exist).
    server_dirs: Vec<(&'static str, PathBuf)>,
    process: Spawned,
    client_ip: Ipv4Addr,
    /// The frontend the client talks to and the backends behind it.
    frontend: (Ipv4Addr, u16),
    backends: Vec<Ipv4Addr>,
}

impl Exchange {
    fn client_log(&self) -> Vec<Event> {
        read_events(&self.client_dir)
    }

    fn server_logs(&self) -> Vec<Vec<Event>> {
        self.server_dirs.iter().filter(|(_, d)| d.exists()).map(|(_, d)| read_events(d)).collect()
    }

    fn client_status(&self) -> Option<Value> {
        read_status(&self.client_dir)
    }

    /// The client's address and source port, once its socket has one (a UDP socket bound to
    /// 0.0.0.0 reports only the port).
    fn local(&self) -> Option<(Ipv4Addr, u16)> {
        let status = self.client_status()?;
        let (_, port) = status["local"].as_str()?.rsplit_once(':')?;
        Some((self.client_ip, port.parse().ok()?))
    }
}

fn start_exchanges(world: &World) -> Vec<Exchange> {
    let python = python();
    let script = world.script.to_str().unwrap();
    let server_dirs = |name: &str| -> Vec<(&'static str, PathBuf)> {
        BACKENDS
            .iter()
            .zip(&world.backends)
            .map(|(b, pod)| (b.1, pod.dir().join("exchange").join(name)))
            .collect()
    };
    let mut exchanges = Vec::new();

    let dir = world.client.dir().join("clusterip-tcp");
    let args = [
        &python,
        "-u",
        script,
        "tcp-client",
        "clusterip-tcp",
        dir.to_str().unwrap(),
        &STREAM_VIP.to_string(),
        &STREAM_PORT.to_string(),
    ];
    let process = world.client.spawn_command(world.client_command(&args)).unwrap();
    exchanges.push(Exchange {
        name: "clusterip-tcp",
        what: format!("client pod → {STREAM_VIP}:{STREAM_PORT} (ClusterIP, TCP, a backend on each node)"),
        tcp: true,
        client_dir: dir,
        server_dirs: server_dirs("clusterip-tcp"),
        process,
        client_ip: CLIENT_IP,
        frontend: (STREAM_VIP, STREAM_PORT),
        backends: BACKENDS.iter().map(|b| b.2).collect(),
    });

    let dir = world.client.dir().join("clusterip-udp");
    let args = [
        &python,
        "-u",
        script,
        "udp-client",
        "clusterip-udp",
        dir.to_str().unwrap(),
        &DNS_VIP.to_string(),
        &DNS_PORT.to_string(),
        &UDP_SOURCE_PORT.to_string(),
    ];
    let process = world.client.spawn_command(world.client_command(&args)).unwrap();
    exchanges.push(Exchange {
        name: "clusterip-udp",
        what: format!(
            "client pod :{UDP_SOURCE_PORT} → {DNS_VIP}:{DNS_PORT} (ClusterIP, UDP, fixed source port)"
        ),
        tcp: false,
        client_dir: dir,
        server_dirs: server_dirs("clusterip-udp"),
        process,
        client_ip: CLIENT_IP,
        frontend: (DNS_VIP, DNS_PORT),
        backends: BACKENDS.iter().map(|b| b.2).collect(),
    });

    let node0 = world.multi.node_ip(0);
    let dir = world.multi.node(0).dir().join("external-client").join("nodeport-tcp");
    std::fs::create_dir_all(&dir).unwrap();
    let process = world
        .multi
        .external_spawn([
            python.as_str(),
            "-u",
            script,
            "tcp-client",
            "nodeport-tcp",
            dir.to_str().unwrap(),
            &node0.to_string(),
            &NODE_PORT.to_string(),
        ])
        .unwrap();
    exchanges.push(Exchange {
        name: "nodeport-tcp",
        what: format!(
            "external client → {node0}:{NODE_PORT} (NodePort of node 0, TCP, its backend on node 1: masqueraded)"
        ),
        tcp: true,
        client_dir: dir,
        server_dirs: server_dirs("nodeport-tcp"),
        process,
        client_ip: world.multi.external_ip(),
        frontend: (node0, NODE_PORT),
        backends: vec![BACKENDS[1].2],
    });
    exchanges
}

/// A step's figures, printed and kept for the final report.
struct StepFigures {
    name: String,
    seconds: f64,
    /// Per exchange: (client's window, backends' window).
    ends: Vec<(Window, Window)>,
    /// nf_conntrack entries of the exchanges that netfilter NATed, per node.
    legacy_entries: Vec<Vec<CtEntry>>,
    /// kproxy counters that moved during the step, per node.
    stats_moved: Vec<BTreeMap<String, u64>>,
    progressed: bool,
}

impl StepFigures {
    fn render(&self, exchanges: &[Exchange]) -> String {
        let mut out = format!(
            "step \"{}\" ({:.1} s): nf_conntrack entries NATed by netfilter for the exchanges: node-0 {}, node-1 {}{}\n",
            self.name,
            self.seconds,
            self.legacy_entries[0].len(),
            self.legacy_entries[1].len(),
            if self.progressed { "" } else { "; NOT every exchange made progress at both ends" }
        );
        for (node, entries) in self.legacy_entries.iter().enumerate() {
            for entry in entries {
                let _ = writeln!(out, "    node-{node}: {}", entry.line);
            }
        }
        for (exchange, (client, server)) in exchanges.iter().zip(&self.ends) {
            let _ = writeln!(
                out,
                "  {:<14} client→backend {:>6} B sent, {:>6} B arrived; backend→client {:>6} B sent, {:>6} B arrived; \
                 receipts {:>3} at client, {:>3} at backend; max gap {:.2} s at client, {:.2} s at backend",
                exchange.name,
                client.tx,
                server.rx,
                server.tx,
                client.rx,
                client.receipts,
                server.receipts,
                client.max_gap,
                server.max_gap
            );
        }
        for (node, moved) in self.stats_moved.iter().enumerate() {
            if !moved.is_empty() {
                let list: Vec<String> = moved.iter().map(|(k, v)| format!("{k} +{v}")).collect();
                let _ = writeln!(out, "  kproxy counters of node-{node}: {}", list.join(", "));
            }
        }
        out
    }
}

/// The exchanges' entries that netfilter NATed, in node `node`.
fn legacy_entries(world: &World, exchanges: &[Exchange], node: usize) -> Vec<CtEntry> {
    let locals: Vec<(Ipv4Addr, u16)> = exchanges.iter().filter_map(Exchange::local).collect();
    world
        .conntrack(node)
        .into_iter()
        .filter(|e| e.natted() && locals.iter().any(|(ip, port)| e.from(*ip, *port)))
        .collect()
}

/// Runs one step: `action`, then the exchanges until each end made [`STEP_RECEIPTS`] receipts
/// (or [`STEP_DEADLINE`] passed); returns its figures.
fn step(world: &World, exchanges: &[Exchange], name: &str, action: impl FnOnce()) -> StepFigures {
    let stats_before: Vec<BTreeMap<String, u64>> = (0..2).map(|n| world.stats(n)).collect();
    let from = now_s();
    action();
    let after_action = now_s();
    let deadline = Instant::now() + STEP_DEADLINE;
    let progressed = loop {
        let all = exchanges.iter().all(|x| {
            window(&[x.client_log()], after_action, now_s()).receipts >= STEP_RECEIPTS
                && window(&x.server_logs(), after_action, now_s()).receipts >= STEP_RECEIPTS
        });
        if all {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let to = now_s();
    let ends = exchanges
        .iter()
        .map(|x| (window(&[x.client_log()], from, to), window(&x.server_logs(), from, to)))
        .collect();
    let legacy = (0..2).map(|n| legacy_entries(world, exchanges, n)).collect();
    let stats_moved = (0..2)
        .map(|n| {
            let before = &stats_before[n];
            world
                .stats(n)
                .into_iter()
                .filter_map(|(k, v)| {
                    let moved = v.saturating_sub(before.get(&k).copied().unwrap_or(0));
                    (moved > 0).then_some((k, moved))
                })
                .collect()
        })
        .collect();
    let figures = StepFigures {
        name: name.to_owned(),
        seconds: to - from,
        ends,
        legacy_entries: legacy,
        stats_moved,
        progressed,
    };
    eprint!("{}", figures.render(exchanges));
    figures
}

/// Step 1's check: each exchange goes through kube-proxy — node 0 has its nf_conntrack entry,
/// `[ASSURED]`, DNATed to one of the frontend's backends (and the NodePort one masqueraded).
fn wait_for_kube_proxy_entries(world: &World, exchanges: &[Exchange]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let entries = world.conntrack(0);
        let missing: Vec<&str> = exchanges
            .iter()
            .filter(|x| {
                let Some((ip, port)) = x.local() else { return true };
                !entries.iter().any(|e| {
                    e.from(ip, port)
                        && (e.orig.1, e.orig.3) == x.frontend
                        && x.backends.contains(&e.reply.0)
                        && e.assured
                        && (x.name != "nodeport-tcp" || e.reply.1 == world.multi.node_ip(0))
                })
            })
            .map(|x| x.name)
            .collect();
        if missing.is_empty() {
            for x in exchanges {
                let (ip, port) = x.local().unwrap();
                let entry = entries.iter().find(|e| e.from(ip, port) && e.natted()).unwrap();
                eprintln!("  {} through kube-proxy: {}", x.name, entry.line);
            }
            return;
        }
        let lines: Vec<&str> = entries.iter().map(|e| e.line.as_str()).collect();
        assert!(
            Instant::now() < deadline,
            "no kube-proxy DNAT entry ([ASSURED], reply from a backend) on node 0 for {missing:?}:\n{}",
            lines.join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// New connections after kproxy loaded (kube-proxy's rules still in place): a TCP connection and
/// a UDP exchange from the client pod to the ClusterIPs, watched by `kproxy trace` on node 0.
/// Returns what failed.
fn check_new_connections(world: &World) -> Vec<String> {
    let mut failures = Vec::new();
    let (bin, pins) = (kproxy_bin(), world.pins[0].display().to_string());
    let trace = world
        .multi
        .node(0)
        .node_spawn([
            bin.to_str().unwrap(),
            "--pin-dir",
            &pins,
            "trace",
            "--client",
            &CLIENT_IP.to_string(),
            "--timeout",
            "60",
            "--json",
        ])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !trace.log().contains("tracing NAT events") {
        assert!(trace.is_running(), "trace exited: {}", trace.log());
        assert!(Instant::now() < deadline, "trace did not start: {}", trace.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let translated_before = world.stats(0).get("socket_lb_translated").copied().unwrap_or(0);
    let python = python();
    let script = world.script.to_str().unwrap();
    let probe = |name: &str, args: Vec<String>, in_cgroup: bool| -> (PathBuf, Option<Value>) {
        let dir = world.client.dir().join(name);
        let mut full = vec![python.clone(), "-u".into(), script.into()];
        full.push(args[0].clone());
        full.push(name.into());
        full.push(dir.display().to_string());
        full.extend(args[1..].iter().cloned());
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        let process = if in_cgroup {
            world.client.spawn_command(world.client_command(&full)).unwrap()
        } else {
            world.client.spawn(&full).unwrap()
        };
        if process.wait_timeout(Duration::from_secs(15)).unwrap().is_none() {
            std::fs::write(dir.join("stop"), "").unwrap();
            let _ = process.wait_timeout(Duration::from_secs(10));
        }
        (dir.clone(), read_status(&dir))
    };
    let port = |p: u16| p.to_string();
    let (_, tcp) = probe(
        "probe-tcp",
        vec![
            "tcp-client".into(),
            STREAM_VIP.to_string(),
            port(STREAM_PORT),
            port(PROBE_TCP_PORT),
            "5".into(),
        ],
        true,
    );
    let (_, udp) = probe(
        "probe-udp",
        vec!["udp-client".into(), DNS_VIP.to_string(), port(DNS_PORT), port(PROBE_UDP_PORT), "3".into()],
        true,
    );
    // Outside the socket hooks' cgroup, so tc translates it whatever the mode: once its events
    // are read, every earlier event has been.
    let (_, marker) = probe(
        "probe-marker",
        vec!["udp-client".into(), DNS_VIP.to_string(), port(DNS_PORT), port(MARKER_UDP_PORT), "1".into()],
        false,
    );
    for (name, status) in [("TCP", &tcp), ("UDP", &udp), ("marker UDP", &marker)] {
        match status {
            Some(s) if s["done"] == true && s["errors"].as_array().is_some_and(Vec::is_empty) => {}
            other => failures.push(format!("the new {name} exchange after kproxy loaded failed: {other:?}")),
        }
    }
    if let Some(tcp) = &tcp
        && tcp["peer"] != format!("{STREAM_VIP}:{STREAM_PORT}")
    {
        failures.push(format!("the new TCP connection's getpeername() is {}, not the Service", tcp["peer"]));
    }
    let client = |p: u16| format!("{CLIENT_IP}:{p}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let steps: Vec<Value> = loop {
        let steps: Vec<Value> = trace
            .log()
            .lines()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if steps.iter().any(|s| s["step"] == "un-NAT" && s["destination"] == client(MARKER_UDP_PORT)) {
            break steps;
        }
        if Instant::now() >= deadline {
            failures.push(format!(
                "kproxy trace never showed the marker flow (tc, outside the cgroup):\n{}",
                trace.log()
            ));
            break steps;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = trace.terminate(Duration::from_secs(5));
    // Each DNAT event prints a pre-DNAT step and its post-DNAT step.
    let dnat_of = |source: &str| -> Vec<(String, String, String)> {
        steps
            .windows(2)
            .filter(|w| w[0]["step"] == "pre-DNAT" && w[1]["step"] == "post-DNAT" && w[0]["source"] == source)
            .map(|w| {
                (
                    w[0]["destination"].as_str().unwrap_or("").to_owned(),
                    w[1]["destination"].as_str().unwrap_or("").to_owned(),
                    w[1]["note"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    };
    for (what, port, vip, service_port) in
        [("TCP", PROBE_TCP_PORT, STREAM_VIP, STREAM_PORT), ("UDP", PROBE_UDP_PORT, DNS_VIP, DNS_PORT)]
    {
        let events = dnat_of(&client(port));
        eprintln!(
            "  kproxy trace of the new {what} flow from :{port}: {} DNAT events, first {:?}",
            events.len(),
            events.first()
        );
        match world.datapath {
            Datapath::Tc => {
                let translated = events.iter().any(|(before, after, note)| {
                    *before == format!("{vip}:{service_port}")
                        && BACKENDS.iter().any(|b| *after == format!("{}:{service_port}", b.2))
                        && note.contains("new flow")
                });
                if !translated {
                    failures.push(format!(
                        "kproxy trace shows no DNAT of the new {what} flow {} → {vip}:{service_port} to a backend: {events:?}",
                        client(port)
                    ));
                }
            }
            // Translated at connect()/sendmsg(): the packets already carry the backend, tc
            // has nothing to translate and the trace nothing to show.
            Datapath::SocketLb => {
                if !events.is_empty() {
                    failures
                        .push(format!("with socket LB, tc translated the new {what} flow again: {events:?}"));
                }
            }
        }
    }
    if world.datapath == Datapath::SocketLb {
        let translated = world.stats(0).get("socket_lb_translated").copied().unwrap_or(0) - translated_before;
        eprintln!("  socket hooks: socket_lb_translated +{translated}");
        if translated < 2 {
            failures
                .push(format!("the socket hooks translated {translated} calls of the new flows, not ≥ 2"));
        }
    }
    // Neither was NATed by netfilter, although kube-proxy's rules were still there: kproxy sent
    // them to a backend before netfilter saw them.
    let entries = world.conntrack(0);
    for (what, port) in [("TCP", PROBE_TCP_PORT), ("UDP", PROBE_UDP_PORT)] {
        let mine: Vec<&CtEntry> = entries.iter().filter(|e| e.from(CLIENT_IP, port)).collect();
        let lines: Vec<&str> = mine.iter().map(|e| e.line.as_str()).collect();
        eprintln!("  nf_conntrack of the new {what} flow: {lines:?}");
        let by_kproxy =
            !mine.is_empty() && mine.iter().all(|e| !e.natted() && BACKENDS.iter().any(|b| b.2 == e.orig.1));
        if !by_kproxy {
            failures.push(format!(
                "the new {what} flow's nf_conntrack entries are not those of a flow kproxy sent to a backend: {lines:?}"
            ));
        }
    }
    failures
}

/// Stops the exchanges (each client shuts its side and waits for the backend's end of stream, or
/// for the answers in flight) and checks what each end observed over the whole run.
fn stop_and_check(exchanges: &[Exchange]) -> (Vec<String>, String) {
    let stopped_at = now_s();
    for x in exchanges {
        std::fs::write(x.client_dir.join("stop"), "").unwrap();
    }
    for x in exchanges {
        if x.process.wait_timeout(Duration::from_secs(15)).unwrap().is_none() {
            let _ = x.process.kill();
        }
    }
    // A TCP backend is done once it has seen the client's end of stream and sent its own.
    let deadline = Instant::now() + Duration::from_secs(5);
    while exchanges
        .iter()
        .filter(|x| x.tcp)
        .any(|x| x.server_dirs.iter().filter_map(|(_, d)| read_status(d)).any(|s| s["done"] != true))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut failures = Vec::new();
    let mut report = String::new();
    for x in exchanges {
        let client = x.client_status().unwrap_or(Value::Null);
        let servers: Vec<(&str, Value)> =
            x.server_dirs.iter().filter_map(|(b, d)| read_status(d).map(|s| (*b, s))).collect();
        let u = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
        let gap = |v: &Value| {
            // An end that did not finish still has the gap from its last receipt to the stop.
            let open =
                if v["done"] == true { 0.0 } else { v["last_rx"].as_f64().map_or(0.0, |t| stopped_at - t) };
            v["max_gap"].as_f64().unwrap_or(f64::INFINITY).max(open)
        };
        let (server_rx, server_tx): (u64, u64) =
            servers.iter().fold((0, 0), |(rx, tx), (_, s)| (rx + u(s, "rx"), tx + u(s, "tx")));
        let backends: Vec<&str> = servers.iter().map(|(b, _)| *b).collect();
        let _ = writeln!(
            report,
            "{}: {}\n  client: sent {} B, received {} B, max gap {:.2} s, errors {}, done {}{}\n  backend{} {:?}: received {} B, sent {} B, max gap {}, errors {}, client seen as {}",
            x.name,
            x.what,
            u(&client, "tx"),
            u(&client, "rx"),
            gap(&client),
            client["errors"],
            client["done"],
            if x.tcp {
                String::new()
            } else {
                format!(
                    ", unanswered {}, answers from {} ({})",
                    client["unanswered"], client["backends"], client["sources"]
                )
            },
            if servers.len() == 1 { "" } else { "s" },
            backends,
            server_rx,
            server_tx,
            servers.iter().map(|(_, s)| format!("{:.2} s", gap(s))).collect::<Vec<_>>().join(" / "),
            servers.iter().map(|(_, s)| s["errors"].to_string()).collect::<Vec<_>>().join(" / "),
            servers
                .iter()
                .map(|(_, s)| if x.tcp { s["peer"].to_string() } else { s["peers"].to_string() })
                .collect::<Vec<_>>()
                .join(" / "),
        );
        let mut fail = |what: String| failures.push(format!("{}: {what}", x.name));
        if client["done"] != true {
            fail("the client did not end cleanly".into());
        }
        if client["errors"].as_array().is_none_or(|e| !e.is_empty()) {
            fail(format!("the client saw {}", client["errors"]));
        }
        if gap(&client) > MAX_GAP_S {
            fail(format!("the client waited {:.2} s between two receipts", gap(&client)));
        }
        for (dir, s) in &servers {
            if s["errors"].as_array().is_none_or(|e| !e.is_empty()) {
                fail(format!("{dir} saw {}", s["errors"]));
            }
            if x.tcp && s["done"] != true {
                fail(format!("{dir} did not end cleanly"));
            }
            if gap(s) > MAX_GAP_S {
                fail(format!("{dir} waited {:.2} s between two receipts", gap(s)));
            }
        }
        if servers.len() != 1 {
            fail(format!(
                "its data reached {} backends {backends:?}, not the one the flow had",
                servers.len()
            ));
        } else {
            let s = &servers[0].1;
            if u(&client, "tx") != u(s, "rx") || client["tx_sha256"] != s["rx_sha256"] {
                fail(format!(
                    "client→backend: {} B sent, {} B arrived, checksums {}",
                    u(&client, "tx"),
                    u(s, "rx"),
                    if client["tx_sha256"] == s["rx_sha256"] { "equal" } else { "differ" }
                ));
            }
            if u(&client, "rx") != u(s, "tx") || client["rx_sha256"] != s["tx_sha256"] {
                fail(format!(
                    "backend→client: {} B sent, {} B arrived, checksums {}",
                    u(s, "tx"),
                    u(&client, "rx"),
                    if client["rx_sha256"] == s["tx_sha256"] { "equal" } else { "differ" }
                ));
            }
        }
        if !x.tcp {
            if client["unanswered"] != 0 {
                fail(format!("{} datagrams were not answered", client["unanswered"]));
            }
            for (backend, s) in &servers {
                if s["peers"].as_array().is_none_or(|p| p.len() != 1) {
                    fail(format!(
                        "{backend} saw the client from {} (a UDP server's client is its address and port)",
                        s["peers"]
                    ));
                }
            }
        }
    }
    (failures, report)
}

/// Once the inherited connections have ended, the agent says so and a second
/// `cleanup-kube-proxy --apply` removes the table that kept netfilter translating them. The TCP
/// exchanges closed (their entries are in TIME_WAIT: over); the UDP one's entry would expire
/// after nf_conntrack's 120 s UDP stream timeout, which the test does not wait for: it deletes it
/// as the expiry would.
fn keeper_goes_once_inherited_connections_end(world: &World) -> Vec<String> {
    let mut failures = Vec::new();
    let node = world.multi.node(0);
    let port = UDP_SOURCE_PORT.to_string();
    let deleted = node.node_exec_output(["conntrack", "-D", "-p", "udp", "--orig-port-src", port.as_str()]);
    eprintln!(
        "  node-0: the UDP exchange's nf_conntrack entry deleted (its expiry): {:?}",
        deleted.map(|o| o.status)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !world.agent_logs().contains("every connection inherited from netfilter has ended") {
        if Instant::now() > deadline {
            failures.push("the agent did not log that every inherited connection has ended".to_owned());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = world.kproxy(0, &["cleanup-kube-proxy", "--apply"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("  node-0: kproxy cleanup-kube-proxy --apply, again:\n{text}");
    if !text
        .contains("deleted table ip kproxy-inherited-nat: no connection opened through kube-proxy is left")
    {
        failures.push(format!("the second cleanup did not remove table ip kproxy-inherited-nat:\n{text}"));
    }
    let tables = node.node_exec(["nft", "list", "tables"]).unwrap_or_default();
    if tables.contains("kproxy-inherited-nat") {
        failures.push(format!("table ip kproxy-inherited-nat is still there: {tables}"));
    }
    failures
}

fn migrate(rules: Rules, datapath: Datapath) {
    let mut world = World::build(rules, datapath);
    eprintln!("migration test: kube-proxy {rules:?} rules, kproxy {datapath:?}");
    let exchanges = start_exchanges(&world);
    let mut failures = Vec::new();
    let mut steps = Vec::new();

    steps.push(step(&world, &exchanges, "through kube-proxy", || {
        wait_for_kube_proxy_entries(&world, &exchanges)
    }));
    assert!(
        steps[0].progressed,
        "the exchanges do not run through kube-proxy's rules: {}",
        steps[0].render(&exchanges)
    );

    world.start_agents();
    let world = world;
    steps.push(step(&world, &exchanges, "kproxy loaded", || {
        world.wait_for_agents();
        failures.extend(check_new_connections(&world));
    }));

    steps.push(step(&world, &exchanges, "kube-proxy rules removed", || {
        for node in 0..2 {
            let out = world.kproxy(node, &["cleanup-kube-proxy", "--apply"]);
            eprintln!(
                "  node-{node}: kproxy cleanup-kube-proxy --apply ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "cleanup-kube-proxy --apply failed on node {node}");
            let left = world.kube_proxy_leftovers(node);
            assert!(left.is_empty(), "node {node}: kube-proxy's rules left after cleanup: {left:#?}");
            if node == 0 {
                // The three exchanges are node 0's: what keeps netfilter translating them is said.
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(
                    text.contains("kept netfilter's connection tracking and NAT hooks")
                        && text.contains("connections opened through kube-proxy still open: 3"),
                    "cleanup does not say it kept netfilter running for the 3 open connections:\n{text}"
                );
                let doctor = world.kproxy(0, &["doctor"]);
                let doctor = String::from_utf8_lossy(&doctor.stdout).into_owned();
                let inherited = doctor
                    .lines()
                    .find(|l| l.split_whitespace().nth(1) == Some("inherited"))
                    .unwrap_or_default()
                    .to_owned();
                eprintln!("  node-0: kproxy doctor: {inherited}");
                assert!(
                    inherited.contains("OK")
                        && inherited.contains("3 connection(s) opened through kube-proxy"),
                    "doctor's inherited line:\n{doctor}"
                );
            }
        }
    }));

    for (i, s) in steps.iter().enumerate() {
        if !s.progressed {
            failures.push(format!("step {} \"{}\": an exchange stalled (figures below)", i + 1, s.name));
        }
    }
    let (end_failures, report) = stop_and_check(&exchanges);
    failures.extend(end_failures);
    failures.extend(keeper_goes_once_inherited_connections_end(&world));
    let steps_text: String = steps.iter().map(|s| s.render(&exchanges)).collect();
    eprintln!("{report}");
    assert!(
        failures.is_empty(),
        "kube-proxy {rules:?} → kproxy {datapath:?}: what the users of the connections saw:\n- {}\n\n{steps_text}\n{report}",
        failures.join("\n- ")
    );
}

// ------------------------------------------------------------------------------------------------
// The way back (issue 17): kproxy uninstalled while kube-proxy's rules are restored.
//
// Connections opened through kproxy (kube-proxy's rules removed by `cleanup-kube-proxy --apply`
// once the agents run, before any exchange starts: kproxy alone translates them), then kube-proxy's
// rules restored on both nodes, then, as an operator deleting kproxy's DaemonSet would, the agents
// stopped (SIGTERM: the datapath stays pinned) and `kproxy unload` run on each node. With the
// handover (the default), `unload` first hands kproxy's flows to netfilter (`cmd/handover.rs`) and
// the exchanges go on. With `--no-handover` it measures what the handover avoids: the test asserts
// that each exchange is cut, and prints how. With socket LB (`--socket-lb on`, the client pod in
// the hooks' cgroup) only the NodePort flow is kproxy's to hand over: the pod's TCP socket talks to
// its backend itself and goes on; its UDP datagrams, sent to the Service address, meet kube-proxy's
// rules as a new flow once the hooks are gone (measured and printed, not asserted).

#[test]
fn iptables_rules_restored_unload_hands_kproxy_flows_to_netfilter() {
    way_back(Rules::Iptables, Datapath::Tc, true);
}

#[test]
fn nftables_rules_restored_unload_hands_kproxy_flows_to_netfilter() {
    way_back(Rules::Nftables, Datapath::Tc, true);
}

#[test]
fn iptables_rules_restored_unload_without_handover_cuts_kproxy_flows() {
    way_back(Rules::Iptables, Datapath::Tc, false);
}

#[test]
fn iptables_rules_restored_unload_with_socket_lb_keeps_connected_sockets_and_hands_node_ports_over() {
    way_back(Rules::Iptables, Datapath::SocketLb, true);
}

/// Whether kproxy translates the exchange's packets in tc or XDP (and keeps its flow in
/// CONNTRACK_V4), rather than at its socket's connect()/sendmsg().
fn translated_in_the_datapath(world: &World, x: &Exchange) -> bool {
    world.datapath == Datapath::Tc || x.name == "nodeport-tcp"
}

/// kproxy's conntrack rows (`kproxy dump conntrack --json`) of node `node`.
fn kproxy_conntrack(world: &World, node: usize) -> Vec<Value> {
    let out = world.kproxy(node, &["dump", "conntrack", "--json"]);
    serde_json::from_slice::<Value>(&out.stdout).ok().and_then(|v| v.as_array().cloned()).unwrap_or_default()
}

/// Every exchange kproxy translates in its datapath has its flow in node 0's kproxy conntrack
/// (what kproxy sent it to is printed); nf_conntrack has no NAT of theirs (no rule of
/// kube-proxy's is left to make one).
fn wait_for_kproxy_flows(world: &World, exchanges: &[Exchange]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let expected: Vec<&Exchange> =
        exchanges.iter().filter(|x| translated_in_the_datapath(world, x)).collect();
    loop {
        let rows = kproxy_conntrack(world, 0);
        let found: Vec<Option<&Value>> = expected
            .iter()
            .map(|x| {
                let (ip, port) = x.local()?;
                let original = format!("{ip}:{port} -> {}:{}", x.frontend.0, x.frontend.1);
                rows.iter().find(|r| r["original"] == original.as_str())
            })
            .collect();
        if found.iter().all(Option::is_some) {
            for (x, row) in expected.iter().zip(found) {
                let row = row.unwrap();
                eprintln!(
                    "  {} through kproxy: {} translated to {}",
                    x.name, row["original"], row["translated"]
                );
            }
            let natted: Vec<CtEntry> = (0..2).flat_map(|n| legacy_entries(world, exchanges, n)).collect();
            assert!(
                natted.is_empty(),
                "netfilter NATed flows of the exchanges with no kube-proxy rule: {natted:#?}"
            );
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the exchanges have no kproxy conntrack entry on node 0: {rows:#?}\n{}",
            world.agent_logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// kube-proxy's rules again, as its proxier writes them at start (the file `install_kube_proxy`
/// wrote).
fn restore_kube_proxy(world: &World, node: usize) {
    let dir = world.multi.node(node).dir();
    match world.rules {
        Rules::Iptables => {
            let file = dir.join("kube-proxy.iptables");
            world.node_exec(node, &["iptables-restore", file.to_str().unwrap()]);
        }
        Rules::Nftables => {
            let file = dir.join("kube-proxy.nft");
            world.node_exec(node, &["nft", "-f", file.to_str().unwrap()]);
        }
    }
    assert!(!world.kube_proxy_leftovers(node).is_empty(), "node {node}: kube-proxy's rules not restored");
}

/// The exchanges' nf_conntrack entries on node `node`, NATed or not.
fn exchange_entries(world: &World, exchanges: &[Exchange], node: usize) -> Vec<String> {
    let locals: Vec<(Ipv4Addr, u16)> = exchanges.iter().filter_map(Exchange::local).collect();
    world
        .conntrack(node)
        .into_iter()
        .filter(|e| {
            locals.iter().any(|(ip, port)| e.from(*ip, *port) || (e.reply.1 == *ip && e.reply.3 == *port))
        })
        .map(|e| e.line)
        .collect()
}

fn way_back(rules: Rules, datapath: Datapath, handover: bool) {
    let mut world = World::build(rules, datapath);
    eprintln!(
        "way-back test: kproxy {datapath:?} → kube-proxy {rules:?} rules, `kproxy unload`{}",
        if handover { "" } else { " --no-handover" }
    );
    world.start_agents();
    world.wait_for_agents();
    for node in 0..2 {
        let out = world.kproxy(node, &["cleanup-kube-proxy", "--apply"]);
        assert!(
            out.status.success(),
            "node {node}: cleanup-kube-proxy --apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let left = world.kube_proxy_leftovers(node);
        assert!(left.is_empty(), "node {node}: kube-proxy's rules left after cleanup: {left:#?}");
    }
    let world = world;
    let exchanges = start_exchanges(&world);
    let mut steps = Vec::new();

    steps.push(step(&world, &exchanges, "through kproxy (no kube-proxy rule)", || {
        wait_for_kproxy_flows(&world, &exchanges)
    }));
    assert!(steps[0].progressed, "the exchanges do not run through kproxy: {}", steps[0].render(&exchanges));

    steps.push(step(&world, &exchanges, "kube-proxy's rules restored", || {
        for node in 0..2 {
            restore_kube_proxy(&world, node);
        }
    }));
    for node in 0..2 {
        eprintln!(
            "  node-{node}: the exchanges' nf_conntrack entries: {:#?}",
            exchange_entries(&world, &exchanges, node)
        );
    }

    let mut unload_out = Vec::new();
    steps.push(step(&world, &exchanges, "agents stopped, kproxy unloaded", || {
        for (node, agent) in world.agents.iter().enumerate() {
            let status = agent.terminate(Duration::from_secs(10)).unwrap();
            eprintln!("  node-{node}: agent stopped (SIGTERM): {status}");
        }
        for node in 0..2 {
            let mut args = vec!["unload"];
            if !handover {
                args.push("--no-handover");
            }
            let out = world.kproxy(node, &args);
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            eprintln!(
                "  node-{node}: kproxy {} ({}):\n{text}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "node {node}: kproxy unload failed");
            assert!(!world.pins[node].exists(), "node {node}: the pin directory is still there");
            unload_out.push(text);
        }
        let link = world.node_exec(0, &["ip", "link", "show", "eth0"]);
        assert!(!link.contains("prog/xdp"), "XDP still on node 0's eth0: {link}");
    }));
    for node in 0..2 {
        eprintln!(
            "  node-{node}: the exchanges' nf_conntrack entries: {:#?}",
            exchange_entries(&world, &exchanges, node)
        );
    }

    let (end_failures, report) = stop_and_check(&exchanges);
    let steps_text: String = steps.iter().map(|s| s.render(&exchanges)).collect();
    eprintln!("{report}");
    let mut failures = Vec::new();
    if handover && datapath == Datapath::Tc {
        // Node 0's kproxy translated the three exchanges; node 1's none.
        if !unload_out[0]
            .contains("handed 3 flow(s) kproxy translated to netfilter (nf_conntrack): 2 TCP, 1 UDP")
        {
            failures.push(format!(
                "node 0's unload did not hand the 3 exchanges to netfilter:\n{}",
                unload_out[0]
            ));
        }
        for (i, s) in steps.iter().enumerate() {
            if !s.progressed {
                failures.push(format!("step {} \"{}\": an exchange stalled (figures below)", i + 1, s.name));
            }
        }
        failures.extend(end_failures);
    } else if handover {
        // Socket LB: the NodePort flow is the only one in kproxy's conntrack.
        if !unload_out[0].contains("handed 1 flow(s) kproxy translated to netfilter (nf_conntrack): 1 TCP") {
            failures.push(format!(
                "node 0's unload did not hand the NodePort flow to netfilter:\n{}",
                unload_out[0]
            ));
        }
        let (udp, others): (Vec<String>, Vec<String>) =
            end_failures.into_iter().partition(|f| f.starts_with("clusterip-udp: "));
        eprintln!("  socket LB, after the unload the UDP exchange went through kube-proxy's rules: {udp:#?}");
        failures.extend(others);
    } else {
        if !unload_out[0].contains("not handing flows to netfilter (--no-handover): the 3 open flow(s)") {
            failures.push(format!(
                "node 0's unload did not say the 3 flows lose their translation:\n{}",
                unload_out[0]
            ));
        }
        // What the handover is for: each exchange is cut. How is in the figures and the report.
        for x in &exchanges {
            let broken: Vec<&String> =
                end_failures.iter().filter(|f| f.starts_with(&format!("{}: ", x.name))).collect();
            eprintln!("  without the handover, {}: {broken:#?}", x.name);
            if broken.is_empty() {
                failures.push(format!("{}: went on unharmed without the handover", x.name));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "kproxy {datapath:?} → kube-proxy {rules:?}, handover {handover}: what the users of the connections saw:\n- {}\n\n{steps_text}\n{report}",
        failures.join("\n- ")
    );
}
