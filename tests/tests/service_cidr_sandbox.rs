//! Unallocated service addresses, with real clients in a sandbox: inside a service CIDR, an address
//! that is no Service's is dropped on the node and never leaves it, as kube-proxy's nftables mode
//! drops it (`pkg/proxy/nftables/proxier.go`, chain `cluster-ips-check`: "Drop traffic to
//! unallocated ClusterIPs", with the CIDRs of the ServiceCIDR objects).
//!
//! The node namespace routes 10.96.0.0/16 to a dead end (a permanent neighbour on the port-less node
//! bridge), as a real node's default route would carry such a packet away; an nftables counter in
//! the sandbox's node namespace (postrouting, that route's interface) counts what leaves that way.
//! Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Mode};
use sandbox::NODE_DEVICE;

/// An address of the service range that no Service of the cluster has.
const UNALLOCATED: &str = "10.96.0.77";

/// A family's service range, the dead end it is routed to (a permanent neighbour on the port-less
/// node bridge) and the nftables family its counter lives in.
struct DeadEnd {
    ip_flag: &'static str,
    hop: &'static str,
    range: &'static str,
    nft_family: &'static str,
}

const DEAD_END_V4: DeadEnd =
    DeadEnd { ip_flag: "-4", hop: "10.0.0.254", range: "10.96.0.0/16", nft_family: "ip" };
const DEAD_END_V6: DeadEnd =
    DeadEnd { ip_flag: "-6", hop: "fe80::fe", range: "fd00:10:96::/112", nft_family: "ip6" };

/// Routes the service range of `dead_end`'s family to it and counts what the node sends there.
fn route_to_a_counted_dead_end(cluster: &Cluster, dead_end: &DeadEnd) {
    let DeadEnd { ip_flag, hop, range, nft_family } = dead_end;
    let node = |args: &[&str]| cluster.sandbox.node_exec(args.iter().copied()).unwrap();
    if *ip_flag == "-6" {
        // The sandbox's node bridge has IPv6 off until an IPv6 route needs it.
        node(&["sysctl", "-qw", &format!("net.ipv6.conf.{NODE_DEVICE}.disable_ipv6=0")]);
    }
    let lladdr = "02:00:00:00:00:fe";
    node(&["ip", ip_flag, "neigh", "replace", hop, "lladdr", lladdr, "dev", NODE_DEVICE, "nud", "permanent"]);
    node(&["ip", ip_flag, "route", "add", range, "via", hop, "dev", NODE_DEVICE, "onlink"]);
    let rules = format!(
        "table {nft_family} observe {{\n  counter leaked {{}}\n  chain post {{\n    type filter hook postrouting \
         priority 0; policy accept;\n    oifname \"{NODE_DEVICE}\" {nft_family} daddr {range} counter name leaked\n  \
         }}\n}}\n"
    );
    let file = cluster.sandbox.dir().join(format!("observe-{nft_family}.nft"));
    std::fs::write(&file, rules).unwrap();
    cluster.sandbox.node_exec(["nft".as_ref(), "-f".as_ref(), file.as_os_str()]).unwrap();
}

/// The IPv4 service range routed to its dead end.
fn route_the_range_to_a_counted_dead_end(cluster: &Cluster) {
    route_to_a_counted_dead_end(cluster, &DEAD_END_V4);
}

/// Packets to the service range of `dead_end`'s family that left the node through its route.
fn leaked_to(cluster: &Cluster, dead_end: &DeadEnd) -> u64 {
    let family = dead_end.nft_family;
    let out =
        cluster.sandbox.node_exec(["nft", "-j", "list", "counter", family, "observe", "leaked"]).unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    json["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|item| item["counter"]["packets"].as_u64())
        .unwrap_or_else(|| panic!("no counter in {out}"))
}

fn leaked(cluster: &Cluster) -> u64 {
    leaked_to(cluster, &DEAD_END_V4)
}

/// curl's exit code for one request from the client pod (7: refused, 28: timed out).
fn curl_exit(cluster: &Cluster, url: &str) -> Option<i32> {
    cluster.client.exec_output(["curl", "-sS", "--max-time", "2", url]).unwrap().status.code()
}

/// Waits until a request to the unallocated address is dropped by kproxy (counted, nothing leaves).
fn wait_until_dropped(cluster: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (drops, leaks) = (cluster.stat("drop_unallocated_service_ip"), leaked(cluster));
        assert_eq!(curl_exit(cluster, &format!("http://{UNALLOCATED}/")), Some(28), "the client times out");
        if cluster.stat("drop_unallocated_service_ip") > drops && leaked(cluster) == leaks {
            return;
        }
        assert!(Instant::now() < deadline, "never dropped on the node:\n{}", cluster.agent_log());
    }
}

/// The range no longer known: the packet leaves the node again.
fn assert_leaves_the_node(cluster: &Cluster) {
    let (drops, leaks) = (cluster.stat("drop_unallocated_service_ip"), leaked(cluster));
    assert_eq!(curl_exit(cluster, &format!("http://{UNALLOCATED}/")), Some(28));
    assert!(leaked(cluster) > leaks, "the SYN did not leave the node");
    assert_eq!(cluster.stat("drop_unallocated_service_ip"), drops);
}

