//! Ephemeral port reuse, with real clients in a sandbox: a client pod that reached a backend
//! through a Service and then reaches the same pod directly from the same source port (a
//! StatefulSet peer, a Kafka client that bootstraps through a Service, a resolver asking a
//! CoreDNS pod by address) must get its replies — kproxy may un-NAT only what it NATed. And two
//! live flows whose reply tuples would be equal (the same port to the Service and to the pod, or
//! to two Services with one backend) must both exchange data. netfilter's kube-proxy passes all
//! of these (a closed connection's tuple is reused; a clashing source port is remapped). Needs
//! root.

mod common;

use common::cluster::{Cluster, DNS_PODS, DNS_VIP, WEB_PODS, WEB_VIP};
use serde_json::Value;

/// The client side, run in the client pod: each scenario prints one JSON object.
const CLIENT: &str = r#"
import json, socket, struct, sys

def bound(kind, port):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('0.0.0.0', port))
    s.settimeout(3)
    return s

def http(s, close):
    s.sendall(b'GET / HTTP/1.1\r\nHost: x\r\nConnection: ' + (b'close' if close else b'keep-alive') + b'\r\n\r\n')
    data = b''
    while b'\r\n\r\n' not in data:
        data += s.recv(4096)
    head, body = data.split(b'\r\n\r\n', 1)
    length = int([l.split(b':')[1] for l in head.split(b'\r\n') if l.lower().startswith(b'content-length')][0])
    while len(body) < length:
        body += s.recv(4096)
    if close:
        # The server closes first (Connection: close): the client keeps no TIME_WAIT.
        while s.recv(4096):
            pass
    return body.decode().strip()

def get(port, addr, close=True):
    s = bound(socket.SOCK_STREAM, port)
    try:
        s.connect((addr, 80))
        return {'ok': True, 'pod': http(s, close), 'peer': s.getpeername()[0]}
    except OSError as e:
        return {'ok': False, 'error': str(e)}
    finally:
        s.close()

def dns_query(name):
    return struct.pack('>HHHHHH', 0x4b50, 0x0100, 1, 0, 0, 0) + b''.join(
        bytes([len(p)]) + p.encode() for p in name.split('.')) + b'\0' + struct.pack('>HH', 1, 1)

def dns_answer(data):
    # The last 4 bytes of a one-answer A response are the address.
    return socket.inet_ntoa(data[-4:]) if len(data) >= 16 and data[7] == 1 else None

def dns(port, addrs):
    s = bound(socket.SOCK_DGRAM, port)
    out = []
    for addr in addrs:
        s.sendto(dns_query('ip.kproxy.test'), (addr, 53))
        try:
            data, peer = s.recvfrom(4096)
            out.append({'ok': True, 'from': peer[0], 'pod_ip': dns_answer(data)})
        except OSError as e:
            out.append({'ok': False, 'error': str(e)})
    s.close()
    return out

scenario, vip, pods = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if scenario == 'tcp-reuse':
    for port in range(41000, 41010):
        via = get(port, vip)
        direct = get(port, pods[via['pod']]) if via['ok'] else None
        print(json.dumps({'port': port, 'via_service': via, 'direct': direct}))
elif scenario == 'udp-reuse':
    for port in range(42000, 42010):
        via = dns(port, [vip])[0]
        direct = dns(port, [via['pod_ip']])[0] if via['ok'] else None
        print(json.dumps({'port': port, 'via_service': via, 'direct': direct}))
elif scenario == 'tcp-live':
    for port in range(43000, 43005):
        a = bound(socket.SOCK_STREAM, port)
        a.connect((vip, 80))
        first = http(a, False)
        b = bound(socket.SOCK_STREAM, port)
        try:
            b.connect((pods[first], 80))
            direct = {'ok': True, 'pod': http(b, False)}
        except OSError as e:
            direct = {'ok': False, 'error': str(e)}
        try:
            again = {'ok': True, 'pod': http(a, False)}
        except OSError as e:
            again = {'ok': False, 'error': str(e)}
        a.close(); b.close()
        print(json.dumps({'port': port, 'first': first, 'direct': direct, 'again': again}))
elif scenario == 'udp-live':
    for port in range(44000, 44005):
        first = dns(port, [vip])[0]
        both = dns(port, [first['pod_ip'], vip, first['pod_ip'], vip])
        print(json.dumps({'port': port, 'first': first, 'then': both}))
elif scenario == 'two-services':
    for port in range(45000, 45005):
        a = bound(socket.SOCK_STREAM, port)
        a.connect((vip, 80))
        b = bound(socket.SOCK_STREAM, port)
        out = {'port': port}
        try:
            b.connect((pods['other'], 80))
            out['second'] = {'ok': True, 'pod': http(b, False)}
        except OSError as e:
            out['second'] = {'ok': False, 'error': str(e)}
        try:
            out['first'] = {'ok': True, 'pod': http(a, False)}
        except OSError as e:
            out['first'] = {'ok': False, 'error': str(e)}
        a.close(); b.close()
        print(json.dumps(out))
"#;

