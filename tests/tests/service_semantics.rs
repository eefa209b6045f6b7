//! Conntrack lifecycle and Service semantics with real clients in a sandbox
//! (the behaviours of shared/CONFORMANCE.md): refusal without endpoints, the
//! UDP client that keeps its source port, session affinity, hairpin,
//! terminating backends, and the operator's conntrack tools. Needs root.

mod common;

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use common::cluster::{Cluster, DNS_VIP, Trace, UdpOutcome, WEB_VIP, send_one_datagram};

fn edit(cluster: &Cluster, file: &str, from: &str, to: &str) {
    let path = cluster.manifest(file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{file} has no {from:?}");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

fn add_manifest(cluster: &Cluster, name: &str, text: &str) {
    std::fs::write(cluster.manifest(name), text).unwrap();
}

const EMPTY_SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: empty
  namespace: default
spec:
  clusterIP: 10.96.0.200
  ports:
  - name: http
    port: 80
    protocol: TCP
  - name: dns
    port: 5353
    protocol: UDP
";

#[test]
fn a_service_without_endpoints_refuses_at_once() {
    let cluster = Cluster::start("refuse");
    add_manifest(&cluster, "empty.yaml", EMPTY_SERVICE);
    cluster.wait_for_frontends(&[("10.96.0.200:80", "TCP", 0), ("10.96.0.200:5353", "UDP", 0)]);

    let started = Instant::now();
    let out = cluster.client.exec_output(["curl", "-sS", "--max-time", "5", "http://10.96.0.200/"]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(err.contains("Connection refused") || err.contains("Couldn't connect"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1), "refused after {:?}", started.elapsed());

    // UDP: ICMP port unreachable, which dig reports as a refused connection.
    let started = Instant::now();
    let out = cluster
        .client
        .exec_output(["dig", "+time=3", "+tries=1", "-p", "5353", "@10.96.0.200", "x"])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("connection refused"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(2), "refused after {:?}", started.elapsed());

    // A port the web Service does not have.
    let out = cluster
        .client
        .exec_output(["curl", "-sS", "--max-time", "5", &format!("http://{WEB_VIP}:8081/")])
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stderr));
    let stats = cluster.dump_json("stats");
    let count = |reason: &str| {
        stats.as_array().unwrap().iter().find(|r| r["reason"] == reason).unwrap()["packets"].as_u64().unwrap()
    };
    assert!(count("reject_tcp_rst") >= 2 && count("reject_udp_icmp") >= 1, "{stats:#}");
}

/// A backend with nothing listening on the Service's UDP port answers with ICMP port
/// unreachable; the client's socket, connected to the Service, learns it at once
/// (ECONNREFUSED) instead of waiting out its timeout — the error is un-NATed like a reply.
#[test]
fn a_backend_port_unreachable_reaches_the_client_as_a_refusal_from_the_service() {
    let cluster = Cluster::start("icmp");
    add_manifest(
        &cluster,
        "closed.yaml",
        "apiVersion: v1
kind: Service
metadata: {name: closed, namespace: default}
spec:
  clusterIP: 10.96.0.150
  ports: [{name: udp, port: 9999, protocol: UDP, targetPort: 9998}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: closed-1
  namespace: default
  labels: {kubernetes.io/service-name: closed}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11], conditions: {ready: true}}]
ports: [{name: udp, port: 9998, protocol: UDP}]
",
    );
    cluster.wait_for_frontends(&[("10.96.0.150:9999", "UDP", 1)]);
    let before = cluster.stat("icmp_error_unnat");
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--port", "9999"]);
    let outcome = send_one_datagram(&cluster.client, "10.96.0.150", 9999);
    assert!(matches!(outcome, UdpOutcome::Refused(s) if s < 1.0), "{outcome:?}");
    assert_eq!(cluster.stat("icmp_error_unnat"), before + 1);

    // `kproxy trace` shows the error's quote as it arrived and as the client got it.
    let steps = trace.steps();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "ICMP", "un-NAT"], "{steps:#?}");
    assert_eq!(steps[2]["destination"], "10.244.0.11:9998", "{steps:#?}");
    assert_eq!(steps[3]["destination"], "10.96.0.150:9999", "{steps:#?}");
    assert_eq!(steps[3]["source"], steps[0]["source"], "{steps:#?}");
}

