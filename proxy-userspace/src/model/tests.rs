use super::*;
use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::manifest::{Objects, parse_str};
use crate::net::Protocol;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::net::Ipv4Addr;

const KUBE_DNS: &str = r#"apiVersion: v1
kind: Service
metadata:
  annotations:
    prometheus.io/port: "9153"
    prometheus.io/scrape: "true"
  labels:
    k8s-app: kube-dns
    kubernetes.io/cluster-service: "true"
    kubernetes.io/name: CoreDNS
  name: kube-dns
  namespace: kube-system
  resourceVersion: "234"
  uid: 5d3b9f5e-8c1a-4f0e-9a55-0c6f1f3f2a11
spec:
  clusterIP: 10.96.0.10
  clusterIPs:
  - 10.96.0.10
  internalTrafficPolicy: Cluster
  ipFamilies:
  - IPv4
  ipFamilyPolicy: SingleStack
  ports:
  - name: dns
    port: 53
    protocol: UDP
    targetPort: 53
  - name: dns-tcp
    port: 53
    protocol: TCP
    targetPort: 53
  - name: metrics
    port: 9153
    protocol: TCP
    targetPort: 9153
  selector:
    k8s-app: kube-dns
  sessionAffinity: None
  type: ClusterIP
status:
  loadBalancer: {}
"#;

const KUBE_DNS_SLICE_A: &str = r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.0.13
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: kind-control-plane
  targetRef:
    kind: Pod
    name: coredns-668d6bf9bc-x7k2p
    namespace: kube-system
- addresses:
  - 10.244.0.12
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: kind-control-plane
  targetRef:
    kind: Pod
    name: coredns-668d6bf9bc-4zq8m
    namespace: kube-system
kind: EndpointSlice
metadata:
  generateName: kube-dns-
  labels:
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
    k8s-app: kube-dns
    kubernetes.io/service-name: kube-dns
  name: kube-dns-abc12
  namespace: kube-system
ports:
- name: dns-tcp
  port: 53
  protocol: TCP
- name: dns
  port: 53
  protocol: UDP
- name: metrics
  port: 9153
  protocol: TCP
"#;

/// A second slice of kube-dns: one endpoint shared with the first (a duplicate), one new on another
/// node, and one that is not ready.
const KUBE_DNS_SLICE_B: &str = r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.1.9
  conditions:
    ready: true
  nodeName: kind-worker
- addresses:
  - 10.244.0.12
  conditions: {}
  nodeName: kind-control-plane
- addresses:
  - 10.244.2.4
  conditions:
    ready: false
    serving: false
    terminating: true
  nodeName: kind-worker2
kind: EndpointSlice
metadata:
  labels:
    kubernetes.io/service-name: kube-dns
  name: kube-dns-def34
  namespace: kube-system
ports:
- name: dns
  port: 53
  protocol: UDP
- name: dns-tcp
  port: 53
  protocol: TCP
- name: metrics
  port: 9153
  protocol: TCP
"#;

fn parse(docs: &[&str]) -> Objects {
    let mut objects = Objects::default();
    for (i, doc) in docs.iter().enumerate() {
        objects.append(parse_str(doc, &format!("test-{i}.yaml")));
    }
    assert!(objects.errors.is_empty(), "manifest errors: {:?}", objects.errors);
    objects
}

fn build_from(docs: &[&str]) -> (Desired, Vec<ManifestError>) {
    let objects = parse(docs);
    build(&objects.services, &objects.slices)
}

fn build_ok(docs: &[&str]) -> Desired {
    let (desired, errors) = build_from(docs);
    assert!(errors.is_empty(), "model errors: {errors:#?}");
    desired
}

fn frontend<'a>(desired: &'a Desired, vip: &str, port: u16, proto: Protocol) -> &'a Frontend {
    let vip: std::net::IpAddr = vip.parse().unwrap();
    desired
        .frontends
        .iter()
        .find(|f| f.vip == vip && f.port == port && f.proto == proto)
        .unwrap_or_else(|| panic!("no frontend {vip}:{port}/{proto} in {desired:#?}"))
}

fn backends(list: &[(&str, u16)]) -> Vec<BackendAddr> {
    list.iter().map(|(addr, port)| BackendAddr { addr: addr.parse().unwrap(), port: *port }).collect()
}

fn keys(desired: &Desired) -> Vec<String> {
    desired.frontends.iter().map(|f| format!("{}:{}/{}", f.vip, f.port, f.proto)).collect()
}

/// A Service `shop/web` with the given spec lines (indented by two spaces under `spec:`).
fn web(spec: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\nspec:\n{spec}")
}

/// An IPv4 EndpointSlice of `shop/web` with the given top-level lines.
fn web_slice(name: &str, body: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\n{body}"
    )
}

#[test]
fn kube_dns_with_one_slice() {
    let desired = build_ok(&[KUBE_DNS, KUBE_DNS_SLICE_A]);
    assert_eq!(keys(&desired), ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP"]);
    let dns = frontend(&desired, "10.96.0.10", 53, Protocol::Udp);
    assert_eq!(dns.service, ServiceName { namespace: "kube-system".into(), name: "kube-dns".into() });
    assert_eq!(dns.service.to_string(), "kube-system/kube-dns");
    assert_eq!(dns.port_name, "dns");
    assert_eq!(dns.backends, backends(&[("10.244.0.12", 53), ("10.244.0.13", 53)]));
    assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Tcp).port_name, "dns-tcp");
    let metrics = frontend(&desired, "10.96.0.10", 9153, Protocol::Tcp);
    assert_eq!(metrics.port_name, "metrics");
    assert_eq!(metrics.backends, backends(&[("10.244.0.12", 9153), ("10.244.0.13", 9153)]));
}

#[test]
fn slices_are_merged_deduplicated_sorted_and_only_ready_endpoints_used() {
    let desired = build_ok(&[KUBE_DNS_SLICE_B, KUBE_DNS, KUBE_DNS_SLICE_A]);
    let expected = backends(&[("10.244.0.12", 53), ("10.244.0.13", 53), ("10.244.1.9", 53)]);
    assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Udp).backends, expected);
    assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Tcp).backends, expected);
}

#[test]
fn output_does_not_depend_on_input_order() {
    let a = build_ok(&[KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_B]);
    let b = build_ok(&[KUBE_DNS_SLICE_B, KUBE_DNS_SLICE_A, KUBE_DNS]);
    assert_eq!(a, b);
    let other = web("  clusterIP: 10.96.0.5\n  ports:\n  - port: 80\n");
    let c = build_ok(&[&other, KUBE_DNS]);
    let d = build_ok(&[KUBE_DNS, &other]);
    assert_eq!(c, d);
    assert_eq!(
        keys(&c),
        ["10.96.0.5:80/TCP", "10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP"]
    );
}

#[test]
fn readiness_absent_or_true_is_ready_false_is_not() {
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.1]\n- addresses: [10.244.1.2]\n  conditions: {ready: true}\n- addresses: [10.244.1.3]\n  conditions: {ready: false, serving: true, terminating: true}\n- addresses: [10.244.1.4]\n  conditions: {serving: true}\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n",
    );
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: http\n",
    );
    let desired = build_ok(&[&svc, &slice]);
    let fe = frontend(&desired, "10.96.12.7", 80, Protocol::Tcp);
    assert_eq!(fe.backends, backends(&[("10.244.1.1", 8080), ("10.244.1.2", 8080), ("10.244.1.4", 8080)]));
}

#[test]
fn no_ready_endpoints_still_gives_a_frontend() {
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.3]\n  conditions: {ready: false}\nports:\n- port: 8080\n",
    );
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
    let desired = build_ok(&[&svc, &slice]);
    assert_eq!(desired.frontends.len(), 1);
    assert!(frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends.is_empty());

    // And with no EndpointSlice at all.
    let desired = build_ok(&[KUBE_DNS]);
    assert_eq!(desired.frontends.len(), 3);
    assert!(desired.frontends.iter().all(|f| f.backends.is_empty()));

    // And with a slice that has `endpoints: null`, as the API prints for an empty slice.
    let slice = web_slice("web-x1", "endpoints: null\nports:\n- port: 8080\n");
    let desired = build_ok(&[&svc, &slice]);
    assert!(desired.frontends[0].backends.is_empty());
}

#[test]
fn dual_stack_uses_the_cluster_ips_of_both_families_deduplicated() {
    let svc = web(
        "  clusterIP: fd00:10:96::4a1\n  clusterIPs:\n  - fd00:10:96::4a1\n  - 10.96.12.7\n  ipFamilies: [IPv6, IPv4]\n  ipFamilyPolicy: PreferDualStack\n  ports:\n  - name: http\n    port: 80\n",
    );
    let desired = build_ok(&[&svc]);
    let mut found = keys(&desired);
    found.sort();
    assert_eq!(found, ["10.96.12.7:80/TCP", "fd00:10:96::4a1:80/TCP"]);

    let svc =
        web("  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, 10.96.12.8]\n  ports:\n  - port: 80\n");
    let desired = build_ok(&[&svc]);
    assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.8:80/TCP"]);

    // Only clusterIPs set (clusterIP empty) still works.
    let svc = web("  clusterIP: \"\"\n  clusterIPs: [10.96.12.9]\n  ports:\n  - port: 80\n");
    assert_eq!(keys(&build_ok(&[&svc])), ["10.96.12.9:80/TCP"]);

    // IPv6-only.
    let svc = web("  clusterIP: fd00:10:96::4a1\n  clusterIPs: [fd00:10:96::4a1]\n  ports:\n  - port: 80\n");
    assert_eq!(keys(&build_ok(&[&svc])), ["fd00:10:96::4a1:80/TCP"]);

    // An unusable IPv6 address is reported with its field, as an IPv4 one is.
    let svc = web("  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"::1\"]\n  ports:\n  - port: 80\n");
    let (desired, errors) = build_from(&[&svc]);
    assert!(desired.frontends.is_empty());
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("spec.clusterIPs[1]") && e.to_string().contains("loopback")),
        "{errors:?}"
    );
}

#[test]
fn each_family_takes_its_backends_from_the_slices_of_its_address_type() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"fd00:10:96::4a1\"]\n  ipFamilies: [IPv4, IPv6]\n  ports:\n  - port: 80\n    targetPort: 8080\n",
    );
    let v4 = web_slice("web-v4", "endpoints:\n- addresses: [10.244.1.5]\nports:\n- port: 8080\n");
    let v6 = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-v6\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv6\nendpoints:\n- addresses: [\"fd00:10:244::5\"]\n- addresses: [\"10.244.9.9\"]\nports:\n- port: 8080\n";
    let (desired, errors) = build_from(&[&svc, &v4, v6]);
    let v4_frontend = frontend(&desired, "10.96.12.7", 80, Protocol::Tcp);
    assert_eq!(v4_frontend.backends, backends(&[("10.244.1.5", 8080)]));
    let v6_frontend = frontend(&desired, "fd00:10:96::4a1", 80, Protocol::Tcp);
    assert_eq!(v6_frontend.backends, backends(&[("fd00:10:244::5", 8080)]));
    // An IPv4 address in an IPv6 slice is the slice's error, named by its field.
    assert!(
        errors.iter().any(|e| e.to_string().contains("endpoints[1].addresses[0]")
            && e.to_string().contains("not an IPv6 address")),
        "{errors:?}"
    );
}

#[test]
fn headless_external_name_and_missing_cluster_ip_are_skipped_without_error() {
    let headless = web("  clusterIP: None\n  clusterIPs: [None]\n  ports:\n  - name: http\n    port: 80\n");
    let headless_slice =
        web_slice("web-h1", "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: null\n");
    let external = r#"apiVersion: v1
kind: Service
metadata:
  name: search
  namespace: shop
spec:
  type: ExternalName
  externalName: search.example.com
  ports:
  - port: 443
"#;
    let no_ip = "apiVersion: v1\nkind: Service\nmetadata:\n  name: pending\n  namespace: shop\nspec:\n  ports:\n  - port: 80\n";
    let no_spec = "apiVersion: v1\nkind: Service\nmetadata:\n  name: bare\n";
    // The slice of the headless Service is not ours: its missing port number is not reported.
    let desired = build_ok(&[&headless, &headless_slice, external, no_ip, no_spec]);
    assert!(desired.frontends.is_empty());
    assert!(desired.trigger_times.is_empty());
    let stats = &desired.stats;
    assert_eq!((stats.services_seen, stats.services_programmed), (4, 0));
    assert_eq!((stats.services_skipped_headless, stats.services_skipped_external_name), (1, 1));
}

