//! The manifests source under bad input and faults (issue 14): the real agent
//! with `--manifests`, the real datapath, curl from a sandbox pod. For each
//! fault the programmed state (`kproxy dump services` and `backends`) stays
//! what it was, the error names the file and the object, and the web Service
//! keeps answering; a FIFO and a deeply nested file never keep `/healthz`
//! from answering within a second, and later changes are still applied.
//! Needs root.

mod common;

use std::{
    io::Write as _,
    path::Path,
    time::{Duration, Instant},
};

use common::cluster::{Cluster, WEB_PODS, WEB_VIP};
use sandbox::Spawned;

/// Several of the agent's polls (`--poll-ms 100`): a fault it would act on is
/// acted on within this.
const FAULT_WINDOW: Duration = Duration::from_millis(1500);

/// What the datapath serves: frontends with their slots, and backends.
fn programmed(cluster: &Cluster) -> (serde_json::Value, serde_json::Value) {
    (cluster.dump_json("services"), cluster.dump_json("backends"))
}

/// One request to the web Service's ClusterIP from the client pod, answered by a web pod.
fn web_answers(cluster: &Cluster) {
    let body = cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap_or_else(|e| {
        panic!(
            "curl {WEB_VIP}: {e:#}\nservices:\n{}\nagent:\n{}",
            cluster.kproxy(&["dump", "services"]),
            cluster.agent_log()
        )
    });
    assert!(WEB_PODS.iter().any(|(name, _)| body == format!("{name}\n")), "answered {body:?}");
}

/// Throughout `window`, the datapath holds `before` and the web Service answers.
fn holds_for(cluster: &Cluster, before: &(serde_json::Value, serde_json::Value), window: Duration) {
    let until = Instant::now() + window;
    while Instant::now() < until {
        assert_eq!(
            &programmed(cluster),
            before,
            "the programmed state changed; agent:\n{}",
            cluster.agent_log()
        );
        web_answers(cluster);
    }
}

/// Waits until the agent's log has `text`.
fn wait_for_log(cluster: &Cluster, text: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = cluster.agent_log();
        if log.contains(text) {
            return log;
        }
        assert!(Instant::now() < deadline, "the agent never logged {text:?}:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The log line that has all of `parts`, once there is one (waiting at most 20 s).
fn find_logged_line(cluster: &Cluster, parts: &[&str]) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = cluster.agent_log();
        if let Some(line) = log.lines().find(|line| parts.iter().all(|part| line.contains(part))) {
            return Some(line.to_owned());
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn logged_line(cluster: &Cluster, parts: &[&str]) -> String {
    find_logged_line(cluster, parts)
        .unwrap_or_else(|| panic!("no log line with all of {parts:?}:\n{}", cluster.agent_log()))
}

/// A gauge from the agent's `/metrics`.
fn gauge(cluster: &Cluster, name: &str) -> Option<u64> {
    let (code, body) = cluster.node_curl("http://127.0.0.1:10249/metrics");
    assert_eq!(code, 200, "{body}");
    body.lines().find_map(|line| line.strip_prefix(&format!("{name} "))).map(|v| v.parse().unwrap())
}

fn replace_in(path: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(from), "{} has no {from:?}", path.display());
    std::fs::write(path, text.replacen(from, to, 1)).unwrap();
}

/// A Service that comes after the fault: applied, it shows the agent still follows the files.
const LATE: &str = "apiVersion: v1
kind: Service
metadata: {name: late, namespace: default}
spec:
  clusterIP: 10.96.0.201
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: late-1, namespace: default, labels: {kubernetes.io/service-name: late}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11]}]
ports: [{name: http, port: 80, protocol: TCP}]
";

fn later_changes_are_applied(cluster: &Cluster) {
    std::fs::write(cluster.manifest("late.yaml"), LATE).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.201:80", "TCP", 1)]);
    assert_eq!(cluster.client.curl("http://10.96.0.201/").unwrap(), "web-1\n");
}