/// The answering DNS pod for a query from a fixed source port.
fn whoami_from_port(cluster: &Cluster, port: u16) -> Option<String> {
    let out = cluster
        .client
        .exec_output([
            "dig",
            "+short",
            "+time=1",
            "+tries=1",
            "-b",
            &format!("0.0.0.0#{port}"),
            &format!("@{DNS_VIP}"),
            "whoami.kproxy.test",
            "TXT",
        ])
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().trim_matches('"').to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

#[test]
fn a_udp_client_with_a_fixed_source_port_follows_its_backend_within_a_second() {
    let cluster = Cluster::start("udp-move");
    let first = whoami_from_port(&cluster, 12345).expect("an answer");
    for _ in 0..5 {
        assert_eq!(
            whoami_from_port(&cluster, 12345).as_deref(),
            Some(first.as_str()),
            "one flow, one backend"
        );
    }
    // The backend pod is replaced: its endpoint leaves the slice.
    let (gone, other_ip) =
        if first == "coredns-1" { ("10.244.0.21", "10.244.0.22") } else { ("10.244.0.22", "10.244.0.21") };
    // Its pod is going away: no longer ready nor serving.
    let text = std::fs::read_to_string(cluster.manifest("kube-dns.yaml")).unwrap();
    let ready = format!("  - {gone}\n  conditions:\n    ready: true\n    serving: true");
    assert!(text.contains(&ready));
    let without =
        text.replacen(&ready, &format!("  - {gone}\n  conditions:\n    ready: false\n    serving: false"), 2);
    let changed = Instant::now();
    std::fs::write(cluster.manifest("kube-dns.yaml"), without).unwrap();
    let answered = loop {
        if let Some(who) = whoami_from_port(&cluster, 12345)
            && who != first
        {
            break changed.elapsed();
        }
        assert!(
            changed.elapsed() < Duration::from_secs(10),
            "still answered by {first}:\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(answered < Duration::from_secs(1), "reached the new backend {other_ip} only after {answered:?}");
}

#[test]
fn session_affinity_sticks_and_can_be_switched_at_runtime() {
    let cluster = Cluster::start("affinity");
    let url = format!("http://{WEB_VIP}/");
    let spread = |n| -> BTreeSet<String> { (0..n).map(|_| cluster.client.curl(&url).unwrap()).collect() };
    assert!(spread(30).len() > 1, "without affinity the replies spread");

    edit(
        &cluster,
        "web.yaml",
        "  sessionAffinity: None\n",
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 60\n",
    );
    std::thread::sleep(Duration::from_millis(700));
    let stuck = spread(15);
    assert_eq!(stuck.len(), 1, "15 replies in a row from one backend: {stuck:?}");
    let affinity = cluster.dump_json("affinity");
    assert_eq!(affinity.as_array().unwrap().len(), 1, "{affinity:#}");

    edit(&cluster, "web.yaml", "  sessionAffinity: ClientIP\n", "  sessionAffinity: None\n");
    std::thread::sleep(Duration::from_millis(700));
    assert!(spread(30).len() > 1, "switching back to None spreads again");
}

#[test]
fn a_pod_reaches_itself_through_its_own_service() {
    let cluster = Cluster::start("hairpin");
    add_manifest(
        &cluster,
        "self.yaml",
        "apiVersion: v1
kind: Service
metadata: {name: self, namespace: default}
spec:
  clusterIP: 10.96.0.111
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: self-1
  namespace: default
  labels: {kubernetes.io/service-name: self}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11], conditions: {ready: true}}]
ports: [{name: http, port: 80, protocol: TCP}]
",
    );
    cluster.wait_for_frontends(&[("10.96.0.111:80", "TCP", 1)]);
    let web1 = &cluster.web[0];
    assert_eq!(web1.curl("http://10.96.0.111/").unwrap(), "web-1\n");
    // The backend saw the hairpin address, not itself.
    assert_eq!(web1.curl("http://10.96.0.111/client").unwrap().trim(), "169.254.42.1");
    let ct = cluster.dump_json("conntrack");
    assert!(
        ct.as_array().unwrap().iter().any(|r| r["hairpin"] == true && r["service"] == "default/self:http"),
        "{ct:#}"
    );
}

