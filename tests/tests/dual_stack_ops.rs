//! The operator's view of IPv6 flows on a dual-stack node (issue 19), through the real agent and real
//! clients: `kproxy dump conntrack` lists a curl -6 through an IPv6 cluster IP (client → VIP translated
//! to the backend, named by its Service) after the IPv4 flows, `kproxy conntrack flush --service`
//! deletes a Service's flows of both families, the agent purges the IPv6 UDP flows of a backend that
//! left its slice at once (kube-proxy's conntrack clean-up), and its GC expires idle IPv6 flows;
//! `kproxy dump affinity` lists an IPv6 client's sessionAffinity entry, which the GC deletes once its
//! Service has no affinity; `kproxy trace` shows an IPv6 DNS query's and an IPv6 curl's NAT steps, and an ICMPv6
//! port unreachable's quote un-NATed for the client.
//! The cluster is dual_stack.rs's, cut down. Needs root.

mod common;

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use common::cluster::{CLIENT_IP, Cluster, Mode, Trace, UdpOutcome, send_one_datagram};
use common::dual_stack::{WEB_PORTS, dual_pod, endpoints, ipv6_of, slice};
use sandbox::Pod;
use serde_json::Value;

const WEB_VIP4: &str = "10.96.0.210";
const WEB_VIP6: &str = "fd00:10:96::210";
const DNS_VIP6: &str = "fd00:10:96::253";
/// `ops-closed`: 9999/UDP to port 9998 of ops-dns-a, where nothing listens.
const CLOSED_VIP6: &str = "fd00:10:96::254";
const WEB: (&str, Ipv4Addr) = ("ops-web", Ipv4Addr::new(10, 244, 0, 51));
const DNS: [(&str, Ipv4Addr); 2] =
    [("ops-dns-a", Ipv4Addr::new(10, 244, 0, 61)), ("ops-dns-b", Ipv4Addr::new(10, 244, 0, 62))];

/// `ops-web` (an IPv4 and an IPv6 cluster IP, port 80, one backend, a slice per family) and `ops-dns`
/// (IPv6 only, 53/UDP, the one backend named).
fn manifests(dns_backend: (&str, Ipv4Addr)) -> String {
    manifests_with(dns_backend, "")
}

/// [`manifests`] with `web_spec` added to ops-web's spec (two-space indented lines).
fn manifests_with(dns_backend: (&str, Ipv4Addr), web_spec: &str) -> String {
    let dns_ports = "- name: dns\n  port: 53\n  protocol: UDP\n";
    [
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: ops-web\n  namespace: default\nspec:\n  clusterIP: {WEB_VIP4}\n  clusterIPs: [{WEB_VIP4}, \"{WEB_VIP6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n{web_spec}  ports:\n  - port: 80\n    protocol: TCP\n    targetPort: 80\n"
        ),
        slice("ops-web-v4", "ops-web", "IPv4", endpoints(&[WEB], false), WEB_PORTS),
        slice("ops-web-v6", "ops-web", "IPv6", endpoints(&[WEB], true), WEB_PORTS),
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: ops-dns\n  namespace: default\nspec:\n  clusterIP: \"{DNS_VIP6}\"\n  clusterIPs: [\"{DNS_VIP6}\"]\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n"
        ),
        slice(
            "ops-dns-v6",
            "ops-dns",
            "IPv6",
            endpoints(&[dns_backend], true),
            dns_ports,
        ),
    ]
    .join("---\n")
}

/// The example cluster with a dual-stack client, the dual-stack web pod and two dual-stack dnsmasq
/// pods, the agent (with `agent_args`) started on the manifests, `ops-dns` served by `ops-dns-a`.
struct DualStack {
    cluster: Cluster,
    _pods: Vec<Pod>,
}

fn start(tag: &str, agent_args: &[&str]) -> DualStack {
    start_on(tag, agent_args, &manifests(DNS[0]))
}

