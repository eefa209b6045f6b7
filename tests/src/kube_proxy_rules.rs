//! kube-proxy's own rule shapes for a set of Service ports, to run beside kproxy in the same
//! sandbox: the benchmarks' baseline (`cargo xtask bench`) and the oracle of the differential
//! test (`tests/tests/differential.rs`).
//!
//! - [`kube_proxy_ruleset`]: the nat table of the iptables mode (what the benchmarks restore);
//!   [`kube_proxy_iptables`] adds the filter table (REJECT for Services without endpoints, the
//!   `KUBE-FORWARD` chain that drops conntrack-INVALID packets), for `iptables-restore`.
//! - [`kube_proxy_nftables`]: the nftables mode, an `nft -f` script that replaces `table ip
//!   kube-proxy` in one transaction: the `service-ips` verdict map, per-Service chains choosing
//!   an endpoint with `numgen random mod N vmap`, per-endpoint chains doing the `dnat`, the
//!   mark-for-masquerade / masquerading chains, `no-endpoint-services` rejecting, and
//!   `cluster-ips-check` (reject ports a ClusterIP does not have, drop unallocated ClusterIPs).
//!
//! Both follow kube-proxy's proxiers (pkg/proxy/iptables and pkg/proxy/nftables, v1.31+, IPv4,
//! `--masquerade-all=false`, a cluster CIDR for the local-traffic detector); only the chain-name
//! hashes differ (any stable hash gives the same rule shapes). NodePorts and load-balancer IPs
//! (with `loadBalancerSourceRanges`) are generated with `externalTrafficPolicy: Cluster`
//! (masqueraded), and `sessionAffinity: ClientIP` (`-m recent` lists; nftables affinity sets);
//! external IPs and traffic policy Local are not. UDP conntrack clean-up, which kube-proxy does
//! after each sync, is not a rule: see [`stale_udp_entries`].
use std::{fmt::Write as _, net::Ipv4Addr};

use serde_json::{Value, json};

pub const NAMESPACE: &str = "bench";

/// kube-proxy's default masquerade mark (`--iptables-masquerade-bit=14`).
const MASQ_MARK: &str = "0x4000";

/// One Service port with the endpoints kube-proxy would use for it (ready ones, or serving and
/// terminating ones when none is ready); no endpoints means the port is rejected.
#[derive(Clone, Debug)]
pub struct Svc {
    pub namespace: String,
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    /// "TCP" or "UDP".
    pub proto: &'static str,
    pub port_name: &'static str,
    pub target_port: u16,
    /// The port's NodePort (reached on every local address, masqueraded: policy Cluster).
    pub node_port: Option<u16>,
    /// `status.loadBalancer.ingress` IPs (policy Cluster: masqueraded like NodePorts).
    pub load_balancer_ips: Vec<Ipv4Addr>,
    /// `spec.loadBalancerSourceRanges`: only these sources reach the load-balancer IPs.
    pub source_ranges: Vec<String>,
    /// `sessionAffinity: ClientIP` with this timeout (seconds).
    pub affinity_timeout: Option<u32>,
    pub endpoints: Vec<Ipv4Addr>,
    /// `internalTrafficPolicy: Local` whose endpoints are all on other nodes (`endpoints` is empty):
    /// new connections to the cluster IP are dropped, not rejected ("has no local endpoints"). The
    /// cluster IP only: NodePorts and LB IPs of such a port are not generated.
    pub no_local_endpoints: bool,
}

/// A ClusterIP port of `bench/unnamed` at 0.0.0.0:0 with no endpoints and nothing else; set the
/// fields that matter with struct update syntax.
impl Default for Svc {
    fn default() -> Self {
        Svc {
            namespace: NAMESPACE.into(),
            name: "unnamed".into(),
            vip: Ipv4Addr::UNSPECIFIED,
            port: 0,
            proto: "TCP",
            port_name: "",
            target_port: 0,
            node_port: None,
            load_balancer_ips: Vec::new(),
            source_ranges: Vec::new(),
            affinity_timeout: None,
            endpoints: Vec::new(),
            no_local_endpoints: false,
        }
    }
}

impl Svc {
    /// `namespace/name:port`, kube-proxy's ServicePortName.
    fn port_name_string(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }
}

fn add(base: Ipv4Addr, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base).wrapping_add(offset))
}

