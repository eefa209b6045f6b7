//! The node namespace, its pods, and the processes run inside them.
use std::ffi::OsStr;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use crate::cmd;
use crate::tools::{find_tool, require_root, require_tools};

/// Every namespace and temp dir a sandbox creates is named `kp-<pid>-<n>-<tag>…`.
pub const NETNS_PREFIX: &str = "kp-";
/// The pods' default gateway; the node-side veth answers ARP for it (proxy ARP).
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The IPv6 gateway of dual-stack pods ([`Pod::add_ipv6`]): a link-local address on every host veth.
pub const GATEWAY_IP6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The node's own address, on the portless bridge [`NODE_DEVICE`] (lets the node namespace reach
/// pods, and gives proxy ARP a route to [`GATEWAY_IP`] that is not via the asking veth).
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// Device in the node namespace that holds [`NODE_IP`] and the route to [`GATEWAY_IP`]: a bridge
/// with no ports (kernels here have no `dummy` driver), so packets routed to it are dropped: it
/// leads nowhere.
pub const NODE_DEVICE: &str = "kpnode0";

/// Deadline for one `exec` (setup commands and helpers have their own timeouts inside).
const EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline for the `ip`/`sysctl` commands that build the sandbox.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);
const IFNAMSIZ: usize = 15;

static COUNTER: AtomicU32 = AtomicU32::new(0);
static STALE_CLEANUP: Once = Once::new();

/// Keeps `[A-Za-z0-9_-]` (anything else becomes `_`), at most `max` characters.
pub(crate) fn sanitize(text: &str, max: usize) -> String {
    text.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .take(max)
        .collect()
}

pub(crate) fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

fn ip_cmd(args: &[&str]) -> Result<Command> {
    let mut cmd = Command::new(find_tool("ip")?);
    cmd.args(args);
    Ok(cmd)
}

/// `ip <args>` that must succeed.
pub(crate) fn ip(args: &[&str]) -> Result<String> {
    cmd::run_ok(ip_cmd(args)?, SETUP_TIMEOUT)
}

/// Sets sysctls (`key=value`) inside namespace `netns` (nsenter: /proc/sys/net is per namespace).
pub(crate) fn sysctl_in(netns: &str, settings: &[&str]) -> Result<()> {
    let mut cmd = Command::new(find_tool("nsenter")?);
    cmd.arg(format!("--net={}", netns_path(netns).display())).arg("--").arg(find_tool("sysctl")?);
    cmd.arg("-q").arg("-w").args(settings);
    cmd::run_ok(cmd, SETUP_TIMEOUT).map(drop)
}

/// Kills every process in namespace `netns` and deletes it. Errors are reported, not returned:
/// this runs from `Drop`.
pub(crate) fn delete_netns(netns: &str) {
    if !netns_path(netns).exists() {
        return;
    }
    if let Ok(pids) = ip(&["netns", "pids", netns]) {
        for pid in pids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            if pid > 1 && pid != std::process::id() as i32 {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    if let Err(err) = ip(&["netns", "del", netns]) {
        eprintln!("sandbox: could not delete netns {netns}: {err:#}");
    }
}

fn remove_dir(dir: &Path) {
    if dir.exists()
        && let Err(err) = std::fs::remove_dir_all(dir)
    {
        eprintln!("sandbox: could not remove {}: {err}", dir.display());
    }
}

fn pid_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// `(pid, n)` of a name made by this crate, `kp-<pid>-<n>-…` (with `prefix` = `kp-`).
fn parse_owned_name(name: &str, prefix: &str) -> Option<(u32, u32)> {
    let mut parts = name.strip_prefix(prefix)?.splitn(3, '-');
    let pid = parts.next()?.parse().ok()?;
    let n = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((pid, n))
}

/// Removes namespaces (and temp dirs) left behind by sandboxes of processes that no longer run:
/// names `<prefix><pid>-<n>-…` (the sandbox's own format) whose pid is dead. Sandboxes of live
/// processes, including concurrent test runs, are left alone. Returns the namespaces removed.
pub fn cleanup_stale(prefix: &str) -> Result<Vec<String>> {
    if prefix.is_empty() {
        bail!("cleanup_stale needs a non-empty prefix");
    }
    let stale = |name: &str| match parse_owned_name(name, prefix) {
        Some((pid, _)) => pid != std::process::id() && !pid_alive(pid),
        None => false,
    };
    let mut removed = Vec::new();
    match std::fs::read_dir("/run/netns") {
        Ok(entries) => {
            let mut names: Vec<String> =
                entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| stale(n)).collect();
            names.sort();
            for name in names {
                delete_netns(&name);
                if netns_path(&name).exists() {
                    bail!("could not remove stale netns {name}");
                }
                removed.push(name);
            }
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).context("listing /run/netns"),
    }
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            if let Some(name) = entry.file_name().to_str()
                && stale(name)
                && entry.path().is_dir()
            {
                remove_dir(&entry.path());
            }
        }
    }
    Ok(removed)
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum Owner {
    Node,
    Pod(String),
}

