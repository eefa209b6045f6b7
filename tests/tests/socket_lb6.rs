//! Socket-level load balancing of IPv6 sockets (issue 19) with the real agent and its default flags
//! (`--socket-lb host-only`), the hooks attached to the child cgroup the cluster fixture creates:
//! processes of the node's own network namespace (a hostNetwork pod, the kubelet) started in that
//! cgroup make AF_INET6 socket calls with Python, and the test reads what a user would see — where
//! connect() and sendto() go, what getpeername() and recvfrom() report, dig's answers.
//!
//! - A dual-stack socket naming an IPv4 cluster IP by its IPv4-mapped address (`::ffff:10.96.0.100`:
//!   Java, Go and the kubelet do this) reaches the IPv4 Service's backends: the node's packets never
//!   cross a pod veth, so only the socket hooks can translate them (kube-proxy's nat OUTPUT chain
//!   sees the IPv4 packet).
//! - An IPv6 cluster IP of a dual-stack Service, over TCP and unconnected UDP (dig AAAA takes only
//!   an answer from the address it asked).
//! - Refusal at once with no endpoints or on a port the cluster IP does not have.
//! - A connected UDP socket, to an IPv6 Service or by a mapped address, destroyed when its backend
//!   leaves (ECONNABORTED), as socket_lb.rs checks for AF_INET.
//!
//! The node namespace gets an IPv6 address of its own (`NODE_IP6`) for the pods to answer; the pods
//! are dual-stack (`Pod::add_ipv6`: a /128 route to each in the node namespace). Needs root.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv6Addr,
    time::{Duration, Instant},
};

use common::cluster::{Cluster, DNS_VIP, Mode, WEB_VIP};
use common::dual_stack::{
    DNS_PODS6, DNS_VIP6, EMPTY_VIP4, EMPTY_VIP6, WEB_PODS6, WEB_VIP4, WEB_VIP6, ipv6_of, manifests,
    start_pods,
};
use sandbox::{NODE_DEVICE, Pod};

/// The node's own IPv6 address (on its bridge), the source of its IPv6 connections.
const NODE_IP6: &str = "fd00:10::1";

/// The example cluster (IPv4 `web` and `kube-dns`) with its client made dual-stack, two dual-stack
/// nginx and two dual-stack dnsmasq pods, the node namespace given [`NODE_IP6`], and the agent
/// started with its default flags.
struct DualStack {
    cluster: Cluster,
    web: Vec<Pod>,
    dns: Vec<Pod>,
}

