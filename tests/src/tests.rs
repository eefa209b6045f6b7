//! The sandbox itself, with plain routing through the node (no kproxy). Needs root and the
//! Debian packages `cargo xtask setup` installs; a missing one fails the test with that hint.
use std::net::Ipv4Addr;
use std::path::Path;

use crate::{BIG_FILE_LEN, BIG_FILE_PATH, NETNS_PREFIX, Sandbox, cleanup_stale, require_tools};

/// Namespaces under /run/netns whose name starts with `prefix`.
pub(crate) fn netns_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_pods_reach_each_other_through_the_node() {
    require_tools(&["nginx", "curl"]).unwrap();
    let sandbox = Sandbox::new("route").unwrap();
    let prefix = format!("{}-", sandbox.name());
    let dir = sandbox.dir().to_path_buf();
    let web_ip = Ipv4Addr::new(10, 244, 0, 11);
    let web = sandbox.add_pod("web-1", web_ip).unwrap();
    let client = sandbox.add_pod("client", Ipv4Addr::new(10, 244, 0, 20)).unwrap();
    assert!(web.host_veth().starts_with("veth") && web.host_veth().len() <= 15, "{}", web.host_veth());
    assert_ne!(web.host_veth(), client.host_veth());
    assert_eq!(netns_with_prefix(&prefix).len(), 3, "node + 2 pods");

    // The node namespace: forwarding on, no default route, the pods' /32 routes on the veths.
    assert_eq!(sandbox.node_exec(["cat", "/proc/sys/net/ipv4/ip_forward"]).unwrap().trim(), "1");
    let routes = sandbox.node_exec(["ip", "route", "show"]).unwrap();
    assert!(!routes.contains("default"), "node must have no default route:\n{routes}");
    assert!(routes.contains(&format!("{web_ip} dev {}", web.host_veth())), "{routes}");
    // The pod: /32 on eth0, default via the link-local gateway.
    let pod_routes = web.exec(["ip", "route", "show"]).unwrap();
    assert!(pod_routes.contains("default via 169.254.1.1 dev eth0"), "{pod_routes}");

    // nsenter keeps the mount namespace (bpffs stays visible); `ip netns exec` is for pods only.
    let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    let node_mnt = sandbox.node_exec(["readlink", "/proc/self/ns/mnt"]).unwrap();
    assert_eq!(node_mnt.trim(), ours.to_string_lossy());

    let body = format!("backend web-1 {web_ip}\n");
    let nginx = web.start_nginx(&body).unwrap();
    assert!(nginx.is_running());
    assert_eq!(client.curl(&format!("http://{web_ip}/")).unwrap(), body);
    // The backend sees the client's own address (plain routing, no NAT).
    assert_eq!(client.curl(&format!("http://{web_ip}/client")).unwrap().trim(), "10.244.0.20");
    let big_url = format!("http://{web_ip}{BIG_FILE_PATH}");
    let size = client
        .exec(["curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{size_download}", &big_url])
        .unwrap();
    assert_eq!(size.trim(), BIG_FILE_LEN.to_string());
    // The node reaches pods from its own address.
    assert_eq!(
        sandbox.node_exec(["curl", "-sS", "--max-time", "5", &format!("http://{web_ip}/")]).unwrap(),
        body
    );

    // Dropping a pod removes its namespace and veth at once.
    let client_ns = client.netns().to_owned();
    let client_veth = client.host_veth().to_owned();
    drop(client);
    assert!(!Path::new("/run/netns").join(&client_ns).exists());
    let links = sandbox.node_exec(["ip", "-o", "link", "show"]).unwrap();
    assert!(!links.contains(&client_veth), "{links}");

    drop(web);
    drop(sandbox);
    assert!(nginx.try_wait().is_err(), "nginx is no longer tracked once the sandbox is gone");
    assert_eq!(netns_with_prefix(&prefix), Vec::<String>::new());
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn dnsmasq_backends_tell_who_answered() {
    require_tools(&["dnsmasq", "dig"]).unwrap();
    let sandbox = Sandbox::new("dns").unwrap();
    let dns_ip = Ipv4Addr::new(10, 244, 1, 9);
    let dns = sandbox.add_pod("coredns-a", dns_ip).unwrap();
    let client = sandbox.add_pod("client", Ipv4Addr::new(10, 244, 1, 20)).unwrap();
    let answer = Ipv4Addr::new(10, 96, 0, 50);
    dns.start_dnsmasq(answer).unwrap();
    assert_eq!(client.dig(dns_ip, "web.default.svc.cluster.local", "A").unwrap().trim(), answer.to_string());
    assert_eq!(client.dig(dns_ip, "whoami.kproxy.test", "TXT").unwrap().trim(), "\"coredns-a\"");
    assert_eq!(client.dig_tcp(dns_ip, "ip.kproxy.test", "A").unwrap().trim(), dns_ip.to_string());
    // Nothing answers at an address that no pod has: dig fails instead of hanging.
    assert!(client.dig(Ipv4Addr::new(10, 244, 1, 99), "whoami.kproxy.test", "TXT").is_err());
}

#[test]
fn dual_stack_pods_reach_each_other_over_ipv6_through_the_node() {
    require_tools(&["nginx", "curl", "dnsmasq", "dig"]).unwrap();
    let sandbox = Sandbox::new("route6").unwrap();
    let mut web = sandbox.add_pod("web-1", Ipv4Addr::new(10, 244, 0, 11)).unwrap();
    let mut client = sandbox.add_pod("client", Ipv4Addr::new(10, 244, 0, 20)).unwrap();
    let web_ip6: std::net::Ipv6Addr = "fd00:10:244::11".parse().unwrap();
    web.add_ipv6(web_ip6).unwrap();
    client.add_ipv6("fd00:10:244::20".parse().unwrap()).unwrap();
    let _nginx = web.start_nginx("hello from web-1\n").unwrap();
    let _dns = web.start_dnsmasq(Ipv4Addr::new(10, 96, 0, 100)).unwrap();
    // Over IPv6, and the backend sees the client's IPv6 address; IPv4 still works beside it.
    assert_eq!(client.curl(&format!("http://[{web_ip6}]/")).unwrap(), "hello from web-1\n");
    assert_eq!(client.curl(&format!("http://[{web_ip6}]/client")).unwrap(), "fd00:10:244::20\n");
    assert_eq!(client.curl("http://10.244.0.11/").unwrap(), "hello from web-1\n");
    assert_eq!(client.dig(web_ip6, "ip6.kproxy.test", "AAAA").unwrap().trim(), "fd00:10:244::11");
    assert_eq!(client.dig_tcp(web_ip6, "whoami.kproxy.test", "TXT").unwrap().trim(), "\"web-1\"");
}

#[test]
fn everything_is_removed_when_a_test_panics() {
    require_tools(&["nginx"]).unwrap();
    let names = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let sandbox = Sandbox::new("panic").unwrap();
        let pod = sandbox.add_pod("web", Ipv4Addr::new(10, 244, 2, 2)).unwrap();
        let server = pod.start_nginx("x\n").unwrap();
        *names.lock().unwrap() =
            Some((format!("{}-", sandbox.name()), sandbox.dir().to_path_buf(), server.pid()));
        panic!("test failure inside a sandbox");
    });
    assert!(result.is_err());
    let (prefix, dir, pid) = names.into_inner().unwrap().unwrap();
    assert_eq!(netns_with_prefix(&prefix), Vec::<String>::new());
    assert!(!dir.exists());
    assert!(!Path::new("/proc").join(pid.to_string()).exists(), "nginx (pid {pid}) still runs");
}

