//! kube-proxy's reading of EndpointSlices, with real clients in a sandbox: topology hints
//! (`pkg/proxy/topology.go` `CategorizeEndpoints`/`topologyModeFromHints`), the traffic-policy-Local
//! drop (the nftables and iptables proxiers' "has no local endpoints" rule), and
//! `pkg/proxy/endpointslicecache.go` (addresses[0], `serving` nil = true, the slice's own `ready`
//! whatever `publishNotReadyAddresses` says, the error for a slice without its Service label).
//!
//! The sandbox is one node (`node-1`, the agent's --hostname-override) with the three nginx pods of
//! [`Cluster`]; slices put them on other nodes by `nodeName`, as a real cluster's would be. Each
//! nginx answers its own name, so the client sees which endpoint it reached. Needs root.

mod common;

use std::collections::BTreeMap;

use common::cluster::{Cluster, Mode};

fn add_manifest(cluster: &Cluster, name: &str, text: &str) {
    std::fs::write(cluster.manifest(name), text).unwrap();
}

/// A ClusterIP Service `name` on `vip`:80 (targetPort 80) with `spec_extra` lines, and its slice.
fn service(name: &str, vip: &str, spec_extra: &str, endpoints: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  clusterIP: {vip}
  ports:
  - name: http
    port: 80
    protocol: TCP
{spec_extra}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-abcde
  namespace: default
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv4
ports:
- name: http
  port: 80
  protocol: TCP
endpoints:
{endpoints}"
    )
}

/// One endpoint: `addresses`, its `conditions` (flow mapping), node and hints (flow mappings or "").
fn endpoint(addresses: &str, conditions: &str, node: &str, hints: &str) -> String {
    let hints = if hints.is_empty() { String::new() } else { format!("  hints: {hints}\n") };
    format!("- addresses: {addresses}\n  conditions: {conditions}\n  nodeName: {node}\n{hints}")
}

const READY: &str = "{ready: true, serving: true, terminating: false}";

/// The three web pods on node-1/2/3, in zones a, a, b, hinted as the EndpointSlice controller hints
/// them for `trafficDistribution: PreferSameNode` (node and zone) or `PreferClose` (zone only).
fn hinted_web(with_node_hints: bool) -> String {
    hinted_web_but(with_node_hints, "")
}

/// [`hinted_web`] with the endpoint `unhinted` (an address) left without hints.
fn hinted_web_but(with_node_hints: bool, unhinted: &str) -> String {
    [
        ("10.244.0.11", "node-1", "zone-a"),
        ("10.244.0.12", "node-2", "zone-a"),
        ("10.244.0.13", "node-3", "zone-b"),
    ]
    .iter()
    .map(|(ip, node, zone)| {
        let hints = if *ip == unhinted {
            String::new()
        } else if with_node_hints {
            format!("{{forNodes: [{{name: {node}}}], forZones: [{{name: {zone}}}]}}")
        } else {
            format!("{{forZones: [{{name: {zone}}}]}}")
        };
        endpoint(&format!("[{ip}]"), READY, node, &hints)
    })
    .collect()
}

/// Which pods answer `count` requests to `url`, and how often.
fn answers(cluster: &Cluster, url: &str, count: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..count {
        let body = cluster
            .client
            .exec(["curl", "-sS", "--max-time", "5", url])
            .unwrap_or_else(|e| panic!("curl {url}: {e:#}\n{}", cluster.agent_log()));
        *seen.entry(body.trim().to_string()).or_default() += 1;
    }
    seen
}

fn only(pod: &str, count: usize) -> BTreeMap<String, usize> {
    [(pod.to_string(), count)].into()
}

/// curl's exit code for one request (7: refused, 28: timed out).
fn curl_exit(cluster: &Cluster, url: &str, max_time: &str) -> Option<i32> {
    let out = cluster.client.exec_output(["curl", "-sS", "--max-time", max_time, url]).unwrap();
    out.status.code()
}