fn start(tag: &str) -> DualStack {
    let mut cluster = Cluster::prepared(tag, Mode::Files);
    cluster.client.add_ipv6(ipv6_of(common::cluster::CLIENT_IP)).unwrap();
    let (web, dns) = start_pods(&cluster);
    let node = cluster.sandbox.node_netns().to_owned();
    for args in [
        vec!["sysctl", "-qw", &format!("net.ipv6.conf.{NODE_DEVICE}.disable_ipv6=0")],
        vec!["sysctl", "-qw", &format!("net.ipv6.conf.{NODE_DEVICE}.accept_dad=0")],
        vec!["ip", "-6", "addr", "add", &format!("{NODE_IP6}/128"), "dev", NODE_DEVICE, "nodad"],
    ] {
        let out =
            std::process::Command::new("ip").args(["netns", "exec", &node]).args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::write(cluster.manifest("dual-stack.yaml"), manifests(&WEB_PODS6, &DNS_PODS6)).unwrap();
    cluster.start_agent();
    cluster.wait_for_frontends(&[
        ("10.96.0.100:80", "TCP", 3),
        ("10.96.0.10:53", "UDP", 2),
        (&format!("{WEB_VIP4}:80"), "TCP", 2),
        (&format!("[{WEB_VIP6}]:80"), "TCP", 2),
        (&format!("[{DNS_VIP6}]:53"), "UDP", 2),
        (&format!("[{DNS_VIP6}]:53"), "TCP", 2),
        (&format!("[{EMPTY_VIP6}]:80"), "TCP", 0),
        (&format!("{EMPTY_VIP4}:80"), "TCP", 0),
    ]);
    cluster.wait_for_attachment();
    wait_for_socket_hooks(&cluster);
    DualStack { cluster, web, dns }
}

/// Waits for the agent's socket hooks, and checks the IPv6 four are among them.
fn wait_for_socket_hooks(cluster: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.agent_log().contains("socket-level load balancing on") {
        assert!(Instant::now() < deadline, "socket LB not attached:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let links = cluster.link_pins();
    for program in ["kproxy_connect6", "kproxy_sendmsg6", "kproxy_recvmsg6", "kproxy_getpeername6"] {
        assert!(
            links.iter().any(|l| l.starts_with("cgroup@") && l.ends_with(&format!("-{program}"))),
            "{program} attached: {links:?}"
        );
    }
}

/// `script` run by python3 in network namespace `netns`, from inside the hooks' cgroup; its stdout.
fn run(cluster: &Cluster, netns: &str, script: &str) -> String {
    let out = cluster.cgroup.command(netns, &["python3", "-c", script]).output().unwrap();
    assert!(out.status.success(), "{script}\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_on_node(cluster: &Cluster, script: &str) -> String {
    run(cluster, cluster.sandbox.node_netns(), script)
}

/// Python: `fetch(host, path)` over an AF_INET6 socket, printing getpeername's address and port and
/// the body's first line.
const HTTP6: &str = r#"
import socket, errno
def fetch(host, path):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect((host, 80))
    s.sendall(b'GET ' + path.encode() + b' HTTP/1.0\r\n\r\n')
    page = b''
    while True:
        chunk = s.recv(4096)
        if not chunk: break
        page += chunk
    peer = s.getpeername()
    s.close()
    print(peer[0], peer[1], page.split(b'\r\n\r\n', 1)[1].decode().strip())
"#;

/// Python: a DNS query for `name` of type `qtype`, and which backend a `whoami.kproxy.test` TXT
/// answer names.
const DNS_HELPERS: &str = r#"
import socket, struct
def query(name, qtype):
    q = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.split('.'):
        q += bytes([len(label)]) + label.encode()
    return q + b'\x00' + struct.pack('>HH', qtype, 1)
def backend(reply):
    at = reply.find(b'dns6-')
    return reply[at:at + 6].decode() if at >= 0 else '?'
"#;

/// Lines of `out` as `(peer address, peer port, body)`.
fn peers_and_bodies(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .map(|line| {
            let mut fields = line.splitn(3, ' ');
            let mut next = || fields.next().unwrap_or_default().to_owned();
            (next(), next(), next())
        })
        .collect()
}

#[test]
fn a_dual_stack_socket_reaches_an_ipv4_service_by_its_ipv4_mapped_address() {
    let ds = start("sock6-mapped");
    let cluster = &ds.cluster;
    let translated_before = cluster.stat("socket_lb_translated");
    let reverse_before = cluster.stat("socket_lb_reverse");
    let dnat_before = cluster.stat("dnat_new_flow");

    // TCP: 12 connections of the node to the example's IPv4 `web` by ::ffff:10.96.0.100.
    let mapped = format!("::ffff:{WEB_VIP}");
    let out =
        run_on_node(cluster, &format!("{HTTP6}\nfor _ in range(12):\n    fetch('{mapped}', '/whoami')\n"));
    let rows = peers_and_bodies(&out);
    assert_eq!(rows.len(), 12, "{out}");
    let mut backends = BTreeSet::new();
    for (peer, port, body) in &rows {
        assert_eq!(
            (peer.as_str(), port.as_str()),
            (mapped.as_str(), "80"),
            "getpeername shows the Service: {out}"
        );
        // nginx's "$server_addr $remote_addr": an IPv4 backend, reached from the node's IPv4 address.
        let (backend, client) = body.split_once(' ').unwrap_or_else(|| panic!("{out}"));
        assert!(backend.starts_with("10.244.0.1"), "a web backend answered: {out}");
        assert_eq!(client, sandbox::NODE_IP.to_string(), "{out}");
        backends.insert(backend.to_owned());
    }
    assert!(backends.len() >= 2, "12 connections spread over the 3 backends: {backends:?}");

    // UDP: connected (connect6 sees the mapped address) and unconnected (a sendto() to a mapped
    // address goes to the IPv4 UDP code and its sendmsg4 hook; recvfrom() runs recvmsg6).
    let dns_mapped = format!("::ffff:{DNS_VIP}");
    let out = run_on_node(
        cluster,
        &format!(
            r#"{DNS_HELPERS}
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.settimeout(5)
s.connect(('{dns_mapped}', 53))
s.send(query('whoami.kproxy.test', 16))
reply = s.recv(512)
print('connected', s.getpeername()[0], s.getpeername()[1], 'coredns' in reply.decode('latin-1'))
for n in range(4):
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    u.settimeout(5)
    u.sendto(query('whoami.kproxy.test', 16), ('{dns_mapped}', 53))
    reply, source = u.recvfrom(512)
    print('unconnected', source[0], source[1], 'coredns' in reply.decode('latin-1'))
"#
        ),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert_eq!(lines[0], format!("connected {dns_mapped} 53 True"), "{out}");
    for line in &lines[1..] {
        assert_eq!(*line, format!("unconnected {dns_mapped} 53 True"), "recvfrom shows the Service: {out}");
    }
    assert!(cluster.stat("socket_lb_translated") >= translated_before + 12 + 5);
    assert!(cluster.stat("socket_lb_reverse") >= reverse_before + 12 + 2 + 4);
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before, "the tc path translated nothing");
}

#[test]
fn the_node_reaches_an_ipv6_cluster_ip_over_tcp_and_getpeername_shows_it() {
    let ds = start("sock6-tcp");
    let cluster = &ds.cluster;
    let translated_before = cluster.stat("socket_lb_translated");
    let dnat_before = cluster.stat("dnat_new_flow");
    let vip: Ipv6Addr = WEB_VIP6.parse().unwrap();
    let out =
        run_on_node(cluster, &format!("{HTTP6}\nfor _ in range(24):\n    fetch('{WEB_VIP6}', '/whoami')\n"));
    let rows = peers_and_bodies(&out);
    assert_eq!(rows.len(), 24, "{out}");
    let mut backends = BTreeSet::new();
    for (peer, port, body) in &rows {
        assert_eq!((peer.parse::<Ipv6Addr>().ok(), port.as_str()), (Some(vip), "80"), "getpeername: {out}");
        let (backend, client) = body.split_once(' ').unwrap_or_else(|| panic!("{out}"));
        assert_eq!(client, NODE_IP6, "the backend sees the node's own address: {out}");
        backends.insert(backend.parse::<Ipv6Addr>().unwrap_or_else(|_| panic!("{out}")));
    }
    let expected: BTreeSet<Ipv6Addr> = ds.web.iter().map(|p| p.ip6().unwrap()).collect();
    assert_eq!(backends, expected, "24 connections reach both IPv6 backends");
    assert!(cluster.stat("socket_lb_translated") >= translated_before + 24);
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before, "the tc path translated nothing");

    // curl -6 from the node, as an operator would.
    let out = cluster
        .cgroup
        .command(
            cluster.sandbox.node_netns(),
            &["curl", "-6", "-sS", "--max-time", "5", &format!("http://[{WEB_VIP6}]/")],
        )
        .output()
        .unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(WEB_PODS6.iter().any(|(name, _)| body.trim() == *name), "curl -6: {body:?} {out:?}");

    // host-only: a pod's IPv6 socket, in the same cgroup, is left to the tc path on its veth.
    let translated_before = cluster.stat("socket_lb_translated");
    let out = run(cluster, cluster.client.netns(), &format!("{HTTP6}\nfetch('{WEB_VIP6}', '/client')\n"));
    let rows = peers_and_bodies(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0].2, ipv6_of(common::cluster::CLIENT_IP).to_string(), "{out}");
    assert_eq!(cluster.stat("socket_lb_translated"), translated_before, "a pod's socket was translated");
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before + 1, "tc translated the pod's connection");
}

#[test]
fn unconnected_udp_over_ipv6_keeps_a_backend_per_socket_and_answers_come_from_the_service() {
    let ds = start("sock6-udp");
    let cluster = &ds.cluster;
    let vip: Ipv6Addr = DNS_VIP6.parse().unwrap();
    let out = run_on_node(
        cluster,
        &format!(
            r#"{DNS_HELPERS}
for n in range(16):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(5)
    for _ in range(4):
        s.sendto(query('whoami.kproxy.test', 16), ('{DNS_VIP6}', 53))
        reply, source = s.recvfrom(512)
        print(n, source[0], source[1], backend(reply))
    s.close()
"#
        ),
    );
    let mut backends_of_socket: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for line in out.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields.len(), 4, "{out}");
        assert_eq!(fields[1].parse::<Ipv6Addr>().ok(), Some(vip), "recvfrom shows the Service: {line}");
        assert_eq!(fields[2], "53", "{line}");
        backends_of_socket.entry(fields[0]).or_default().insert(fields[3]);
    }
    assert_eq!(backends_of_socket.len(), 16, "{out}");
    assert!(
        backends_of_socket.values().all(|b| b.len() == 1),
        "one backend per socket: {backends_of_socket:?}"
    );
    let used: BTreeSet<&str> = backends_of_socket.values().flatten().copied().collect();
    assert_eq!(used, ["dns6-a", "dns6-b"].into(), "16 sockets over both backends: {backends_of_socket:?}");

    // dig AAAA from the node, over UDP and TCP: dig takes only an answer from the address it asked.
    let answers: BTreeSet<String> = ds.dns.iter().map(|p| p.ip6().unwrap().to_string()).collect();
    for transport in ["+notcp", "+tcp"] {
        let out = cluster
            .cgroup
            .command(
                cluster.sandbox.node_netns(),
                &[
                    "dig",
                    "+short",
                    "+time=2",
                    "+tries=1",
                    transport,
                    &format!("@{DNS_VIP6}"),
                    "ip6.kproxy.test",
                    "AAAA",
                ],
            )
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(answers.contains(&answer), "dig {transport} AAAA @{DNS_VIP6}: {answer:?} ({out:?})");
    }
}