/// `/healthz` asked every 50 ms from the node, each answer awaited for at most
/// a second: a liveness bound, not a measurement.
struct HealthProbe {
    process: Spawned,
    stop: std::path::PathBuf,
}

const PROBE: &str = r#"
import json, os, sys, time, urllib.error, urllib.request
stop = sys.argv[1]
probes, late = 0, []
while not os.path.exists(stop):
    started = time.monotonic()
    try:
        with urllib.request.urlopen("http://127.0.0.1:10256/healthz", timeout=1) as answer:
            answer.read()
        outcome = None
    except urllib.error.HTTPError as answer:
        outcome = None  # answered, whatever it says
    except Exception as error:
        outcome = repr(error)
    took = time.monotonic() - started
    probes += 1
    if outcome is not None or took > 1:
        late.append(f"{outcome or 'answered'} after {took:.2f} s")
    time.sleep(0.05)
print(json.dumps({"probes": probes, "late": late}), flush=True)
"#;

impl HealthProbe {
    fn start(cluster: &Cluster) -> Self {
        let stop = cluster.sandbox.dir().join("health-probe-stop");
        let _ = std::fs::remove_file(&stop);
        let process =
            cluster.sandbox.node_spawn(["python3", "-c", PROBE, stop.to_str().unwrap()]).expect("python3");
        HealthProbe { process, stop }
    }

    /// Stops probing; every probe was answered within a second.
    fn answered_throughout(self) {
        std::fs::write(&self.stop, "").unwrap();
        let status = self.process.wait_timeout(Duration::from_secs(10)).unwrap().expect("the probe stops");
        let log = self.process.log();
        assert!(status.success(), "{log}");
        let report: serde_json::Value =
            serde_json::from_str(log.trim()).unwrap_or_else(|e| panic!("{e}: {log}"));
        assert!(report["probes"].as_u64().unwrap() >= 10, "{report}");
        assert_eq!(report["late"], serde_json::json!([]), "/healthz did not answer within a second");
    }
}

