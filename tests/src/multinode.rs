//! A multi-node cluster sandbox: N node [`Sandbox`]es joined by an "underlay" network, plus an
//! external client, for NodePort / ExternalIP / LoadBalancer / externalTrafficPolicy / XDP tests.
//!
//! Layout (all in namespaces this module creates; nothing is added to the root namespace):
//! - an underlay namespace `kpm-<pid>-<n>-<tag>-u` holding the bridge [`UNDERLAY_BRIDGE`];
//! - node `i` is a regular [`Sandbox`] (`kp-<pid>-<m>-<tag>-n<i>-node`) whose [`NODE_EXTERNAL_DEVICE`]
//!   (`eth0`, its "external interface") is a veth to the bridge with [`MultiNode::node_ip`]
//!   (`192.168.100.(10+i)/24`); node `i` owns the pod CIDR `10.244.i.0/24` and every node routes
//!   every other node's pod CIDR via that node's underlay address;
//! - an external client namespace `kpm-<pid>-<n>-<tag>-x` with [`EXTERNAL_IP`]`/24` on `eth0`,
//!   and a route for [`EXTERNAL_SERVICE_RANGE`] (ExternalIPs / LB IPs) via node 0. It has no route
//!   to Service or pod ranges: it reaches Services only through node addresses.
//!
//! No namespace has a default route, and IPv6 is off on every link. Dropping a [`MultiNode`]
//! (panics included) removes the nodes (each [`Sandbox`] removes itself), the client and the
//! underlay; [`cleanup_stale_multinode`] removes what a killed run left behind.
use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Result, bail};

use crate::cmd;
use crate::sandbox::{delete_netns, ip, netns_path, sanitize, sysctl_in};
use crate::tools::{find_tool, require_root, require_tools};
use crate::{Pod, Sandbox, Spawned, cleanup_stale};

/// Prefix of the underlay and external-client namespaces: `kpm-<pid>-<n>-<tag>-{u,x}`.
pub const MULTINODE_PREFIX: &str = "kpm-";
/// Name of each node's external interface (the veth to the underlay bridge).
pub const NODE_EXTERNAL_DEVICE: &str = "eth0";
/// The bridge in the underlay namespace.
pub const UNDERLAY_BRIDGE: &str = "br0";
/// Prefix length of the underlay network 192.168.100.0/24.
pub const UNDERLAY_PREFIX_LEN: u8 = 24;
/// The external client's address on the underlay.
pub const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 200);
/// ExternalIP / LoadBalancer range; the external client routes it via node 0.
pub const EXTERNAL_SERVICE_RANGE: &str = "192.168.200.0/24";
/// Most nodes a [`MultiNode`] may have (node addresses stay below [`EXTERNAL_IP`]).
pub const MAX_NODES: usize = 100;

const EXEC_TIMEOUT: Duration = Duration::from_secs(60);

static COUNTER: AtomicU32 = AtomicU32::new(0);
static STALE_CLEANUP: Once = Once::new();

/// Removes underlay and client namespaces left by multi-node sandboxes of dead processes
/// (`kpm-<pid>-<n>-…` with a dead pid). Their node namespaces use the [`Sandbox`] pattern and
/// are removed by [`cleanup_stale`]`(`[`crate::NETNS_PREFIX`]`)`. Returns the namespaces removed.
pub fn cleanup_stale_multinode() -> Result<Vec<String>> {
    cleanup_stale(MULTINODE_PREFIX)
}

/// Pod CIDR of node `i`: `10.244.i.0/24`.
pub fn pod_cidr(node: usize) -> String {
    format!("10.244.{node}.0/24")
}

/// Address `host` in node `node`'s pod CIDR: `10.244.node.host`.
pub fn pod_ip(node: usize, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, u8::try_from(node).expect("node index fits the pod CIDR scheme"), host)
}

/// Underlay address of node `i`: `192.168.100.(10+i)`.
pub fn node_underlay_ip(node: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 100, u8::try_from(10 + node).expect("node index fits the underlay"))
}

/// N nodes on an underlay bridge plus an external client. See the module docs.
pub struct MultiNode {
    base: String,
    underlay_ns: String,
    external_ns: String,
    nodes: Vec<Sandbox>,
}

