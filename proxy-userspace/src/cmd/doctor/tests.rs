use super::agent::*;
use super::datapath::*;
use super::kernel::*;
use super::kube_proxy::*;
use super::sysctl::*;
use super::*;
use crate::bpf;

#[test]
fn ephemeral_ports_inside_the_snat_range_are_reported_unless_reserved() {
    let value = |v: &str| Runtime::Value(v.to_owned());
    let snat = (61000, 65535);
    let clear = snat_ports_check(value("32768\t60999"), value(""), snat);
    assert_eq!(clear.status, Status::Ok, "{clear:?}");
    let overlap = snat_ports_check(value("1024 65535"), value(""), snat);
    assert_eq!(overlap.status, Status::Warn, "{overlap:?}");
    assert!(overlap.finding.contains("61000-65535"), "{overlap:?}");
    assert!(overlap.fix.as_deref().unwrap().contains("ip_local_reserved_ports=61000-65535"));
    let reserved = snat_ports_check(value("1024 65535"), value("30000-32767,61000-65535"), snat);
    assert_eq!(reserved.status, Status::Ok, "{reserved:?}");
    let partly = snat_ports_check(value("32768 62000"), value("61000-61500"), snat);
    assert_eq!(partly.status, Status::Warn, "{partly:?}");
    let unreadable = snat_ports_check(Runtime::Unknown("no".into()), value(""), snat);
    assert_eq!(unreadable.status, Status::Ok);
}

#[test]
fn kernel_versions() {
    assert_eq!(parse_kernel_version("6.18.0-1-amd64"), Some((6, 18)));
    assert_eq!(parse_kernel_version("5.15.0\n"), Some((5, 15)));
    assert_eq!(parse_kernel_version("6.6"), Some((6, 6)));
    assert_eq!(parse_kernel_version("linux"), None);
    assert_eq!(kernel_verdict("6.6.1", "running").status, Status::Ok);
    assert_eq!(kernel_verdict("6.5.13", "running").status, Status::Fail);
    assert_eq!(kernel_verdict("5.15.0-91-generic", "running").status, Status::Fail);
    assert_eq!(kernel_verdict("10.0.0", "running").status, Status::Ok);
}

#[test]
fn mounts_bpffs_and_cgroup2() {
    let hybrid = "sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,relatime 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
    assert_eq!(bpffs_check(Some(hybrid), false).status, Status::Ok);
    let c = cgroup2_check(Some(hybrid), false);
    assert_eq!(c.status, Status::Ok);
    assert!(c.finding.contains("hybrid"), "{}", c.finding);
    let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n";
    assert!(cgroup2_check(Some(unified), false).finding.contains("unified"));
    assert_eq!(bpffs_check(Some(unified), false).status, Status::Warn);
    let v1 = "cgroup /sys/fs/cgroup/memory cgroup rw 0 0\nbpf /mnt/bpf bpf rw 0 0\n";
    assert_eq!(cgroup2_check(Some(v1), false).status, Status::Warn);
    assert!(bpffs_check(Some(v1), false).finding.contains("/mnt/bpf"));
    let c = bpffs_check(None, true);
    assert!(c.finding.contains("cannot read runtime value under --root"));
}

#[test]
fn sysctl_lines() {
    let text = "# comment\n; also\n\n  net.ipv4.ip_forward   =   0  \n-net/ipv4/conf/all/rp_filter=2\nnet/ipv4/conf/eth0.100/rp_filter = 1\nkernel.foo=bar baz\nnot an assignment\n";
    let a = parse_sysctl(text);
    assert_eq!(
        a,
        vec![
            Assignment { key: "net.ipv4.ip_forward".into(), value: "0".into(), line: 4 },
            Assignment { key: "net.ipv4.conf.all.rp_filter".into(), value: "2".into(), line: 5 },
            Assignment { key: "net.ipv4.conf.eth0/100.rp_filter".into(), value: "1".into(), line: 6 },
            Assignment { key: "kernel.foo".into(), value: "bar baz".into(), line: 7 },
        ]
    );
    assert_eq!(normalize_key("net.ipv4.conf.eth0/100.rp_filter"), "net.ipv4.conf.eth0/100.rp_filter");
}