/// The `i`-th other Service: VIP in 10.100.0.0/14, three endpoints in 10.128.0.0/10 (no pod has
/// them; no benchmark packet goes there).
pub fn filler(i: u32) -> Svc {
    Svc {
        namespace: NAMESPACE.into(),
        name: format!("svc-{i:06}"),
        vip: add(Ipv4Addr::new(10, 100, 0, 1), i),
        port: 80,
        proto: "TCP",
        port_name: "http",
        target_port: 8080,
        endpoints: (0..3).map(|j| add(Ipv4Addr::new(10, 128, 0, 1), i * 3 + j)).collect(),
        ..Svc::default()
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
        "metadata": {"name": svc.name, "namespace": svc.namespace},
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
            "namespace": svc.namespace,
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
/// rule per Service port that has endpoints (in `svcs` order), `KUBE-SVC-*` picking an endpoint
/// with `-m statistic --mode random --probability 1/k`, `KUBE-SEP-*` doing the DNAT, and the
/// masquerade chains (`KUBE-MARK-MASQ`, `KUBE-POSTROUTING` in nat POSTROUTING). A port without
/// endpoints has no nat rule: the filter table rejects it ([`kube_proxy_iptables`]).
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
    let _ = writeln!(rules, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}");
    let _ = writeln!(rules, "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN");
    let _ = writeln!(rules, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}");
    let _ = writeln!(
        rules,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    );
    let mut svc_rules = String::new();
    for svc in svcs.iter().filter(|s| !s.endpoints.is_empty()) {
        let proto = svc.proto.to_ascii_lowercase();
        let spn = svc.port_name_string();
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
        if svc.node_port.is_some() || !svc.load_balancer_ips.is_empty() {
            let ext_chain = format!("KUBE-EXT-{}", chain_hash(&format!("{spn}{}", svc.proto)));
            let _ = writeln!(chains, ":{ext_chain} - [0:0]");
            let _ = writeln!(
                svc_rules,
                "-A {ext_chain} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ"
            );
            let _ = writeln!(svc_rules, "-A {ext_chain} -j {svc_chain}");
            if let Some(node_port) = svc.node_port {
                let _ = writeln!(
                    rules,
                    "-A KUBE-NODEPORTS -p {proto} -m comment --comment \"{spn}\" -m {proto} --dport {node_port} -j {ext_chain}"
                );
            }
            // With source ranges, KUBE-FW-* sends only the allowed sources on; the rest stays
            // addressed to the load-balancer IP and KUBE-PROXY-FIREWALL (filter) drops it.
            let fw_chain = format!("KUBE-FW-{}", chain_hash(&format!("{spn}{}", svc.proto)));
            if !svc.source_ranges.is_empty() {
                let _ = writeln!(chains, ":{fw_chain} - [0:0]");
                for range in &svc.source_ranges {
                    let _ = writeln!(
                        svc_rules,
                        "-A {fw_chain} -s {range} -m comment --comment \"{spn} loadbalancer IP\" -j {ext_chain}"
                    );
                }
            }
            for lb in &svc.load_balancer_ips {
                let target = if svc.source_ranges.is_empty() { &ext_chain } else { &fw_chain };
                let _ = writeln!(
                    rules,
                    "-A KUBE-SERVICES -d {lb}/32 -p {proto} -m comment --comment \"{spn} loadbalancer IP\" -m {proto} --dport {} -j {target}",
                    svc.port
                );
            }
        }
        let sep_chain_of =
            |ep: &Ipv4Addr| format!("KUBE-SEP-{}", chain_hash(&format!("{spn}{}{ep}", svc.proto)));
        // Session affinity: a source seen within the timeout goes back to its endpoint, before
        // any random pick; the endpoint's chain records the source.
        let mut recent_set = String::new();
        if let Some(timeout) = svc.affinity_timeout {
            for ep in &svc.endpoints {
                let sep_chain = sep_chain_of(ep);
                let _ = writeln!(
                    svc_rules,
                    "-A {svc_chain} -m comment --comment \"{spn} -> {ep}:{}\" -m recent --name {sep_chain} --mask 255.255.255.255 --rsource --rcheck --seconds {timeout} --reap -j {sep_chain}",
                    svc.target_port
                );
            }
            recent_set = "-m recent --set --name {} --mask 255.255.255.255 --rsource ".into();
        }
        let k = svc.endpoints.len();
        for (i, ep) in svc.endpoints.iter().enumerate() {
            let sep_chain = sep_chain_of(ep);
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
            let recent = recent_set.replace("{}", &sep_chain);
            let _ = writeln!(
                svc_rules,
                "-A {sep_chain} -p {proto} -m comment --comment \"{spn}\" {recent}-m {proto} -j DNAT --to-destination {target}"
            );
        }
    }
    let _ = writeln!(
        rules,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
    );
    format!("*nat\n{chains}{rules}{svc_rules}COMMIT\n")
}

/// The filter table of kube-proxy's iptables mode for `svcs`: `KUBE-SERVICES` (from INPUT,
/// FORWARD and OUTPUT, new connections only) rejecting every Service port without endpoints with
/// ICMP port unreachable, and `KUBE-FORWARD` dropping conntrack-INVALID packets (kube-proxy's
/// default, `--conntrack-tcp-be-liberal=false`) and accepting marked and established traffic.
pub fn kube_proxy_filter_ruleset(svcs: &[Svc]) -> String {
    let mut out = String::from("*filter\n");
    for chain in ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL"] {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
    let new = "-m conntrack --ctstate NEW";
    let _ = writeln!(
        out,
        "-A INPUT {new} -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL"
    );
    let _ =
        writeln!(out, "-A INPUT {new} -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES");
    let _ = writeln!(
        out,
        "-A INPUT {new} -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES"
    );
    let _ = writeln!(
        out,
        "-A FORWARD {new} -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL"
    );
    let _ = writeln!(out, "-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD");
    let _ = writeln!(
        out,
        "-A FORWARD {new} -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
    );
    let _ = writeln!(
        out,
        "-A FORWARD {new} -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES"
    );
    let _ = writeln!(
        out,
        "-A OUTPUT {new} -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL"
    );
    let _ =
        writeln!(out, "-A OUTPUT {new} -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES");
    for svc in svcs.iter().filter(|s| s.endpoints.is_empty()) {
        let proto = svc.proto.to_ascii_lowercase();
        // pkg/proxy/iptables/proxier.go: internalTrafficFilterTarget, DROP when the Service has
        // endpoints but none on this node for internalTrafficPolicy: Local.
        let (comment, target) = if svc.no_local_endpoints {
            ("has no local endpoints", "DROP")
        } else {
            ("has no endpoints", "REJECT --reject-with icmp-port-unreachable")
        };
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -d {}/32 -p {proto} -m comment --comment \"{} {comment}\" -m {proto} --dport {} -j {target}",
            svc.vip,
            svc.port_name_string(),
            svc.port
        );
        if let Some(node_port) = svc.node_port {
            let _ = writeln!(
                out,
                "-A KUBE-EXTERNAL-SERVICES -p {proto} -m comment --comment \"{} has no endpoints\" -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j REJECT --reject-with icmp-port-unreachable",
                svc.port_name_string()
            );
        }
        for lb in &svc.load_balancer_ips {
            let _ = writeln!(
                out,
                "-A KUBE-EXTERNAL-SERVICES -d {lb}/32 -p {proto} -m comment --comment \"{} has no endpoints\" -m {proto} --dport {} -j REJECT --reject-with icmp-port-unreachable",
                svc.port_name_string(),
                svc.port
            );
        }
    }
    for svc in svcs.iter().filter(|s| !s.source_ranges.is_empty()) {
        let proto = svc.proto.to_ascii_lowercase();
        let spn = svc.port_name_string();
        let fw_chain = format!("KUBE-FW-{}", chain_hash(&format!("{spn}{}", svc.proto)));
        for lb in &svc.load_balancer_ips {
            let _ = writeln!(
                out,
                "-A KUBE-PROXY-FIREWALL -m comment --comment \"{spn} traffic not accepted by {fw_chain}\" -m {proto} -p {proto} -d {lb}/32 --dport {} -j DROP",
                svc.port
            );
        }
    }
    let _ = writeln!(out, "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP");
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT"
    );
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    );
    out.push_str("COMMIT\n");
    out
}

