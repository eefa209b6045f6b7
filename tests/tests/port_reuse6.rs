//! Ephemeral port reuse over IPv6, with real clients in dual-stack pods (as `port_reuse.rs` for
//! IPv4): a client that reached a backend through an IPv6 Service and then reaches the same pod
//! directly from the same source port must get its replies from the pod — kproxy may un-NAT only
//! what it NATed — and two live flows whose reply tuples would be equal (the same port to the
//! Service and to the pod, or to two Services with one backend) must both exchange data.
//! netfilter's kube-proxy passes all of these (a closed connection's tuple is reused; a clashing
//! source port is remapped). The real agent programs the IPv6 Services from its manifests. Needs
//! root.

mod common;

use std::net::{Ipv4Addr, Ipv6Addr};

use common::cluster::{CLIENT_IP, Cluster, Mode};
use sandbox::Pod;
use serde_json::Value;

const WEB_VIP6: &str = "fd00:10:96::300";
const DNS_VIP6: &str = "fd00:10:96::353";
/// Two more Services in front of web6-a alone.
const ONE_VIP6: &str = "fd00:10:96::351";
const TWO_VIP6: &str = "fd00:10:96::352";

/// The client side, run in the client pod: each scenario prints one JSON object per port.
const CLIENT: &str = r#"
import json, socket, struct, sys

def bound(kind, port):
    s = socket.socket(socket.AF_INET6, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('::', port))
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
        bytes([len(p)]) + p.encode() for p in name.split('.')) + b'\0' + struct.pack('>HH', 28, 1)

def dns_answer(data):
    # The last 16 bytes of a one-answer AAAA response are the address.
    return socket.inet_ntop(socket.AF_INET6, data[-16:]) if len(data) >= 28 and data[7] == 1 else None

def dns(port, addrs):
    s = bound(socket.SOCK_DGRAM, port)
    out = []
    for addr in addrs:
        s.sendto(dns_query('ip6.kproxy.test'), (addr, 53))
        try:
            data, peer = s.recvfrom(4096)
            out.append({'ok': True, 'from': peer[0], 'pod_ip': dns_answer(data)})
        except OSError as e:
            out.append({'ok': False, 'error': str(e)})
    s.close()
    return out

scenario, vip, pods = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if scenario == 'tcp-reuse':
    for port in range(41000, 41006):
        via = get(port, vip)
        direct = get(port, pods[via['pod']]) if via['ok'] else None
        print(json.dumps({'port': port, 'via_service': via, 'direct': direct}))
elif scenario == 'udp-reuse':
    for port in range(42000, 42006):
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
            out['second'] = {'ok': True, 'pod': http(b, False), 'peer': b.getpeername()[0]}
        except OSError as e:
            out['second'] = {'ok': False, 'error': str(e)}
        try:
            out['first'] = {'ok': True, 'pod': http(a, False), 'peer': a.getpeername()[0]}
        except OSError as e:
            out['first'] = {'ok': False, 'error': str(e)}
        a.close(); b.close()
        print(json.dumps(out))
"#;

/// The pods' IPv6 addresses: `fd00:10:244::<last IPv4 octet>`.
fn ipv6_of(ip: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, u16::from(ip.octets()[3]))
}

const WEB: [(&str, Ipv4Addr); 2] =
    [("web6-a", Ipv4Addr::new(10, 244, 0, 31)), ("web6-b", Ipv4Addr::new(10, 244, 0, 32))];
const DNS: [(&str, Ipv4Addr); 2] =
    [("dns6-a", Ipv4Addr::new(10, 244, 0, 41)), ("dns6-b", Ipv4Addr::new(10, 244, 0, 42))];

