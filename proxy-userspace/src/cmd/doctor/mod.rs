//! `kproxy doctor`: checks the node for what breaks a service proxy.
//!
//! Each check ends OK, WARN or FAIL with a one-line finding and, unless OK,
//! the fix to apply. The exit status is 1 when any check FAILs.
//!
//! - **kernel**: TCX links need 6.6 (FAIL below).
//! - **btf**: `/sys/kernel/btf/vmlinux` (WARN when missing).
//! - **bpffs**: bpffs mounted at `/sys/fs/bpf` (WARN: `kproxy load` mounts it, but pins must live there).
//! - **cgroup2**: a cgroup2 mount, unified or hybrid (WARN when none).
//! - **bpffs-host**: the bpffs of `--pin-dir` is the host's (FAIL when it is private to this mount
//!   namespace, as under `ip netns exec`: pins made there vanish with it).
//! - **datapath**: programs and maps pinned under `--pin-dir` (FAIL when not), and the agent that
//!   holds the pin directory.
//! - **attach**: both hooks on every interface matching `--interfaces` in this network namespace
//!   (one WARN per interface missing a hook; FAIL, listing the interfaces there are, when none
//!   matches: a Calico `cali*` or Cilium `lxc*` node checked with the default `veth*`).
//! - **map \<name\>**: entries / capacity; hash maps WARN above 80 %, FAIL when full (inserts fail);
//!   the LRU maps (conntrack, affinity) WARN when (nearly) full: they evict.
//! - **north-south**: the external interfaces (tc, XDP) from the link pins (informational).
//! - **socket-lb**: the socket hooks and their mode: host-only or on OK; off WARN (the node's own
//!   processes cannot reach cluster IPs).
//! - **agent**: `GET /healthz` on `--healthz-address`: 200 OK, 503 FAIL, nothing listening WARN.
//! - **ip_forward**: at runtime and after the next boot, following sysctl's precedence (which file
//!   and line sets it): runtime 0 FAIL, runtime 1 but persisted 0 (the incident of
//!   shared/cases/001) or not persisted WARN.
//! - **rp_filter**: `net.ipv4.conf.{all,default}.rp_filter` strict (1) WARN.
//! - **kube-proxy**: kube-proxy running FAIL (both translate); its rules left behind WARN.
//!
//! With `--root DIR` the files of a mounted node image are read instead
//! (`DIR/etc/sysctl.d/...`, `DIR/proc/...` when present); the checks of
//! the running datapath, agent and netfilter are skipped.

use std::{
    fmt::Write as _,
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, ToSocketAddrs as _},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::Result;
use serde::Serialize;

use crate::bpf::{self, Hook, InterfaceSelector, PinDir};

#[derive(clap::Args, Debug, Default)]
pub struct DoctorArgs {
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Check a mounted node image: read DIR/etc/sysctl.d/..., DIR/proc/sys/...
    /// instead of /; the running datapath, agent and netfilter are not checked.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Pod-facing interfaces (globs) that must carry both programs.
    #[arg(long, num_args = 1.., default_values = ["veth*"])]
    pub interfaces: Vec<String>,
    /// Where the agent serves /healthz.
    #[arg(long, default_value = "127.0.0.1:10256")]
    pub healthz_address: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub finding: String,
    /// What to do; `None` when OK.
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: impl Into<String>, finding: impl Into<String>) -> Self {
        Check { name: name.into(), status: Status::Ok, finding: finding.into(), fix: None }
    }
    fn warn(name: impl Into<String>, finding: impl Into<String>, fix: impl Into<String>) -> Self {
        Check { name: name.into(), status: Status::Warn, finding: finding.into(), fix: Some(fix.into()) }
    }
    fn fail(name: impl Into<String>, finding: impl Into<String>, fix: impl Into<String>) -> Self {
        Check { name: name.into(), status: Status::Fail, finding: finding.into(), fix: Some(fix.into()) }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    /// The node image checked (`--root`), or null for this node.
    pub root: Option<PathBuf>,
    pub checks: Vec<Check>,
    /// Checks not run, with why.
    pub skipped: Vec<String>,
}