#[test]
fn headless_and_service_proxy_name_labels_skip_the_service() {
    for label in ["service.kubernetes.io/headless: \"\"", "service.kubernetes.io/service-proxy-name: cilium"]
    {
        let svc = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: shop\n  labels:\n    app: web\n    {label}\nspec:\n  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n"
        );
        let slice = web_slice("web-x1", "endpoints:\n- addresses: [bogus]\nports:\n- port: 0\n");
        let desired = build_ok(&[&svc, &slice]);
        assert!(desired.frontends.is_empty(), "{label}");
        assert_eq!(desired.stats.services_programmed, 0, "{label}");
    }
    // A slice carrying the label is ignored as well, as kube-proxy's informers do.
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
    let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-x1\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\n    service.kubernetes.io/service-proxy-name: other\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.1]\nports:\n- port: 8080\n";
    let desired = build_ok(&[&svc, slice]);
    assert!(desired.frontends[0].backends.is_empty());
}

#[test]
fn protocol_defaults_to_tcp_and_sctp_is_reported_but_other_ports_kept() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n  - name: sig\n    port: 3868\n    protocol: SCTP\n  - name: syslog\n    port: 514\n    protocol: UDP\n  - name: weird\n    port: 9\n    protocol: tcp\n",
    );
    let (desired, errors) = build_from(&[&svc]);
    assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.7:514/UDP"]);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_eq!(errors[0].origin, "test-0.yaml");
    assert_eq!(errors[0].object.as_deref(), Some("Service shop/web"));
    assert_eq!(errors[0].field.as_deref(), Some("spec.ports[1].protocol"));
    assert!(errors[0].message.contains("SCTP is not supported by kproxy"), "{}", errors[0].message);
    // The port, and why.
    assert!(errors[0].message.contains("port \"sig\" 3868/SCTP is skipped"), "{}", errors[0].message);
    assert!(errors[0].message.contains("translates TCP and UDP only"), "{}", errors[0].message);
    assert!(errors[0].message.contains("CRC32c"), "{}", errors[0].message);
    assert_eq!(errors[1].field.as_deref(), Some("spec.ports[3].protocol"));
    assert!(errors[1].message.contains("\"tcp\""), "{}", errors[1].message);
}

#[test]
fn invalid_cluster_ip_skips_the_service() {
    for (spec, field) in [
        ("  clusterIP: 10.96.300.1\n", "spec.clusterIP"),
        ("  clusterIP: web.shop.svc\n", "spec.clusterIP"),
        ("  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"10.96.12.x\"]\n", "spec.clusterIPs[1]"),
        ("  clusterIP: 0.0.0.0\n", "spec.clusterIP"),
        ("  clusterIP: 127.0.0.1\n", "spec.clusterIP"),
    ] {
        let svc = web(&format!("{spec}  ports:\n  - port: 80\n"));
        let (desired, errors) = build_from(&[&svc, KUBE_DNS]);
        assert_eq!(desired.frontends.len(), 3, "kube-dns is still built: {spec}");
        assert_eq!(errors.len(), 1, "{spec}: {errors:#?}");
        assert_eq!(errors[0].object.as_deref(), Some("Service shop/web"));
        assert_eq!(errors[0].field.as_deref(), Some(field));
        assert!(errors[0].message.ends_with("the Service is skipped"), "{}", errors[0].message);
    }
}

#[test]
fn out_of_range_ports_are_reported_and_skipped() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: a\n    port: 0\n  - name: b\n    port: 70000\n  - name: c\n    port: -80\n  - name: d\n    port: 65535\n  - name: e\n",
    );
    let (desired, errors) = build_from(&[&svc]);
    assert_eq!(keys(&desired), ["10.96.12.7:65535/TCP"]);
    let fields: Vec<_> = errors.iter().map(|e| e.field.as_deref().unwrap()).collect();
    assert_eq!(
        fields,
        ["spec.ports[0].port", "spec.ports[1].port", "spec.ports[2].port", "spec.ports[4].port"]
    );
    assert_eq!(
        errors[1].to_string(),
        "test-0.yaml: Service shop/web: spec.ports[1].port: port 70000 is not in 1-65535; the port is skipped"
    );
}

#[test]
fn duplicate_port_and_protocol_is_reported_same_port_other_protocol_is_fine() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n  - name: http-udp\n    port: 80\n    protocol: UDP\n  - name: again\n    port: 80\n",
    );
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n- name: http-udp\n  port: 8081\n  protocol: UDP\n",
    );
    let (desired, errors) = build_from(&[&svc, &slice]);
    assert_eq!(keys(&desired), ["10.96.12.7:80/TCP", "10.96.12.7:80/UDP"]);
    assert_eq!(
        frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends,
        backends(&[("10.244.1.1", 8080)])
    );
    assert_eq!(
        frontend(&desired, "10.96.12.7", 80, Protocol::Udp).backends,
        backends(&[("10.244.1.1", 8081)])
    );
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].field.as_deref(), Some("spec.ports[2]"));
    assert!(
        errors[0].message.contains("duplicate port 80/TCP (also spec.ports[0])"),
        "{}",
        errors[0].message
    );
}

#[test]
fn duplicate_port_name_is_reported() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n  - name: http\n    port: 81\n",
    );
    let (desired, errors) = build_from(&[&svc]);
    assert_eq!(keys(&desired), ["10.96.12.7:80/TCP"]);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field.as_deref(), Some("spec.ports[1].name"));
}

#[test]
fn slices_link_by_label_within_the_namespace() {
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
    let unlabelled = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-manual\n  namespace: shop\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.1]\nports:\n- port: 8080\n";
    let other_ns = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-x1\n  namespace: staging\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\nports:\n- port: 8080\n";
    let linked = web_slice("web-x2", "endpoints:\n- addresses: [10.244.1.3]\nports:\n- port: 8080\n");
    let (desired, errors) = build_from(&[&svc, unlabelled, other_ns, &linked]);
    assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.3", 8080)]));
    // As kube-proxy, the slice that belongs to no Service is named in an error, not dropped in silence.
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(
        errors[0].to_string(),
        "test-1.yaml: EndpointSlice shop/web-manual: metadata.labels[kubernetes.io/service-name]: the EndpointSlice has no kubernetes.io/service-name label, so it belongs to no Service; it is ignored"
    );

    // A slice without a namespace belongs to `default`.
    let svc = "apiVersion: v1\nkind: Service\nmetadata:\n  name: api\nspec:\n  clusterIP: 10.96.0.20\n  ports:\n  - port: 443\n";
    let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: api-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: api\naddressType: IPv4\nendpoints:\n- addresses: [10.244.3.3]\nports:\n- port: 6443\n";
    let desired = build_ok(&[svc, slice]);
    assert_eq!(desired.frontends[0].service.to_string(), "default/api");
    assert_eq!(desired.frontends[0].backends, backends(&[("10.244.3.3", 6443)]));
}

#[test]
fn ipv6_slices_of_an_ipv4_only_service_and_fqdn_slices_give_it_no_backends() {
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
    let v6 = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-v6\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv6\nendpoints:\n- addresses: [\"fd00:10:244::5\"]\nports:\n- port: 8080\n";
    let fqdn = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-fqdn\n  namespace: shop\n  labels:\n    kubernetes.io/service-name: web\naddressType: FQDN\nendpoints:\n- addresses: [web.example.com]\nports:\n- port: 0\n";
    let desired = build_ok(&[&svc, v6, fqdn]);
    assert_eq!(desired.frontends.len(), 1);
    assert!(desired.frontends[0].backends.is_empty());
}

#[test]
fn named_target_ports_resolve_per_slice() {
    // Port 80 → container port "http", which is 100 on one set of pods and 101 on another
    // (the e2e "multi-port, named targetPort" case); unnamed ports match unnamed slice ports.
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    targetPort: http\n  - name: admin\n    port: 81\n    targetPort: admin\n",
    );
    let old = web_slice(
        "web-old",
        "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: http\n  port: 100\n  protocol: TCP\n- name: admin\n  port: 200\n  protocol: TCP\n",
    );
    let new = web_slice(
        "web-new",
        "endpoints:\n- addresses: [10.244.2.1]\nports:\n- name: http\n  port: 101\n  protocol: TCP\n- port: 999\n",
    );
    let desired = build_ok(&[&svc, &old, &new]);
    let http = frontend(&desired, "10.96.12.7", 80, Protocol::Tcp);
    assert_eq!(http.backends, backends(&[("10.244.1.1", 100), ("10.244.2.1", 101)]));
    let admin = frontend(&desired, "10.96.12.7", 81, Protocol::Tcp);
    assert_eq!(admin.backends, backends(&[("10.244.1.1", 200)]));

    // Absent and empty names match each other.
    let svc = web("  clusterIP: 10.96.12.8\n  ports:\n  - port: 80\n    targetPort: 8080\n");
    let slice =
        web_slice("web-x1", "endpoints:\n- addresses: [10.244.1.5]\nports:\n- name: \"\"\n  port: 8080\n");
    let desired = build_ok(&[&svc, &slice]);
    assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.5", 8080)]));
    let svc = web("  clusterIP: 10.96.12.8\n  ports:\n  - name: \"\"\n    port: 80\n");
    let slice = web_slice("web-x1", "endpoints:\n- addresses: [10.244.1.5]\nports:\n- port: 8080\n");
    let desired = build_ok(&[&svc, &slice]);
    assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.5", 8080)]));
}

#[test]
fn slice_port_protocol_must_match() {
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n");
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: dns\n  port: 5353\n  protocol: TCP\n",
    );
    let desired = build_ok(&[&svc, &slice]);
    assert!(frontend(&desired, "10.96.12.7", 53, Protocol::Udp).backends.is_empty());
}

#[test]
fn invalid_slice_ports_are_reported_and_ignored() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  ports:\n  - name: a\n    port: 80\n  - name: b\n    port: 81\n  - name: c\n    port: 82\n  - name: d\n    port: 83\n",
    );
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.1]\nports:\n- name: a\n  port: 0\n- name: b\n  port: 70000\n- name: c\n- name: d\n  port: 8083\n",
    );
    let (desired, errors) = build_from(&[&svc, &slice]);
    assert_eq!(desired.frontends.len(), 4);
    assert!(frontend(&desired, "10.96.12.7", 80, Protocol::Tcp).backends.is_empty());
    assert!(frontend(&desired, "10.96.12.7", 81, Protocol::Tcp).backends.is_empty());
    assert!(frontend(&desired, "10.96.12.7", 82, Protocol::Tcp).backends.is_empty());
    assert_eq!(
        frontend(&desired, "10.96.12.7", 83, Protocol::Tcp).backends,
        backends(&[("10.244.1.1", 8083)])
    );
    assert_eq!(errors.len(), 3, "{errors:#?}");
    for (err, i) in errors.iter().zip(0..) {
        assert_eq!(err.origin, "test-1.yaml");
        assert_eq!(err.object.as_deref(), Some("EndpointSlice shop/web-x1"));
        assert_eq!(err.field, Some(format!("ports[{i}].port")));
    }
    assert!(errors[2].message.contains("missing"), "{}", errors[2].message);
}

#[test]
fn invalid_endpoint_addresses_are_reported_and_skipped() {
    let svc = web("  clusterIP: 10.96.12.7\n  ports:\n  - port: 80\n");
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.1]\n- addresses: [\"10.244.1.300\", 10.244.1.2, \"fd00::1\"]\n- addresses: [127.0.0.1]\n  conditions: {ready: false}\nports:\n- port: 8080\n",
    );
    let (desired, errors) = build_from(&[&svc, &slice]);
    // An endpoint is its addresses[0] (kube-proxy's addEndpoints): endpoint 1's other addresses are not
    // read at all, so its unusable first address leaves it out.
    assert_eq!(desired.frontends[0].backends, backends(&[("10.244.1.1", 8080)]));
    let fields: Vec<_> = errors.iter().map(|e| e.field.as_deref().unwrap()).collect();
    assert_eq!(fields, ["endpoints[1].addresses[0]", "endpoints[2].addresses[0]"]);
    assert_eq!(
        errors[0].to_string(),
        "test-1.yaml: EndpointSlice shop/web-x1: endpoints[1].addresses[0]: \"10.244.1.300\" is not an IPv4 address; the address is skipped"
    );
}

#[test]
fn conflicting_and_repeated_objects_are_reported() {
    let svc = web(
        "  clusterIP: 10.96.0.10\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n  - port: 80\n",
    );
    let (desired, errors) = build_from(&[KUBE_DNS, &svc, KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_A]);
    assert_eq!(
        keys(&desired),
        ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:80/TCP", "10.96.0.10:9153/TCP"]
    );
    assert_eq!(frontend(&desired, "10.96.0.10", 53, Protocol::Udp).service.name, "kube-dns");
    assert_eq!(frontend(&desired, "10.96.0.10", 80, Protocol::Tcp).service.name, "web");
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(texts.len(), 3, "{texts:#?}");
    assert_eq!(
        texts[0],
        "test-2.yaml: Service kube-system/kube-dns: the Service is defined again (first in test-0.yaml); this copy is skipped"
    );
    assert_eq!(
        texts[1],
        "test-4.yaml: EndpointSlice kube-system/kube-dns-abc12: the EndpointSlice is defined again (first in test-3.yaml); this copy is skipped"
    );
    assert_eq!(
        texts[2],
        "test-1.yaml: Service shop/web: spec.ports[0]: 10.96.0.10:53/UDP is already used by Service kube-system/kube-dns; the port is skipped"
    );
}