#[test]
fn a_terminating_backend_keeps_its_flows_and_gets_no_new_ones() {
    let cluster = Cluster::start("terminating");
    let out = cluster.sandbox.dir().join("slow.bin");
    // Pin the long download to web-1 by making it the only backend first.
    let web = std::fs::read_to_string(cluster.manifest("web.yaml")).unwrap();
    let only_web1 = web
        .replacen(
            "  - 10.244.0.12\n  conditions:\n    ready: true",
            "  - 10.244.0.12\n  conditions:\n    ready: false",
            1,
        )
        .replacen(
            "  - 10.244.0.13\n  conditions:\n    ready: true",
            "  - 10.244.0.13\n  conditions:\n    ready: false",
            1,
        );
    std::fs::write(cluster.manifest("web.yaml"), &only_web1).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 1)]);
    let download = cluster.client.download_slowly(&WEB_VIP.to_string(), &out).unwrap();
    std::thread::sleep(Duration::from_millis(500));

    // web-1 starts terminating (still serving); the other two become ready.
    let terminating = web.replacen(
        "  - 10.244.0.11\n  conditions:\n    ready: true\n    serving: true\n    terminating: false",
        "  - 10.244.0.11\n  conditions:\n    ready: false\n    serving: true\n    terminating: true",
        1,
    );
    assert_ne!(terminating, web);
    std::fs::write(cluster.manifest("web.yaml"), &terminating).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);
    for _ in 0..20 {
        assert_ne!(
            cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap(),
            "web-1\n",
            "a terminating backend got a new connection"
        );
    }
    let backends = cluster.dump_json("backends");
    assert!(
        backends
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["address"] == "10.244.0.11:80" && b["state"] == "terminating"),
        "{backends:#}"
    );
    let status = download.wait_timeout(Duration::from_secs(30)).unwrap().expect("download finished");
    assert!(status.success(), "the flow to the terminating backend broke: {}", download.log());
    assert!(std::fs::read(&out).unwrap() == sandbox::big_file_contents());
}

#[test]
fn conntrack_flush_by_service_and_the_dumps() {
    let cluster = Cluster::start("flush");
    cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap();
    cluster.client.dig(DNS_VIP, "whoami.kproxy.test", "TXT").unwrap();
    let ct = cluster.dump_json("conntrack");
    let rows = ct.as_array().unwrap();
    assert!(rows.iter().any(|r| r["service"] == "default/web:http"), "{ct:#}");
    for row in rows {
        let left = row["time_left_seconds"].as_f64().unwrap();
        assert!(left > 0.0 && left <= 6.0 * 3600.0, "{row}");
    }
    let table = cluster.kproxy(&["dump", "conntrack"]);
    assert!(table.contains("10.96.0.100:80") && table.contains("default/web:http"), "{table}");

    let out = cluster.kproxy(&["conntrack", "flush", "--service", "default/web"]);
    assert!(out.contains("2") || out.contains("deleted"), "{out}");
    let ct = cluster.dump_json("conntrack");
    let rows = ct.as_array().unwrap();
    assert!(!rows.iter().any(|r| r["service"] == "default/web:http"), "web flows left: {ct:#}");
    assert!(
        rows.iter().any(|r| r["service"] == "kube-system/kube-dns:dns"),
        "dns flows were flushed too: {ct:#}"
    );
    cluster.kproxy(&["conntrack", "flush"]);
    assert_eq!(cluster.dump_json("conntrack").as_array().unwrap().len(), 0);
}