#[test]
fn a_yaml_error_in_a_programmed_services_document_keeps_it_programmed() {
    let cluster = Cluster::start("mf-yaml");
    let before = programmed(&cluster);
    let web = cluster.manifest("web.yaml");
    replace_in(&web, "  clusterIP: 10.96.0.100\n", "  clusterIP: [10.96.0.100\n");

    holds_for(&cluster, &before, FAULT_WINDOW);
    let line = logged_line(&cluster, &["web.yaml (document 1): Service default/web: invalid YAML"]);
    assert!(line.contains("the last good version stays programmed"), "{line}");
    holds_for(&cluster, &before, FAULT_WINDOW);
    assert_eq!(gauge(&cluster, "kproxy_manifest_objects_kept_last_good"), Some(1));
    assert_eq!(gauge(&cluster, "kproxy_manifest_errors"), Some(1));

    // Fixed, it reads cleanly again, and the files are still followed.
    replace_in(&web, "  clusterIP: [10.96.0.100\n", "  clusterIP: 10.96.0.100\n");
    let deadline = Instant::now() + Duration::from_secs(20);
    while gauge(&cluster, "kproxy_manifest_objects_kept_last_good") != Some(0) {
        assert!(Instant::now() < deadline, "{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(programmed(&cluster), before);
    later_changes_are_applied(&cluster);
}

#[test]
fn a_type_error_in_an_endpoint_slice_keeps_its_backends() {
    let cluster = Cluster::start("mf-type");
    let before = programmed(&cluster);
    // The slice's port (the Service's is indented under spec).
    replace_in(
        &cluster.manifest("web.yaml"),
        "\n- name: http\n  port: 80\n",
        "\n- name: http\n  port: eighty\n",
    );

    holds_for(&cluster, &before, FAULT_WINDOW);
    let line =
        logged_line(&cluster, &["web.yaml (document 2): EndpointSlice default/web-7x2kq: ports[0].port"]);
    assert!(line.contains("invalid type: string \"eighty\""), "{line}");
    assert!(line.contains("the last good version stays programmed"), "{line}");
    holds_for(&cluster, &before, FAULT_WINDOW);
    assert_eq!(gauge(&cluster, "kproxy_manifest_objects_kept_last_good"), Some(1));
}

/// Validation, not parsing: the documents parse, but the new versions have a cluster IP that is no
/// address (the whole Service would be skipped) and endpoints whose addresses are not addresses (every
/// backend would go). Both keep their last valid version (`last_good.rs`), for the API server source
/// too; the fixed versions are applied.
#[test]
fn an_invalid_new_version_keeps_the_last_valid_one() {
    let cluster = Cluster::start("mf-invalid");
    let before = programmed(&cluster);
    let web = cluster.manifest("web.yaml");
    replace_in(&web, "  clusterIP: 10.96.0.100\n", "  clusterIP: 10.96.0.300\n");
    for i in 11..=13 {
        replace_in(&web, &format!("  - 10.244.0.{i}\n"), &format!("  - 10.244.0.{}\n", i + 290));
    }

    let service = logged_line(
        &cluster,
        &["Service default/web", "spec.clusterIP", "last good version stays programmed"],
    );
    assert!(service.contains("\"10.96.0.300\" is not an IP address"), "{service}");
    let slice = logged_line(
        &cluster,
        &[
            "EndpointSlice default/web-7x2kq",
            "endpoints[0].addresses[0]",
            "last good version stays programmed",
        ],
    );
    assert!(slice.contains("10.244.0.301"), "{slice}");
    holds_for(&cluster, &before, FAULT_WINDOW);

    // Fixed, with a change: the new version is programmed.
    replace_in(&web, "  clusterIP: 10.96.0.300\n", "  clusterIP: 10.96.0.100\n");
    for i in 11..=13 {
        replace_in(&web, &format!("  - 10.244.0.{}\n", i + 290), &format!("  - 10.244.0.{i}\n"));
    }
    replace_in(&web, "  - 10.244.0.13\n", "  - 10.244.0.12\n");
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);
    web_answers(&cluster);
}

#[test]
fn the_manifests_directory_vanishing_changes_nothing() {
    let cluster = Cluster::start("mf-vanish");
    let before = programmed(&cluster);
    let moved = cluster.manifests.with_extension("moved");
    std::fs::rename(&cluster.manifests, &moved).unwrap();
    let restore = scopeguard(|| {
        let _ = std::fs::rename(&moved, &cluster.manifests);
    });

    holds_for(&cluster, &before, FAULT_WINDOW);
    let line =
        logged_line(&cluster, &["the manifests cannot be read; everything stays programmed as last read"]);
    assert!(line.contains(&cluster.manifests.display().to_string()), "{line}");
    assert!(line.contains("WARN"), "{line}");
    holds_for(&cluster, &before, FAULT_WINDOW);
    // Both Services and both slices.
    assert_eq!(gauge(&cluster, "kproxy_manifest_objects_kept_last_good"), Some(4));

    drop(restore);
    wait_for_log(&cluster, "the manifests can be read again");
    holds_for(&cluster, &before, FAULT_WINDOW);
    later_changes_are_applied(&cluster);
}

/// Runs `f` when dropped (also when the test panics).
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// `web.yaml` rewritten in place in two writes with a pause between them
/// longer than many polls, as a slow writer (or `cat >`) does: first cut at the
/// document boundary (the Service without its slice), then emptied.
#[test]
fn a_file_rewritten_in_two_writes_causes_no_outage() {
    let cluster = Cluster::start("mf-two-writes");
    let before = programmed(&cluster);
    let path = cluster.manifest("web.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let slice_at = text.find("\n---\n").unwrap() + "\n---\n".len();
    for first in [&text[..slice_at], ""] {
        let mut file = std::fs::OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
        file.write_all(first.as_bytes()).unwrap();
        holds_for(&cluster, &before, FAULT_WINDOW);
        file.write_all(&text.as_bytes()[first.len()..]).unwrap();
        drop(file);
        holds_for(&cluster, &before, FAULT_WINDOW);
    }
    logged_line(&cluster, &["web.yaml", "the file is now the start of what it held (a write in progress?)"]);
    logged_line(&cluster, &["web.yaml", "the file is empty now (a write in progress?)"]);
    later_changes_are_applied(&cluster);
}

/// A file that sorts first claims the running web Service's ClusterIP with a
/// name that sorts first and a backend with nothing on port 80: the address
/// stays with default/web until that Service goes.
#[test]
fn a_new_file_that_sorts_first_does_not_take_a_running_services_cluster_ip() {
    let cluster = Cluster::start("mf-claim");
    let before = programmed(&cluster);
    let thief = "apiVersion: v1
kind: Service
metadata: {name: aaa, namespace: default}
spec:
  clusterIP: 10.96.0.100
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: aaa-1, namespace: default, labels: {kubernetes.io/service-name: aaa}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.21]}]
ports: [{name: http, port: 80, protocol: TCP}]
";
    std::fs::write(cluster.manifest("00-aaa.yaml"), thief).unwrap();

    holds_for(&cluster, &before, FAULT_WINDOW);
    let line = logged_line(&cluster, &["00-aaa.yaml (document 1): Service default/aaa: spec.ports[0]"]);
    assert!(line.contains("10.96.0.100:80/TCP is already used by Service default/web"), "{line}");
    holds_for(&cluster, &before, FAULT_WINDOW);

    // Its owner gone, the address is the newcomer's.
    let web = cluster.manifest("web.yaml");
    std::fs::rename(&web, web.with_extension("yaml.off")).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 1)]);
    let services = cluster.dump_json("services");
    let slot0 =
        services.as_array().unwrap().iter().find(|r| r["frontend"] == "10.96.0.100:80" && r["slot"] == 0);
    assert_eq!(slot0.unwrap()["service"], "default/aaa:http", "{services:#}");
}