#[test]
fn multi_document_file_with_broken_document_and_bad_port() {
    let text = format!(
        r#"# web shop, as applied by the demo
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: 10.96.45.3
  ports:
  - name: http
    port: 70000
    targetPort: 8080
  - name: https
    port: 443
    targetPort: 8443
---
apiVersion: v1
kind: Service
metadata:
  name: cart
  namespace: default
spec:
  clusterIP: 10.96.45.4
  ports:
  - name: http
    port: 80
    targetPort: 8080
    protocol: [TCP
---
{KUBE_DNS}---
{KUBE_DNS_SLICE_A}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-7f9c2
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses:
  - 10.244.1.20
  conditions:
    ready: true
ports:
- name: https
  port: 8443
  protocol: TCP
"#
    );
    let objects = parse_str(&text, "examples/web.yaml");
    assert_eq!(objects.services.len(), 2);
    assert_eq!(objects.slices.len(), 2);
    assert_eq!(objects.errors.len(), 1, "{:#?}", objects.errors);
    let broken = objects.errors[0].to_string();
    assert!(broken.starts_with("examples/web.yaml (document 2): invalid YAML: "), "{broken}");

    let (desired, errors) = build(&objects.services, &objects.slices);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    let err = &errors[0];
    assert_eq!(err.origin, "examples/web.yaml (document 1)");
    assert_eq!(err.object.as_deref(), Some("Service default/web"));
    assert_eq!(err.field.as_deref(), Some("spec.ports[0].port"));
    assert_eq!(
        err.to_string(),
        "examples/web.yaml (document 1): Service default/web: spec.ports[0].port: port 70000 is not in 1-65535; the port is skipped"
    );
    assert_eq!(
        keys(&desired),
        ["10.96.0.10:53/TCP", "10.96.0.10:53/UDP", "10.96.0.10:9153/TCP", "10.96.45.3:443/TCP"]
    );
    let https = frontend(&desired, "10.96.45.3", 443, Protocol::Tcp);
    assert_eq!(https.port_name, "https");
    assert_eq!(https.backends, backends(&[("10.244.1.20", 8443)]));
    assert_eq!(
        frontend(&desired, "10.96.0.10", 53, Protocol::Udp).backends,
        backends(&[("10.244.0.12", 53), ("10.244.0.13", 53)])
    );
}

#[test]
fn never_panics_on_empty_or_default_objects() {
    let services = vec![
        Sourced { origin: "a".to_string(), object: Service::default() },
        Sourced {
            origin: "b".to_string(),
            object: Service {
                metadata: ObjectMeta { name: Some("x".into()), ..Default::default() },
                spec: Some(Default::default()),
                ..Default::default()
            },
        },
    ];
    let slices = vec![Sourced { origin: "c".to_string(), object: EndpointSlice::default() }];
    let (desired, errors) = build(&services, &slices);
    assert_eq!(
        desired,
        Desired { stats: ModelStats { services_seen: 2, ..Default::default() }, ..Default::default() }
    );
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_eq!(errors[0].to_string(), "a: Service: metadata.name: the Service has no name; it is skipped");
    assert_eq!(errors[1].field.as_deref(), Some("metadata.labels[kubernetes.io/service-name]"));
    let none: [Sourced<Service>; 0] = [];
    let no_slices: [Sourced<EndpointSlice>; 0] = [];
    assert_eq!(build(&none, &no_slices), (Desired::default(), Vec::new()));
}

#[test]
fn display_forms() {
    assert_eq!(Protocol::Tcp.to_string(), "TCP");
    assert_eq!(Protocol::Udp.to_string(), "UDP");
    let backend = BackendAddr { addr: Ipv4Addr::new(10, 244, 0, 12).into(), port: 53 };
    assert_eq!(backend.to_string(), "10.244.0.12:53");
    assert!(Protocol::Tcp < Protocol::Udp);
}

// ---- kube-proxy's endpoint selection, traffic policies, affinity, proxy name, trigger times ----

/// `shop/checkout` as `kubectl get svc checkout -o yaml` prints it; `SPEC_EXTRA` is replaced by extra
/// spec lines (two-space indented) and `LABELS_EXTRA` by extra label lines (four-space indented).
const CHECKOUT: &str = r#"apiVersion: v1
kind: Service
metadata:
  annotations:
    kubectl.kubernetes.io/last-applied-configuration: |
      {"apiVersion":"v1","kind":"Service","metadata":{"annotations":{},"name":"checkout","namespace":"shop"},"spec":{"ports":[{"name":"http","port":80,"targetPort":"http"}],"selector":{"app":"checkout"}}}
  creationTimestamp: "2025-03-02T10:15:42Z"
  labels:
    app: checkout
LABELS_EXTRA  name: checkout
  namespace: shop
  resourceVersion: "48211"
  uid: 3f1c7a52-96e4-4b8e-a1d2-5c0f4e8b7d19
spec:
  clusterIP: 10.96.88.14
  clusterIPs:
  - 10.96.88.14
  ipFamilies:
  - IPv4
  ipFamilyPolicy: SingleStack
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: http
  selector:
    app: checkout
  type: ClusterIP
SPEC_EXTRAstatus:
  loadBalancer: {}
"#;

fn checkout(spec_extra: &str) -> String {
    checkout_labelled(spec_extra, "")
}

fn checkout_labelled(spec_extra: &str, labels_extra: &str) -> String {
    let spec_extra = if spec_extra.is_empty() {
        "  internalTrafficPolicy: Cluster\n  sessionAffinity: None\n"
    } else {
        spec_extra
    };
    CHECKOUT.replace("SPEC_EXTRA", spec_extra).replace("LABELS_EXTRA", labels_extra)
}

/// One endpoint of a checkout pod, as the EndpointSlice controller writes it. `conditions` is the
/// flow mapping printed after `conditions:`; `node` may be empty for no nodeName.
fn pod(addr: &str, node: &str, conditions: &str) -> String {
    let node = if node.is_empty() { String::new() } else { format!("  nodeName: {node}\n") };
    let last = addr.rsplit('.').next().unwrap();
    format!(
        "- addresses:\n  - {addr}\n  conditions: {conditions}\n{node}  targetRef:\n    kind: Pod\n    name: checkout-7d9f8b6c5-p{last}\n    namespace: shop\n    uid: 0b7e4c1a-2d3f-4e5a-8b9c-{last:0>12}\n"
    )
}

const READY: &str = "{ready: true, serving: true, terminating: false}";
const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";
const TERMINATING_NOT_SERVING: &str = "{ready: false, serving: false, terminating: true}";
const NOT_READY: &str = "{ready: false, serving: false, terminating: false}";

/// An EndpointSlice of `shop/checkout` with the given endpoints and, if any, trigger time.
fn checkout_slice(name: &str, trigger: Option<&str>, endpoints: &[String]) -> String {
    checkout_slice_labelled(name, trigger, "", endpoints)
}

fn checkout_slice_labelled(
    name: &str,
    trigger: Option<&str>,
    labels_extra: &str,
    endpoints: &[String],
) -> String {
    let annotations = match trigger {
        Some(time) => {
            format!("  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"{time}\"\n")
        }
        None => String::new(),
    };
    let endpoints = if endpoints.is_empty() {
        "endpoints: null\n".to_string()
    } else {
        format!("endpoints:\n{}", endpoints.concat())
    };
    format!(
        r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
{endpoints}kind: EndpointSlice
metadata:
{annotations}  creationTimestamp: "2025-03-02T10:15:42Z"
  generateName: checkout-
  generation: 7
  labels:
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
    kubernetes.io/service-name: checkout
{labels_extra}  name: {name}
  namespace: shop
  ownerReferences:
  - apiVersion: v1
    blockOwnerDeletion: true
    controller: true
    kind: Service
    name: checkout
    uid: 3f1c7a52-96e4-4b8e-a1d2-5c0f4e8b7d19
  resourceVersion: "48390"
  uid: 9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d
ports:
- name: http
  port: 8080
  protocol: TCP
"#
    )
}

fn build_opts(docs: &[&str], options: &ModelOptions) -> Desired {
    let objects = parse(docs);
    let (desired, errors) = build_with(&objects.services, &objects.slices, options);
    assert!(errors.is_empty(), "model errors: {errors:#?}");
    desired
}

fn on_node(node: &str) -> ModelOptions {
    ModelOptions { node_name: Some(node.to_string()), ..Default::default() }
}

fn checkout_frontend(desired: &Desired) -> &Frontend {
    frontend(desired, "10.96.88.14", 80, Protocol::Tcp)
}

fn at_8080(addrs: &[&str]) -> Vec<BackendAddr> {
    addrs.iter().map(|addr| BackendAddr { addr: addr.parse().unwrap(), port: 8080 }).collect()
}

#[test]
fn conditions_of_a_single_endpoint() {
    // (conditions, used, from the terminating fallback)
    let cases = [
        ("{}", true, false),
        ("{ready: true}", true, false),
        (READY, true, false),
        ("{serving: true}", true, false),
        ("{terminating: false}", true, false),
        // Ready wins over anything else (the API never writes this, but the rule is "ready").
        ("{ready: true, serving: false, terminating: true}", true, false),
        ("{serving: false, terminating: true}", true, false),
        (TERMINATING, true, true),
        ("{ready: false, serving: true, terminating: true}", true, true),
        (TERMINATING_NOT_SERVING, false, false),
        // serving is true when absent (kube-proxy: `Serving == nil || *Serving`), so a not-ready
        // terminating endpoint that does not say otherwise is the fallback.
        ("{ready: false, terminating: true}", true, true),
        ("{ready: false}", false, false),
        (NOT_READY, false, false),
        // Serving but not terminating (a pod whose readiness flips): not ready, not a fallback.
        ("{ready: false, serving: true, terminating: false}", false, false),
        ("{ready: false, serving: true}", false, false),
    ];
    for (conditions, used, fallback) in cases {
        let slice = checkout_slice("checkout-7wq2d", None, &[pod("10.244.1.17", "kind-worker", conditions)]);
        let desired = build_ok(&[&checkout(""), &slice]);
        let fe = checkout_frontend(&desired);
        let expected = if used { at_8080(&["10.244.1.17"]) } else { vec![] };
        assert_eq!(fe.backends, expected, "{conditions}");
        assert_eq!(fe.terminating_fallback, fallback, "{conditions}");
        assert!(!fe.local_only);
        assert_eq!(fe.session_affinity_timeout, None);
    }
}

#[test]
fn terminating_endpoints_are_used_only_when_none_is_ready() {
    // A rolling update in progress: one new ready pod, two old ones terminating (one still serving).
    let rolling = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.1.17", "kind-worker", TERMINATING),
            pod("10.244.2.8", "kind-worker2", READY),
            pod("10.244.2.9", "kind-worker2", TERMINATING_NOT_SERVING),
            pod("10.244.1.18", "kind-worker", NOT_READY),
        ],
    );
    let desired = build_ok(&[&checkout(""), &rolling]);
    let fe = checkout_frontend(&desired);
    assert_eq!(fe.backends, at_8080(&["10.244.2.8"]));
    assert!(!fe.terminating_fallback);
    // The old pod that still serves keeps its connections (no new ones); the one that stopped serving
    // and the unready one are gone from the datapath.
    assert_eq!(fe.terminating_backends, at_8080(&["10.244.1.17"]));
    assert_eq!(
        (
            desired.stats.endpoints_ready,
            desired.stats.endpoints_terminating,
            desired.stats.endpoints_not_ready
        ),
        (1, 2, 1)
    );
    assert_eq!(desired.stats.frontends_terminating_fallback, 0);

    // Scaled to zero: only terminating pods are left; those still serving take new connections.
    let draining = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.1.17", "kind-worker", TERMINATING),
            pod("10.244.2.3", "kind-worker2", TERMINATING),
            pod("10.244.2.9", "kind-worker2", TERMINATING_NOT_SERVING),
            pod("10.244.1.18", "kind-worker", NOT_READY),
        ],
    );
    let desired = build_ok(&[&checkout(""), &draining]);
    let fe = checkout_frontend(&desired);
    assert_eq!(fe.backends, at_8080(&["10.244.1.17", "10.244.2.3"]));
    assert!(fe.terminating_fallback);
    assert!(fe.terminating_backends.is_empty(), "under the fallback they are the backends");
    assert_eq!(desired.stats.frontends_terminating_fallback, 1);
    assert_eq!(desired.stats.frontends_without_backends, 0);

    // Nothing serves any more: no backend (connections are rejected), and no fallback flag.
    let gone = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.2.9", "kind-worker2", TERMINATING_NOT_SERVING),
            pod("10.244.1.18", "kind-worker", NOT_READY),
        ],
    );
    let desired = build_ok(&[&checkout(""), &gone]);
    let fe = checkout_frontend(&desired);
    assert!(fe.backends.is_empty());
    assert!(!fe.terminating_fallback);
    assert!(fe.terminating_backends.is_empty());
    assert_eq!(desired.stats.frontends_without_backends, 1);
}

