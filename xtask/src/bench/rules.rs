//! What the benchmarks program: N Services as manifests (for kproxy) and as the iptables ruleset
//! kube-proxy's iptables mode would write for them (the baseline).
use std::{fmt::Write as _, net::Ipv4Addr};

use serde_json::{Value, json};

pub const NAMESPACE: &str = "bench";

/// One Service port with its ready endpoints.
#[derive(Clone, Debug)]
pub struct Svc {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    /// "TCP" or "UDP".
    pub proto: &'static str,
    pub port_name: &'static str,
    pub target_port: u16,
    pub endpoints: Vec<Ipv4Addr>,
}

fn add(base: Ipv4Addr, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base).wrapping_add(offset))
}

/// The `i`-th other Service: VIP in 10.100.0.0/14, three endpoints in 10.128.0.0/10 (no pod has
/// them; no benchmark packet goes there).
pub fn filler(i: u32) -> Svc {
    Svc {
        name: format!("svc-{i:06}"),
        vip: add(Ipv4Addr::new(10, 100, 0, 1), i),
        port: 80,
        proto: "TCP",
        port_name: "http",
        target_port: 8080,
        endpoints: (0..3).map(|j| add(Ipv4Addr::new(10, 128, 0, 1), i * 3 + j)).collect(),
    }
}

/// `n` Services in all: the `measured` ones in the middle of `n - measured.len()` others (at
/// least the measured ones).
pub fn cluster(n: usize, measured: &[Svc]) -> Vec<Svc> {
    let others = n.saturating_sub(measured.len()) as u32;
    let mut all: Vec<Svc> = (0..others).map(filler).collect();
    let middle = all.len() / 2;
    for (k, svc) in measured.iter().enumerate() {
        all.insert(middle + k, svc.clone());
    }
    all
}

pub fn service_json(svc: &Svc) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": svc.name, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": svc.vip.to_string(),
            "clusterIPs": [svc.vip.to_string()],
            "ports": [{"name": svc.port_name, "port": svc.port, "protocol": svc.proto, "targetPort": svc.target_port}],
        },
    })
}

/// The Service's EndpointSlice with `endpoints` (ready).
pub fn slice_json(svc: &Svc, endpoints: &[Ipv4Addr]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{}-bench", svc.name),
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": svc.name},
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": svc.port_name, "port": svc.target_port, "protocol": svc.proto}],
    })
}

/// Every Service and its slice as one `kind: List` JSON document.
pub fn manifests(svcs: &[Svc]) -> String {
    let items: Vec<Value> =
        svcs.iter().flat_map(|s| [service_json(s), slice_json(s, &s.endpoints)]).collect();
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// kube-proxy names chains by a hash of the Service port (and endpoint); any stable 16-character
/// hash gives the same rule shapes.
fn chain_hash(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016X}")
}

/// The nat-table ruleset of kube-proxy's iptables mode (v1.28+, `--masquerade-all=false`,
/// cluster CIDR `cluster_cidr`) for `svcs`, in `iptables-restore` format: `KUBE-SERVICES` with one
/// rule per Service port (in `svcs` order), `KUBE-SVC-*` picking an endpoint with `-m statistic
/// --mode random --probability 1/k`, `KUBE-SEP-*` doing the DNAT, and the masquerade chains.
pub fn kube_proxy_ruleset(svcs: &[Svc], cluster_cidr: &str) -> String {
    let mut chains = String::new();
    let mut rules = String::new();
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        let _ = writeln!(chains, ":{chain} - [0:0]");
    }
    let _ =
        writeln!(rules, "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES");
    let _ = writeln!(rules, "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES");
    let _ = writeln!(
        rules,
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING"
    );
    let _ = writeln!(rules, "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000");
    let _ = writeln!(rules, "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN");
    let _ = writeln!(rules, "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000");
    let _ = writeln!(
        rules,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    );
    let mut svc_rules = String::new();
    for svc in svcs {
        let proto = svc.proto.to_ascii_lowercase();
        let spn = format!("{NAMESPACE}/{}:{}", svc.name, svc.port_name);
        let svc_chain = format!("KUBE-SVC-{}", chain_hash(&format!("{spn}{}", svc.proto)));
        let _ = writeln!(chains, ":{svc_chain} - [0:0]");
        let _ = writeln!(
            rules,
            "-A KUBE-SERVICES -d {}/32 -p {proto} -m comment --comment \"{spn} cluster IP\" -m {proto} --dport {} -j {svc_chain}",
            svc.vip, svc.port
        );
        let _ = writeln!(
            svc_rules,
            "-A {svc_chain} ! -s {cluster_cidr} -d {}/32 -p {proto} -m comment --comment \"{spn} cluster IP\" -m {proto} --dport {} -j KUBE-MARK-MASQ",
            svc.vip, svc.port
        );
        let k = svc.endpoints.len();
        for (i, ep) in svc.endpoints.iter().enumerate() {
            let sep_chain = format!("KUBE-SEP-{}", chain_hash(&format!("{spn}{}{ep}", svc.proto)));
            let _ = writeln!(chains, ":{sep_chain} - [0:0]");
            let target = format!("{ep}:{}", svc.target_port);
            if i + 1 < k {
                let p = 1.0 / (k - i) as f64;
                let _ = writeln!(
                    svc_rules,
                    "-A {svc_chain} -m comment --comment \"{spn} -> {target}\" -m statistic --mode random --probability {p:.11} -j {sep_chain}"
                );
            } else {
                let _ = writeln!(
                    svc_rules,
                    "-A {svc_chain} -m comment --comment \"{spn} -> {target}\" -j {sep_chain}"
                );
            }
            let _ = writeln!(
                svc_rules,
                "-A {sep_chain} -s {ep}/32 -m comment --comment \"{spn}\" -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(
                svc_rules,
                "-A {sep_chain} -p {proto} -m comment --comment \"{spn}\" -m {proto} -j DNAT --to-destination {target}"
            );
        }
    }
    let _ = writeln!(
        rules,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
    );
    format!("*nat\n{chains}{rules}{svc_rules}COMMIT\n")
}

/// Removes everything [`kube_proxy_ruleset`] added (an empty nat table).
pub const EMPTY_NAT: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_service_sits_in_the_middle() {
        let web = filler(999_999);
        let all = cluster(5, std::slice::from_ref(&web));
        assert_eq!(all.len(), 5);
        assert_eq!(all[2].name, web.name);
        assert_eq!(cluster(1, std::slice::from_ref(&web)).len(), 1);
    }

    #[test]
    fn ruleset_has_kube_proxy_shapes() {
        let text = kube_proxy_ruleset(&[filler(0), filler(1)], "10.244.0.0/16");
        assert_eq!(text.matches("-A KUBE-SERVICES -d ").count(), 2);
        assert_eq!(text.matches("--probability 0.33333333333").count(), 2);
        assert_eq!(text.matches("--probability 0.50000000000").count(), 2);
        assert_eq!(text.matches("-j DNAT --to-destination").count(), 6);
        assert!(text.starts_with("*nat\n") && text.ends_with("COMMIT\n"));
        let value: Value = serde_json::from_str(&manifests(&[filler(0)])).unwrap();
        assert_eq!(value["items"].as_array().unwrap().len(), 2);
    }
}
