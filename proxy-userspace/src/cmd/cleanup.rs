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
//! netfilter applies only while conntrack runs in the network namespace and a
//! NAT hook is registered. Both are there only while some rule needs them:
//! kube-proxy's DNAT, masquerade and `ct state` rules, not the empty built-in
//! chains they leave. So while any inherited connection is open, before the
//! first rule or table of kube-proxy's goes, [`KEEPER_TABLE`] is created: NAT
//! base chains with one rule that reads conntrack state and changes nothing;
//! a later run deletes it once none is left.
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

use super::kube_proxy_rules::{TablePlan, find_tool, kube_proxy_nft_tables, plan_save};

/// The nftables table of empty NAT base chains that keeps netfilter's NAT
/// hooks while inherited connections remain.
pub const KEEPER_TABLE: &str = "kproxy-inherited-nat";

/// `nft -f` input creating [`KEEPER_TABLE`] (a no-op when it exists). The
/// `ct state` rule makes netfilter track connections in this namespace (a rule
/// that needs conntrack is what turns it on); the NAT base chains register the
/// NAT hooks that apply the existing bindings. Neither translates a new flow.
const KEEPER_SCRIPT: &str = "table ip kproxy-inherited-nat {
\tchain prerouting { type nat hook prerouting priority -100; ct state established,related counter; }
\tchain output { type nat hook output priority -100; }
\tchain input { type nat hook input priority 100; }
\tchain postrouting { type nat hook postrouting priority 100; }
}
";

/// Keeps netfilter translating inherited connections while kube-proxy's rules go.
struct Keeper {
    /// Why it is needed (how many connections are open), `None` when it is not.
    needed: Option<String>,
    /// There already, or created by this run.
    present: bool,
    /// Created by this run (or, in a dry run, would be).
    created: bool,
}

impl Keeper {
    fn new(inherited: &Result<usize, String>, present: bool) -> Self {
        let needed = match inherited {
            Ok(0) => None,
            Ok(n) => Some(format!("{n} connection(s) opened through kube-proxy are still open")),
            // Not counted: keep the hooks rather than risk cutting them.
            Err(e) => Some(format!("connections netfilter translated could not be counted ({e})")),
        };
        Keeper { needed, present, created: false }
    }

    /// Called before removing anything of kube-proxy's.
    fn ensure(&mut self, apply: bool, nft: Option<&std::path::Path>) -> Result<()> {
        if self.present || self.needed.is_none() {
            return Ok(());
        }
        if apply {
            let nft = nft.context(
                "nft is not installed: cannot keep netfilter's NAT hooks for inherited connections",
            )?;
            run_command(Command::new(nft).args(["-f", "-"]), Some(KEEPER_SCRIPT))?;
        }
        self.present = true;
        self.created = true;
        Ok(())
    }
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
    let inherited = open_inherited_connections();
    let keeper_there = nft.as_deref().is_some_and(keeper_table_exists);
    let mut cleanup = Cleanup {
        apply,
        keeper: Keeper::new(&inherited, keeper_there),
        nft,
        out: String::new(),
        rules: 0,
        chains: 0,
        tables: 0,
        failures: 0,
    };
    if !apply {
        cleanup.out.push_str(
            "dry run: nothing is changed; `kproxy cleanup-kube-proxy --apply` removes what is listed\n",
        );
    }
    for backend in &backends {
        cleanup.iptables(backend);
    }
    if backends.is_empty() {
        cleanup.out.push_str("iptables: not installed; not checked\n");
    }
    cleanup.nftables();
    cleanup.keeper_outcome();
    cleanup.summary(&inherited)
}

fn keeper_table_exists(nft: &std::path::Path) -> bool {
    run_command(Command::new(nft).args(["list", "tables"]), None).is_ok_and(|listed| {
        super::kube_proxy_rules::parse_nft_tables(&listed)
            .iter()
            .any(|(family, name)| family == "ip" && name == KEEPER_TABLE)
    })
}

/// One run of the command: what it does (or, in a dry run, would do) and its report.
struct Cleanup {
    apply: bool,
    nft: Option<PathBuf>,
    keeper: Keeper,
    out: String,
    rules: usize,
    chains: usize,
    tables: usize,
    failures: usize,
}

impl Cleanup {
    fn verb(&self, what: &str) -> String {
        if self.apply { format!("deleted {what}") } else { format!("would delete {what}") }
    }

    /// kube-proxy's chains in one iptables backend, one transaction per table.
    fn iptables(&mut self, backend: &Backend) {
        let saved = match run_command(&mut Command::new(&backend.save), None) {
            Ok(saved) => saved,
            Err(error) => {
                let _ = writeln!(self.out, "{}: not checked: {error:#}", backend.label);
                return;
            }
        };
        let plans = match plan_save(&saved) {
            Ok(plans) => plans,
            Err(error) => {
                self.failures += 1;
                let _ = writeln!(
                    self.out,
                    "{}: cannot read {}: {error:#}",
                    backend.label,
                    backend.save.display()
                );
                return;
            }
        };
        if plans.is_empty() {
            let _ = writeln!(self.out, "{}: nothing of kube-proxy's", backend.label);
        }
        for plan in &plans {
            let _ = writeln!(self.out, "{} table {}:", backend.label, plan.table);
            for (chain, because) in &plan.kept {
                let _ = writeln!(
                    self.out,
                    "  keep chain {chain}: a chain that is not kube-proxy's uses it: {because}"
                );
            }
            if !plan.is_empty() {
                self.apply_plan(backend, plan);
            }
        }
    }