#[test]
fn terminating_backends_follow_conditions_and_policy() {
    let endpoints = [
        pod("10.244.1.17", "kind-worker", READY),
        pod("10.244.1.20", "kind-worker", TERMINATING),
        pod("10.244.2.3", "kind-worker2", TERMINATING),
        pod("10.244.2.9", "kind-worker2", TERMINATING_NOT_SERVING),
        pod("10.244.2.4", "kind-worker2", "{ready: true, serving: true, terminating: true}"),
    ];
    let slice = checkout_slice("checkout-7wq2d", None, &endpoints);
    let desired = build_ok(&[&checkout(""), &slice]);
    let fe = checkout_frontend(&desired);
    // Ready wins, even when terminating: such an endpoint is a backend, never in both lists.
    assert_eq!(fe.backends, at_8080(&["10.244.1.17", "10.244.2.4"]));
    assert_eq!(fe.terminating_backends, at_8080(&["10.244.1.20", "10.244.2.3"]));
    assert!(fe.backends.iter().all(|b| !fe.terminating_backends.contains(b)));

    // internalTrafficPolicy: Local keeps only this node's terminating endpoints too.
    let local = checkout("  internalTrafficPolicy: Local\n  sessionAffinity: None\n");
    let desired = build_opts(&[&local, &slice], &on_node("kind-worker"));
    let fe = checkout_frontend(&desired);
    assert_eq!(fe.backends, at_8080(&["10.244.1.17"]));
    assert_eq!(fe.terminating_backends, at_8080(&["10.244.1.20"]));
}

#[test]
fn an_endpoint_in_several_slices_prefers_its_ready_copy() {
    // During a slice rebalance the same pod can be listed twice, once stale.
    let stale = checkout_slice("checkout-7wq2d", None, &[pod("10.244.1.17", "kind-worker", NOT_READY)]);
    let fresh = checkout_slice("checkout-k2m9x", None, &[pod("10.244.1.17", "kind-worker", READY)]);
    let terminating =
        checkout_slice("checkout-z8p4f", None, &[pod("10.244.1.17", "kind-worker", TERMINATING)]);
    for docs in [
        [checkout(""), stale.clone(), fresh.clone(), terminating.clone()],
        [terminating.clone(), fresh.clone(), stale.clone(), checkout("")],
    ] {
        let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
        let desired = build_ok(&docs);
        let fe = checkout_frontend(&desired);
        assert_eq!(fe.backends, at_8080(&["10.244.1.17"]));
        assert!(!fe.terminating_fallback);
        assert_eq!(desired.stats.endpoints_ready, 1);
        assert_eq!(desired.stats.endpoints_terminating + desired.stats.endpoints_not_ready, 0);
    }
    // Without a ready copy, the serving-and-terminating copy beats the not-ready one.
    for docs in [[checkout(""), stale.clone(), terminating.clone()], [checkout(""), terminating, stale]] {
        let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
        let desired = build_ok(&docs);
        let fe = checkout_frontend(&desired);
        assert_eq!(fe.backends, at_8080(&["10.244.1.17"]));
        assert!(fe.terminating_fallback);
        assert_eq!(desired.stats.endpoints_terminating, 1);
    }
}

#[test]
fn publish_not_ready_addresses_is_left_to_the_endpoint_slice_controller() {
    let slice = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.1.17", "kind-worker", NOT_READY),
            pod("10.244.2.8", "kind-worker2", TERMINATING_NOT_SERVING),
            pod("10.244.2.9", "kind-worker2", "{ready: false}"),
        ],
    );
    // The controller writes a publishNotReadyAddresses Service's endpoints as ready; a slice that says
    // `ready: false` anyway is believed, as kube-proxy believes it (it never reads the flag).
    for svc in [
        checkout("  publishNotReadyAddresses: true\n  sessionAffinity: None\n"),
        checkout("  publishNotReadyAddresses: false\n"),
    ] {
        let desired = build_ok(&[&svc, &slice]);
        let fe = checkout_frontend(&desired);
        assert!(fe.backends.is_empty(), "{svc}");
        assert_eq!(desired.stats.endpoints_ready, 0);
    }
}

#[test]
fn internal_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let slice = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.1.17", "kind-worker", READY),
            pod("10.244.1.18", "kind-worker", TERMINATING),
            pod("10.244.2.8", "kind-worker2", READY),
            pod("10.244.3.4", "", READY),
        ],
    );
    let local = checkout("  internalTrafficPolicy: Local\n  sessionAffinity: None\n");

    // Without a node name nothing is local: the VIP is known but has no backend.
    let desired = build_ok(&[&local, &slice]);
    let fe = checkout_frontend(&desired);
    assert!(fe.local_only);
    assert!(fe.backends.is_empty());
    assert!(!fe.terminating_fallback);
    let empty_name = ModelOptions { node_name: Some(String::new()), ..Default::default() };
    assert!(checkout_frontend(&build_opts(&[&local, &slice], &empty_name)).backends.is_empty());

    let desired = build_opts(&[&local, &slice], &on_node("kind-worker"));
    assert_eq!(checkout_frontend(&desired).backends, at_8080(&["10.244.1.17"]));
    let desired = build_opts(&[&local, &slice], &on_node("kind-worker2"));
    assert_eq!(checkout_frontend(&desired).backends, at_8080(&["10.244.2.8"]));
    let desired = build_opts(&[&local, &slice], &on_node("kind-control-plane"));
    assert!(checkout_frontend(&desired).backends.is_empty());

    // Cluster (explicit or absent) ignores the node.
    let cluster = checkout("");
    let desired = build_opts(&[&cluster, &slice], &on_node("kind-worker"));
    let fe = checkout_frontend(&desired);
    assert!(!fe.local_only);
    assert_eq!(fe.backends, at_8080(&["10.244.1.17", "10.244.2.8", "10.244.3.4"]));
    let absent = checkout("  sessionAffinity: None\n");
    assert_eq!(checkout_frontend(&build_ok(&[&absent, &slice])).backends.len(), 3);
}

/// An endpoint with topology hints (`for_nodes`, `for_zones`: empty for none).
fn hinted(addr: &str, node: &str, conditions: &str, for_nodes: &[&str], for_zones: &[&str]) -> String {
    let list = |names: &[&str]| names.iter().map(|n| format!("{{name: {n}}}")).collect::<Vec<_>>().join(", ");
    let mut hints = String::new();
    if !for_nodes.is_empty() || !for_zones.is_empty() {
        hints.push_str("  hints:\n");
        if !for_nodes.is_empty() {
            hints.push_str(&format!("    forNodes: [{}]\n", list(for_nodes)));
        }
        if !for_zones.is_empty() {
            hints.push_str(&format!("    forZones: [{}]\n", list(for_zones)));
        }
    }
    format!("{}{hints}", pod(addr, node, conditions))
}

fn on_node_in_zone(node: &str, zone: &str) -> ModelOptions {
    ModelOptions { node_name: Some(node.into()), zone: Some(zone.into()), ..Default::default() }
}

#[test]
fn topology_hints_as_kube_proxy_follows_them() {
    // Three pods on three nodes in two zones, hinted as the EndpointSlice controller would for
    // trafficDistribution: PreferSameNode (node and zone hints on every endpoint).
    let endpoints = [
        hinted("10.244.1.17", "kind-worker", READY, &["kind-worker"], &["zone-a"]),
        hinted("10.244.2.8", "kind-worker2", READY, &["kind-worker2"], &["zone-a"]),
        hinted("10.244.3.4", "kind-worker3", READY, &["kind-worker3"], &["zone-b"]),
    ];
    let slice = checkout_slice("checkout-7wq2d", None, &endpoints);
    let svc = checkout("");
    let options = on_node_in_zone("kind-worker", "zone-a");
    let fe = checkout_frontend(&build_opts(&[&svc, &slice], &options)).clone();
    assert_eq!(fe.backends, at_8080(&["10.244.1.17"]));
    assert_eq!(fe.topology, Topology::SameNode);

    // A node no endpoint is hinted for falls back to its zone's, and a zone none is hinted for to all.
    let fe = checkout_frontend(&build_opts(&[&svc, &slice], &on_node_in_zone("kind-cp", "zone-b"))).clone();
    assert_eq!((fe.backends, fe.topology), (at_8080(&["10.244.3.4"]), Topology::SameZone));
    let fe = checkout_frontend(&build_opts(&[&svc, &slice], &on_node_in_zone("kind-cp", "zone-c"))).clone();
    assert_eq!((fe.backends.len(), fe.topology), (3, Topology::All));
    // No zone known (no label, no flag): zone hints are not followed.
    let fe = checkout_frontend(&build_opts(&[&svc, &slice], &on_node("kind-cp"))).clone();
    assert_eq!((fe.backends.len(), fe.topology), (3, Topology::All));

    // Zone hints alone (PreferClose / PreferSameZone, or the topology-aware-hints annotation).
    let zoned = [
        hinted("10.244.1.17", "kind-worker", READY, &[], &["zone-a"]),
        hinted("10.244.2.8", "kind-worker2", READY, &[], &["zone-a"]),
        hinted("10.244.3.4", "kind-worker3", READY, &[], &["zone-b"]),
    ];
    let zoned_slice = checkout_slice("checkout-7wq2d", None, &zoned);
    let fe = checkout_frontend(&build_opts(&[&svc, &zoned_slice], &options)).clone();
    assert_eq!((fe.backends, fe.topology), (at_8080(&["10.244.1.17", "10.244.2.8"]), Topology::SameZone));

    // One ready endpoint without a hint: every endpoint is used. A not-ready one without does not count.
    let mut partly = zoned.to_vec();
    partly.push(pod("10.244.3.9", "kind-worker3", READY));
    let fe = checkout_frontend(&build_opts(&[&svc, &checkout_slice("s", None, &partly)], &options)).clone();
    assert_eq!((fe.backends.len(), fe.topology), (4, Topology::All));
    let mut not_ready = zoned.to_vec();
    not_ready.push(pod("10.244.3.9", "kind-worker3", NOT_READY));
    let fe =
        checkout_frontend(&build_opts(&[&svc, &checkout_slice("s", None, &not_ready)], &options)).clone();
    assert_eq!(fe.topology, Topology::SameZone);

    // Local policy ignores hints; north-south Cluster entries follow them (kube-proxy's clusterEndpoints).
    let local = checkout("  internalTrafficPolicy: Local\n  sessionAffinity: None\n");
    let fe = checkout_frontend(&build_opts(&[&local, &zoned_slice], &options)).clone();
    assert_eq!((fe.backends, fe.topology), (at_8080(&["10.244.1.17"]), Topology::All));

    // The terminating fallback ignores topology: no ready endpoint at all.
    let draining = [
        hinted("10.244.2.8", "kind-worker2", TERMINATING, &[], &["zone-a"]),
        hinted("10.244.3.4", "kind-worker3", TERMINATING, &[], &["zone-b"]),
    ];
    let fe = checkout_frontend(&build_opts(&[&svc, &checkout_slice("s", None, &draining)], &options)).clone();
    assert_eq!((fe.backends.len(), fe.terminating_fallback, fe.topology), (2, true, Topology::All));

    let desired = build_opts(&[&svc, &slice], &options);
    assert_eq!(desired.stats.frontends_topology_same_node, 1);
    assert_eq!(desired.stats.frontends_topology_same_zone, 0);
}

