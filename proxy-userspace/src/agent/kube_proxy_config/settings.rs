//! What a file means for `kproxy agent`: kube-proxy's zero values are unset, addresses get their
//! default ports, and what kproxy cannot honour is listed in `ignored`.

use std::{net::SocketAddr, time::Duration};

use super::{Conntrack, FileSettings, KubeProxyConfiguration, Logging, ModeSection};

/// kube-proxy's default ports (`k8s.io/kubernetes/pkg/cluster/ports`).
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

/// A set string: `None` for absent or empty (kube-proxy's zero value).
fn set(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A Go duration (`metav1.Duration`: "1s", "1h0m0s"); zero is unset.
fn duration(field: &str, value: &Option<String>) -> Result<Option<Duration>, String> {
    let Some(text) = set(value) else { return Ok(None) };
    let parsed = crate::agent::parse_duration(text).map_err(|e| format!("{field}: {e}"))?;
    Ok((!parsed.is_zero()).then_some(parsed))
}

/// kube-proxy's `AppendPortIfNeeded`: an address without a port gets the default one.
fn bind_address(field: &str, value: &str, default_port: u16) -> Result<String, String> {
    if value.parse::<SocketAddr>().is_ok() {
        return Ok(value.to_string());
    }
    match value.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(SocketAddr::new(ip, default_port).to_string()),
        Err(_) => Err(format!("{field}: {value:?} is not an IP address or address:port")),
    }
}

pub(super) fn settings(config: &KubeProxyConfiguration, cpus: u32) -> Result<FileSettings, String> {
    let mut out = FileSettings {
        kubeconfig: config.client_connection.as_ref().and_then(|c| set(&c.kubeconfig)).map(str::to_string),
        hostname_override: set(&config.hostname_override).map(str::to_string),
        ..Default::default()
    };
    // The steps run in this order so that the first error and the `ignored` list read as before.
    read_addresses(config, &mut out)?;
    read_mode(config, &mut out)?;
    read_detect_local(config, &mut out)?;
    if let Some(conntrack) = &config.conntrack {
        read_conntrack(conntrack, cpus, &mut out)?;
    }
    if let Some(logging) = &config.logging {
        read_logging(logging, &mut out)?;
    }
    let unused = unused_fields(config)?;
    out.ignored.extend(unused.into_iter().map(str::to_string));
    Ok(out)
}

/// The health and metrics listeners, the cluster CIDRs and the NodePort addresses.
fn read_addresses(config: &KubeProxyConfiguration, out: &mut FileSettings) -> Result<(), String> {
    if let Some(value) = set(&config.healthz_bind_address) {
        out.healthz_bind_address = Some(bind_address("healthzBindAddress", value, HEALTHZ_PORT)?);
    }
    if let Some(value) = set(&config.metrics_bind_address) {
        out.metrics_bind_address = Some(bind_address("metricsBindAddress", value, METRICS_PORT)?);
    }
    out.bind_address_hard_fail = config.bind_address_hard_fail.filter(|&hard| hard);
    if let Some(cidrs) = set(&config.cluster_cidr) {
        out.cluster_cidrs =
            cidrs.split(',').map(|c| c.trim().to_string()).filter(|c| !c.is_empty()).collect();
    }
    out.nodeport_addresses = config.node_port_addresses.clone().unwrap_or_default();
    Ok(())
}

/// What the proxy mode implies: the NodePort default and the sync periods.
fn read_mode(config: &KubeProxyConfiguration, out: &mut FileSettings) -> Result<(), String> {
    let mode = set(&config.mode).unwrap_or("iptables");
    if !matches!(mode, "iptables" | "nftables") {
        out.ignored.push(format!("mode ({mode}: kproxy is its own datapath)"));
    }
    // kube-proxy's nftables mode answers NodePorts on the node's primary IPs unless told otherwise.
    if mode == "nftables" && out.nodeport_addresses.is_empty() {
        out.nodeport_addresses = vec![crate::agent::nodeport::PRIMARY.to_string()];
    }
    // The mode's own section sets the sync periods (the top-level fields, where present, win).
    let section = if mode == "nftables" { &config.nftables } else { &config.iptables };
    let section_name = if mode == "nftables" { "nftables" } else { "iptables" };
    let from_section = |name: &str, pick: fn(&ModeSection) -> &Option<String>| {
        section.as_ref().map_or(Ok(None), |s| duration(&format!("{section_name}.{name}"), pick(s)))
    };
    out.min_sync_period = duration("minSyncPeriod", &config.min_sync_period)?
        .or(from_section("minSyncPeriod", |s| &s.min_sync_period)?);
    out.sync_period =
        duration("syncPeriod", &config.sync_period)?.or(from_section("syncPeriod", |s| &s.sync_period)?);
    Ok(())
}

/// detectLocalMode: ClusterCIDR is kproxy's own way; an interface prefix becomes `interfaces`.
fn read_detect_local(config: &KubeProxyConfiguration, out: &mut FileSettings) -> Result<(), String> {
    match set(&config.detect_local_mode) {
        None | Some("ClusterCIDR") => {}
        Some("InterfaceNamePrefix") => {
            let prefix = config.detect_local.as_ref().and_then(|d| set(&d.interface_name_prefix));
            let Some(prefix) = prefix else {
                return Err(
                    "detectLocal.interfaceNamePrefix: detectLocalMode InterfaceNamePrefix needs a prefix"
                        .into(),
                );
            };
            out.interfaces = Some(format!("{prefix}*"));
        }
        Some(other) => out.ignored.push(format!("detectLocalMode ({other})")),
    }
    Ok(())
}