#[test]
fn sysctl_precedence() {
    let listing = vec![
        ("/etc/sysctl.d", vec!["99-sysctl.conf".into(), "50-default.conf".into(), "README".into()]),
        ("/run/sysctl.d", vec![]),
        ("/usr/local/lib/sysctl.d", vec![]),
        ("/usr/lib/sysctl.d", vec!["50-default.conf".into(), "10-net.conf".into()]),
        ("/lib/sysctl.d", vec!["10-net.conf".into()]),
    ];
    assert_eq!(
        sysctl_order(&listing),
        vec![
            "/usr/lib/sysctl.d/10-net.conf",
            "/etc/sysctl.d/50-default.conf",
            "/etc/sysctl.d/99-sysctl.conf",
            "/etc/sysctl.conf",
        ]
    );
    let files = SysctlFiles {
        files: vec![
            (
                "/usr/lib/sysctl.d/10-net.conf".into(),
                parse_sysctl("net.ipv4.ip_forward = 1\n-net.ipv4.conf.*.rp_filter = 2\n"),
            ),
            ("/etc/sysctl.d/50-default.conf".into(), parse_sysctl("net.ipv4.conf.default.rp_filter = 1\n")),
            ("/etc/sysctl.d/99-sysctl.conf".into(), parse_sysctl("# x\n\nnet.ipv4.ip_forward=0\n")),
            ("/etc/sysctl.conf".into(), vec![]),
        ],
    };
    let s = files.effective("net.ipv4.ip_forward").unwrap();
    assert_eq!((s.file.as_str(), s.line, s.value.as_str()), ("/etc/sysctl.d/99-sysctl.conf", 3, "0"));
    // The explicit assignment wins over a later glob, a glob applies otherwise.
    assert_eq!(files.effective("net.ipv4.conf.default.rp_filter").unwrap().value, "1");
    let all = files.effective("net.ipv4.conf.all.rp_filter").unwrap();
    assert_eq!((all.value.as_str(), all.glob.as_deref()), ("2", Some("net.ipv4.conf.*.rp_filter")));
    assert_eq!(files.effective("net.ipv4.tcp_syncookies"), None);
}

fn setting(value: &str) -> Setting {
    Setting { file: "/etc/sysctl.d/99-sysctl.conf".into(), line: 12, value: value.into(), glob: None }
}

#[test]
fn ip_forward_decisions() {
    let v = |s: &str| Runtime::Value(s.into());
    let c = ip_forward_check(v("1"), Some(setting("0")));
    assert_eq!(c.status, Status::Warn);
    assert!(
        c.finding.starts_with("/etc/sysctl.d/99-sysctl.conf:12 sets net.ipv4.ip_forward = 0: the next reboot disables forwarding (the incident of cases/001)"),
        "{}",
        c.finding
    );
    assert!(c.fix.unwrap().contains("line 12"));
    assert_eq!(ip_forward_check(v("1"), Some(setting("1"))).status, Status::Ok);
    assert_eq!(ip_forward_check(v("1"), None).status, Status::Warn);
    let c = ip_forward_check(v("0"), Some(setting("0")));
    assert_eq!(c.status, Status::Fail);
    assert!(c.fix.unwrap().starts_with("sysctl -w net.ipv4.ip_forward=1; then edit"));
    assert_eq!(ip_forward_check(v("0"), Some(setting("1"))).status, Status::Fail);
    let unknown = Runtime::Unknown("cannot read runtime value under --root".into());
    let c = ip_forward_check(unknown.clone(), Some(setting("1")));
    assert_eq!(c.status, Status::Warn);
    assert!(c.finding.contains("cannot read runtime value under --root"));
    assert!(ip_forward_check(unknown, Some(setting("0"))).finding.contains("99-sysctl.conf:12"));
}

