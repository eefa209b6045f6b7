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
//!   matches: a Calico `cali*` or Cilium `lxc*` node checked with the default `veth*`); an
//!   interface with no hook whose pod the socket hooks cover (`--socket-lb on`, every process of
//!   the pod in their cgroup: `--pod-veth-tc auto` leaves it bare) is OK.
//! - **map \<name\>**: entries / capacity; hash maps WARN above 80 %, FAIL when full (inserts fail);
//!   the LRU maps (conntrack, affinity) WARN when (nearly) full: they evict.
//! - **north-south**: the external interfaces (tc, XDP) from the link pins (informational).
//! - **socket-lb**: the socket hooks and their mode: host-only or on OK; off WARN (the node's own
//!   processes cannot reach cluster IPs).
//! - **agent**: `GET /healthz` on `--healthz-address`: 200 OK, 503 FAIL with the body's `reason`,
//!   nothing listening WARN.
//! - **api-server**: `GET /version` on the endpoint the agent would use (`k8s::api_endpoint`, from
//!   `--kubeconfig`, `--master`, `--api-server-host/--api-server-port` and the environment, as the
//!   agent decides): it answers OK; no answer FAIL, and when that endpoint is the in-cluster
//!   ClusterIP the fix names `--api-server-host/--api-server-port` and ConfigMap
//!   `kproxy-api-endpoint`; no endpoint at all (not in a pod, no kubeconfig) WARN.
//! - **ip_forward**: at runtime and after the next boot, following sysctl's precedence (which file
//!   and line sets it): runtime 0 FAIL, runtime 1 but persisted 0 (the incident of
//!   shared/cases/001) or not persisted WARN.
//! - **ipv6_forward**: `net.ipv6.conf.all.forwarding`, as ip_forward, on a node that serves IPv6:
//!   IPv6 Services programmed, or forwarding on at runtime or in a sysctl file (off at runtime FAIL
//!   only with IPv6 Services); otherwise listed as skipped (an IPv4-only node does not need it).
//! - **rp_filter**: `net.ipv4.conf.{all,default}.rp_filter` strict (1) WARN.
//! - **kube-proxy**: kube-proxy running FAIL (both translate); its rules left behind WARN.
//! - **inherited**: connections netfilter translated before kproxy took over (kube-proxy's), from
//!   nf_conntrack: open ones are OK while a NAT hook remains to translate them, FAIL when none does.
//!
//! With `--root DIR` the files of a mounted node image are read instead
//! (`DIR/etc/sysctl.d/...`, `DIR/proc/...` when present); the checks of
//! the running datapath, agent and netfilter are skipped.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

use anyhow::Result;
use serde::Serialize;

use crate::bpf::{InterfaceSelector, PinDir};
use crate::k8s::api_endpoint::KubeOptions;
use agent::agent_check;
use api::api_check;
use datapath::datapath_checks;
use kernel::{btf_check, kernel_check};
use kube_proxy::kube_proxy_check;
use sysctl::runtime_sysctl;

mod agent;
mod api;
mod datapath;
mod kernel;
mod kube_proxy;
mod sysctl;
#[cfg(test)]
mod tests;

pub use agent::{agent_verdict, parse_http_response};
pub use api::{Probe, api_verdict};
pub use datapath::{
    attach_checks, covering_cgroups, link_pin_name, map_fill_check, north_south_check, socket_lb_check,
};
pub use kernel::{bpffs_check, bpffs_host_check, cgroup2_check, kernel_verdict, parse_kernel_version};
pub use kube_proxy::{kube_proxy_verdict, leftover_lines};
pub use sysctl::{
    Assignment, Ipv6Need, Runtime, SYSCTL_DIRS, Setting, SysctlFiles, ip_forward_check, ipv6_forward_check,
    ipv6_forward_need, normalize_key, parse_sysctl, rp_filter_check, snat_ports_check, sysctl_order,
};

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
    /// The agent's --kubeconfig, for the api-server check (without it, as the agent: the
    /// environment's KPROXY_API_SERVER_HOST, else in-cluster KUBERNETES_SERVICE_HOST).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The agent's --master, for the api-server check.
    #[arg(long)]
    pub master: Option<String>,
    /// The agent's --api-server-host, for the api-server check.
    #[arg(long, value_name = "HOST")]
    pub api_server_host: Option<String>,
    /// The agent's --api-server-port, for the api-server check.
    #[arg(long, value_name = "PORT")]
    pub api_server_port: Option<u16>,
}

impl DoctorArgs {
    /// The API server settings, as the agent takes them.
    fn kube_options(&self) -> KubeOptions {
        KubeOptions {
            kubeconfig: self.kubeconfig.clone(),
            master: self.master.clone(),
            api_server_host: self.api_server_host.clone(),
            api_server_port: self.api_server_port,
        }
    }
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
    pub(super) fn ok(name: impl Into<String>, finding: impl Into<String>) -> Self {
        Check { name: name.into(), status: Status::Ok, finding: finding.into(), fix: None }
    }
    pub(super) fn warn(name: impl Into<String>, finding: impl Into<String>, fix: impl Into<String>) -> Self {
        Check { name: name.into(), status: Status::Warn, finding: finding.into(), fix: Some(fix.into()) }
    }
    pub(super) fn fail(name: impl Into<String>, finding: impl Into<String>, fix: impl Into<String>) -> Self {
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
        checks.push(api_check(&args.kube_options()));
    } else {
        skipped.push(
            "bpffs-host, datapath, attach, maps, agent and api-server: they belong to a running node, not an image"
                .to_owned(),
        );
    }
    let files = SysctlFiles::read(root);
    checks.push(ip_forward_check(
        runtime_sysctl(root, "net.ipv4.ip_forward"),
        files.effective("net.ipv4.ip_forward"),
    ));
    // The live node's datapath, for the checks that depend on what it serves.
    let maps = if root.is_none() { crate::bpf::Maps::from_pins(pins).ok() } else { None };
    let ipv6_frontends = maps.as_ref().map_or(0, |maps| {
        maps.services_v6.iter().filter_map(|e| e.ok()).filter(|(key, _)| key.slot == 0).count() as u64
    });
    let (runtime6, persisted6) = (
        runtime_sysctl(root, "net.ipv6.conf.all.forwarding"),
        files.effective("net.ipv6.conf.all.forwarding"),
    );
    match ipv6_forward_need(ipv6_frontends, &runtime6, persisted6.as_ref()) {
        Some(need) => checks.push(ipv6_forward_check(need, runtime6, persisted6)),
        None => skipped.push(
            "ipv6_forward: no IPv6 Service is programmed and IPv6 forwarding is off at runtime and at boot"
                .to_owned(),
        ),
    }
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
    let snat_range =
        maps.as_ref().and_then(|maps| maps.nodeport_config.get(&0, 0).ok()).unwrap_or_default().port_range();
    checks.push(snat_ports_check(
        runtime_sysctl(root, "net.ipv4.ip_local_port_range"),
        runtime_sysctl(root, "net.ipv4.ip_local_reserved_ports"),
        snat_range,
    ));
    if root.is_none() {
        checks.push(kube_proxy_check());
        checks.push(kube_proxy::inherited_check());
    } else {
        skipped.push("kube-proxy: its rules live in the running kernel".to_owned());
    }
    Ok(Report { root: root.map(Path::to_path_buf), checks, skipped })
}

/// `path` on the node checked: under `root` when given.
pub(super) fn host(root: Option<&Path>, path: &str) -> PathBuf {
    match root {
        Some(root) => root.join(path.trim_start_matches('/')),
        None => PathBuf::from(path),
    }
}

pub(super) fn read(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok()
}