/// The conntrack timeouts and table size kproxy keeps, and the netfilter-only fields it ignores.
fn read_conntrack(conntrack: &Conntrack, cpus: u32, out: &mut FileSettings) -> Result<(), String> {
    out.conntrack_tcp_timeout_established =
        duration("conntrack.tcpEstablishedTimeout", &conntrack.tcp_established_timeout)?;
    // kproxy keeps one UDP timeout; a Service's UDP flows are answered ones, netfilter's "stream".
    out.conntrack_udp_timeout = duration("conntrack.udpStreamTimeout", &conntrack.udp_stream_timeout)?;
    if duration("conntrack.udpTimeout", &conntrack.udp_timeout)?.is_some() {
        out.ignored.push("conntrack.udpTimeout (kproxy uses conntrack.udpStreamTimeout for UDP)".into());
    }
    if duration("conntrack.tcpCloseWaitTimeout", &conntrack.tcp_close_wait_timeout)?.is_some() {
        out.ignored.push("conntrack.tcpCloseWaitTimeout (a netfilter sysctl)".into());
    }
    if conntrack.tcp_be_liberal == Some(true) {
        out.ignored.push("conntrack.tcpBeLiberal (a netfilter sysctl)".into());
    }
    let per_core = u64::from(conntrack.max_per_core.unwrap_or(0)) * u64::from(cpus.max(1));
    let flows = per_core.max(u64::from(conntrack.min.unwrap_or(0)));
    // maxPerCore 0 is kube-proxy's "leave the table size as it is" (conntrack.min ignored).
    if flows > 0 && conntrack.max_per_core != Some(0) {
        out.conntrack_max = Some(u32::try_from(flows * 2).unwrap_or(u32::MAX));
    }
    Ok(())
}

/// The log format (text or json only) and verbosity.
fn read_logging(logging: &Logging, out: &mut FileSettings) -> Result<(), String> {
    out.log_format = set(&logging.format).map(str::to_string);
    if let Some(format) = out.log_format.as_deref()
        && !matches!(format, "text" | "json")
    {
        return Err(format!("logging.format: {format:?} is not text or json"));
    }
    out.verbosity = logging.verbosity.filter(|&v| v > 0);
    Ok(())
}

/// The fields that are set, and meaningless here, in the order `ignored` lists them.
fn unused_fields(config: &KubeProxyConfiguration) -> Result<Vec<&'static str>, String> {
    let flag = |on: Option<bool>| on == Some(true);
    let mut unused: Vec<&'static str> = Vec::new();
    if config.feature_gates.as_ref().is_some_and(|gates| !gates.is_empty()) {
        unused.push("featureGates");
    }
    if set(&config.bind_address).is_some_and(|a| a != "0.0.0.0") {
        unused.push("bindAddress");
    }
    if flag(config.enable_profiling) {
        unused.push("enableProfiling");
    }
    if set(&config.show_hidden_metrics_for_version).is_some() {
        unused.push("showHiddenMetricsForVersion");
    }
    for (name, section) in [("iptables", &config.iptables), ("nftables", &config.nftables)] {
        let Some(section) = section else { continue };
        if flag(section.masquerade_all) {
            unused.push(if name == "iptables" { "iptables.masqueradeAll" } else { "nftables.masqueradeAll" });
        }
        if section.masquerade_bit.is_some_and(|bit| bit != 14) {
            unused.push(if name == "iptables" { "iptables.masqueradeBit" } else { "nftables.masqueradeBit" });
        }
    }
    if config.iptables.as_ref().is_some_and(|s| s.localhost_node_ports == Some(false)) {
        unused.push("iptables.localhostNodePorts");
    }
    if has_values(&config.ipvs) {
        unused.push("ipvs");
    }
    if has_values(&config.winkernel) {
        unused.push("winkernel");
    }
    if config.oom_score_adj.is_some() {
        unused.push("oomScoreAdj");
    }
    if set(&config.port_range).is_some() {
        unused.push("portRange");
    }
    if duration("configSyncPeriod", &config.config_sync_period)?.is_some() {
        unused.push("configSyncPeriod");
    }
    if config.detect_local.as_ref().and_then(|d| set(&d.bridge_interface)).is_some() {
        unused.push("detectLocal.bridgeInterface");
    }
    if let Some(client) = &config.client_connection
        && (client.qps.is_some_and(|q| q != 0.0) || client.burst.is_some_and(|b| b != 0))
    {
        unused.push("clientConnection.qps/burst");
    }
    Ok(unused)
}

/// Whether a free-form section holds anything but zero values (kubeadm writes them all out).
fn has_values(value: &Option<serde_yaml::Value>) -> bool {
    fn non_zero(value: &serde_yaml::Value) -> bool {
        use serde_yaml::Value;
        match value {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty() && s != "0s" && s != "0",
            Value::Sequence(items) => items.iter().any(non_zero),
            Value::Mapping(map) => map.values().any(non_zero),
            Value::Tagged(tagged) => non_zero(&tagged.value),
        }
    }
    value.as_ref().is_some_and(non_zero)
}
