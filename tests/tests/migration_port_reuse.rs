//! A client reuses a source port across the move from kube-proxy to kproxy (issue 17): its earlier
//! connection to a Service went through kube-proxy's rules and is over, but netfilter keeps its
//! entry (TIME_WAIT, 120 s) with the reply tuple backend → client:port. The new connection from
//! the same port to the same Service is kproxy's; with one backend, kproxy's DNAT gives it that
//! very reply tuple. After `cleanup-kube-proxy --apply` no NAT hook is left to resolve the clash
//! (with one, netfilter remaps the port and kproxy's reverse NAT at the pod still un-NATs the
//! reply), but connection tracking still runs — kubelet's `KUBE-FIREWALL` rule, reproduced here,
//! reads conntrack state, as do most node firewalls and CNIs — and netfilter drops the new entry
//! when it confirms it: the client's SYNs go unanswered until the old entry expires. kproxy marks
//! the reply tuples of the flows netfilter translated (INHERITED_V4) and remaps the new flow's
//! source port itself (`port_remapped`), so the client gets its answer at once. Real nginx, a Python
//! client; kube-proxy's nftables rules.
//!
//! Run: `cargo xtask test -p kproxy-tests --test migration_port_reuse -- --nocapture` (root).

mod common;

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use common::cluster::{Cluster, Mode, WEB_PODS};
use sandbox::kube_proxy_rules::{Svc, kube_proxy_nftables, manifests};

const REUSE_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 150);
const CLIENT_PORT: &str = "42000";

fn reuse_service() -> Svc {
    Svc {
        namespace: "default".into(),
        name: "reuse".into(),
        vip: REUSE_VIP,
        port: 80,
        port_name: "http",
        target_port: 80,
        endpoints: vec![WEB_PODS[0].1],
        ..Svc::default()
    }
}

/// One HTTP/1.0 request from the client pod's port CLIENT_PORT, read to the end: nginx closes
/// first, and the client closes only after that, so its port is free again at once (no TIME_WAIT
/// on its side) while netfilter keeps the connection in TIME_WAIT. The body, or what failed.
const CLIENT: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.settimeout(5)
s.bind(("0.0.0.0", int(sys.argv[2])))
try:
    s.connect((sys.argv[1], 80))
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
except OSError as e:
    print(f"error: {e}")
    sys.exit(1)
s.close()
print(data.split(b"\r\n\r\n", 1)[-1].decode().strip())
"#;

fn request(cluster: &Cluster) -> Result<String, String> {
    let out = cluster
        .client
        .exec_output(["python3", "-c", CLIENT, &REUSE_VIP.to_string(), CLIENT_PORT])
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() { Ok(text) } else { Err(format!("{}: {text}", out.status)) }
}

fn nf_conntrack(cluster: &Cluster) -> String {
    cluster
        .sandbox
        .node_exec(["conntrack", "-L", "-p", "tcp", "--orig-port-src", CLIENT_PORT])
        .unwrap_or_default()
}

#[test]
fn a_source_port_reused_after_kube_proxy_gets_its_answer_through_kproxy() {
    let mut cluster = Cluster::prepared("reuse", Mode::Files);
    let svc = reuse_service();
    std::fs::write(cluster.manifests.join("reuse.json"), manifests(std::slice::from_ref(&svc))).unwrap();
    let rules = cluster.sandbox.dir().join("kube-proxy.nft");
    std::fs::write(&rules, kube_proxy_nftables(std::slice::from_ref(&svc), "10.244.0.0/16", "10.96.0.0/16"))
        .unwrap();
    cluster.sandbox.node_exec(["nft", "-f", rules.to_str().unwrap()]).expect("kube-proxy's nftables rules");
    // kubelet's KUBE-FIREWALL (route_localnet martians), which needs connection tracking.
    let firewall = cluster.sandbox.dir().join("kubelet.nft");
    std::fs::write(
        &firewall,
        "table ip kubelet-firewall {\n\tchain input { type filter hook input priority 0; \
         ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct status != dnat drop; }\n}\n",
    )
    .unwrap();
    cluster.sandbox.node_exec(["nft", "-f", firewall.to_str().unwrap()]).expect("kubelet's firewall rule");

    // Through kube-proxy: answered, and netfilter remembers the translated connection.
    assert_eq!(request(&cluster).as_deref(), Ok(WEB_PODS[0].0), "through kube-proxy's rules");
    let deadline = Instant::now() + Duration::from_secs(5);
    let entry = loop {
        let listed = nf_conntrack(&cluster);
        if let Some(line) =
            listed.lines().find(|l| l.contains("TIME_WAIT") && l.contains(&REUSE_VIP.to_string()))
        {
            break line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "no TIME_WAIT entry of kube-proxy's DNAT in nf_conntrack:\n{listed}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("netfilter after the first connection: {entry}");
    assert!(entry.contains(&format!("src={}", WEB_PODS[0].1)), "the reply tuple is the backend's: {entry}");

    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 1)]);
    cluster.wait_for_attachment();
    let cleanup = cluster.kproxy(&["cleanup-kube-proxy", "--apply"]);
    eprintln!("cleanup-kube-proxy --apply:\n{cleanup}");
    assert!(cleanup.contains("deleted table ip kube-proxy"), "{cleanup}");
    let remapped_before = cluster.stat("port_remapped");

    // The same port again, now through kproxy, to the only backend: the reply tuple netfilter holds.
    let answer = request(&cluster);
    if answer.is_err() {
        eprintln!("client sockets: {}", cluster.client.exec(["ss", "-tan"]).unwrap_or_default());
    }
    eprintln!("through kproxy from the same port: {answer:?}; netfilter now:\n{}", nf_conntrack(&cluster));
    assert_eq!(answer.as_deref(), Ok(WEB_PODS[0].0), "agent log:\n{}", cluster.agent_log());
    assert!(
        cluster.stat("port_remapped") > remapped_before,
        "kproxy did not remap the new flow's port away from the reply tuple netfilter holds"
    );
    assert!(cluster.stat("dnat_new_flow") >= 1, "the second connection is kproxy's");
}
