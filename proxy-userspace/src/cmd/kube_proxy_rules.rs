//! kube-proxy's netfilter rules: which iptables chains and nftables tables are kube-proxy's, read from
//! `<backend>-save` and `nft list tables`, and the plan that removes them. Shared by `kproxy
//! cleanup-kube-proxy` (which applies it) and `kproxy doctor` (which reports what is left).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};

/// Chains kube-proxy creates (iptables and IPVS modes, current and past
/// releases), in any table.
pub const KUBE_PROXY_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-MARK-DROP",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOOP-BACK",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
    "KUBE-SOURCE-RANGES-FIREWALL",
];

/// Per-Service and per-endpoint chains (the suffix is a hash of the name).
pub const KUBE_PROXY_CHAIN_PREFIXES: &[&str] =
    &["KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-", "KUBE-XLB-"];

/// kubelet's chains: never removed, whatever the patterns above say.
pub const KUBELET_CHAINS: &[&str] = &["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"];

/// nftables tables of kube-proxy's nftables mode: (family, name).
pub const KUBE_PROXY_NFT_TABLES: &[(&str, &str)] = &[("ip", "kube-proxy"), ("ip6", "kube-proxy")];

/// Whether `chain` is one kube-proxy creates.
pub fn is_kube_proxy_chain(chain: &str) -> bool {
    !KUBELET_CHAINS.contains(&chain)
        && (KUBE_PROXY_CHAINS.contains(&chain)
            || KUBE_PROXY_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// One table of `iptables-save` output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedTable {
    pub name: String,
    /// In the order saved.
    pub chains: Vec<SavedChain>,
    /// In the order saved (per chain, that is rule order).
    pub rules: Vec<SavedRule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedChain {
    pub name: String,
    /// A built-in chain (it has a policy; user chains show `-`).
    pub builtin: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    /// The `-j`/`-g` target, if any.
    pub target: Option<String>,
    /// The line as saved, `-A CHAIN ...`.
    pub line: String,
}

/// Splits a rule line into arguments the way iptables-restore does: blanks
/// separate, double quotes group (a backslash escapes a quote inside).
fn split_args(line: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut current = String::new();
    let mut in_arg = false;
    let mut quoted = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    current.push(next);
                }
            }
            '"' => {
                quoted = !quoted;
                in_arg = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_arg {
                    args.push(std::mem::take(&mut current));
                    in_arg = false;
                }
            }
            c => {
                current.push(c);
                in_arg = true;
            }
        }
    }
    if in_arg {
        args.push(current);
    }
    args
}

/// Parses `iptables-save` output (every table in it). Comment lines are
/// skipped; anything not understood is an error, so nothing is removed on a
/// misreading.
pub fn parse_save(text: &str) -> Result<Vec<SavedTable>> {
    let mut tables = Vec::new();
    let mut current: Option<SavedTable> = None;
    for (number, raw) in text.lines().enumerate() {
        let number = number + 1;
        let mut line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // `iptables-save -c` puts counters before the rule.
        if line.starts_with('[')
            && let Some(end) = line.find(']')
        {
            line = line[end + 1..].trim_start();
        }
        if let Some(name) = line.strip_prefix('*') {
            if let Some(table) = current.take() {
                bail!("line {number}: table {} has no COMMIT before *{name}", table.name);
            }
            current = Some(SavedTable { name: name.to_string(), chains: Vec::new(), rules: Vec::new() });
            continue;
        }
        let Some(table) = current.as_mut() else {
            bail!("line {number}: {line:?} outside a table");
        };
        if line == "COMMIT" {
            tables.extend(current.take());
        } else if let Some(declaration) = line.strip_prefix(':') {
            let mut fields = declaration.split_whitespace();
            let (Some(name), Some(policy)) = (fields.next(), fields.next()) else {
                bail!("line {number}: chain declaration {line:?} without a policy");
            };
            table.chains.push(SavedChain { name: name.to_string(), builtin: policy != "-" });
        } else if line.starts_with("-A ") {
            let args = split_args(line);
            let chain =
                args.get(1).cloned().with_context(|| format!("line {number}: {line:?} has no chain"))?;
            let target = args
                .windows(2)
                .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
                .map(|w| w[1].clone());
            table.rules.push(SavedRule { chain, target, line: line.to_string() });
        } else {
            bail!("line {number}: unexpected {line:?}");
        }
    }
    if let Some(table) = current {
        bail!("table {} has no COMMIT", table.name);
    }
    Ok(tables)
}