/// One ICMP echo request (a raw socket; the machine has no `ping`) to `argv[1]`: exit 0 on its echo reply, 1
/// when none comes within a second.
const PING: &str = r#"
import socket, struct, sys
def checksum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
echo = struct.pack("!BBHHH", 8, 0, 0, 0x4b50, 1) + b"kproxy"
echo = echo[:2] + struct.pack("!H", checksum(echo)) + echo[4:]
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock.settimeout(1)
sock.sendto(echo, (sys.argv[1], 0))
try:
    while True:
        data, peer = sock.recvfrom(2048)
        if peer[0] == sys.argv[1] and data[(data[0] & 15) * 4] == 0:
            sys.exit(0)
except socket.timeout:
    sys.exit(1)
"#;

/// One ping from the client pod to the unallocated address (never answered: the dead end has no host): how many
/// packets kproxy dropped as unallocated, and how many left the node, meanwhile.
fn ping_unallocated(cluster: &Cluster) -> (u64, u64) {
    let (drops, leaks) = (cluster.stat("drop_unallocated_service_ip"), leaked(cluster));
    let out = cluster.client.exec_output(["python3", "-c", PING, UNALLOCATED]).unwrap();
    assert_eq!(out.status.code(), Some(1), "no reply: {}", String::from_utf8_lossy(&out.stderr));
    (cluster.stat("drop_unallocated_service_ip") - drops, leaked(cluster) - leaks)
}

/// [`PING`] for IPv6: one echo request (the kernel fills in an ICMPv6 raw socket's checksum) to `argv[1]`.
const PING6: &str = r#"
import socket, struct, sys
sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
sock.settimeout(1)
sock.sendto(struct.pack("!BBHHH", 128, 0, 0, 0x4b50, 1) + b"kproxy", (sys.argv[1], 0))
try:
    while True:
        data, peer = sock.recvfrom(2048)
        if peer[0] == sys.argv[1] and data[0] == 129:
            sys.exit(0)
except socket.timeout:
    sys.exit(1)
"#;

const UNALLOCATED6: &str = "fd00:10:96::77";

/// One `ping -6` from the client pod to [`UNALLOCATED6`], its neighbour cache flushed first (so that
/// the echo request goes out only once neighbour discovery with the node has worked): the packets
/// kproxy dropped as unallocated (when it runs) and those that left the node, meanwhile.
fn ping6_unallocated(cluster: &Cluster, agent_running: bool) -> (u64, u64) {
    let drops = || if agent_running { cluster.stat("drop_unallocated_service_ip") } else { 0 };
    let (before, leaks) = (drops(), leaked_to(cluster, &DEAD_END_V6));
    cluster.client.exec(["ip", "-6", "neigh", "flush", "dev", "eth0"]).unwrap();
    let out = cluster.client.exec_output(["python3", "-c", PING6, UNALLOCATED6]).unwrap();
    assert_eq!(out.status.code(), Some(1), "no reply: {}", String::from_utf8_lossy(&out.stderr));
    (drops() - before, leaked_to(cluster, &DEAD_END_V6) - leaks)
}

const SERVICE_CIDR: &str = "apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata:
  name: kubernetes
spec:
  cidrs:
  - 10.96.0.0/16
  - fd00:10:96::/112
";