impl Report {
    pub fn worst(&self) -> Status {
        self.checks.iter().map(|c| c.status).max().unwrap_or(Status::Ok)
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        if let Some(root) = &self.root {
            let _ = writeln!(out, "node image at {}", root.display());
        }
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for check in &self.checks {
            let _ = writeln!(out, "{:<4}  {:<width$}  {}", check.status.label(), check.name, check.finding);
            if let Some(fix) = &check.fix {
                let _ = writeln!(out, "{:<4}  {:<width$}  fix: {fix}", "", "");
            }
        }
        for skipped in &self.skipped {
            let _ = writeln!(out, "skipped: {skipped}");
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        let _ = writeln!(
            out,
            "{} OK, {} WARN, {} FAIL",
            count(Status::Ok),
            count(Status::Warn),
            count(Status::Fail)
        );
        out
    }
}

/// Prints the report; returns the process exit status (non-zero on FAIL).
pub fn run(pins: &PinDir, args: &DoctorArgs) -> Result<i32> {
    let report = collect(pins, args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(if report.worst() == Status::Fail { 1 } else { 0 })
}

/// Runs every check.
pub fn collect(pins: &PinDir, args: &DoctorArgs) -> Result<Report> {
    let root = args.root.as_deref();
    if let Some(root) = root
        && !root.is_dir()
    {
        anyhow::bail!("--root {}: not a directory", root.display());
    }
    let selector = InterfaceSelector::new(&args.interfaces)?;
    let mut checks = vec![kernel_check(root), btf_check(root)];
    let mounts = read(&host(root, "/proc/mounts"));
    checks.push(bpffs_check(mounts.as_deref(), root.is_some()));
    checks.push(cgroup2_check(mounts.as_deref(), root.is_some()));
    let mut skipped = Vec::new();
    if root.is_none() {
        checks.push(bpffs_host_check(pins));
        checks.extend(datapath_checks(pins, &selector, &args.interfaces));
        checks.push(agent_check(&args.healthz_address));
    } else {
        skipped.push(
            "bpffs-host, datapath, attach, maps and agent: they belong to a running node, not an image"
                .to_owned(),
        );
    }
    let files = SysctlFiles::read(root);
    checks.push(ip_forward_check(
        runtime_sysctl(root, "net.ipv4.ip_forward"),
        files.effective("net.ipv4.ip_forward"),
    ));
    checks.push(rp_filter_check([
        (
            "all",
            runtime_sysctl(root, "net.ipv4.conf.all.rp_filter"),
            files.effective("net.ipv4.conf.all.rp_filter"),
        ),
        (
            "default",
            runtime_sysctl(root, "net.ipv4.conf.default.rp_filter"),
            files.effective("net.ipv4.conf.default.rp_filter"),
        ),
    ]));
    let snat_range = if root.is_none() {
        crate::bpf::Maps::from_pins(pins).ok().and_then(|maps| maps.nodeport_config.get(&0, 0).ok())
    } else {
        None
    }
    .unwrap_or_default()
    .port_range();
    checks.push(snat_ports_check(
        runtime_sysctl(root, "net.ipv4.ip_local_port_range"),
        runtime_sysctl(root, "net.ipv4.ip_local_reserved_ports"),
        snat_range,
    ));
    if root.is_none() {
        checks.push(kube_proxy_check());
    } else {
        skipped.push("kube-proxy: its rules live in the running kernel".to_owned());
    }
    Ok(Report { root: root.map(Path::to_path_buf), checks, skipped })
}

/// `path` on the node checked: under `root` when given.
fn host(root: Option<&Path>, path: &str) -> PathBuf {
    match root {
        Some(root) => root.join(path.trim_start_matches('/')),
        None => PathBuf::from(path),
    }
}

fn read(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok()
}

// ---------------------------------------------------------------- kernel

/// `6.18.0-1-amd64` → (6, 18).
pub fn parse_kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The decision on a kernel release (`source` says where it was read).
pub fn kernel_verdict(release: &str, source: &str) -> Check {
    match parse_kernel_version(release) {
        None => Check::warn(
            "kernel",
            format!("cannot parse kernel release {release:?} ({source})"),
            "check `uname -r`",
        ),
        Some((major, minor)) if (major, minor) < (6, 6) => Check::fail(
            "kernel",
            format!("kernel {release} ({source}) is older than 6.6: no TCX links, kproxy cannot attach"),
            "boot a kernel 6.6 or newer",
        ),
        Some(_) => Check::ok("kernel", format!("kernel {release} ({source}) has TCX (6.6+)")),
    }
}

fn kernel_check(root: Option<&Path>) -> Check {
    if let Some(release) = read(&host(root, "/proc/sys/kernel/osrelease")) {
        return kernel_verdict(release.trim(), "running");
    }
    let Some(root) = root else {
        return Check::warn(
            "kernel",
            "cannot read /proc/sys/kernel/osrelease",
            "check `uname -r`: 6.6+ is needed",
        );
    };
    // An image: the newest kernel installed.
    let mut installed: Vec<(Option<(u32, u32)>, String)> = ["lib/modules", "usr/lib/modules"]
        .iter()
        .filter_map(|d| fs::read_dir(root.join(d)).ok())
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .map(|name| (parse_kernel_version(&name), name))
        .collect();
    installed.sort();
    match installed.pop() {
        Some((_, newest)) => {
            kernel_verdict(&newest, "newest in lib/modules; cannot read runtime value under --root")
        }
        None => Check::warn(
            "kernel",
            "cannot read runtime value under --root (no proc/sys/kernel/osrelease, no lib/modules)",
            "check that the node boots a kernel 6.6 or newer",
        ),
    }
}

fn btf_check(root: Option<&Path>) -> Check {
    if host(root, "/sys/kernel/btf/vmlinux").exists() {
        return Check::ok("btf", "/sys/kernel/btf/vmlinux present");
    }
    if let Some(root) = root {
        let configs: Vec<PathBuf> = fs::read_dir(root.join("boot"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("config-")))
            .collect();
        if let Some(config) = configs
            .iter()
            .find(|p| read(p).is_some_and(|t| t.lines().any(|l| l.trim() == "CONFIG_DEBUG_INFO_BTF=y")))
        {
            let shown = config.strip_prefix(root).unwrap_or(config);
            return Check::ok("btf", format!("/{} has CONFIG_DEBUG_INFO_BTF=y", shown.display()));
        }
        return Check::warn(
            "btf",
            "cannot read runtime value under --root (no sys/kernel/btf/vmlinux, no boot/config-* with BTF)",
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        );
    }
    Check::warn(
        "btf",
        "/sys/kernel/btf/vmlinux missing: the kernel has no BTF (CO-RE programs and bpftool cannot resolve kernel types)",
        "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y",
    )
}

/// `(mount point, fstype)` of /proc/mounts.
fn mount_points(mounts: &str) -> Vec<(&str, &str)> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_, target, fstype) = (f.next()?, f.next()?, f.next()?);
            Some((target, fstype))
        })
        .collect()
}

pub fn bpffs_check(mounts: Option<&str>, under_root: bool) -> Check {
    let Some(mounts) = mounts else {
        return if under_root {
            Check::warn(
                "bpffs",
                "cannot read runtime value under --root (no proc/mounts)",
                "make sure /sys/fs/bpf is mounted at boot (kproxy load mounts it)",
            )
        } else {
            Check::warn("bpffs", "cannot read /proc/mounts", "mount -t bpf -o mode=0700 bpf /sys/fs/bpf")
        };
    };
    let points = mount_points(mounts);
    if points.iter().any(|(t, f)| *t == "/sys/fs/bpf" && *f == "bpf") {
        return Check::ok("bpffs", "bpffs mounted at /sys/fs/bpf");
    }
    let elsewhere: Vec<&str> = points.iter().filter(|(_, f)| *f == "bpf").map(|(t, _)| *t).collect();
    let also =
        if elsewhere.is_empty() { String::new() } else { format!(" (bpffs is at {})", elsewhere.join(", ")) };
    Check::warn(
        "bpffs",
        format!("no bpffs at /sys/fs/bpf{also}: pins cannot outlive the agent"),
        "mount -t bpf -o mode=0700 bpf /sys/fs/bpf (kproxy load does it) and add it to /etc/fstab",
    )
}

/// Whether pins under the pin directory outlive the process that makes them: a bpffs private
/// to this mount namespace (`ip netns exec` remounts /sys) takes the datapath with it.
pub fn bpffs_host_check(pins: &PinDir) -> Check {
    match bpf::bpffs_scope(pins.root(), false) {
        bpf::BpffsScope::Host(why) => Check::ok("bpffs-host", why),
        bpf::BpffsScope::Private(why) => Check::fail(
            "bpffs-host",
            format!(
                "{why}; pins made from here vanish with this mount namespace, the links and flows with them"
            ),
            "run kproxy in the host's mount namespace: `nsenter --net=/run/netns/NAME` enters only a network \
             namespace, `ip netns exec` also remounts /sys; a container needs the host's /sys/fs/bpf (hostPath)",
        ),
        bpf::BpffsScope::Unknown(why) => Check::warn(
            "bpffs-host",
            why,
            "make sure kproxy runs where it sees the host's /sys/fs/bpf (the host's mount namespace, or a hostPath \
             mount in a container)",
        ),
    }
}

pub fn cgroup2_check(mounts: Option<&str>, under_root: bool) -> Check {
    let Some(mounts) = mounts else {
        let finding = if under_root {
            "cannot read runtime value under --root (no proc/mounts)"
        } else {
            "cannot read /proc/mounts"
        };
        return Check::warn("cgroup2", finding, "make sure cgroup v2 is mounted (unified or hybrid layout)");
    };
    let points = mount_points(mounts);
    match points.iter().find(|(_, f)| *f == "cgroup2") {
        Some((target, _)) if *target == "/sys/fs/cgroup" => {
            Check::ok("cgroup2", "cgroup v2 mounted at /sys/fs/cgroup (unified layout)")
        }
        Some((target, _)) => Check::ok("cgroup2", format!("cgroup v2 mounted at {target} (hybrid layout)")),
        None => Check::warn(
            "cgroup2",
            "no cgroup2 mount: the socket-level load balancing (cgroup connect4/sendmsg4 hooks) cannot attach",
            "boot with systemd.unified_cgroup_hierarchy=1, or mount -t cgroup2 none /sys/fs/cgroup/unified",
        ),
    }
}

// ---------------------------------------------------------------- datapath

/// The link pin names an interface should have (as `datapath` writes them).
pub fn link_pin_name(name: &str, index: u32, hook: Hook) -> String {
    format!("{}@{index}-{}", name.replace('.', "%2E"), hook.suffix())
}

