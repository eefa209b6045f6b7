//! The deployment as an operator meets it: the flags the manifests in deploy/
//! pass exist in the real `kproxy agent`, and `kproxy cleanup-kube-proxy`
//! removes kube-proxy's netfilter state — and nothing else — from a sandbox
//! node's network namespace (never the host's). Needs root for the second part.
//! The manifests' schema checks are unit tests in proxy-userspace
//! (deploy_manifests.rs), where k8s-openapi is at hand. `capabilities` runs the
//! agent as the capabilities overlay does (deploy/capabilities.rs).

#[path = "deploy/capabilities.rs"]
mod capabilities;
mod common;

use std::{
    collections::BTreeSet,
    io::Write as _,
    path::Path,
    process::{Command, Stdio},
};

use sandbox::{Sandbox, kproxy_bin};
use serde_yaml::Value;

fn deploy_file(relative: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The long options `kproxy <subcommand> --help` lists.
fn help_flags(subcommand: &str) -> BTreeSet<String> {
    let out = Command::new(kproxy_bin()).args([subcommand, "--help"]).output().expect("running kproxy");
    assert!(out.status.success(), "kproxy {subcommand} --help: {}", String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout).unwrap();
    help.lines()
        .filter(|l| l.trim_start().starts_with('-'))
        .flat_map(|l| l.split([' ', ',', '=']))
        .filter_map(|word| word.strip_prefix("--"))
        .map(|flag| flag.split('<').next().unwrap().to_string())
        .filter(|flag| !flag.is_empty())
        .collect()
}

fn strings(value: &Value) -> Vec<String> {
    value.as_sequence().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
}

#[test]
fn deployed_flags_exist_in_kproxy_agent() {
    let flags = help_flags("agent");
    assert!(
        flags.contains("hostname-override") && flags.contains("interfaces"),
        "help parsed badly: {flags:?}"
    );

    let ds = deploy_file("base/daemonset.yaml");
    let containers = &ds["spec"]["template"]["spec"]["containers"];
    let agent =
        containers.as_sequence().unwrap().iter().find(|c| c["name"].as_str() == Some("kproxy")).unwrap();
    let args = strings(&agent["args"]);
    assert_eq!(args[0], "agent");
    let mut unknown = Vec::new();
    for arg in &args[1..] {
        let flag = arg.strip_prefix("--").unwrap_or_else(|| panic!("{arg:?} is not a --flag"));
        let name = flag.split('=').next().unwrap();
        if !flags.contains(name) {
            unknown.push(format!("DaemonSet arg {arg}"));
        }
    }
    // The kubeadm overlay's args replace the base's.
    let patch = deploy_file("overlays/kubeadm/kube-proxy-config.yaml");
    let kubeadm_args = strings(&patch["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert_eq!(kubeadm_args[0], "agent");
    for arg in &kubeadm_args[1..] {
        let name = arg.strip_prefix("--").and_then(|a| a.split('=').next()).unwrap_or(arg);
        if !flags.contains(name) {
            unknown.push(format!("kubeadm overlay arg {arg}"));
        }
    }
    let config = deploy_file("base/configmap.yaml");
    for key in config["data"].as_mapping().unwrap().keys() {
        let key = key.as_str().unwrap();
        if !flags.contains(key) {
            unknown.push(format!("ConfigMap key {key}"));
        }
    }
    assert!(unknown.is_empty(), "not flags of `kproxy agent` ({flags:?}):\n{}", unknown.join("\n"));
}

/// `args` with each `$(VAR)` replaced as the base DaemonSet's env defines it (ConfigMap keys,
/// `NODE_NAME` as `node-1`).
fn substituted(args: &[String]) -> Vec<String> {
    let ds = deploy_file("base/daemonset.yaml");
    let config = deploy_file("base/configmap.yaml");
    let agent = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(agent["name"].as_str(), Some("kproxy"));
    let mut env = Vec::new();
    for var in agent["env"].as_sequence().unwrap() {
        if var["valueFrom"]["configMapKeyRef"]["optional"].as_bool() == Some(true) {
            continue; // an optional ConfigMap deploy/ does not create (kproxy-api-endpoint): unset
        }
        let value = match var["valueFrom"]["configMapKeyRef"]["key"].as_str() {
            Some(key) => config["data"][key].as_str().unwrap().to_owned(),
            None => "node-1".to_owned(),
        };
        env.push((format!("$({})", var["name"].as_str().unwrap()), value));
    }
    args.iter().map(|arg| env.iter().fold(arg.clone(), |arg, (var, value)| arg.replace(var, value))).collect()
}

/// The kubeadm overlay runs `kproxy agent` on kube-proxy's config.conf, and the settings the file
/// holds are the file's: the overlay passes no flag that would win over them (the base's args
/// would). The real binary with the overlay's arguments, its effective configuration read back
/// with `--write-config-to`.
#[test]
fn the_kubeadm_overlay_leaves_config_conf_its_settings() {
    let dir = std::env::temp_dir().join(format!("kproxy-deploy-kubeadm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf_path = dir.join("config.conf");
    let testdata = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../proxy-userspace/testdata/kubeadm-kube-proxy-config.conf");
    // kubeadm's rendering with settings an operator changed, none of them kproxy-config's values.
    let conf = std::fs::read_to_string(testdata)
        .unwrap()
        .replace("metricsBindAddress: \"\"", "metricsBindAddress: 0.0.0.0:10249")
        .replacen("  minSyncPeriod: 0s", "  minSyncPeriod: 2s", 1)
        .replacen("  syncPeriod: 0s", "  syncPeriod: 45s", 1)
        .replace("logging:\n", "logging:\n  format: json\n");
    std::fs::write(&conf_path, conf).unwrap();
    let effective = |args: &[String]| -> String {
        let out_path = dir.join("effective.yaml");
        let mut args: Vec<String> = substituted(args)
            .into_iter()
            .map(|a| if a.starts_with("--config=") { format!("--config={}", conf_path.display()) } else { a })
            .collect();
        args.extend(["--write-config-to".to_owned(), out_path.display().to_string()]);
        let out = Command::new(kproxy_bin()).args(&args).env_remove("NODE_NAME").output().unwrap();
        assert!(out.status.success(), "kproxy {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        std::fs::read_to_string(&out_path).unwrap()
    };
    let patch = deploy_file("overlays/kubeadm/kube-proxy-config.yaml");
    let kubeadm_args = strings(&patch["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(kubeadm_args.iter().any(|a| a.starts_with("--config=")), "{kubeadm_args:?}");
    let written = effective(&kubeadm_args);
    for setting in [
        "\nmetricsBindAddress: 0.0.0.0:10249\n",
        "\nminSyncPeriod: 2s\n",
        "\nsyncPeriod: 45s\n",
        "  format: json\n",
    ] {
        assert!(written.contains(setting), "{setting:?} lost:\n{written}");
    }
    assert!(written.contains("\nhostnameOverride: node-1\n"), "{written}");
    assert!(written.contains("\nclusterCIDR: 10.244.0.0/16\n"), "{written}");
    // The base's flags on the same file would have overridden them.
    let ds = deploy_file("base/daemonset.yaml");
    let mut base_args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    base_args.push("--config=x".into());
    assert!(effective(&base_args).contains("\nmetricsBindAddress: 127.0.0.1:10249\n"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn uninstall_and_migration_commands_exist() {
    let out = Command::new(kproxy_bin()).arg("--help").output().expect("running kproxy");
    let help = String::from_utf8(out.stdout).unwrap();
    for subcommand in ["agent", "unload", "cleanup-kube-proxy"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(subcommand)),
            "no `kproxy {subcommand}`:\n{help}"
        );
    }
    assert!(help_flags("cleanup-kube-proxy").contains("apply"));
}

// ---------------------------------------------------------------------------
// cleanup-kube-proxy in a sandbox node

/// What kube-proxy (iptables mode, v1.29+) writes for `default/web`
/// (ClusterIP 10.96.0.100:80, two endpoints) and `default/shop` (ClusterIP
/// 10.96.0.200:443 and NodePort 30443, one endpoint), next to kubelet's
/// chains, kube-router's and the node's own firewall rules.
const NFT_IPV4: &str = r#"*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-A PREROUTING -i eth9 -j MARK --set-xmark 0x100/0x100
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-EXT-SHOPQ3VJ7ZFTNW2L - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-SHOPA1B2C3D4E5F6 - [0:0]
:KUBE-SEP-WEB1AAAABBBBCCCC - [0:0]
:KUBE-SEP-WEB2DDDDEEEEFFFF - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-SHOPQ3VJ7ZFTNW2L - [0:0]
:KUBE-SVC-WEB4LZ7QSCYHAVNX - [0:0]
:USER-DNAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -p tcp -m tcp --dport 2222 -j USER-DNAT
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -j MASQUERADE
-A KUBE-EXT-SHOPQ3VJ7ZFTNW2L -m comment --comment "masquerade traffic for default/shop:https external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-SHOPQ3VJ7ZFTNW2L -j KUBE-SVC-SHOPQ3VJ7ZFTNW2L
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/shop:https" -m tcp --dport 30443 -j KUBE-EXT-SHOPQ3VJ7ZFTNW2L
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-SHOPA1B2C3D4E5F6 -s 10.244.0.21/32 -m comment --comment "default/shop:https" -j KUBE-MARK-MASQ
-A KUBE-SEP-SHOPA1B2C3D4E5F6 -p tcp -m comment --comment "default/shop:https" -m tcp -j DNAT --to-destination 10.244.0.21:8443
-A KUBE-SEP-WEB1AAAABBBBCCCC -s 10.244.0.11/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB1AAAABBBBCCCC -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.0.11:8080
-A KUBE-SEP-WEB2DDDDEEEEFFFF -s 10.244.0.12/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB2DDDDEEEEFFFF -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.0.12:8080
-A KUBE-SERVICES -d 10.96.0.100/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-WEB4LZ7QSCYHAVNX
-A KUBE-SERVICES -d 10.96.0.200/32 -p tcp -m comment --comment "default/shop:https cluster IP" -m tcp --dport 443 -j KUBE-SVC-SHOPQ3VJ7ZFTNW2L
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-SHOPQ3VJ7ZFTNW2L ! -s 10.244.0.0/16 -d 10.96.0.200/32 -p tcp -m comment --comment "default/shop:https cluster IP" -m tcp --dport 443 -j KUBE-MARK-MASQ
-A KUBE-SVC-SHOPQ3VJ7ZFTNW2L -m comment --comment "default/shop:https -> 10.244.0.21:8443" -j KUBE-SEP-SHOPA1B2C3D4E5F6
-A KUBE-SVC-WEB4LZ7QSCYHAVNX ! -s 10.244.0.0/16 -d 10.96.0.100/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-WEB4LZ7QSCYHAVNX -m comment --comment "default/web:http -> 10.244.0.11:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-WEB1AAAABBBBCCCC
-A KUBE-SVC-WEB4LZ7QSCYHAVNX -m comment --comment "default/web:http -> 10.244.0.12:8080" -j KUBE-SEP-WEB2DDDDEEEEFFFF
-A USER-DNAT -p tcp -j DNAT --to-destination 10.244.0.50:22
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-ROUTER-INPUT - [0:0]
:KUBE-SERVICES - [0:0]
:USER-FW - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -m comment --comment "kube-router netpol" -j KUBE-ROUTER-INPUT
-A INPUT -j USER-FW
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -s 192.0.2.0/24 -j DROP
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-ROUTER-INPUT -s 10.244.0.0/16 -j RETURN
-A USER-FW -p tcp -m tcp --dport 22 -j ACCEPT
-A USER-FW -p tcp -m tcp --dport 9100 -m comment --comment "-j KUBE-SERVICES in a comment is not a jump" -j ACCEPT
COMMIT
"#;

/// An older node whose kube-proxy used iptables-legacy.
const LEGACY_IPV4: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SEP-LEGACYWEB1AAAAAA - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-LEGACYWEBAAAAAAA - [0:0]
:KUBE-XLB-LEGACYWEBAAAAAAA - [0:0]
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -o eth9 -j MASQUERADE
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SEP-LEGACYWEB1AAAAAA -p tcp -m tcp -j DNAT --to-destination 10.244.0.11:8080
-A KUBE-SERVICES -d 10.96.0.100/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-LEGACYWEBAAAAAAA
-A KUBE-SVC-LEGACYWEBAAAAAAA -j KUBE-SEP-LEGACYWEB1AAAAAA
-A KUBE-XLB-LEGACYWEBAAAAAAA -j KUBE-SVC-LEGACYWEBAAAAAAA
COMMIT
"#;

/// Dual-stack: the IPv6 side of `default/web` (fd00:96::100).
const NFT_IPV6: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SEP-WEB6AAAABBBBCCCC - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-WEB6LZ7QSCYHAVNX - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -s fd00:244::/64 -j MASQUERADE
-A KUBE-SEP-WEB6AAAABBBBCCCC -p tcp -m tcp -j DNAT --to-destination [fd00:244::11]:8080
-A KUBE-SERVICES -d fd00:96::100/128 -p tcp -m tcp --dport 80 -j KUBE-SVC-WEB6LZ7QSCYHAVNX
-A KUBE-SVC-WEB6LZ7QSCYHAVNX -j KUBE-SEP-WEB6AAAABBBBCCCC
COMMIT
"#;

/// kube-proxy's nftables mode (abridged) and a user's own table.
const NFT_TABLES: &str = r#"table ip kube-proxy {
    chain nat-prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        ip daddr 10.96.0.100 tcp dport 80 dnat to 10.244.0.11:8080
    }
}
table ip6 kube-proxy {
    chain nat-output {
        type nat hook output priority -100; policy accept;
    }
}
table inet node-firewall {
    chain input {
        type filter hook input priority filter; policy accept;
        tcp dport 22 accept
    }
}
"#;

/// The kube-proxy chains of the fixtures above, per (save command, table).
fn kube_proxy_chains(text: &str, table: &str) -> Vec<String> {
    let mut in_table = false;
    let mut chains = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            in_table = name == table;
        } else if in_table && let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap();
            // Listed by hand from the fixtures: kubelet's, kube-router's and
            // the user's chains are not kube-proxy's.
            let theirs =
                ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-ROUTER-INPUT", "USER-DNAT", "USER-FW"];
            if name.starts_with("KUBE-") && !theirs.contains(&name) {
                chains.push(name.to_string());
            }
        }
    }
    chains
}

/// `text` without kube-proxy's chains and the rules that jump into them: what
/// must remain. Built line by line from the fixture, not by cleanup's planner.
fn without_kube_proxy(text: &str) -> String {
    let mut table = String::new();
    let mut out = String::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_string();
        }
        let chains = kube_proxy_chains(text, &table);
        let is_ours = |name: &str| chains.iter().any(|c| c == name);
        let words: Vec<&str> = line.split_whitespace().collect();
        let declares =
            line.starts_with(':') && is_ours(line[1..].split_whitespace().next().unwrap_or_default());
        let in_chain = words.first() == Some(&"-A") && words.get(1).is_some_and(|c| is_ours(c));
        let jumps = words.first() == Some(&"-A") && words.windows(2).any(|w| w[0] == "-j" && is_ours(w[1]));
        if !(declares || in_chain || jumps) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// iptables-save output without comments and counters.
fn normalize(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let line = match (line.starts_with(':'), line.rfind(" [")) {
            (true, Some(at)) => &line[..at],
            _ => line,
        };
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Runs `args` in the sandbox node with `input` on stdin.
fn node_stdin(sandbox: &Sandbox, args: &[&str], input: &str) {
    let mut command = sandbox.node_command(args).unwrap();
    let mut child =
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Everything netfilter holds in the node: (what, normalized text).
fn snapshot(sandbox: &Sandbox) -> Vec<(String, String)> {
    let mut all = Vec::new();
    for save in ["iptables-nft-save", "iptables-legacy-save", "ip6tables-nft-save", "ip6tables-legacy-save"] {
        all.push((save.to_string(), normalize(&sandbox.node_exec([save]).unwrap())));
    }
    all.push(("nft list tables".into(), sandbox.node_exec(["nft", "list", "tables"]).unwrap()));
    all.push((
        "nft list table inet node-firewall".into(),
        sandbox.node_exec(["nft", "list", "table", "inet", "node-firewall"]).unwrap(),
    ));
    all
}

fn cleanup(sandbox: &Sandbox, apply: bool) -> String {
    let bin = kproxy_bin();
    let bin = bin.to_str().unwrap();
    let mut args = vec![bin, "cleanup-kube-proxy"];
    if apply {
        args.push("--apply");
    }
    let out = sandbox.node_exec_output(&args).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{args:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn cleanup_kube_proxy_removes_exactly_kube_proxys_rules() {
    for tool in ["iptables-nft-restore", "iptables-legacy-restore", "ip6tables-nft-restore", "nft", "nsenter"]
    {
        assert!(
            Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().unwrap().status.success(),
            "{tool} is missing: run `cargo xtask setup`"
        );
    }
    let sandbox = Sandbox::new("cleanup").expect("sandbox (needs root)");
    // Everything below runs in the sandbox's node namespace (nsenter --net).
    node_stdin(&sandbox, &["iptables-nft-restore"], NFT_IPV4);
    node_stdin(&sandbox, &["iptables-legacy-restore"], LEGACY_IPV4);
    node_stdin(&sandbox, &["ip6tables-nft-restore"], NFT_IPV6);
    node_stdin(&sandbox, &["nft", "-f", "-"], NFT_TABLES);
    let before = snapshot(&sandbox);
    assert!(before[0].1.contains(":KUBE-SVC-WEB4LZ7QSCYHAVNX -"), "fixture not loaded:\n{}", before[0].1);

    // Dry run: lists every kube-proxy chain and jump, changes nothing.
    let report = cleanup(&sandbox, false);
    assert_eq!(snapshot(&sandbox), before, "the dry run changed something:\n{report}");
    let mut expected_chains = 0;
    for (backend, text) in
        [("iptables-nft", NFT_IPV4), ("iptables-legacy", LEGACY_IPV4), ("ip6tables-nft", NFT_IPV6)]
    {
        for table in ["mangle", "nat", "filter"] {
            let chains = kube_proxy_chains(text, table);
            if chains.is_empty() {
                assert!(!report.contains(&format!("{backend} table {table}:")), "{report}");
                continue;
            }
            assert!(report.contains(&format!("{backend} table {table}:\n")), "{backend} {table}:\n{report}");
            for chain in &chains {
                assert!(report.contains(&format!("would delete chain: {chain} (")), "{chain}:\n{report}");
            }
            expected_chains += chains.len();
        }
    }
    for jump in [
        r#"would delete rule: -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
        r#"would delete rule: -A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#,
        r#"would delete rule: -A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD"#,
        "nftables: would delete table ip kube-proxy",
        "nftables: would delete table ip6 kube-proxy",
    ] {
        assert!(report.contains(jump), "{jump}:\n{report}");
    }
    for theirs in
        ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-ROUTER-INPUT", "USER-", "node-firewall", "MASQUERADE"]
    {
        assert!(!report.contains(theirs), "{theirs} is not kube-proxy's:\n{report}");
    }
    // 3 + 9 jumps from built-in chains (nft ipv4), 1 (legacy), 2 (ipv6).
    let summary = format!("would remove 15 rules, {expected_chains} chains, 2 nftables tables");
    assert!(report.contains(&summary), "{summary}:\n{report}");

    // Apply: what remains is the fixture without kube-proxy's lines.
    let report = cleanup(&sandbox, true);
    assert!(
        report.contains(&format!("removed 15 rules, {expected_chains} chains, 2 nftables tables")),
        "{report}"
    );
    let after = snapshot(&sandbox);
    let expected = [
        normalize(&without_kube_proxy(NFT_IPV4)),
        normalize(&without_kube_proxy(LEGACY_IPV4)),
        normalize(&without_kube_proxy(NFT_IPV6)),
    ];
    let get = |what: &str| &after.iter().find(|(w, _)| w == what).unwrap().1;
    assert_tables_eq(get("iptables-nft-save"), &expected[0], "iptables-nft");
    assert_tables_eq(get("iptables-legacy-save"), &expected[1], "iptables-legacy");
    assert_tables_eq(get("ip6tables-nft-save"), &expected[2], "ip6tables-nft");
    assert_eq!(get("ip6tables-legacy-save"), &before[3].1);
    let tables: BTreeSet<&str> = get("nft list tables").lines().collect();
    assert!(
        !tables.contains("table ip kube-proxy") && !tables.contains("table ip6 kube-proxy"),
        "{tables:?}"
    );
    let tables_before: BTreeSet<&str> = before[4].1.lines().collect();
    let gone: Vec<&&str> = tables_before.difference(&tables).collect();
    assert_eq!(gone, [&"table ip kube-proxy", &"table ip6 kube-proxy"]);
    assert_eq!(get("nft list table inet node-firewall"), &before[5].1);

    // Idempotent: a second run finds nothing.
    let report = cleanup(&sandbox, false);
    assert!(report.contains("nothing of kube-proxy's found"), "{report}");
}

/// Compares saved tables with the expected ones, table by table (the save
/// order of tables differs between backends).
fn assert_tables_eq(actual: &str, expected: &str, what: &str) {
    let split = |text: &str| -> std::collections::BTreeMap<String, String> {
        let mut tables = std::collections::BTreeMap::new();
        let mut current = String::new();
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                current = name.to_string();
            }
            let entry: &mut String = tables.entry(current.clone()).or_default();
            entry.push_str(line);
            entry.push('\n');
        }
        tables
    };
    let (actual, expected) = (split(actual), split(expected));
    for (table, text) in &expected {
        assert_eq!(actual.get(table), Some(text), "{what} table {table}");
    }
}