/// The filter and nat tables of kube-proxy's iptables mode, for one `iptables-restore` (which
/// replaces both tables atomically, as kube-proxy's sync does with its own chains).
pub fn kube_proxy_iptables(svcs: &[Svc], cluster_cidr: &str) -> String {
    kube_proxy_filter_ruleset(svcs) + &kube_proxy_ruleset(svcs, cluster_cidr)
}

/// Removes everything [`kube_proxy_ruleset`] added (an empty nat table).
pub const EMPTY_NAT: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";

/// kube-proxy's nftables chain-name base: `HASH-namespace/name/proto/port`.
fn nft_chain_base(svc: &Svc) -> String {
    let name = format!("{}/{}/{}/{}", svc.namespace, svc.name, svc.proto.to_ascii_lowercase(), svc.port_name);
    format!("{}-{name}", &chain_hash(&name)[..8])
}

/// kube-proxy's nftables name of an endpoint's chain or affinity set (`prefix` `endpoint` or
/// `affinity`): `prefix-HASH-namespace/name/proto/port__ip/port`.
fn nft_endpoint_name(prefix: &str, svc: &Svc, ep: &Ipv4Addr) -> String {
    let proto = svc.proto.to_ascii_lowercase();
    let name = format!("{}/{}/{proto}/{}__{ep}/{}", svc.namespace, svc.name, svc.port_name, svc.target_port);
    format!("{prefix}-{}-{name}", &chain_hash(&name)[..8])
}

