//! `kproxy cleanup-kube-proxy`: removes what kube-proxy left in netfilter after
//! a node moved to kproxy.
//!
//! kube-proxy does not clean up when its DaemonSet is deleted: its iptables
//! chains (iptables and IPVS modes) and its nftables tables (nftables mode)
//! stay and keep DNATing Service traffic with a frozen view of the cluster.
//! This command finds them and, with `apply`, removes them:
//!
//! - iptables, for every backend installed (`iptables-nft`, `iptables-legacy`,
//!   and the `ip6tables` ones; plain `iptables` where the variants are
//!   missing): the chains kube-proxy creates ([`is_kube_proxy_chain`]), and the
//!   rules of built-in chains that jump into them. Read with `<backend>-save`,
//!   removed with `<backend>-restore --noflush` in one transaction per table
//!   (`-D` the jumps, `-F` then `-X` the chains), so a table is either cleaned
//!   whole or left as it was.
//! - nftables: the tables `ip kube-proxy` and `ip6 kube-proxy`.
//!
//! Connections opened through kube-proxy's rules before kproxy took over
//! ("inherited": the agent leaves them to netfilter, see
//! `agent::inherited`) are translated by nf_conntrack's NAT bindings, which
//! netfilter applies only while a NAT hook is registered. Deleting kube-proxy's
//! nftables table unregisters its NAT chains — and with the last of them the
//! hooks, cutting those connections. So while any is open, the table is
//! replaced in the same transaction by [`KEEPER_TABLE`], empty NAT base chains
//! that keep the hooks (and translate nothing new); a later run removes it once
//! none is left. iptables' `nat` table keeps its built-in chains, and with them
//! the hooks, whatever is removed from it.
//!
//! Nothing else is touched: kubelet's chains (`KUBE-FIREWALL`,
//! `KUBE-KUBELET-CANARY`), other `KUBE-*` chains (kube-router's
//! `KUBE-ROUTER-*`...), other tables, and every rule that does not jump into a
//! removed chain stay. A kube-proxy chain that a chain which is not
//! kube-proxy's jumps to is kept (with what it jumps to) and reported, since
//! deleting it would break, or require deleting, someone else's rule.