/// An IPv6 Service on `vip` with `ports` and one IPv6 slice of `pods`.
fn service(name: &str, vip: &str, pods: &[(&str, Ipv4Addr)], ports: &[(&str, u16, &str)]) -> String {
    let service_ports: String = ports
        .iter()
        .map(|(n, p, proto)| format!("  - name: {n}\n    port: {p}\n    protocol: {proto}\n"))
        .collect();
    let slice_ports: String = ports
        .iter()
        .map(|(n, p, proto)| format!("- name: {n}\n  port: {p}\n  protocol: {proto}\n"))
        .collect();
    let endpoints: String = pods
        .iter()
        .map(|(pod, ip)| {
            format!(
                "- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n  nodeName: node-1\n  targetRef: {{kind: Pod, name: {pod}}}\n",
                ipv6_of(*ip)
            )
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  clusterIP: \"{vip}\"\n  clusterIPs: [\"{vip}\"]\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n  ports:\n{service_ports}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-v6\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv6\nendpoints:\n{endpoints}ports:\n{slice_ports}"
    )
}

/// The example cluster with its client made dual-stack, two dual-stack nginx pods behind `web6`
/// (and web6-a alone behind `one6` and `two6`), two dual-stack dnsmasq pods behind `dns6`, the
/// agent started on the manifests.
fn start(tag: &str) -> (Cluster, Vec<Pod>) {
    let mut cluster = Cluster::prepared(tag, Mode::Files);
    cluster.client.add_ipv6(ipv6_of(CLIENT_IP)).unwrap();
    let dual_pod = |cluster: &Cluster, name: &str, ip: Ipv4Addr| {
        let mut pod = cluster.sandbox.add_pod(name, ip).unwrap();
        pod.add_ipv6(ipv6_of(ip)).unwrap();
        pod
    };
    let mut pods = Vec::new();
    for (name, ip) in WEB {
        let pod = dual_pod(&cluster, name, ip);
        pod.start_nginx(&format!("{name}\n")).unwrap();
        pods.push(pod);
    }
    for (name, ip) in DNS {
        let pod = dual_pod(&cluster, name, ip);
        pod.start_dnsmasq(ip).unwrap();
        pods.push(pod);
    }
    let http = [("http", 80, "TCP")];
    let manifests = [
        service("web6", WEB_VIP6, &WEB, &http),
        service("dns6", DNS_VIP6, &DNS, &[("dns", 53, "UDP")]),
        service("one6", ONE_VIP6, &WEB[..1], &http),
        service("two6", TWO_VIP6, &WEB[..1], &http),
    ]
    .join("---\n");
    std::fs::write(cluster.manifest("port-reuse6.yaml"), manifests).unwrap();
    cluster.start_agent();
    cluster.wait_for_frontends(&[
        (&format!("[{WEB_VIP6}]:80"), "TCP", 2),
        (&format!("[{DNS_VIP6}]:53"), "UDP", 2),
        (&format!("[{ONE_VIP6}]:80"), "TCP", 1),
        (&format!("[{TWO_VIP6}]:80"), "TCP", 1),
    ]);
    cluster.wait_for_attachment();
    (cluster, pods)
}

fn run(cluster: &Cluster, scenario: &str, vip: &str, pods: &Value) -> Vec<Value> {
    run_in(cluster, &cluster.client, scenario, vip, pods)
}

/// [`run`] with the client side in `pod`.
fn run_in(cluster: &Cluster, pod: &Pod, scenario: &str, vip: &str, pods: &Value) -> Vec<Value> {
    let script = cluster.sandbox.dir().join("port_reuse6_client.py");
    std::fs::write(&script, CLIENT).unwrap();
    let out =
        pod.exec_output(["python3", script.to_str().unwrap(), scenario, vip, &pods.to_string()]).unwrap();
    assert!(out.status.success(), "client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn web_pods() -> Value {
    Value::Object(
        WEB.iter().map(|(name, ip)| ((*name).to_owned(), ipv6_of(*ip).to_string().into())).collect(),
    )
}

/// After a closed connection (TCP) or an answered query (UDP) through the IPv6 Service, the same
/// source port reaches the pod directly and is answered by the pod itself; and while a keep-alive
/// connection through the Service lives, a second socket on its port to the same pod works too,
/// as does the first afterwards; one UDP socket asking the Service and the pod by turns gets every
/// answer from the address it asked.
#[test]
fn ipv6_clients_reusing_a_port_of_a_service_flow_reach_the_pod_directly() {
    let (cluster, _pods) = start("reuse6");

    let rows = run(&cluster, "tcp-reuse", WEB_VIP6, &web_pods());
    assert_eq!(rows.len(), 6);
    for row in &rows {
        assert_eq!(row["via_service"]["ok"], true, "{row}");
        assert_eq!(row["via_service"]["peer"], WEB_VIP6, "{row}");
        assert_eq!(
            row["direct"]["ok"], true,
            "direct connection after a closed one through the Service: {row}"
        );
        assert_eq!(row["direct"]["pod"], row["via_service"]["pod"], "{row}");
    }
    assert!(cluster.stat("clash_yielded") >= 6, "{:#}", cluster.dump_json("stats"));

    let rows = run(&cluster, "udp-reuse", DNS_VIP6, &Value::Null);
    assert_eq!(rows.len(), 6);
    let dns_ips: Vec<String> = DNS.iter().map(|(_, ip)| ipv6_of(*ip).to_string()).collect();
    for row in &rows {
        assert_eq!(row["via_service"]["ok"], true, "{row}");
        assert_eq!(row["via_service"]["from"], DNS_VIP6, "{row}");
        assert!(dns_ips.contains(&row["via_service"]["pod_ip"].as_str().unwrap().to_owned()), "{row}");
        assert_eq!(row["direct"]["ok"], true, "direct query after one through the Service: {row}");
        assert_eq!(row["direct"]["from"], row["via_service"]["pod_ip"], "answered by the pod itself: {row}");
    }

    let remapped = cluster.stat("port_remapped");
    let rows = run(&cluster, "tcp-live", WEB_VIP6, &web_pods());
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert_eq!(row["direct"]["ok"], true, "{row}");
        assert_eq!(row["direct"]["pod"], row["first"], "{row}");
        assert_eq!(row["again"]["ok"], true, "the Service connection still works: {row}");
        assert_eq!(row["again"]["pod"], row["first"], "{row}");
    }
    assert!(cluster.stat("port_remapped") >= remapped + 5, "{:#}", cluster.dump_json("stats"));

    let rows = run(&cluster, "udp-live", DNS_VIP6, &Value::Null);
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert_eq!(row["first"]["ok"], true, "{row}");
        let then = row["then"].as_array().unwrap();
        for (i, answer) in then.iter().enumerate() {
            assert_eq!(answer["ok"], true, "{row}");
            let expected = if i % 2 == 0 { row["first"]["pod_ip"].clone() } else { DNS_VIP6.into() };
            assert_eq!(answer["from"], expected, "{row}");
        }
    }
}

