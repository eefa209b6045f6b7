//! The differential test harness: the same client scenarios run through kproxy and through
//! kube-proxy's own rules (iptables mode and nftables mode), each in its own sandbox built the
//! same way, and what each client observed is compared (`tests/tests/differential.rs` holds the
//! scenario list and the comparison).
//!
//! **The sandbox** ([`World`], one per [`Mode`], reused by every scenario of that mode): one node
//! ([`Sandbox`]: pods with /32 addresses behind host veths, `ip_forward=1`), a client pod, three
//! backends `web-1..3` running a small Python server (`server.py`: TCP and UDP on 8080, answering
//! with the pod's name and the client address it saw, closing first or resetting on request), two
//! DNS pods `coredns-1..2` running dnsmasq. The Services are [`baseline`]: `web` (three
//! backends), `kube-dns`, `one` and `one-again` (both only `web-1`: two Services sharing one
//! backend, and deterministic hairpin), `empty` (no endpoints), `deaf` (a target port nothing
//! listens on), `np` (a NodePort on the node's address, only `web-1`), `lb` and `lb-ranged`
//! (LoadBalancer IPs, the second with `loadBalancerSourceRanges` admitting only `web-2`) and
//! `sticky` (`sessionAffinity: ClientIP` over the three backends). The node namespace also routes the ServiceCIDR to a dead end — a permanent
//! neighbour on the port-less node bridge, so packets routed there are dropped without any ICMP —
//! as a real node's default route would carry traffic to a ClusterIP that nothing translated
//! (without it, the node's own sockets could not even connect to a ClusterIP, and untranslated
//! packets would get "network unreachable" from the sandbox, which no cluster does).
//!
//! **The proxies**: [`Mode::Kproxy`] runs the real `kproxy agent --manifests DIR --service-cidr
//! SERVICE_CIDR --cluster-cidr CLUSTER_CIDR` (kube-proxy's rules get the same; otherwise default flags,
//! its socket hooks confined to a child cgroup the harness creates: every client process runs in
//! that cgroup, as every process of a real node is under the agent's cgroup root).
//! [`Mode::Iptables`] restores kube-proxy's iptables-mode filter and nat tables
//! ([`crate::kube_proxy_rules::kube_proxy_iptables`]); [`Mode::Nftables`] loads its nftables
//! table ([`crate::kube_proxy_rules::kube_proxy_nftables`]). A backend change rewrites the
//! manifests (kproxy: then waits until `kproxy dump diff` finds the maps equal to them) or
//! regenerates and reloads the rules, then does what kube-proxy does after every sync: deletes
//! the UDP conntrack entries of Service ports that no longer reach a serving endpoint, with the
//! `conntrack` tool (pkg/proxy/conntrack/cleanup.go). TCP entries are never touched.
//!
//! **A scenario** ([`Scenario`]) runs in a Python client (`client.py`, one per place a socket is
//! opened from: the client pod, the node, another pod) driven over stdin/stdout, one JSON request
//! and one JSON observation per step. Every scenario has its own block of source ports, so no
//! scenario meets another's conntrack entries or TIME_WAIT sockets; before each scenario the
//! cluster is put back to the baseline.
//!
//! **Observations** ([`Observation`]) keep what a client sees, in terms that do not depend on the
//! random backend choice: the outcome (connected, refused, timeout, reset, reply, eof, ...), the
//! answering pod as a label in order of first appearance in the scenario (`S1`, `S2`: "the same
//! backend as before", "another one"), or for [`Step::any_backend`] steps only whether it is one
//! of the Service's current endpoints; addresses as a Service name or a pod label with the port;
//! whether the server saw the client's own address or another (masqueraded) one; the byte count.
//! The raw observation is kept for the report.
//!
//! Timeouts are short: 3 s for a TCP connect (one SYN retransmission: a SYN may meet a server's
//! TIME_WAIT and be answered only by its retransmission), 2 s for an answer.
pub mod scenario;
pub mod spec;

use std::{
    collections::{BTreeMap, HashMap},
    ffi::OsString,
    fmt,
    io::{BufRead as _, BufReader, Write as _},
    net::Ipv4Addr,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Value, json};

pub use scenario::*;
pub use spec::*;

use crate::{
    NODE_DEVICE, NODE_IP, Pod, Sandbox, Spawned,
    cgroup::ChildCgroup,
    find_tool, kproxy_bin,
    kube_proxy_rules::{self, parse_udp_entries, stale_udp_entries},
};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// Backends' TCP and UDP server port.
pub const WEB_PORT: u16 = 8080;
/// The `np` Service's NodePort (TCP and UDP), on the node's address.
pub const NODE_PORT: u16 = 30081;
/// Load-balancer IPs (TEST-NET-1, routed to the node's dead end like the ServiceCIDR): `lb`'s,
/// open to every source, and `lb-ranged`'s, open only to [`LB_ALLOWED_SOURCE`] (`web-2`).
pub const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
pub const LB_RANGED_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);
pub const LB_ALLOWED_SOURCE: &str = "10.244.0.12/32";
const LB_CIDR: &str = "192.0.2.0/24";
/// A port nothing listens on in the backends (the `deaf` Service's target port).
pub const DEAF_PORT: u16 = 9999;
/// An address in the ServiceCIDR that no Service has.
pub const UNALLOCATED_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 199);
pub const WEB_PODS: [(&str, Ipv4Addr); 3] = [
    ("web-1", Ipv4Addr::new(10, 244, 0, 11)),
    ("web-2", Ipv4Addr::new(10, 244, 0, 12)),
    ("web-3", Ipv4Addr::new(10, 244, 0, 13)),
];
pub const DNS_PODS: [(&str, Ipv4Addr); 2] =
    [("coredns-1", Ipv4Addr::new(10, 244, 0, 21)), ("coredns-2", Ipv4Addr::new(10, 244, 0, 22))];