/// One WARN per matching interface missing a hook, or one OK.
pub fn attach_checks(
    interfaces: &[bpf::Interface],
    selector: &InterfaceSelector,
    globs: &[String],
    links: &std::collections::BTreeSet<String>,
    pin_dir: &Path,
) -> Vec<Check> {
    let wanted: Vec<&bpf::Interface> = interfaces.iter().filter(|i| selector.matches(&i.name)).collect();
    if wanted.is_empty() {
        const SHOWN: usize = 30;
        let mut seen: Vec<&str> = interfaces.iter().take(SHOWN).map(|i| i.name.as_str()).collect();
        let more = format!("and {} more", interfaces.len().saturating_sub(SHOWN));
        if interfaces.len() > SHOWN {
            seen.push(&more);
        }
        let seen = if seen.is_empty() { "none".to_owned() } else { seen.join(", ") };
        return vec![Check::fail(
            "attach",
            format!(
                "no interface matches {} in this network namespace, so no pod's traffic reaches the programs; \
                 its interfaces: {seen}",
                globs.join(" ")
            ),
            "pass the pod-facing interfaces' names to the agent and to doctor with --interfaces (veth* for bridge \
             CNIs such as flannel and kindnet, cali* for Calico, lxc* for Cilium); a node that runs no pod yet has \
             none",
        )];
    }
    let mut out = Vec::new();
    for iface in &wanted {
        let missing: Vec<&str> = Hook::POD
            .iter()
            .filter(|h| !links.contains(&link_pin_name(&iface.name, iface.index, **h)))
            .map(|h| match h {
                Hook::Ingress => "ingress (DNAT of what the pod sends)",
                Hook::Egress => "egress (un-NAT of the replies it receives)",
                Hook::ExternalIngress => "external ingress (NodePort, ExternalIP and LB traffic)",
            })
            .collect();
        if !missing.is_empty() {
            out.push(Check::warn(
                format!("attach {}", iface.name),
                format!(
                    "{} (index {}) has no {} program: no link pin under {}/links",
                    iface.name,
                    iface.index,
                    missing.join(" and no "),
                    pin_dir.display()
                ),
                format!(
                    "the agent attaches new interfaces within --poll-ms; check its log, or run `kproxy --pin-dir {} load --interfaces {}`",
                    pin_dir.display(),
                    globs.join(" ")
                ),
            ));
        }
    }
    if out.is_empty() {
        let names: Vec<&str> = wanted.iter().map(|i| i.name.as_str()).collect();
        out.push(Check::ok(
            "attach",
            format!(
                "ingress and egress programs attached on {} interfaces: {}",
                names.len(),
                names.join(", ")
            ),
        ));
    }
    out
}

/// Fill of one map: hash maps refuse inserts when full; LRU maps evict.
pub fn map_fill_check(map: &str, entries: u64, capacity: u64) -> Check {
    let lru = matches!(map, "conntrack_v4" | "affinity_v4");
    let name = if map == "conntrack_v4" { "conntrack fill".to_owned() } else { format!("map {map}") };
    if capacity == 0 {
        return Check::warn(
            name,
            format!("{map}: cannot read its capacity ({entries} entries)"),
            "check `bpftool map show`",
        );
    }
    let percent = entries as f64 * 100.0 / capacity as f64;
    let fill = format!("{entries}/{capacity} entries ({percent:.1} %)");
    if lru {
        if percent >= 90.0 {
            let what = if entries >= capacity { "full" } else { "nearly full" };
            return Check::warn(
                name,
                format!(
                    "{map} {fill} is {what}: the LRU evicts the least recently used entries (live flows may lose their translation)"
                ),
                if map == "conntrack_v4" {
                    "raise `kproxy agent --conntrack-max` (takes effect when the datapath is loaded anew) or lower the conntrack timeouts"
                } else {
                    "lower the sessionAffinity timeouts, or reload the datapath with a larger affinity map"
                },
            );
        }
        return Check::ok(name, format!("{map} {fill} (LRU)"));
    }
    if entries >= capacity {
        Check::fail(
            name,
            format!("{map} {fill} is full: inserts fail, new Services and endpoints are not programmed"),
            "remove unused Services, or reload the datapath with larger maps (`kproxy unload`, then start the agent)",
        )
    } else if percent > 80.0 {
        Check::warn(
            name,
            format!("{map} {fill} is over 80 % full: inserts fail when it is full"),
            "plan larger maps before the cluster grows further",
        )
    } else {
        Check::ok(name, format!("{map} {fill}"))
    }
}