use std::{
    fmt::Write as _,
    io::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use super::kube_proxy_rules::{find_tool, kube_proxy_nft_tables, plan_save};

/// The nftables table of empty NAT base chains that keeps netfilter's NAT
/// hooks while inherited connections remain.
pub const KEEPER_TABLE: &str = "kproxy-inherited-nat";

/// `nft -f` input: [`KEEPER_TABLE`] created (if missing), then `tables` deleted,
/// in one transaction so the NAT hooks never go away in between.
fn keeper_script(tables: &[(String, String)]) -> String {
    let mut script = format!(
        "table ip {KEEPER_TABLE} {{\n\
         \tchain prerouting {{ type nat hook prerouting priority dstnat; }}\n\
         \tchain output {{ type nat hook output priority dstnat; }}\n\
         \tchain input {{ type nat hook input priority srcnat; }}\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; }}\n\
         }}\n"
    );
    for (family, name) in tables {
        let _ = writeln!(script, "delete table {family} {name}");
    }
    script
}

/// Connections netfilter translated that are still open, from nf_conntrack;
/// an error says why they could not be counted.
pub fn open_inherited_connections() -> Result<usize, String> {
    if !crate::nf_conntrack::is_available() {
        return Ok(0);
    }
    crate::nf_conntrack::dump_v4()
        .map(|entries| entries.iter().filter(|e| e.is_dst_nat() && !e.is_over()).count())
        .map_err(|e| format!("{e:#}"))
}

/// An installed iptables flavour: its save and restore commands.
struct Backend {
    label: String,
    save: PathBuf,
    restore: PathBuf,
}

fn backends() -> Vec<Backend> {
    let mut found = Vec::new();
    for family in ["iptables", "ip6tables"] {
        let mut any = false;
        for label in [format!("{family}-nft"), format!("{family}-legacy")] {
            if let (Some(save), Some(restore)) =
                (find_tool(&format!("{label}-save")), find_tool(&format!("{label}-restore")))
            {
                found.push(Backend { label, save, restore });
                any = true;
            }
        }
        if !any
            && let (Some(save), Some(restore)) =
                (find_tool(&format!("{family}-save")), find_tool(&format!("{family}-restore")))
        {
            found.push(Backend { label: family.to_string(), save, restore });
        }
    }
    found
}

/// Runs `command`, feeding `stdin`; its stdout, or an error with its stderr.
fn run_command(command: &mut Command, stdin: Option<&str>) -> Result<String> {
    let shown = format!("{command:?}");
    let mut child = command
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {shown}"))?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().context("stdin")?;
        pipe.write_all(input.as_bytes()).with_context(|| format!("writing to {shown}"))?;
    }
    let output = child.wait_with_output().with_context(|| format!("waiting for {shown}"))?;
    if !output.status.success() {
        bail!("{shown} failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Lists (and with `apply`, removes) kube-proxy's chains; returns the report.
/// With `apply`, a failed step makes it an error whose message is the report.
pub fn run(apply: bool) -> Result<String> {
    let backends = backends();
    let nft = find_tool("nft");
    if backends.is_empty() && nft.is_none() {
        bail!("neither iptables-save nor nft is installed: nothing to check");
    }
    let (rule_verb, chain_verb, table_verb) = if apply {
        ("deleted rule", "deleted chain", "deleted table")
    } else {
        ("would delete rule", "would delete chain", "would delete table")
    };
    let mut out = String::new();
    if !apply {
        out.push_str(
            "dry run: nothing is changed; `kproxy cleanup-kube-proxy --apply` removes what is listed\n",
        );
    }
    let (mut rules, mut chains, mut tables, mut failures) = (0usize, 0usize, 0usize, 0usize);

    for backend in &backends {
        let saved = match run_command(&mut Command::new(&backend.save), None) {
            Ok(saved) => saved,
            Err(error) => {
                let _ = writeln!(out, "{}: not checked: {error:#}", backend.label);
                continue;
            }
        };
        let plans = match plan_save(&saved) {
            Ok(plans) => plans,
            Err(error) => {
                failures += 1;
                let _ = writeln!(out, "{}: cannot read {}: {error:#}", backend.label, backend.save.display());
                continue;
            }
        };
        if plans.is_empty() {
            let _ = writeln!(out, "{}: nothing of kube-proxy's", backend.label);
        }
        for plan in &plans {
            let _ = writeln!(out, "{} table {}:", backend.label, plan.table);
            for (chain, because) in &plan.kept {
                let _ = writeln!(
                    out,
                    "  keep chain {chain}: a chain that is not kube-proxy's uses it: {because}"
                );
            }
            if plan.is_empty() {
                continue;
            }
            let result = if apply {
                run_command(
                    Command::new(&backend.restore).args(["-w", "5", "--noflush"]),
                    Some(&plan.restore_input()),
                )
                .map(drop)
            } else {
                Ok(())
            };
            match result {
                Ok(()) => {
                    for rule in &plan.delete_rules {
                        let _ = writeln!(out, "  {rule_verb}: {rule}");
                    }
                    for (chain, count) in &plan.delete_chains {
                        let _ = writeln!(out, "  {chain_verb}: {chain} ({count} rules)");
                    }
                    rules += plan.delete_rules.len();
                    chains += plan.delete_chains.len();
                }
                Err(error) => {
                    failures += 1;
                    let _ = writeln!(
                        out,
                        "  FAILED, table left as it was (is kube-proxy still running on this node?): {error:#}"
                    );
                }
            }
        }
    }
    if backends.is_empty() {
        out.push_str("iptables: not installed; not checked\n");
    }

    match &nft {
        None => out.push_str("nftables: nft is not installed; not checked\n"),
        Some(nft) => match run_command(Command::new(nft).args(["list", "tables"]), None) {
            Err(error) => {
                let _ = writeln!(out, "nftables: not checked: {error:#}");
            }
            Ok(listed) => {
                let found = kube_proxy_nft_tables(&listed);
                if found.is_empty() {
                    out.push_str("nftables: nothing of kube-proxy's\n");
                }
                let keeper_there = super::kube_proxy_rules::parse_nft_tables(&listed)
                    .iter()
                    .any(|(family, name)| family == "ip" && name == KEEPER_TABLE);
                let inherited = open_inherited_connections();
                let still_open = match &inherited {
                    Ok(n) => *n > 0,
                    // Not counted: keep the hooks rather than risk cutting them.
                    Err(_) => true,
                };
                let shown = match &inherited {
                    Ok(n) => format!("{n} connection(s) translated by netfilter (kube-proxy) are still open"),
                    Err(e) => format!("connections translated by netfilter could not be counted ({e})"),
                };
                let keep = still_open && !found.is_empty();
                let result = if !apply || found.is_empty() {
                    Ok(())
                } else if keep {
                    run_command(Command::new(nft).args(["-f", "-"]), Some(&keeper_script(&found))).map(drop)
                } else {
                    found.iter().try_for_each(|(family, name)| {
                        run_command(Command::new(nft).args(["delete", "table", family, name]), None).map(drop)
                    })
                };
                match result {
                    Ok(()) => {
                        for (family, name) in &found {
                            tables += 1;
                            let _ = writeln!(out, "nftables: {table_verb} {family} {name}");
                        }
                        if keep {
                            let verb = if apply { "kept" } else { "would keep" };
                            let _ = writeln!(
                                out,
                                "nftables: {verb} netfilter's NAT hooks (table ip {KEEPER_TABLE}, no rules): \
                                 {shown}; run `kproxy cleanup-kube-proxy --apply` again once they have ended"
                            );
                        }
                    }
                    Err(error) => {
                        failures += 1;
                        let _ = writeln!(out, "nftables: FAILED, tables left as they were: {error:#}");
                    }
                }
                if keeper_there && found.is_empty() {
                    if still_open {
                        let _ = writeln!(out, "nftables: keeping table ip {KEEPER_TABLE}: {shown}");
                    } else if apply {
                        match run_command(
                            Command::new(nft).args(["delete", "table", "ip", KEEPER_TABLE]),
                            None,
                        ) {
                            Ok(_) => {
                                tables += 1;
                                let _ = writeln!(
                                    out,
                                    "nftables: deleted table ip {KEEPER_TABLE}: no connection inherited from \
                                     kube-proxy is left"
                                );
                            }
                            Err(error) => {
                                failures += 1;
                                let _ = writeln!(
                                    out,
                                    "nftables: FAILED to delete table ip {KEEPER_TABLE}: {error:#}"
                                );
                            }
                        }
                    } else {
                        tables += 1;
                        let _ = writeln!(
                            out,
                            "nftables: would delete table ip {KEEPER_TABLE}: no connection inherited from kube-proxy \
                             is left"
                        );
                    }
                }
            }
        },
    }

    match open_inherited_connections() {
        Ok(0) => out.push_str("connections opened through kube-proxy still open: none\n"),
        Ok(n) => {
            let _ = writeln!(
                out,
                "connections opened through kube-proxy still open: {n} (netfilter translates them until they end)"
            );
        }
        Err(e) => {
            let _ = writeln!(out, "connections opened through kube-proxy: not counted: {e}");
        }
    }
    let what = format!("{rules} rules, {chains} chains, {tables} nftables tables");
    if rules + chains + tables == 0 && failures == 0 {
        out.push_str("nothing of kube-proxy's found\n");
    } else if apply {
        let _ = writeln!(out, "removed {what}");
    } else {
        let _ = writeln!(out, "would remove {what}");
    }
    if failures > 0 {
        bail!("{out}{failures} step(s) failed");
    }
    Ok(out)
}