impl MultiNode {
    /// Builds the underlay, `nodes` node sandboxes (tag `<tag>-n<i>`) and the external client.
    /// The first one of a process also removes leftovers of dead processes.
    pub fn new(tag: &str, nodes: usize) -> Result<MultiNode> {
        require_root()?;
        require_tools(&["ip", "nsenter", "sysctl"])?;
        if nodes == 0 || nodes > MAX_NODES {
            bail!("a multi-node sandbox needs 1..={MAX_NODES} nodes, not {nodes}");
        }
        STALE_CLEANUP.call_once(|| {
            if let Err(err) = cleanup_stale_multinode() {
                eprintln!("multinode: cleaning up stale namespaces failed: {err:#}");
            }
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tag = sanitize(tag, 12);
        let base = format!("{MULTINODE_PREFIX}{}-{n}-{tag}", std::process::id());
        // From here on, Drop removes whatever part was built.
        let mut multi = MultiNode {
            underlay_ns: format!("{base}-u"),
            external_ns: format!("{base}-x"),
            base,
            nodes: Vec::with_capacity(nodes),
        };
        multi.build_underlay()?;
        for i in 0..nodes {
            let node = Sandbox::new(&format!("{tag}-n{i}"))?;
            multi.nodes.push(node);
            multi.attach_node(i)?;
        }
        for i in 0..nodes {
            let node_ns = multi.nodes[i].node_netns().to_owned();
            for j in (0..nodes).filter(|&j| j != i) {
                let via = node_underlay_ip(j).to_string();
                ip(&[
                    "-n",
                    &node_ns,
                    "route",
                    "add",
                    &pod_cidr(j),
                    "via",
                    &via,
                    "dev",
                    NODE_EXTERNAL_DEVICE,
                ])?;
            }
        }
        multi.build_external()?;
        Ok(multi)
    }

    fn build_underlay(&self) -> Result<()> {
        let u = self.underlay_ns.as_str();
        delete_netns(u);
        ip(&["netns", "add", u])?;
        sysctl_in(u, &["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])?;
        ip(&["-n", u, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            u,
            "link",
            "add",
            UNDERLAY_BRIDGE,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ])?;
        ip(&["-n", u, "link", "set", UNDERLAY_BRIDGE, "up"])?;
        Ok(())
    }

    /// Underlay-side port `port` (in the underlay namespace) ⇄ `eth0` in `netns`, with `addr`.
    fn attach(&self, netns: &str, port: &str, addr: Ipv4Addr) -> Result<()> {
        let u = self.underlay_ns.as_str();
        ip(&[
            "-n",
            u,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            NODE_EXTERNAL_DEVICE,
            "netns",
            netns,
        ])?;
        sysctl_in(u, &[&format!("net.ipv6.conf.{port}.disable_ipv6=1")])?;
        ip(&["-n", u, "link", "set", port, "master", UNDERLAY_BRIDGE])?;
        ip(&["-n", u, "link", "set", port, "up"])?;
        sysctl_in(
            netns,
            &[
                &format!("net.ipv6.conf.{NODE_EXTERNAL_DEVICE}.disable_ipv6=1"),
                &format!("net.ipv4.conf.{NODE_EXTERNAL_DEVICE}.rp_filter=0"),
            ],
        )?;
        ip(&[
            "-n",
            netns,
            "addr",
            "add",
            &format!("{addr}/{UNDERLAY_PREFIX_LEN}"),
            "dev",
            NODE_EXTERNAL_DEVICE,
        ])?;
        ip(&["-n", netns, "link", "set", NODE_EXTERNAL_DEVICE, "up"])?;
        self.make_wire(netns, port)
    }

    /// Makes a veth pair behave like a NIC on a wire, as XDP on a real external interface
    /// sees it: packets leave `eth0` with complete checksums (a veth otherwise hands over the
    /// partial ones of checksum offload, which XDP cannot tell apart and XDP_TX would send on
    /// unfinished), and the underlay-side port receives what XDP sends back out of `eth0` (a
    /// veth has a receive queue for that only when GRO or an XDP program is on: a pass-all XDP
    /// program, as GRO would merge a bulk transfer's segments before the other nodes' XDP sees
    /// them — no wire does that, and a merged frame through XDP on veth loses its GSO state).
    fn make_wire(&self, netns: &str, port: &str) -> Result<()> {
        let ethtool = find_tool("ethtool")?;
        let mut command = Command::new(find_tool("ip")?);
        command.args(["netns", "exec", netns]).arg(&ethtool).args(["-K", NODE_EXTERNAL_DEVICE, "tx", "off"]);
        cmd::run_ok(command, EXEC_TIMEOUT)?;
        let pin = Path::new("/sys/fs/bpf").join(format!("{}-{port}-xdp-pass", self.base));
        crate::xdp_pass::attach(&self.underlay_ns, port, &pin)
    }

    fn attach_node(&self, i: usize) -> Result<()> {
        let node_ns = self.nodes[i].node_netns().to_owned();
        self.attach(&node_ns, &format!("n{i}"), node_underlay_ip(i))
    }

    fn build_external(&self) -> Result<()> {
        let x = self.external_ns.as_str();
        delete_netns(x);
        ip(&["netns", "add", x])?;
        sysctl_in(x, &["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])?;
        ip(&["-n", x, "link", "set", "lo", "up"])?;
        self.attach(x, "x", EXTERNAL_IP)?;
        let via = node_underlay_ip(0).to_string();
        ip(&["-n", x, "route", "add", EXTERNAL_SERVICE_RANGE, "via", &via, "dev", NODE_EXTERNAL_DEVICE])?;
        Ok(())
    }

    /// `kpm-<pid>-<n>-<tag>`: prefix of the underlay and client namespace names.
    pub fn name(&self) -> &str {
        &self.base
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Node `i` (panics if out of range). Its `node_exec`/`node_spawn` run in its namespace.
    pub fn node(&self, i: usize) -> &Sandbox {
        &self.nodes[i]
    }

    pub fn nodes(&self) -> &[Sandbox] {
        &self.nodes
    }

    /// Node `i`'s address on its [`NODE_EXTERNAL_DEVICE`].
    pub fn node_ip(&self, i: usize) -> Ipv4Addr {
        assert!(i < self.nodes.len(), "node {i} out of range (have {})", self.nodes.len());
        node_underlay_ip(i)
    }

    /// The external client's address, [`EXTERNAL_IP`].
    pub fn external_ip(&self) -> Ipv4Addr {
        EXTERNAL_IP
    }

    /// Name of the underlay namespace (holds [`UNDERLAY_BRIDGE`] and ports `n<i>`, `x`).
    pub fn underlay_netns(&self) -> &str {
        &self.underlay_ns
    }

    /// Name of the external client namespace.
    pub fn external_netns(&self) -> &str {
        &self.external_ns
    }

    pub fn external_netns_path(&self) -> PathBuf {
        netns_path(&self.external_ns)
    }

    /// Adds a Calico-style pod on node `node` (see [`Sandbox::add_pod`]); `ip` should lie in
    /// [`pod_cidr`]`(node)` for other nodes to reach it.
    #[must_use = "dropping a Pod removes it"]
    pub fn add_pod(&self, node: usize, name: &str, ip_addr: Ipv4Addr) -> Result<Pod> {
        let Some(sandbox) = self.nodes.get(node) else {
            bail!("node {node} out of range (have {})", self.nodes.len());
        };
        sandbox.add_pod(name, ip_addr)
    }

    /// `ip netns exec <client namespace> <args…>`, not yet run.
    pub fn external_command<I, S>(&self, args: I) -> Result<Command>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(find_tool("ip")?);
        command.args(["netns", "exec", &self.external_ns]).args(args);
        Ok(command)
    }

    /// Runs a command in the external client; its stdout, or an error if it exits non-zero.
    pub fn external_exec<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run_ok(self.external_command(args)?, EXEC_TIMEOUT)
    }

    /// Runs a command in the external client and returns its raw output, whatever its status.
    pub fn external_exec_output<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run(self.external_command(args)?, EXEC_TIMEOUT)
    }

    /// Starts a long-running command in the external client. The process is tracked (and killed
    /// on drop) by node 0's [`Sandbox`]; its log lands in node 0's temp dir.
    pub fn external_spawn<I, S>(&self, args: I) -> Result<Spawned>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.nodes[0].node_spawn_command(self.external_command(args)?)
    }

    /// Removes everything; idempotent.
    fn cleanup(&mut self) {
        // Node sandboxes first: they kill their (and the client's) processes and take their
        // `eth0` veths with their namespaces.
        self.nodes.clear();
        delete_netns(&self.external_ns);
        delete_netns(&self.underlay_ns);
    }
}

impl Drop for MultiNode {
    fn drop(&mut self) {
        self.cleanup();
    }
}

impl std::fmt::Debug for MultiNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiNode").field("name", &self.base).field("nodes", &self.nodes).finish()
    }
}

#[cfg(test)]
mod cluster_sandbox_tests {
    use std::time::Instant;