fn run(cluster: &Cluster, scenario: &str, vip: &str, pods: &Value) -> Vec<Value> {
    let script = cluster.sandbox.dir().join("port_reuse_client.py");
    std::fs::write(&script, CLIENT).unwrap();
    let out = cluster
        .client
        .exec_output(["python3", script.to_str().unwrap(), scenario, vip, &pods.to_string()])
        .unwrap();
    assert!(out.status.success(), "client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn web_pods() -> Value {
    Value::Object(WEB_PODS.iter().map(|(name, ip)| ((*name).to_owned(), ip.to_string().into())).collect())
}

#[test]
fn a_pod_reached_through_a_service_answers_directly_from_the_same_port() {
    let cluster = Cluster::start("reuse-tcp");
    let rows = run(&cluster, "tcp-reuse", &WEB_VIP.to_string(), &web_pods());
    assert_eq!(rows.len(), 10);
    for row in &rows {
        assert_eq!(row["via_service"]["ok"], true, "{row}");
        assert_eq!(row["via_service"]["peer"], WEB_VIP.to_string(), "{row}");
        assert_eq!(
            row["direct"]["ok"], true,
            "direct connection after a closed one through the Service: {row}"
        );
        assert_eq!(row["direct"]["pod"], row["via_service"]["pod"], "{row}");
    }
    assert!(cluster.stat("clash_yielded") >= 10, "{:#}", cluster.dump_json("stats"));
}

#[test]
fn a_dns_pod_asked_through_the_service_answers_directly_from_the_same_port() {
    let cluster = Cluster::start("reuse-udp");
    let rows = run(&cluster, "udp-reuse", &DNS_VIP.to_string(), &Value::Null);
    assert_eq!(rows.len(), 10);
    let dns_ips: Vec<String> = DNS_PODS.iter().map(|(_, ip)| ip.to_string()).collect();
    for row in &rows {
        assert_eq!(row["via_service"]["ok"], true, "{row}");
        assert_eq!(row["via_service"]["from"], DNS_VIP.to_string(), "{row}");
        assert!(dns_ips.contains(&row["via_service"]["pod_ip"].as_str().unwrap().to_owned()), "{row}");
        assert_eq!(row["direct"]["ok"], true, "direct query after one through the Service: {row}");
        assert_eq!(row["direct"]["from"], row["via_service"]["pod_ip"], "answered by the pod itself: {row}");
    }
}

/// Both flows of a live collision exchange data: a keep-alive connection through the Service and
/// a second socket on the same port to the backend it landed on.
#[test]
fn a_live_connection_through_the_service_and_one_to_its_pod_share_a_port() {
    let cluster = Cluster::start("reuse-live");
    let rows = run(&cluster, "tcp-live", &WEB_VIP.to_string(), &web_pods());
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert_eq!(row["direct"]["ok"], true, "{row}");
        assert_eq!(row["direct"]["pod"], row["first"], "{row}");
        assert_eq!(row["again"]["ok"], true, "the Service connection still works: {row}");
        assert_eq!(row["again"]["pod"], row["first"], "{row}");
    }
    assert!(cluster.stat("port_remapped") >= 5, "{:#}", cluster.dump_json("stats"));
    let conntrack = cluster.kproxy(&["dump", "conntrack"]);
    assert!(!conntrack.is_empty());

    // UDP: one unconnected socket asks the Service and the pod by turns; every answer comes from
    // the address it was sent to.
    let rows = run(&cluster, "udp-live", &DNS_VIP.to_string(), &Value::Null);
    for row in &rows {
        assert_eq!(row["first"]["ok"], true, "{row}");
        let then = row["then"].as_array().unwrap();
        for (i, answer) in then.iter().enumerate() {
            assert_eq!(answer["ok"], true, "{row}");
            let expected =
                if i % 2 == 0 { row["first"]["pod_ip"].clone() } else { DNS_VIP.to_string().into() };
            assert_eq!(answer["from"], expected, "{row}");
        }
    }
}

/// Two Services in front of one pod, and one client port used for both at once: the second
/// flow's reply tuple is the first's, so its port is remapped.
#[test]
fn two_services_with_one_backend_share_a_client_port() {
    let cluster = Cluster::start("reuse-two");
    let (name, ip) = WEB_PODS[0];
    for (svc, vip) in [("one", "10.96.0.51"), ("two", "10.96.0.52")] {
        std::fs::write(
            cluster.manifest(&format!("{svc}.yaml")),
            format!(
                "apiVersion: v1
kind: Service
metadata: {{name: {svc}, namespace: default}}
spec:
  clusterIP: {vip}
  ports: [{{name: http, port: 80, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {svc}-1
  namespace: default
  labels: {{kubernetes.io/service-name: {svc}}}
addressType: IPv4
endpoints: [{{addresses: [{ip}], conditions: {{ready: true}}}}]
ports: [{{name: http, port: 80, protocol: TCP}}]
"
            ),
        )
        .unwrap();
    }
    cluster.wait_for_frontends(&[("10.96.0.51:80", "TCP", 1), ("10.96.0.52:80", "TCP", 1)]);
    let rows = run(&cluster, "two-services", "10.96.0.51", &serde_json::json!({"other": "10.96.0.52"}));
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert_eq!(row["first"]["ok"], true, "{row}");
        assert_eq!(row["first"]["pod"], name, "{row}");
        assert_eq!(row["second"]["ok"], true, "{row}");
        assert_eq!(row["second"]["pod"], name, "{row}");
    }
}
