//! kube-proxy's configuration file (`--config`): `kubeproxy.config.k8s.io/v1alpha1
//! KubeProxyConfiguration`, as kubeadm renders it into ConfigMap `kube-system/kube-proxy`
//! (`config.conf`), read into the `kproxy agent` settings it means.
//!
//! Every field of the v1alpha1 type is known (k8s.io/kube-proxy/config/v1alpha1/types.go); an
//! unknown field or a wrong type is an error naming the field and the file, as kube-proxy's strict
//! decoding reports it. Zero values are "unset" and take kube-proxy's defaults (kubeadm writes
//! every field, most of them zero). Fields with no kproxy meaning (the proxy mode, IPVS, masquerade
//! bits, Windows) are collected in [`FileSettings::ignored`] when set, for one warning.
//!
//! [`read`] reads the file; the caller merges the settings under its flags (a flag given wins;
//! kube-proxy lets only its logging flags and `--hostname-override` win and ignores the others
//! when `--config` is given). [`to_yaml`] writes settings back as a KubeProxyConfiguration
//! (`--write-config-to`).

use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};

use serde::{Deserialize, Serialize};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's default ports (`k8s.io/kubernetes/pkg/cluster/ports`).
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

/// The file as written, every field optional.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    pub logging: Option<Logging>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    pub iptables: Option<ModeSection>,
    pub ipvs: Option<serde_yaml::Value>,
    pub nftables: Option<ModeSection>,
    pub winkernel: Option<serde_yaml::Value>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Option<Conntrack>,
    pub config_sync_period: Option<String>,
    pub port_range: Option<String>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub windows_run_as_service: Option<bool>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Logging {
    pub format: Option<String>,
    pub flush_frequency: Option<serde_yaml::Value>,
    pub verbosity: Option<u32>,
    pub vmodule: Option<serde_yaml::Value>,
    pub options: Option<serde_yaml::Value>,
}

/// `iptables:` and `nftables:` (the same fields kproxy cares about).
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModeSection {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Conntrack {
    pub max_per_core: Option<u32>,
    pub min: Option<u32>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<String>,
    pub udp_stream_timeout: Option<String>,
}

/// What the file sets that `kproxy agent` honours; `None`: not set (zero), the flag's default holds.
/// [`to_yaml`] writes effective settings of the same shape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    pub kubeconfig: Option<String>,
    pub hostname_override: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    /// `clusterCIDR`, comma-separated as kube-proxy takes it (one per family).
    pub cluster_cidrs: Vec<String>,
    /// `detectLocal.interfaceNamePrefix` (with `detectLocalMode: InterfaceNamePrefix`) as a glob for
    /// `--interfaces` (in effective settings, `--interfaces`' globs, space-separated).
    pub interfaces: Option<String>,
    pub nodeport_addresses: Vec<String>,
    pub min_sync_period: Option<Duration>,
    pub sync_period: Option<Duration>,
    pub conntrack_tcp_timeout_established: Option<Duration>,
    pub conntrack_udp_timeout: Option<Duration>,
    /// `max(conntrack.maxPerCore × CPUs, conntrack.min)` flows, as kproxy entries (two per flow).
    pub conntrack_max: Option<u32>,
    pub log_format: Option<String>,
    pub verbosity: Option<u32>,
    /// Fields set to something kproxy cannot honour, by their path in the file.
    pub ignored: Vec<String>,
}

/// A problem with the file: it names the file and, where it is about one, the field.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

/// Reads the KubeProxyConfiguration in `file`.
pub fn read(file: &Path) -> Result<FileSettings, ConfigError> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| ConfigError { file: file.display().to_string(), message: e.to_string() })?;
    parse(file, &text, usable_cpus())
}

/// The CPUs this process may run on, as Go's `runtime.NumCPU` (kube-proxy's `maxPerCore` factor).
fn usable_cpus() -> u32 {
    // SAFETY: sched_getaffinity fills the zeroed set we own; CPU_COUNT only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            u32::try_from(libc::CPU_COUNT(&set)).unwrap_or(1).max(1)
        } else {
            1
        }
    }
}