    use super::*;
    use crate::tests::netns_with_prefix;

    #[test]
    fn pods_on_different_nodes_reach_each_other_through_the_underlay() {
        require_tools(&["nginx", "curl"]).unwrap();
        let multi = MultiNode::new("pp", 2).unwrap();
        let node_names: Vec<String> = multi.nodes().iter().map(|n| format!("{}-", n.name())).collect();
        let own = format!("{}-", multi.name());
        assert_eq!(netns_with_prefix(&own).len(), 2, "underlay + client");

        // Node layout: eth0 with the underlay address, routes to the other node's pod CIDR, no
        // default route.
        for i in 0..2 {
            let addrs = multi.node(i).node_exec(["ip", "-4", "addr", "show", "dev", "eth0"]).unwrap();
            assert!(addrs.contains(&format!("{}/24", multi.node_ip(i))), "{addrs}");
            let routes = multi.node(i).node_exec(["ip", "route", "show"]).unwrap();
            assert!(!routes.contains("default"), "node {i} must have no default route:\n{routes}");
            let other = 1 - i;
            assert!(
                routes.contains(&format!("{} via {} dev eth0", pod_cidr(other), multi.node_ip(other))),
                "{routes}"
            );
        }

        let web = multi.add_pod(1, "web", pod_ip(1, 10)).unwrap();
        let client = multi.add_pod(0, "client", pod_ip(0, 10)).unwrap();
        assert!(web.host_veth().starts_with("veth"));
        web.start_nginx("hello from node 1\n").unwrap();
        let body = client.curl(&format!("http://{}/", web.ip())).unwrap();
        assert_eq!(body, "hello from node 1\n");
        // No NAT on the way: the server sees the client pod's own address.
        let seen = client.curl(&format!("http://{}/client", web.ip())).unwrap();
        assert_eq!(seen.trim(), client.ip().to_string());

        drop(client);
        drop(web);
        drop(multi);
        assert!(netns_with_prefix(&own).is_empty(), "{:?}", netns_with_prefix(&own));
        for prefix in node_names {
            assert!(netns_with_prefix(&prefix).is_empty(), "{:?}", netns_with_prefix(&prefix));
        }
    }

