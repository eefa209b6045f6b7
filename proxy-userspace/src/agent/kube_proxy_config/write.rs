//! Settings written back as a KubeProxyConfiguration (`--write-config-to`).

use std::time::Duration;

use super::{
    API_VERSION, ClientConnection, Conntrack, DetectLocal, FileSettings, KIND, KubeProxyConfiguration,
    Logging,
};

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
