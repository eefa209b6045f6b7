//! The agent's `/metrics` page as Prometheus reads it: the real agent and datapath in a sandbox, syncs
//! driven by manifest changes, the page scraped with curl and parsed by a strict text-format parser
//! (openmetrics-parser's Prometheus grammar, which also validates label sets, histogram buckets and
//! duplicate families). Every family kube-proxy 1.34 serves that kproxy has a meaning for is there
//! under kube-proxy's name, type, HELP text and labels, and its values say what happened.
//! Needs root.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::{Cluster, Mode};
use openmetrics_parser::{MetricsExposition, PrometheusType, PrometheusValue, prometheus::parse_prometheus};

type Exposition = MetricsExposition<PrometheusType, PrometheusValue>;

/// (name, type, label names without `le`, HELP): kube-proxy's own, byte for byte (pkg/proxy/metrics and
/// the metrics reference of 1.34), then client_golang's process collector and kproxy's build info.
const FAMILIES: &[(&str, PrometheusType, &[&str], &str)] = &[
    (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        PrometheusType::Histogram,
        &["ip_family"],
        "SyncProxyRules latency in seconds",
    ),
    (
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        PrometheusType::Histogram,
        &["ip_family"],
        "SyncProxyRules latency in seconds for full resyncs",
    ),
    (
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        PrometheusType::Histogram,
        &["ip_family"],
        "SyncProxyRules latency in seconds for partial resyncs",
    ),
    (
        "kubeproxy_network_programming_duration_seconds",
        PrometheusType::Histogram,
        &["ip_family"],
        "In Cluster Network Programming Latency in seconds",
    ),
    (
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        PrometheusType::Gauge,
        &["ip_family"],
        "The last time proxy rules were successfully synced",
    ),
    (
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        PrometheusType::Gauge,
        &["ip_family"],
        "The last time a sync of proxy rules was queued",
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        PrometheusType::Gauge,
        &[],
        "Pending proxy rules Endpoint changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        PrometheusType::Counter,
        &[],
        "Cumulative proxy rules Endpoint changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        PrometheusType::Gauge,
        &[],
        "Pending proxy rules Service changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_service_changes_total",
        PrometheusType::Counter,
        &[],
        "Cumulative proxy rules Service changes",
    ),
    (
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        PrometheusType::Gauge,
        &["ip_family", "traffic_policy"],
        "Number of services with a Local traffic policy and no endpoints",
    ),
    (
        "kubeproxy_proxy_healthz_total",
        PrometheusType::Counter,
        &["code"],
        "Cumulative proxy healthz HTTP status",
    ),
    ("kubeproxy_proxy_livez_total", PrometheusType::Counter, &["code"], "Cumulative proxy livez HTTP status"),
    (
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
        PrometheusType::Histogram,
        &["ip_family"],
        "ReconcileConntrackFlowsLatency latency in seconds",
    ),
    (
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
        PrometheusType::Counter,
        &["ip_family"],
        "Cumulative conntrack flows deleted by conntrack reconciler",
    ),
    (
        "process_cpu_seconds_total",
        PrometheusType::Counter,
        &[],
        "Total user and system CPU time spent in seconds.",
    ),
    ("process_resident_memory_bytes", PrometheusType::Gauge, &[], "Resident memory size in bytes."),
    ("process_virtual_memory_bytes", PrometheusType::Gauge, &[], "Virtual memory size in bytes."),
    (
        "process_virtual_memory_max_bytes",
        PrometheusType::Gauge,
        &[],
        "Maximum amount of virtual memory available in bytes.",
    ),
    (
        "process_start_time_seconds",
        PrometheusType::Gauge,
        &[],
        "Start time of the process since unix epoch in seconds.",
    ),
    ("process_open_fds", PrometheusType::Gauge, &[], "Number of open file descriptors."),
    ("process_max_fds", PrometheusType::Gauge, &[], "Maximum number of open file descriptors."),
    (
        "kproxy_build_info",
        PrometheusType::Gauge,
        &["commit", "version"],
        "kproxy's version and the commit it was built from; always 1",
    ),
];

/// The sync histograms' buckets, kube-proxy's `ExponentialBuckets(0.001, 2, 15)`, as written in `le`.
const SYNC_BUCKETS: [&str; 15] = [
    "0.001", "0.002", "0.004", "0.008", "0.016", "0.032", "0.064", "0.128", "0.256", "0.512", "1.024",
    "2.048", "4.096", "8.192", "16.384",
];

/// One scrape: the text and what the parser made of it (which fails the test if it refuses the page).
fn scrape(cluster: &Cluster) -> (String, Exposition) {
    let (code, text) = cluster.node_curl("http://127.0.0.1:10249/metrics");
    assert_eq!(code, 200, "{text}");
    // curl's -w output starts on a line of its own: the page's closing newline was taken with it.
    let text = text + "\n";
    let parsed =
        parse_prometheus(&text).unwrap_or_else(|e| panic!("the parser refuses the page: {e}\n{text}"));
    (text, parsed)
}

