//! ClusterIP end to end: the real `kproxy agent` in a sandbox node, real nginx
//! and dnsmasq pods, real curl and dig clients. Needs root.
//!
//! The semantic tests run in each datapath (modules `tc`, `socket_lb_with_tc`, `socket_lb_no_tc`,
//! see [`Datapath`]): what the client observes is the same whether the tc programs translate
//! its packets or the socket hooks its connect()/sendmsg(), with or without a tc program on its
//! veth.

mod common;

use std::{collections::BTreeMap, time::Duration};

use common::cluster::{CLIENT_IP, Cluster, DNS_PODS, DNS_VIP, Datapath, WEB_PODS, WEB_VIP};

/// Runs each named test body (a `fn(Datapath)`) in every datapath.
macro_rules! in_every_datapath {
    ($($body:ident),* $(,)?) => {
        mod tc {
            $(#[test] fn $body() { super::$body(super::Datapath::Tc) })*
        }
        mod socket_lb_with_tc {
            $(#[test] fn $body() { super::$body(super::Datapath::SocketLbWithTc) })*
        }
        mod socket_lb_no_tc {
            $(#[test] fn $body() { super::$body(super::Datapath::SocketLbNoTc) })*
        }
    };
}

in_every_datapath!(
    curl_to_the_cluster_ip_reaches_every_backend_in_fair_shares,
    dig_to_the_dns_cluster_ip_is_answered_from_the_vip,
    fragmented_udp_queries_and_answers_go_through_the_cluster_ip,
    a_10_mb_transfer_through_the_vip_arrives_intact_with_software_checksums,
    a_backend_removed_from_the_manifests_gets_no_new_connections,
);

/// A cluster in `datapath`, its sandbox tagged by the mode too.
fn start(tag: &str, datapath: Datapath) -> Cluster {
    let suffix = match datapath {
        Datapath::Tc => "",
        Datapath::SocketLbWithTc => "-t",
        Datapath::SocketLbNoTc => "-n",
    };
    Cluster::start_in(&format!("{tag}{suffix}"), datapath)
}

/// `dig +short +time=2 +tries=1 @server name rtype` (and `extra`) from the client.
fn dig(cluster: &Cluster, name: &str, rtype: &str, extra: &[&str]) -> String {
    let server = format!("@{DNS_VIP}");
    let mut args = vec!["dig", "+short", "+time=2", "+tries=1"];
    args.extend(extra);
    args.extend([server.as_str(), name, rtype]);
    cluster.client_exec(&args).unwrap()
}

fn count_backends(bodies: &str) -> BTreeMap<String, u32> {
    let mut hits = BTreeMap::new();
    for line in bodies.lines().filter(|l| !l.is_empty()) {
        *hits.entry(line.to_owned()).or_default() += 1;
    }
    hits
}

/// `n` new TCP connections from the client to the web VIP (curl closes each).
fn curl_many(cluster: &Cluster, n: usize) -> BTreeMap<String, u32> {
    let url = format!("http://{WEB_VIP}/");
    let mut args = vec!["curl".to_owned(), "-sS".into(), "--max-time".into(), "20".into()];
    args.extend(["-H".into(), "Connection: close".into()]);
    for _ in 0..n {
        args.push(url.clone());
    }
    count_backends(&cluster.client_exec(&args).expect("curl through the VIP"))
}

/// `bpftool -j <args>`, or None when it fails (an object that does not exist).
fn bpftool(args: &[&str]) -> Option<serde_json::Value> {
    let out = std::process::Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .expect("bpftool (cargo xtask setup)");
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

fn curl_to_the_cluster_ip_reaches_every_backend_in_fair_shares(datapath: Datapath) {
    let cluster = start("spread", datapath);
    let curl = |url: &str| cluster.client_exec(&["curl", "-sS", "--max-time", "5", url]);
    let page = curl(&format!("http://{WEB_VIP}/")).unwrap_or_else(|e| {
        panic!(
            "{e:#}\nagent:\n{}\nstats:\n{}\nnet:\n{}\nservices:\n{}",
            cluster.agent_log(),
            cluster.kproxy(&["dump", "stats"]),
            cluster.sandbox.node_exec(["bpftool", "net", "show"]).unwrap(),
            cluster.kproxy(&["dump", "services"])
        )
    });
    assert!(WEB_PODS.iter().any(|(name, _)| page == format!("{name}\n")), "unexpected page {page:?}");

    let hits = curl_many(&cluster, 300);
    assert_eq!(hits.values().sum::<u32>(), 300, "{hits:?}");
    assert_eq!(hits.len(), 3, "every backend answers: {hits:?}");
    // Binomial(300, 1/3): mean 100, sd 8.2; ±5 sd.
    for (backend, n) in &hits {
        assert!((59..=141).contains(n), "{backend} answered {n} of 300: {hits:?}");
    }

    // The backend saw the client pod's own address (no SNAT on pod → ClusterIP).
    let seen = curl(&format!("http://{WEB_VIP}/client")).unwrap();
    assert_eq!(seen.trim(), CLIENT_IP.to_string());
    if datapath != Datapath::Tc {
        // Translated at connect(): no packet was NATed, so nothing is in conntrack.
        return;
    }

    // Every request was a flow of its own, translated by tc (the closed ones may have expired — 10 s
    // after their FIN — and been collected before the dump, so they are counted, not listed).
    assert!(cluster.stat("dnat_new_flow") >= 301, "{:#}", cluster.dump_json("stats"));
    // The flows are in conntrack, original and translated tuples side by side.
    let ct = cluster.dump_json("conntrack");
    let rows = ct.as_array().unwrap();
    assert!(!rows.is_empty(), "no conntrack rows");
    let row = &rows[0];
    assert!(row["original"].as_str().unwrap().ends_with(&format!("-> {WEB_VIP}:80")), "{row}");
    assert!(row["translated"].as_str().unwrap().contains("-> 10.244.0.1"), "{row}");
    assert_eq!(row["service"], "default/web:http");
}

fn dig_to_the_dns_cluster_ip_is_answered_from_the_vip(datapath: Datapath) {
    let cluster = start("dns", datapath);
    // dig drops replies from any source but the server it asked: an answer
    // proves the reply was un-NATed back to 10.96.0.10.
    let mut answered_by = BTreeMap::new();
    for _ in 0..30 {
        let txt = dig(&cluster, "whoami.kproxy.test", "TXT", &[]);
        *answered_by.entry(txt.trim().trim_matches('"').to_owned()).or_insert(0) += 1;
    }
    let names: Vec<&str> = DNS_PODS.iter().map(|(n, _)| *n).collect();
    assert!(answered_by.keys().all(|k| names.contains(&k.as_str())), "{answered_by:?}");
    assert_eq!(answered_by.len(), 2, "both DNS pods answer over 30 queries: {answered_by:?}");

    let a = dig(&cluster, "web.default.svc.cluster.local", "A", &[]);
    assert_eq!(a.trim(), WEB_VIP.to_string());
    // The same over TCP (the dns-tcp port of the Service).
    let a = dig(&cluster, "web.default.svc.cluster.local", "A", &["+tcp"]);
    assert_eq!(a.trim(), WEB_VIP.to_string());
    if datapath != Datapath::Tc {
        return;
    }

    let ct = cluster.dump_json("conntrack");
    assert!(
        ct.as_array().unwrap().iter().any(|r| r["protocol"] == "UDP"
            && r["original"].as_str().unwrap().ends_with(&format!("-> {DNS_VIP}:53"))
            && r["service"] == "kube-system/kube-dns:dns"
            && r["packets_reply"].as_u64() == Some(1)),
        "{ct:#}"
    );
}

/// Kubernetes' e2e tests send 2000-byte UDP payloads: on a 1500-byte MTU they travel in
/// fragments, and only the first carries the ports. A 2 KB DNS query (EDNS padding) and its 2 KB
/// answer get through the ClusterIP both ways.
fn fragmented_udp_queries_and_answers_go_through_the_cluster_ip(datapath: Datapath) {
    let cluster = start("frag", datapath);
    let followed_before = cluster.stat("fragment_followed");
    let script = sandbox::big_dns_query_script(DNS_VIP, 53);
    let mut answered_by = BTreeMap::new();
    for _ in 0..6 {
        let out = cluster.client_exec(&["python3", "-c", &script]).unwrap_or_else(|e| {
            let logs: String = cluster
                .dns
                .iter()
                .map(|p| {
                    std::fs::read_to_string(p.dir().join("dnsmasq/dnsmasq.log")).unwrap_or_default()
                        + &p.exec(["nstat", "-az"]).unwrap_or_default()
                })
                .collect();
            panic!("{e:#}\n{}\n{logs}", cluster.kproxy(&["dump", "stats"]))
        });
        let fields: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(fields.len(), 4, "{out}");
        let (query_len, answer_len): (usize, usize) =
            (fields[0].parse().unwrap(), fields[1].parse().unwrap());
        assert!(query_len > 1500 && answer_len > 1500 + sandbox::BIG_TXT_STRINGS, "{out}");
        assert_eq!(fields[2], DNS_VIP.to_string(), "the answer comes from the ClusterIP");
        *answered_by.entry(fields[3].to_owned()).or_insert(0) += 1;
    }
    let names: Vec<&str> = DNS_PODS.iter().map(|(n, _)| *n).collect();
    assert!(answered_by.keys().all(|k| names.contains(&k.as_str())), "{answered_by:?}");
    // Each query and each answer had a later fragment that followed its first (on the tc path;
    // with socket LB no packet is translated, so no fragment needs following).
    if datapath == Datapath::Tc {
        assert!(cluster.stat("fragment_followed") >= followed_before + 12);
    }
}

fn a_10_mb_transfer_through_the_vip_arrives_intact_with_software_checksums(datapath: Datapath) {
    let cluster = start("big", datapath);
    // Without offload every L4 checksum is computed and verified in software,
    // so a wrong incremental update in the NAT would drop segments.
    cluster.client_exec(&["ethtool", "-K", "eth0", "tx", "off"]).unwrap();
    for pod in &cluster.web {
        pod.exec(["ethtool", "-K", "eth0", "tx", "off"]).unwrap();
    }
    let out = cluster.sandbox.dir().join("big.bin");
    cluster
        .client_exec(&[
            "curl",
            "-sS",
            "--max-time",
            "60",
            "-o",
            out.to_str().unwrap(),
            &format!("http://{WEB_VIP}{}", sandbox::BIG_FILE_PATH),
        ])
        .unwrap();
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), sandbox::BIG_FILE_LEN);
    assert!(got == sandbox::big_file_contents(), "the 10 MB file arrived corrupted");
    let stats = cluster.dump_json("stats");
    let rewrite_failed = stats.as_array().unwrap().iter().find(|r| r["reason"] == "rewrite_failed").unwrap();
    assert_eq!(rewrite_failed["packets"], 0);
}

fn a_backend_removed_from_the_manifests_gets_no_new_connections(datapath: Datapath) {
    let cluster = start("remove", datapath);
    let web = cluster.manifest("web.yaml");
    let text = std::fs::read_to_string(&web).unwrap();
    // Drop web-3's endpoint from the EndpointSlice.
    let start = text.find("- addresses:\n  - 10.244.0.13").expect("web-3 endpoint in the example");
    let end = text[start..].find("ports:").map(|i| start + i).unwrap();
    std::fs::write(&web, format!("{}{}", &text[..start], &text[end..])).unwrap();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 2)]);

    let hits = curl_many(&cluster, 60);
    assert!(!hits.contains_key("web-3"), "web-3 still gets connections: {hits:?}");
    assert_eq!(hits.values().sum::<u32>(), 60);
    assert_eq!(hits.len(), 2, "{hits:?}");
    let backends = cluster.dump_json("backends");
    assert!(
        !backends.as_array().unwrap().iter().any(|b| b["address"] == "10.244.0.13:80"),
        "web-3 is still in the backends map: {backends:#}"
    );
}