    #[test]
    fn external_client_reaches_a_node_address() {
        require_tools(&["nc", "ss"]).unwrap();
        let multi = MultiNode::new("ext", 2).unwrap();
        let own = format!("{}-", multi.name());
        let node_names: Vec<String> = multi.nodes().iter().map(|n| format!("{}-", n.name())).collect();

        let routes = multi.external_exec(["ip", "route", "show"]).unwrap();
        assert!(!routes.contains("default"), "client must have no default route:\n{routes}");
        assert!(
            routes.contains(&format!("{EXTERNAL_SERVICE_RANGE} via {} dev eth0", multi.node_ip(0))),
            "{routes}"
        );
        assert!(!routes.contains("10.96.") && !routes.contains("10.244."), "{routes}");
        let addrs = multi.external_exec(["ip", "-4", "addr", "show", "dev", "eth0"]).unwrap();
        assert!(addrs.contains(&format!("{}/24", multi.external_ip())), "{addrs}");

        // A TCP listener on node 1's underlay address; the client connects and reads its greeting.
        let node1 = multi.node(1);
        let target = multi.node_ip(1).to_string();
        let nc = find_tool("nc").unwrap();
        let listener = node1
            .node_spawn([
                "sh".as_ref(),
                "-c".as_ref(),
                format!("echo hello-from-node1 | {} -l -N {target} 9000", nc.display()).as_ref(),
            ] as [&OsStr; 3])
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = node1.node_exec(["ss", "-Hlnt"]).unwrap();
            if out.contains(&format!("{target}:9000")) {
                break;
            }
            assert!(listener.is_running(), "listener exited: {}", listener.log());
            assert!(Instant::now() < deadline, "nc never listened: {}", listener.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        let got = multi.external_exec([
            nc.as_os_str(),
            "-w".as_ref(),
            "5".as_ref(),
            target.as_ref(),
            "9000".as_ref(),
        ]);
        assert_eq!(got.unwrap().trim(), "hello-from-node1");

        // A process spawned in the client is killed on drop.
        let sleeper = multi.external_spawn(["sleep", "600"]).unwrap();
        let pid = sleeper.pid();
        assert!(sleeper.is_running());
        drop(multi);
        assert!(
            !std::path::Path::new("/proc").join(pid.to_string()).exists(),
            "client process {pid} survived"
        );
        assert!(netns_with_prefix(&own).is_empty(), "{:?}", netns_with_prefix(&own));
        for prefix in node_names {
            assert!(netns_with_prefix(&prefix).is_empty(), "{:?}", netns_with_prefix(&prefix));
        }
    }

    #[test]
    fn cleanup_on_panic_and_rejects_bad_sizes() {
        assert!(MultiNode::new("bad", 0).is_err());
        let names = std::sync::Mutex::new(Vec::new());
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let multi = MultiNode::new("pnc", 1).unwrap();
            names.lock().unwrap().push(format!("{}-", multi.name()));
            names.lock().unwrap().push(format!("{}-", multi.node(0).name()));
            panic!("boom");
        }));
        assert!(result.is_err());
        let names = names.into_inner().unwrap();
        assert_eq!(names.len(), 2);
        for prefix in names {
            assert!(netns_with_prefix(&prefix).is_empty(), "{:?}", netns_with_prefix(&prefix));
        }
    }
}