/// Label name → value of a sample.
fn labels_of(
    family: &openmetrics_parser::MetricFamily<PrometheusType, PrometheusValue>,
) -> Vec<(BTreeMap<String, String>, &PrometheusValue)> {
    family
        .iter_samples()
        .map(|sample| {
            let set = sample.get_labelset().expect("labels");
            let labels = set.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            (labels, &sample.value)
        })
        .collect()
}

/// The value of the sample of `name` whose labels are exactly `labels` (histograms: their count).
fn value(exposition: &Exposition, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let family = exposition.families.get(name)?;
    let wanted: BTreeMap<String, String> =
        labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    labels_of(family).into_iter().find(|(labels, _)| *labels == wanted).map(|(_, value)| match value {
        PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
        PrometheusValue::Counter(c) => c.value.as_f64(),
        PrometheusValue::Histogram(h) => h.count.expect("histogram count") as f64,
        PrometheusValue::Summary(s) => s.count.expect("summary count") as f64,
    })
}

const V4: (&str, &str) = ("ip_family", "IPv4");

/// The label names, in the order written, of the first sample line of `family` (a histogram's
/// without `le`, which client_golang writes last).
fn written_label_names(text: &str, family: &str) -> Vec<String> {
    let Some(line) = text.lines().find(|l| !l.starts_with('#') && l.starts_with(family)) else {
        return Vec::new();
    };
    let Some((_, rest)) = line.split_once('{') else { return Vec::new() };
    let names: Vec<String> =
        rest.split(',').filter_map(|pair| pair.split_once('=')).map(|(k, _)| k.to_owned()).collect();
    names.into_iter().filter(|n| n != "le").collect()
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

#[test]
fn the_metrics_page_parses_and_carries_kube_proxys_families() {
    let test_started = unix_now();
    let cluster = Cluster::start_with("metrics-page", Mode::Files);

    // Local traffic policies whose only endpoint is on another node: internal (a cluster IP) and
    // external (an external IP, which this test never sends to), each counted once per Service port.
    let elsewhere = "- addresses: [10.244.0.12]\n  conditions: {ready: true, serving: true, terminating: false}\n  \
                     nodeName: node-2\n";
    let service = |name: &str, vip: &str, spec_extra: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  \
             clusterIP: {vip}\n{spec_extra}  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abcde\n  \
             namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n\
             ports:\n- name: http\n  port: 80\n  protocol: TCP\nendpoints:\n{elsewhere}"
        )
    };
    std::fs::write(
        cluster.manifest("itp-local.yaml"),
        service("itp-local", "10.96.0.160", "  internalTrafficPolicy: Local\n"),
    )
    .unwrap();
    std::fs::write(
        cluster.manifest("etp-local.yaml"),
        service(
            "etp-local",
            "10.96.0.161",
            "  externalIPs: [203.0.113.80]\n  externalTrafficPolicy: Local\n",
        ),
    )
    .unwrap();
    // A UDP backend leaves kube-dns: the conntrack reconciler runs for it.
    let dns = cluster.manifest("kube-dns.yaml");
    let dns_text = std::fs::read_to_string(&dns).unwrap();
    let second = dns_text.find("- addresses:\n  - 10.244.0.22").expect("the second DNS endpoint");
    let end = dns_text[second..].find("ports:").map(|i| second + i).unwrap();
    std::fs::write(&dns, format!("{}{}", &dns_text[..second], &dns_text[end..])).unwrap();
    cluster.wait_for_frontends(&[
        ("10.96.0.160:80", "TCP", 0),
        ("10.96.0.161:80", "TCP", 1),
        ("10.96.0.10:53", "UDP", 1),
    ]);

    // Probes as a kubelet and a load balancer send them.
    let (mut healthz, mut livez) = (0, 0);
    for _ in 0..3 {
        assert_eq!(cluster.node_curl("http://127.0.0.1:10256/healthz").0, 200);
        healthz += 1;
    }
    assert_eq!(cluster.node_curl("http://127.0.0.1:10256/livez").0, 200);
    livez += 1;

    // The no-local gauge follows the sync that programmed the new Services; wait for it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (text, page) = loop {
        let (text, page) = scrape(&cluster);
        let no_local = |policy| {
            value(
                &page,
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                &[V4, ("traffic_policy", policy)],
            )
        };
        if (no_local("internal"), no_local("external")) == (Some(1.0), Some(1.0)) {
            break (text, page);
        }
        assert!(
            Instant::now() < deadline,
            "no-local counts never became 1 and 1:\n{text}\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };

    // Every family: name, type, HELP and label names as kube-proxy has them.
    for (name, kind, labels, help) in FAMILIES {
        let family = page.families.get(*name).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        assert_eq!(&family.family_type, kind, "{name}");
        assert_eq!(family.help, *help, "{name}");
        // Label names in the order clients write them (sorted; `le` last).
        let names: Vec<&str> =
            family.get_label_names().iter().map(String::as_str).filter(|n| *n != "le").collect();
        assert_eq!(names, *labels, "{name}");
        let first = written_label_names(&text, name);
        assert!(first.windows(2).all(|w| w[0] <= w[1]), "{name}: labels not sorted: {first:?}");
        assert!(family.iter_samples().next().is_some(), "{name} has no sample:\n{text}");
    }
    // HELP and TYPE consistent for the whole page: each family is described once, HELP then TYPE,
    // and no sample is outside a typed family (an untyped sample would parse as Unknown).
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap();
            assert!(lines[i - 1].starts_with(&format!("# HELP {name} ")), "TYPE {name} without its HELP");
        }
    }
    for (name, family) in &page.families {
        assert_ne!(family.family_type, PrometheusType::Unknown, "{name} has no TYPE");
        assert!(!family.help.is_empty(), "{name} has no HELP");
        assert_eq!(text.matches(&format!("# TYPE {name} ")).count(), 1, "{name} typed twice");
    }

    // Sync histograms: kube-proxy's buckets, ip_family before le, +Inf last.
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
    ] {
        let bounds: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix(&format!("{name}_bucket{{ip_family=\"IPv4\",le=\"")))
            .map(|rest| rest.split('"').next().unwrap())
            .collect();
        assert_eq!(bounds[..15], SYNC_BUCKETS, "{name}");
        assert_eq!(bounds[15..], ["+Inf"], "{name}");
    }
    let programming_buckets = lines
        .iter()
        .filter(|l| {
            l.starts_with("kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=")
        })
        .count();
    assert_eq!(programming_buckets, 2 + 59 + 12 + 7 + 1);

    // What happened, as the values tell it: the first sync was full, the manifest changes partial.
    let count = |name| value(&page, name, &[V4]).unwrap();
    assert!(count("kubeproxy_sync_full_proxy_rules_duration_seconds") >= 1.0, "{text}");
    assert!(count("kubeproxy_sync_partial_proxy_rules_duration_seconds") >= 1.0, "{text}");
    assert_eq!(
        count("kubeproxy_sync_proxy_rules_duration_seconds"),
        count("kubeproxy_sync_full_proxy_rules_duration_seconds")
            + count("kubeproxy_sync_partial_proxy_rules_duration_seconds")
    );
    assert!(count("kubeproxy_conntrack_reconciler_sync_duration_seconds") >= 1.0, "{text}");
    assert!(count("kubeproxy_conntrack_reconciler_deleted_entries_total") >= 0.0);
    let last_sync = count("kubeproxy_sync_proxy_rules_last_timestamp_seconds");
    assert!(last_sync >= test_started && last_sync <= unix_now(), "{last_sync}");
    assert!(value(&page, "kubeproxy_sync_proxy_rules_service_changes_total", &[]).unwrap() >= 2.0);
    assert!(value(&page, "kubeproxy_sync_proxy_rules_endpoint_changes_total", &[]).unwrap() >= 2.0);
    assert!(value(&page, "kubeproxy_proxy_healthz_total", &[("code", "200")]).unwrap() >= healthz as f64);
    assert!(value(&page, "kubeproxy_proxy_livez_total", &[("code", "200")]).unwrap() >= livez as f64);

    // The process is the agent, started during this test.
    let started = value(&page, "process_start_time_seconds", &[]).unwrap();
    assert!(started >= test_started - 1.0 && started <= unix_now(), "{started} vs {test_started}");
    let resident = value(&page, "process_resident_memory_bytes", &[]).unwrap();
    assert!(resident > 1e6 && value(&page, "process_virtual_memory_bytes", &[]).unwrap() >= resident);
    let open = value(&page, "process_open_fds", &[]).unwrap();
    assert!(open >= 3.0 && open <= value(&page, "process_max_fds", &[]).unwrap(), "{open}");
    assert!(value(&page, "process_cpu_seconds_total", &[]).unwrap() > 0.0);

    // Build info: this crate's version, and a commit of this repository (or "unknown" outside one).
    let build = labels_of(&page.families["kproxy_build_info"]);
    let [(labels, _)] = build.as_slice() else { panic!("one kproxy_build_info series: {build:?}") };
    assert_eq!(labels["version"], kproxy::agent::http::metrics::BUILD_VERSION);
    let commit = &labels["commit"];
    if commit != "unknown" {
        let repo = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let kind =
            std::process::Command::new("git").args(["-C", repo, "cat-file", "-t", commit]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&kind.stdout).trim(), "commit", "{commit} is not a commit here");
    }
    assert_eq!(
        value(&page, "kproxy_build_info", &[("commit", commit), ("version", labels["version"].as_str())]),
        Some(1.0)
    );

    // The health counters move with each answer, by code.
    assert_eq!(cluster.node_curl("http://127.0.0.1:10256/livez").0, 200);
    let (_, again) = scrape(&cluster);
    let livez_now = value(&again, "kubeproxy_proxy_livez_total", &[("code", "200")]).unwrap();
    assert!(livez_now > value(&page, "kubeproxy_proxy_livez_total", &[("code", "200")]).unwrap());
}