struct ChildEntry {
    /// Unique within the sandbox (pids can be reused).
    id: u32,
    owner: Owner,
    child: Child,
    /// Set once the child has exited and was reaped (its pid may be reused from then on).
    status: Option<ExitStatus>,
}

impl ChildEntry {
    /// The exit status if the child has exited (then its group is killed and it is reaped).
    fn poll(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() && cmd::has_exited(self.child.id())? {
            cmd::kill_group(self.child.id());
            self.status = Some(self.child.wait()?);
        }
        Ok(self.status)
    }

    /// Kills the process group (unless already reaped) and reaps the child.
    fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        cmd::kill_group(self.child.id());
        let status = self.child.wait()?;
        self.status = Some(status);
        Ok(status)
    }
}

struct PodRecord {
    name: String,
    netns: String,
    host_veth: String,
    dir: PathBuf,
    removed: bool,
}

#[derive(Default)]
struct State {
    pods: Vec<PodRecord>,
    children: Vec<ChildEntry>,
    next_pod: u32,
    next_log: u32,
    cleaned: bool,
}

struct Inner {
    base: String,
    node_ns: String,
    dir: PathBuf,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn kill_children(state: &mut State, owner: Option<&Owner>) {
        let (mine, rest): (Vec<_>, Vec<_>) =
            state.children.drain(..).partition(|c| owner.is_none_or(|o| *o == c.owner));
        state.children = rest;
        for mut entry in mine {
            let _ = entry.kill();
        }
    }

    fn remove_pod_locked(&self, state: &mut State, name: &str) {
        Self::kill_children(state, Some(&Owner::Pod(name.to_owned())));
        let Some(pod) = state.pods.iter_mut().find(|p| p.name == name && !p.removed) else { return };
        pod.removed = true;
        // Deleting the host veth first is synchronous (namespace teardown is not), so the node's
        // route and interface are gone when this returns.
        if netns_path(&self.node_ns).exists() {
            let _ = ip(&["-n", &self.node_ns, "link", "del", &pod.host_veth]);
        }
        delete_netns(&pod.netns);
        remove_dir(&pod.dir);
    }

    /// Kills processes, deletes pod namespaces, the node namespace, then the temp dir. Idempotent.
    fn cleanup(&self) {
        let mut state = self.lock();
        if state.cleaned {
            return;
        }
        state.cleaned = true;
        Self::kill_children(&mut state, None);
        let names: Vec<String> = state.pods.iter().filter(|p| !p.removed).map(|p| p.name.clone()).collect();
        for name in names {
            self.remove_pod_locked(&mut state, &name);
        }
        delete_netns(&self.node_ns);
        remove_dir(&self.dir);
    }