#[test]
fn local_policy_without_local_endpoints_drops_when_the_service_has_endpoints_elsewhere() {
    let local = checkout("  internalTrafficPolicy: Local\n  sessionAffinity: None\n");
    let elsewhere = checkout_slice("checkout-7wq2d", None, &[pod("10.244.2.8", "kind-worker2", READY)]);
    let desired = build_opts(&[&local, &elsewhere], &on_node("kind-worker"));
    let fe = checkout_frontend(&desired);
    assert!(fe.backends.is_empty());
    assert!(fe.no_local_endpoints, "kube-proxy drops: \"has no local endpoints\"");
    assert_eq!(desired.stats.frontends_no_local_endpoints, 1);

    // A terminating endpoint elsewhere is usable elsewhere too (hasAnyEndpoints).
    let terminating =
        checkout_slice("checkout-7wq2d", None, &[pod("10.244.2.8", "kind-worker2", TERMINATING)]);
    assert!(
        checkout_frontend(&build_opts(&[&local, &terminating], &on_node("kind-worker"))).no_local_endpoints
    );

    // No usable endpoint anywhere: refused, as kube-proxy's "has no endpoints" REJECT.
    for endpoints in [vec![], vec![pod("10.244.2.8", "kind-worker2", NOT_READY)]] {
        let slice = checkout_slice("checkout-7wq2d", None, &endpoints);
        let fe = checkout_frontend(&build_opts(&[&local, &slice], &on_node("kind-worker"))).clone();
        assert!(fe.backends.is_empty() && !fe.no_local_endpoints);
    }
    // A local endpoint: used.
    let here = checkout_slice("checkout-7wq2d", None, &[pod("10.244.1.17", "kind-worker", READY)]);
    let fe = checkout_frontend(&build_opts(&[&local, &here], &on_node("kind-worker"))).clone();
    assert!(!fe.backends.is_empty() && !fe.no_local_endpoints);
    // Cluster policy never drops.
    let cluster = checkout_slice("checkout-7wq2d", None, &[pod("10.244.2.8", "kind-worker2", NOT_READY)]);
    assert!(
        !checkout_frontend(&build_opts(&[&checkout(""), &cluster], &on_node("kind-worker")))
            .no_local_endpoints
    );
}

#[test]
fn internal_traffic_policy_local_falls_back_to_local_terminating_endpoints() {
    // The local pod is terminating while a remote one is ready: kube-proxy keeps traffic on the node
    // and uses the local terminating pod rather than the remote ready one.
    let slice = checkout_slice(
        "checkout-7wq2d",
        None,
        &[
            pod("10.244.1.17", "kind-worker", TERMINATING),
            pod("10.244.1.19", "kind-worker", TERMINATING_NOT_SERVING),
            pod("10.244.2.8", "kind-worker2", READY),
            pod("10.244.2.9", "kind-worker2", TERMINATING),
        ],
    );
    let local = checkout("  internalTrafficPolicy: Local\n");
    let desired = build_opts(&[&local, &slice], &on_node("kind-worker"));
    let fe = checkout_frontend(&desired);
    assert_eq!(fe.backends, at_8080(&["10.244.1.17"]));
    assert!(fe.terminating_fallback);
    assert!(fe.local_only);
    let desired = build_opts(&[&local, &slice], &on_node("kind-worker2"));
    let fe = checkout_frontend(&desired);
    assert_eq!(fe.backends, at_8080(&["10.244.2.8"]));
    assert!(!fe.terminating_fallback);
}

#[test]
fn unknown_internal_traffic_policy_is_reported_and_cluster_is_used() {
    let svc = checkout("  internalTrafficPolicy: local\n");
    let slice = checkout_slice("checkout-7wq2d", None, &[pod("10.244.2.8", "kind-worker2", READY)]);
    let objects = parse(&[&svc, &slice]);
    let (desired, errors) = build_with(&objects.services, &objects.slices, &on_node("kind-worker"));
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(
        errors[0].to_string(),
        "test-0.yaml: Service shop/checkout: spec.internalTrafficPolicy: internalTrafficPolicy \"local\" is not Cluster or Local; Cluster is used"
    );
    let fe = checkout_frontend(&desired);
    assert!(!fe.local_only);
    assert_eq!(fe.backends, at_8080(&["10.244.2.8"]));
}

#[test]
fn client_ip_affinity_timeout_default_custom_and_invalid() {
    let affinity = |lines: &str| checkout(&format!("  internalTrafficPolicy: Cluster\n{lines}"));
    // What the API server stores for `sessionAffinity: ClientIP` without a config.
    let defaulted = affinity(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 10800\n",
    );
    // A manifest that leaves the config out.
    let bare = affinity("  sessionAffinity: ClientIP\n");
    let empty_config = affinity("  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP: {}\n");
    for svc in [&defaulted, &bare, &empty_config] {
        let fe = checkout_frontend(&build_ok(&[svc])).clone();
        assert_eq!(fe.session_affinity_timeout, Some(10800), "{svc}");
    }
    let e2e = affinity(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 125\n",
    );
    assert_eq!(checkout_frontend(&build_ok(&[&e2e])).session_affinity_timeout, Some(125));
    for seconds in [1, 86400] {
        let svc = affinity(&format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {seconds}\n"
        ));
        assert_eq!(checkout_frontend(&build_ok(&[&svc])).session_affinity_timeout, Some(seconds));
    }

    for seconds in ["0", "86401", "-5", "2147483647"] {
        let svc = affinity(&format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {seconds}\n"
        ));
        let (desired, errors) = build_from(&[&svc]);
        assert_eq!(checkout_frontend(&desired).session_affinity_timeout, Some(10800), "{seconds}");
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert_eq!(errors[0].object.as_deref(), Some("Service shop/checkout"));
        assert_eq!(errors[0].field.as_deref(), Some("spec.sessionAffinityConfig.clientIP.timeoutSeconds"));
        assert_eq!(errors[0].message, format!("timeoutSeconds {seconds} is not in 1-86400; 10800 is used"));
    }

    // No affinity: None, absent, or a config left over after switching back to None.
    let leftover = affinity(
        "  sessionAffinity: None\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 0\n",
    );
    for svc in [checkout(""), checkout("  internalTrafficPolicy: Cluster\n"), leftover] {
        assert_eq!(checkout_frontend(&build_ok(&[&svc])).session_affinity_timeout, None);
    }
    let cookie = affinity("  sessionAffinity: Cookie\n");
    let (desired, errors) = build_from(&[&cookie]);
    assert_eq!(checkout_frontend(&desired).session_affinity_timeout, None);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field.as_deref(), Some("spec.sessionAffinity"));
}

#[test]
fn affinity_and_policy_apply_to_every_frontend_of_the_service() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, 10.96.12.8]\n  internalTrafficPolicy: Local\n  ports:\n  - name: http\n    port: 80\n  - name: dns\n    port: 53\n    protocol: UDP\n  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 600\n",
    );
    let desired = build_ok(&[&svc, KUBE_DNS]);
    assert_eq!(desired.frontends.len(), 7);
    for fe in &desired.frontends {
        let ours = fe.service.name == "web";
        assert_eq!(fe.session_affinity_timeout, ours.then_some(600), "{fe:?}");
        assert_eq!(fe.local_only, ours, "{fe:?}");
    }
}

#[test]
fn service_proxy_name_selects_the_services_to_program() {
    let unlabelled = checkout("");
    let ours = checkout_labelled("", "    service.kubernetes.io/service-proxy-name: kproxy\n")
        .replace("checkout", "cart")
        .replace("10.96.88.14", "10.96.88.15");
    let theirs = checkout_labelled("", "    service.kubernetes.io/service-proxy-name: cilium\n")
        .replace("checkout", "search")
        .replace("10.96.88.14", "10.96.88.16");
    let headless_ours = checkout_labelled(
        "",
        "    service.kubernetes.io/headless: \"\"\n    service.kubernetes.io/service-proxy-name: kproxy\n",
    )
    .replace("checkout", "pods")
    .replace("10.96.88.14", "10.96.88.17");
    let endpoints = [pod("10.244.1.17", "kind-worker", READY)];
    let checkout_eps = checkout_slice("checkout-7wq2d", None, &endpoints);
    let cart_eps = checkout_slice_labelled(
        "cart-b5n2w",
        None,
        "    service.kubernetes.io/service-proxy-name: kproxy\n",
        &endpoints,
    )
    .replace("service-name: checkout", "service-name: cart");
    // Hand-written: no proxy-name label on the slice; its Service decides.
    let cart_manual = checkout_slice("cart-manual", None, &[pod("10.244.2.8", "kind-worker2", READY)])
        .replace("service-name: checkout", "service-name: cart");
    let search_eps = checkout_slice("search-q1w2e", None, &endpoints)
        .replace("service-name: checkout", "service-name: search");
    let docs = [
        unlabelled.as_str(),
        &ours,
        &theirs,
        &headless_ours,
        &checkout_eps,
        &cart_eps,
        &cart_manual,
        &search_eps,
    ];
    let names = |desired: &Desired| -> Vec<String> {
        desired.frontends.iter().map(|f| f.service.name.clone()).collect()
    };

    // Default proxy: only Services without the label.
    let desired = build_opts(&docs, &ModelOptions::default());
    assert_eq!(names(&desired), ["checkout"]);
    assert_eq!(desired.stats.services_skipped_other_proxy, 2);
    assert_eq!(desired.stats.services_skipped_headless, 1);
    let empty = ModelOptions { service_proxy_name: Some(String::new()), ..Default::default() };
    assert_eq!(build_opts(&docs, &empty), desired);

    // Named proxy: only the Services labelled with that name (headless ones still skipped).
    let kproxy = ModelOptions { service_proxy_name: Some("kproxy".into()), ..Default::default() };
    let desired = build_opts(&docs, &kproxy);
    assert_eq!(names(&desired), ["cart"]);
    assert_eq!(
        frontend(&desired, "10.96.88.15", 80, Protocol::Tcp).backends,
        at_8080(&["10.244.1.17", "10.244.2.8"])
    );
    assert_eq!(desired.stats.services_skipped_other_proxy, 2);
    assert_eq!(desired.stats.services_programmed, 1);

    let cilium = ModelOptions { service_proxy_name: Some("cilium".into()), ..Default::default() };
    let desired = build_opts(&docs, &cilium);
    assert_eq!(names(&desired), ["search"]);
    assert_eq!(frontend(&desired, "10.96.88.16", 80, Protocol::Tcp).backends, at_8080(&["10.244.1.17"]));

    let nobody = ModelOptions { service_proxy_name: Some("kube-router".into()), ..Default::default() };
    let desired = build_opts(&docs, &nobody);
    assert!(desired.frontends.is_empty());
    assert_eq!(desired.stats.services_skipped_other_proxy, 3);
}

#[test]
fn a_slice_labelled_for_another_proxy_is_ignored_under_a_proxy_name() {
    let svc = checkout_labelled("", "    service.kubernetes.io/service-proxy-name: kproxy\n");
    let mislabelled = checkout_slice_labelled(
        "checkout-7wq2d",
        None,
        "    service.kubernetes.io/service-proxy-name: cilium\n",
        &[pod("10.244.1.17", "kind-worker", READY)],
    );
    let kproxy = ModelOptions { service_proxy_name: Some("kproxy".into()), ..Default::default() };
    let desired = build_opts(&[&svc, &mislabelled], &kproxy);
    assert!(checkout_frontend(&desired).backends.is_empty());
}

#[test]
fn trigger_times_keep_the_newest_per_service() {
    let checkout_a = checkout_slice(
        "checkout-7wq2d",
        Some("2025-03-02T10:16:03Z"),
        &[pod("10.244.1.17", "kind-worker", READY)],
    );
    // Newer than 10:16:03Z although it sorts before it as a string ('.' < 'Z').
    let checkout_b = checkout_slice(
        "checkout-k2m9x",
        Some("2025-03-02T10:16:03.5Z"),
        &[pod("10.244.2.8", "kind-worker2", READY)],
    );
    let checkout_c = checkout_slice(
        "checkout-z8p4f",
        Some("2025-03-02T10:16:03.25Z"),
        &[pod("10.244.2.9", "kind-worker2", READY)],
    );
    let kube_dns_a = KUBE_DNS_SLICE_A.replace(
        "  generateName: kube-dns-\n",
        "  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"2025-03-01T08:00:00Z\"\n  generateName: kube-dns-\n",
    );
    let (svc, a, b, c) = (checkout(""), &checkout_a, &checkout_b, &checkout_c);
    for docs in [
        [svc.as_str(), a, b, c, KUBE_DNS, &kube_dns_a, KUBE_DNS_SLICE_B],
        [c, KUBE_DNS_SLICE_B, &kube_dns_a, b, KUBE_DNS, a, svc.as_str()],
    ] {
        let objects = parse(&docs);
        let (desired, errors) = build(&objects.services, &objects.slices);
        assert!(errors.is_empty(), "{errors:#?}");
        assert_eq!(
            desired.trigger_times,
            [
                (
                    ServiceName { namespace: "kube-system".into(), name: "kube-dns".into() },
                    "2025-03-01T08:00:00Z".to_string()
                ),
                (
                    ServiceName { namespace: "shop".into(), name: "checkout".into() },
                    "2025-03-02T10:16:03.5Z".to_string()
                ),
            ]
        );
    }

    // Slices without the annotation give no entry; nor do Services kproxy does not program.
    let desired = build_ok(&[KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_B]);
    assert!(desired.trigger_times.is_empty());
    let other = checkout_labelled("", "    service.kubernetes.io/service-proxy-name: cilium\n");
    assert!(build_ok(&[&other, &checkout_a]).trigger_times.is_empty());
    // A Service without any frontend yet (no port) still gets its trigger time.
    let no_ports = checkout("")
        .replace("  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: http\n", "");
    let desired = build_ok(&[&no_ports, &checkout_a]);
    assert!(desired.frontends.is_empty());
    assert_eq!(desired.trigger_times.len(), 1);
}