/// The next hop of the dead-end route for the ServiceCIDR (a permanent neighbour on the node
/// bridge, which has no ports: what is sent there is dropped, silently).
const DEAD_END_HOP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 254);
const DEAD_END_MAC: &str = "02:00:00:00:00:fe";

/// Scenario `i` uses source ports `PORT_BASE + i * PORTS_PER_SCENARIO ..`, below the ephemeral
/// range.
const PORT_BASE: u16 = 20000;
const PORTS_PER_SCENARIO: u16 = 40;
const CONNECT_TIMEOUT: f64 = 3.0;
const REPLY_TIMEOUT: f64 = 2.0;
/// On top of a step's own timeout, for the client to report.
const CLIENT_SLACK: Duration = Duration::from_secs(10);
const PROGRAMMED_TIMEOUT: Duration = Duration::from_secs(30);

const CLIENT_PY: &str = include_str!("client.py");
const SERVER_PY: &str = include_str!("server.py");

fn port(name: &'static str, port: u16, proto: Proto, target_port: u16) -> PortSpec {
    PortSpec { name, port, proto, target_port, node_port: None }
}

fn web_ports(target_port: u16) -> Vec<PortSpec> {
    vec![port("http", 80, Proto::Tcp, target_port), port("echo", 80, Proto::Udp, target_port)]
}

fn endpoints(pods: &[(&str, Ipv4Addr)]) -> Vec<EndpointSpec> {
    pods.iter().map(|(name, ip)| EndpointSpec::ready(name, *ip)).collect()
}

/// The Services every scenario starts from.
pub fn baseline() -> ClusterSpec {
    let service = |namespace, name, ip: [u8; 4], ports, endpoints| ServiceSpec {
        namespace,
        name,
        cluster_ip: Ipv4Addr::from(ip),
        ports,
        endpoints,
        load_balancer_ip: None,
        source_ranges: Vec::new(),
        affinity_timeout: None,
        internal_local: false,
        traffic_distribution: None,
    };
    let with_node_port = |node_port| {
        web_ports(WEB_PORT).into_iter().map(|p| PortSpec { node_port: Some(node_port), ..p }).collect()
    };
    ClusterSpec {
        services: vec![
            service("default", "web", [10, 96, 0, 100], web_ports(WEB_PORT), endpoints(&WEB_PODS)),
            service(
                "kube-system",
                "kube-dns",
                [10, 96, 0, 10],
                vec![port("dns", 53, Proto::Udp, 53), port("dns-tcp", 53, Proto::Tcp, 53)],
                endpoints(&DNS_PODS),
            ),
            service("default", "one", [10, 96, 0, 101], web_ports(WEB_PORT), endpoints(&WEB_PODS[..1])),
            service("default", "one-again", [10, 96, 0, 102], web_ports(WEB_PORT), endpoints(&WEB_PODS[..1])),
            service("default", "empty", [10, 96, 0, 103], web_ports(WEB_PORT), Vec::new()),
            service("default", "deaf", [10, 96, 0, 104], web_ports(DEAF_PORT), endpoints(&WEB_PODS[2..])),
            service("default", "np", [10, 96, 0, 105], with_node_port(NODE_PORT), endpoints(&WEB_PODS[..1])),
            ServiceSpec {
                affinity_timeout: Some(10800),
                ..service("default", "sticky", [10, 96, 0, 108], web_ports(WEB_PORT), endpoints(&WEB_PODS))
            },
            // internalTrafficPolicy: Local, its endpoints on other nodes: dropped (clients time out).
            ServiceSpec {
                internal_local: true,
                ..service(
                    "default",
                    "local-elsewhere",
                    [10, 96, 0, 109],
                    web_ports(WEB_PORT),
                    WEB_PODS[1..]
                        .iter()
                        .map(|(name, ip)| EndpointSpec { node: "node-2", ..EndpointSpec::ready(name, *ip) })
                        .collect(),
                )
            },
            // trafficDistribution: PreferSameNode, one endpoint hinted for each node: web-1 is this node's.
            ServiceSpec {
                traffic_distribution: Some("PreferSameNode"),
                ..service(
                    "default",
                    "same-node",
                    [10, 96, 0, 110],
                    web_ports(WEB_PORT),
                    WEB_PODS
                        .iter()
                        .zip(["node-1", "node-2", "node-3"])
                        .map(|((name, ip), node)| EndpointSpec {
                            node,
                            for_nodes: vec![node],
                            ..EndpointSpec::ready(name, *ip)
                        })
                        .collect(),
                )
            },
            ServiceSpec {
                load_balancer_ip: Some(LB_IP),
                ..service("default", "lb", [10, 96, 0, 106], with_node_port(30082), endpoints(&WEB_PODS[..1]))
            },
            ServiceSpec {
                load_balancer_ip: Some(LB_RANGED_IP),
                source_ranges: vec![LB_ALLOWED_SOURCE],
                ..service(
                    "default",
                    "lb-ranged",
                    [10, 96, 0, 107],
                    with_node_port(30083),
                    endpoints(&WEB_PODS[..1]),
                )
            },
        ],
    }
}

