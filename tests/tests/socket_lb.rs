//! Socket-level load balancing with the real agent, its hooks attached to the child cgroup the
//! cluster fixture creates (never the machine's root cgroup). Client processes are moved into
//! that cgroup, then enter a pod's (or the node's) network namespace; Python scripts make the
//! socket calls whose results a user would see: where connect() goes, what getpeername() and
//! recvfrom() report, what a connected UDP socket experiences when its backend leaves.
//!
//! Each test runs twice (the `socket_lb_with_tc` and `socket_lb_no_tc` modules): with the tc
//! programs on every pod veth (`--pod-veth-tc on`), and with none on the client pod's veth
//! (`--pod-veth-tc auto`: every process of the client's namespace is in the cgroup, so the hooks
//! cover it), where nothing but the hooks can translate the client's traffic.

use std::{
    io::{BufRead, BufReader},
    process::Stdio,
    time::{Duration, Instant},
};

mod common;
use common::cluster::{CLIENT_IP, CLIENT_SERVER_PORT, Cluster, DNS_VIP, Datapath, WEB_VIP};

/// Runs each named test body (a `fn(Datapath)`) in both socket-LB modes.
macro_rules! in_both_modes {
    ($($body:ident),* $(,)?) => {
        mod socket_lb_with_tc {
            $(#[test] fn $body() { super::$body(super::Datapath::SocketLbWithTc) })*
        }
        mod socket_lb_no_tc {
            $(#[test] fn $body() { super::$body(super::Datapath::SocketLbNoTc) })*
        }
    };
}

in_both_modes!(
    connect_goes_to_a_backend_getpeername_shows_the_service_and_no_packet_is_natted,
    unconnected_udp_keeps_a_backend_per_socket_answers_come_from_the_service_and_dig_works,
    a_service_without_endpoints_refuses_connect,
    a_connected_udp_socket_to_a_removed_backend_is_destroyed,
    a_connected_udp_socket_to_a_backend_removed_while_the_agent_was_down_is_destroyed,
    session_affinity_keeps_a_pod_on_one_backend,
    a_pod_reaches_itself_through_its_service,
    a_service_port_the_cluster_ip_does_not_have_refuses_connect,
    an_unallocated_service_address_is_refused_at_connect,
);

type TestCgroup = sandbox::cgroup::ChildCgroup;

/// A DNS query for `name` (TXT when `txt`, else A), as bytes, and the code that sends it.
const DNS_HELPERS: &str = r#"
import socket, struct, sys, errno, time
def query(name, qtype):
    q = struct.pack('>HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.split('.'):
        q += bytes([len(label)]) + label.encode()
    return q + b'\x00' + struct.pack('>HH', qtype, 1)
def backend(reply):
    at = reply.find(b'coredns-')
    return reply[at:at + 9].decode() if at >= 0 else '?'
"#;

/// A cluster whose agent runs with `--socket-lb on` in `datapath`'s mode, the client pod's veth
/// checked: no kproxy program when the hooks cover it, both otherwise (and on the server pods'
/// veths always, their processes being outside the cgroup).
fn start(tag: &str, datapath: Datapath) -> Cluster {
    let suffix = if datapath == Datapath::SocketLbNoTc { "-n" } else { "-t" };
    let cluster = Cluster::start_in(&format!("{tag}{suffix}"), datapath);
    wait_for_socket_hooks(&cluster);
    check_veths(&cluster);
    cluster
}

/// The tc programs `bpftool net show` finds on each pod's veth: none on a covered pod's. The agent
/// takes them off a covered pod's veth on its next poll after the hooks are up: waited for.
fn check_veths(cluster: &Cluster) {
    let pods = std::iter::once(&cluster.client).chain(&cluster.web).chain(&cluster.dns);
    for pod in pods {
        let expected: &[&str] = if cluster.covered(pod) { &[] } else { &["kproxy_egress", "kproxy_ingress"] };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut programs = cluster.tc_programs(pod.host_veth());
            programs.sort();
            if programs == expected || std::time::Instant::now() > deadline {
                assert_eq!(programs, expected, "tc programs on {} ({})", pod.host_veth(), pod.name());
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// `kproxy doctor --json`'s attach checks in the node namespace: (status, name, finding). Its
/// exit status is not asserted: the sandbox has no API server for its api-server check.
fn doctor_attach_checks(cluster: &Cluster) -> Vec<(String, String, String)> {
    let bin = common::cluster::kproxy_bin();
    let pin_dir = cluster.pin_dir.display().to_string();
    let args =
        [bin.to_string_lossy().into_owned(), "--pin-dir".into(), pin_dir, "doctor".into(), "--json".into()];
    let out = cluster.sandbox.node_exec_output(args).unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor --json: {e}\n{}", String::from_utf8_lossy(&out.stderr)));
    let text = |c: &serde_json::Value, key: &str| c[key].as_str().unwrap_or_default().to_owned();
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| text(c, "name").starts_with("attach"))
        .map(|c| (text(c, "status"), text(c, "name"), text(c, "finding")))
        .collect()
}

fn wait_for_socket_hooks(cluster: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cluster.agent_log().contains("socket-level load balancing on") {
        assert!(Instant::now() < deadline, "socket LB not attached:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn run(cgroup: &TestCgroup, netns: &str, script: &str) -> String {
    let out = cgroup.command(netns, &["python3", "-c", script]).output().unwrap();
    assert!(out.status.success(), "{script}\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn connect_goes_to_a_backend_getpeername_shows_the_service_and_no_packet_is_natted(datapath: Datapath) {
    let cluster = start("sock-tcp", datapath);
    let cgroup = &cluster.cgroup;
    let dnat_before = cluster.stat("dnat_new_flow");
    let script = format!(
        r#"
import socket
for _ in range(6):
    s = socket.create_connection(('{WEB_VIP}', 80), timeout=5)
    s.sendall(b'GET /whoami HTTP/1.0\r\n\r\n')
    page = b''
    while True:
        chunk = s.recv(4096)
        if not chunk: break
        page += chunk
    print(s.getpeername()[0], s.getpeername()[1], page.split(b'\r\n\r\n', 1)[1].decode().split()[0])
    s.close()
"#
    );
    let out = run(cgroup, cluster.client.netns(), &script);
    let mut backends = std::collections::BTreeSet::new();
    for line in out.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            &fields[..2],
            [WEB_VIP.to_string().as_str(), "80"],
            "getpeername shows the Service: {line}"
        );
        backends.insert(fields[2].to_owned());
    }
    assert!(backends.iter().all(|b| b.starts_with("10.244.0.1")), "{out}");
    assert!(cluster.stat("socket_lb_translated") >= 6);
    assert!(cluster.stat("socket_lb_reverse") >= 6, "getpeername was rewritten");
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before, "the tc path translated nothing: no double NAT");

    // A process outside the cgroup still goes through the tc path (from a web pod: the veth of
    // an uncovered pod keeps it).
    let page = cluster.web[0].curl(&format!("http://{WEB_VIP}/whoami")).unwrap();
    assert!(page.starts_with("10.244.0.1"), "{page}");
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before + 1);
    check_veths(&cluster);
}

fn unconnected_udp_keeps_a_backend_per_socket_answers_come_from_the_service_and_dig_works(
    datapath: Datapath,
) {
    let cluster = start("sock-udp", datapath);
    let cgroup = &cluster.cgroup;
    let script = format!(
        r#"{DNS_HELPERS}
for n in range(16):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    for _ in range(4):
        s.sendto(query('whoami.kproxy.test', 16), ('{DNS_VIP}', 53))
        reply, source = s.recvfrom(512)
        print(n, source[0], source[1], backend(reply))
    s.close()
"#
    );
    let out = run(cgroup, cluster.client.netns(), &script);
    let mut backends_of_socket: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    for line in out.lines() {
        let (socket, rest) = line.split_once(' ').unwrap();
        assert!(rest.starts_with(&format!("{DNS_VIP} 53 coredns-")), "recvfrom shows the Service: {line}");
        backends_of_socket.entry(socket).or_default().insert(rest.rsplit(' ').next().unwrap());
    }
    assert_eq!(backends_of_socket.len(), 16, "{out}");
    // Each socket keeps one backend from datagram to datagram (a UDP exchange over sendto
    // stays with its server), and the sockets together use both.
    assert!(backends_of_socket.values().all(|b| b.len() == 1), "{backends_of_socket:?}");
    let used: std::collections::BTreeSet<&str> = backends_of_socket.values().flatten().copied().collect();
    assert_eq!(used.len(), 2, "16 sockets all on one backend: {backends_of_socket:?}");
    let dig = cgroup
        .command(
            cluster.client.netns(),
            &["dig", "+short", "+time=2", "+tries=1", &format!("@{DNS_VIP}"), "ip.kproxy.test"],
        )
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&dig.stdout);
    assert!(answer.trim().starts_with("10.244.0.2"), "dig through socket LB: {answer}");
    assert!(cluster.stat("socket_lb_translated") >= 5);
    check_veths(&cluster);
}

fn a_service_without_endpoints_refuses_connect(datapath: Datapath) {
    let cluster = start("sock-refuse", datapath);
    let cgroup = &cluster.cgroup;
    std::fs::write(
        cluster.manifest("empty.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: empty\n  namespace: default\nspec:\n  clusterIP: 10.96.0.200\n  ports:\n  - name: http\n    port: 80\n",
    )
    .unwrap();
    cluster.wait_for_frontends(&[("10.96.0.200:80", "TCP", 0)]);
    let script = r#"
import socket, errno
try:
    socket.create_connection(('10.96.0.200', 80), timeout=5)
    print('connected')
except OSError as e:
    print(errno.errorcode[e.errno])
"#;
    assert_eq!(run(cgroup, cluster.client.netns(), script).trim(), "ECONNREFUSED");
    assert!(cluster.stat("socket_lb_refused") >= 1);
}

fn a_connected_udp_socket_to_a_removed_backend_is_destroyed(datapath: Datapath) {
    connected_udp_socket_is_destroyed_when_its_backend_leaves(
        "sock-destroy",
        datapath,
        AgentDuringRemoval::Running,
    );
}

/// The backend leaves while the agent is down: the restarted agent adopts the pinned maps, finds
/// the backend gone on its first sync and destroys the sockets then.
fn a_connected_udp_socket_to_a_backend_removed_while_the_agent_was_down_is_destroyed(datapath: Datapath) {
    connected_udp_socket_is_destroyed_when_its_backend_leaves(
        "sock-destroy-down",
        datapath,
        AgentDuringRemoval::Stopped,
    );
}

#[derive(PartialEq)]
enum AgentDuringRemoval {
    Running,
    Stopped,
}

fn connected_udp_socket_is_destroyed_when_its_backend_leaves(
    tag: &str,
    datapath: Datapath,
    agent: AgentDuringRemoval,
) {
    let mut cluster = start(tag, datapath);
    let script = format!(
        r#"{DNS_HELPERS}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(('{DNS_VIP}', 53))
s.settimeout(2)
s.send(query('whoami.kproxy.test', 16))
print('backend', backend(s.recv(512)), s.getpeername()[0], flush=True)
# Sockets connected to the pods' own addresses: the application's, not the Service's.
direct = []
for ip in ('10.244.0.21', '10.244.0.22'):
    d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    d.connect((ip, 53))
    d.settimeout(2)
    direct.append(d)
deadline = time.time() + 30
while time.time() < deadline:
    try:
        s.send(query('whoami.kproxy.test', 16))
        s.recv(512)
    except socket.timeout:
        pass
    except OSError as e:
        print('error', errno.errorcode[e.errno], flush=True)
        for d in direct:
            try:
                d.send(query('whoami.kproxy.test', 16))
                print('direct', backend(d.recv(512)), flush=True)
            except OSError as e:
                print('direct error', errno.errorcode.get(e.errno, e), flush=True)
        sys.exit(0)
    time.sleep(0.2)
print('still connected', flush=True)
"#
    );
    let mut child = cluster
        .cgroup
        .command(cluster.client.netns(), &["python3", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("the script printed nothing").unwrap();
    let fields: Vec<&str> = first.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "{first}");
    assert_eq!(fields[2], DNS_VIP.to_string(), "getpeername of the connected UDP socket shows the Service");
    let gone = fields[1].to_owned();
    let gone_ip = match gone.as_str() {
        "coredns-1" => "10.244.0.21",
        "coredns-2" => "10.244.0.22",
        other => panic!("unknown backend {other}"),
    };

    // The backend leaves the EndpointSlice.
    if agent == AgentDuringRemoval::Stopped {
        cluster.stop_agent();
    }
    let path = cluster.manifest("kube-dns.yaml");
    let yaml = std::fs::read_to_string(&path).unwrap();
    let without: String = remove_endpoint(&yaml, gone_ip);
    std::fs::write(&path, without).unwrap();
    if agent == AgentDuringRemoval::Stopped {
        // The restarted agent finds the backend gone in the maps it adopts.
        std::thread::sleep(Duration::from_secs(1));
        cluster.start_agent();
    }
    cluster.wait_for_frontends(&[("10.96.0.10:53", "UDP", 1)]);

    let verdict = lines.next().expect("the script ended silently").unwrap();
    assert!(
        verdict == "error ECONNABORTED" || verdict == "error EDESTADDRREQ",
        "the socket connected to {gone} was not destroyed: {verdict}\n{}",
        cluster.agent_log()
    );
    let direct: Vec<String> = lines.by_ref().take(2).map(Result::unwrap).collect();
    assert_eq!(
        direct,
        ["direct coredns-1", "direct coredns-2"],
        "sockets connected to the pods' own addresses are left alone"
    );
    let _ = child.wait();
    // The agent logs after SOCK_DESTROY returns; the script may see the error first.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cluster.agent_log().contains("destroyed the UDP sockets connected to removed backends") {
        assert!(Instant::now() < deadline, "no destroy in the agent log:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The EndpointSlice YAML without the endpoint whose address is `ip`.
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

/// With the agent's default flags (only `--cgroup-root` moved to the test's child cgroup, which
/// holds the client processes): the node's own processes (the agent's network namespace: a
/// hostNetwork pod, the kubelet) reach a cluster IP over TCP and UDP through the socket hooks in
/// host-only mode — the node has no route to it otherwise, and the tc programs on the pods'
/// interfaces never see those packets — while pods in the same cgroup keep the per-packet tc
/// path.
#[test]
fn with_default_flags_the_node_reaches_cluster_ips_and_pods_keep_the_tc_path() {
    let cluster = Cluster::start("sock-default");
    assert!(cluster.extra_agent_args.is_empty(), "default flags");
    wait_for_socket_hooks(&cluster);
    let cgroup = &cluster.cgroup;
    let node_netns = cluster.sandbox.node_netns().to_owned();
    let translated_before = cluster.stat("socket_lb_translated");

    let url = format!("http://{WEB_VIP}/whoami");
    let mut answered = Vec::new();
    for _ in 0..10 {
        let out = cgroup.command(&node_netns, &["curl", "-sS", "--max-time", "5", &url]).output().unwrap();
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && body.starts_with("10.244.0.1") {
            answered.push(body);
        }
    }
    assert_eq!(answered.len(), 10, "of 10 HTTP requests from the node to {url}: {answered:?}");
    assert!(cluster.stat("socket_lb_translated") >= translated_before + 10);

    let mut answers = Vec::new();
    for _ in 0..10 {
        let dig = cgroup
            .command(
                &node_netns,
                &[
                    "dig",
                    "+short",
                    "+time=2",
                    "+tries=1",
                    &format!("@{DNS_VIP}"),
                    "whoami.kproxy.test",
                    "TXT",
                ],
            )
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&dig.stdout).trim().to_owned();
        if answer.starts_with("\"coredns-") {
            answers.push(answer);
        }
    }
    assert_eq!(answers.len(), 10, "of 10 DNS queries over UDP from the node to {DNS_VIP}: {answers:?}");

    // getpeername shows the Service, as it would through kube-proxy's nat OUTPUT rules.
    let page = run(
        cgroup,
        &node_netns,
        &format!(
            r#"
import socket
s = socket.create_connection(('{WEB_VIP}', 80), timeout=5)
s.sendall(b'GET /whoami HTTP/1.0\r\n\r\n')
print(s.recv(4096).split(b'\r\n\r\n', 1)[1].decode().split()[0], s.getpeername()[0])
"#
        ),
    );
    let fields: Vec<&str> = page.split_whitespace().collect();
    assert!(fields[0].starts_with("10.244.0.1"), "the node reached a web backend: {page}");
    assert_eq!(fields[1], WEB_VIP.to_string(), "getpeername shows the Service");

    let translated_before = cluster.stat("socket_lb_translated");
    let dnat_before = cluster.stat("dnat_new_flow");
    let out = run(
        cgroup,
        cluster.client.netns(),
        &format!(
            "import socket\nsocket.create_connection(('{WEB_VIP}', 80), timeout=5).close()\nprint('ok')"
        ),
    );
    assert_eq!(out.trim(), "ok");
    assert_eq!(cluster.stat("socket_lb_translated"), translated_before, "a pod's socket was translated");
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before + 1, "the pod's connection went through tc");
}

/// `web.yaml` as another Service, `name` at `vip`, with `edit` applied to its text.
fn web_service_copy(cluster: &Cluster, name: &str, vip: &str, edit: impl Fn(String) -> String) {
    let yaml = std::fs::read_to_string(cluster.manifest("web.yaml")).unwrap();
    let yaml = yaml
        .replace("name: web\n", &format!("name: {name}\n"))
        .replace("name: web-7x2kq", &format!("name: {name}-7x2kq"))
        .replace("kubernetes.io/service-name: web", &format!("kubernetes.io/service-name: {name}"))
        .replace("uid: 6b1c3f0e-5a2d-4c8e-9a53-1d0d2b7b6f10", "uid: 6b1c3f0e-5a2d-4c8e-9a53-1d0d2b7b6f11")
        .replace(&WEB_VIP.to_string(), vip);
    std::fs::write(cluster.manifest(&format!("{name}.yaml")), edit(yaml)).unwrap();
}

/// A Python script: `count` new connections (separate sockets) to `vip:port`, each printing
/// `GET /whoami`'s first word and getpeername().
fn whoami_script(vip: &str, port: u16, count: usize) -> String {
    format!(
        r#"
import socket
for _ in range({count}):
    s = socket.create_connection(('{vip}', {port}), timeout=5)
    s.sendall(b'GET /whoami HTTP/1.0\r\n\r\n')
    page = b''
    while True:
        chunk = s.recv(4096)
        if not chunk: break
        page += chunk
    print(page.split(b'\r\n\r\n', 1)[1].decode().split()[0], s.getpeername()[0], s.getpeername()[1])
    s.close()
"#
    )
}

/// sessionAffinity: ClientIP through the hooks: the pod is one client (its network namespace),
/// so its new connections — from separate processes — all reach one backend, and none crossed
/// the tc path's NAT. On a veth without tc nothing else could translate them.
fn session_affinity_keeps_a_pod_on_one_backend(datapath: Datapath) {
    let cluster = start("sock-affinity", datapath);
    web_service_copy(&cluster, "sticky", "10.96.0.101", |yaml| {
        yaml.replace("sessionAffinity: None", "sessionAffinity: ClientIP")
    });
    cluster.wait_for_frontends(&[("10.96.0.101:80", "TCP", 3)]);
    let (translated_before, dnat_before) =
        (cluster.stat("socket_lb_translated"), cluster.stat("dnat_new_flow"));
    let mut backends = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let out = run(&cluster.cgroup, cluster.client.netns(), &whoami_script("10.96.0.101", 80, 4));
        for line in out.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(&fields[1..], ["10.96.0.101", "80"], "getpeername shows the Service: {line}");
            backends.insert(fields[0].to_owned());
        }
    }
    assert_eq!(backends.len(), 1, "16 connections of one pod with ClientIP affinity: {backends:?}");
    assert!(backends.iter().all(|b| b.starts_with("10.244.0.1")), "{backends:?}");
    assert!(cluster.stat("socket_lb_translated") >= translated_before + 16);
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before, "the hooks translated, not tc");
    // Without affinity the same pod spreads over the backends.
    let out = run(&cluster.cgroup, cluster.client.netns(), &whoami_script(&WEB_VIP.to_string(), 80, 24));
    let spread: std::collections::BTreeSet<&str> = out.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(spread.len() > 1, "24 connections without affinity all on one backend: {out}");
}

/// Hairpin: the client pod reaches its own server through a Service whose only endpoint is the
/// pod itself; getpeername shows the Service.
fn a_pod_reaches_itself_through_its_service(datapath: Datapath) {
    let cluster = start("sock-hairpin", datapath);
    web_service_copy(&cluster, "itself", "10.96.0.102", |yaml| {
        let (service, _) = yaml.split_once("endpoints:\n").unwrap();
        format!(
            "{service}endpoints:\n- addresses:\n  - {CLIENT_IP}\n  conditions:\n    ready: true\n  nodeName: node-1\n\
             ports:\n- name: http\n  port: {CLIENT_SERVER_PORT}\n  protocol: TCP\n"
        )
    });
    cluster.wait_for_frontends(&[("10.96.0.102:80", "TCP", 1)]);
    let out = run(&cluster.cgroup, cluster.client.netns(), &whoami_script("10.96.0.102", 80, 3));
    assert_eq!(out.lines().collect::<Vec<_>>(), ["client 10.96.0.102 80"; 3], "{out}");
}

/// A port the cluster IP does not have is refused at connect(), as the tc path refuses it.
fn a_service_port_the_cluster_ip_does_not_have_refuses_connect(datapath: Datapath) {
    let cluster = start("sock-noport", datapath);
    let script = format!(
        r#"
import socket, errno
try:
    socket.create_connection(('{WEB_VIP}', 81), timeout=5)
    print('connected')
except OSError as e:
    print(errno.errorcode.get(e.errno, e))
"#
    );
    assert_eq!(run(&cluster.cgroup, cluster.client.netns(), &script).trim(), "ECONNREFUSED");
}

/// Coverage follows the pod's processes: one that enters the covered client pod's namespace
/// from outside the cgroup makes the agent attach tc to its veth again (its sockets are not the
/// hooks'), and its Service traffic is translated there; once it is gone, the veth is bare again.
#[test]
fn a_pod_with_a_process_outside_the_cgroup_gets_tc_back_and_loses_it_when_it_leaves() {
    let cluster = start("sock-cover", Datapath::SocketLbNoTc);
    let veth = cluster.client.host_veth().to_owned();
    // doctor knows the bare veth is the hooks' doing: no WARN, and it says why.
    let attach = doctor_attach_checks(&cluster);
    assert!(attach.iter().all(|(status, ..)| status == "OK"), "doctor: {attach:#?}");
    let covered = format!("{veth} covered by the socket hooks: no per-packet program needed");
    assert!(attach.iter().any(|(_, _, finding)| finding.contains(&covered)), "doctor: {attach:#?}");
    let mut nsenter = std::process::Command::new("nsenter");
    nsenter.arg(format!("--net={}", cluster.client.netns_path().display())).args(["sleep", "600"]);
    let outsider = cluster.client.spawn_command(nsenter).unwrap();
    let wait_for = |wanted: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut programs = cluster.tc_programs(&veth);
            programs.sort();
            if programs == wanted {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{veth}: {programs:?}, not {wanted:?}; the outsider {}: {}\n{}",
                if outsider.is_running() { "runs" } else { "has exited" },
                outsider.log(),
                cluster.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_for(&["kproxy_egress", "kproxy_ingress"]);
    // The agent says why, in a line that may reach its log a moment after the attach.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.agent_log().contains("pod no longer covered by the socket hooks") {
        assert!(Instant::now() < deadline, "{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let dnat_before = cluster.stat("dnat_new_flow");
    let page = cluster.client.curl(&format!("http://{WEB_VIP}/whoami")).unwrap();
    assert!(page.starts_with("10.244.0.1"), "{page}");
    assert_eq!(cluster.stat("dnat_new_flow"), dnat_before + 1, "the outsider's connection went through tc");
    outsider.kill().unwrap();
    wait_for(&[]);
    check_veths(&cluster);
    let attach = doctor_attach_checks(&cluster);
    assert!(attach.iter().all(|(status, ..)| status == "OK"), "doctor: {attach:#?}");
}

/// An address of the service CIDR that no Service has is refused at connect() (EPERM, as for the
/// node's own sockets): with no tc on the veth nothing else would keep it from leaving the node.
fn an_unallocated_service_address_is_refused_at_connect(datapath: Datapath) {
    let mut cluster = start("sock-unalloc", datapath);
    cluster.stop_agent();
    cluster.extra_agent_args.extend(["--service-cidr".into(), "10.96.0.0/16".into()]);
    cluster.start_agent();
    cluster.wait_for_attachment();
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.dump_json("service-cidrs").as_array().is_none_or(|a| a.is_empty()) {
        assert!(Instant::now() < deadline, "no service CIDR programmed:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let dropped_before = cluster.stat("drop_unallocated_service_ip");
    let script = r#"
import socket, errno
for proto in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
    s = socket.socket(socket.AF_INET, proto)
    s.settimeout(5)
    try:
        if proto == socket.SOCK_STREAM:
            s.connect(('10.96.0.222', 80))
        else:
            s.sendto(b'x', ('10.96.0.222', 53))
        print('sent')
    except OSError as e:
        print(errno.errorcode.get(e.errno, e))
"#;
    assert_eq!(
        run(&cluster.cgroup, cluster.client.netns(), script).split_whitespace().collect::<Vec<_>>(),
        ["EPERM"; 2]
    );
    assert!(cluster.stat("drop_unallocated_service_ip") >= dropped_before + 2);
    check_veths(&cluster);
}