#[test]
fn an_invalid_trigger_time_is_reported_and_ignored() {
    let good = checkout_slice(
        "checkout-7wq2d",
        Some("2025-03-02T10:16:03+01:00"),
        &[pod("10.244.1.17", "kind-worker", READY)],
    );
    let bad =
        checkout_slice("checkout-k2m9x", Some("yesterday"), &[pod("10.244.2.8", "kind-worker2", READY)]);
    let (desired, errors) = build_from(&[&checkout(""), &good, &bad]);
    assert_eq!(
        desired.trigger_times,
        [(
            ServiceName { namespace: "shop".into(), name: "checkout".into() },
            "2025-03-02T10:16:03+01:00".into()
        )]
    );
    assert_eq!(checkout_frontend(&desired).backends, at_8080(&["10.244.1.17", "10.244.2.8"]));
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].origin, "test-2.yaml");
    assert_eq!(errors[0].object.as_deref(), Some("EndpointSlice shop/checkout-k2m9x"));
    assert_eq!(
        errors[0].field.as_deref(),
        Some("metadata.annotations[endpoints.kubernetes.io/last-change-trigger-time]")
    );
    assert!(errors[0].message.starts_with("\"yesterday\" is not an RFC 3339 time"), "{}", errors[0].message);
}

#[test]
fn stats_count_services_frontends_and_endpoints() {
    let external = "apiVersion: v1\nkind: Service\nmetadata:\n  name: search\n  namespace: shop\nspec:\n  type: ExternalName\n  externalName: search.example.com\n";
    let headless = web("  clusterIP: None\n  ports:\n  - port: 80\n");
    let other = checkout_labelled("", "    service.kubernetes.io/service-proxy-name: cilium\n")
        .replace("checkout", "cart")
        .replace("10.96.88.14", "10.96.88.15");
    let slice = checkout_slice(
        "checkout-7wq2d",
        None,
        &[pod("10.244.1.17", "kind-worker", TERMINATING), pod("10.244.1.18", "kind-worker", NOT_READY)],
    );
    let desired = build_ok(&[
        KUBE_DNS,
        KUBE_DNS_SLICE_A,
        KUBE_DNS_SLICE_B,
        &checkout(""),
        &slice,
        external,
        &headless,
        &other,
    ]);
    assert_eq!(
        desired.stats,
        ModelStats {
            services_seen: 5,
            services_programmed: 2,
            services_skipped_headless: 1,
            services_skipped_external_name: 1,
            services_skipped_other_proxy: 1,
            frontends: 4,
            frontends_without_backends: 0,
            frontends_terminating_fallback: 1,
            // kube-dns: .0.12, .0.13, .1.9 ready (.0.12 listed twice), .2.4 terminating; checkout: one
            // terminating, one not ready.
            endpoints_ready: 3,
            endpoints_terminating: 2,
            endpoints_not_ready: 1,
            ..Default::default()
        }
    );
}

#[test]
fn build_is_build_with_default_options() {
    let docs = [KUBE_DNS, KUBE_DNS_SLICE_A, KUBE_DNS_SLICE_B];
    let objects = parse(&docs);
    let default = build(&objects.services, &objects.slices);
    assert_eq!(build_with(&objects.services, &objects.slices, &ModelOptions::default()), default);
    // A node name alone changes nothing for Cluster policy.
    assert_eq!(build_with(&objects.services, &objects.slices, &on_node("kind-worker")), default);
}

#[test]
fn constructors_for_callers() {
    let service = ServiceName { namespace: "default".into(), name: "web".into() };
    let backends = at_8080(&["10.244.1.5"]);
    let fe = Frontend::new(
        service.clone(),
        "http",
        Ipv4Addr::new(10, 96, 0, 20),
        80,
        Protocol::Tcp,
        backends.clone(),
    );
    assert_eq!(
        fe,
        Frontend {
            service,
            port_name: "http".into(),
            vip: Ipv4Addr::new(10, 96, 0, 20).into(),
            port: 80,
            proto: Protocol::Tcp,
            backends,
            session_affinity_timeout: None,
            local_only: false,
            terminating_fallback: false,
            terminating_backends: vec![],
            kind: FrontendKind::ClusterIp,
            scope: Scope::Internal,
            external_local: false,
            source_ranges: vec![],
            no_local_endpoints: false,
            topology: Topology::All,
        }
    );
    let mut other = fe.clone();
    other.vip = Ipv4Addr::new(10, 96, 0, 10).into();
    let desired = Desired::new(vec![fe.clone(), other.clone()]);
    assert_eq!(desired.frontends, [other, fe]);
    assert_eq!(desired.stats, ModelStats::default());
    assert!(desired.trigger_times.is_empty());
}

// ---- north–south frontends: node ports, external IPs, load-balancer IPs, health checks ----

/// `kind vip:port/proto scope` of every entry, in order.
fn entries(desired: &Desired) -> Vec<String> {
    desired
        .frontends
        .iter()
        .map(|f| format!("{} {}:{}/{} {:?}", f.kind, f.vip, f.port, f.proto, f.scope))
        .collect()
}

fn entry<'a>(desired: &'a Desired, vip: &str, port: u16, proto: Protocol, scope: Scope) -> &'a Frontend {
    let vip: Ipv4Addr = vip.parse().unwrap();
    desired
        .frontends
        .iter()
        .find(|f| f.vip == vip && f.port == port && f.proto == proto && f.scope == scope)
        .unwrap_or_else(|| panic!("no {scope:?} entry {vip}:{port}/{proto} in {desired:#?}"))
}

/// Options for node `kind-worker` with these node addresses.
fn on_worker(addresses: &[&str]) -> ModelOptions {
    ModelOptions {
        node_name: Some("kind-worker".into()),
        node_addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
        ..Default::default()
    }
}

fn build_opts_from(docs: &[&str], options: &ModelOptions) -> (Desired, Vec<ManifestError>) {
    let objects = parse(docs);
    build_with(&objects.services, &objects.slices, options)
}

/// `(field, message)` of each error, after checking it names `Service shop/web`.
fn web_errors(errors: &[ManifestError]) -> Vec<(String, String)> {
    errors
        .iter()
        .map(|e| {
            assert_eq!(e.object.as_deref(), Some("Service shop/web"), "{e}");
            (e.field.clone().unwrap_or_default(), e.message.clone())
        })
        .collect()
}

/// An EndpointSlice of `shop/web` with port `http` 8080/TCP and these (address, node, conditions).
fn web_endpoints(name: &str, endpoints: &[(&str, &str, &str)]) -> String {
    let mut body = String::from("endpoints:\n");
    for (addr, node, conditions) in endpoints {
        body.push_str(&format!("- addresses: [{addr}]\n  conditions: {conditions}\n  nodeName: {node}\n"));
    }
    body.push_str("ports:\n- name: http\n  port: 8080\n  protocol: TCP\n");
    web_slice(name, &body)
}

/// A LoadBalancer `shop/web` (port http 80, nodePort 30080) with the given extra spec lines and an
/// ingress IP 198.51.100.10.
fn load_balancer(spec_extra: &str) -> String {
    web(&format!(
        "  type: LoadBalancer\n  clusterIP: 10.96.12.7\n{spec_extra}  ports:\n  - name: http\n    port: 80\n    nodePort: 30080\nstatus:\n  loadBalancer:\n    ingress:\n    - ip: 198.51.100.10\n"
    ))
}

#[test]
fn node_ports_answer_on_every_node_address_for_each_protocol() {
    let svc = web(
        "  type: NodePort\n  clusterIP: 10.96.12.7\n  internalTrafficPolicy: Local\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n    nodePort: 30053\n  - name: dns-tcp\n    port: 53\n    protocol: TCP\n    nodePort: 30053\n  - name: http\n    port: 80\n",
    );
    let slice = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.5]\n  nodeName: kind-worker\n- addresses: [10.244.2.5]\n  nodeName: kind-worker2\nports:\n- name: dns\n  port: 5353\n  protocol: UDP\n- name: dns-tcp\n  port: 5353\n  protocol: TCP\n",
    );
    // A repeated node address is one address.
    let options = on_worker(&["192.168.1.10", "10.0.0.5", "192.168.1.10"]);
    let desired = build_opts(&[&svc, &slice], &options);
    assert_eq!(
        entries(&desired),
        [
            "NodePort 10.0.0.5:30053/TCP Internal",
            "NodePort 10.0.0.5:30053/UDP Internal",
            "ClusterIP 10.96.12.7:53/TCP Internal",
            "ClusterIP 10.96.12.7:53/UDP Internal",
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "NodePort 192.168.1.10:30053/TCP Internal",
            "NodePort 192.168.1.10:30053/UDP Internal",
        ]
    );
    // The cluster IP honours internalTrafficPolicy: Local; node ports use every endpoint.
    let cluster_ip = entry(&desired, "10.96.12.7", 53, Protocol::Udp, Scope::Internal);
    assert_eq!(cluster_ip.backends, backends(&[("10.244.1.5", 5353)]));
    assert!(cluster_ip.local_only);
    for vip in ["10.0.0.5", "192.168.1.10"] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let fe = entry(&desired, vip, 30053, proto, Scope::Internal);
            assert_eq!(fe.backends, backends(&[("10.244.1.5", 5353), ("10.244.2.5", 5353)]));
            assert_eq!(fe.port_name, if proto == Protocol::Tcp { "dns-tcp" } else { "dns" });
            assert!(!fe.local_only && !fe.external_local && fe.source_ranges.is_empty());
        }
    }
    assert_eq!(desired.stats.frontends, 7);
    assert_eq!(desired.stats.services_programmed, 1);

    // No node address: no NodePort frontend.
    let desired = build_opts(&[&svc, &slice], &on_node("kind-worker"));
    assert!(desired.frontends.iter().all(|f| f.kind == FrontendKind::ClusterIp));

    // A nodePort on a ClusterIP Service is not a node port (the API server refuses it anyway).
    let cluster_ip_only = svc.replace("type: NodePort", "type: ClusterIP");
    let desired = build_opts(&[&cluster_ip_only, &slice], &options);
    assert_eq!(desired.frontends.len(), 3);
}

#[test]
fn a_port_without_node_port_has_no_node_port_frontend() {
    // allocateLoadBalancerNodePorts: false leaves the nodePorts out; that is legal.
    let svc = web(
        "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n  - name: admin\n    port: 81\n    nodePort: 0\n",
    );
    let desired = build_opts(&[&svc], &on_worker(&["192.168.1.10"]));
    assert_eq!(
        entries(&desired),
        ["ClusterIP 10.96.12.7:80/TCP Internal", "ClusterIP 10.96.12.7:81/TCP Internal"]
    );
}

#[test]
fn out_of_range_node_port_is_reported_and_the_port_keeps_its_cluster_ip() {
    let svc = web(
        "  type: NodePort\n  clusterIP: 10.96.12.7\n  ports:\n  - name: a\n    port: 80\n    nodePort: 70000\n  - name: b\n    port: 81\n    nodePort: -1\n  - name: c\n    port: 82\n    nodePort: 30082\n",
    );
    let (desired, errors) = build_opts_from(&[&svc], &on_worker(&["192.168.1.10"]));
    assert_eq!(
        entries(&desired),
        [
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "ClusterIP 10.96.12.7:81/TCP Internal",
            "ClusterIP 10.96.12.7:82/TCP Internal",
            "NodePort 192.168.1.10:30082/TCP Internal",
        ]
    );
    assert_eq!(
        errors[0].to_string(),
        "test-0.yaml: Service shop/web: spec.ports[0].nodePort: nodePort 70000 is not in 1-65535; no NodePort is programmed for the port"
    );
    let fields: Vec<_> = web_errors(&errors).into_iter().map(|(field, _)| field).collect();
    assert_eq!(fields, ["spec.ports[0].nodePort", "spec.ports[1].nodePort"]);
}

