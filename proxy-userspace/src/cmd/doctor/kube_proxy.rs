//! kube-proxy checks: a running kube-proxy, and the rules it left behind (read with
//! [`kube_proxy_rules`](crate::cmd::kube_proxy_rules)).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

use super::{Check, read};
use crate::cmd::kube_proxy_rules::find_tool;

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

pub(super) fn kube_proxy_check() -> Check {
    let (found, unchecked) = kube_proxy_leftovers();
    kube_proxy_verdict(&kube_proxy_pids(), &found, &unchecked)
}

/// Connections netfilter translated before kproxy took over (kube-proxy's), still open: whether
/// netfilter can still translate them.
pub fn inherited_verdict(open: Result<usize, String>, nat_hooks: Option<bool>) -> Check {
    let name = "inherited";
    match (open, nat_hooks) {
        (Err(e), _) => {
            Check::warn(name, format!("nf_conntrack not read: {e}"), "run as root (CAP_NET_ADMIN)")
        }
        (Ok(0), _) => Check::ok(name, "no connection translated by netfilter (kube-proxy) is open"),
        (Ok(n), Some(false)) => Check::fail(
            name,
            format!(
                "{n} connection(s) translated by netfilter are open but no NAT hook is left: they are no longer translated"
            ),
            "reconnect their clients; next time let `kproxy cleanup-kube-proxy --apply` remove kube-proxy's rules (it keeps the hooks)",
        ),
        (Ok(n), _) => Check::ok(
            name,
            format!(
                "{n} connection(s) opened through kube-proxy are still open; netfilter translates them until they end \
                 (`kproxy cleanup-kube-proxy --apply` removes what keeps its NAT hooks once none is left)"
            ),
        ),
    }
}

pub(super) fn inherited_check() -> Check {
    inherited_verdict(
        crate::cmd::cleanup::open_inherited_connections(),
        crate::cmd::netfilter::nat_hooks_present(),
    )
}