/// The agent's log line without its terminal colour codes (`ESC [ … m`).
fn without_colours(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// `kproxy_topology_service_ports` for IPv4 from the agent's metrics page.
fn topology_ports(cluster: &Cluster, topology: &str) -> u64 {
    let (code, page) = cluster.node_curl("http://127.0.0.1:10249/metrics");
    assert_eq!(code, 200, "{page}");
    let series = format!("kproxy_topology_service_ports{{ip_family=\"IPv4\",topology=\"{topology}\"}} ");
    let line =
        page.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("no {series} in:\n{page}"));
    line[series.len()..].parse().unwrap()
}

#[test]
fn node_hints_keep_traffic_on_this_node_and_zone_hints_in_this_zone() {
    let mut cluster = Cluster::start("topology");
    add_manifest(&cluster, "topo.yaml", &service("topo", "10.96.0.150", "", &hinted_web(true)));
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 1)]);
    // PreferSameNode: every ready endpoint has a node hint and one is for node-1.
    assert_eq!(answers(&cluster, "http://10.96.0.150/", 30), only("web-1", 30));
    // The operator sees why: the gauge and the agent's line naming the Service port and the rule.
    assert_eq!(topology_ports(&cluster, "PreferSameNode"), 1);
    assert_eq!(topology_ports(&cluster, "PreferSameZone"), 0);
    let told = cluster.agent_log();
    let line = told
        .lines()
        .find(|l| l.contains("topology chose this Service port's endpoints") && l.contains("default/topo"))
        .unwrap_or_else(|| panic!("no topology line in the agent's log:\n{told}"));
    let line = without_colours(line);
    assert!(line.contains("topology=PreferSameNode") && line.contains("endpoints_chosen=1"), "{line}");

    // Zone hints only, and the agent knows no zone: every endpoint (kube-proxy ignores zone hints when
    // the node has no topology.kubernetes.io/zone label).
    add_manifest(&cluster, "topo.yaml", &service("topo", "10.96.0.150", "", &hinted_web(false)));
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 3)]);
    let spread = answers(&cluster, "http://10.96.0.150/", 60);
    assert_eq!(spread.keys().collect::<Vec<_>>(), ["web-1", "web-2", "web-3"], "{spread:?}");

    // The node's zone given (as --node-zone in manifests mode): zone-b has only web-3.
    cluster.stop_agent();
    cluster.extra_agent_args = vec!["--node-zone".into(), "zone-b".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 1)]);
    assert_eq!(answers(&cluster, "http://10.96.0.150/", 30), only("web-3", 30));
    assert_eq!(topology_ports(&cluster, "PreferSameZone"), 1);

    // One ready endpoint without a hint: hints are ignored (kube-proxy: "one or more endpoints is
    // missing a zone hint").
    add_manifest(
        &cluster,
        "topo.yaml",
        &service("topo", "10.96.0.150", "", &hinted_web_but(false, "10.244.0.12")),
    );
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 3)]);
    let spread = answers(&cluster, "http://10.96.0.150/", 60);
    assert_eq!(spread.keys().collect::<Vec<_>>(), ["web-1", "web-2", "web-3"], "{spread:?}");
    assert_eq!(topology_ports(&cluster, "PreferSameZone"), 0);
}

#[test]
fn the_nodes_zone_label_from_the_api_server_chooses_the_zone() {
    // The API server is the in-process one (the only fake allowed): it serves the Node object with
    // real list/watch semantics, as the agent's Node watch reads it.
    let cluster = Cluster::start_with("topology-api", Mode::Api);
    let node = |zone: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n  labels:\n    topology.kubernetes.io/zone: {zone}\n"
        )
    };
    cluster.api().apply_yaml(&node("zone-b")).unwrap();
    cluster.api().apply_yaml(&service("topo", "10.96.0.150", "", &hinted_web(false))).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 1)]);
    assert_eq!(answers(&cluster, "http://10.96.0.150/", 30), only("web-3", 30));

    // The node moves to zone-a (relabelled): the zone's two pods, without restarting the agent.
    cluster.api().apply_yaml(&node("zone-a")).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 2)]);
    let spread = answers(&cluster, "http://10.96.0.150/", 40);
    assert_eq!(spread.keys().collect::<Vec<_>>(), ["web-1", "web-2"], "{spread:?}");
}

