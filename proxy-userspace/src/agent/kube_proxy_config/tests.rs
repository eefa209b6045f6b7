use super::*;

/// kube-proxy's config.conf as `kubeadm init` (v1.31–1.34) renders it into ConfigMap
/// kube-system/kube-proxy: every field written, most at their zero value, with the pod subnet
/// kubeadm was given.
pub(crate) const KUBEADM_CONFIG_CONF: &str = include_str!("../../../testdata/kubeadm-kube-proxy-config.conf");

fn parse_text(text: &str) -> Result<FileSettings, ConfigError> {
    parse(Path::new("config.conf"), text, 4)
}

#[test]
fn kubeadms_rendering_means_the_defaults_and_its_pod_subnet() {
    let settings = parse_text(KUBEADM_CONFIG_CONF).unwrap();
    assert_eq!(
        settings,
        FileSettings {
            kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            ..Default::default()
        }
    );
}

#[test]
fn every_field_with_a_kproxy_meaning_is_read() {
    let text = KUBEADM_CONFIG_CONF
        .replace("hostnameOverride: \"\"", "hostnameOverride: worker-3")
        .replace("healthzBindAddress: \"\"", "healthzBindAddress: 0.0.0.0")
        .replace("metricsBindAddress: \"\"", "metricsBindAddress: 0.0.0.0:10249")
        .replace("bindAddressHardFail: false", "bindAddressHardFail: true")
        .replace("clusterCIDR: 10.244.0.0/16", "clusterCIDR: 10.244.0.0/16,fd00:10:244::/56")
        .replace("nodePortAddresses: null", "nodePortAddresses: [primary, 192.168.0.0/16]")
        .replace("  tcpEstablishedTimeout: null", "  tcpEstablishedTimeout: 24h0m0s")
        .replace("  udpStreamTimeout: 0s", "  udpStreamTimeout: 2m0s")
        .replace("  maxPerCore: null", "  maxPerCore: 32768")
        .replace("  min: null", "  min: 131072")
        .replace("  interfaceNamePrefix: \"\"", "  interfaceNamePrefix: cali")
        .replace("detectLocalMode: \"\"", "detectLocalMode: InterfaceNamePrefix")
        .replace("  verbosity: 0", "  verbosity: 4")
        .replace("logging:\n", "logging:\n  format: json\n")
        .replacen("  minSyncPeriod: 0s", "  minSyncPeriod: 1s", 1)
        .replacen("  syncPeriod: 0s", "  syncPeriod: 30s", 1);
    let settings = parse_text(&text).unwrap();
    assert_eq!(
        settings,
        FileSettings {
            kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
            hostname_override: Some("worker-3".into()),
            healthz_bind_address: Some("0.0.0.0:10256".into()),
            metrics_bind_address: Some("0.0.0.0:10249".into()),
            bind_address_hard_fail: Some(true),
            cluster_cidrs: vec!["10.244.0.0/16".into(), "fd00:10:244::/56".into()],
            interfaces: Some("cali*".into()),
            nodeport_addresses: vec!["primary".into(), "192.168.0.0/16".into()],
            min_sync_period: Some(Duration::from_secs(1)),
            sync_period: Some(Duration::from_secs(30)),
            conntrack_tcp_timeout_established: Some(Duration::from_secs(86400)),
            conntrack_udp_timeout: Some(Duration::from_secs(120)),
            // max(32768 × 4 CPUs, 131072) flows, two entries each.
            conntrack_max: Some(262_144),
            log_format: Some("json".into()),
            verbosity: Some(4),
            ignored: vec![],
        }
    );
}

#[test]
fn effective_settings_written_read_back_are_the_same() {
    let settings = FileSettings {
        kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
        hostname_override: Some("worker-3".into()),
        healthz_bind_address: Some("0.0.0.0:10256".into()),
        metrics_bind_address: Some("127.0.0.1:10249".into()),
        bind_address_hard_fail: Some(true),
        cluster_cidrs: vec!["10.244.0.0/16".into(), "fd00:10:244::/56".into()],
        interfaces: Some("cali*".into()),
        nodeport_addresses: vec!["primary".into()],
        min_sync_period: Some(Duration::from_secs(1)),
        sync_period: Some(Duration::from_secs(30)),
        conntrack_tcp_timeout_established: Some(Duration::from_secs(6 * 3600)),
        conntrack_udp_timeout: Some(Duration::from_secs(60)),
        conntrack_max: Some(524_288),
        log_format: Some("json".into()),
        verbosity: Some(4),
        ignored: vec![],
    };
    let yaml = to_yaml(&settings);
    assert!(yaml.contains("\nminSyncPeriod: 1s\n"), "{yaml}");
    assert!(yaml.contains("  tcpEstablishedTimeout: 6h0m0s\n"), "{yaml}");
    assert!(yaml.contains("detectLocalMode: InterfaceNamePrefix\n"), "{yaml}");
    assert_eq!(parse_text(&yaml).unwrap(), settings);

    // Two globs are no prefix: said in a comment, not written as one.
    let veths = FileSettings { interfaces: Some("veth* lxc*".into()), ..settings };
    let yaml = to_yaml(&veths);
    assert!(yaml.contains("# --interfaces veth* lxc*: not one NAME* glob"), "{yaml}");
    assert_eq!(parse_text(&yaml).unwrap().interfaces, None);
}