#[test]
fn external_traffic_policy_local_adds_an_external_entry_with_this_nodes_endpoints() {
    let svc = load_balancer("  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n");
    let slice = web_endpoints(
        "web-x1",
        &[
            ("10.244.1.5", "kind-worker", READY),
            ("10.244.1.6", "kind-worker", TERMINATING),
            ("10.244.2.5", "kind-worker2", READY),
            ("10.244.2.6", "kind-worker2", TERMINATING),
        ],
    );
    let desired = build_opts(&[&svc, &slice], &on_worker(&["192.168.1.10"]));
    assert_eq!(
        entries(&desired),
        [
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "NodePort 192.168.1.10:30080/TCP Internal",
            "NodePort 192.168.1.10:30080/TCP External",
            "LoadBalancer 198.51.100.10:80/TCP Internal",
            "LoadBalancer 198.51.100.10:80/TCP External",
        ]
    );
    let cluster_ip = entry(&desired, "10.96.12.7", 80, Protocol::Tcp, Scope::Internal);
    assert!(!cluster_ip.external_local, "the policy is about external addresses only");
    for (vip, port) in [("192.168.1.10", 30080), ("198.51.100.10", 80)] {
        let internal = entry(&desired, vip, port, Protocol::Tcp, Scope::Internal);
        assert_eq!(internal.backends, at_8080(&["10.244.1.5", "10.244.2.5"]));
        assert_eq!(internal.terminating_backends, at_8080(&["10.244.1.6", "10.244.2.6"]));
        assert!(internal.external_local && !internal.local_only);
        let external = entry(&desired, vip, port, Protocol::Tcp, Scope::External);
        assert_eq!(external.backends, at_8080(&["10.244.1.5"]));
        assert_eq!(external.terminating_backends, at_8080(&["10.244.1.6"]));
        assert!(external.external_local && external.local_only && !external.terminating_fallback);
    }
    assert_eq!(desired.stats.frontends, 5);

    // This node's pods are terminating while others are ready: external clients stay on the node and
    // use the local terminating pod; internal ones use the ready pods elsewhere.
    let slice = web_endpoints(
        "web-x1",
        &[
            ("10.244.1.6", "kind-worker", TERMINATING),
            ("10.244.1.7", "kind-worker", TERMINATING_NOT_SERVING),
            ("10.244.2.5", "kind-worker2", READY),
        ],
    );
    let desired = build_opts(&[&svc, &slice], &on_worker(&["192.168.1.10"]));
    let internal = entry(&desired, "198.51.100.10", 80, Protocol::Tcp, Scope::Internal);
    assert_eq!(internal.backends, at_8080(&["10.244.2.5"]));
    assert_eq!(internal.terminating_backends, at_8080(&["10.244.1.6"]));
    let external = entry(&desired, "198.51.100.10", 80, Protocol::Tcp, Scope::External);
    assert_eq!(external.backends, at_8080(&["10.244.1.6"]));
    assert!(external.terminating_fallback);
    assert!(external.terminating_backends.is_empty());

    // No endpoint on this node (or no node name): the external entry exists, without backends.
    for options in
        [on_worker(&["192.168.1.10"]), ModelOptions { node_name: None, ..on_worker(&["192.168.1.10"]) }]
    {
        let remote = web_endpoints("web-x1", &[("10.244.2.5", "kind-worker2", READY)]);
        let desired = build_opts(&[&svc, &remote], &options);
        assert!(entry(&desired, "192.168.1.10", 30080, Protocol::Tcp, Scope::External).backends.is_empty());
        assert_eq!(desired.stats.frontends_without_backends, 2);
    }

    // Cluster (explicit or absent): only the internal entries, which external clients use as well.
    for policy in ["  externalTrafficPolicy: Cluster\n", ""] {
        let desired = build_opts(&[&load_balancer(policy), &slice], &on_worker(&["192.168.1.10"]));
        assert!(desired.frontends.iter().all(|f| f.scope == Scope::Internal && !f.external_local));
        assert_eq!(desired.frontends.len(), 3);
    }
}

#[test]
fn unknown_external_traffic_policy_is_reported_and_cluster_is_used() {
    let svc = load_balancer("  externalTrafficPolicy: local\n  healthCheckNodePort: 32100\n");
    let (desired, errors) = build_opts_from(&[&svc], &on_worker(&["192.168.1.10"]));
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(
        errors[0].to_string(),
        "test-0.yaml: Service shop/web: spec.externalTrafficPolicy: externalTrafficPolicy \"local\" is not Cluster or Local; Cluster is used"
    );
    assert!(desired.frontends.iter().all(|f| f.scope == Scope::Internal && !f.external_local));
    assert!(desired.health_checks.is_empty(), "only Local Services are health-checked");
}

#[test]
fn external_ips_answer_on_the_service_port_and_bad_ones_are_reported() {
    let svc = web(
        "  clusterIP: 10.96.12.7\n  externalIPs: [203.0.113.7, \"fd00::7\", bogus, 127.0.0.1, 203.0.113.8, 203.0.113.7, 224.0.0.1]\n  ports:\n  - name: http\n    port: 80\n  - name: dns\n    port: 53\n    protocol: UDP\n",
    );
    let (desired, errors) = build_opts_from(&[&svc], &ModelOptions::default());
    assert_eq!(
        entries(&desired),
        [
            "ClusterIP 10.96.12.7:53/UDP Internal",
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "ExternalIP 203.0.113.7:53/UDP Internal",
            "ExternalIP 203.0.113.7:80/TCP Internal",
            "ExternalIP 203.0.113.8:53/UDP Internal",
            "ExternalIP 203.0.113.8:80/TCP Internal",
        ]
    );
    assert_eq!(entry(&desired, "203.0.113.8", 53, Protocol::Udp, Scope::Internal).port_name, "dns");
    assert_eq!(
        web_errors(&errors),
        [
            ("spec.externalIPs[2]".to_string(), "\"bogus\" is not an IP address; it is skipped".to_string()),
            (
                "spec.externalIPs[3]".to_string(),
                "127.0.0.1 is a loopback address, not a usable external IP; it is skipped".to_string()
            ),
            (
                "spec.externalIPs[6]".to_string(),
                "224.0.0.1 is a multicast address, not a usable external IP; it is skipped".to_string()
            ),
        ]
    );

    // With externalTrafficPolicy: Local, on a ClusterIP Service too.
    let local = web(
        "  clusterIP: 10.96.12.7\n  externalTrafficPolicy: Local\n  externalIPs: [203.0.113.7]\n  ports:\n  - name: http\n    port: 80\n",
    );
    let slice = web_endpoints(
        "web-x1",
        &[("10.244.1.5", "kind-worker", READY), ("10.244.2.5", "kind-worker2", READY)],
    );
    let desired = build_opts(&[&local, &slice], &on_node("kind-worker"));
    assert_eq!(
        entry(&desired, "203.0.113.7", 80, Protocol::Tcp, Scope::External).backends,
        at_8080(&["10.244.1.5"])
    );
    assert_eq!(entry(&desired, "203.0.113.7", 80, Protocol::Tcp, Scope::Internal).backends.len(), 2);
}

#[test]
fn load_balancer_ingress_ips_skip_proxy_mode_hostnames_and_other_types() {
    let svc = web(
        "  type: LoadBalancer\n  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    nodePort: 30080\nstatus:\n  loadBalancer:\n    ingress:\n    - ip: 198.51.100.10\n    - ip: 198.51.100.11\n      ipMode: Proxy\n    - hostname: lb.example.com\n    - ip: 198.51.100.12\n      ipMode: VIP\n    - ip: \"2001:db8::1\"\n    - ip: 198.51.100.300\n    - ip: 0.0.0.0\n",
    );
    let (desired, errors) = build_opts_from(&[&svc], &ModelOptions::default());
    assert_eq!(
        entries(&desired),
        [
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "LoadBalancer 198.51.100.10:80/TCP Internal",
            "LoadBalancer 198.51.100.12:80/TCP Internal",
        ]
    );
    let fields: Vec<_> = web_errors(&errors).into_iter().map(|(field, _)| field).collect();
    assert_eq!(fields, ["status.loadBalancer.ingress[5].ip", "status.loadBalancer.ingress[6].ip"]);
    assert!(errors[1].message.contains("0.0.0.0 is the unspecified address"), "{}", errors[1].message);

    // A left-over status on a Service that is no longer a LoadBalancer is not programmed.
    let cluster_ip = svc.replace("type: LoadBalancer", "type: NodePort");
    let desired = build_opts(
        &[&cluster_ip.replace("    - ip: 198.51.100.300\n    - ip: 0.0.0.0\n", "")],
        &ModelOptions::default(),
    );
    assert!(desired.frontends.iter().all(|f| f.kind != FrontendKind::LoadBalancer), "{desired:#?}");
}

#[test]
fn source_ranges_apply_to_load_balancer_ips_only_and_bad_ones_are_reported() {
    let svc = load_balancer(
        "  externalIPs: [203.0.113.7]\n  loadBalancerSourceRanges:\n  - 10.0.0.0/8\n  - \" 192.168.0.0/16 \"\n  - 10.1.2.3/33\n  - nonsense\n  - 2001:db8::/32\n  - 172.16.5.4/12\n  - 10.0.0.0/8\n  - 10.9.8.7\n",
    );
    let (desired, errors) = build_opts_from(&[&svc], &on_worker(&["192.168.1.10"]));
    let ranges: Vec<String> = entry(&desired, "198.51.100.10", 80, Protocol::Tcp, Scope::Internal)
        .source_ranges
        .iter()
        .map(ToString::to_string)
        .collect();
    // 192.168.0.0/16 holds the node's address: the LB IP itself is admitted (kube-proxy's allowFromNode).
    assert_eq!(ranges, ["10.0.0.0/8", "10.9.8.7/32", "172.16.0.0/12", "192.168.0.0/16", "198.51.100.10/32"]);
    let (elsewhere, _) = build_opts_from(&[&svc], &on_worker(&["100.64.0.1"]));
    let ranges: Vec<String> = entry(&elsewhere, "198.51.100.10", 80, Protocol::Tcp, Scope::Internal)
        .source_ranges
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        ranges,
        ["10.0.0.0/8", "10.9.8.7/32", "172.16.0.0/12", "192.168.0.0/16"],
        "no range holds the node"
    );
    for fe in desired.frontends.iter().filter(|f| f.kind != FrontendKind::LoadBalancer) {
        assert!(fe.source_ranges.is_empty(), "{fe:?}");
    }
    assert_eq!(
        web_errors(&errors),
        [
            (
                "spec.loadBalancerSourceRanges[2]".to_string(),
                "\"10.1.2.3/33\": prefix length above 32; the range is skipped".to_string()
            ),
            (
                "spec.loadBalancerSourceRanges[3]".to_string(),
                "\"nonsense\" is not a CIDR; the range is skipped".to_string()
            ),
        ]
    );
}

#[test]
fn node_port_collisions_are_reported_on_the_later_service() {
    let first = web(
        "  type: NodePort\n  clusterIP: 10.96.12.7\n  ports:\n  - name: http\n    port: 80\n    nodePort: 30080\n",
    );
    let second = "apiVersion: v1\nkind: Service\nmetadata:\n  name: api\n  namespace: shop\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.12.8\n  externalTrafficPolicy: Local\n  ports:\n  - name: http\n    port: 8080\n    nodePort: 30080\n  - name: udp\n    port: 8080\n    protocol: UDP\n    nodePort: 30080\n";
    let options = on_worker(&["192.168.1.10", "10.0.0.5"]);
    let (desired, errors) = build_opts_from(&[&first, second], &options);
    assert_eq!(
        entries(&desired),
        [
            "NodePort 10.0.0.5:30080/TCP Internal",
            "NodePort 10.0.0.5:30080/UDP Internal",
            "NodePort 10.0.0.5:30080/UDP External",
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "ClusterIP 10.96.12.8:8080/TCP Internal",
            "ClusterIP 10.96.12.8:8080/UDP Internal",
            "NodePort 192.168.1.10:30080/TCP Internal",
            "NodePort 192.168.1.10:30080/UDP Internal",
            "NodePort 192.168.1.10:30080/UDP External",
        ]
    );
    assert_eq!(entry(&desired, "10.0.0.5", 30080, Protocol::Tcp, Scope::Internal).service.name, "web");
    // One error per address: the internal and external entries of an address go together.
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        texts,
        [
            "test-1.yaml: Service shop/api: spec.ports[0].nodePort: 10.0.0.5:30080/TCP is already used by Service shop/web; the NodePort is skipped",
            "test-1.yaml: Service shop/api: spec.ports[0].nodePort: 192.168.1.10:30080/TCP is already used by Service shop/web; the NodePort is skipped",
        ]
    );

    // An external IP may not take another Service's address either.
    let thief = "apiVersion: v1\nkind: Service\nmetadata:\n  name: thief\n  namespace: shop\nspec:\n  clusterIP: 10.96.12.9\n  externalIPs: [10.96.12.7]\n  ports:\n  - port: 80\n";
    let (desired, errors) = build_opts_from(&[&first, thief], &options);
    assert_eq!(desired.frontends.len(), 4);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].field.as_deref(), Some("spec.externalIPs[0]"));
    assert!(errors[0].message.ends_with("already used by Service shop/web; the external IP is skipped"));
}

