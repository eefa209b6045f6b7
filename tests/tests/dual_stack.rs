//! Dual-stack Services end to end (issue 19): the real `kproxy agent` reads Services with an IPv4 and an
//! IPv6 cluster IP and EndpointSlices of both address types from its manifests, programs each family in
//! its own maps, and real clients in dual-stack pods reach both addresses: curl over IPv6 and IPv4, dig
//! AAAA over UDP and TCP (dig takes only a reply from the address it asked: the un-NAT is checked by the
//! client itself), refusal with no endpoints, and a fixed-port UDP client following a backend swap.
//! Needs root.

mod common;

use std::{
    collections::BTreeSet,
    net::Ipv6Addr,
    time::{Duration, Instant},
};

use common::cluster::{CLIENT_IP, Cluster, Mode};
use common::dual_stack::{
    DNS_PODS6, DNS_VIP6, EMPTY_VIP6, WEB_PODS6, WEB_VIP4, WEB_VIP6, ipv6_of, manifests, start_pods,
};
use sandbox::Pod;

/// A running dual-stack cluster: the example cluster's client made dual-stack, two dual-stack nginx pods
/// and two dual-stack dnsmasq pods (beside the example's IPv4 ones), the agent started on the manifests.
struct DualStack {
    cluster: Cluster,
    web: Vec<Pod>,
    dns: Vec<Pod>,
}

/// `dns_backends` of [`DNS_PODS6`] behind `dual-dns`.
fn start(tag: &str, dns_backends: usize) -> DualStack {
    let mut cluster = Cluster::prepared(tag, Mode::Files);
    cluster.client.add_ipv6(ipv6_of(CLIENT_IP)).unwrap();
    let (web, dns) = start_pods(&cluster);
    let manifests = manifests(&WEB_PODS6, &DNS_PODS6[..dns_backends]);
    std::fs::write(cluster.manifest("dual-stack.yaml"), manifests).unwrap();
    cluster.start_agent();
    cluster.wait_for_frontends(&[
        ("10.96.0.200:80", "TCP", 2),
        (&format!("[{WEB_VIP6}]:80"), "TCP", 2),
        (&format!("[{DNS_VIP6}]:53"), "UDP", dns_backends as u64),
        (&format!("[{DNS_VIP6}]:53"), "TCP", dns_backends as u64),
        (&format!("[{EMPTY_VIP6}]:80"), "TCP", 0),
    ]);
    cluster.wait_for_attachment();
    DualStack { cluster, web, dns }
}

#[test]
fn a_dual_stack_service_answers_on_both_addresses_with_the_client_address_kept() {
    let ds = start("dual", 1);
    let client = &ds.cluster.client;
    let mut seen = BTreeSet::new();
    for _ in 0..24 {
        seen.insert(client.curl(&format!("http://[{WEB_VIP6}]/")).unwrap());
    }
    let names: BTreeSet<String> = ds.web.iter().map(|p| format!("{}\n", p.name())).collect();
    assert_eq!(seen, names, "24 requests to the IPv6 cluster IP reach both backends");
    // No source NAT: the backend sees the client's own IPv6 address.
    assert_eq!(
        client.curl(&format!("http://[{WEB_VIP6}]/client")).unwrap().trim(),
        ipv6_of(CLIENT_IP).to_string()
    );
    // The same Service on its IPv4 cluster IP, to the same pods.
    let body = client.curl(&format!("http://{WEB_VIP4}/")).unwrap();
    assert!(names.contains(&body), "{body:?}");
    assert_eq!(client.curl(&format!("http://{WEB_VIP4}/client")).unwrap().trim(), CLIENT_IP.to_string());

    // DNS to an IPv6 cluster IP over UDP and TCP: dig takes only an answer from the address it asked.
    let dns6 = ipv6_of(ds.dns[0].ip()).to_string();
    let vip: Ipv6Addr = DNS_VIP6.parse().unwrap();
    assert_eq!(client.dig(vip, "ip6.kproxy.test", "AAAA").unwrap().trim(), dns6);
    assert_eq!(client.dig_tcp(vip, "ip6.kproxy.test", "AAAA").unwrap().trim(), dns6);

    // What an operator reads: the IPv6 frontends by Service name, their backends.
    let services = ds.cluster.dump_json("services");
    let v6_slot0 = services
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["frontend"] == format!("[{WEB_VIP6}]:80") && r["slot"] == 0)
        .unwrap_or_else(|| panic!("no IPv6 frontend in {services}"));
    assert!(v6_slot0["service"].as_str().unwrap().starts_with("default/dual-web"), "{v6_slot0}");
    let backends = ds.cluster.dump_json("backends");
    for pod in &ds.web {
        let address = format!("[{}]:80", ipv6_of(pod.ip()));
        assert!(
            backends.as_array().unwrap().iter().any(|b| b["address"] == address),
            "{address} in {backends}"
        );
    }
}

#[test]
fn no_endpoints_is_refused_at_once_over_ipv6() {
    let ds = start("dual-refuse", 1);
    let client = &ds.cluster.client;
    // TCP: a reset, which connect() reports as ECONNREFUSED at once — not a timeout, and not the
    // "no route" a node without the Service would answer (EHOSTUNREACH / ENETUNREACH).
    let script = format!(
        "import socket\ns = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\ns.settimeout(3)\ntry:\n    s.connect(('{EMPTY_VIP6}', 80))\n    print('connected')\nexcept ConnectionRefusedError:\n    print('refused')\nexcept OSError as e:\n    print(e)\n"
    );
    let started = Instant::now();
    assert_eq!(client.exec(["python3", "-c", &script]).unwrap().trim(), "refused");
    assert!(started.elapsed() < Duration::from_secs(3), "refused, not timed out");
    // UDP: ICMPv6 port unreachable, which a connected socket reports as ECONNREFUSED.
    let script = format!(
        "import socket\ns = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\ns.settimeout(3)\ns.connect(('{EMPTY_VIP6}', 53))\ns.send(b'x')\ntry:\n    s.recv(100)\n    print('answered')\nexcept ConnectionRefusedError:\n    print('refused')\nexcept OSError as e:\n    print(e)\n"
    );
    assert_eq!(client.exec(["python3", "-c", &script]).unwrap().trim(), "refused");
}

#[test]
fn a_fixed_port_udp_client_follows_an_ipv6_backend_swap() {
    let ds = start("dual-swap", 1);
    let client = &ds.cluster.client;
    let vip: Ipv6Addr = DNS_VIP6.parse().unwrap();
    // dig from one source port every time (as a resolver library reusing its socket would).
    let source = format!("{}#35353", ipv6_of(CLIENT_IP));
    let ask = || {
        let out = client
            .exec([
                "dig",
                "+short",
                "+time=1",
                "+tries=1",
                "-b",
                &source,
                &format!("@{vip}"),
                "whoami.kproxy.test",
                "TXT",
            ])
            .unwrap_or_default();
        out.trim().trim_matches('"').to_owned()
    };
    assert_eq!(ask(), "dns6-a");
    // The slice now names dns6-b instead of dns6-a (a rollout).
    let swapped = [("dns6-b", ds.dns[1].ip())];
    std::fs::write(ds.cluster.manifest("dual-stack.yaml"), manifests(&WEB_PODS6, &swapped)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = ask();
        if answer == "dns6-b" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {answer:?} after the swap; agent log:\n{}",
            ds.cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // And it stays there.
    for _ in 0..5 {
        assert_eq!(ask(), "dns6-b");
    }
}