fn datapath_checks(pins: &PinDir, selector: &InterfaceSelector, globs: &[String]) -> Vec<Check> {
    let root = pins.root();
    if !pins.is_loaded() {
        let what = if root.exists() {
            format!("the datapath under {} is incomplete (programs or maps missing)", root.display())
        } else {
            format!(
                "kproxy is not loaded: nothing pinned under {}; Service traffic is not translated",
                root.display()
            )
        };
        return vec![Check::fail(
            "datapath",
            what,
            format!(
                "start `kproxy agent` (it loads the datapath), or run `kproxy --pin-dir {} load`",
                root.display()
            ),
        )];
    }
    let holder = match bpf::pin_lock_pid(root) {
        Some(_) => format!("; held by {}", bpf::lock_holder(root)),
        None => String::new(),
    };
    let mut out =
        vec![Check::ok("datapath", format!("programs and maps pinned under {}{holder}", root.display()))];
    let links: std::collections::BTreeSet<String> = fs::read_dir(root.join("links"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    match bpf::interfaces() {
        Ok(interfaces) => out.extend(attach_checks(&interfaces, selector, globs, &links, root)),
        Err(e) => {
            out.push(Check::warn("attach", format!("cannot list interfaces: {e:#}"), "check `ip link`"))
        }
    }
    out.push(north_south_check(&links));
    match bpf::Maps::from_pins(pins) {
        Ok(maps) => {
            let mode = maps.socket_lb_config.get(&0, 0).ok().map(|c| c.mode);
            out.push(socket_lb_check(&links, mode));
            for (map, entries, capacity) in bpf::map_usage(&maps) {
                out.push(map_fill_check(map, entries, capacity));
            }
        }
        Err(e) => out.push(Check::fail(
            "maps",
            format!("cannot open the pinned maps: {e:#}"),
            "run `kproxy unload` and start the agent again",
        )),
    }
    out
}

/// What serves traffic from outside, from the link pins: external interfaces (tc, XDP).
/// Informational: a node may well have none.
pub fn north_south_check(links: &std::collections::BTreeSet<String>) -> Check {
    let interface = |l: &str| l.split('@').next().unwrap_or(l).replace("%2E", ".");
    let external: Vec<String> =
        links.iter().filter(|l| l.ends_with("-external")).map(|l| interface(l)).collect();
    let xdp: Vec<String> = links.iter().filter(|l| l.ends_with("-xdp")).map(|l| interface(l)).collect();
    let mut parts = Vec::new();
    if external.is_empty() {
        parts.push(
            "no external interface (NodePorts, ExternalIPs and LB IPs are not served on this node)"
                .to_owned(),
        );
    } else {
        parts.push(format!(
            "external interfaces {} (XDP on {})",
            external.join(", "),
            if xdp.is_empty() { "none".to_owned() } else { xdp.join(", ") }
        ));
    }
    Check::ok("north-south", parts.join("; "))
}

/// The socket hooks (link pins) and the mode the agent wrote (`SOCKET_LB_CONFIG`). Without
/// them the node's own processes — hostNetwork pods, the kubelet, node daemons — cannot reach
/// a cluster IP: their packets never cross the pods' interfaces, where the tc programs sit
/// (kube-proxy serves them in nat OUTPUT).
pub fn socket_lb_check(links: &std::collections::BTreeSet<String>, mode: Option<u32>) -> Check {
    use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF};
    let hooks = links.iter().filter(|l| l.starts_with("cgroup@")).count();
    match mode {
        _ if hooks == 0 => Check::warn(
            "socket-lb",
            "socket-level load balancing off: processes in the node's network namespace (hostNetwork pods, \
             kubelet) cannot reach cluster IPs",
            "run `kproxy agent` with --socket-lb host-only (the default) or on",
        ),
        Some(SOCKET_LB_OFF) => Check::warn(
            "socket-lb",
            format!(
                "socket-level load balancing off, yet {hooks} cgroup hooks are pinned: processes in the node's \
                 network namespace cannot reach cluster IPs"
            ),
            "restart `kproxy agent` with --socket-lb host-only (the default) or on",
        ),
        Some(SOCKET_LB_HOST_ONLY) => Check::ok(
            "socket-lb",
            format!(
                "socket-level load balancing host-only ({hooks} cgroup hooks): the node's own processes reach \
                 cluster IPs at connect()/sendmsg(), pods through tc"
            ),
        ),
        Some(SOCKET_LB_ALL) => Check::ok(
            "socket-lb",
            format!(
                "socket-level load balancing on ({hooks} cgroup hooks): every process's sockets are translated"
            ),
        ),
        _ => Check::ok("socket-lb", format!("{hooks} cgroup hooks pinned (mode unknown)")),
    }
}

// ---------------------------------------------------------------- SNAT ports

/// The node's ephemeral ports against the SNAT range: kproxy takes SNAT and
/// remapped ports from it without knowing the node's own sockets, so a node
/// process that picks one of them as its ephemeral port to the same backend
/// would share a reply tuple with a translated flow.
pub fn snat_ports_check(local: Runtime, reserved: Runtime, snat: (u16, u16)) -> Check {
    let name = "snat-ports";
    let Runtime::Value(local) = local else {
        return Check::ok(name, format!("SNAT ports {}-{} (ephemeral range not readable)", snat.0, snat.1));
    };
    let mut bounds = local.split_whitespace().filter_map(|v| v.parse::<u32>().ok());
    let (Some(low), Some(high)) = (bounds.next(), bounds.next()) else {
        return Check::ok(
            name,
            format!("SNAT ports {}-{} (ephemeral range {local:?} not understood)", snat.0, snat.1),
        );
    };
    let (snat_low, snat_high) = (u32::from(snat.0), u32::from(snat.1));
    let overlap_low = low.max(snat_low);
    let overlap_high = high.min(snat_high);
    if overlap_low > overlap_high {
        return Check::ok(
            name,
            format!("ephemeral ports {low}-{high} stay clear of the SNAT range {snat_low}-{snat_high}"),
        );
    }
    let reserved = match &reserved {
        Runtime::Value(v) => v.clone(),
        Runtime::Unknown(_) => String::new(),
    };
    let covered = reserved.split(',').any(|part| {
        let mut ends = part.trim().split('-').filter_map(|v| v.parse::<u32>().ok());
        match (ends.next(), ends.next()) {
            (Some(a), Some(b)) => a <= overlap_low && b >= overlap_high,
            (Some(a), None) => a == overlap_low && a == overlap_high,
            _ => false,
        }
    });
    if covered {
        return Check::ok(
            name,
            format!(
                "ephemeral ports {low}-{high} overlap the SNAT range, but ip_local_reserved_ports excludes it"
            ),
        );
    }
    Check::warn(
        name,
        format!(
            "ephemeral ports {low}-{high} overlap the SNAT range {snat_low}-{snat_high} \
             ({overlap_low}-{overlap_high}): a node process may pick a port a translated flow holds"
        ),
        format!(
            "sysctl net.ipv4.ip_local_reserved_ports={overlap_low}-{overlap_high}, or move --snat-port-range \
             outside net.ipv4.ip_local_port_range"
        ),
    )
}

// ---------------------------------------------------------------- agent

/// The status code of `GET /healthz` (HTTP/1.0, 2 s timeouts) and the body.
fn http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    let addr: SocketAddr = match address.parse() {
        Ok(addr) => addr,
        Err(_) => address.to_socket_addrs()?.next().ok_or_else(|| std::io::Error::other("no address"))?,
    };
    let timeout = Duration::from_secs(2);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.take(64 * 1024).read_to_end(&mut response)?;
    parse_http_response(&String::from_utf8_lossy(&response))
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response"))
}

/// `HTTP/1.1 200 OK\r\n...\r\n\r\nbody` → (200, body).
pub fn parse_http_response(text: &str) -> Option<(u16, String)> {
    let status_line = text.lines().next()?;
    let mut fields = status_line.split_whitespace();
    if !fields.next()?.starts_with("HTTP/") {
        return None;
    }
    let code = fields.next()?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((code, body.trim().to_owned()))
}

pub fn agent_verdict(address: &str, result: &std::io::Result<(u16, String)>) -> Check {
    match result {
        Ok((200, body)) => Check::ok("agent", format!("healthy: GET http://{address}/healthz → 200 {body}")),
        Ok((503, body)) => Check::fail(
            "agent",
            format!(
                "unhealthy: GET http://{address}/healthz → 503 {body}: a change has waited over 2 × --sync-period, the maps lag the cluster"
            ),
            "read the agent's log (sync errors, API server access); restart it if it is stuck",
        ),
        Ok((code, body)) => Check::warn(
            "agent",
            format!("GET http://{address}/healthz → {code} {body}: is this kproxy's health server?"),
            "check --healthz-bind-address of the agent and --healthz-address",
        ),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Check::warn(
            "agent",
            format!("no agent is running: connection refused on {address}"),
            "start `kproxy agent` (the DaemonSet); without it the maps stop following the cluster",
        ),
        Err(e) => Check::warn(
            "agent",
            format!("cannot reach http://{address}/healthz: {e}"),
            "check that `kproxy agent` runs and --healthz-address matches its --healthz-bind-address",
        ),
    }
}

fn agent_check(address: &str) -> Check {
    agent_verdict(address, &http_get(address, "/healthz"))
}

// ---------------------------------------------------------------- sysctl

/// One `key = value` line of a sysctl.d file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// Dotted form (`net.ipv4.ip_forward`), without the `-` prefix.
    pub key: String,
    pub value: String,
    /// 1-based.
    pub line: usize,
}

/// `net/ipv4/ip_forward` → `net.ipv4.ip_forward`: with `/` as the first
/// separator, slashes separate and dots are literal (sysctl.d(5)).
pub fn normalize_key(key: &str) -> String {
    let key = key.trim();
    match key.find(['.', '/']) {
        Some(i) if key.as_bytes()[i] == b'/' => key
            .chars()
            .map(|c| match c {
                '/' => '.',
                '.' => '/',
                c => c,
            })
            .collect(),
        _ => key.to_owned(),
    }
}

/// The assignments of a sysctl.d file: `#` and `;` comments, blank lines,
/// whitespace around key and value, a `-` prefix (ignore failures).
pub fn parse_sysctl(text: &str) -> Vec<Assignment> {
    text.lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                return None;
            }
            let (key, value) = line.split_once('=')?;
            let key = key.trim();
            let key = key.strip_prefix('-').unwrap_or(key);
            Some(Assignment { key: normalize_key(key), value: value.trim().to_owned(), line: i + 1 })
        })
        .collect()
}

