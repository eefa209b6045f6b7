//! The agent against an API server: kube-rs watchers in `kproxy agent` talk
//! the real list/watch protocol to an in-process server (sandbox::apiserver —
//! the one fake this suite allows, since no API server can be installed here),
//! and the real datapath in a sandbox proves each change with curl. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Mode, WEB_VIP};
use serde_json::json;

fn wait_until(what: &str, cluster: &Cluster, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; agent log:\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn web_slice(addresses: &[&str]) -> serde_json::Value {
    let endpoints: Vec<serde_json::Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true, "serving": true, "terminating": false}, "nodeName": "node-1"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-7x2kq",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-29T14:00:00Z"}
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]
    })
}

fn service(name: &str, cluster_ip: &str, port: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 80}]}
    })
}

fn served_by(cluster: &Cluster, url: &str, attempts: usize) -> std::collections::BTreeSet<String> {
    (0..attempts).filter_map(|_| cluster.client.curl(url).ok()).map(|body| body.trim().to_owned()).collect()
}

#[test]
fn adds_updates_and_deletes_from_the_api_server_reach_the_datapath() {
    let cluster = Cluster::start_with("api-crud", Mode::Api);
    let url = format!("http://{WEB_VIP}/");
    assert!(cluster.client.curl(&url).unwrap().starts_with("web-"));

    // Update: web-3 leaves the EndpointSlice.
    cluster.api().apply(web_slice(&["10.244.0.11", "10.244.0.12"]));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);
    let seen = served_by(&cluster, &url, 40);
    assert!(!seen.contains("web-3") && !seen.is_empty(), "{seen:?}");

    // Add: a second Service on another VIP, sharing the pods.
    cluster.api().apply(service("web-b", "10.96.0.101", json!(8080)));
    let mut slice = web_slice(&["10.244.0.13"]);
    slice["metadata"]["name"] = json!("web-b-abcde");
    slice["metadata"]["labels"]["kubernetes.io/service-name"] = json!("web-b");
    cluster.api().apply(slice);
    cluster.wait_for_frontends(&[("10.96.0.101:8080", "TCP", 1)]);
    assert_eq!(cluster.client.curl("http://10.96.0.101:8080/").unwrap(), "web-3\n");

    // Delete: the VIP stops answering, the other Service is unaffected.
    assert!(cluster.api().delete("Service", Some("default"), "web"));
    wait_until("web's frontend to go", &cluster, || cluster.backend_count("10.96.0.100:80", "TCP").is_none());
    assert!(cluster.client.curl(&url).is_err(), "a deleted Service's VIP still answers");
    assert_eq!(cluster.client.curl("http://10.96.0.101:8080/").unwrap(), "web-3\n");

    // Re-created, it works again.
    cluster.api().apply(service("web", "10.96.0.100", json!(80)));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);
    assert!(cluster.client.curl(&url).unwrap().starts_with("web-"));
}

#[test]
fn a_dropped_watch_and_a_compacted_history_both_recover() {
    let cluster = Cluster::start_with("api-relist", Mode::Api);
    let lists_before =
        cluster.api().requests().iter().filter(|r| r.contains("/services") && !r.contains("watch=")).count();

    cluster.api().drop_watches();
    cluster.api().apply(web_slice(&["10.244.0.11"]));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 1)]);

    // History compacted while the agent was not watching: its next watch gets
    // 410 Gone and it must list again to see the change.
    cluster.api().compact();
    cluster.api().apply(web_slice(&["10.244.0.11", "10.244.0.12", "10.244.0.13"]));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    wait_until("a relist after 410 Gone", &cluster, || {
        let lists = cluster
            .api()
            .requests()
            .iter()
            .filter(|r| r.contains("/services") && !r.contains("watch="))
            .count();
        lists > lists_before
    });
    let seen = served_by(&cluster, &format!("http://{WEB_VIP}/"), 40);
    assert_eq!(seen.len(), 3, "{seen:?}");
}