#[test]
fn go_durations() {
    let d = |s: f64| go_duration(Duration::from_secs_f64(s));
    assert_eq!(go_duration(Duration::ZERO), "0s");
    assert_eq!(d(0.05), "50ms");
    assert_eq!(d(0.0015), "1.5ms");
    assert_eq!(go_duration(Duration::from_micros(100)), "100µs");
    assert_eq!(go_duration(Duration::from_nanos(7)), "7ns");
    assert_eq!(d(1.0), "1s");
    assert_eq!(d(1.5), "1.5s");
    assert_eq!(d(90.0), "1m30s");
    assert_eq!(d(3600.0), "1h0m0s");
    assert_eq!(d(86400.0), "24h0m0s");
    for text in ["50ms", "1.5s", "1m30s", "24h0m0s", "100µs"] {
        assert_eq!(go_duration(crate::agent::parse_duration(text).unwrap()), text);
    }
}

#[test]
fn max_per_core_zero_leaves_the_table_size_alone_as_in_kube_proxy() {
    let text = KUBEADM_CONFIG_CONF
        .replace("  maxPerCore: null", "  maxPerCore: 0")
        .replace("  min: null", "  min: 131072");
    assert_eq!(parse_text(&text).unwrap().conntrack_max, None);
    let text = KUBEADM_CONFIG_CONF.replace("  min: null", "  min: 131072");
    assert_eq!(parse_text(&text).unwrap().conntrack_max, Some(262_144));
}

#[test]
fn the_nftables_mode_means_primary_nodeport_addresses_unless_set() {
    let nftables = KUBEADM_CONFIG_CONF.replace("mode: \"\"", "mode: nftables");
    assert_eq!(parse_text(&nftables).unwrap().nodeport_addresses, ["primary"]);
    let cidrs = nftables.replace("nodePortAddresses: null", "nodePortAddresses: [10.0.0.0/8]");
    assert_eq!(parse_text(&cidrs).unwrap().nodeport_addresses, ["10.0.0.0/8"]);
}

#[test]
fn the_nftables_mode_reads_its_own_section() {
    let text = KUBEADM_CONFIG_CONF.replace("mode: \"\"", "mode: nftables").replace(
        "nftables:\n  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 0s",
        "nftables:\n  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 2s",
    );
    assert_eq!(parse_text(&text).unwrap().min_sync_period, Some(Duration::from_secs(2)));
}

#[test]
fn fields_without_a_kproxy_meaning_are_listed_when_set() {
    let text = KUBEADM_CONFIG_CONF
        .replace("mode: \"\"", "mode: ipvs")
        .replace("  scheduler: \"\"", "  scheduler: rr")
        .replace(
            "  masqueradeAll: false\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nipvs",
            "  masqueradeAll: true\n  masqueradeBit: null\n  minSyncPeriod: 0s\n  syncPeriod: 0s\nipvs",
        )
        .replace("oomScoreAdj: null", "oomScoreAdj: -999");
    let settings = parse_text(&text).unwrap();
    assert_eq!(
        settings.ignored,
        ["mode (ipvs: kproxy is its own datapath)", "iptables.masqueradeAll", "ipvs", "oomScoreAdj"]
    );
}

#[test]
fn a_typo_or_a_wrong_type_is_refused_with_the_field_and_the_file() {
    let typo = KUBEADM_CONFIG_CONF.replace("hostnameOverride:", "hostnameOveride:");
    let err = parse_text(&typo).unwrap_err();
    assert_eq!(err.file, "config.conf");
    assert!(err.message.contains("unknown field `hostnameOveride`"), "{err}");

    let nested =
        KUBEADM_CONFIG_CONF.replace("  tcpBeLiberal: false", "  tcpBeLiberal: false\n  tcpTimeout: 1s");
    let err = parse_text(&nested).unwrap_err();
    assert!(err.message.contains("conntrack") && err.message.contains("unknown field `tcpTimeout`"), "{err}");

    let wrong_type = KUBEADM_CONFIG_CONF.replace("  verbosity: 0", "  verbosity: loud");
    let err = parse_text(&wrong_type).unwrap_err();
    assert!(err.message.contains("logging.verbosity") && err.message.contains("invalid type"), "{err}");

    let bad_duration = KUBEADM_CONFIG_CONF.replace("  udpStreamTimeout: 0s", "  udpStreamTimeout: 2 minutes");
    let err = parse_text(&bad_duration).unwrap_err();
    assert!(err.message.starts_with("conntrack.udpStreamTimeout:"), "{err}");

    let bad_address =
        KUBEADM_CONFIG_CONF.replace("healthzBindAddress: \"\"", "healthzBindAddress: localhost");
    assert!(parse_text(&bad_address).unwrap_err().message.starts_with("healthzBindAddress:"));

    let other_kind =
        KUBEADM_CONFIG_CONF.replace("kind: KubeProxyConfiguration", "kind: KubeletConfiguration");
    assert!(parse_text(&other_kind).unwrap_err().message.starts_with("apiVersion/kind:"));
}