/// Directories of sysctl.d files, highest precedence first: a file name in
/// an earlier directory masks the same name in later ones.
pub const SYSCTL_DIRS: [&str; 5] =
    ["/etc/sysctl.d", "/run/sysctl.d", "/usr/local/lib/sysctl.d", "/usr/lib/sysctl.d", "/lib/sysctl.d"];

/// The order files are applied in: each `*.conf` name once (from the first
/// directory that has it), sorted by name; `/etc/sysctl.conf` last (procps'
/// `sysctl --system`). Input: (directory, file names) in [`SYSCTL_DIRS`] order.
pub fn sysctl_order(listing: &[(&str, Vec<String>)]) -> Vec<String> {
    let mut chosen: std::collections::BTreeMap<&str, String> = std::collections::BTreeMap::new();
    for (dir, names) in listing {
        for name in names.iter().filter(|n| n.ends_with(".conf")) {
            chosen.entry(name.as_str()).or_insert_with(|| format!("{dir}/{name}"));
        }
    }
    let mut files: Vec<String> = chosen.into_values().collect();
    files.push("/etc/sysctl.conf".to_owned());
    files
}

/// Where a persisted value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The file as the node sees it (`/etc/sysctl.d/99-sysctl.conf`).
    pub file: String,
    pub line: usize,
    pub value: String,
    /// The line is a glob (`net.ipv4.conf.*.rp_filter`).
    pub glob: Option<String>,
}

impl Setting {
    pub fn location(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// The sysctl files that apply at boot, in order, with their contents.
#[derive(Clone, Debug, Default)]
pub struct SysctlFiles {
    pub files: Vec<(String, Vec<Assignment>)>,
}

impl SysctlFiles {
    pub fn read(root: Option<&Path>) -> Self {
        let listing: Vec<(&str, Vec<String>)> = SYSCTL_DIRS
            .iter()
            .map(|dir| {
                let names = fs::read_dir(host(root, dir))
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect();
                (*dir, names)
            })
            .collect();
        let files = sysctl_order(&listing)
            .into_iter()
            .map(|file| {
                let text = read_in_root(root, &file).unwrap_or_default();
                let assignments = parse_sysctl(&text);
                (file, assignments)
            })
            .collect();
        Self { files }
    }

    /// The value `key` gets at boot: the last explicit assignment, else the
    /// last glob that matches (systemd-sysctl does not apply a glob to a key
    /// set explicitly).
    pub fn effective(&self, key: &str) -> Option<Setting> {
        let mut explicit = None;
        let mut globbed = None;
        for (file, assignments) in &self.files {
            for a in assignments {
                let setting =
                    || Setting { file: file.clone(), line: a.line, value: a.value.clone(), glob: None };
                if a.key == key {
                    explicit = Some(setting());
                } else if a.key.contains(['*', '?', '['])
                    && glob::Pattern::new(&a.key).is_ok_and(|p| p.matches(key))
                {
                    globbed = Some(Setting { glob: Some(a.key.clone()), ..setting() });
                }
            }
        }
        explicit.or(globbed)
    }
}

/// Reads `path` (absolute, as the node sees it) under `root`, following
/// symlinks inside the root (Debian's /etc/sysctl.d/99-sysctl.conf →
/// ../sysctl.conf); a link to /dev/null masks (empty).
fn read_in_root(root: Option<&Path>, path: &str) -> Option<String> {
    let mut current = PathBuf::from(path);
    for _ in 0..8 {
        if current == Path::new("/dev/null") {
            return Some(String::new());
        }
        let on_disk = host(root, &current.to_string_lossy());
        match fs::read_link(&on_disk) {
            Ok(target) => {
                current = if target.is_absolute() {
                    target
                } else {
                    normalize(&current.parent().unwrap_or(Path::new("/")).join(target))
                };
            }
            Err(_) => return read(&on_disk),
        }
    }
    None
}

/// Resolves `.` and `..` lexically (never above `/`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(p) => out.push(p),
            _ => {}
        }
    }
    out
}

/// A value at runtime, or why it is unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Runtime {
    Value(String),
    Unknown(String),
}

fn runtime_sysctl(root: Option<&Path>, key: &str) -> Runtime {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    match read(&host(root, &path)) {
        Some(v) => Runtime::Value(v.trim().to_owned()),
        None if root.is_some() => Runtime::Unknown("cannot read runtime value under --root".to_owned()),
        None => Runtime::Unknown(format!("cannot read {path}")),
    }
}

fn describe(setting: &Setting, key: &str) -> String {
    match &setting.glob {
        Some(glob) => format!("{} sets {glob} = {} (matches {key})", setting.location(), setting.value),
        None => format!("{} sets {key} = {}", setting.location(), setting.value),
    }
}

const FORWARD: &str = "net.ipv4.ip_forward";

/// ip_forward at runtime and after the next boot.
pub fn ip_forward_check(runtime: Runtime, persisted: Option<Setting>) -> Check {
    let name = "ip_forward";
    let persisted_off = persisted.as_ref().filter(|s| s.value == "0");
    let file_fix = |s: &Setting| {
        format!(
            "edit {} line {} to `{FORWARD} = 1` (or delete it and set it in a later file), then `sysctl --system`",
            s.file, s.line
        )
    };
    let new_file_fix =
        "echo 'net.ipv4.ip_forward = 1' > /etc/sysctl.d/99-zz-kproxy.conf (a file read after the others)";
    match runtime {
        Runtime::Value(v) if v == "0" => {
            let boot = match &persisted {
                Some(s) => describe(s, FORWARD),
                None => "no sysctl file sets it".to_owned(),
            };
            let fix = match persisted_off {
                Some(s) => format!("sysctl -w {FORWARD}=1; then {}", file_fix(s)),
                None if persisted.is_none() => format!("sysctl -w {FORWARD}=1; then {new_file_fix}"),
                None => format!("sysctl -w {FORWARD}=1"),
            };
            Check::fail(
                name,
                format!("{FORWARD} = 0 at runtime: the node routes no pod traffic ({boot})"),
                fix,
            )
        }
        Runtime::Value(v) => match &persisted {
            Some(s) if s.value == "0" => Check::warn(
                name,
                format!(
                    "{}: the next reboot disables forwarding (the incident of cases/001); {v} at runtime only",
                    describe(s, FORWARD)
                ),
                file_fix(s),
            ),
            Some(s) => {
                Check::ok(name, format!("{v} at runtime; {} keeps it after a reboot", describe(s, FORWARD)))
            }
            None => Check::warn(
                name,
                format!(
                    "{v} at runtime, but no sysctl file sets {FORWARD}: after a reboot it is 0 (the kernel default) until something sets it again"
                ),
                new_file_fix,
            ),
        },
        Runtime::Unknown(why) => match &persisted {
            Some(s) if s.value == "0" => Check::warn(
                name,
                format!(
                    "{why}; {}: the next boot disables forwarding (the incident of cases/001)",
                    describe(s, FORWARD)
                ),
                file_fix(s),
            ),
            Some(s) => Check::warn(
                name,
                format!("{why}; {} at boot", describe(s, FORWARD)),
                "check the running node with `kproxy doctor`",
            ),
            None => Check::warn(
                name,
                format!("{why}; no sysctl file sets {FORWARD}: it boots as 0 (the kernel default)"),
                new_file_fix,
            ),
        },
    }
}

