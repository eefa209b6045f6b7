//! IPv6 ClusterIP through the real programs on real veths (issue 19): dual-stack pods, nginx and
//! curl -6, a UDP server and client over real sockets. Unlike BPF_PROG_TEST_RUN, the pods' kernels
//! hand the programs TCP segments with partial (offloaded) checksums, which the pseudo-header
//! rewrite must leave right for the backend to accept them. Needs root.
//!
//! The test writes SERVICES_V6, BACKENDS_V6 and VIPS_V6 through their pins, with the slot layout
//! the Syncer gives IPv4 and ids far above the ones the agent hands out (the agent's manifests have
//! no IPv6 Service, so its syncs leave these entries alone): written while the Syncer did not
//! program IPv6. `tests/dual_stack.rs` goes through the agent's own IPv6 sync.

mod common;

use std::net::Ipv6Addr;
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData};
use common::cluster::Cluster;
use proxy_common::{
    maps::{IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL, ServiceValueV4, VipV4},
    maps_v6::{BackendV6, ServiceKeyV6},
};
use sandbox::{Pod, Spawned};

const CLIENT6: &str = "fd00:10:244::2";
const WEB6: &str = "fd00:10:96::64";
const ECHO6: &str = "fd00:10:96::a";
const EMPTY6: &str = "fd00:10:96::c8";
/// A Service whose only backend is web-1, for web-1 to reach itself through (hairpin).
const SELF6: &str = "fd00:10:96::77";
const ECHO_PORT: u16 = 5353;

fn v6(text: &str) -> [u8; 16] {
    text.parse::<Ipv6Addr>().unwrap().octets()
}

fn open<K: aya::Pod, V: aya::Pod>(cluster: &Cluster, name: &str) -> HashMap<MapData, K, V> {
    let data = MapData::from_pin(cluster.pin_dir.join("maps").join(name)).unwrap();
    HashMap::try_from(Map::HashMap(data)).unwrap()
}

/// Writes a frontend as the Syncer lays IPv4 out: backends, slots, slot 0, then the VIP.
struct Frontends {
    services: HashMap<MapData, ServiceKeyV6, ServiceValueV4>,
    backends: HashMap<MapData, u32, BackendV6>,
    vips: HashMap<MapData, [u8; 16], VipV4>,
    next_id: u32,
}

impl Frontends {
    fn new(cluster: &Cluster) -> Self {
        Self {
            services: open(cluster, "services_v6"),
            backends: open(cluster, "backends_v6"),
            vips: open(cluster, "vips_v6"),
            // Clear of the ids the agent hands out for the IPv4 example.
            next_id: 60_000,
        }
    }

    fn add(&mut self, vip: &str, port: u16, proto: u8, backends: &[([u8; 16], u16)]) {
        let rev_nat_id = self.next_id;
        let key = ServiceKeyV6::new(v6(vip), port.to_be_bytes(), proto, SCOPE_INTERNAL, 0);
        for (slot, (addr, port)) in backends.iter().enumerate() {
            self.next_id += 1;
            let backend = BackendV6 { addr: *addr, port: port.to_be_bytes(), proto, flags: 0 };
            self.backends.insert(self.next_id, backend, 0).unwrap();
            let value = ServiceValueV4 { backend_id: self.next_id, rev_nat_id, ..Default::default() };
            self.services.insert(key.with_slot(slot as u16 + 1), value, 0).unwrap();
        }
        self.next_id += 1;
        let slot0 = ServiceValueV4 { count: backends.len() as u16, rev_nat_id, ..Default::default() };
        self.services.insert(key, slot0, 0).unwrap();
        let frontends = self.vips.get(&v6(vip), 0).map_or(0, |v| v.frontends);
        self.vips.insert(v6(vip), VipV4 { frontends: frontends + 1 }, 0).unwrap();
    }
}

/// A UDP server answering every datagram with `name` (the backend that answered).
fn udp_server(pod: &Pod, name: &str) -> Spawned {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         s.bind(('::', {ECHO_PORT}))\n\
         while True:\n    data, peer = s.recvfrom(2048)\n    s.sendto(b'{name} ' + data, peer)\n"
    );
    let server = pod.spawn(["python3", "-c", script.as_str()]).unwrap();
    pod.wait_listening("udp", ECHO_PORT, Some(&server), Duration::from_secs(10)).unwrap();
    server
}

/// Sends `message` from `[::]:sport` to `[vip]:port`; the answer and the address:port it came from
/// (as the client's socket sees it: the Service, or a timeout if it came from anyone else).
fn udp_ask(pod: &Pod, sport: u16, vip: &str, message: &str) -> anyhow::Result<String> {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         s.bind(('::', {sport}))\n\
         s.connect(('{vip}', {ECHO_PORT}))\n\
         s.settimeout(3)\n\
         s.send(b'{message}')\n\
         data, peer = s.recvfrom(2048)\n\
         print(data.decode(), peer[0], peer[1])\n"
    );
    Ok(pod.exec(["python3", "-c", script.as_str()])?.trim().to_owned())
}