/// kube-proxy's nftables-mode table for `svcs` (`table ip kube-proxy`), as an `nft -f` script that
/// replaces the table in one transaction (add, delete, define: works whether or not it exists).
/// `cluster_cidr` is the local-traffic detector (traffic from outside it to a ClusterIP is
/// masqueraded); `service_cidr` the ServiceCIDR whose unallocated addresses are dropped.
///
/// The shape, from pkg/proxy/nftables/proxier.go: base chains `filter-{prerouting,input,forward,
/// output}` at `dstnat - 10`, `filter-output-post-dnat` at `dstnat + 10`, `nat-{prerouting,output}`
/// at `dstnat` jumping to `services`, `nat-postrouting` at `srcnat` jumping to `masquerading`;
/// `services` dispatches `ip daddr . meta l4proto . th dport` through the `service-ips` vmap to
/// `service-…` chains (masquerade mark for sources outside the cluster CIDR, then `numgen random
/// mod N vmap` to `endpoint-…` chains: hairpin mark, `dnat to`); `service-endpoints-check` sends
/// ports without endpoints through `no-endpoint-services` to `reject-chain`; `cluster-ips-check`
/// (new connections, after DNAT) rejects what is still addressed to an active ClusterIP (a port it
/// does not have) and drops the rest of the ServiceCIDR.
pub fn kube_proxy_nftables(svcs: &[Svc], cluster_cidr: &str, service_cidr: &str) -> String {
    let mut t = String::new();
    let mut line = |text: &str| {
        t.push_str("    ");
        t.push_str(text);
        t.push('\n');
    };
    line("comment \"rules for kube-proxy\"");
    let base_chains = [
        ("filter-prerouting", "filter", "prerouting", "-110", vec!["ct state new jump firewall-check"]),
        (
            "filter-input",
            "filter",
            "input",
            "-110",
            vec!["ct state new jump nodeport-endpoints-check", "ct state new jump service-endpoints-check"],
        ),
        (
            "filter-forward",
            "filter",
            "forward",
            "-110",
            vec!["ct state new jump service-endpoints-check", "ct state new jump cluster-ips-check"],
        ),
        (
            "filter-output",
            "filter",
            "output",
            "-110",
            vec!["ct state new jump service-endpoints-check", "ct state new jump firewall-check"],
        ),
        ("filter-output-post-dnat", "filter", "output", "-90", vec!["ct state new jump cluster-ips-check"]),
        ("nat-prerouting", "nat", "prerouting", "-100", vec!["jump services"]),
        ("nat-output", "nat", "output", "-100", vec!["jump services"]),
        ("nat-postrouting", "nat", "postrouting", "100", vec!["jump masquerading"]),
    ];
    for (name, kind, hook, priority, rules) in base_chains {
        line(&format!("chain {name} {{"));
        line(&format!("    type {kind} hook {hook} priority {priority}; policy accept;"));
        for rule in rules {
            line(&format!("    {rule}"));
        }
        line("}");
    }
    let vips: std::collections::BTreeSet<Ipv4Addr> = svcs.iter().map(|s| s.vip).collect();
    // The elements of each verdict map, Service port by Service port.
    let (mut no_endpoint, mut no_endpoint_node_ports, mut service_ips, mut node_ports, mut firewall) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for svc in svcs {
        let proto = svc.proto.to_ascii_lowercase();
        let base = nft_chain_base(svc);
        let port = svc.port;
        let lbs = &svc.load_balancer_ips;
        if svc.endpoints.is_empty() {
            // internalTrafficFilterVerdict: "drop" for a Local policy without local endpoints.
            let verdict = if svc.no_local_endpoints { "drop" } else { "goto reject-chain" };
            for ip in std::iter::once(&svc.vip).chain(lbs) {
                no_endpoint.push(format!("{ip} . {proto} . {port} : {verdict}"));
            }
            if let Some(n) = svc.node_port {
                no_endpoint_node_ports.push(format!("{proto} . {n} : goto reject-chain"));
            }
        } else {
            service_ips.push(format!("{} . {proto} . {port} : goto service-{base}", svc.vip));
            for lb in lbs {
                service_ips.push(format!("{lb} . {proto} . {port} : goto external-{base}"));
            }
            if let Some(n) = svc.node_port {
                node_ports.push(format!("{proto} . {n} : goto external-{base}"));
            }
        }
        if !svc.source_ranges.is_empty() {
            for lb in lbs {
                firewall.push(format!("{lb} . {proto} . {port} : goto firewall-{base}"));
            }
        }
    }
    let elements = |items: Vec<String>| {
        if items.is_empty() { String::new() } else { format!(" elements = {{ {} }};", items.join(", ")) }
    };
    let map = |name: &str, key: &str, comment: &str, items: Vec<String>| {
        format!("map {name} {{ type {key} : verdict; comment \"{comment}\";{} }}", elements(items))
    };
    let addr_key = "ipv4_addr . inet_proto . inet_service";
    let port_key = "inet_proto . inet_service";
    line(&format!(
        "set cluster-ips {{ type ipv4_addr; comment \"Active ClusterIPs\";{} }}",
        elements(vips.iter().map(Ipv4Addr::to_string).collect())
    ));
    line(&map(
        "no-endpoint-services",
        addr_key,
        "vmap to drop or reject packets to services with no endpoints",
        no_endpoint,
    ));
    line(&map(
        "no-endpoint-nodeports",
        port_key,
        "vmap to drop or reject packets to service nodeports with no endpoints",
        no_endpoint_node_ports,
    ));
    line(&map(
        "firewall-ips",
        addr_key,
        "destinations that are subject to LoadBalancerSourceRanges",
        firewall,
    ));
    line(&map("service-ips", addr_key, "ClusterIP, ExternalIP and LoadBalancer IP traffic", service_ips));
    line(&map("service-nodeports", port_key, "NodePort traffic", node_ports));
    for svc in svcs.iter().filter(|s| !s.endpoints.is_empty()) {
        if let Some(timeout) = svc.affinity_timeout {
            for ep in &svc.endpoints {
                line(&format!(
                    "set {} {{ type ipv4_addr; flags dynamic,timeout; timeout {timeout}s; }}",
                    nft_endpoint_name("affinity", svc, ep)
                ));
            }
        }
    }
    let regular: Vec<(&str, Vec<String>)> = vec![
        ("firewall-check", vec!["ip daddr . meta l4proto . th dport vmap @firewall-ips".into()]),
        ("service-endpoints-check", vec!["ip daddr . meta l4proto . th dport vmap @no-endpoint-services".into()]),
        (
            "nodeport-endpoints-check",
            vec!["fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports".into()],
        ),
        (
            "cluster-ips-check",
            vec![
                "ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"".into(),
                format!("ip daddr {{ {service_cidr} }} drop comment \"Drop traffic to unallocated ClusterIPs\""),
            ],
        ),
        ("reject-chain", vec!["reject".into()]),
        ("mark-for-masquerade", vec![format!("mark set mark or {MASQ_MARK}")]),
        (
            "masquerading",
            vec![
                format!("mark and {MASQ_MARK} == 0 return"),
                format!("mark set mark xor {MASQ_MARK}"),
                "masquerade fully-random".into(),
            ],
        ),
        (
            "services",
            vec![
                "ip daddr . meta l4proto . th dport vmap @service-ips".into(),
                "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports".into(),
            ],
        ),
    ];
    let mut chain = |name: &str, rules: &[String]| {
        line(&format!("chain {name} {{"));
        for rule in rules {
            line(&format!("    {rule}"));
        }
        line("}");
    };
    for (name, rules) in &regular {
        chain(name, rules);
    }
    for svc in svcs.iter().filter(|s| !s.source_ranges.is_empty()) {
        let ranges = svc.source_ranges.join(", ");
        chain(&format!("firewall-{}", nft_chain_base(svc)), &[format!("ip saddr != {{ {ranges} }} drop")]);
    }
    for svc in svcs.iter().filter(|s| !s.endpoints.is_empty()) {
        let proto = svc.proto.to_ascii_lowercase();
        let base = nft_chain_base(svc);
        let endpoint_chain = |ep: &Ipv4Addr| nft_endpoint_name("endpoint", svc, ep);
        let affinity_set = |ep: &Ipv4Addr| nft_endpoint_name("affinity", svc, ep);
        let picks: Vec<String> = svc
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, ep)| format!("{i} : goto {}", endpoint_chain(ep)))
            .collect();
        let mut rules = vec![format!(
            "ip daddr {} {proto} dport {} ip saddr != {cluster_cidr} jump mark-for-masquerade",
            svc.vip, svc.port
        )];
        if svc.affinity_timeout.is_some() {
            for ep in &svc.endpoints {
                rules.push(format!("ip saddr @{} goto {}", affinity_set(ep), endpoint_chain(ep)));
            }
        }
        rules.push(format!("numgen random mod {} vmap {{ {} }}", svc.endpoints.len(), picks.join(", ")));
        chain(&format!("service-{base}"), &rules);
        if svc.node_port.is_some() || !svc.load_balancer_ips.is_empty() {
            chain(
                &format!("external-{base}"),
                &["jump mark-for-masquerade".into(), format!("goto service-{base}")],
            );
        }
        for ep in &svc.endpoints {
            let mut rules = vec![format!("ip saddr {ep} jump mark-for-masquerade")];
            if svc.affinity_timeout.is_some() {
                rules.push(format!("update @{} {{ ip saddr }}", affinity_set(ep)));
            }
            rules.push(format!("meta l4proto {proto} dnat to {ep}:{}", svc.target_port));
            chain(&endpoint_chain(ep), &rules);
        }
    }
    format!("add table ip kube-proxy\ndelete table ip kube-proxy\ntable ip kube-proxy {{\n{t}}}\n")
}

