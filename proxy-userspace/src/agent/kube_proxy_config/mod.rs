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
//!
//! Files: this one (the settings and the calls), `file` (the v1alpha1 type as written), `settings`
//! (the file → what it means for kproxy), `write` (settings → a file again).

mod file;
mod settings;
#[cfg(test)]
mod tests;
mod write;

use std::{path::Path, time::Duration};

pub use file::{ClientConnection, Conntrack, DetectLocal, KubeProxyConfiguration, Logging, ModeSection};
pub use write::{go_duration, to_yaml};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

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
    settings::settings(&config, cpus).map_err(error)
}