/// Reads a KubeProxyConfiguration from `text` (the contents of `file`, for messages).
pub fn parse(file: &Path, text: &str, cpus: u32) -> Result<FileSettings, ConfigError> {
    let error = |message: String| ConfigError { file: file.display().to_string(), message };
    let config: KubeProxyConfiguration = serde_yaml::from_str(text).map_err(|e| error(e.to_string()))?;
    match (config.api_version.as_deref(), config.kind.as_deref()) {
        (Some(API_VERSION), Some(KIND)) => {}
        (version, kind) => {
            return Err(error(format!(
                "apiVersion/kind: {} {} is not {API_VERSION} {KIND}",
                version.unwrap_or("(none)"),
                kind.unwrap_or("(none)")
            )));
        }
    }
    settings(&config, cpus).map_err(error)
}

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

fn settings(config: &KubeProxyConfiguration, cpus: u32) -> Result<FileSettings, String> {
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

/// `settings` as a KubeProxyConfiguration (`--write-config-to`): the fields kproxy honours, at
/// the values given, and comments for what the file format cannot say.
pub fn to_yaml(settings: &FileSettings) -> String {
    let mut notes = vec![
        "kproxy's effective configuration (kproxy agent --write-config-to): the KubeProxyConfiguration"
            .to_owned(),
        "fields kproxy honours, from the flags and the --config file; kproxy's other flags are not here."
            .to_owned(),
    ];
    let globs: Vec<&str> = settings.interfaces.as_deref().unwrap_or_default().split_whitespace().collect();
    let prefix = match globs.as_slice() {
        [glob] => glob.strip_suffix('*').filter(|p| !p.is_empty() && !p.contains(['*', '?', '['])),
        _ => None,
    };
    if prefix.is_none() && !globs.is_empty() {
        notes.push(format!(
            "--interfaces {}: not one NAME* glob, so not a detectLocal.interfaceNamePrefix",
            globs.join(" ")
        ));
    }
    for (field, value) in [
        ("healthzBindAddress", &settings.healthz_bind_address),
        ("metricsBindAddress", &settings.metrics_bind_address),
    ] {
        if value.as_deref() == Some("") {
            notes.push(format!("{field}: disabled (an empty flag); in a file, empty means the default"));
        }
    }
    let config = KubeProxyConfiguration {
        api_version: Some(API_VERSION.to_owned()),
        kind: Some(KIND.to_owned()),
        client_connection: Some(ClientConnection {
            kubeconfig: Some(settings.kubeconfig.clone().unwrap_or_default()),
            ..Default::default()
        }),
        logging: Some(Logging {
            format: settings.log_format.clone(),
            verbosity: settings.verbosity,
            ..Default::default()
        }),
        hostname_override: Some(settings.hostname_override.clone().unwrap_or_default()),
        healthz_bind_address: settings.healthz_bind_address.clone(),
        metrics_bind_address: settings.metrics_bind_address.clone(),
        bind_address_hard_fail: settings.bind_address_hard_fail,
        detect_local_mode: prefix.map(|_| "InterfaceNamePrefix".to_owned()),
        detect_local: prefix
            .map(|p| DetectLocal { interface_name_prefix: Some(p.to_owned()), ..Default::default() }),
        cluster_cidr: Some(settings.cluster_cidrs.join(",")),
        node_port_addresses: Some(settings.nodeport_addresses.clone()),
        conntrack: Some(Conntrack {
            // Exactly this many flows: kproxy's entries are two per flow.
            min: settings.conntrack_max.map(|entries| entries.div_ceil(2)),
            tcp_established_timeout: settings.conntrack_tcp_timeout_established.map(go_duration),
            udp_stream_timeout: settings.conntrack_udp_timeout.map(go_duration),
            ..Default::default()
        }),
        sync_period: settings.sync_period.map(go_duration),
        min_sync_period: settings.min_sync_period.map(go_duration),
        ..Default::default()
    };
    let mut value = serde_yaml::to_value(&config).expect("a KubeProxyConfiguration serialises");
    strip_nulls(&mut value);
    let yaml = serde_yaml::to_string(&value).expect("YAML serialises");
    notes.iter().map(|n| format!("# {n}\n")).collect::<String>() + &yaml
}

/// Drops the unset fields (and sections left empty) from a serialised configuration.
fn strip_nulls(value: &mut serde_yaml::Value) {
    if let serde_yaml::Value::Mapping(map) = value {
        for (_, field) in map.iter_mut() {
            strip_nulls(field);
        }
        map.retain(|_, field| {
            !(field.is_null() || field.as_mapping().is_some_and(serde_yaml::Mapping::is_empty))
        });
    }
}

/// A duration as Go's `time.Duration.String` writes it (`1s`, `50ms`, `6h0m0s`): what
/// `metav1.Duration` fields hold.
pub fn go_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    // `value / scale` with the fraction's trailing zeros dropped.
    let decimal = |value: u128, scale: u128, digits: usize| {
        let (whole, fraction) = (value / scale, value % scale);
        if fraction == 0 {
            whole.to_string()
        } else {
            format!("{whole}.{}", format!("{fraction:0digits$}").trim_end_matches('0'))
        }
    };
    match nanos {
        0 => "0s".to_owned(),
        1..1_000 => format!("{nanos}ns"),
        1_000..1_000_000 => format!("{}µs", decimal(nanos, 1_000, 3)),
        1_000_000..1_000_000_000 => format!("{}ms", decimal(nanos, 1_000_000, 6)),
        _ => {
            let (hours, rest) = (nanos / 3_600_000_000_000, nanos % 3_600_000_000_000);
            let (minutes, rest) = (rest / 60_000_000_000, rest % 60_000_000_000);
            let seconds = format!("{}s", decimal(rest, 1_000_000_000, 9));
            match (hours, minutes) {
                (0, 0) => seconds,
                (0, m) => format!("{m}m{seconds}"),
                (h, m) => format!("{h}h{m}m{seconds}"),
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// kube-proxy's config.conf as `kubeadm init` (v1.31–1.34) renders it into ConfigMap
    /// kube-system/kube-proxy: every field written, most at their zero value, with the pod subnet
    /// kubeadm was given.
    pub(crate) const KUBEADM_CONFIG_CONF: &str =
        include_str!("../../testdata/kubeadm-kube-proxy-config.conf");

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
        assert!(
            err.message.contains("conntrack") && err.message.contains("unknown field `tcpTimeout`"),
            "{err}"
        );

        let wrong_type = KUBEADM_CONFIG_CONF.replace("  verbosity: 0", "  verbosity: loud");
        let err = parse_text(&wrong_type).unwrap_err();
        assert!(err.message.contains("logging.verbosity") && err.message.contains("invalid type"), "{err}");

        let bad_duration =
            KUBEADM_CONFIG_CONF.replace("  udpStreamTimeout: 0s", "  udpStreamTimeout: 2 minutes");
        let err = parse_text(&bad_duration).unwrap_err();
        assert!(err.message.starts_with("conntrack.udpStreamTimeout:"), "{err}");

        let bad_address =
            KUBEADM_CONFIG_CONF.replace("healthzBindAddress: \"\"", "healthzBindAddress: localhost");
        assert!(parse_text(&bad_address).unwrap_err().message.starts_with("healthzBindAddress:"));

        let other_kind =
            KUBEADM_CONFIG_CONF.replace("kind: KubeProxyConfiguration", "kind: KubeletConfiguration");
        assert!(parse_text(&other_kind).unwrap_err().message.starts_with("apiVersion/kind:"));
    }
}