#[test]
fn health_checks_count_this_nodes_endpoints_and_ports_are_unique() {
    let web_svc = load_balancer("  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n");
    // The same pods in two slices and two ports: each address counts once.
    let slice_a = web_slice(
        "web-x1",
        "endpoints:\n- addresses: [10.244.1.5]\n  nodeName: kind-worker\n- addresses: [10.244.1.6]\n  conditions: {ready: false, serving: true, terminating: true}\n  nodeName: kind-worker\n- addresses: [10.244.1.7]\n  conditions: {ready: false, serving: false, terminating: true}\n  nodeName: kind-worker\n- addresses: [10.244.2.5]\n  nodeName: kind-worker2\nports:\n- name: http\n  port: 8080\n- name: admin\n  port: 9090\n",
    );
    let slice_b = web_slice(
        "web-x2",
        "endpoints:\n- addresses: [10.244.1.5]\n  nodeName: kind-worker\n- addresses: [10.244.1.8]\n  nodeName: kind-worker\n- addresses: [10.244.1.6]\n  conditions: {ready: true}\n  nodeName: kind-worker\nports:\n- name: http\n  port: 8080\n",
    );
    let other = |name: &str, ip: &str, node_port: u16, health: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: shop\nspec:\n  type: LoadBalancer\n  clusterIP: {ip}\n  externalTrafficPolicy: Local\n  healthCheckNodePort: {health}\n  ports:\n  - port: 80\n    nodePort: {node_port}\n"
        )
    };
    let api = other("api", "10.96.12.8", 30081, "31000");
    let copy = other("copy", "10.96.12.9", 30082, "32100");
    let bad = other("bad", "10.96.12.10", 30083, "70000");
    let cluster = other("cluster", "10.96.12.11", 30084, "32200")
        .replace("externalTrafficPolicy: Local", "externalTrafficPolicy: Cluster");
    let options = on_worker(&["192.168.1.10"]);
    let (desired, errors) =
        build_opts_from(&[&web_svc, &slice_a, &slice_b, &api, &copy, &bad, &cluster], &options);
    let service = |name: &str| ServiceName { namespace: "shop".into(), name: name.into() };
    assert_eq!(
        desired.health_checks,
        [
            HealthCheck { service: service("api"), port: 31000, local_ready: 0, local_terminating: 0 },
            // .1.5, .1.8 and .1.6 (ready in its second copy) are ready; .1.7 no longer serves.
            HealthCheck { service: service("web"), port: 32100, local_ready: 3, local_terminating: 0 },
        ]
    );
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        texts,
        [
            "test-5.yaml: Service shop/bad: spec.healthCheckNodePort: healthCheckNodePort 70000 is not in 1-65535; no health check is served",
            "test-4.yaml: Service shop/copy: spec.healthCheckNodePort: healthCheckNodePort 32100 is already used by Service shop/web; no health check is served",
        ]
    );

    // Terminating pods that still serve are counted apart from the ready ones.
    let (desired, _) = build_opts_from(&[&web_svc, &slice_a], &options);
    assert_eq!((desired.health_checks[0].local_ready, desired.health_checks[0].local_terminating), (1, 1));
    // Elsewhere, nothing is local.
    let (desired, _) = build_opts_from(&[&web_svc, &slice_a], &on_node("kind-control-plane"));
    assert_eq!((desired.health_checks[0].local_ready, desired.health_checks[0].local_terminating), (0, 0));
}

// ---- IPv6 north–south: node ports, external and load-balancer IPs of the Service's families ----

/// The entry `vip:port/proto` (`vip` of either family) of `scope`.
fn entry_at<'a>(desired: &'a Desired, vip: &str, port: u16, proto: Protocol, scope: Scope) -> &'a Frontend {
    let vip: std::net::IpAddr = vip.parse().unwrap();
    desired
        .frontends
        .iter()
        .find(|f| f.vip == vip && f.port == port && f.proto == proto && f.scope == scope)
        .unwrap_or_else(|| panic!("no {scope:?} entry {vip}:{port}/{proto} in {desired:#?}"))
}

/// A slice of `shop/web` of `family` (`IPv4` or `IPv6`) with port `http` 8080/TCP and these
/// (address, node) ready endpoints.
fn web_family_slice(name: &str, family: &str, endpoints: &[(&str, &str)]) -> String {
    let mut body = String::from("endpoints:\n");
    for (addr, node) in endpoints {
        body.push_str(&format!("- addresses: [\"{addr}\"]\n  conditions: {READY}\n  nodeName: {node}\n"));
    }
    body.push_str("ports:\n- name: http\n  port: 8080\n  protocol: TCP\n");
    web_slice(name, &body).replace("addressType: IPv4", &format!("addressType: {family}"))
}

/// A dual-stack LoadBalancer `shop/web` (port http 80, nodePort 30080), with an external IP and an
/// ingress IP of each family, and dual-stack pods on kind-worker and kind-worker2.
fn dual_stack_load_balancer(spec_extra: &str) -> [String; 3] {
    let svc = web(&format!(
        "  type: LoadBalancer\n  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"fd00:10:96::7\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n{spec_extra}  externalIPs: [203.0.113.7, \"2001:db8:7::7\"]\n  ports:\n  - name: http\n    port: 80\n    nodePort: 30080\nstatus:\n  loadBalancer:\n    ingress:\n    - ip: 198.51.100.10\n    - ip: \"2001:db8:10::10\"\n"
    ));
    let v4 =
        web_family_slice("web-v4", "IPv4", &[("10.244.1.5", "kind-worker"), ("10.244.2.5", "kind-worker2")]);
    let v6 = web_family_slice(
        "web-v6",
        "IPv6",
        &[("fd00:10:244:1::5", "kind-worker"), ("fd00:10:244:2::5", "kind-worker2")],
    );
    [svc, v4, v6]
}

#[test]
fn a_dual_stack_service_answers_north_south_on_both_families_with_each_familys_backends() {
    let docs = dual_stack_load_balancer("");
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let options = on_worker(&["192.168.1.10", "fd00:192:168:1::10"]);
    let desired = build_opts(&docs, &options);
    assert_eq!(
        entries(&desired),
        [
            "ClusterIP 10.96.12.7:80/TCP Internal",
            "NodePort 192.168.1.10:30080/TCP Internal",
            "LoadBalancer 198.51.100.10:80/TCP Internal",
            "ExternalIP 203.0.113.7:80/TCP Internal",
            "ExternalIP 2001:db8:7::7:80/TCP Internal",
            "LoadBalancer 2001:db8:10::10:80/TCP Internal",
            "ClusterIP fd00:10:96::7:80/TCP Internal",
            "NodePort fd00:192:168:1::10:30080/TCP Internal",
        ]
    );
    let v6 = backends(&[("fd00:10:244:1::5", 8080), ("fd00:10:244:2::5", 8080)]);
    for vip in ["fd00:192:168:1::10", "2001:db8:7::7"] {
        let port = if vip.starts_with("fd00") { 30080 } else { 80 };
        let frontend = entry_at(&desired, vip, port, Protocol::Tcp, Scope::Internal);
        assert_eq!(frontend.backends, v6, "{vip}");
        assert!(!frontend.external_local);
    }
    assert_eq!(
        entry_at(&desired, "192.168.1.10", 30080, Protocol::Tcp, Scope::Internal).backends,
        backends(&[("10.244.1.5", 8080), ("10.244.2.5", 8080)])
    );
}

#[test]
fn external_traffic_policy_local_keeps_ipv6_clients_on_this_nodes_ipv6_endpoints() {
    let docs = dual_stack_load_balancer("  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n");
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let desired = build_opts(&docs, &on_worker(&["192.168.1.10", "fd00:192:168:1::10"]));
    let node_port = |scope| entry_at(&desired, "fd00:192:168:1::10", 30080, Protocol::Tcp, scope);
    assert_eq!(node_port(Scope::External).backends, backends(&[("fd00:10:244:1::5", 8080)]));
    assert!(node_port(Scope::External).external_local);
    assert_eq!(node_port(Scope::Internal).backends.len(), 2, "inside the cluster: every endpoint");
    // A dual-stack pod is one endpoint of the health check.
    assert_eq!((desired.health_checks[0].local_ready, desired.health_checks[0].local_terminating), (1, 0));

    // A node without a local endpoint drops external clients (no endpoint here, some elsewhere).
    let desired = build_opts(
        &docs,
        &ModelOptions { node_name: Some("kind-worker3".into()), ..on_worker(&["fd00:192:168:1::10"]) },
    );
    let external = entry_at(&desired, "fd00:192:168:1::10", 30080, Protocol::Tcp, Scope::External);
    assert!(external.backends.is_empty() && external.no_local_endpoints, "{external:#?}");
    assert_eq!(desired.health_checks[0].local_ready, 0);
}

#[test]
fn north_south_addresses_of_a_family_the_service_lacks_are_not_programmed() {
    // IPv4 only: no IPv6 NodePort, external or load-balancer IP (kube-proxy's IPv6 proxier never
    // sees the Service), and the other way round.
    let [dual, v4, v6] = dual_stack_load_balancer("");
    let ipv4_only = dual
        .replace("  clusterIPs: [10.96.12.7, \"fd00:10:96::7\"]\n", "")
        .replace("[IPv4, IPv6]", "[IPv4]")
        .replace("RequireDualStack", "SingleStack");
    let options = on_worker(&["192.168.1.10", "fd00:192:168:1::10"]);
    let desired = build_opts(&[&ipv4_only, &v4, &v6], &options);
    assert!(desired.frontends.iter().all(|f| f.vip.is_ipv4()), "{:?}", entries(&desired));
    assert_eq!(desired.frontends.len(), 4);

    let ipv6_only = dual
        .replace(
            "  clusterIP: 10.96.12.7\n  clusterIPs: [10.96.12.7, \"fd00:10:96::7\"]\n",
            "  clusterIP: \"fd00:10:96::7\"\n",
        )
        .replace("[IPv4, IPv6]", "[IPv6]")
        .replace("RequireDualStack", "SingleStack")
        .replace("  healthCheckNodePort: 32100\n", "");
    let local = ipv6_only.replace(
        "  ipFamilies:",
        "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n  ipFamilies:",
    );
    let desired = build_opts(&[&local, &v4, &v6], &options);
    assert!(desired.frontends.iter().all(|f| f.vip.is_ipv6()), "{:?}", entries(&desired));
    assert_eq!(desired.frontends.len(), 1 + 3 * 2, "the cluster IP, and 3 addresses × 2 scopes");
    // An IPv6-only Service's health check counts its IPv6 endpoints.
    assert_eq!(desired.health_checks[0].local_ready, 1);
}

#[test]
fn each_familys_load_balancer_ips_are_filtered_by_the_source_ranges_of_their_family() {
    let ranges = |desired: &Desired, vip: &str| -> Vec<String> {
        entry_at(desired, vip, 80, Protocol::Tcp, Scope::Internal)
            .source_ranges
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    // IPv4 ranges alone: the IPv6 LB IP admits every IPv6 client, as kube-proxy's IPv6 proxier does.
    let docs = dual_stack_load_balancer("  loadBalancerSourceRanges: [10.0.0.0/8]\n");
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let desired = build_opts(&docs, &on_worker(&["192.168.1.10"]));
    assert_eq!(ranges(&desired, "198.51.100.10"), ["10.0.0.0/8"]);
    assert!(ranges(&desired, "2001:db8:10::10").is_empty());
    // Both families: each LB IP gets its own family's ranges; a node address in a range admits that
    // family's LB IPs (allowFromNode), here the IPv6 one only.
    let docs = dual_stack_load_balancer(
        "  loadBalancerSourceRanges: [10.0.0.0/8, \"2001:db8:99::/48\", \"fd00:192:168::/48\"]\n",
    );
    let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
    let desired = build_opts(&docs, &on_worker(&["192.168.1.10", "fd00:192:168:1::10"]));
    assert_eq!(ranges(&desired, "198.51.100.10"), ["10.0.0.0/8"]);
    assert_eq!(
        ranges(&desired, "2001:db8:10::10"),
        ["2001:db8:10::10/128", "2001:db8:99::/48", "fd00:192:168::/48"]
    );
    // External IPs and NodePorts have no source ranges, in either family.
    assert!(ranges(&desired, "2001:db8:7::7").is_empty());
    let node_port = entry_at(&desired, "fd00:192:168:1::10", 30080, Protocol::Tcp, Scope::Internal);
    assert!(node_port.source_ranges.is_empty(), "{node_port:?}");
}