fn pod_ip(name: &str) -> Option<Ipv4Addr> {
    std::iter::once(("client", CLIENT_IP))
        .chain(WEB_PODS)
        .chain(DNS_PODS)
        .find(|(n, _)| *n == name)
        .map(|(_, ip)| ip)
}

fn pod_name(ip: Ipv4Addr) -> Option<&'static str> {
    std::iter::once(("client", CLIENT_IP))
        .chain(WEB_PODS)
        .chain(DNS_PODS)
        .find(|(_, a)| *a == ip)
        .map(|(n, _)| n)
}

/// The port pod `name` serves `proto` on.
fn server_port(name: &str) -> u16 {
    if DNS_PODS.iter().any(|(n, _)| *n == name) { 53 } else { WEB_PORT }
}

/// Which proxy serves the Services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Kproxy,
    Iptables,
    Nftables,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Kproxy => "kproxy",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        })
    }
}

/// What a client saw at one step, in terms comparable across proxies (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Observation {
    pub outcome: String,
    /// The answering pod: `S1`, `S2`, ... in order of first appearance, or `backend of <svc>`.
    pub server: Option<String>,
    /// The peer address: what `connect` reached, or where a datagram's answer came from.
    pub peer: Option<String>,
    /// The client address the server saw: `client` (the client's own) or `other` (translated).
    pub seen: Option<String>,
    pub bytes: Option<u64>,
}

impl fmt::Display for Observation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.outcome)?;
        for (key, value) in [("server", &self.server), ("peer", &self.peer), ("seen", &self.seen)] {
            if let Some(value) = value {
                write!(f, " {key}={value}")?;
            }
        }
        if let Some(bytes) = self.bytes {
            write!(f, " bytes={bytes}")?;
        }
        Ok(())
    }
}

impl Observation {
    /// This observation with `field` cleared (for comparing what an allowance does not cover).
    pub fn without(&self, field: Field) -> Observation {
        let mut out = self.clone();
        match field {
            Field::Outcome => out.outcome.clear(),
            Field::Server => out.server = None,
            Field::Peer => out.peer = None,
            Field::Seen => out.seen = None,
            Field::Bytes => out.bytes = None,
        }
        out
    }
}

/// One step as run in one mode.
#[derive(Clone, Debug)]
pub struct StepResult {
    /// The step, with its symbolic destination and port resolved.
    pub what: String,
    pub observation: Observation,
    /// The client's own report (or the change applied), for the log.
    pub raw: String,
}

/// A Python client in one place, driven one request at a time.
struct Client {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<std::io::Result<String>>,
    log: PathBuf,
}

/// The real interpreter behind `python3` (a pyenv shim costs a shell and a second exec per start).
fn python() -> Result<PathBuf> {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = PYTHON.get() {
        return Ok(path.clone());
    }
    let shim = find_tool("python3")?;
    let out = std::process::Command::new(&shim)
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .with_context(|| format!("running {}", shim.display()))?;
    let real = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let path = if out.status.success() && real.is_file() { real } else { shim };
    Ok(PYTHON.get_or_init(|| path).clone())
}