/// Two IPv6 Services in front of one pod, and one client port used for both at once: the second
/// flow's reply tuple is the first's, so its port is remapped, and both connections work.
#[test]
fn two_ipv6_services_with_one_backend_share_a_client_port() {
    let (cluster, _pods) = start("reuse6-two");
    let rows = run(&cluster, "two-services", ONE_VIP6, &serde_json::json!({"other": TWO_VIP6}));
    assert_eq!(rows.len(), 5);
    for row in &rows {
        assert_eq!(row["first"]["ok"], true, "{row}");
        assert_eq!(
            (&row["first"]["pod"], &row["first"]["peer"]),
            (&"web6-a".into(), &ONE_VIP6.into()),
            "{row}"
        );
        assert_eq!(row["second"]["ok"], true, "{row}");
        assert_eq!(
            (&row["second"]["pod"], &row["second"]["peer"]),
            (&"web6-a".into(), &TWO_VIP6.into()),
            "{row}"
        );
    }
    assert!(cluster.stat("port_remapped") >= 5, "{:#}", cluster.dump_json("stats"));

    // Each remapped flow holds two SNAT_V6 entries (its own key, its reply key); a flush takes them
    // with the flows, so no stale remapped port outlives its conntrack entries.
    let snat_v6_entries = || {
        let maps = kproxy::bpf::Maps::from_pins(&kproxy::bpf::PinDir::new(&cluster.pin_dir)).unwrap();
        maps.snat_v6.keys().count()
    };
    assert!(snat_v6_entries() >= 10, "{} SNAT_V6 entries", snat_v6_entries());
    cluster.kproxy(&["conntrack", "flush"]);
    assert_eq!(snat_v6_entries(), 0, "SNAT_V6 after a flush");
}

/// The same from web6-a itself: the pod reaches itself through both Services from one port at
/// once (hairpin), so both flows' reply tuples are `web6-a:80 → the hairpin address:port`; the
/// second one's port is remapped and both connections work, each answered from its Service.
#[test]
fn a_pod_reaching_itself_through_two_ipv6_services_from_one_port_keeps_both_connections() {
    let (cluster, pods) = start("reuse6-hairpin");
    let web_a = &pods[0];
    let rows = run_in(&cluster, web_a, "two-services", ONE_VIP6, &serde_json::json!({"other": TWO_VIP6}));
    assert_eq!(rows.len(), 5);
    for row in &rows {
        for (which, vip) in [("first", ONE_VIP6), ("second", TWO_VIP6)] {
            assert_eq!(row[which]["ok"], true, "{which}: {row}");
            assert_eq!((&row[which]["pod"], &row[which]["peer"]), (&"web6-a".into(), &vip.into()), "{row}");
        }
    }
    assert!(cluster.stat("hairpin") >= 10, "{:#}", cluster.dump_json("stats"));
    assert!(cluster.stat("port_remapped") >= 5, "{:#}", cluster.dump_json("stats"));
}
