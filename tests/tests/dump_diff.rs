//! `kproxy dump diff`: what the agent wants (from the manifests or the API
//! server) against what the maps hold, with the real agent in a sandbox.
//! Needs root.

mod common;

use common::cluster::{Cluster, Mode, kproxy_bin};

/// `kproxy dump diff <args>` in the node namespace: (exit status, stdout).
fn diff(cluster: &Cluster, args: &[&str]) -> (i32, String) {
    let bin = kproxy_bin();
    let pin_dir = cluster.pin_dir.display().to_string();
    let mut full = vec![bin.to_str().unwrap(), "--pin-dir", &pin_dir, "dump", "diff"];
    full.extend_from_slice(args);
    let out = cluster.sandbox.node_exec_output(&full).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "kproxy dump diff {args:?} failed ({code}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (code, stdout)
}

const EXTRA_SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: extra
  namespace: default
spec:
  clusterIP: 10.96.0.201
  ports:
  - name: http
    port: 8080
    protocol: TCP
";

/// Removes web-3 (10.244.0.13) from web's EndpointSlice.
fn remove_web_3(cluster: &Cluster) {
    let path = cluster.manifest("web.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text.find("- addresses:\n  - 10.244.0.13\n").expect("web-3 in web.yaml");
    let end = start + text[start..].find("\nports:").expect("ports after the endpoints") + 1;
    std::fs::write(&path, format!("{}{}", &text[..start], &text[end..])).unwrap();
}

#[test]
fn diff_names_what_changed_while_the_agent_was_down() {
    let mut cluster = Cluster::start("diff");
    let manifests = cluster.manifests.display().to_string();

    let (code, out) = diff(&cluster, &["--manifests", &manifests]);
    assert_eq!((code, out.as_str()), (0, "no differences\n"));
    let (code, out) = diff(&cluster, &["--manifests", &manifests, "--json"]);
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), serde_json::json!([]));

    // While the agent is down: an endpoint goes away and a Service appears.
    cluster.stop_agent();
    remove_web_3(&cluster);
    std::fs::write(cluster.manifest("extra.yaml"), EXTRA_SERVICE).unwrap();

    let (code, table) = diff(&cluster, &["--manifests", &manifests]);
    assert_eq!(code, 1, "{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "header, two differences, count:\n{table}");
    assert!(lines[0].starts_with("KIND") && lines[0].contains("DETAIL"), "{table}");
    let row = |line: &str| line.split_whitespace().take(3).map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(row(lines[1]), ["backends", "10.96.0.100:80/TCP", "default/web:http"], "{table}");
    assert!(lines[1].ends_with("3 backends, want 2; extra 10.244.0.13:80"), "{table}");
    assert_eq!(row(lines[2]), ["missing-frontend", "10.96.0.201:8080/TCP", "default/extra:http"], "{table}");
    assert!(lines[2].contains("not in the services map (wants no backends (refuses))"), "{table}");
    assert_eq!(lines[3], "2 differences");

    let (code, out) = diff(&cluster, &["--manifests", &manifests, "--json"]);
    assert_eq!(code, 1);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        json,
        serde_json::json!([
            {
                "kind": "backends",
                "frontend": "10.96.0.100:80/TCP",
                "service": "default/web:http",
                "detail": "3 backends, want 2; extra 10.244.0.13:80",
            },
            {
                "kind": "missing-frontend",
                "frontend": "10.96.0.201:8080/TCP",
                "service": "default/extra:http",
                "detail": "not in the services map (wants no backends (refuses))",
            },
        ])
    );

    // The agent catches up: nothing differs any more.
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2), ("10.96.0.201:8080", "TCP", 0)]);
    let (code, out) = diff(&cluster, &["--manifests", &manifests]);
    assert_eq!((code, out.as_str()), (0, "no differences\n"), "agent log:\n{}", cluster.agent_log());
}

#[test]
fn diff_reads_the_api_server_like_the_agent() {
    let cluster = Cluster::start_with("diffapi", Mode::Api);
    let url = cluster.api().url();
    let (code, out) = diff(&cluster, &["--master", &url, "--hostname-override", "node-1"]);
    assert_eq!((code, out.as_str()), (0, "no differences\n"));

    // The diff lists once, with the agent's label selector, and no watch.
    let lists: Vec<String> = cluster
        .api()
        .requests()
        .into_iter()
        .filter(|r| r.contains("labelSelector") && !r.contains("watch=true"))
        .collect();
    assert!(lists.iter().any(|r| r.starts_with("GET /api/v1/services?")), "{lists:?}");
    assert!(lists.iter().any(|r| r.contains("/apis/discovery.k8s.io/v1/endpointslices?")), "{lists:?}");

    // A new Service: once the agent has programmed it, nothing differs.
    cluster.api().apply_yaml(EXTRA_SERVICE).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.201:8080", "TCP", 0)]);
    let (code, out) = diff(&cluster, &["--master", &url, "--hostname-override", "node-1", "--json"]);
    assert_eq!((code, out.trim()), (0, "[]"), "agent log:\n{}", cluster.agent_log());
}

const SERVICE_CIDR: &str = "apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata:
  name: kubernetes
spec:
  cidrs:
  - 10.96.0.0/16
";

#[test]
fn diff_compares_the_service_cidrs_with_the_clusters_and_the_flag() {
    let mut cluster = Cluster::start_with("diffcidr", Mode::Api);
    let url = cluster.api().url();
    let args = ["--master", url.as_str(), "--hostname-override", "node-1"];
    assert_eq!(diff(&cluster, &args), (0, "no differences\n".to_owned()));

    // While the agent is down the cluster gets a ServiceCIDR: SERVICE_CIDRS_V4 lacks it.
    cluster.stop_agent();
    cluster.api().apply_yaml(SERVICE_CIDR).unwrap();
    let (code, out) = diff(&cluster, &[&args[..], &["--json"]].concat());
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap(),
        serde_json::json!([
            {"kind": "service-cidrs", "frontend": "", "service": "", "detail": "missing 10.96.0.0/16"},
        ])
    );
    // The diff listed the ServiceCIDRs, unselected, as the agent's watch does.
    let requests = cluster.api().requests();
    assert!(
        requests.iter().any(
            |r| r.starts_with("GET /apis/networking.k8s.io/v1/servicecidrs") && !r.contains("watch=true")
        ),
        "{requests:?}"
    );

    // The agent catches up; the diff is clean again, unless it is told of a range the agent was not.
    cluster.start_agent();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while cluster.dump_json("service-cidrs") != serde_json::json!([{"cidr": "10.96.0.0/16"}]) {
        assert!(std::time::Instant::now() < deadline, "never programmed:\n{}", cluster.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(diff(&cluster, &args), (0, "no differences\n".to_owned()));
    let (code, table) = diff(&cluster, &[&args[..], &["--service-cidr", "192.0.2.0/24,fd00::/108"]].concat());
    assert_eq!(code, 1, "{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "header, one difference, count:\n{table}");
    // Both families' ranges: SERVICE_CIDRS_V6 is compared as SERVICE_CIDRS_V4 is.
    assert!(
        lines[1].starts_with("service-cidrs") && lines[1].ends_with("missing 192.0.2.0/24, fd00::/108"),
        "{table}"
    );
}