    fn spawn(self: &Arc<Self>, owner: Owner, mut command: Command) -> Result<Spawned> {
        let what = cmd::describe(&command);
        let mut state = self.lock();
        if state.cleaned {
            bail!("sandbox {} is already torn down", self.base);
        }
        state.next_log += 1;
        let label = match &owner {
            Owner::Node => "node".to_owned(),
            Owner::Pod(name) => sanitize(name, 32),
        };
        let log = self.dir.join("logs").join(format!("{}-{label}.log", state.next_log));
        std::fs::create_dir_all(self.dir.join("logs"))?;
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        command.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
        let child = command.spawn().with_context(|| format!("starting `{what}`"))?;
        let pid = child.id();
        let id = state.next_log;
        state.children.push(ChildEntry { id, owner, child, status: None });
        Ok(Spawned { inner: Arc::clone(self), id, pid, log, what })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// A process started with `spawn`. It runs until [`Spawned::kill`], or until its pod or the
/// sandbox is dropped (its whole process group is killed and reaped then); dropping this handle
/// does not stop it.
pub struct Spawned {
    inner: Arc<Inner>,
    id: u32,
    pid: u32,
    log: PathBuf,
    what: String,
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The command line, for messages.
    pub fn command_line(&self) -> &str {
        &self.what
    }

    /// File that receives the process's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// What the process has written to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read(&self.log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// `None` while running; the exit status once it has exited (it is reaped then).
    pub fn try_wait(&self) -> Result<Option<ExitStatus>> {
        let mut state = self.inner.lock();
        match state.children.iter_mut().find(|c| c.id == self.id) {
            Some(entry) => entry.poll(),
            None => {
                bail!("`{}` (pid {}) is no longer tracked: its pod or sandbox is gone", self.what, self.pid)
            }
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGTERM to the process group, waits up to `grace`, then SIGKILL; returns the exit
    /// status. For a clean shutdown (e.g. an agent that exits on SIGTERM).
    pub fn terminate(&self, grace: Duration) -> Result<ExitStatus> {
        if self.try_wait()?.is_none()
            && let Ok(pid) = i32::try_from(self.pid)
        {
            // SAFETY: kill has no memory-safety preconditions; the leader is unreaped, so the
            // group id is still ours.
            unsafe {
                libc::kill(-pid, libc::SIGTERM);
            }
        }
        if let Some(status) = self.wait_timeout(grace)? {
            return Ok(status);
        }
        self.kill()
    }

    /// Kills the process group (SIGKILL) and reaps the process; its exit status.
    pub fn kill(&self) -> Result<ExitStatus> {
        let mut state = self.inner.lock();
        match state.children.iter_mut().find(|c| c.id == self.id) {
            Some(entry) => entry.kill(),
            None => {
                bail!("`{}` (pid {}) is no longer tracked: its pod or sandbox is gone", self.what, self.pid)
            }
        }
    }
}

impl std::fmt::Debug for Spawned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spawned").field("pid", &self.pid).field("command", &self.what).finish()
    }
}

/// One node: a network namespace with `ip_forward=1`, no default route, and pods attached by
/// veth pairs. Dropping it kills every process it started and removes every namespace, veth and
/// temp file it made, also when a test panics.
pub struct Sandbox {
    inner: Arc<Inner>,
}

impl Sandbox {
    /// Creates the node namespace `kp-<pid>-<n>-<tag>-node`. The first sandbox of a process also
    /// removes what sandboxes of dead processes left behind ([`cleanup_stale`]).
    pub fn new(tag: &str) -> Result<Sandbox> {
        require_root()?;
        require_tools(&["ip", "nsenter", "sysctl", "ss"])?;
        STALE_CLEANUP.call_once(|| {
            if let Err(err) = cleanup_stale(NETNS_PREFIX) {
                eprintln!("sandbox: cleaning up stale namespaces failed: {err:#}");
            }
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = format!("{NETNS_PREFIX}{}-{n}-{}", std::process::id(), sanitize(tag, 16));
        let node_ns = format!("{base}-node");
        let dir = std::env::temp_dir().join(&base);
        // Leftovers of an earlier process with the same pid cannot be in use: start clean.
        remove_dir(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let inner = Arc::new(Inner { base, node_ns: node_ns.clone(), dir, state: Mutex::default() });
        // From here on, Drop removes whatever part was built.
        let sandbox = Sandbox { inner };
        delete_netns(&node_ns);
        ip(&["netns", "add", &node_ns])?;
        let node = node_ns.as_str();
        ip(&["-n", node, "link", "set", "lo", "up"])?;
        sysctl_in(
            node,
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )?;
        ip(&["-n", node, "link", "add", NODE_DEVICE, "type", "bridge"])?;
        ip(&["-n", node, "addr", "add", &format!("{NODE_IP}/32"), "dev", NODE_DEVICE])?;
        ip(&["-n", node, "link", "set", NODE_DEVICE, "up"])?;
        ip(&["-n", node, "route", "add", &format!("{GATEWAY_IP}/32"), "dev", NODE_DEVICE])?;
        Ok(sandbox)
    }

    /// `kp-<pid>-<n>-<tag>`: the prefix of every name this sandbox made.
    pub fn name(&self) -> &str {
        &self.inner.base
    }

    /// Name of the node namespace (under /run/netns).
    pub fn node_netns(&self) -> &str {
        &self.inner.node_ns
    }

    /// `/run/netns/<node namespace>`, for `nsenter --net=` or `setns`.
    pub fn node_netns_path(&self) -> PathBuf {
        netns_path(&self.inner.node_ns)
    }

    /// The sandbox's temp dir (logs, server configs); removed on drop.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Adds pod `name` with address `ip`: its own namespace, `eth0` with `ip/32`, default route
    /// via [`GATEWAY_IP`]; on the node a `veth<n>-<name>` (≤ 15 chars) with proxy ARP and a /32
    /// route to `ip`. Dropping the returned [`Pod`] removes the pod (the sandbox's drop does too).
    #[must_use = "dropping a Pod removes it"]
    pub fn add_pod(&self, name: &str, ip_addr: Ipv4Addr) -> Result<Pod> {
        if name.is_empty() {
            bail!("pod name must not be empty");
        }
        let inner = &self.inner;
        let clean = sanitize(name, 24);
        let (netns, host_veth, dir) = {
            let mut state = inner.lock();
            if state.cleaned {
                bail!("sandbox {} is already torn down", inner.base);
            }
            if state.pods.iter().any(|p| p.name == name && !p.removed) {
                bail!("pod {name} already exists in sandbox {}", inner.base);
            }
            let index = state.next_pod;
            state.next_pod += 1;
            let netns = format!("{}-p-{clean}", inner.base);
            let mut host_veth = format!("veth{index}-{clean}");
            host_veth.truncate(IFNAMSIZ);
            let dir = inner.dir.join("pods").join(format!("{index}-{clean}"));
            state.pods.push(PodRecord {
                name: name.to_owned(),
                netns: netns.clone(),
                host_veth: host_veth.clone(),
                dir: dir.clone(),
                removed: false,
            });
            (netns, host_veth, dir)
        };
        // From here on, a failure leaves a registered pod that the sandbox's drop removes.
        let pod = Pod {
            inner: Arc::clone(inner),
            name: name.to_owned(),
            ip: ip_addr,
            ip6: None,
            netns: netns.clone(),
            host_veth: host_veth.clone(),
            dir: dir.clone(),
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let node = inner.node_ns.as_str();
        let cidr = format!("{ip_addr}/32");
        delete_netns(&netns);
        ip(&["netns", "add", &netns])?;
        sysctl_in(&netns, &["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])?;
        ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        // Created in the node namespace with its peer placed straight into the pod's: nothing
        // ever appears in the root namespace.
        ip(&[
            "-n", node, "link", "add", &host_veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
        ])?;
        sysctl_in(
            node,
            &[
                &format!("net.ipv6.conf.{host_veth}.disable_ipv6=1"),
                &format!("net.ipv4.conf.{host_veth}.proxy_arp=1"),
                &format!("net.ipv4.neigh.{host_veth}.proxy_delay=0"),
                &format!("net.ipv4.conf.{host_veth}.rp_filter=0"),
            ],
        )?;
        sysctl_in(&netns, &["net.ipv6.conf.eth0.disable_ipv6=1"])?;
        ip(&["-n", node, "link", "set", &host_veth, "up"])?;
        ip(&["-n", &netns, "addr", "add", &cidr, "dev", "eth0"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &netns, "route", "add", &GATEWAY_IP.to_string(), "dev", "eth0", "scope", "link"])?;
        ip(&["-n", &netns, "route", "add", "default", "via", &GATEWAY_IP.to_string(), "dev", "eth0"])?;
        ip(&["-n", node, "route", "add", &cidr, "dev", &host_veth, "scope", "link"])?;
        Ok(pod)
    }

    /// `nsenter --net=/run/netns/<node> <args…>`, not yet run. `nsenter` only switches the
    /// network namespace, so the real bpffs at /sys/fs/bpf stays visible (`ip netns exec` would
    /// remount /sys and hide it).
    pub fn node_command<I, S>(&self, args: I) -> Result<Command>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(find_tool("nsenter")?);
        command.arg(format!("--net={}", self.node_netns_path().display())).arg("--").args(args);
        Ok(command)
    }

    /// Runs a command in the node namespace; its stdout, or an error if it exits non-zero.
    pub fn node_exec<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run_ok(self.node_command(args)?, EXEC_TIMEOUT)
    }

    /// Runs a command in the node namespace and returns its raw output, whatever its exit status.
    pub fn node_exec_output<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run(self.node_command(args)?, EXEC_TIMEOUT)
    }

    /// Starts a long-running command in the node namespace (e.g. `kproxy agent`).
    pub fn node_spawn<I, S>(&self, args: I) -> Result<Spawned>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.node_spawn_command(self.node_command(args)?)
    }

    /// Starts a command built with [`Sandbox::node_command`] (to add env vars or a cwd).
    pub fn node_spawn_command(&self, command: Command) -> Result<Spawned> {
        self.inner.spawn(Owner::Node, command)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.inner.cleanup();
    }
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("name", &self.inner.base).finish()
    }
}

/// A pod of a [`Sandbox`]. Dropping it kills its processes and removes its namespace and veth.
pub struct Pod {
    inner: Arc<Inner>,
    name: String,
    ip: Ipv4Addr,
    /// Set by [`Pod::add_ipv6`]: the pod is dual-stack.
    ip6: Option<Ipv6Addr>,
    netns: String,
    host_veth: String,
    dir: PathBuf,
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The pod's IPv6 address, when [`Pod::add_ipv6`] made it dual-stack.
    pub fn ip6(&self) -> Option<Ipv6Addr> {
        self.ip6
    }

    /// Makes the pod dual-stack: IPv6 on in the pod and on its host veth, `eth0` with `addr/128`, a
    /// default route via [`GATEWAY_IP6`] (the link-local address every host veth holds, as Calico's
    /// `fe80::ecee:eeff:feee:eeee`), and on the node a /128 route to `addr` and IPv6 forwarding on.
    /// Addresses skip duplicate address detection, which would leave them unusable for a second.
    pub fn add_ipv6(&mut self, addr: Ipv6Addr) -> Result<()> {
        let node = self.inner.node_ns.as_str();
        let (netns, veth) = (self.netns.as_str(), self.host_veth.as_str());
        sysctl_in(
            node,
            &[
                "net.ipv6.conf.all.forwarding=1",
                &format!("net.ipv6.conf.{veth}.accept_dad=0"),
                &format!("net.ipv6.conf.{veth}.disable_ipv6=0"),
            ],
        )?;
        sysctl_in(
            netns,
            &[
                "net.ipv6.conf.all.disable_ipv6=0",
                "net.ipv6.conf.eth0.accept_dad=0",
                "net.ipv6.conf.eth0.disable_ipv6=0",
            ],
        )?;
        let gateway = format!("{GATEWAY_IP6}/64");
        ip(&["-n", node, "-6", "addr", "add", &gateway, "dev", veth, "nodad"])?;
        ip(&["-n", netns, "-6", "addr", "add", &format!("{addr}/128"), "dev", "eth0", "nodad"])?;
        ip(&["-n", netns, "-6", "route", "add", "default", "via", &GATEWAY_IP6.to_string(), "dev", "eth0"])?;
        ip(&["-n", node, "-6", "route", "add", &format!("{addr}/128"), "dev", veth])?;
        self.ip6 = Some(addr);
        Ok(())
    }

    /// Name of the pod's namespace (under /run/netns).
    pub fn netns(&self) -> &str {
        &self.netns
    }

    pub fn netns_path(&self) -> PathBuf {
        netns_path(&self.netns)
    }

    /// The node-side veth (in the node namespace), e.g. `veth0-web-1`.
    pub fn host_veth(&self) -> &str {
        &self.host_veth
    }

    /// The pod's temp dir (server configs); removed with the pod.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `ip netns exec <pod namespace> <args…>`, not yet run.
    pub fn command<I, S>(&self, args: I) -> Result<Command>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(find_tool("ip")?);
        command.args(["netns", "exec", &self.netns]).args(args);
        Ok(command)
    }

    /// Runs a command in the pod; its stdout, or an error if it exits non-zero.
    pub fn exec<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run_ok(self.command(args)?, EXEC_TIMEOUT)
    }

    /// Runs a command in the pod and returns its raw output, whatever its exit status.
    pub fn exec_output<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        cmd::run(self.command(args)?, EXEC_TIMEOUT)
    }