#[test]
fn ipv6_sockets_are_refused_at_once_without_endpoints_or_on_a_missing_port() {
    let ds = start("sock6-refuse");
    let cluster = &ds.cluster;
    let refused_before = cluster.stat("socket_lb_refused");
    let script = format!(
        r#"
import socket, errno
def tcp(host, port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect((host, port))
        return 'connected'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
def udp(host, port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        s.sendto(b'x', (host, port))
        return 'sent'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
print(tcp('{EMPTY_VIP6}', 80))
print(udp('{EMPTY_VIP6}', 53))
print(tcp('::ffff:{EMPTY_VIP4}', 80))
print(tcp('{WEB_VIP6}', 81))
"#
    );
    // ECONNREFUSED from connect() and sendto() themselves: no packet left (a reset or an ICMPv6
    // error would come later; no route would be ENETUNREACH, a drop a timeout).
    let out = run_on_node(cluster, &script);
    assert_eq!(out.lines().collect::<Vec<_>>(), ["ECONNREFUSED"; 4], "{out}");
    assert!(cluster.stat("socket_lb_refused") >= refused_before + 4);
    // The same Service on its IPv4 address, from an AF_INET socket, as before.
    let out = run_on_node(
        cluster,
        &format!(
            "import socket, errno\ntry:\n    socket.create_connection(('{EMPTY_VIP4}', 80), timeout=5)\n    print('connected')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n"
        ),
    );
    assert_eq!(out.trim(), "ECONNREFUSED");
}

/// The attach types `bpftool cgroup show` finds on `cgroup` (kproxy's programs are the only ones a
/// test cgroup gets).
fn cgroup_attach_types(cgroup: &std::path::Path) -> BTreeSet<String> {
    let out =
        std::process::Command::new("bpftool").args(["-j", "cgroup", "show"]).arg(cgroup).output().unwrap();
    assert!(out.status.success(), "bpftool cgroup show: {}", String::from_utf8_lossy(&out.stderr));
    let programs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::json!([]));
    programs
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["attach_type"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

#[test]
fn the_agent_attaches_the_ipv6_hooks_to_its_cgroup_and_unload_detaches_them() {
    let mut ds = start("sock6-unload");
    let cgroup = ds.cluster.cgroup.path().to_owned();
    let attached = cgroup_attach_types(&cgroup);
    let hooks = [
        "cgroup_inet4_connect",
        "cgroup_udp4_sendmsg",
        "cgroup_udp4_recvmsg",
        "cgroup_inet4_getpeername",
        "cgroup_inet6_connect",
        "cgroup_udp6_sendmsg",
        "cgroup_udp6_recvmsg",
        "cgroup_inet6_getpeername",
    ];
    for hook in hooks {
        assert!(attached.contains(hook), "{hook} on {}: {attached:?}", cgroup.display());
    }
    assert!(ds.cluster.stop_agent().success(), "{}", ds.cluster.agent_log());
    // The hooks outlive the agent (pinned links)...
    assert_eq!(cgroup_attach_types(&cgroup), attached);
    // ...until `kproxy unload`.
    ds.cluster.kproxy(&["unload"]);
    let left = cgroup_attach_types(&cgroup);
    assert!(left.is_empty(), "left on {} after unload: {left:?}", cgroup.display());
    // And a dual-stack socket of the node reaches no Service any more (no route to a cluster IP).
    let out = run_on_node(
        &ds.cluster,
        &format!(
            "import socket, errno\ns = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\ns.settimeout(3)\ntry:\n    s.connect(('{WEB_VIP6}', 80))\n    print('connected')\nexcept OSError as e:\n    print(errno.errorcode.get(e.errno, str(e)))\n"
        ),
    );
    assert_ne!(out.trim(), "connected", "{out}");
}

/// The EndpointSlice YAML without the endpoint whose address is `ip` (as socket_lb.rs edits it).
fn remove_endpoint(yaml: &str, ip: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].starts_with("- addresses:") && lines.get(i + 1).is_some_and(|l| l.contains(ip)) {
            i += 1;
            while i < lines.len() && lines[i].starts_with("  ") {
                i += 1;
            }
            continue;
        }
        out.push(lines[i]);
        i += 1;
    }
    out.join("\n") + "\n"
}

/// Two connected AF_INET6 UDP sockets of the node — one to the IPv6 DNS Service, one to the IPv4
/// kube-dns by its mapped address — are destroyed when their backends leave their slices: the
/// application gets ECONNABORTED (then EDESTADDRREQ) and would reconnect through the Service,
/// instead of sending to a dead pod. Sockets connected to the IPv6 pods' own addresses are left
/// alone.
#[test]
fn connected_ipv6_udp_sockets_to_removed_backends_are_destroyed() {
    let ds = start("sock6-destroy");
    let cluster = &ds.cluster;
    let direct6: Vec<String> = ds.dns.iter().map(|p| format!("'{}'", p.ip6().unwrap())).collect();
    let script = format!(
        r#"{DNS_HELPERS}
import sys, time, errno
def connected(host):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.connect((host, 53))
    s.settimeout(2)
    s.send(query('whoami.kproxy.test', 16))
    return s, s.recv(512)
native, reply = connected('{DNS_VIP6}')
print('native', backend(reply), native.getpeername()[0], flush=True)
mapped, reply = connected('::ffff:{DNS_VIP}')
at = reply.find(b'coredns-')
print('mapped', reply[at:at + 9].decode(), mapped.getpeername()[0], flush=True)
direct = []
for ip in ({direct}):
    d = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    d.connect((ip, 53))
    d.settimeout(2)
    direct.append(d)
pending = {{'native': native, 'mapped': mapped}}
deadline = time.time() + 30
while pending and time.time() < deadline:
    for name, s in list(pending.items()):
        try:
            s.send(query('whoami.kproxy.test', 16))
            s.recv(512)
        except socket.timeout:
            pass
        except OSError as e:
            print(name, 'error', errno.errorcode[e.errno], flush=True)
            del pending[name]
    time.sleep(0.2)
for name in pending:
    print(name, 'still connected', flush=True)
for d in direct:
    try:
        d.send(query('whoami.kproxy.test', 16))
        print('direct', backend(d.recv(512)), flush=True)
    except OSError as e:
        print('direct error', errno.errorcode.get(e.errno, e), flush=True)
"#,
        direct = direct6.join(", ") + ","
    );
    let mut child = cluster
        .cgroup
        .command(cluster.sandbox.node_netns(), &["python3", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::BufRead as _;
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || lines.next().expect("the script ended silently").unwrap();
    let native = next();
    let fields: Vec<&str> = native.split(' ').collect();
    assert_eq!(fields.len(), 3, "{native}");
    assert_eq!(fields[2].parse::<Ipv6Addr>().ok(), DNS_VIP6.parse().ok(), "getpeername: {native}");
    let gone6 = DNS_PODS6.iter().find(|(name, _)| *name == fields[1]).unwrap_or_else(|| panic!("{native}"));
    let mapped = next();
    let fields: Vec<&str> = mapped.split(' ').collect();
    assert_eq!(fields.len(), 3, "{mapped}");
    assert_eq!(fields[2], format!("::ffff:{DNS_VIP}"), "getpeername: {mapped}");
    let gone4 = match fields[1] {
        "coredns-1" => "10.244.0.21",
        "coredns-2" => "10.244.0.22",
        other => panic!("unknown backend {other}"),
    };

    // Both backends leave their slices.
    let remaining: Vec<(&str, std::net::Ipv4Addr)> =
        DNS_PODS6.iter().filter(|(name, _)| *name != gone6.0).copied().collect();
    std::fs::write(cluster.manifest("dual-stack.yaml"), manifests(&WEB_PODS6, &remaining)).unwrap();
    let path = cluster.manifest("kube-dns.yaml");
    let yaml = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, remove_endpoint(&yaml, gone4)).unwrap();
    cluster.wait_for_frontends(&[(&format!("[{DNS_VIP6}]:53"), "UDP", 1), ("10.96.0.10:53", "UDP", 1)]);

    let mut verdicts: Vec<String> = (0..2).map(|_| next()).collect();
    verdicts.sort();
    for (verdict, name) in verdicts.iter().zip(["mapped", "native"]) {
        assert!(
            *verdict == format!("{name} error ECONNABORTED")
                || *verdict == format!("{name} error EDESTADDRREQ"),
            "the {name} socket was not destroyed: {verdicts:?}\n{}",
            cluster.agent_log()
        );
    }
    let direct: Vec<String> = (0..2).map(|_| next()).collect();
    assert_eq!(direct, ["direct dns6-a", "direct dns6-b"], "sockets connected to the pods' own addresses");
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cluster.agent_log().contains("destroyed the UDP sockets connected to removed backends") {
        assert!(Instant::now() < deadline, "no destroy in the agent log:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
}