/// [`start`] on the manifests `yaml`.
fn start_on(tag: &str, agent_args: &[&str], yaml: &str) -> DualStack {
    let mut cluster = Cluster::prepared(tag, Mode::Files);
    cluster.client.add_ipv6(ipv6_of(CLIENT_IP)).unwrap();
    let web = dual_pod(&cluster, WEB.0, WEB.1);
    web.start_nginx(&format!("{}\n", WEB.0)).unwrap();
    let mut pods = vec![web];
    for (name, ip) in DNS {
        let pod = dual_pod(&cluster, name, ip);
        pod.start_dnsmasq(Ipv4Addr::new(10, 96, 0, 210)).unwrap();
        pods.push(pod);
    }
    std::fs::write(cluster.manifest("dual-stack-ops.yaml"), yaml).unwrap();
    cluster.extra_agent_args.extend(agent_args.iter().map(|a| (*a).to_owned()));
    cluster.start_agent();
    cluster.wait_for_frontends(&[
        (&format!("{WEB_VIP4}:80"), "TCP", 1),
        (&format!("[{WEB_VIP6}]:80"), "TCP", 1),
        (&format!("[{DNS_VIP6}]:53"), "UDP", 1),
    ]);
    cluster.wait_for_attachment();
    DualStack { cluster, _pods: pods }
}

/// `kproxy dump conntrack --json` rows.
fn conntrack(cluster: &Cluster) -> Vec<Value> {
    cluster.dump_json("conntrack").as_array().unwrap().clone()
}

/// A TXT query from the client's fixed IPv6 port 35353 to the IPv6 DNS cluster IP: the name of the
/// dnsmasq pod that answered.
fn whoami(cluster: &Cluster) -> String {
    let source = format!("{}#35353", ipv6_of(CLIENT_IP));
    let out = cluster
        .client
        .exec([
            "dig",
            "+short",
            "+time=1",
            "+tries=1",
            "-b",
            &source,
            &format!("@{DNS_VIP6}"),
            "whoami.kproxy.test",
            "TXT",
        ])
        .unwrap_or_default();
    out.trim().trim_matches('"').to_owned()
}

/// The rows whose translated tuple goes to `backend` (`[addr]:port`).
fn flows_to<'a>(rows: &'a [Value], backend: &str) -> Vec<&'a Value> {
    rows.iter()
        .filter(|r| r["translated"].as_str().unwrap_or_default().ends_with(&format!("-> {backend}")))
        .collect()
}