/// One UDP conntrack entry as `conntrack -L -p udp` prints it: the original destination and the
/// reply source (where the flow was DNATed to).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpEntry {
    pub orig_dst: Ipv4Addr,
    pub orig_dport: u16,
    pub reply_src: Ipv4Addr,
}

/// Parses `conntrack -L -p udp` output (`udp 17 29 src=… dst=… sport=… dport=… [UNREPLIED]
/// src=… dst=… sport=… dport=… …`).
pub fn parse_udp_entries(text: &str) -> Vec<UdpEntry> {
    text.lines()
        .filter_map(|line| {
            let field = |key: &str, nth: usize| {
                line.split_whitespace().filter_map(|f| f.strip_prefix(key)).nth(nth).map(str::to_owned)
            };
            Some(UdpEntry {
                orig_dst: field("dst=", 0)?.parse().ok()?,
                orig_dport: field("dport=", 0)?.parse().ok()?,
                reply_src: field("src=", 1)?.parse().ok()?,
            })
        })
        .collect()
}

/// What kube-proxy's conntrack clean-up (pkg/proxy/conntrack/cleanup.go, after every sync)
/// deletes: UDP entries addressed to a Service port that has serving endpoints (`svcs` with
/// `serving`: the endpoints whose EndpointSlice condition `serving` holds, including terminating
/// ones) whose reply source is none of them. Services without endpoints and deleted Services
/// keep their entries. Each result is one `conntrack -D -p udp --orig-dst … --orig-port-dst …
/// --reply-src …` filter.
pub fn stale_udp_entries(entries: &[UdpEntry], serving: &[(Ipv4Addr, u16, Vec<Ipv4Addr>)]) -> Vec<UdpEntry> {
    let mut stale: Vec<UdpEntry> = entries
        .iter()
        .filter(|e| {
            serving.iter().any(|(vip, port, eps)| {
                *vip == e.orig_dst && *port == e.orig_dport && !eps.is_empty() && !eps.contains(&e.reply_src)
            })
        })
        .cloned()
        .collect();
    stale.dedup();
    stale
}

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

    fn empty_svc() -> Svc {
        Svc { name: "empty".into(), endpoints: Vec::new(), ..filler(7) }
    }

    #[test]
    fn a_port_without_endpoints_is_rejected_in_filter_not_translated() {
        let svcs = [filler(0), empty_svc()];
        let text = kube_proxy_iptables(&svcs, "10.244.0.0/16");
        assert_eq!(text.matches("-A KUBE-SERVICES -d ").count(), 2, "{text}");
        assert_eq!(text.matches("has no endpoints\" -m tcp --dport 80 -j REJECT").count(), 1, "{text}");
        assert!(text.contains(&format!("-A KUBE-SERVICES -d {}/32 -p tcp -m comment", filler(0).vip)));
        assert!(!text.contains(&format!(
            "-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"bench/empty:http cluster IP\"",
            empty_svc().vip
        )));
        assert!(text.contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"));
        assert!(text.starts_with("*filter\n") && text.ends_with("COMMIT\n"));
    }

    #[test]
    fn node_ports_are_masqueraded_and_rejected_without_endpoints() {
        let svcs =
            [Svc { node_port: Some(30080), ..filler(0) }, Svc { node_port: Some(30081), ..empty_svc() }];
        let iptables = kube_proxy_iptables(&svcs, "10.244.0.0/16");
        assert!(iptables.contains("-m tcp --dport 30080 -j KUBE-EXT-"), "{iptables}");
        assert_eq!(iptables.matches("external destinations\" -j KUBE-MARK-MASQ").count(), 1, "{iptables}");
        assert!(iptables.contains("--dst-type LOCAL -m tcp --dport 30081 -j REJECT"), "{iptables}");
        let nft = kube_proxy_nftables(&svcs, "10.244.0.0/16", "10.96.0.0/12");
        assert!(nft.contains("tcp . 30080 : goto external-"), "{nft}");
        assert!(nft.contains("tcp . 30081 : goto reject-chain"), "{nft}");
        assert!(nft.contains("jump mark-for-masquerade\n        goto service-"), "{nft}");
    }

    #[test]
    fn load_balancer_ips_with_source_ranges_pass_only_those_sources() {
        let lb = Ipv4Addr::new(192, 0, 2, 10);
        let svc =
            Svc { load_balancer_ips: vec![lb], source_ranges: vec!["10.244.0.12/32".into()], ..filler(0) };
        let iptables = kube_proxy_iptables(std::slice::from_ref(&svc), "10.244.0.0/16");
        let spn = "bench/svc-000000:http";
        assert!(
            iptables.contains(&format!(
                "-A KUBE-SERVICES -d 192.0.2.10/32 -p tcp -m comment --comment \"{spn} loadbalancer IP\" -m tcp --dport 80 -j KUBE-FW-"
            )),
            "{iptables}"
        );
        assert!(
            iptables.contains(&format!(
                "-s 10.244.0.12/32 -m comment --comment \"{spn} loadbalancer IP\" -j KUBE-EXT-"
            )),
            "{iptables}"
        );
        assert!(iptables.contains("-d 192.0.2.10/32 --dport 80 -j DROP"), "{iptables}");
        let nft = kube_proxy_nftables(&[svc], "10.244.0.0/16", "10.96.0.0/12");
        assert!(nft.contains("192.0.2.10 . tcp . 80 : goto external-"), "{nft}");
        assert!(nft.contains("192.0.2.10 . tcp . 80 : goto firewall-"), "{nft}");
        assert!(nft.contains("ip saddr != { 10.244.0.12/32 } drop"), "{nft}");
    }

    #[test]
    fn a_local_policy_without_local_endpoints_drops_where_no_endpoints_rejects() {
        let local =
            Svc { name: "local".into(), endpoints: Vec::new(), no_local_endpoints: true, ..filler(3) };
        let svcs = [local.clone(), empty_svc()];
        let nft = kube_proxy_nftables(&svcs, "10.244.0.0/16", "10.96.0.0/12");
        assert!(nft.contains(&format!("{} . tcp . 80 : drop", local.vip)), "{nft}");
        assert!(nft.contains(&format!("{} . tcp . 80 : goto reject-chain", empty_svc().vip)), "{nft}");
        let ipt = kube_proxy_iptables(&svcs, "10.244.0.0/16");
        assert!(ipt.contains("bench/local:http has no local endpoints\" -m tcp --dport 80 -j DROP"), "{ipt}");
        assert!(ipt.contains("bench/empty:http has no endpoints\" -m tcp --dport 80 -j REJECT"), "{ipt}");
    }

    #[test]
    fn session_affinity_checks_and_records_the_source() {
        let svc = Svc { affinity_timeout: Some(10800), ..filler(0) };
        let iptables = kube_proxy_ruleset(std::slice::from_ref(&svc), "10.244.0.0/16");
        assert_eq!(iptables.matches("--rcheck --seconds 10800 --reap -j KUBE-SEP-").count(), 3, "{iptables}");
        assert_eq!(iptables.matches("-m recent --set --name KUBE-SEP-").count(), 3, "{iptables}");
        let check = iptables.find("--rcheck").unwrap();
        assert!(check < iptables.find("--probability").unwrap(), "checks come before the random pick");
        let nft = kube_proxy_nftables(&[svc], "10.244.0.0/16", "10.96.0.0/12");
        assert_eq!(nft.matches("flags dynamic,timeout; timeout 10800s;").count(), 3, "{nft}");
        assert_eq!(nft.matches("ip saddr @affinity-").count(), 3, "{nft}");
        assert_eq!(nft.matches("update @affinity-").count(), 3, "{nft}");
    }

    #[test]
    fn nftables_table_has_kube_proxy_shapes() {
        let svcs = [filler(0), empty_svc()];
        let text = kube_proxy_nftables(&svcs, "10.244.0.0/16", "10.96.0.0/12");
        assert!(
            text.starts_with("add table ip kube-proxy\ndelete table ip kube-proxy\ntable ip kube-proxy {")
        );
        assert_eq!(text.matches("numgen random mod 3 vmap { 0 : goto endpoint-").count(), 1, "{text}");
        assert_eq!(text.matches("dnat to 10.128.0.").count(), 3, "{text}");
        assert!(text.contains(&format!("{} . tcp . 80 : goto reject-chain", empty_svc().vip)), "{text}");
        assert!(text.contains(&format!("{} . tcp . 80 : goto service-", filler(0).vip)), "{text}");
        assert!(text.contains("ip daddr @cluster-ips reject"), "{text}");
        assert!(text.contains("type nat hook postrouting priority 100;"), "{text}");
        assert_eq!(text.matches('{').count(), text.matches('}').count());
    }

    #[test]
    fn stale_udp_entries_are_those_of_a_service_port_not_reaching_a_serving_endpoint() {
        let out = "udp      17 28 src=10.244.0.2 dst=10.96.0.10 sport=20001 dport=53 src=10.244.0.21 dst=10.244.0.2 sport=53 dport=20001 mark=0 use=1\n\
                   udp      17 28 src=10.244.0.2 dst=10.96.0.10 sport=20002 dport=53 src=10.244.0.22 dst=10.244.0.2 sport=53 dport=20002 mark=0 use=1\n\
                   udp      17 20 src=10.244.0.2 dst=10.244.0.21 sport=20003 dport=53 [UNREPLIED] src=10.244.0.21 dst=10.244.0.2 sport=53 dport=20003 mark=0 use=1\n\
                   conntrack v1.4.7 (conntrack-tools): 3 flow entries have been shown.\n";
        let entries = parse_udp_entries(out);
        assert_eq!(entries.len(), 3);
        let vip = Ipv4Addr::new(10, 96, 0, 10);
        let serving = [(vip, 53, vec![Ipv4Addr::new(10, 244, 0, 22)])];
        let stale = stale_udp_entries(&entries, &serving);
        assert_eq!(
            stale,
            vec![UdpEntry { orig_dst: vip, orig_dport: 53, reply_src: Ipv4Addr::new(10, 244, 0, 21) }]
        );
        assert!(stale_udp_entries(&entries, &[(vip, 53, Vec::new())]).is_empty());
    }
}