#[test]
fn cleanup_stale_removes_only_dead_runs() {
    require_tools(&["ip"]).unwrap();
    let ip = crate::find_tool("ip").unwrap();
    // A pid above pid_max never runs; pid 1 always does.
    // Our pid in the second field keeps concurrent runs of this test apart.
    let me = std::process::id();
    let dead = format!("{NETNS_PREFIX}99999999-{me}-stale-node");
    let live = format!("{NETNS_PREFIX}1-{me}-stale-node");
    let not_ours = format!("{NETNS_PREFIX}x{me}-stale-node");
    for name in [&dead, &live, &not_ours] {
        let status = std::process::Command::new(&ip).args(["netns", "add", name]).status().unwrap();
        assert!(status.success(), "ip netns add {name}");
    }
    let removed = cleanup_stale(NETNS_PREFIX);
    let exists = |name: &str| Path::new("/run/netns").join(name).exists();
    let (dead_gone, live_kept, not_ours_kept) = (!exists(&dead), exists(&live), exists(&not_ours));
    for name in [&dead, &live, &not_ours] {
        if exists(name) {
            let _ = std::process::Command::new(&ip).args(["netns", "del", name]).status();
        }
    }
    removed.unwrap();
    assert!(dead_gone, "{dead} (dead pid) must be removed");
    assert!(live_kept, "{live} (live pid) must be kept");
    assert!(not_ours_kept, "{not_ours} (not our format) must be kept");
}