#[test]
fn rp_filter_decisions() {
    let v = |s: &str| Runtime::Value(s.into());
    assert_eq!(rp_filter_check([("all", v("0"), None), ("default", v("2"), None)]).status, Status::Ok);
    let c = rp_filter_check([("all", v("1"), None), ("default", v("0"), None)]);
    assert_eq!(c.status, Status::Warn);
    assert!(c.finding.contains("net.ipv4.conf.all.rp_filter = 1"), "{}", c.finding);
    assert!(c.finding.contains("multi-homed"), "{}", c.finding);
    let c = rp_filter_check([("all", v("0"), None), ("default", v("0"), Some(setting("1")))]);
    assert_eq!(c.status, Status::Warn, "strict after the next reboot");
    let unknown = Runtime::Unknown("cannot read runtime value under --root".into());
    let c = rp_filter_check([("all", unknown.clone(), None), ("default", unknown, Some(setting("2")))]);
    assert_eq!(c.status, Status::Ok);
}

#[test]
fn map_fill() {
    assert_eq!(map_fill_check("services_v4", 10, 100).status, Status::Ok);
    assert_eq!(map_fill_check("services_v4", 81, 100).status, Status::Warn);
    assert_eq!(map_fill_check("backends_v4", 100, 100).status, Status::Fail);
    assert_eq!(map_fill_check("conntrack_v4", 85, 100).status, Status::Ok);
    let c = map_fill_check("conntrack_v4", 100, 100);
    assert_eq!((c.status, c.name.as_str()), (Status::Warn, "conntrack fill"));
    assert!(c.finding.contains("evicts"));
}

#[test]
fn attach_per_interface() {
    let ifaces = vec![
        bpf::Interface { name: "lo".into(), index: 1 },
        bpf::Interface { name: "veth0-a".into(), index: 5 },
        bpf::Interface { name: "veth1.100".into(), index: 6 },
    ];
    let selector = InterfaceSelector::new(&["veth*".to_owned()]).unwrap();
    let globs = ["veth*".to_owned()];
    let none = std::collections::BTreeSet::new();
    let mut links: std::collections::BTreeSet<String> =
        ["veth0-a@5-ingress", "veth0-a@5-egress", "veth1%2E100@6-ingress"].map(String::from).into();
    let checks = attach_checks(&ifaces, &selector, &globs, &links, &none, Path::new("/sys/fs/bpf/kproxy"));
    assert_eq!(checks.len(), 1);
    assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Warn, "attach veth1.100"));
    assert!(checks[0].finding.contains("no egress"), "{}", checks[0].finding);
    links.insert("veth1%2E100@6-egress".into());
    let checks = attach_checks(&ifaces, &selector, &globs, &links, &none, Path::new("/sys/fs/bpf/kproxy"));
    assert_eq!(checks[0].status, Status::Ok);
    assert!(checks[0].finding.contains("2 interfaces"));

    // A Calico node checked with the default glob: FAIL, naming what is there.
    let calico = vec![
        bpf::Interface { name: "lo".into(), index: 1 },
        bpf::Interface { name: "eth0".into(), index: 2 },
        bpf::Interface { name: "cali12ab34cd".into(), index: 7 },
    ];
    let checks = attach_checks(&calico, &selector, &globs, &links, &none, Path::new("/sys/fs/bpf/kproxy"));
    assert_eq!(checks.len(), 1);
    assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Fail, "attach"));
    assert!(checks[0].finding.contains("no interface matches veth*"), "{}", checks[0].finding);
    assert!(checks[0].finding.ends_with("its interfaces: lo, eth0, cali12ab34cd"), "{}", checks[0].finding);
    assert!(checks[0].fix.as_deref().unwrap_or_default().contains("cali*"), "{:?}", checks[0].fix);
}

