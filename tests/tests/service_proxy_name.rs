//! `--service-proxy-name` against the API server: the agent lists only the Services (and, through
//! the labels the EndpointSlice controller copies, the slices) labelled
//! `service.kubernetes.io/service-proxy-name=NAME`; the others are left to the default proxy, and a
//! Service whose label is removed is handed back to it. The API server is the in-process one (the
//! only fake allowed), which applies label selectors and reports an object that stops matching a
//! watch as DELETED, as the real one does. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Mode};

const LABEL: &str = "service.kubernetes.io/service-proxy-name";

fn labelled_service(labels: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: special
  namespace: default
  labels:
{labels}spec:
  clusterIP: 10.96.0.160
  ports:
  - name: http
    port: 80
    protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: special-abcde
  namespace: default
  labels:
    kubernetes.io/service-name: special
{labels}addressType: IPv4
ports:
- name: http
  port: 80
  protocol: TCP
endpoints:
- addresses: [10.244.0.12]
  conditions: {{ready: true}}
"
    )
}

fn wait_until(cluster: &Cluster, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "{what}:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn only_the_services_labelled_with_the_proxy_name_are_programmed_and_unlabelling_hands_one_back() {
    let mut cluster = Cluster::prepared("proxy-name", Mode::Api);
    cluster.extra_agent_args = vec!["--service-proxy-name".into(), "kproxy".into()];
    cluster.api().apply_yaml(&labelled_service(&format!("    {LABEL}: kproxy\n"))).unwrap();
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.160:80", "TCP", 1)]);
    cluster.wait_for_attachment();
    let answer = cluster.client.exec(["curl", "-sS", "--max-time", "5", "http://10.96.0.160/"]).unwrap();
    assert_eq!(answer.trim(), "web-2");

    // The unlabelled Services (web, kube-dns) are the default proxy's: not even listed.
    assert_eq!(cluster.backend_count("10.96.0.100:80", "TCP"), None);
    assert_eq!(cluster.backend_count("10.96.0.10:53", "UDP"), None);
    let requests = cluster.api().requests();
    let selector = "labelSelector=service.kubernetes.io%2Fservice-proxy-name%3Dkproxy";
    assert!(
        requests.iter().any(|r| r.contains("/services?") && r.contains(selector)),
        "the Service list did not ask for the proxy name: {requests:#?}"
    );

    // Labelled for another proxy: it stops matching the agent's watch, which drops it.
    cluster.api().apply_yaml(&labelled_service(&format!("    {LABEL}: cilium\n"))).unwrap();
    wait_until(&cluster, "the Service labelled for cilium is still programmed", || {
        cluster.backend_count("10.96.0.160:80", "TCP").is_none()
    });
    // The label removed: the default proxy's again, still not ours.
    cluster.api().apply_yaml(&labelled_service("    app: special\n")).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cluster.backend_count("10.96.0.160:80", "TCP"), None);

    // Labelled for kproxy again: programmed again.
    cluster.api().apply_yaml(&labelled_service(&format!("    {LABEL}: kproxy\n"))).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.160:80", "TCP", 1)]);
}