    /// Starts a long-running command in the pod.
    pub fn spawn<I, S>(&self, args: I) -> Result<Spawned>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.spawn_command(self.command(args)?)
    }

    /// Starts a command built with [`Pod::command`].
    pub fn spawn_command(&self, command: Command) -> Result<Spawned> {
        self.inner.spawn(Owner::Pod(self.name.clone()), command)
    }

    /// `curl -sS --max-time 5 <url>` from the pod: the response body.
    pub fn curl(&self, url: &str) -> Result<String> {
        let curl = find_tool("curl")?;
        self.exec([
            curl.as_os_str(),
            OsStr::new("-sS"),
            OsStr::new("--max-time"),
            OsStr::new("5"),
            OsStr::new(url),
        ])
    }

    /// `dig +short +time=2 +tries=1 @<server> <name> <rtype>` from the pod (UDP).
    pub fn dig(&self, server: impl Into<IpAddr>, name: &str, rtype: &str) -> Result<String> {
        self.dig_with(server, name, rtype, &[])
    }

    /// Like [`Pod::dig`], over TCP.
    pub fn dig_tcp(&self, server: impl Into<IpAddr>, name: &str, rtype: &str) -> Result<String> {
        self.dig_with(server, name, rtype, &["+tcp"])
    }

    fn dig_with(&self, server: impl Into<IpAddr>, name: &str, rtype: &str, extra: &[&str]) -> Result<String> {
        let dig = find_tool("dig")?;
        let mut args: Vec<String> =
            vec![dig.to_string_lossy().into_owned(), "+short".into(), "+time=2".into(), "+tries=1".into()];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args.extend([format!("@{}", server.into()), name.to_owned(), rtype.to_owned()]);
        self.exec(&args)
    }

    /// Waits until something in the pod listens on `proto` ("tcp" or "udp") `port`, checking that
    /// `process` (if given) is still running. Polls `ss` inside the pod.
    pub fn wait_listening(
        &self,
        proto: &str,
        port: u16,
        process: Option<&Spawned>,
        timeout: Duration,
    ) -> Result<()> {
        let flag = match proto {
            "tcp" => "-Hlnt",
            "udp" => "-Hlnu",
            other => bail!("wait_listening: unknown protocol {other}"),
        };
        let ss = find_tool("ss")?;
        let suffix = format!(":{port}");
        let deadline = Instant::now() + timeout;
        loop {
            let out = self.exec([ss.as_os_str(), OsStr::new(flag)])?;
            let listening = out
                .lines()
                .any(|line| line.split_whitespace().nth(3).is_some_and(|local| local.ends_with(&suffix)));
            if listening {
                return Ok(());
            }
            if let Some(process) = process
                && let Some(status) = process.try_wait()?
            {
                bail!(
                    "`{}` in pod {} exited ({status}) before listening on {proto}/{port}; its output:\n{}",
                    process.command_line(),
                    self.name,
                    process.log()
                );
            }
            if Instant::now() >= deadline {
                bail!("nothing listens on {proto}/{port} in pod {} after {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let mut state = self.inner.lock();
        if !state.cleaned {
            self.inner.remove_pod_locked(&mut state, &self.name);
        }
    }
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod")
            .field("name", &self.name)
            .field("ip", &self.ip)
            .field("netns", &self.netns)
            .field("host_veth", &self.host_veth)
            .finish()
    }
}