#[test]
fn a_covered_veth_without_programs_is_ok_and_an_uncovered_or_half_attached_one_warns() {
    use std::collections::BTreeSet;
    let ifaces = vec![
        bpf::Interface { name: "veth-client".into(), index: 5 },
        bpf::Interface { name: "veth-web".into(), index: 6 },
        bpf::Interface { name: "veth-dns".into(), index: 7 },
    ];
    let selector = InterfaceSelector::new(&["veth*".to_owned()]).unwrap();
    let globs = ["veth*".to_owned()];
    let pin_dir = Path::new("/sys/fs/bpf/kproxy");
    let mut links: BTreeSet<String> =
        ["veth-web@6-ingress", "veth-web@6-egress", "veth-dns@7-ingress", "veth-dns@7-egress"]
            .map(String::from)
            .into();
    let client: BTreeSet<String> = ["veth-client".to_owned()].into();

    let checks = attach_checks(&ifaces, &selector, &globs, &links, &client, pin_dir);
    assert_eq!(checks.len(), 1, "{checks:?}");
    assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Ok, "attach"));
    assert!(
        checks[0].finding.contains("attached on 2 interfaces: veth-web, veth-dns"),
        "{}",
        checks[0].finding
    );
    assert!(
        checks[0].finding.contains("veth-client covered by the socket hooks: no per-packet program needed"),
        "{}",
        checks[0].finding
    );

    // The same veth uncovered: its missing programs are a WARN.
    let checks = attach_checks(&ifaces, &selector, &globs, &links, &BTreeSet::new(), pin_dir);
    assert_eq!(checks.len(), 1, "{checks:?}");
    assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Warn, "attach veth-client"));
    assert!(checks[0].finding.contains("no ingress"), "{}", checks[0].finding);

    // Covered but half attached is not what the agent leaves: WARN.
    links.insert("veth-client@5-ingress".into());
    let checks = attach_checks(&ifaces, &selector, &globs, &links, &client, pin_dir);
    assert_eq!((checks[0].status, checks[0].name.as_str()), (Status::Warn, "attach veth-client"));
    assert!(checks[0].finding.contains("no egress"), "{}", checks[0].finding);

    // Another interface WARNs while the covered one is still reported OK.
    links.remove("veth-client@5-ingress");
    links.remove("veth-dns@7-egress");
    let checks = attach_checks(&ifaces, &selector, &globs, &links, &client, pin_dir);
    let found: Vec<(Status, &str)> = checks.iter().map(|c| (c.status, c.name.as_str())).collect();
    assert_eq!(found, [(Status::Warn, "attach veth-dns"), (Status::Ok, "attach")]);
    assert!(checks[1].finding.starts_with("veth-client covered"), "{}", checks[1].finding);
}

#[test]
fn only_hooks_in_mode_on_cover_pods_and_their_cgroup_comes_from_the_link_pins() {
    use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY};
    // "/sys/fs/cgroup/kp" in hex.
    let links: std::collections::BTreeSet<String> = [
        "cgroup@2f7379732f66732f6367726f75702f6b70-kproxy_connect4",
        "cgroup@2f7379732f66732f6367726f75702f6b70-kproxy_sendmsg4",
        "veth0@5-ingress",
    ]
    .map(String::from)
    .into();
    let on = covering_cgroups(&links, Some(SOCKET_LB_ALL));
    assert_eq!(on.into_iter().collect::<Vec<_>>(), [std::path::PathBuf::from("/sys/fs/cgroup/kp")]);
    assert!(covering_cgroups(&links, Some(SOCKET_LB_HOST_ONLY)).is_empty());
    assert!(covering_cgroups(&links, None).is_empty());
    assert!(covering_cgroups(&["veth0@5-ingress".to_owned()].into(), Some(SOCKET_LB_ALL)).is_empty());
}