#[test]
fn bad_manifests_are_reported_and_the_rest_keeps_working() {
    let cluster = Cluster::start("bad");
    std::fs::write(
        cluster.manifest("broken.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad-port\n  namespace: default\nspec:\n  clusterIP: 10.96.0.50\n  ports:\n  - name: http\n    port: 70000\n    protocol: TCP\n---\nthis: [is not: yaml\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cluster.agent_log().contains("bad-port") {
        assert!(std::time::Instant::now() < deadline, "no error logged:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = cluster.agent_log();
    let line = log.lines().find(|l| l.contains("bad-port")).unwrap();
    assert!(line.contains("broken.yaml") && line.contains("spec.ports[0].port"), "{line}");
    assert!(log.lines().any(|l| l.contains("broken.yaml") && l.contains("document 2")), "{log}");
    // Everything already programmed is still there and still works.
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3), ("10.96.0.10:53", "UDP", 2)]);
    assert!(cluster.backend_count("10.96.0.50:70000", "TCP").is_none());
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));
}

#[test]
fn pods_created_after_the_agent_started_are_served() {
    let cluster = Cluster::start("late");
    let late = cluster.sandbox.add_pod("late", "10.244.0.3".parse().unwrap()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match late.curl(&format!("http://{WEB_VIP}/")) {
            Ok(page) if page.starts_with("web-") => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "late pod not served: {other:?}\n{}",
                cluster.agent_log()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The agent logs each attachment once its pass over the interfaces ends.
    let wanted = format!("{}/ingress", late.host_veth());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !cluster.agent_log().contains(&wanted) {
        assert!(std::time::Instant::now() < deadline, "{wanted} not logged:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_leaves_the_datapath_and_unload_removes_everything() {
    let mut cluster = Cluster::start("unload");
    let status = cluster.stop_agent();
    assert!(status.success(), "agent exit status {status}");
    // The pinned datapath keeps serving without the agent.
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));

    // Both programs are attached through TCX links on all six pod veths...
    let programs: Vec<u64> = ["kproxy_ingress", "kproxy_egress"]
        .iter()
        .map(|p| {
            let pin = cluster.pin_dir.join("progs").join(p);
            let info = bpftool(&["prog", "show", "pinned", pin.to_str().unwrap()]).expect("pinned program");
            info["id"].as_u64().unwrap()
        })
        .collect();
    let links_of = |ids: &[u64]| -> usize {
        // A link another test frees between bpftool's listing and its open fails the listing:
        // list again.
        let links = (0..20)
            .find_map(|_| {
                bpftool(&["link", "show"]).or_else(|| {
                    std::thread::sleep(Duration::from_millis(50));
                    None
                })
            })
            .expect("bpftool link show");
        links.as_array().unwrap().iter().filter(|l| ids.contains(&l["prog_id"].as_u64().unwrap_or(0))).count()
    };
    // Plus the egress program on the node's own interface, which the agent takes as the
    // external one (it holds the node address); that interface also has the external ingress
    // program and XDP.
    assert_eq!(links_of(&programs), 12 + 1);

    let out = cluster.kproxy(&["unload"]);
    // The node interface's three, and the eight socket hooks (IPv4's four and IPv6's four) of the
    // default host-only mode on the cluster's child cgroup.
    assert_eq!(out.matches("detached").count(), 12 + 3 + 8, "{out}");
    assert_eq!(out.matches("detached cgroup@").count(), 8, "{out}");
    assert!(!cluster.pin_dir.exists(), "pins left in {}", cluster.pin_dir.display());
    assert_eq!(links_of(&programs), 0, "links left after unload");
    // With no pin and no link left the kernel frees the programs.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while programs.iter().any(|id| bpftool(&["prog", "show", "id", &id.to_string()]).is_some()) {
        assert!(std::time::Instant::now() < deadline, "programs {programs:?} still loaded after unload");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Without the datapath the VIP is just an unrouted address.
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).is_err());

    let netns_prefix = cluster.sandbox.name().to_owned();
    drop(cluster);
    let left = std::process::Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains(&netns_prefix), "namespaces left behind:\n{left}");
}