#[test]
fn an_unallocated_address_of_a_service_cidr_from_the_api_server_is_dropped_on_the_node() {
    let cluster = Cluster::start_with("svc-cidr-api", Mode::Api);
    route_the_range_to_a_counted_dead_end(&cluster);

    // No ServiceCIDR yet: nothing is dropped (kube-proxy adds its rule once it knows a CIDR).
    assert_leaves_the_node(&cluster);

    assert_eq!(cluster.dump_json("service-cidrs"), serde_json::json!([]));
    cluster.api().apply_yaml(SERVICE_CIDR).unwrap();
    wait_until_dropped(&cluster);
    assert_eq!(
        cluster.dump_json("service-cidrs"),
        serde_json::json!([{"cidr": "10.96.0.0/16"}, {"cidr": "fd00:10:96::/112"}]),
        "both families' ranges, SERVICE_CIDRS_V4 and SERVICE_CIDRS_V6"
    );
    // The cluster's Services in the range are served as before, and a port a cluster IP does not
    // have is still refused at once.
    assert!(
        cluster
            .client
            .exec(["curl", "-sS", "--max-time", "5", "http://10.96.0.100/"])
            .unwrap()
            .starts_with("web-")
    );
    assert_eq!(curl_exit(&cluster, "http://10.96.0.100:81/"), Some(7));
    let log = cluster.agent_log();
    assert!(
        log.lines().any(|l| l.contains("unallocated addresses of these service CIDRs are dropped")
            && l.contains("10.96.0.0/16")
            && l.contains("fd00:10:96::/112")),
        "{log}"
    );

    // The node's own sockets (hostNetwork processes, through the socket hooks): refused at once
    // (EPERM), and nothing leaves either.
    let (drops, leaks) = (cluster.stat("drop_unallocated_service_ip"), leaked(&cluster));
    let out = cluster
        .cgroup
        .command(
            cluster.sandbox.node_netns(),
            &["curl", "-sS", "--max-time", "2", &format!("http://{UNALLOCATED}/")],
        )
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(leaked(&cluster), leaks);
    assert!(cluster.stat("drop_unallocated_service_ip") > drops);

    // The ServiceCIDR deleted: the range is no longer known, and nothing is dropped.
    assert!(cluster.api().delete("ServiceCIDR", None, "kubernetes"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let leaks = leaked(&cluster);
        curl_exit(&cluster, &format!("http://{UNALLOCATED}/"));
        if leaked(&cluster) > leaks {
            break;
        }
        assert!(Instant::now() < deadline, "still dropped:\n{}", cluster.agent_log());
    }
    assert_leaves_the_node(&cluster);
}

#[test]
fn a_service_cidr_manifest_and_the_flag_drop_unallocated_addresses_in_manifests_mode() {
    let mut cluster = Cluster::start("svc-cidr-files");
    route_the_range_to_a_counted_dead_end(&cluster);
    assert_leaves_the_node(&cluster);
    assert_eq!(ping_unallocated(&cluster), (0, 1), "before any CIDR the echo request leaves the node");

    std::fs::write(cluster.manifest("service-cidr.yaml"), SERVICE_CIDR).unwrap();
    wait_until_dropped(&cluster);
    // ICMP too: kube-proxy's rule matches the address whatever the protocol.
    assert_eq!(ping_unallocated(&cluster), (1, 0), "the echo request is dropped on the node");
    std::fs::remove_file(cluster.manifest("service-cidr.yaml")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let leaks = leaked(&cluster);
        curl_exit(&cluster, &format!("http://{UNALLOCATED}/"));
        if leaked(&cluster) > leaks {
            break;
        }
        assert!(Instant::now() < deadline, "still dropped:\n{}", cluster.agent_log());
    }

    // --service-cidr, without any ServiceCIDR object.
    cluster.stop_agent();
    cluster.extra_agent_args = vec!["--service-cidr".into(), "10.96.0.0/16,fd00::/108".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    wait_until_dropped(&cluster);
    assert!(cluster.kproxy(&["dump", "service-cidrs"]).contains("10.96.0.0/16"));
    assert!(
        cluster
            .client
            .exec(["curl", "-sS", "--max-time", "5", "http://10.96.0.100/"])
            .unwrap()
            .starts_with("web-")
    );
}

#[test]
fn an_api_server_without_service_cidrs_is_told_once_and_the_flag_still_drops() {
    // As an API server before Kubernetes 1.33 answers: no such resource.
    let mut cluster = Cluster::prepared("svc-cidr-old-api", Mode::Api);
    cluster.api().hide_service_cidrs(true);
    cluster.api().apply_yaml(SERVICE_CIDR).unwrap();
    cluster.extra_agent_args = vec!["--service-cidr".into(), "10.96.0.0/16".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    cluster.wait_for_attachment();
    route_the_range_to_a_counted_dead_end(&cluster);

    wait_until_dropped(&cluster);
    assert!(
        cluster
            .client
            .exec(["curl", "-sS", "--max-time", "5", "http://10.96.0.100/"])
            .unwrap()
            .starts_with("web-")
    );
    let log = cluster.agent_log();
    let told = log.lines().filter(|l| l.contains("the API server serves no ServiceCIDRs")).count();
    assert_eq!(told, 1, "{log}");
    let asked = cluster.api().requests().iter().filter(|r| r.contains("/servicecidrs")).count();
    assert_eq!(asked, 1, "asked once, not again: {:?}", cluster.api().requests());
    // The object the server does not serve is not read: only the flag's range is held.
    assert_eq!(cluster.dump_json("service-cidrs"), serde_json::json!([{"cidr": "10.96.0.0/16"}]));
}

#[test]
fn an_ipv6_echo_request_to_an_unallocated_address_is_dropped_and_neighbour_discovery_goes_on() {
    let mut cluster = Cluster::prepared("svc-cidr-ping6", Mode::Files);
    cluster.client.add_ipv6(common::dual_stack::ipv6_of(common::cluster::CLIENT_IP)).unwrap();
    route_to_a_counted_dead_end(&cluster, &DEAD_END_V6);
    assert_eq!(
        ping6_unallocated(&cluster, false),
        (0, 1),
        "with no service proxy the echo request leaves the node"
    );

    cluster.extra_agent_args = vec!["--service-cidr".into(), "10.96.0.0/16,fd00:10:96::/112".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    cluster.wait_for_attachment();
    // kube-proxy's `ip6 daddr { fd00:10:96::/112 } drop` under `ct state new`; the neighbour
    // solicitation the client sent first passed, or no echo request would have been sent at all.
    assert_eq!(ping6_unallocated(&cluster, true), (1, 0), "the echo request is dropped on the node");
    assert!(cluster.kproxy(&["dump", "service-cidrs"]).contains("fd00:10:96::/112"));
}