#[test]
fn a_fifo_named_yaml_does_not_wedge_the_agent() {
    let mut cluster = Cluster::start("mf-fifo");
    let before = programmed(&cluster);
    let probe = HealthProbe::start(&cluster);
    let fifo = cluster.manifest("00-fifo.yaml");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());

    holds_for(&cluster, &before, FAULT_WINDOW);
    let line = find_logged_line(&cluster, &["00-fifo.yaml: not a regular file (a FIFO); it is not read"]);
    probe.answered_throughout();
    assert!(line.is_some(), "the FIFO is not reported:\n{}", cluster.agent_log());
    holds_for(&cluster, &before, FAULT_WINDOW);
    later_changes_are_applied(&cluster);
    let status = cluster.stop_agent();
    assert!(status.success(), "the agent did not stop on SIGTERM: {status:?}");
}

/// A 200 KB document nested 100,000 levels and a mapping nested 50,000 levels
/// (43 s for the YAML parser alone): rejected at once, naming the document.
#[test]
fn a_deeply_nested_file_does_not_stall_the_agent() {
    let cluster = Cluster::start("mf-deep");
    let before = programmed(&cluster);
    let probe = HealthProbe::start(&cluster);
    let seq = "[".repeat(100_000) + &"]".repeat(100_000);
    let map = "{a: ".repeat(50_000) + "1" + &"}".repeat(50_000);
    // Written under a name the agent does not read, then renamed: the convention for writing manifests.
    let path = cluster.manifest("00-deep.yaml");
    std::fs::write(path.with_extension("tmp"), format!("{seq}\n---\n{map}\n")).unwrap();
    std::fs::rename(path.with_extension("tmp"), &path).unwrap();

    holds_for(&cluster, &before, FAULT_WINDOW);
    let reported: Vec<Option<String>> = [1, 2]
        .iter()
        .map(|document| {
            let line =
                format!("00-deep.yaml (document {document}): collections nested more than 100 levels deep");
            find_logged_line(&cluster, &[&line])
        })
        .collect();
    probe.answered_throughout();
    assert!(reported.iter().all(Option::is_some), "{reported:?}\n{}", cluster.agent_log());
    holds_for(&cluster, &before, FAULT_WINDOW);
    later_changes_are_applied(&cluster);
}