#[test]
fn agent_health() {
    let r = parse_http_response("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"x\":1}");
    assert_eq!(r, Some((200, "{\"x\":1}".to_owned())));
    assert_eq!(parse_http_response("SSH-2.0"), None);
    assert_eq!(agent_verdict("a:1", &Ok((200, String::new()))).status, Status::Ok);
    assert_eq!(agent_verdict("a:1", &Ok((503, String::new()))).status, Status::Fail);
    let refused = Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
    let c = agent_verdict("a:1", &refused);
    assert_eq!(c.status, Status::Warn);
    assert!(c.finding.contains("no agent is running"));
}

#[test]
fn an_unhealthy_agent_is_quoted_with_its_reason_and_the_fix_that_goes_with_it() {
    let body = |reason: &str| {
        format!(
            r#"{{"lastUpdated": "2026-01-01T00:00:00Z","currentTime": "2026-01-01T00:00:40Z", "nodeEligible": true, "reason": {}}}"#,
            serde_json::Value::String(reason.into())
        )
    };
    let blind = "Service watch: list failed 5 times: tcp connect error; no sync has been programmed yet (started 40s ago)";
    let c = agent_verdict("127.0.0.1:10256", &Ok((503, body(blind))));
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.finding, format!("unhealthy: GET http://127.0.0.1:10256/healthz → 503: {blind}"));
    assert!(c.fix.as_deref().unwrap().contains("api-server check"), "{c:?}");
    let first = agent_verdict("a:1", &Ok((503, body("no sync has been programmed yet (started 2s ago)"))));
    assert!(first.fix.as_deref().unwrap().contains("has not programmed the maps once"), "{first:?}");
    let leaving = agent_verdict(
        "a:1",
        &Ok((
            503,
            body(
                "this node is not eligible for traffic (being deleted, or tainted ToBeDeletedByClusterAutoscaler)",
            ),
        )),
    );
    assert!(leaving.fix.as_deref().unwrap().contains("as intended"), "{leaving:?}");
    let stuck =
        agent_verdict("a:1", &Ok((503, body("a change has waited 65s for a successful sync (limit 60s)"))));
    assert!(stuck.fix.as_deref().unwrap().contains("sync errors"), "{stuck:?}");
    // A body without a reason (an older agent) is quoted whole.
    let old = agent_verdict("a:1", &Ok((503, r#"{"lastUpdated": "x"}"#.to_owned())));
    assert!(
        old.finding.contains(r#"{"lastUpdated": "x"}"#) && old.finding.contains("--sync-period"),
        "{old:?}"
    );
}

fn endpoint(url: &str, origin: crate::k8s::api_endpoint::Origin) -> crate::k8s::api_endpoint::Endpoint {
    crate::k8s::api_endpoint::Endpoint {
        url: url.to_owned(),
        origin,
        credentials: crate::k8s::api_endpoint::Credentials::ServiceAccount("/sa".into()),
        overridden: None,
    }
}

#[test]
fn an_unanswered_cluster_ip_names_the_explicit_endpoint_to_set() {
    use crate::k8s::api_endpoint::Origin;
    let cluster_ip = endpoint("https://10.96.0.1:443", Origin::InCluster);
    let c = api_verdict(&cluster_ip, &Probe::Unreachable("tcp connect error: timed out".into()));
    assert_eq!((c.name.as_str(), c.status), ("api-server", Status::Fail));
    assert!(c.finding.starts_with("https://10.96.0.1:443 (from in-cluster KUBERNETES_SERVICE_HOST"), "{c:?}");
    assert!(c.finding.contains("does not answer GET /version: tcp connect error: timed out"), "{c:?}");
    let fix = c.fix.unwrap();
    assert!(
        fix.contains("--api-server-host HOST --api-server-port PORT") && fix.contains("kproxy-api-endpoint"),
        "{fix}"
    );

    // An explicit endpoint that does not answer: check that one (no advice to set what is set).
    let explicit = endpoint("https://10.0.0.1:6443", Origin::ApiServerEnv);
    let c = api_verdict(&explicit, &Probe::Unreachable("connection refused".into()));
    assert_eq!(c.status, Status::Fail);
    assert!(
        c.fix.as_deref().unwrap().starts_with("check host and port of ConfigMap kproxy-api-endpoint"),
        "{c:?}"
    );

    let ok = api_verdict(&explicit, &Probe::Answered("v1.34.1".into()));
    assert_eq!(ok.status, Status::Ok);
    assert_eq!(
        ok.finding,
        "https://10.0.0.1:6443 (from KPROXY_API_SERVER_HOST/KPROXY_API_SERVER_PORT, set from ConfigMap kproxy-api-endpoint) answers GET /version: v1.34.1"
    );
    let refused = api_verdict(&explicit, &Probe::Refused { code: 401, message: "Unauthorized".into() });
    assert_eq!(refused.status, Status::Fail);
    assert!(refused.fix.as_deref().unwrap().contains("/sa"), "{refused:?}");
    let odd = api_verdict(&explicit, &Probe::Refused { code: 404, message: "not found".into() });
    assert_eq!(odd.status, Status::Warn);
}

#[test]
fn kube_proxy_decisions() {
    assert_eq!(kube_proxy_verdict(&[], &[], &[]).status, Status::Ok);
    let c = kube_proxy_verdict(&[], &["nftables table ip kube-proxy".into()], &[]);
    assert_eq!(c.status, Status::Warn);
    assert_eq!(c.fix.as_deref(), Some("kproxy cleanup-kube-proxy --apply"));
    let c = kube_proxy_verdict(&[42], &[], &[]);
    assert_eq!(c.status, Status::Fail);
    assert!(c.finding.contains("kube-proxy and kproxy both translate Service traffic"));
    let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j KUBE-SVC-ABC\nCOMMIT\n";
    let plans = crate::cmd::kube_proxy_rules::plan_save(saved).unwrap();
    let lines = leftover_lines("iptables-nft", &plans);
    assert_eq!(
        lines,
        vec!["iptables-nft table nat: KUBE-SERVICES, KUBE-SVC-ABC (2 chains, 1 jumps from built-in chains)"]
    );
}

#[test]
fn symlinks_resolve_inside_the_root() {
    let dir = std::env::temp_dir().join(format!("kproxy-doctor-unit-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("etc/sysctl.d")).unwrap();
    fs::write(dir.join("etc/sysctl.conf"), "net.ipv4.ip_forward = 0\n").unwrap();
    std::os::unix::fs::symlink("../sysctl.conf", dir.join("etc/sysctl.d/99-sysctl.conf")).unwrap();
    std::os::unix::fs::symlink("/dev/null", dir.join("etc/sysctl.d/50-masked.conf")).unwrap();
    std::os::unix::fs::symlink("/etc/sysctl.conf", dir.join("etc/sysctl.d/60-abs.conf")).unwrap();
    assert_eq!(
        read_in_root(Some(&dir), "/etc/sysctl.d/99-sysctl.conf").unwrap(),
        "net.ipv4.ip_forward = 0\n"
    );
    assert_eq!(read_in_root(Some(&dir), "/etc/sysctl.d/60-abs.conf").unwrap(), "net.ipv4.ip_forward = 0\n");
    assert_eq!(read_in_root(Some(&dir), "/etc/sysctl.d/50-masked.conf").unwrap(), "");
    let files = SysctlFiles::read(Some(&dir));
    assert_eq!(files.effective("net.ipv4.ip_forward").unwrap().file, "/etc/sysctl.conf");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn socket_lb_check_names_the_mode_and_warns_when_the_node_is_not_served() {
    use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF};
    let links: std::collections::BTreeSet<String> = [
        "veth1@5-ingress",
        "cgroup@2f7379732f66732f636772-kproxy_connect4",
        "cgroup@2f7379732f66732f636772-kproxy_sendmsg4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let host_only = socket_lb_check(&links, Some(SOCKET_LB_HOST_ONLY));
    assert_eq!(host_only.status, Status::Ok);
    assert!(host_only.finding.contains("host-only (2 cgroup hooks)"), "{}", host_only.finding);
    let on = socket_lb_check(&links, Some(SOCKET_LB_ALL));
    assert!(on.finding.contains("on (2 cgroup hooks)"), "{}", on.finding);
    let none = std::collections::BTreeSet::new();
    for off in [socket_lb_check(&none, Some(SOCKET_LB_OFF)), socket_lb_check(&none, None)] {
        assert_eq!(off.status, Status::Warn, "{}", off.finding);
        assert!(off.finding.contains("cannot reach cluster IPs"), "{}", off.finding);
    }
}

#[test]
fn north_south_check_names_external_interfaces_and_xdp() {
    let links: std::collections::BTreeSet<String> = [
        "eth0@2-external",
        "eth0@2-egress",
        "eth0@2-xdp",
        "veth1@5-ingress",
        "cgroup@2f7379732f66732f636772-kproxy_connect4",
        "cgroup@2f7379732f66732f636772-kproxy_sendmsg4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let check = north_south_check(&links);
    assert!(check.finding.contains("external interfaces eth0 (XDP on eth0)"), "{}", check.finding);
    let none = north_south_check(&std::collections::BTreeSet::new());
    assert!(none.finding.contains("no external interface"), "{}", none.finding);
}

#[test]
fn inherited_connections_are_ok_while_netfilter_can_translate_them_and_fail_when_it_cannot() {
    use super::kube_proxy::inherited_verdict;
    assert_eq!(inherited_verdict(Ok(0), Some(false)).status, Status::Ok);
    let kept = inherited_verdict(Ok(3), Some(true));
    assert_eq!(kept.status, Status::Ok);
    assert!(kept.finding.starts_with("3 connection(s) opened through kube-proxy"), "{}", kept.finding);
    let cut = inherited_verdict(Ok(2), Some(false));
    assert_eq!(cut.status, Status::Fail);
    assert!(cut.finding.contains("no NAT hook"), "{}", cut.finding);
    assert_eq!(inherited_verdict(Err("EPERM".into()), None).status, Status::Warn);
}

#[test]
fn ipv6_forwarding_is_checked_only_on_a_node_that_serves_ipv6() {
    let v = |s: &str| Runtime::Value(s.into());
    // An IPv4-only node: IPv6 enabled (as on every Linux node) but off everywhere, no IPv6 Service.
    assert_eq!(ipv6_forward_need(0, &v("0"), None), None);
    assert_eq!(ipv6_forward_need(0, &v("0"), Some(&setting("0"))), None);
    assert_eq!(ipv6_forward_need(0, &Runtime::Unknown("no /proc".into()), None), None);
    // IPv6 Services, or forwarding on somewhere.
    assert_eq!(ipv6_forward_need(3, &v("0"), None), Some(Ipv6Need::Services(3)));
    assert_eq!(ipv6_forward_need(0, &v("1"), None), Some(Ipv6Need::Configured));
    assert_eq!(ipv6_forward_need(0, &v("0"), Some(&setting("1"))), Some(Ipv6Need::Configured));
}

#[test]
fn ipv6_forward_decisions() {
    let v = |s: &str| Runtime::Value(s.into());
    let services = Ipv6Need::Services(4);
    // Drift: on now, off after the next reboot.
    let c = ipv6_forward_check(services, v("1"), Some(setting("0")));
    assert_eq!((c.status, c.name.as_str()), (Status::Warn, "ipv6_forward"));
    assert!(
        c.finding.starts_with(
            "/etc/sysctl.d/99-sysctl.conf:12 sets net.ipv6.conf.all.forwarding = 0: the next reboot disables forwarding"
        ),
        "{}",
        c.finding
    );
    assert!(c.finding.ends_with("; 4 IPv6 frontends are programmed"), "{}", c.finding);
    let fix = c.fix.unwrap();
    assert!(fix.contains("line 12 to `net.ipv6.conf.all.forwarding = 1`"), "{fix}");
    assert!(fix.contains("accept_ra = 2"), "{fix}");
    assert_eq!(ipv6_forward_check(services, v("1"), Some(setting("1"))).status, Status::Ok);
    let c = ipv6_forward_check(services, v("1"), None);
    assert_eq!(c.status, Status::Warn);
    assert!(
        c.fix
            .unwrap()
            .starts_with("echo 'net.ipv6.conf.all.forwarding = 1' > /etc/sysctl.d/99-zz-kproxy-ipv6.conf")
    );
    // Off at runtime: FAIL with IPv6 Services, WARN when only configured somewhere.
    let c = ipv6_forward_check(services, v("0"), Some(setting("1")));
    assert_eq!(c.status, Status::Fail);
    assert!(c.finding.contains("the node routes no IPv6 pod traffic"), "{}", c.finding);
    assert!(c.fix.unwrap().starts_with("sysctl -w net.ipv6.conf.all.forwarding=1"));
    assert_eq!(ipv6_forward_check(Ipv6Need::Configured, v("0"), Some(setting("1"))).status, Status::Warn);
    // The IPv4 check keeps its own words.
    let c = ip_forward_check(v("1"), None);
    assert!(c.fix.unwrap().starts_with("echo 'net.ipv4.ip_forward = 1' > /etc/sysctl.d/99-zz-kproxy.conf"));
}

/// A node image as fixture files: the persisted value found by sysctl's precedence, the runtime one
/// read under the root, through the same `collect` the command runs.
#[test]
fn ipv6_forwarding_read_from_a_node_image() {
    let dir = std::env::temp_dir().join(format!("kproxy-doctor-ipv6-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    };
    write(
        "usr/lib/sysctl.d/50-dual-stack.conf",
        "net/ipv6/conf/all/forwarding = 1\nnet.ipv4.ip_forward = 1\n",
    );
    write("etc/sysctl.d/90-hardening.conf", "# IPv6 off for servers\nnet.ipv6.conf.all.forwarding = 0\n");
    write("proc/sys/net/ipv6/conf/all/forwarding", "1\n");
    write("proc/sys/net/ipv4/ip_forward", "1\n");
    let args = DoctorArgs { root: Some(dir.clone()), interfaces: vec!["veth*".into()], ..Default::default() };
    let pins = PinDir::new(dir.join("no-pins"));
    let report = collect(&pins, &args).unwrap();
    let check = report.checks.iter().find(|c| c.name == "ipv6_forward").expect("checked: forwarding is on");
    assert_eq!(check.status, Status::Warn, "{check:?}");
    assert!(
        check.finding.starts_with("/etc/sysctl.d/90-hardening.conf:2 sets net.ipv6.conf.all.forwarding = 0"),
        "{}",
        check.finding
    );
    // Without IPv6 forwarding anywhere the image is an IPv4-only node: skipped, not reported.
    fs::remove_file(dir.join("usr/lib/sysctl.d/50-dual-stack.conf")).unwrap();
    write("proc/sys/net/ipv6/conf/all/forwarding", "0\n");
    let report = collect(&pins, &args).unwrap();
    assert!(report.checks.iter().all(|c| c.name != "ipv6_forward"), "{:?}", report.checks);
    assert!(
        report.skipped.iter().any(|s| s.starts_with("ipv6_forward: no IPv6 Service")),
        "{:?}",
        report.skipped
    );
    fs::remove_dir_all(&dir).unwrap();
}