/// sessionAffinity is kept per Service port, whichever of its addresses a client uses, as kube-proxy's affinity
/// sets are per Service port and endpoint ("without regard to which service IP was used to reach the service",
/// pkg/proxy/nftables/proxier.go): a client that reached one web pod through the ClusterIP gets the same pod
/// through the Service's external IP and its load-balancer IP, and a second client stuck elsewhere keeps its own.
#[test]
fn session_affinity_holds_across_a_service_ports_cluster_external_and_load_balancer_ips() {
    const EXTERNAL_IP: &str = "192.0.2.100";
    const LB_IP: &str = "192.0.2.101";
    let cluster = Cluster::start("affinity-ips");
    edit(
        &cluster,
        "web.yaml",
        "  sessionAffinity: None\n",
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 600\n",
    );
    edit(
        &cluster,
        "web.yaml",
        "  type: ClusterIP\n",
        &format!("  type: LoadBalancer\n  externalIPs:\n  - {EXTERNAL_IP}\n"),
    );
    edit(
        &cluster,
        "web.yaml",
        "status:\n  loadBalancer: {}\n",
        &format!("status:\n  loadBalancer:\n    ingress:\n    - ip: {LB_IP}\n"),
    );
    cluster.wait_for_frontends(&[
        ("10.96.0.100:80", "TCP", 3),
        ("192.0.2.100:80", "TCP", 3),
        ("192.0.2.101:80", "TCP", 3),
    ]);
    let urls = [format!("http://{WEB_VIP}/"), format!("http://{EXTERNAL_IP}/"), format!("http://{LB_IP}/")];
    // Four rounds over the three addresses, starting at each in turn.
    let replies = |client: &sandbox::Pod| -> Vec<(String, String)> {
        (0..4)
            .flat_map(|round| (0..3).map(move |i| (round + i) % 3))
            .map(|i| (urls[i].clone(), client.curl(&urls[i]).unwrap()))
            .collect()
    };
    let first = replies(&cluster.client);
    let sticky: BTreeSet<&String> = first.iter().map(|(_, reply)| reply).collect();
    assert_eq!(sticky.len(), 1, "one pod answers the client on every address: {first:?}");
    let pod = sticky.into_iter().next().unwrap().trim().to_owned();

    // The client's pod starts terminating (it still serves): a second client is sent to another pod, and
    // sticks to that one on every address.
    let web = std::fs::read_to_string(cluster.manifest("web.yaml")).unwrap();
    let ip = match pod.as_str() {
        "web-1" => "10.244.0.11",
        "web-2" => "10.244.0.12",
        "web-3" => "10.244.0.13",
        other => panic!("reply from {other:?}"),
    };
    let serving =
        format!("  - {ip}\n  conditions:\n    ready: true\n    serving: true\n    terminating: false");
    let terminating =
        format!("  - {ip}\n  conditions:\n    ready: false\n    serving: true\n    terminating: true");
    assert!(web.contains(&serving), "{web}");
    std::fs::write(cluster.manifest("web.yaml"), web.replacen(&serving, &terminating, 1)).unwrap();
    cluster.wait_for_frontends(&[
        ("10.96.0.100:80", "TCP", 2),
        ("192.0.2.100:80", "TCP", 2),
        ("192.0.2.101:80", "TCP", 2),
    ]);
    let second_client = &cluster.dns[0];
    let second = replies(second_client);
    let other: BTreeSet<&String> = second.iter().map(|(_, reply)| reply).collect();
    assert_eq!(other.len(), 1, "one pod answers the second client on every address: {second:?}");
    assert_ne!(other.into_iter().next().unwrap().trim(), pod, "{second:?}");

    // Ready again: the first client is back on its pod, the second stays where it is.
    std::fs::write(cluster.manifest("web.yaml"), &web).unwrap();
    cluster.wait_for_frontends(&[
        ("10.96.0.100:80", "TCP", 3),
        ("192.0.2.100:80", "TCP", 3),
        ("192.0.2.101:80", "TCP", 3),
    ]);
    let again = replies(&cluster.client);
    assert!(again.iter().all(|(_, reply)| reply.trim() == pod), "{again:?}");
    assert_eq!(replies(second_client), second);

    // One affinity entry per client, under the Service port's cluster IP.
    let affinity = cluster.dump_json("affinity");
    let rows = affinity.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{affinity:#}");
    assert!(
        rows.iter().all(|r| r["frontend"] == "10.96.0.100:80" && r["service"] == "default/web:http"),
        "{affinity:#}"
    );
}
