//! kube-proxy's node eligibility (KEP-3836): a load balancer probing `NODE_IP:10256/healthz` for an
//! `externalTrafficPolicy: Cluster` Service must be told to stop sending to a node that is being
//! deleted or drained by the cluster autoscaler, before its pods go; `/livez` stays 200 (the process
//! is sound, the kubelet must not restart it). The Node object comes from the in-process API server
//! (the only fake allowed), with real list/watch semantics. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Mode};

fn node(extra_metadata: &str, spec: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n{extra_metadata}spec:\n{spec}")
}

/// Waits until `/healthz` answers `code`, checking `/livez` is 200 every time.
fn wait_for_healthz(cluster: &Cluster, code: u16, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (livez, body) = cluster.node_curl("http://127.0.0.1:10256/livez");
        assert_eq!(livez, 200, "/livez must stay 200 ({what}): {body}");
        let (status, body) = cluster.node_curl("http://127.0.0.1:10256/healthz");
        if status == code {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: /healthz is {status}, not {code}: {body}\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn healthz_turns_503_for_a_node_being_deleted_or_drained_and_livez_stays_200() {
    let cluster = Cluster::start_with("node-eligible", Mode::Api);
    cluster.api().apply_yaml(&node("", "  podCIDR: 10.244.0.0/24\n")).unwrap();
    let body = wait_for_healthz(&cluster, 200, "a plain node");
    assert!(body.contains(r#""nodeEligible": true"#), "{body}");

    // The cluster autoscaler's taint: drained, traffic must go elsewhere.
    let tainted = node(
        "",
        "  taints:\n  - key: ToBeDeletedByClusterAutoscaler\n    value: \"1733000000\"\n    effect: NoSchedule\n",
    );
    cluster.api().apply_yaml(&tainted).unwrap();
    let body = wait_for_healthz(&cluster, 503, "tainted ToBeDeletedByClusterAutoscaler");
    assert!(body.contains(r#""nodeEligible": false"#), "{body}");

    // Untainted (the scale-down was cancelled): eligible again.
    cluster.api().apply_yaml(&node("", "  podCIDR: 10.244.0.0/24\n")).unwrap();
    wait_for_healthz(&cluster, 200, "untainted");

    // Being deleted (a finalizer holds the object while its deletionTimestamp is set).
    let deleting = node(
        "  deletionTimestamp: \"2026-12-01T12:00:00Z\"\n  finalizers: [example.com/hold]\n",
        "  podCIDR: 10.244.0.0/24\n",
    );
    cluster.api().apply_yaml(&deleting).unwrap();
    let body = wait_for_healthz(&cluster, 503, "with a deletionTimestamp");
    assert!(body.contains(r#""nodeEligible": false"#), "{body}");

    // Traffic through the node is still served meanwhile: only the probe changes.
    let answer = cluster.client.exec(["curl", "-sS", "--max-time", "5", "http://10.96.0.100/"]).unwrap();
    assert!(answer.starts_with("web-"), "{answer}");
}