/// rp_filter of `all` and `default`: strict (1) drops replies that arrive on
/// another interface than the route back to their source.
pub fn rp_filter_check(values: [(&str, Runtime, Option<Setting>); 2]) -> Check {
    let mut strict = Vec::new();
    let mut notes = Vec::new();
    let mut unknown = Vec::new();
    for (which, runtime, persisted) in &values {
        let key = format!("net.ipv4.conf.{which}.rp_filter");
        let boot = persisted.as_ref().map(|s| s.value.as_str());
        match runtime {
            Runtime::Value(v) => {
                if v == "1" {
                    strict.push(format!("{key} = 1 at runtime"));
                } else {
                    notes.push(format!("{which} = {v}"));
                }
                if boot == Some("1") && v != "1" {
                    strict.push(format!(
                        "{} (after the next reboot)",
                        describe(persisted.as_ref().expect("set"), &key)
                    ));
                }
            }
            Runtime::Unknown(why) => match persisted {
                Some(s) if s.value == "1" => strict.push(format!("{} (at boot)", describe(s, &key))),
                Some(s) => notes.push(format!("{which} = {} at boot", s.value)),
                None => {
                    unknown.push(why.clone());
                    notes.push(format!("{which} = 0 at boot (kernel default)"));
                }
            },
        }
    }
    if !strict.is_empty() {
        return Check::warn(
            "rp_filter",
            format!(
                "strict reverse-path filtering: {}; replies arriving through another interface than the route back to their source are dropped (kproxy's bounce paths do not need it, multi-homed nodes do)",
                strict.join("; ")
            ),
            "set net.ipv4.conf.all.rp_filter = 2 and net.ipv4.conf.default.rp_filter = 2 (loose) in /etc/sysctl.d/, then `sysctl --system`",
        );
    }
    let mut finding = format!("not strict ({})", notes.join(", "));
    if let Some(why) = unknown.first() {
        finding.push_str(&format!("; {why}"));
    }
    Check::ok("rp_filter", finding)
}

// ---------------------------------------------------------------- kube-proxy

/// Pids of processes named kube-proxy.
fn kube_proxy_pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = read(&e.path().join("comm"))?;
            (comm.trim() == "kube-proxy").then_some(pid)
        })
        .collect()
}

use crate::cmd::kube_proxy_rules::find_tool;

fn output(tool: &Path, args: &[&str]) -> Result<String, String> {
    match Command::new(tool).args(args).stdin(std::process::Stdio::null()).output() {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!("{} failed: {}", tool.display(), String::from_utf8_lossy(&out.stderr).trim())),
        Err(e) => Err(format!("{}: {e}", tool.display())),
    }
}

/// What kube-proxy left: one line per iptables table or nftables table found,
/// and what could not be checked.
fn kube_proxy_leftovers() -> (Vec<String>, Vec<String>) {
    let mut found = Vec::new();
    let mut unchecked = Vec::new();
    let mut any_tool = false;
    for family in ["iptables", "ip6tables"] {
        let mut variants: Vec<(String, PathBuf)> =
            [format!("{family}-nft-save"), format!("{family}-legacy-save")]
                .into_iter()
                .filter_map(|n| find_tool(&n).map(|p| (n.trim_end_matches("-save").to_owned(), p)))
                .collect();
        if variants.is_empty()
            && let Some(p) = find_tool(&format!("{family}-save"))
        {
            variants.push((family.to_owned(), p));
        }
        for (label, tool) in variants {
            any_tool = true;
            let plans = output(&tool, &[]).and_then(|text| {
                crate::cmd::kube_proxy_rules::plan_save(&text).map_err(|e| format!("{label}: {e:#}"))
            });
            match plans {
                Ok(plans) => found.extend(leftover_lines(&label, &plans)),
                Err(e) => unchecked.push(e),
            }
        }
    }
    if let Some(nft) = find_tool("nft") {
        any_tool = true;
        match output(&nft, &["list", "tables"]) {
            Ok(text) => {
                for (family, name) in crate::cmd::kube_proxy_rules::kube_proxy_nft_tables(&text) {
                    found.push(format!("nftables table {family} {name}"));
                }
            }
            Err(e) => unchecked.push(e),
        }
    }
    if !any_tool {
        unchecked.push("neither iptables-save nor nft is installed".to_owned());
    }
    (found, unchecked)
}

/// `iptables-nft table nat: KUBE-SERVICES, KUBE-SVC-... (12 chains, 3 jumps)`.
pub fn leftover_lines(label: &str, plans: &[crate::cmd::kube_proxy_rules::TablePlan]) -> Vec<String> {
    plans
        .iter()
        .filter(|p| !p.is_empty() || !p.kept.is_empty())
        .map(|p| {
            let mut chains: Vec<&str> = p.delete_chains.iter().map(|(c, _)| c.as_str()).collect();
            chains.extend(p.kept.iter().map(|(c, _)| c.as_str()));
            let shown: Vec<&str> = chains.iter().take(3).copied().collect();
            let more = if chains.len() > 3 { ", ..." } else { "" };
            format!(
                "{label} table {}: {}{more} ({} chains, {} jumps from built-in chains)",
                p.table,
                shown.join(", "),
                chains.len(),
                p.delete_rules.len()
            )
        })
        .collect()
}

pub fn kube_proxy_verdict(running: &[u32], found: &[String], unchecked: &[String]) -> Check {
    let name = "kube-proxy";
    if !running.is_empty() {
        let pids: Vec<String> = running.iter().map(u32::to_string).collect();
        return Check::fail(
            name,
            format!(
                "kube-proxy is running (pid {}): kube-proxy and kproxy both translate Service traffic",
                pids.join(", ")
            ),
            "remove kube-proxy from this node (delete its DaemonSet or keep it off with a nodeSelector), then `kproxy cleanup-kube-proxy --apply`",
        );
    }
    if !found.is_empty() {
        return Check::warn(
            name,
            format!(
                "kube-proxy left rules that would translate Service traffic a second time: {}",
                found.join("; ")
            ),
            "kproxy cleanup-kube-proxy --apply",
        );
    }
    if !unchecked.is_empty() {
        return Check::warn(
            name,
            format!("not running, but its rules could not be checked: {}", unchecked.join("; ")),
            "check with `kproxy cleanup-kube-proxy` (dry run)",
        );
    }
    Check::ok(name, "not running, and no kube-proxy chain or table is left")
}