#[test]
fn bad_objects_are_reported_once_and_the_rest_is_programmed() {
    let cluster = Cluster::start_with("api-bad", Mode::Api);
    cluster.api().apply(service("bad-ip", "10.96.0.300", json!(80)));
    cluster.api().apply(service("port-zero", "10.96.0.51", json!(0)));
    cluster.api().apply(service("port-70000", "10.96.0.52", json!(70000)));
    cluster.api().apply(service("good", "10.96.0.53", json!(80)));
    cluster.wait_for_frontends(&[("10.96.0.53:80", "TCP", 0)]);
    // More syncs: the errors must not be logged again.
    cluster.api().apply(web_slice(&["10.244.0.11", "10.244.0.12"]));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);

    let log = cluster.agent_log();
    for (name, field) in [
        ("bad-ip", "spec.clusterIP"),
        ("port-zero", "spec.ports[0].port"),
        ("port-70000", "spec.ports[0].port"),
    ] {
        let lines: Vec<&str> =
            log.lines().filter(|l| l.contains(&format!("Service default/{name}"))).collect();
        assert_eq!(lines.len(), 1, "{name} should be reported exactly once:\n{log}");
        assert!(lines[0].contains(field), "{name}: {}", lines[0]);
    }
    assert!(cluster.backend_count("10.96.0.51:0", "TCP").is_none());
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));
}

#[test]
fn health_and_metrics_answer_like_kube_proxy() {
    let cluster = Cluster::start_with("api-health", Mode::Api);
    cluster.api().apply(web_slice(&["10.244.0.11", "10.244.0.12"]));
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);

    let (code, body) = cluster.node_curl("http://127.0.0.1:10256/healthz");
    assert_eq!(code, 200, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(health["lastUpdated"].as_str().unwrap().starts_with("20"), "{health}");
    assert!(health["currentTime"].is_string(), "{health}");
    assert_eq!(cluster.node_curl("http://127.0.0.1:10256/livez").0, 200);
    assert_eq!(cluster.node_curl("http://127.0.0.1:10249/proxyMode"), (200, "ebpf".to_owned()));

    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let (code, metrics) = cluster.node_curl("http://127.0.0.1:10249/metrics");
        assert_eq!(code, 200);
        // Map fill is refreshed every 2 s.
        if metrics.contains("kproxy_bpf_map_entries{map=\"services_v4\"}") || Instant::now() > deadline {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kproxy_bpf_map_entries{map=\"services_v4\"}",
        "kproxy_datapath_packets_total{reason=\"dnat_new_flow\"}",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics:\n{metrics}");
    }
    // The slice change carried last-change-trigger-time: one latency sample.
    let count = metrics
        .lines()
        .find(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(count >= 1.0, "no network programming sample:\n{metrics}");
}

#[test]
fn sigkill_mid_traffic_keeps_flows_and_applies_what_changed_meanwhile() {
    let mut cluster = Cluster::start_with("api-kill", Mode::Api);
    let out = cluster.sandbox.dir().join("slow.bin");
    // A long-lived connection: 10 MB at 1 MB/s.
    let started = Instant::now();
    let download = cluster.client.download_slowly(&WEB_VIP.to_string(), &out).unwrap();
    std::thread::sleep(Duration::from_millis(800));

    let agent = cluster.agent.take().unwrap();
    agent.kill().unwrap();
    // While the agent is down: new connections still work, and the cluster changes.
    for _ in 0..5 {
        assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));
    }
    cluster.api().apply(service("web-b", "10.96.0.101", json!(8080)));
    let mut slice = web_slice(&["10.244.0.12"]);
    slice["metadata"]["name"] = json!("web-b-abcde");
    slice["metadata"]["labels"]["kubernetes.io/service-name"] = json!("web-b");
    cluster.api().apply(slice);
    assert!(cluster.api().delete("Service", Some("kube-system"), "kube-dns"));
    assert!(
        download.is_running(),
        "the download ended {:?} after it started, before the agent came back: {:?} {} ({:?} bytes)",
        started.elapsed(),
        download.try_wait(),
        download.log(),
        std::fs::metadata(&out).map(|m| m.len())
    );

    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.101:8080", "TCP", 1), ("10.96.0.100:80", "TCP", 3)]);
    wait_until("kube-dns removed", &cluster, || cluster.backend_count("10.96.0.10:53", "UDP").is_none());
    assert_eq!(cluster.client.curl("http://10.96.0.101:8080/").unwrap(), "web-2\n");
    assert!(cluster.agent_log().contains("adopted the maps' contents"));

    let status = download.wait_timeout(Duration::from_secs(30)).unwrap().expect("download finished");
    assert!(status.success(), "the long-lived download failed: {}", download.log());
    assert!(std::fs::read(&out).unwrap() == sandbox::big_file_contents(), "the download arrived corrupted");
}