/// One series of the agent's `/metrics` (`name{labels}` as written), when present.
fn metric(cluster: &Cluster, series: &str) -> Option<f64> {
    let (code, text) = cluster.node_curl("http://127.0.0.1:10249/metrics");
    assert_eq!(code, 200, "{text}");
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until `done` holds, or fails with `what` and the agent's log.
fn wait_until(cluster: &Cluster, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}; agent log:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn an_ipv6_flow_is_dumped_translated_and_flushed_with_its_service() {
    // A short GC interval: the conntrack fill in /metrics is the GC's count.
    let ds = start("dsops-dump", &["--conntrack-gc-interval", "1s"]);
    let cluster = &ds.cluster;
    let client = &cluster.client;
    assert_eq!(client.curl(&format!("http://{WEB_VIP4}/")).unwrap(), format!("{}\n", WEB.0));
    assert_eq!(client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap(), format!("{}\n", WEB.0));

    let rows = conntrack(cluster);
    let client6 = format!("[{}]:", ipv6_of(CLIENT_IP));
    let backend6 = format!("[{}]:80", ipv6_of(WEB.1));
    let v6 = flows_to(&rows, &backend6);
    assert_eq!(v6.len(), 1, "one IPv6 flow to the backend in {rows:#?}");
    let row = v6[0];
    let original = row["original"].as_str().unwrap();
    assert!(
        original.starts_with(&client6) && original.ends_with(&format!(" -> [{WEB_VIP6}]:80")),
        "client → VIP: {row}"
    );
    let sport = original.split(" -> ").next().unwrap().rsplit(':').next().unwrap();
    assert_eq!(
        row["translated"],
        format!("{client6}{sport} -> {backend6}"),
        "the client's own address and port kept"
    );
    assert_eq!((&row["protocol"], &row["hairpin"]), (&Value::from("TCP"), &Value::from(false)));
    assert_eq!(row["service"], "default/ops-web:", "named by the shared rev-NAT id");
    assert!(
        row["packets_out"].as_u64().unwrap() >= 3 && row["packets_reply"].as_u64().unwrap() >= 2,
        "{row}"
    );
    assert!(row["time_left_seconds"].as_f64().unwrap() > 0.0, "{row}");
    // IPv4 flows first, then IPv6.
    let v4_position =
        rows.iter().position(|r| r["translated"].as_str().unwrap().ends_with(&format!("-> {}:80", WEB.1)));
    let v6_position = rows.iter().position(|r| r == row);
    assert!(v4_position.is_some() && v4_position < v6_position, "{rows:#?}");
    // /metrics counts the IPv6 maps (conntrack by the GC's scan, the service maps by the Syncer) and shows
    // the sync under both families.
    wait_until(cluster, "no IPv6 conntrack entries in /metrics", Duration::from_secs(10), || {
        metric(cluster, r#"kproxy_bpf_map_entries{map="conntrack_v6"}"#) >= Some(2.0)
    });
    assert!(
        metric(cluster, r#"kproxy_bpf_map_entries{map="services_v6"}"#) >= Some(2.0),
        "slot 0 and 1 at least"
    );
    let synced = |family| {
        metric(
            cluster,
            &format!("kubeproxy_sync_proxy_rules_last_timestamp_seconds{{ip_family=\"{family}\"}}"),
        )
    };
    assert!(synced("IPv6") > Some(0.0) && synced("IPv6") == synced("IPv4"));
    // The table shows the same, in the bracket notation of dump services.
    let table = cluster.kproxy(&["dump", "conntrack"]);
    assert!(table.contains(&format!("-> {backend6}")), "{table}");

    // A flush by Service takes both families' flows of it, both directions, and nothing else.
    let out = cluster.kproxy(&["conntrack", "flush", "--service", "default/ops-web"]);
    assert_eq!(
        out.trim(),
        "deleted 4 conntrack entries of Service default/ops-web",
        "two flows, two entries each"
    );
    let rows = conntrack(cluster);
    assert!(rows.iter().all(|r| r["service"] != "default/ops-web:"), "{rows:#?}");
    // And the Service still answers: the next connection is a new flow.
    assert_eq!(client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap(), format!("{}\n", WEB.0));
    assert_eq!(flows_to(&conntrack(cluster), &backend6).len(), 1);
}

#[test]
fn the_ipv6_udp_flows_of_a_removed_backend_are_purged_at_once() {
    let ds = start("dsops-purge", &[]);
    let cluster = &ds.cluster;
    assert_eq!(whoami(cluster), DNS[0].0);
    let old_backend = format!("[{}]:53", ipv6_of(DNS[0].1));
    let rows = conntrack(cluster);
    let flow = flows_to(&rows, &old_backend);
    assert_eq!(flow.len(), 1, "{rows:#?}");
    assert_eq!((&flow[0]["protocol"], &flow[0]["state"]), (&Value::from("UDP"), &Value::from("OPEN")));

    // A rollout: the slice names ops-dns-b instead. No packet is sent until the flow is gone, and the
    // UDP timeout (60 s) is far off: only the agent's purge removes it.
    std::fs::write(cluster.manifest("dual-stack-ops.yaml"), manifests(DNS[1])).unwrap();
    wait_until(
        cluster,
        "the flow to the removed IPv6 backend is still in conntrack",
        Duration::from_secs(15),
        || flows_to(&conntrack(cluster), &old_backend).is_empty(),
    );
    assert!(cluster.agent_log().contains("purged the conntrack entries of removed UDP backends"));
    // kube-proxy's reconciler counter, per family: the two IPv6 entries, no IPv4 one.
    let deleted = |family| {
        metric(
            cluster,
            &format!("kubeproxy_conntrack_reconciler_deleted_entries_total{{ip_family=\"{family}\"}}"),
        )
    };
    assert_eq!((deleted("IPv6"), deleted("IPv4")), (Some(2.0), Some(0.0)));
    // The client, from the same port, now reaches the new backend.
    assert_eq!(whoami(cluster), DNS[1].0);
}

#[test]
fn idle_ipv6_flows_are_expired_by_the_agents_gc() {
    // UDP flows idle for 5 s are dead; the GC looks every second.
    let ds = start("dsops-gc", &["--conntrack-udp-timeout", "5s", "--conntrack-gc-interval", "1s"]);
    let cluster = &ds.cluster;
    assert_eq!(whoami(cluster), DNS[0].0);
    let backend = format!("[{}]:53", ipv6_of(DNS[0].1));
    let rows = conntrack(cluster);
    assert_eq!(flows_to(&rows, &backend).len(), 1, "the flow, read within its 5 s: {rows:#?}");
    // No packet is sent after it: the datapath, which expires a flow when its next packet comes, never
    // sees it again, and the LRU is nowhere near full. Only the GC removes it.
    wait_until(cluster, "the idle IPv6 flow was not collected", Duration::from_secs(20), || {
        flows_to(&conntrack(cluster), &backend).is_empty()
    });
}

const WEB_AFFINITY: &str =
    "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 600\n";

#[test]
fn an_ipv6_clients_session_affinity_is_dumped_and_collected_when_the_service_drops_it() {
    let ds =
        start_on("dsops-affinity", &["--conntrack-gc-interval", "1s"], &manifests_with(DNS[0], WEB_AFFINITY));
    let cluster = &ds.cluster;
    let client = &cluster.client;
    assert_eq!(client.curl(&format!("http://{WEB_VIP4}/")).unwrap(), format!("{}\n", WEB.0));
    assert_eq!(client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap(), format!("{}\n", WEB.0));

    // One entry per client address and Service port: the IPv4 client's, then the IPv6 one's.
    let affinity = cluster.dump_json("affinity");
    let rows = affinity.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{affinity:#}");
    assert_eq!(
        (&rows[0]["client"], &rows[0]["backend"]),
        (&Value::from(CLIENT_IP.to_string()), &Value::from(format!("{}:80", WEB.1))),
        "{affinity:#}"
    );
    let row = &rows[1];
    let client6 = ipv6_of(CLIENT_IP).to_string();
    let backend6 = format!("[{}]:80", ipv6_of(WEB.1));
    assert_eq!(row["client"], client6, "{affinity:#}");
    assert_eq!(row["backend"], backend6, "the id resolved in BACKENDS_V6: {row}");
    assert_eq!(row["frontend"], format!("[{WEB_VIP6}]:80"), "{row}");
    assert_eq!((&row["protocol"], &row["service"]), (&Value::from("TCP"), &Value::from("default/ops-web:")));
    let left = row["time_left_seconds"].as_f64().unwrap();
    assert!(left > 590.0 && left <= 600.0, "the Service's 600 s: {row}");
    let table = cluster.kproxy(&["dump", "affinity"]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&client6) && l.contains(&backend6) && l.contains("default/ops-web")),
        "{table}"
    );

    // The Service drops its affinity: no packet comes and the 600 s are far off, so only the GC removes
    // the entries (the IPv6 one as the IPv4 one), and counts them.
    std::fs::write(cluster.manifest("dual-stack-ops.yaml"), manifests(DNS[0])).unwrap();
    wait_until(
        cluster,
        "the affinity entries outlived the Service's affinity",
        Duration::from_secs(40),
        || cluster.dump_json("affinity").as_array().unwrap().is_empty(),
    );
    wait_until(cluster, "the GC did not count both entries", Duration::from_secs(10), || {
        metric(cluster, "kproxy_affinity_gc_deleted_total") >= Some(2.0)
    });
}

#[test]
fn doctor_checks_ipv6_forwarding_on_a_node_serving_ipv6_services() {
    let ds = start("dsops-doctor", &[]);
    let cluster = &ds.cluster;
    let doctor = |cluster: &Cluster| -> Value {
        let bin = std::env::var("KPROXY_BIN").expect("KPROXY_BIN (run through cargo xtask test)");
        let pin_dir = cluster.pin_dir.display().to_string();
        // Other checks may FAIL in a sandbox (exit status 1): the report is read either way.
        let out = cluster
            .sandbox
            .node_exec_output([
                bin.as_str(),
                "--pin-dir",
                &pin_dir,
                "doctor",
                "--json",
                "--interfaces",
                "veth*",
            ])
            .unwrap();
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
    };
    let report = doctor(cluster);
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ipv6_forward")
        .unwrap_or_else(|| panic!("no ipv6_forward check with IPv6 Services programmed: {report:#}"));
    // The node namespace forwards IPv6 (the dual-stack pods need it), so it is not off at runtime;
    // whether the host's sysctl files persist it decides OK or WARN, and a WARN names the Services.
    let finding = check["finding"].as_str().unwrap();
    match check["status"].as_str().unwrap() {
        "OK" => assert!(finding.starts_with("1 at runtime;"), "{check}"),
        "WARN" => assert!(finding.ends_with("; 2 IPv6 frontends are programmed"), "{check}"),
        other => panic!("{other}: {check}"),
    }
    // Off at runtime, with IPv6 Services programmed: FAIL, with the command that turns it back on.
    cluster.sandbox.node_exec(["sysctl", "-qw", "net.ipv6.conf.all.forwarding=0"]).unwrap();
    let report = doctor(cluster);
    cluster.sandbox.node_exec(["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]).unwrap();
    let check = report["checks"].as_array().unwrap().iter().find(|c| c["name"] == "ipv6_forward").unwrap();
    assert_eq!(check["status"], "FAIL", "{check}");
    assert!(check["finding"].as_str().unwrap().contains("the node routes no IPv6 pod traffic"), "{check}");
    assert!(
        check["fix"].as_str().unwrap().starts_with("sysctl -w net.ipv6.conf.all.forwarding=1"),
        "{check}"
    );
}

#[test]
fn trace_shows_the_nat_steps_of_ipv6_flows() {
    let ds = start("dsops-trace", &[]);
    let cluster = &ds.cluster;
    let client6 = ipv6_of(CLIENT_IP).to_string();
    let dns_backend = format!("[{}]:53", ipv6_of(DNS[0].1));

    // dig over UDP from the client's fixed port 35353: the four steps of its one flow.
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--client", &client6, "--port", "53"]);
    assert_eq!(whoami(cluster), DNS[0].0, "dig accepts only the answer from the address it asked");
    let steps = trace.steps();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "{steps:#?}");
    let client_end = format!("[{client6}]:35353");
    let vip = format!("[{DNS_VIP6}]:53");
    let tuples: Vec<(&str, &str)> =
        steps.iter().map(|s| (s["source"].as_str().unwrap(), s["destination"].as_str().unwrap())).collect();
    assert_eq!(
        tuples,
        [
            (client_end.as_str(), vip.as_str()),
            (client_end.as_str(), dns_backend.as_str()),
            (dns_backend.as_str(), client_end.as_str()),
            (vip.as_str(), client_end.as_str()),
        ],
        "{steps:#?}"
    );
    assert!(steps.iter().all(|s| s["protocol"] == "udp"), "{steps:#?}");
    assert_eq!(steps[1]["note"], "default/ops-dns:dns, backend 1 of 1, new flow", "{steps:#?}");
    assert!(
        steps[3]["note"].as_str().unwrap().starts_with("default/ops-dns:dns, conntrack entry created "),
        "{steps:#?}"
    );

    // curl -6 over TCP: the SYN translated to the backend and the SYN-ACK back from the VIP.
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--client", &client6, "--port", "80"]);
    assert_eq!(cluster.client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap(), format!("{}\n", WEB.0));
    let steps = trace.steps();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "reply", "un-NAT"], "{steps:#?}");
    let backend = format!("[{}]:80", ipv6_of(WEB.1));
    assert_eq!(steps[0]["destination"], format!("[{WEB_VIP6}]:80"), "{steps:#?}");
    assert_eq!(steps[1]["destination"], backend, "{steps:#?}");
    assert_eq!(steps[1]["source"], steps[0]["source"], "the client's own address and port kept");
    assert_eq!(steps[2]["source"], backend, "{steps:#?}");
    assert_eq!(steps[3]["source"], format!("[{WEB_VIP6}]:80"), "un-NATed back to the VIP");
    assert_eq!(steps[3]["destination"], steps[0]["source"]);
    assert!(steps.iter().all(|s| s["protocol"] == "tcp"), "{steps:#?}");
    assert_eq!(steps[1]["note"], "default/ops-web:, backend 1 of 1, new flow", "{steps:#?}");

    // An IPv4 client filter sees none of the IPv6 flow's events: the trace of a v4 curl only.
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--client", &CLIENT_IP.to_string()]);
    assert_eq!(cluster.client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap(), format!("{}\n", WEB.0));
    assert_eq!(cluster.client.curl(&format!("http://{WEB_VIP4}/")).unwrap(), format!("{}\n", WEB.0));
    let steps = trace.steps();
    assert_eq!(steps[0]["destination"], format!("{WEB_VIP4}:80"), "{steps:#?}");
}

/// An ICMPv6 port unreachable from the backend about an IPv6 UDP flow reaches the client's socket
/// as a refusal at once — its quote rewritten back to the cluster IP, which it comes from — and
/// `kproxy trace` shows the quote as it arrived and as the client got it, as IPv4's in
/// service_semantics.rs.
#[test]
fn trace_shows_an_icmpv6_errors_quote_un_nated_for_the_client() {
    let closed = [
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: ops-closed\n  namespace: default\nspec:\n  clusterIP: \"{CLOSED_VIP6}\"\n  clusterIPs: [\"{CLOSED_VIP6}\"]\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n  ports:\n  - name: closed\n    port: 9999\n    protocol: UDP\n    targetPort: 9998\n"
        ),
        slice(
            "ops-closed-v6",
            "ops-closed",
            "IPv6",
            endpoints(&[DNS[0]], true),
            "- name: closed\n  port: 9998\n  protocol: UDP\n",
        ),
    ];
    let yaml = [manifests(DNS[0]), closed.join("---\n")].join("---\n");
    let ds = start_on("dsops-icmp6", &[], &yaml);
    let cluster = &ds.cluster;
    cluster.wait_for_frontends(&[(&format!("[{CLOSED_VIP6}]:9999"), "UDP", 1)]);
    let before = cluster.stat("icmp_error_unnat");
    let trace = Trace::start(&cluster.sandbox, &cluster.pin_dir, &["--port", "9999"]);
    let outcome = send_one_datagram(&cluster.client, CLOSED_VIP6, 9999);
    assert!(matches!(outcome, UdpOutcome::Refused(s) if s < 1.0), "{outcome:?}");
    assert_eq!(cluster.stat("icmp_error_unnat"), before + 1);

    let steps = trace.steps();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["pre-DNAT", "post-DNAT", "ICMP", "un-NAT"], "{steps:#?}");
    let client_end = steps[0]["source"].as_str().unwrap();
    assert!(client_end.starts_with(&format!("[{}]:", ipv6_of(CLIENT_IP))), "{steps:#?}");
    let backend = format!("[{}]:9998", ipv6_of(DNS[0].1));
    assert_eq!(steps[2]["source"], client_end, "the quote as it arrived: {steps:#?}");
    assert_eq!(steps[2]["destination"], backend, "{steps:#?}");
    assert_eq!(steps[3]["source"], client_end, "{steps:#?}");
    assert_eq!(steps[3]["destination"], format!("[{CLOSED_VIP6}]:9999"), "as the client got it: {steps:#?}");
    assert!(steps.iter().all(|s| s["protocol"] == "udp"), "{steps:#?}");
    assert!(
        steps[3]["note"].as_str().unwrap().starts_with("default/ops-closed:closed: the quote rewritten"),
        "{steps:#?}"
    );
}