    fn apply_plan(&mut self, backend: &Backend, plan: &TablePlan) {
        let (apply, nft) = (self.apply, self.nft.clone());
        let result = self.keeper.ensure(apply, nft.as_deref()).and_then(|()| {
            if !apply {
                return Ok(());
            }
            run_command(
                Command::new(&backend.restore).args(["-w", "5", "--noflush"]),
                Some(&plan.restore_input()),
            )
            .map(drop)
        });
        match result {
            Ok(()) => {
                let (rule_verb, chain_verb) = (self.verb("rule"), self.verb("chain"));
                for rule in &plan.delete_rules {
                    let _ = writeln!(self.out, "  {rule_verb}: {rule}");
                }
                for (chain, count) in &plan.delete_chains {
                    let _ = writeln!(self.out, "  {chain_verb}: {chain} ({count} rules)");
                }
                self.rules += plan.delete_rules.len();
                self.chains += plan.delete_chains.len();
            }
            Err(error) => {
                self.failures += 1;
                let _ = writeln!(
                    self.out,
                    "  FAILED, table left as it was (is kube-proxy still running on this node?): {error:#}"
                );
            }
        }
    }

    /// kube-proxy's nftables tables (nftables mode).
    fn nftables(&mut self) {
        let Some(nft) = self.nft.clone() else {
            self.out.push_str("nftables: nft is not installed; not checked\n");
            return;
        };
        let listed = match run_command(Command::new(&nft).args(["list", "tables"]), None) {
            Ok(listed) => listed,
            Err(error) => {
                let _ = writeln!(self.out, "nftables: not checked: {error:#}");
                return;
            }
        };
        let found = kube_proxy_nft_tables(&listed);
        if found.is_empty() {
            self.out.push_str("nftables: nothing of kube-proxy's\n");
        }
        let table_verb = self.verb("table");
        for (family, name) in found {
            let apply = self.apply;
            let result = self.keeper.ensure(apply, Some(&nft)).and_then(|()| {
                if apply {
                    run_command(Command::new(&nft).args(["delete", "table", &family, &name]), None).map(drop)
                } else {
                    Ok(())
                }
            });
            match result {
                Ok(()) => {
                    self.tables += 1;
                    let _ = writeln!(self.out, "nftables: {table_verb} {family} {name}");
                }
                Err(error) => {
                    self.failures += 1;
                    let _ = writeln!(self.out, "nftables: FAILED to delete table {family} {name}: {error:#}");
                }
            }
        }
    }

    /// What became of [`KEEPER_TABLE`]: kept while inherited connections are open, deleted once
    /// none is.
    fn keeper_outcome(&mut self) {
        match (&self.keeper.needed, self.keeper.present) {
            (Some(why), true) => {
                let verb = if self.keeper.created && !self.apply { "would keep" } else { "kept" };
                let _ = writeln!(
                    self.out,
                    "{verb} netfilter's connection tracking and NAT hooks (nftables table ip {KEEPER_TABLE}): \
                     {why}; run `kproxy cleanup-kube-proxy --apply` again once they have ended"
                );
            }
            (None, true) => {
                let result = match (&self.nft, self.apply) {
                    (Some(nft), true) => {
                        run_command(Command::new(nft).args(["delete", "table", "ip", KEEPER_TABLE]), None)
                            .map(drop)
                    }
                    _ => Ok(()),
                };
                match result {
                    Ok(()) => {
                        self.tables += 1;
                        let _ = writeln!(
                            self.out,
                            "nftables: {} ip {KEEPER_TABLE}: no connection opened through kube-proxy is left",
                            self.verb("table")
                        );
                    }
                    Err(error) => {
                        self.failures += 1;
                        let _ = writeln!(
                            self.out,
                            "nftables: FAILED to delete table ip {KEEPER_TABLE}: {error:#}"
                        );
                    }
                }
            }
            _ => {}
        }
    }

    /// The open inherited connections and the totals; an error when a step failed.
    fn summary(mut self, inherited: &Result<usize, String>) -> Result<String> {
        match inherited {
            Ok(0) => self.out.push_str("connections opened through kube-proxy still open: none\n"),
            Ok(n) => {
                let _ = writeln!(
                    self.out,
                    "connections opened through kube-proxy still open: {n} (netfilter translates them until they \
                     end)"
                );
            }
            Err(e) => {
                let _ = writeln!(self.out, "connections opened through kube-proxy: not counted: {e}");
            }
        }
        let (rules, chains, tables) = (self.rules, self.chains, self.tables);
        let what = format!("{rules} rules, {chains} chains, {tables} nftables tables");
        if rules + chains + tables == 0 && self.failures == 0 {
            self.out.push_str("nothing of kube-proxy's found\n");
        } else if self.apply {
            let _ = writeln!(self.out, "removed {what}");
        } else {
            let _ = writeln!(self.out, "would remove {what}");
        }
        if self.failures > 0 {
            bail!("{}{} step(s) failed", self.out, self.failures);
        }
        Ok(self.out)
    }
}