impl Client {
    fn start(cgroup: &ChildCgroup, netns: &str, script: &Path, log: PathBuf) -> Result<Client> {
        let args: Vec<OsString> = vec![python()?.into(), "-u".into(), script.into()];
        let mut command = cgroup.command(netns, &args);
        let stderr = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(stderr).process_group(0);
        let mut child = command.spawn().context("starting the scenario client")?;
        let stdin = child.stdin.take().context("client stdin")?;
        let stdout = child.stdout.take().context("client stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut client = Client { child, stdin, lines, log };
        let ready = client.read(Duration::from_secs(20))?;
        if ready["outcome"] != "ready" {
            bail!("the scenario client said {ready} instead of ready");
        }
        Ok(client)
    }

    fn read(&mut self, timeout: Duration) -> Result<Value> {
        let line = match self.lines.recv_timeout(timeout) {
            Ok(line) => line.context("reading the scenario client")?,
            Err(_) => bail!(
                "the scenario client did not answer within {timeout:?}; its stderr:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            ),
        };
        serde_json::from_str(&line).with_context(|| format!("the scenario client printed {line:?}"))
    }

    fn call(&mut self, request: &Value, timeout: Duration) -> Result<Value> {
        writeln!(self.stdin, "{request}").and_then(|()| self.stdin.flush()).with_context(|| {
            format!(
                "sending {request} to the scenario client; its stderr:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })?;
        self.read(timeout)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill has no memory-safety preconditions; the group is the client's own
            // (process_group(0)) and its leader is not reaped yet.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.child.wait();
    }
}

/// `kproxy agent` with its pins; stopped and unloaded on drop.
struct KproxyAgent {
    agent: Spawned,
    pin_dir: PathBuf,
    manifests: PathBuf,
}

impl Drop for KproxyAgent {
    fn drop(&mut self) {
        let _ = self.agent.terminate(Duration::from_secs(5));
        let _ = std::process::Command::new(kproxy_bin())
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .arg("unload")
            .output();
    }
}

/// Pod labels in order of first appearance in a scenario.
#[derive(Default)]
struct Labels(Vec<String>);

impl Labels {
    fn pod(&mut self, name: &str) -> String {
        let index = match self.0.iter().position(|n| n == name) {
            Some(index) => index,
            None => {
                self.0.push(name.to_owned());
                self.0.len() - 1
            }
        };
        format!("S{}", index + 1)
    }

    /// `svc:port` for a cluster IP, `S<n>:port` for a pod, `node:port`, or the address itself.
    fn addr(&mut self, text: &str) -> String {
        let Some((ip, port)) = text.rsplit_once(':') else { return text.to_owned() };
        let Ok(ip) = ip.parse::<Ipv4Addr>() else { return text.to_owned() };
        if let Some(service) = baseline().service_by_ip(ip) {
            return format!("{}:{port}", service.name);
        }
        if let Some(service) = baseline().service_by_load_balancer_ip(ip) {
            return format!("{}-lb:{port}", service.name);
        }
        if let Some(name) = pod_name(ip) {
            return format!("{}:{port}", self.pod(name));
        }
        if ip == NODE_IP {
            return format!("node:{port}");
        }
        text.to_owned()
    }
}

/// A socket of the running scenario.
struct Socket {
    place: Place,
    /// The Service the socket talks to (connected sockets), for `any_backend`.
    service: Option<&'static str>,
}

/// One sandbox with one proxy, reused across scenarios. Fields drop in order: the agent (and its
/// pins) before the sandbox, the cgroup last.
pub struct World {
    mode: Mode,
    kproxy: Option<KproxyAgent>,
    pods: BTreeMap<&'static str, Pod>,
    spec: ClusterSpec,
    dir: PathBuf,
    sandbox: Sandbox,
    cgroup: ChildCgroup,
}

static NEXT_PIN: AtomicU32 = AtomicU32::new(0);

impl World {
    /// Builds the sandbox, starts the servers and programs [`baseline`] with `mode`'s proxy.
    pub fn start(mode: Mode) -> Result<World> {
        let tag = format!("diff-{mode}");
        let sandbox =
            Sandbox::new(&tag).context("building the sandbox (needs root; run `cargo xtask setup`)")?;
        crate::require_tools(match mode {
            Mode::Kproxy => &["python3"][..],
            Mode::Iptables => &["python3", "iptables-restore", "conntrack"],
            Mode::Nftables => &["python3", "nft", "conntrack"],
        })?;
        let cgroup = ChildCgroup::new("kproxy-diff")?;
        let dir = sandbox.dir().join("differential");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("client.py"), CLIENT_PY)?;
        std::fs::write(dir.join("server.py"), SERVER_PY)?;
        let hop = DEAD_END_HOP.to_string();
        let node = sandbox.node_netns().to_owned();
        crate::sandbox::ip(&[
            "-n",
            &node,
            "neigh",
            "replace",
            &hop,
            "lladdr",
            DEAD_END_MAC,
            "dev",
            NODE_DEVICE,
            "nud",
            "permanent",
        ])?;
        for cidr in [SERVICE_CIDR, LB_CIDR] {
            crate::sandbox::ip(&[
                "-n",
                &node,
                "route",
                "add",
                cidr,
                "via",
                &hop,
                "dev",
                NODE_DEVICE,
                "onlink",
            ])?;
        }

        let mut pods = BTreeMap::new();
        pods.insert("client", sandbox.add_pod("client", CLIENT_IP)?);
        let python = python()?;
        for (name, ip) in WEB_PODS {
            let pod = sandbox.add_pod(name, ip)?;
            let server = pod.spawn([
                python.as_os_str(),
                "-u".as_ref(),
                dir.join("server.py").as_os_str(),
                name.as_ref(),
                WEB_PORT.to_string().as_ref(),
            ])?;
            pod.wait_listening("tcp", WEB_PORT, Some(&server), Duration::from_secs(10))?;
            pod.wait_listening("udp", WEB_PORT, Some(&server), Duration::from_secs(10))?;
            pods.insert(name, pod);
        }
        let web_vip = baseline().service("web").map(|s| s.cluster_ip).context("baseline has web")?;
        for (name, ip) in DNS_PODS {
            let pod = sandbox.add_pod(name, ip)?;
            pod.start_dnsmasq(web_vip)?;
            pods.insert(name, pod);
        }
        let mut world =
            World { mode, kproxy: None, pods, spec: ClusterSpec::default(), dir, sandbox, cgroup };
        if mode == Mode::Kproxy {
            world.start_kproxy()?;
        }
        world.apply(baseline())?;
        if mode == Mode::Kproxy {
            world.wait_for_attachment()?;
        }
        Ok(world)
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn start_kproxy(&mut self) -> Result<()> {
        let pin_dir = PathBuf::from(format!(
            "/sys/fs/bpf/kproxy-diff-{}-{}",
            std::process::id(),
            NEXT_PIN.fetch_add(1, Ordering::Relaxed)
        ));
        let manifests = self.dir.join("manifests");
        std::fs::create_dir_all(&manifests)?;
        let bin = kproxy_bin();
        let args: Vec<OsString> = vec![
            bin.into(),
            "--pin-dir".into(),
            pin_dir.clone().into(),
            "agent".into(),
            "--interfaces".into(),
            "veth*".into(),
            "--poll-ms".into(),
            "100".into(),
            "--hostname-override".into(),
            THIS_NODE.into(),
            "--manifests".into(),
            manifests.clone().into(),
            "--cgroup-root".into(),
            self.cgroup.path().into(),
            // The range kube-proxy's nftables rules drop the unallocated addresses of (a cluster's
            // ServiceCIDR object).
            "--service-cidr".into(),
            SERVICE_CIDR.into(),
            // kube-proxy's local-traffic detector gets the same cluster CIDR (who is masqueraded).
            "--cluster-cidr".into(),
            CLUSTER_CIDR.into(),
        ];
        let agent = self.sandbox.node_spawn(args)?;
        self.kproxy = Some(KproxyAgent { agent, pin_dir, manifests });
        Ok(())
    }

    /// Every pod veth has kproxy's ingress and egress programs (attached within `--poll-ms`,
    /// independently of programming the maps).
    fn wait_for_attachment(&self) -> Result<()> {
        let kproxy = self.kproxy.as_ref().context("kproxy mode")?;
        let deadline = Instant::now() + PROGRAMMED_TIMEOUT;
        loop {
            let links: Vec<String> = std::fs::read_dir(kproxy.pin_dir.join("links"))
                .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            let attached = |veth: &str, hook: &str| {
                links.iter().any(|l| l.starts_with(&format!("{veth}@")) && l.ends_with(&format!("-{hook}")))
            };
            if self
                .pods
                .values()
                .all(|p| attached(p.host_veth(), "ingress") && attached(p.host_veth(), "egress"))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("pod veths not attached; agent log:\n{}", kproxy.agent.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Programs `spec` and waits until it is in effect.
    fn apply(&mut self, spec: ClusterSpec) -> Result<()> {
        match self.mode {
            Mode::Kproxy => self.apply_kproxy(&spec)?,
            Mode::Iptables => {
                let file = self.dir.join("kube-proxy.iptables");
                std::fs::write(
                    &file,
                    kube_proxy_rules::kube_proxy_iptables(&spec.kube_proxy_svcs(), CLUSTER_CIDR),
                )?;
                self.sandbox.node_exec([find_tool("iptables-restore")?.as_os_str(), file.as_os_str()])?;
                // A misread argument makes iptables-restore read nothing and succeed.
                self.sandbox
                    .node_exec([
                        find_tool("iptables")?.as_os_str(),
                        "-t".as_ref(),
                        "nat".as_ref(),
                        "-S".as_ref(),
                        "KUBE-SERVICES".as_ref(),
                    ])
                    .context("kube-proxy's nat rules are not in place after iptables-restore")?;
                self.clean_stale_udp(&spec)?;
            }
            Mode::Nftables => {
                let file = self.dir.join("kube-proxy.nft");
                std::fs::write(
                    &file,
                    kube_proxy_rules::kube_proxy_nftables(
                        &spec.kube_proxy_svcs(),
                        CLUSTER_CIDR,
                        SERVICE_CIDR,
                    ),
                )?;
                self.sandbox.node_exec([find_tool("nft")?.as_os_str(), "-f".as_ref(), file.as_os_str()])?;
                self.clean_stale_udp(&spec)?;
            }
        }
        self.spec = spec;
        Ok(())
    }

    fn apply_kproxy(&self, spec: &ClusterSpec) -> Result<()> {
        let kproxy = self.kproxy.as_ref().context("kproxy mode")?;
        let files = spec.manifest_files();
        for entry in std::fs::read_dir(&kproxy.manifests)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !files.iter().any(|(f, _)| *f == name) {
                std::fs::remove_file(entry.path())?;
            }
        }
        for (name, text) in files {
            let target = kproxy.manifests.join(&name);
            if std::fs::read_to_string(&target).is_ok_and(|old| old == text) {
                continue;
            }
            // Written beside, then renamed in: the agent never reads half a file.
            let staged = self.dir.join(format!("{name}.staged"));
            std::fs::write(&staged, text)?;
            std::fs::rename(&staged, &target)?;
        }
        let deadline = Instant::now() + PROGRAMMED_TIMEOUT;
        loop {
            // Until the agent has pinned its maps, kproxy dump fails: not programmed yet.
            let why = match self.kproxy_programmed(spec) {
                Ok((true, _)) => return Ok(()),
                Ok((false, why)) => why,
                Err(err) => format!("{err:#}"),
            };
            if !kproxy.agent.is_running() {
                bail!("the kproxy agent exited:\n{}", kproxy.agent.log());
            }
            if Instant::now() >= deadline {
                bail!(
                    "kproxy did not program the Services within {PROGRAMMED_TIMEOUT:?}: {why}\nagent log:\n{}",
                    kproxy.agent.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kproxy <args>` against this world's pins, in the node namespace: its JSON output.
    fn kproxy_json(&self, args: &[&str]) -> Result<Value> {
        let kproxy = self.kproxy.as_ref().context("kproxy mode")?;
        let mut full = vec![
            kproxy_bin().display().to_string(),
            "--pin-dir".into(),
            kproxy.pin_dir.display().to_string(),
        ];
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let out = self.sandbox.node_exec_output(&full)?;
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "kproxy {args:?} printed {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    /// Whether the maps hold `spec`, and if not what differs, by `kproxy dump diff` and two
    /// corrections to it: it builds its model without the node's addresses, so it reports every
    /// NodePort frontend as not wanted — those are checked here against the spec instead
    /// (present on the node address with the expected number of backends, and no others) — and
    /// it expects VIPS_V4 entries for node and load-balancer addresses, which VIPS_V4 (cluster
    /// IPs only, by design) never holds.
    fn kproxy_programmed(&self, spec: &ClusterSpec) -> Result<(bool, String)> {
        let kproxy = self.kproxy.as_ref().context("kproxy mode")?;
        let manifests = kproxy.manifests.display().to_string();
        // As the agent runs: this node's name (local endpoints, node hints) and its --service-cidr.
        let diff = self.kproxy_json(&[
            "dump",
            "diff",
            "--json",
            "--manifests",
            &manifests,
            "--hostname-override",
            THIS_NODE,
            "--service-cidr",
            SERVICE_CIDR,
        ])?;
        let node_prefix = format!("{NODE_IP}:");
        let mut node_ports = Vec::new();
        let mut others = Vec::new();
        for row in diff.as_array().context("dump diff --json prints a list")? {
            let frontend = row["frontend"].as_str().unwrap_or_default();
            if row["kind"] == "extra-frontend" && frontend.starts_with(&node_prefix) {
                node_ports.push(frontend.to_owned());
            } else if row["kind"] == "vip"
                && frontend.parse::<Ipv4Addr>().is_ok_and(|ip| spec.service_by_ip(ip).is_none())
            {
                // Its VIPS_V4 check counts the frontends of every address, but VIPS_V4 holds
                // cluster IPs only (node and load-balancer addresses carry other traffic).
            } else {
                others.push(row.to_string());
            }
        }
        if !others.is_empty() {
            return Ok((false, others.join("\n")));
        }
        let wanted: Vec<(String, u64)> = spec
            .services
            .iter()
            .flat_map(|s| {
                let count = s.used_endpoints().len() as u64;
                s.ports.iter().filter_map(move |p| {
                    Some((format!("{NODE_IP}:{}/{}", p.node_port?, p.proto.k8s()), count))
                })
            })
            .collect();
        node_ports.sort();
        let mut wanted_names: Vec<String> = wanted.iter().map(|(f, _)| f.clone()).collect();
        wanted_names.sort();
        if node_ports != wanted_names {
            return Ok((false, format!("NodePort frontends {node_ports:?}, wanted {wanted_names:?}")));
        }
        let services = self.kproxy_json(&["dump", "services", "--json"])?;
        for (frontend, count) in &wanted {
            let (address, proto) = frontend.split_once('/').context("frontend/PROTO")?;
            let programmed = services
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["frontend"] == address && r["protocol"] == proto && r["slot"] == 0);
            if programmed.and_then(|r| r["count"].as_u64()) != Some(*count) {
                return Ok((
                    false,
                    format!("NodePort frontend {frontend}: {programmed:?}, wanted {count} backends"),
                ));
            }
        }
        Ok((true, String::new()))
    }

    /// kube-proxy's post-sync conntrack clean-up, with the `conntrack` tool.
    fn clean_stale_udp(&self, spec: &ClusterSpec) -> Result<()> {
        let conntrack = find_tool("conntrack")?;
        let out = self.sandbox.node_exec_output([
            conntrack.as_os_str(),
            "-L".as_ref(),
            "-p".as_ref(),
            "udp".as_ref(),
        ])?;
        let entries = parse_udp_entries(&String::from_utf8_lossy(&out.stdout));
        for entry in stale_udp_entries(&entries, &spec.serving_udp()) {
            let (dst, port, src) =
                (entry.orig_dst.to_string(), entry.orig_dport.to_string(), entry.reply_src.to_string());
            // Exits non-zero when the entry is already gone.
            self.sandbox.node_exec_output([
                conntrack.as_os_str(),
                "-D".as_ref(),
                "-p".as_ref(),
                "udp".as_ref(),
                "--orig-dst".as_ref(),
                dst.as_ref(),
                "--orig-port-dst".as_ref(),
                port.as_ref(),
                "--reply-src".as_ref(),
                src.as_ref(),
            ])?;
        }
        Ok(())
    }

    fn place_netns(&self, place: Place) -> Result<String> {
        Ok(match place {
            Place::Node => self.sandbox.node_netns().to_owned(),
            Place::Client => self.pod("client")?.netns().to_owned(),
            Place::Pod(name) => self.pod(name)?.netns().to_owned(),
        })
    }

    fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods.get(name).ok_or_else(|| anyhow!("no pod {name} in the sandbox"))
    }

    /// The address a place's sockets send from.
    fn place_ip(place: Place) -> Option<Ipv4Addr> {
        match place {
            Place::Client => Some(CLIENT_IP),
            Place::Node => Some(NODE_IP),
            Place::Pod(name) => pod_ip(name),
        }
    }

    /// Runs scenario number `index` (its port block) from the baseline.
    pub fn run(&mut self, index: usize, scenario: &Scenario) -> Result<Vec<StepResult>> {
        if self.spec != baseline() {
            self.apply(baseline())?;
        }
        let first_port = PORT_BASE + u16::try_from(index)? * PORTS_PER_SCENARIO;
        let mut run = Run {
            first_port,
            clients: HashMap::new(),
            sockets: HashMap::new(),
            servers: Vec::new(),
            labels: Labels::default(),
        };
        let mut results = Vec::new();
        for (i, step) in scenario.steps.iter().enumerate() {
            let (result, server) = self
                .step(&mut run, scenario, step)
                .with_context(|| format!("{} mode, scenario {}, step {i}", self.mode, scenario.name))?;
            run.servers.push(server);
            results.push(result);
        }
        Ok(results)
    }

    /// The address and port of `dst` for a socket of `proto`, with a description; `None` when it
    /// names the answer of a step that had none.
    fn resolve(&self, dst: Dst, servers: &[Option<String>]) -> Result<Option<(Ipv4Addr, u16, String)>> {
        Ok(Some(match dst {
            Dst::Service(name, port) => {
                let service = self.spec.service(name).cloned().or_else(|| baseline().service(name).cloned());
                let service = service.with_context(|| format!("no Service {name}"))?;
                (service.cluster_ip, port, format!("{name}:{port}"))
            }
            Dst::ServerOf(k) => {
                let Some(Some(name)) = servers.get(k) else { return Ok(None) };
                let ip = pod_ip(name).with_context(|| format!("no pod {name}"))?;
                (ip, server_port(name), format!("server of step {k}"))
            }
            Dst::Pod(name, port) => {
                (pod_ip(name).with_context(|| format!("no pod {name}"))?, port, format!("{name}:{port}"))
            }
            Dst::Node(port) => (NODE_IP, port, format!("node:{port}")),
            Dst::LoadBalancer(name, port) => {
                let service = self.spec.service(name).cloned().or_else(|| baseline().service(name).cloned());
                let ip = service
                    .and_then(|s| s.load_balancer_ip)
                    .with_context(|| format!("no load balancer {name}"))?;
                (ip, port, format!("{name} load balancer:{port}"))
            }
            Dst::Addr(ip, port) => (ip, port, format!("{ip}:{port}")),
        }))
    }

    fn step(
        &mut self,
        run: &mut Run,
        scenario: &Scenario,
        step: &Step,
    ) -> Result<(StepResult, Option<String>)> {
        if let Op::Change(change) = &step.op {
            let mut spec = self.spec.clone();
            let what = apply_change(&mut spec, *change, &run.servers)?;
            self.apply(spec)?;
            let observation = Observation { outcome: "applied".into(), ..Observation::default() };
            return Ok((StepResult { what, observation, raw: String::new() }, None));
        }
        let sock = step.op.sock().context("a client step names its socket")?;
        let mut request = json!({"sock": sock, "timeout": REPLY_TIMEOUT});
        let (place, opens, mut what, target) = match &step.op {
            Op::TcpConnect { from, dst, port, .. } => {
                request["op"] = "tcp_connect".into();
                request["timeout"] = CONNECT_TIMEOUT.into();
                request["port"] = run.port(*port).into();
                let what = format!("{sock}: TCP connect from {from:?} port {}", run.describe_port(*port));
                (*from, true, what, Some(*dst))
            }
            Op::UdpOpen { from, port, connect, .. } => {
                request["op"] = "udp_open".into();
                request["port"] = run.port(*port).into();
                let what = format!("{sock}: UDP socket in {from:?} on port {}", run.describe_port(*port));
                (*from, true, what, *connect)
            }
            Op::UdpEcho { to, size, .. } => {
                request["op"] = "udp_echo".into();
                request["size"] = (*size).into();
                (run.place_of(sock)?, false, format!("{sock}: {size}-byte UDP echo"), *to)
            }
            Op::Dns { to, .. } => {
                request["op"] = "dns".into();
                (run.place_of(sock)?, false, format!("{sock}: DNS query"), *to)
            }
            other => {
                let (op, text) = match other {
                    Op::Hello { .. } => ("hello", "hello"),
                    Op::ServerClose { .. } => ("server_close", "server closes first"),
                    Op::ServerReset { .. } => ("server_reset", "server resets"),
                    Op::ClientClose { .. } => ("client_close", "client closes first"),
                    Op::ClientReset { .. } => ("client_reset", "client resets"),
                    Op::TcpDns { .. } => ("tcp_dns", "DNS query over TCP"),
                    _ => unreachable!("handled above"),
                };
                request["op"] = op.into();
                (run.place_of(sock)?, false, format!("{sock}: {text}"), None)
            }
        };
        let mut service = None;
        if let Some(dst) = target {
            let Some((ip, port, text)) = self.resolve(dst, &run.servers)? else {
                if opens {
                    // Never opened: later steps on it get the client's "no-socket".
                    run.sockets.insert(sock, Socket { place, service: None });
                }
                what.push_str(&format!(" to {dst:?}"));
                let observation = Observation { outcome: "no-target".into(), ..Observation::default() };
                return Ok((
                    StepResult { what, observation, raw: "the step it names had no answer".into() },
                    None,
                ));
            };
            request["ip"] = ip.to_string().into();
            request["dport"] = port.into();
            what.push_str(&format!(" to {text}"));
            if let Dst::Service(name, _) = dst {
                service = Some(name);
            }
        }
        if opens {
            run.sockets.insert(sock, Socket { place, service });
        } else if service.is_none() {
            service = run.sockets.get(sock).and_then(|s| s.service);
        }
        if !run.clients.contains_key(&place) {
            let netns = self.place_netns(place)?;
            let log = self.dir.join(format!("client-{}-{}.log", scenario.name, run.clients.len()));
            let client = Client::start(&self.cgroup, &netns, &self.dir.join("client.py"), log)?;
            run.clients.insert(place, client);
        }
        let client = run.clients.get_mut(&place).context("client started")?;
        let timeout =
            Duration::from_secs_f64(request["timeout"].as_f64().unwrap_or(REPLY_TIMEOUT)) + CLIENT_SLACK;
        let reply = client.call(&request, timeout)?;
        let server = reply["server"].as_str().map(str::to_owned);
        let observation = self.observe(&reply, step, place, service, &mut run.labels);
        Ok((StepResult { what, observation, raw: reply.to_string() }, server))
    }

    fn observe(
        &self,
        reply: &Value,
        step: &Step,
        place: Place,
        service: Option<&'static str>,
        labels: &mut Labels,
    ) -> Observation {
        let text = |key: &str| reply[key].as_str().map(str::to_owned);
        let server =
            text("server").map(|name| match (step.any_backend, service.and_then(|s| self.spec.service(s))) {
                (true, Some(svc)) => {
                    if svc.used_endpoints().iter().any(|e| e.pod == name) {
                        format!("backend of {}", svc.name)
                    } else {
                        format!("{} (not a backend of {})", labels.pod(&name), svc.name)
                    }
                }
                _ => labels.pod(&name),
            });
        let peer = text("peer").or_else(|| text("from")).map(|a| labels.addr(&a));
        let seen = text("seen").map(|a| {
            let ip = a.rsplit_once(':').and_then(|(ip, _)| ip.parse::<Ipv4Addr>().ok());
            if ip.is_some() && ip == Self::place_ip(place) { "client".to_owned() } else { "other".to_owned() }
        });
        Observation {
            outcome: text("outcome").unwrap_or_else(|| "no-outcome".into()),
            server,
            peer,
            seen,
            bytes: reply["bytes"].as_u64(),
        }
    }
}

/// The state of one scenario's run.
struct Run {
    first_port: u16,
    clients: HashMap<Place, Client>,
    sockets: HashMap<&'static str, Socket>,
    /// The pod that answered each step so far.
    servers: Vec<Option<String>>,
    labels: Labels,
}

impl Run {
    fn port(&self, port: Port) -> u16 {
        match port {
            Port::Any => 0,
            Port::Nth(n) => {
                assert!(n < PORTS_PER_SCENARIO, "a scenario has {PORTS_PER_SCENARIO} ports");
                self.first_port + n
            }
        }
    }

    fn describe_port(&self, port: Port) -> String {
        match port {
            Port::Any => "any".into(),
            Port::Nth(n) => format!("P{n} ({})", self.first_port + n),
        }
    }

    fn place_of(&self, sock: &str) -> Result<Place> {
        self.sockets.get(sock).map(|s| s.place).with_context(|| format!("socket {sock} was never opened"))
    }
}

fn resolve_pod(pod: PodRef, servers: &[Option<String>]) -> Result<String> {
    match pod {
        PodRef::Named(name) => Ok(name.to_owned()),
        PodRef::ServerOf(k) => servers
            .get(k)
            .cloned()
            .flatten()
            .with_context(|| format!("step {k} had no answer to take the pod from")),
    }
}

/// Applies `change` to `spec`; a description of it.
fn apply_change(spec: &mut ClusterSpec, change: Change, servers: &[Option<String>]) -> Result<String> {
    Ok(match change {
        Change::RemoveEndpoint { service, pod } => {
            let pod = resolve_pod(pod, servers)?;
            let svc = spec.service_mut(service).with_context(|| format!("no Service {service}"))?;
            svc.endpoints.retain(|e| e.pod != pod);
            format!("remove {pod} from {service}'s endpoints")
        }
        Change::AddEndpoint { service, pod } => {
            let pod = resolve_pod(pod, servers)?;
            let ip = pod_ip(&pod).with_context(|| format!("no pod {pod}"))?;
            let svc = spec.service_mut(service).with_context(|| format!("no Service {service}"))?;
            svc.endpoints.retain(|e| e.pod != pod);
            svc.endpoints.push(EndpointSpec::ready(&pod, ip));
            format!("add {pod} to {service}'s endpoints")
        }
        Change::Conditions { service, pod, conditions } => {
            let pod = resolve_pod(pod, servers)?;
            let svc = spec.service_mut(service).with_context(|| format!("no Service {service}"))?;
            let endpoint = svc
                .endpoints
                .iter_mut()
                .find(|e| e.pod == pod)
                .with_context(|| format!("{pod} is not an endpoint of {service}"))?;
            endpoint.ready = conditions.ready;
            endpoint.serving = conditions.serving;
            endpoint.terminating = conditions.terminating;
            format!("{service}'s endpoint {pod}: {conditions:?}")
        }
        Change::DeleteService(service) => {
            spec.services.retain(|s| s.name != service);
            format!("delete Service {service}")
        }
    })
}