#[test]
fn internal_traffic_policy_local_without_a_local_endpoint_drops_as_kube_proxy_does() {
    let cluster = Cluster::start("itp-local");
    let spec = "  internalTrafficPolicy: Local\n";
    let elsewhere = endpoint("[10.244.0.12]", READY, "node-2", "");
    add_manifest(&cluster, "local.yaml", &service("local", "10.96.0.151", spec, &elsewhere));
    cluster.wait_for_frontends(&[("10.96.0.151:80", "TCP", 0)]);

    // The Service has an endpoint, on another node: dropped, so the client times out (exit 28), as
    // through kube-proxy's "has no local endpoints" DROP — not refused.
    let before = cluster.stat("drop_no_local_endpoint");
    assert_eq!(curl_exit(&cluster, "http://10.96.0.151/", "2"), Some(28));
    assert!(cluster.stat("drop_no_local_endpoint") > before, "{}", cluster.agent_log());

    // No usable endpoint anywhere: kube-proxy's "has no endpoints" REJECT — refused at once (exit 7).
    let not_ready =
        endpoint("[10.244.0.12]", "{ready: false, serving: false, terminating: false}", "node-2", "");
    add_manifest(&cluster, "local.yaml", &service("local", "10.96.0.151", spec, &not_ready));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while curl_exit(&cluster, "http://10.96.0.151/", "2") != Some(7) {
        assert!(std::time::Instant::now() < deadline, "never refused:\n{}", cluster.agent_log());
    }

    // A local endpoint: served by it.
    let here = endpoint("[10.244.0.11]", READY, "node-1", "") + &elsewhere;
    add_manifest(&cluster, "local.yaml", &service("local", "10.96.0.151", spec, &here));
    cluster.wait_for_frontends(&[("10.96.0.151:80", "TCP", 1)]);
    assert_eq!(answers(&cluster, "http://10.96.0.151/", 10), only("web-1", 10));
}

#[test]
fn endpoint_slices_are_read_as_kube_proxy_reads_them() {
    let cluster = Cluster::start("slice-reading");

    // An endpoint with two addresses is its first (addresses[0]); the second pod never answers.
    let two = endpoint("[10.244.0.11, 10.244.0.12]", READY, "node-2", "");
    add_manifest(&cluster, "two.yaml", &service("two", "10.96.0.152", "", &two));
    // `serving` left out of a terminating endpoint is true: the terminating fallback serves it.
    let draining = endpoint("[10.244.0.12]", "{ready: false, terminating: true}", "node-2", "");
    add_manifest(&cluster, "draining.yaml", &service("draining", "10.96.0.153", "", &draining));
    // publishNotReadyAddresses does not override the slice: the controller would have written the
    // endpoint ready; a slice that says ready: false is refused, as through kube-proxy.
    let not_ready = endpoint("[10.244.0.13]", "{ready: false}", "node-2", "");
    let pnr = service("pnr", "10.96.0.154", "  publishNotReadyAddresses: true\n", &not_ready);
    add_manifest(&cluster, "pnr.yaml", &pnr);
    // A slice without the kubernetes.io/service-name label belongs to no Service: named in the log.
    let orphan = service("orphan", "10.96.0.155", "", &endpoint("[10.244.0.11]", READY, "node-1", ""))
        .replace("  labels:\n    kubernetes.io/service-name: orphan\n", "");
    add_manifest(&cluster, "orphan.yaml", &orphan);

    cluster.wait_for_frontends(&[
        ("10.96.0.152:80", "TCP", 1),
        ("10.96.0.153:80", "TCP", 1),
        ("10.96.0.154:80", "TCP", 0),
        ("10.96.0.155:80", "TCP", 0),
    ]);
    assert_eq!(answers(&cluster, "http://10.96.0.152/", 20), only("web-1", 20));
    assert_eq!(answers(&cluster, "http://10.96.0.153/", 10), only("web-2", 10));
    assert_eq!(curl_exit(&cluster, "http://10.96.0.154/", "3"), Some(7));
    assert_eq!(curl_exit(&cluster, "http://10.96.0.155/", "3"), Some(7));
    let log = cluster.agent_log();
    assert!(
        log.lines().any(|line| line.contains("EndpointSlice default/orphan-abcde")
            && line.contains("metadata.labels[kubernetes.io/service-name]")),
        "the unlabelled slice is not named:\n{log}"
    );
}