/// What to remove from one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TablePlan {
    pub table: String,
    /// Rules of other chains that jump into a removed chain (`-A ...` lines).
    pub delete_rules: Vec<String>,
    /// kube-proxy chains to flush and delete, with how many rules each holds.
    pub delete_chains: Vec<(String, usize)>,
    /// kube-proxy chains kept because a chain that is not kube-proxy's jumps
    /// to them: (chain, the rule that keeps it).
    pub kept: Vec<(String, String)>,
}

impl TablePlan {
    /// Nothing to remove (kept chains are only reported).
    pub fn is_empty(&self) -> bool {
        self.delete_rules.is_empty() && self.delete_chains.is_empty()
    }

    /// Input for `iptables-restore --noflush`: one transaction that deletes the
    /// jumps, flushes every chain, then deletes them (chains may jump to each
    /// other, so all are flushed before any is deleted).
    pub fn restore_input(&self) -> String {
        let mut out = format!("*{}\n", self.table);
        for rule in &self.delete_rules {
            let spec = rule.strip_prefix("-A ").unwrap_or(rule);
            let _ = writeln!(out, "-D {spec}");
        }
        for (chain, _) in &self.delete_chains {
            let _ = writeln!(out, "-F {chain}");
        }
        for (chain, _) in &self.delete_chains {
            let _ = writeln!(out, "-X {chain}");
        }
        out.push_str("COMMIT\n");
        out
    }
}

/// Decides what to remove from a table: every kube-proxy chain and the rules
/// of built-in chains that jump into one, except chains reachable from a chain
/// that is neither built-in nor kube-proxy's.
pub fn plan_table(table: &SavedTable) -> TablePlan {
    let builtin: BTreeSet<&str> =
        table.chains.iter().filter(|c| c.builtin).map(|c| c.name.as_str()).collect();
    let owned: BTreeSet<&str> = table
        .chains
        .iter()
        .filter(|c| !c.builtin && is_kube_proxy_chain(&c.name))
        .map(|c| c.name.as_str())
        .collect();
    let mut rules_of: BTreeMap<&str, Vec<&SavedRule>> = BTreeMap::new();
    for rule in &table.rules {
        rules_of.entry(rule.chain.as_str()).or_default().push(rule);
    }

    // Kept: owned chains someone else's chain jumps to, and what they reach.
    let mut kept: Vec<(String, String)> = Vec::new();
    let mut kept_set: BTreeSet<&str> = BTreeSet::new();
    let mut work: Vec<&str> = Vec::new();
    for rule in &table.rules {
        let chain = rule.chain.as_str();
        if builtin.contains(chain) || owned.contains(chain) {
            continue;
        }
        if let Some(target) = rule.target.as_deref()
            && owned.contains(target)
            && kept_set.insert(target)
        {
            kept.push((target.to_string(), rule.line.clone()));
            work.push(target);
        }
    }
    while let Some(chain) = work.pop() {
        for rule in rules_of.get(chain).into_iter().flatten() {
            if let Some(target) = rule.target.as_deref()
                && owned.contains(target)
                && kept_set.insert(target)
            {
                kept.push((target.to_string(), rule.line.clone()));
                work.push(target);
            }
        }
    }

    let doomed: BTreeSet<&str> = owned.difference(&kept_set).copied().collect();
    let delete_rules = table
        .rules
        .iter()
        .filter(|r| builtin.contains(r.chain.as_str()))
        .filter(|r| r.target.as_deref().is_some_and(|t| doomed.contains(t)))
        .map(|r| r.line.clone())
        .collect();
    let delete_chains = table
        .chains
        .iter()
        .filter(|c| doomed.contains(c.name.as_str()))
        .map(|c| (c.name.clone(), rules_of.get(c.name.as_str()).map_or(0, Vec::len)))
        .collect();
    TablePlan { table: table.name.clone(), delete_rules, delete_chains, kept }
}

/// Plans every table of an `iptables-save` output; tables with nothing of
/// kube-proxy's are left out.
pub fn plan_save(text: &str) -> Result<Vec<TablePlan>> {
    Ok(parse_save(text)?.iter().map(plan_table).filter(|p| !p.is_empty() || !p.kept.is_empty()).collect())
}