fn kube_proxy_check() -> Check {
    let (found, unchecked) = kube_proxy_leftovers();
    kube_proxy_verdict(&kube_proxy_pids(), &found, &unchecked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ephemeral_ports_inside_the_snat_range_are_reported_unless_reserved() {
        let value = |v: &str| Runtime::Value(v.to_owned());
        let snat = (61000, 65535);
        let clear = snat_ports_check(value("32768\t60999"), value(""), snat);
        assert_eq!(clear.status, Status::Ok, "{clear:?}");
        let overlap = snat_ports_check(value("1024 65535"), value(""), snat);
        assert_eq!(overlap.status, Status::Warn, "{overlap:?}");
        assert!(overlap.finding.contains("61000-65535"), "{overlap:?}");
        assert!(overlap.fix.as_deref().unwrap().contains("ip_local_reserved_ports=61000-65535"));
        let reserved = snat_ports_check(value("1024 65535"), value("30000-32767,61000-65535"), snat);
        assert_eq!(reserved.status, Status::Ok, "{reserved:?}");
        let partly = snat_ports_check(value("32768 62000"), value("61000-61500"), snat);
        assert_eq!(partly.status, Status::Warn, "{partly:?}");
        let unreadable = snat_ports_check(Runtime::Unknown("no".into()), value(""), snat);
        assert_eq!(unreadable.status, Status::Ok);
    }

    #[test]
    fn kernel_versions() {
        assert_eq!(parse_kernel_version("6.18.0-1-amd64"), Some((6, 18)));
        assert_eq!(parse_kernel_version("5.15.0\n"), Some((5, 15)));
        assert_eq!(parse_kernel_version("6.6"), Some((6, 6)));
        assert_eq!(parse_kernel_version("linux"), None);
        assert_eq!(kernel_verdict("6.6.1", "running").status, Status::Ok);
        assert_eq!(kernel_verdict("6.5.13", "running").status, Status::Fail);
        assert_eq!(kernel_verdict("5.15.0-91-generic", "running").status, Status::Fail);
        assert_eq!(kernel_verdict("10.0.0", "running").status, Status::Ok);
    }

    #[test]
    fn mounts_bpffs_and_cgroup2() {
        let hybrid = "sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,relatime 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(bpffs_check(Some(hybrid), false).status, Status::Ok);
        let c = cgroup2_check(Some(hybrid), false);
        assert_eq!(c.status, Status::Ok);
        assert!(c.finding.contains("hybrid"), "{}", c.finding);
        let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n";
        assert!(cgroup2_check(Some(unified), false).finding.contains("unified"));
        assert_eq!(bpffs_check(Some(unified), false).status, Status::Warn);
        let v1 = "cgroup /sys/fs/cgroup/memory cgroup rw 0 0\nbpf /mnt/bpf bpf rw 0 0\n";
        assert_eq!(cgroup2_check(Some(v1), false).status, Status::Warn);
        assert!(bpffs_check(Some(v1), false).finding.contains("/mnt/bpf"));
        let c = bpffs_check(None, true);
        assert!(c.finding.contains("cannot read runtime value under --root"));
    }

    #[test]
    fn sysctl_lines() {
        let text = "# comment\n; also\n\n  net.ipv4.ip_forward   =   0  \n-net/ipv4/conf/all/rp_filter=2\nnet/ipv4/conf/eth0.100/rp_filter = 1\nkernel.foo=bar baz\nnot an assignment\n";
        let a = parse_sysctl(text);
        assert_eq!(
            a,
            vec![
                Assignment { key: "net.ipv4.ip_forward".into(), value: "0".into(), line: 4 },
                Assignment { key: "net.ipv4.conf.all.rp_filter".into(), value: "2".into(), line: 5 },
                Assignment { key: "net.ipv4.conf.eth0/100.rp_filter".into(), value: "1".into(), line: 6 },
                Assignment { key: "kernel.foo".into(), value: "bar baz".into(), line: 7 },
            ]
        );
        assert_eq!(normalize_key("net.ipv4.conf.eth0/100.rp_filter"), "net.ipv4.conf.eth0/100.rp_filter");
    }

    #[test]
    fn sysctl_precedence() {
        let listing = vec![
            ("/etc/sysctl.d", vec!["99-sysctl.conf".into(), "50-default.conf".into(), "README".into()]),
            ("/run/sysctl.d", vec![]),
            ("/usr/local/lib/sysctl.d", vec![]),
            ("/usr/lib/sysctl.d", vec!["50-default.conf".into(), "10-net.conf".into()]),
            ("/lib/sysctl.d", vec!["10-net.conf".into()]),
        ];
        assert_eq!(
            sysctl_order(&listing),
            vec![
                "/usr/lib/sysctl.d/10-net.conf",
                "/etc/sysctl.d/50-default.conf",
                "/etc/sysctl.d/99-sysctl.conf",
                "/etc/sysctl.conf",
            ]
        );
        let files = SysctlFiles {
            files: vec![
                (
                    "/usr/lib/sysctl.d/10-net.conf".into(),
                    parse_sysctl("net.ipv4.ip_forward = 1\n-net.ipv4.conf.*.rp_filter = 2\n"),
                ),
                (
                    "/etc/sysctl.d/50-default.conf".into(),
                    parse_sysctl("net.ipv4.conf.default.rp_filter = 1\n"),
                ),
                ("/etc/sysctl.d/99-sysctl.conf".into(), parse_sysctl("# x\n\nnet.ipv4.ip_forward=0\n")),
                ("/etc/sysctl.conf".into(), vec![]),
            ],
        };
        let s = files.effective("net.ipv4.ip_forward").unwrap();
        assert_eq!((s.file.as_str(), s.line, s.value.as_str()), ("/etc/sysctl.d/99-sysctl.conf", 3, "0"));
        // The explicit assignment wins over a later glob, a glob applies otherwise.
        assert_eq!(files.effective("net.ipv4.conf.default.rp_filter").unwrap().value, "1");
        let all = files.effective("net.ipv4.conf.all.rp_filter").unwrap();
        assert_eq!((all.value.as_str(), all.glob.as_deref()), ("2", Some("net.ipv4.conf.*.rp_filter")));
        assert_eq!(files.effective("net.ipv4.tcp_syncookies"), None);
    }

    fn setting(value: &str) -> Setting {
        Setting { file: "/etc/sysctl.d/99-sysctl.conf".into(), line: 12, value: value.into(), glob: None }
    }

    #[test]
    fn ip_forward_decisions() {
        let v = |s: &str| Runtime::Value(s.into());
        let c = ip_forward_check(v("1"), Some(setting("0")));
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.finding.starts_with("/etc/sysctl.d/99-sysctl.conf:12 sets net.ipv4.ip_forward = 0: the next reboot disables forwarding (the incident of cases/001)"),
            "{}",
            c.finding
        );
        assert!(c.fix.unwrap().contains("line 12"));
        assert_eq!(ip_forward_check(v("1"), Some(setting("1"))).status, Status::Ok);
        assert_eq!(ip_forward_check(v("1"), None).status, Status::Warn);
        let c = ip_forward_check(v("0"), Some(setting("0")));
        assert_eq!(c.status, Status::Fail);
        assert!(c.fix.unwrap().starts_with("sysctl -w net.ipv4.ip_forward=1; then edit"));
        assert_eq!(ip_forward_check(v("0"), Some(setting("1"))).status, Status::Fail);
        let unknown = Runtime::Unknown("cannot read runtime value under --root".into());
        let c = ip_forward_check(unknown.clone(), Some(setting("1")));
        assert_eq!(c.status, Status::Warn);
        assert!(c.finding.contains("cannot read runtime value under --root"));
        assert!(ip_forward_check(unknown, Some(setting("0"))).finding.contains("99-sysctl.conf:12"));
    }

    #[test]
    fn rp_filter_decisions() {
        let v = |s: &str| Runtime::Value(s.into());
        assert_eq!(rp_filter_check([("all", v("0"), None), ("default", v("2"), None)]).status, Status::Ok);
        let c = rp_filter_check([("all", v("1"), None), ("default", v("0"), None)]);
        assert_eq!(c.status, Status::Warn);
        assert!(c.finding.contains("net.ipv4.conf.all.rp_filter = 1"), "{}", c.finding);
        assert!(c.finding.contains("multi-homed"), "{}", c.finding);
        let c = rp_filter_check([("all", v("0"), None), ("default", v("0"), Some(setting("1")))]);
        assert_eq!(c.status, Status::Warn, "strict after the next reboot");
        let unknown = Runtime::Unknown("cannot read runtime value under --root".into());
        let c = rp_filter_check([("all", unknown.clone(), None), ("default", unknown, Some(setting("2")))]);
        assert_eq!(c.status, Status::Ok);
    }

    #[test]
    fn map_fill() {
        assert_eq!(map_fill_check("services_v4", 10, 100).status, Status::Ok);
        assert_eq!(map_fill_check("services_v4", 81, 100).status, Status::Warn);
        assert_eq!(map_fill_check("backends_v4", 100, 100).status, Status::Fail);
        assert_eq!(map_fill_check("conntrack_v4", 85, 100).status, Status::Ok);
        let c = map_fill_check("conntrack_v4", 100, 100);
        assert_eq!((c.status, c.name.as_str()), (Status::Warn, "conntrack fill"));
        assert!(c.finding.contains("evicts"));
    }

    #[test]
    fn attach_per_interface() {
        let ifaces = vec![
            bpf::Interface { name: "lo".into(), index: 1 },
            bpf::Interface { name: "veth0-a".into(), index: 5 },
            bpf::Interface { name: "veth1.100".into(), index: 6 },
        ];
        let selector = InterfaceSelector::new(&["veth*".to_owned()]).unwrap();
        let globs = ["veth*".to_owned()];
        let mut links: std::collections::BTreeSet<String> =
            ["veth0-a@5-ingress", "veth0-a@5-egress", "veth1%2E100@6-ingress"].map(String::from).into();
        let checks = attach_checks(&ifaces, &selector, &globs, &links, Path::new("/sys/fs/bpf/kproxy"));
        assert_eq!(checks.len(), 1);
        assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Warn, "attach veth1.100"));
        assert!(checks[0].finding.contains("no egress"), "{}", checks[0].finding);
        links.insert("veth1%2E100@6-egress".into());
        let checks = attach_checks(&ifaces, &selector, &globs, &links, Path::new("/sys/fs/bpf/kproxy"));
        assert_eq!(checks[0].status, Status::Ok);
        assert!(checks[0].finding.contains("2 interfaces"));

        // A Calico node checked with the default glob: FAIL, naming what is there.
        let calico = vec![
            bpf::Interface { name: "lo".into(), index: 1 },
            bpf::Interface { name: "eth0".into(), index: 2 },
            bpf::Interface { name: "cali12ab34cd".into(), index: 7 },
        ];
        let checks = attach_checks(&calico, &selector, &globs, &links, Path::new("/sys/fs/bpf/kproxy"));
        assert_eq!(checks.len(), 1);
        assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Fail, "attach"));
        assert!(checks[0].finding.contains("no interface matches veth*"), "{}", checks[0].finding);
        assert!(
            checks[0].finding.ends_with("its interfaces: lo, eth0, cali12ab34cd"),
            "{}",
            checks[0].finding
        );
        assert!(checks[0].fix.as_deref().unwrap_or_default().contains("cali*"), "{:?}", checks[0].fix);
    }

    #[test]
    fn agent_health() {
        let r = parse_http_response("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"x\":1}");
        assert_eq!(r, Some((200, "{\"x\":1}".to_owned())));
        assert_eq!(parse_http_response("SSH-2.0"), None);
        assert_eq!(agent_verdict("a:1", &Ok((200, String::new()))).status, Status::Ok);
        assert_eq!(agent_verdict("a:1", &Ok((503, String::new()))).status, Status::Fail);
        let refused = Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let c = agent_verdict("a:1", &refused);
        assert_eq!(c.status, Status::Warn);
        assert!(c.finding.contains("no agent is running"));
    }

    #[test]
    fn kube_proxy_decisions() {
        assert_eq!(kube_proxy_verdict(&[], &[], &[]).status, Status::Ok);
        let c = kube_proxy_verdict(&[], &["nftables table ip kube-proxy".into()], &[]);
        assert_eq!(c.status, Status::Warn);
        assert_eq!(c.fix.as_deref(), Some("kproxy cleanup-kube-proxy --apply"));
        let c = kube_proxy_verdict(&[42], &[], &[]);
        assert_eq!(c.status, Status::Fail);
        assert!(c.finding.contains("kube-proxy and kproxy both translate Service traffic"));
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j KUBE-SVC-ABC\nCOMMIT\n";
        let plans = crate::cmd::kube_proxy_rules::plan_save(saved).unwrap();
        let lines = leftover_lines("iptables-nft", &plans);
        assert_eq!(
            lines,
            vec![
                "iptables-nft table nat: KUBE-SERVICES, KUBE-SVC-ABC (2 chains, 1 jumps from built-in chains)"
            ]
        );
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let dir = std::env::temp_dir().join(format!("kproxy-doctor-unit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("etc/sysctl.d")).unwrap();
        fs::write(dir.join("etc/sysctl.conf"), "net.ipv4.ip_forward = 0\n").unwrap();
        std::os::unix::fs::symlink("../sysctl.conf", dir.join("etc/sysctl.d/99-sysctl.conf")).unwrap();
        std::os::unix::fs::symlink("/dev/null", dir.join("etc/sysctl.d/50-masked.conf")).unwrap();
        std::os::unix::fs::symlink("/etc/sysctl.conf", dir.join("etc/sysctl.d/60-abs.conf")).unwrap();
        assert_eq!(
            read_in_root(Some(&dir), "/etc/sysctl.d/99-sysctl.conf").unwrap(),
            "net.ipv4.ip_forward = 0\n"
        );
        assert_eq!(
            read_in_root(Some(&dir), "/etc/sysctl.d/60-abs.conf").unwrap(),
            "net.ipv4.ip_forward = 0\n"
        );
        assert_eq!(read_in_root(Some(&dir), "/etc/sysctl.d/50-masked.conf").unwrap(), "");
        let files = SysctlFiles::read(Some(&dir));
        assert_eq!(files.effective("net.ipv4.ip_forward").unwrap().file, "/etc/sysctl.conf");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn socket_lb_check_names_the_mode_and_warns_when_the_node_is_not_served() {
        use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF};
        let links: std::collections::BTreeSet<String> = [
            "veth1@5-ingress",
            "cgroup@2f7379732f66732f636772-kproxy_connect4",
            "cgroup@2f7379732f66732f636772-kproxy_sendmsg4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let host_only = socket_lb_check(&links, Some(SOCKET_LB_HOST_ONLY));
        assert_eq!(host_only.status, Status::Ok);
        assert!(host_only.finding.contains("host-only (2 cgroup hooks)"), "{}", host_only.finding);
        let on = socket_lb_check(&links, Some(SOCKET_LB_ALL));
        assert!(on.finding.contains("on (2 cgroup hooks)"), "{}", on.finding);
        let none = std::collections::BTreeSet::new();
        for off in [socket_lb_check(&none, Some(SOCKET_LB_OFF)), socket_lb_check(&none, None)] {
            assert_eq!(off.status, Status::Warn, "{}", off.finding);
            assert!(off.finding.contains("cannot reach cluster IPs"), "{}", off.finding);
        }
    }

    #[test]
    fn north_south_check_names_external_interfaces_and_xdp() {
        let links: std::collections::BTreeSet<String> = [
            "eth0@2-external",
            "eth0@2-egress",
            "eth0@2-xdp",
            "veth1@5-ingress",
            "cgroup@2f7379732f66732f636772-kproxy_connect4",
            "cgroup@2f7379732f66732f636772-kproxy_sendmsg4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let check = north_south_check(&links);
        assert!(check.finding.contains("external interfaces eth0 (XDP on eth0)"), "{}", check.finding);
        let none = north_south_check(&std::collections::BTreeSet::new());
        assert!(none.finding.contains("no external interface"), "{}", none.finding);
    }
}
