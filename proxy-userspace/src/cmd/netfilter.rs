//! What netfilter does in this network namespace, as the operator commands need to know it: whether
//! it applies the NAT bindings of nf_conntrack's entries (those kube-proxy's rules made, those
//! kproxy hands it on `unload`).

use std::{path::Path, process::Command};

use super::kube_proxy_rules::find_tool;

fn output(tool: &Path, args: &[&str]) -> Result<String, String> {
    match Command::new(tool).args(args).stdin(std::process::Stdio::null()).output() {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!("{} failed: {}", tool.display(), String::from_utf8_lossy(&out.stderr).trim())),
        Err(e) => Err(format!("{}: {e}", tool.display())),
    }
}

/// Whether netfilter translates connections by their nf_conntrack NAT bindings in this network
/// namespace: it needs a NAT hook (a NAT base chain: kube-proxy's, iptables' `nat` table, kproxy's
/// keeper table) and connection tracking turned on, which only a rule that uses it does (DNAT,
/// masquerade, a conntrack state match). `None` when neither tool could tell.
pub fn nat_hooks_present() -> Option<bool> {
    let mut known = false;
    if let Some(nft) = find_tool("nft")
        && let Ok(ruleset) = output(&nft, &["list", "ruleset"])
    {
        known = true;
        if nft_translates(&ruleset) {
            return Some(true);
        }
    }
    if let Some(save) = find_tool("iptables-legacy-save")
        && let Ok(saved) = output(&save, &["-t", "nat"])
    {
        known = true;
        if iptables_legacy_translates(&saved) {
            return Some(true);
        }
    }
    known.then_some(false)
}

/// [`nat_hooks_present`] for `nft list ruleset` (iptables-nft's rules included).
fn nft_translates(ruleset: &str) -> bool {
    let uses_conntrack = [
        "ct state",
        "ct status",
        "dnat",
        "snat",
        "masquerade",
        "xt match \"conntrack\"",
        "xt match \"state\"",
    ]
    .iter()
    .any(|marker| ruleset.contains(marker));
    ruleset.contains("type nat hook") && uses_conntrack
}

/// [`nat_hooks_present`] for `iptables-legacy-save -t nat`.
fn iptables_legacy_translates(saved: &str) -> bool {
    let uses_conntrack = ["-j DNAT", "-j SNAT", "-j MASQUERADE", "-m conntrack", "-m state"]
        .iter()
        .any(|marker| saved.contains(marker));
    saved.lines().any(|l| l.trim() == "*nat") && uses_conntrack
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_nftables_rules_translate_and_empty_nat_chains_do_not() {
        let kube_proxy = "table ip kube-proxy {\n\tchain nat-prerouting {\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t\tjump services\n\t}\n\tchain endpoint-x {\n\t\tip protocol tcp dnat to 10.244.1.11:7000\n\t}\n}\n";
        assert!(nft_translates(kube_proxy));
        let empty = "table ip nat {\n\tchain PREROUTING {\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t}\n}\n";
        assert!(!nft_translates(empty));
        assert!(!nft_translates("table ip filter {\n\tchain f {\n\t\tct state invalid drop\n\t}\n}\n"));
    }

    #[test]
    fn legacy_nat_table_with_a_dnat_rule_translates() {
        assert!(iptables_legacy_translates(
            "*nat\n:PREROUTING ACCEPT [0:0]\n-A KUBE-SEP-X -p tcp -j DNAT --to-destination 10.244.1.11:7000\nCOMMIT\n"
        ));
        assert!(!iptables_legacy_translates("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n"));
    }
}