#[test]
fn dual_stack_pods_reach_an_ipv6_cluster_ip_over_tcp_and_udp() {
    let mut cluster = Cluster::start("ipv6");
    cluster.client.add_ipv6(CLIENT6.parse().unwrap()).unwrap();
    let mut servers = Vec::new();
    let mut web = Vec::new();
    for (i, pod) in cluster.web.iter_mut().enumerate() {
        let addr: Ipv6Addr = format!("fd00:10:244::1{}", i + 1).parse().unwrap();
        pod.add_ipv6(addr).unwrap();
        // nginx on [::]:8080 beside the IPv4 one on :80.
        servers.push(pod.start_nginx_on(8080, &format!("{}\n", pod.name())).unwrap());
        web.push((addr.octets(), 8080));
    }
    let mut echo = Vec::new();
    for (i, pod) in cluster.dns.iter_mut().enumerate() {
        let addr: Ipv6Addr = format!("fd00:10:244::2{}", i + 1).parse().unwrap();
        pod.add_ipv6(addr).unwrap();
        servers.push(udp_server(pod, pod.name()));
        echo.push((addr.octets(), ECHO_PORT));
    }
    let web_names: Vec<String> = cluster.web.iter().map(|p| p.name().to_owned()).collect();
    let echo_names: Vec<String> = cluster.dns.iter().map(|p| p.name().to_owned()).collect();

    let mut frontends = Frontends::new(&cluster);
    frontends.add(WEB6, 80, IPPROTO_TCP, &web);
    frontends.add(ECHO6, ECHO_PORT, IPPROTO_UDP, &echo);
    frontends.add(EMPTY6, 80, IPPROTO_TCP, &[]);
    frontends.add(EMPTY6, ECHO_PORT, IPPROTO_UDP, &[]);
    frontends.add(SELF6, 80, IPPROTO_TCP, &web[..1]);

    // TCP: every request answered by a backend, all of them seen, the client's own address kept.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..30 {
        let body =
            cluster.client.curl(&format!("http://[{WEB6}]/")).unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert!(web_names.contains(&body.trim().to_owned()), "request {i} answered by {body:?}");
        seen.insert(body.trim().to_owned());
    }
    assert_eq!(seen.len(), web_names.len(), "backends seen: {seen:?}");
    assert_eq!(cluster.client.curl(&format!("http://[{WEB6}]/client")).unwrap().trim(), CLIENT6);
    // A body larger than a segment: many segments each way, each one's checksum rewritten.
    let url = format!("http://[{WEB6}]{}", sandbox::BIG_FILE_PATH);
    let fetched = cluster
        .client
        .exec([
            "curl",
            "-sS",
            "--max-time",
            "30",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{size_download}",
            url.as_str(),
        ])
        .unwrap();
    assert_eq!(fetched.trim(), format!("200 {}", sandbox::BIG_FILE_LEN));

    // UDP: the answer comes from the Service (a connected socket takes no other), from a backend.
    for sport in [41000, 41001, 41002, 41003] {
        let answer = udp_ask(&cluster.client, sport, ECHO6, "hello").unwrap();
        let mut words = answer.split_whitespace();
        let (who, said, from, port) = (words.next(), words.next(), words.next(), words.next());
        assert!(who.is_some_and(|w| echo_names.iter().any(|n| n == w)), "{answer}");
        assert_eq!((said, from, port), (Some("hello"), Some(ECHO6), Some("5353")), "{answer}");
    }

    // Hairpin: web-1 reaches itself through its Service; it sees the hairpin address as the client.
    let web1 = &cluster.web[0];
    assert_eq!(web1.curl(&format!("http://[{SELF6}]/")).unwrap().trim(), web_names[0]);
    assert_eq!(web1.curl(&format!("http://[{SELF6}]/client")).unwrap().trim(), "100::42:1");

    // No endpoints, or a port the Service does not have: refused at once (curl's exit 7,
    // "Couldn't connect"; a UDP socket hears ECONNREFUSED).
    for url in [format!("http://[{EMPTY6}]/"), format!("http://[{WEB6}]:8443/")] {
        let err = cluster.client.curl(&url).expect_err(&url).to_string();
        assert!(err.contains("onnection refused") || err.contains("Couldn't connect"), "{url}: {err}");
    }
    let err = udp_ask(&cluster.client, 41010, EMPTY6, "anyone").expect_err("no endpoints").to_string();
    assert!(err.contains("ConnectionRefused") || err.contains("Connection refused"), "{err}");
    assert!(
        cluster.stat("dnat_new_flow") >= 30 + 1 + 1 + 4 + 2,
        "dnat_new {}",
        cluster.stat("dnat_new_flow")
    );
    assert!(cluster.stat("reject_tcp_rst") >= 2 && cluster.stat("reject_udp_icmp") >= 1);
}