/// `nft list tables` → (family, name).
pub fn parse_nft_tables(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            match (fields.next(), fields.next(), fields.next()) {
                (Some("table"), Some(family), Some(name)) => Some((family.to_string(), name.to_string())),
                _ => None,
            }
        })
        .collect()
}

/// kube-proxy's tables among `nft list tables` output.
pub fn kube_proxy_nft_tables(text: &str) -> Vec<(String, String)> {
    parse_nft_tables(text)
        .into_iter()
        .filter(|(family, name)| KUBE_PROXY_NFT_TABLES.contains(&(family.as_str(), name.as_str())))
        .collect()
}

/// A tool by name on PATH or in the sbin directories (a non-root PATH often
/// lacks them).
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// minikube with kube-proxy in iptables mode and Docker as the runtime:
    /// `default/nginx-service` (10.97.79.231:80, three endpoints, NodePort
    /// 30080) and `kube-system/kube-dns` (10.96.0.10:53/UDP), as in
    /// shared/cases/002; kubelet's and Docker's chains alongside.
    const MINIKUBE: &str = r#"# Generated by iptables-save v1.8.9 on Sun Nov 29 15:01:11 2026
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [12:720]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [15746:946000]
:POSTROUTING ACCEPT [8165:491000]
:DOCKER - [0:0]
:KUBE-EXT-V2OKYYMBY3REGZOG - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-3VDHYO53IOQ2XWUD - [0:0]
:KUBE-SEP-C54WIGIB4NQVIFB3 - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
:KUBE-SEP-KN3IA7DQGTHQJWSD - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SVC-V2OKYYMBY3REGZOG - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
-A KUBE-EXT-V2OKYYMBY3REGZOG -m comment --comment "masquerade traffic for default/nginx-service external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-V2OKYYMBY3REGZOG -j KUBE-SVC-V2OKYYMBY3REGZOG
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/nginx-service" -m tcp --dport 30080 -j KUBE-EXT-V2OKYYMBY3REGZOG
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-3VDHYO53IOQ2XWUD -s 172.17.0.4/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-3VDHYO53IOQ2XWUD -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 172.17.0.4:80
-A KUBE-SEP-C54WIGIB4NQVIFB3 -s 172.17.0.5/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-C54WIGIB4NQVIFB3 -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 172.17.0.5:80
-A KUBE-SEP-IT2ZTR26TO4XFPTO -s 172.17.0.2/32 -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination 172.17.0.2:53
-A KUBE-SEP-KN3IA7DQGTHQJWSD -s 172.17.0.6/32 -m comment --comment "default/nginx-service" -j KUBE-MARK-MASQ
-A KUBE-SEP-KN3IA7DQGTHQJWSD -p tcp -m comment --comment "default/nginx-service" -m tcp -j DNAT --to-destination 172.17.0.6:80
-A KUBE-SERVICES -d 10.97.79.231/32 -p tcp -m comment --comment "default/nginx-service cluster IP" -m tcp --dport 80 -j KUBE-SVC-V2OKYYMBY3REGZOG
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-TCOU7JCQXEZGVUNU
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-TCOU7JCQXEZGVUNU ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-MARK-MASQ
-A KUBE-SVC-TCOU7JCQXEZGVUNU -m comment --comment "kube-system/kube-dns:dns -> 172.17.0.2:53" -j KUBE-SEP-IT2ZTR26TO4XFPTO
-A KUBE-SVC-V2OKYYMBY3REGZOG ! -s 10.244.0.0/16 -d 10.97.79.231/32 -p tcp -m comment --comment "default/nginx-service cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 172.17.0.4:80" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-3VDHYO53IOQ2XWUD
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 172.17.0.5:80" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-C54WIGIB4NQVIFB3
-A KUBE-SVC-V2OKYYMBY3REGZOG -m comment --comment "default/nginx-service -> 172.17.0.6:80" -j KUBE-SEP-KN3IA7DQGTHQJWSD
COMMIT
*filter
:INPUT ACCEPT [1379000:225000000]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [17326:1040000]
:DOCKER - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -o docker0 -j DOCKER
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
# Completed on Sun Nov 29 15:01:11 2026
"#;

    fn plans() -> BTreeMap<String, TablePlan> {
        plan_save(MINIKUBE).unwrap().into_iter().map(|p| (p.table.clone(), p)).collect()
    }

    fn chains(plan: &TablePlan) -> Vec<&str> {
        plan.delete_chains.iter().map(|(c, _)| c.as_str()).collect()
    }

    #[test]
    fn ownership_of_chain_names() {
        for ours in [
            "KUBE-SERVICES",
            "KUBE-SVC-V2OKYYMBY3REGZOG",
            "KUBE-SEP-3VDHYO53IOQ2XWUD",
            "KUBE-EXT-V2OKYYMBY3REGZOG",
            "KUBE-FW-ABC",
            "KUBE-XLB-ABC",
            "KUBE-SVL-ABC",
            "KUBE-PROXY-CANARY",
            "KUBE-MARK-DROP",
            "KUBE-LOAD-BALANCER",
        ] {
            assert!(is_kube_proxy_chain(ours), "{ours}");
        }
        for theirs in [
            "KUBE-FIREWALL",
            "KUBE-KUBELET-CANARY",
            "KUBE-ROUTER-FORWARD",
            "KUBE-NWPLCY-ABC",
            "KUBE-SERVICES-EXTRA",
            "DOCKER",
            "cali-FORWARD",
            "INPUT",
        ] {
            assert!(!is_kube_proxy_chain(theirs), "{theirs}");
        }
    }

    #[test]
    fn parses_minikube_save() {
        let tables = parse_save(MINIKUBE).unwrap();
        let names: Vec<&str> = tables.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["mangle", "nat", "filter"]);
        let nat = &tables[1];
        assert_eq!(nat.chains.iter().filter(|c| c.builtin).count(), 4);
        assert_eq!(nat.rules.len(), 31);
        let jump = &nat.rules[0];
        assert_eq!(jump.chain, "PREROUTING");
        assert_eq!(jump.target.as_deref(), Some("KUBE-SERVICES"));
        // The comment with blanks and `;` is one argument; the target after it is found.
        let last = nat.rules.iter().find(|r| r.line.contains("must be the last rule")).unwrap();
        assert_eq!(last.target.as_deref(), Some("KUBE-NODEPORTS"));
    }

    #[test]
    fn minikube_plan_removes_kube_proxy_only() {
        let plans = plans();
        let nat = &plans["nat"];
        assert_eq!(
            chains(nat),
            [
                "KUBE-EXT-V2OKYYMBY3REGZOG",
                "KUBE-MARK-MASQ",
                "KUBE-NODEPORTS",
                "KUBE-POSTROUTING",
                "KUBE-PROXY-CANARY",
                "KUBE-SEP-3VDHYO53IOQ2XWUD",
                "KUBE-SEP-C54WIGIB4NQVIFB3",
                "KUBE-SEP-IT2ZTR26TO4XFPTO",
                "KUBE-SEP-KN3IA7DQGTHQJWSD",
                "KUBE-SERVICES",
                "KUBE-SVC-TCOU7JCQXEZGVUNU",
                "KUBE-SVC-V2OKYYMBY3REGZOG",
            ]
        );
        assert_eq!(
            nat.delete_rules,
            [
                r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                r#"-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#,
            ]
        );
        assert!(nat.kept.is_empty());
        let svc = nat.delete_chains.iter().find(|(c, _)| c == "KUBE-SVC-V2OKYYMBY3REGZOG").unwrap();
        assert_eq!(svc.1, 4);

        let filter = &plans["filter"];
        assert_eq!(
            chains(filter),
            [
                "KUBE-EXTERNAL-SERVICES",
                "KUBE-FORWARD",
                "KUBE-NODEPORTS",
                "KUBE-PROXY-CANARY",
                "KUBE-PROXY-FIREWALL",
                "KUBE-SERVICES",
            ]
        );
        assert_eq!(filter.delete_rules.len(), 9);
        assert!(filter.delete_rules.iter().all(|r| !r.contains("KUBE-FIREWALL ") && !r.contains("DOCKER")));
        assert_eq!(chains(&plans["mangle"]), ["KUBE-PROXY-CANARY"]);
        assert!(plans["mangle"].delete_rules.is_empty());
    }

    #[test]
    fn restore_input_deletes_jumps_then_flushes_then_deletes() {
        let plans = plans();
        let input = plans["mangle"].restore_input();
        assert_eq!(input, "*mangle\n-F KUBE-PROXY-CANARY\n-X KUBE-PROXY-CANARY\nCOMMIT\n");
        let input = plans["nat"].restore_input();
        let lines: Vec<&str> = input.lines().collect();
        assert_eq!(lines[0], "*nat");
        assert_eq!(
            lines[1],
            r#"-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#
        );
        assert_eq!(lines[4], "-F KUBE-EXT-V2OKYYMBY3REGZOG");
        assert_eq!(lines[4 + 12], "-X KUBE-EXT-V2OKYYMBY3REGZOG");
        assert_eq!(lines.last(), Some(&"COMMIT"));
        assert_eq!(lines.len(), 1 + 3 + 12 + 12 + 1);
    }

    #[test]
    fn chains_used_by_others_are_kept_with_what_they_reach() {
        let text = "*nat
:PREROUTING ACCEPT [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SEP-A - [0:0]
:KUBE-SEP-B - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A PREROUTING -j KUBE-SEP-B
-A CNI-HOSTPORT-MASQ -g KUBE-SVC-A
-A KUBE-SERVICES -j KUBE-SVC-A
-A KUBE-SVC-A -j KUBE-SEP-A
-A KUBE-SEP-A -j KUBE-MARK-MASQ
-A KUBE-SEP-B -j KUBE-MARK-MASQ
COMMIT
";
        let plan = &plan_save(text).unwrap()[0];
        let kept: Vec<&str> = plan.kept.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(kept, ["KUBE-SVC-A", "KUBE-SEP-A", "KUBE-MARK-MASQ"]);
        assert_eq!(plan.kept[0].1, "-A CNI-HOSTPORT-MASQ -g KUBE-SVC-A");
        assert_eq!(chains(plan), ["KUBE-SERVICES", "KUBE-SEP-B"]);
        assert_eq!(plan.delete_rules, ["-A PREROUTING -j KUBE-SERVICES", "-A PREROUTING -j KUBE-SEP-B"]);
    }

    #[test]
    fn nothing_of_kube_proxy_gives_no_plan() {
        let text =
            "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n";
        assert!(plan_save(text).unwrap().is_empty());
        assert!(plan_save("").unwrap().is_empty());
        assert!(plan_save("# Warning: iptables-legacy tables present\n").unwrap().is_empty());
    }

    #[test]
    fn quoting_and_counters() {
        assert_eq!(
            split_args(r#"-A X -m comment --comment "a \"-j KUBE-SERVICES\" b" -j ACCEPT"#),
            ["-A", "X", "-m", "comment", "--comment", r#"a "-j KUBE-SERVICES" b"#, "-j", "ACCEPT"]
        );
        let text = "*nat\n:OUTPUT ACCEPT [1:2]\n:KUBE-SERVICES - [0:0]\n[5:300] -A OUTPUT -m comment --comment \"-j DOCKER\" -j KUBE-SERVICES\nCOMMIT\n";
        let tables = parse_save(text).unwrap();
        assert_eq!(tables[0].rules[0].target.as_deref(), Some("KUBE-SERVICES"));
        assert_eq!(tables[0].rules[0].chain, "OUTPUT");
    }

    #[test]
    fn malformed_save_is_refused() {
        assert!(parse_save("-A INPUT -j ACCEPT\n").is_err());
        assert!(parse_save("*nat\n:OUTPUT ACCEPT [0:0]\n").is_err());
        assert!(parse_save("*nat\n-I OUTPUT -j X\nCOMMIT\n").is_err());
        assert!(parse_save("*nat\n:OUTPUT\nCOMMIT\n").is_err());
    }

    #[test]
    fn nft_tables() {
        let listed = "table ip nat\ntable ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\ntable inet kube-proxy\ntable inet firewalld\n";
        assert_eq!(parse_nft_tables(listed).len(), 6);
        assert_eq!(
            kube_proxy_nft_tables(listed),
            [("ip".to_string(), "kube-proxy".to_string()), ("ip6".to_string(), "kube-proxy".to_string())]
        );
        assert!(kube_proxy_nft_tables("").is_empty());
    }
}
