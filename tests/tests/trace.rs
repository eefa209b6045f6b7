//! `kproxy trace` on live traffic: while curl and dig run through the VIPs,
//! the trace shows one DNS flow's four steps in order; two sessions side by side see the
//! same events, and one leaving does not end the other's. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{CLIENT_IP, Cluster, DNS_VIP, Trace, WEB_VIP, kproxy_bin};
use sandbox::Spawned;

/// TRACE[0] as bpftool shows its bytes.
fn trace_flag(cluster: &Cluster) -> Vec<String> {
    let flag = cluster.pin_dir.join("maps/trace");
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&flag)
        .output()
        .unwrap();
    let dump: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    dump[0]["value"].as_array().unwrap().iter().map(|b| b.as_str().unwrap().to_owned()).collect()
}

#[test]
fn trace_shows_the_four_nat_steps_of_a_dns_query() {
    let cluster = Cluster::start("trace");
    let client = CLIENT_IP.to_string();
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--client", &client, "--port", "53"]);
    // Other traffic at the same time: web requests are filtered out by --port.
    let web = cluster
        .client
        .spawn(["sh", "-c", &format!("for i in 1 2 3 4 5; do curl -s http://{WEB_VIP}/ >/dev/null; done")])
        .unwrap();
    let answer = cluster.client.dig(DNS_VIP, "web.default.svc.cluster.local", "A").unwrap();
    assert_eq!(answer.trim(), WEB_VIP.to_string());
    let steps = trace.steps();
    let _ = web.wait_timeout(Duration::from_secs(10));

    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "{steps:#?}");
    let client_end = steps[0]["source"].as_str().unwrap();
    assert!(client_end.starts_with(&format!("{CLIENT_IP}:")), "{steps:#?}");
    assert_eq!(steps[0]["destination"], format!("{DNS_VIP}:53"));
    let backend = steps[1]["destination"].as_str().unwrap();
    assert!(backend == "10.244.0.21:53" || backend == "10.244.0.22:53", "{steps:#?}");
    assert!(
        steps[1]["note"].as_str().unwrap().starts_with("kube-system/kube-dns:dns, backend "),
        "{steps:#?}"
    );
    assert_eq!(steps[2]["source"], backend);
    assert_eq!(steps[2]["destination"], client_end);
    assert_eq!(steps[3]["source"], format!("{DNS_VIP}:53"), "un-NATed back to the ClusterIP");
    assert_eq!(steps[3]["destination"], client_end);
    assert!(steps[3]["note"].as_str().unwrap().contains("conntrack entry created"), "{steps:#?}");

    // The flag is off again once nobody listens: the datapath writes nothing.
    assert_eq!(trace_flag(&cluster), ["0x00"; 4], "TRACE.enabled is still set");
}

/// `kproxy trace --json` of the client's DNS flows, stopping after `events` events.
fn dns_trace(cluster: &Cluster, events: u32) -> Spawned {
    let (bin, pins, client) = (kproxy_bin(), cluster.pin_dir.display().to_string(), CLIENT_IP.to_string());
    let count = events.to_string();
    let trace = cluster
        .sandbox
        .node_spawn([
            bin.to_str().unwrap(),
            "--pin-dir",
            &pins,
            "trace",
            "--client",
            &client,
            "--port",
            "53",
            "--count",
            &count,
            "--timeout",
            "30",
            "--json",
        ])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !trace.log().contains("tracing NAT events") {
        assert!(trace.is_running(), "trace exited: {}", trace.log());
        assert!(Instant::now() < deadline, "trace did not start: {}", trace.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    trace
}

/// The step names a finished session printed.
fn finished_steps(trace: &Spawned) -> Vec<String> {
    let status = trace.wait_timeout(Duration::from_secs(10)).unwrap().unwrap_or_else(|| {
        panic!("the session saw too few events:\n{}", trace.log());
    });
    assert!(status.success(), "{}", trace.log());
    let log = trace.log();
    let steps = log.lines().filter(|l| l.starts_with('{')).map(|l| {
        let step: serde_json::Value = serde_json::from_str(l).unwrap();
        step["step"].as_str().unwrap().to_owned()
    });
    steps.collect()
}

#[test]
fn a_second_trace_session_keeps_its_events_when_the_first_one_leaves() {
    let cluster = Cluster::start("trace2");
    // The first session stops after one DNS query (two events), the second after two queries.
    let first = dns_trace(&cluster, 2);
    let second = dns_trace(&cluster, 4);
    let query = || {
        let answer = cluster.client.dig(DNS_VIP, "web.default.svc.cluster.local", "A").unwrap();
        assert_eq!(answer.trim(), WEB_VIP.to_string());
    };
    query();
    // Both listened at once and both saw the query.
    assert_eq!(finished_steps(&first), ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "{}", first.log());
    query();
    assert_eq!(
        finished_steps(&second),
        ["pre-DNAT", "post-DNAT", "reply", "un-NAT", "pre-DNAT", "post-DNAT", "reply", "un-NAT"],
        "the second session lost the events after the first one left"
    );
    assert_eq!(trace_flag(&cluster), ["0x00"; 4], "TRACE.enabled is still set after both left");
}

#[test]
fn the_datapath_debug_log_reaches_the_agent_log() {
    let mut cluster = Cluster::start("bpflog");
    // The log level is fixed when the programs are loaded: reload with it on.
    cluster.stop_agent();
    cluster.kproxy(&["unload"]);
    cluster.extra_agent_args = vec!["--bpf-debug-log".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    // unload removed the programs too; the maps come back before the veths are attached again.
    cluster.wait_for_attachment();
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.agent_log().contains("new flow to frontend") {
        assert!(
            Instant::now() < deadline,
            "no datapath log record in the agent log:\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let line = cluster.agent_log().lines().find(|l| l.contains("new flow to frontend")).unwrap().to_owned();
    assert!(line.contains("DEBUG") && line.contains("proxy_ebpf"), "{line}");
}
