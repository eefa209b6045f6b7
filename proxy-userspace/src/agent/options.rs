//! What the agent is told: its configuration ([`AgentConfig`]), the socket-level load balancing and
//! conntrack options, and the flag values kube-proxy's flags share (durations, the node name).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use proxy_common::{
    conntrack::Timeouts,
    maps::{ConfigV4, DEFAULT_HAIRPIN_ADDR},
};

use crate::{
    agent::nodeport::NorthSouthOptions,
    bpf::{self, PinDir},
    coverage,
    k8s::api_watch::{self, KubeOptions},
    model::ModelOptions,
};

pub enum Source {
    /// Manifests on disk, re-read when a file changes (no cluster needed).
    Files(PathBuf),
    /// The API server.
    Cluster(KubeOptions),
}

pub struct AgentConfig {
    pub pins: PinDir,
    pub source: Source,
    pub interfaces: Vec<String>,
    /// How often interfaces (and manifest files) are checked for changes.
    pub poll: Duration,
    /// Changes arriving closer together than this are applied in one sync.
    pub min_sync_period: Duration,
    /// A full resync (re-read the maps, repair any drift) at least this often.
    pub sync_period: Duration,
    pub healthz_bind: Option<SocketAddr>,
    pub metrics_bind: Option<SocketAddr>,
    /// `--bind-address-hard-fail`: a port that cannot be bound stops the agent instead of being
    /// retried.
    pub bind_address_hard_fail: bool,
    pub model: ModelOptions,
    pub conntrack: ConntrackOptions,
    /// `--bpf-lb-map-max`: entries of the services, backends, rev-NAT, names and VIPs maps it creates.
    pub lb_map_max: u32,
    pub north_south: NorthSouthOptions,
    pub socket_lb: SocketLbOptions,
    /// `--lb-algorithm=maglev`: tables for NodePort, ExternalIP and LB frontends.
    pub maglev: Option<crate::sync::MaglevSettings>,
    /// How long the API watches may show no progress before /healthz is 503.
    pub watch: api_watch::WatchOptions,
    /// Taking the pin directory: how long to wait for another agent, a private bpffs allowed.
    pub claim: bpf::ClaimOptions,
}

/// `--socket-lb` and where its programs attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketLbOptions {
    pub mode: SocketLbMode,
    /// The cgroup (v2) whose processes' sockets are translated, with its
    /// descendants: the cgroup2 root on a node.
    pub cgroup: Option<PathBuf>,
    /// `--socket-lb` was given. The default (host-only) gives way on a node
    /// without cgroup2 instead of stopping the agent.
    pub asked: bool,
    /// `--pod-veth-tc`: whether the veths of pods the hooks cover keep the tc programs.
    pub pod_veth_tc: PodVethTc,
}

/// `--pod-veth-tc`: tc programs on the veths of pods the socket hooks cover.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PodVethTc {
    /// With `--socket-lb on`, none on the veths of pods whose every process is in
    /// `--cgroup-root` (their sockets are translated at connect()/sendmsg()); tc everywhere else.
    Auto,
    /// On every pod veth, whatever the socket hooks cover. The default (docs/architecture.md: what
    /// `auto` still leaves to tc, and how it differs from kube-proxy).
    #[default]
    On,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLbMode {
    /// Translate at connect()/sendmsg() for every process in the cgroup.
    On,
    /// Only for processes in the host's network namespace (hostNetwork pods,
    /// node daemons); pods keep the tc path.
    HostOnly,
    /// The tc path translates everything.
    Off,
}

impl SocketLbOptions {
    /// What the agent does: these options, or off when the default mode has no
    /// cgroup2 hierarchy to attach to.
    pub(super) fn effective(&self) -> Result<Self> {
        match (self.mode, &self.cgroup) {
            (SocketLbMode::Off, _) | (_, Some(_)) => Ok(self.clone()),
            (_, None) if self.asked => {
                anyhow::bail!("--socket-lb needs a cgroup2 hierarchy: mount one or pass --cgroup-root")
            }
            (_, None) => {
                tracing::warn!(
                    "no cgroup2 hierarchy: socket-level load balancing off, so the node's own processes \
                     (hostNetwork pods, kubelet) cannot reach cluster IPs; mount cgroup2 or pass --cgroup-root"
                );
                Ok(Self { mode: SocketLbMode::Off, ..self.clone() })
            }
        }
    }

    /// The pods whose veths need no tc program: those the hooks cover, with `--socket-lb on` and
    /// `--pod-veth-tc auto`.
    pub fn coverage(&self) -> coverage::Coverage {
        match (self.mode, self.pod_veth_tc, &self.cgroup) {
            (SocketLbMode::On, PodVethTc::Auto, Some(cgroup)) => coverage::Coverage::of_cgroup(cgroup),
            _ => coverage::Coverage::Nothing,
        }
    }

    pub(super) fn config(&self) -> Result<proxy_common::maps::SocketLbConfigV4> {
        use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF, SocketLbConfigV4};
        let mode = match self.mode {
            SocketLbMode::On => SOCKET_LB_ALL,
            SocketLbMode::HostOnly => SOCKET_LB_HOST_ONLY,
            SocketLbMode::Off => SOCKET_LB_OFF,
        };
        Ok(SocketLbConfigV4 { host_netns_cookie: own_netns_cookie()?, mode, flags: self.datapath_flags() })
    }

    /// SOCKET_LB_CONFIG's flags: whether covered pods' veths may be left bare.
    fn datapath_flags(&self) -> u32 {
        match self.coverage() {
            coverage::Coverage::Nothing => 0,
            _ => proxy_common::maps::SOCKET_LB_BARE_COVERED_VETHS,
        }
    }
}

/// This process's network namespace cookie (SO_NETNS_COOKIE), as
/// bpf_get_netns_cookie() reports it for sockets in the same namespace.
fn own_netns_cookie() -> Result<u64> {
    const SO_NETNS_COOKIE: i32 = 71;
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").context("a socket to read the netns cookie")?;
    crate::agent::sockdiag::socket_cookie_option(&socket, SO_NETNS_COOKIE)
        .context("getsockopt(SO_NETNS_COOKIE)")
}

/// Conntrack timeouts, table size and garbage collection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackOptions {
    pub timeouts: Timeouts,
    /// CONNTRACK_V4 entries (two per flow); only used when this agent loads a
    /// fresh datapath: a pinned map keeps its size.
    pub max: u32,
    /// First interval of the adaptive GC.
    pub gc_interval: Duration,
}

impl Default for ConntrackOptions {
    fn default() -> Self {
        Self {
            timeouts: Timeouts::DEFAULT,
            max: proxy_common::maps::CONNTRACK_V4_CAPACITY,
            gc_interval: Duration::from_secs(30),
        }
    }
}

impl ConntrackOptions {
    /// CONFIG[0] for these options.
    pub fn config(&self) -> ConfigV4 {
        ConfigV4 {
            timeout_tcp_syn_ns: self.timeouts.tcp_syn_ns,
            timeout_tcp_established_ns: self.timeouts.tcp_established_ns,
            timeout_tcp_closing_ns: self.timeouts.tcp_closing_ns,
            timeout_udp_ns: self.timeouts.udp_ns,
            hairpin_addr: DEFAULT_HAIRPIN_ADDR,
            _pad: 0,
        }
    }
}

/// The node name kube-proxy falls back to without `--hostname-override`: the host name, trimmed and
/// lowercased (`nodeutil.GetHostname`).
pub fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_lowercase();
    (!name.is_empty()).then_some(name)
}

/// Go-style durations as kube-proxy's flags take them: `250ms`, `1s`, `1m30s`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest == "0" {
        return Ok(total);
    }
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let value: f64 = rest[..digits].parse().map_err(|_| format!("{text:?}: expected a number"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            unit => return Err(format!("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")),
        };
        total += Duration::from_secs_f64(value * seconds);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn the_default_socket_lb_gives_way_without_cgroup2_an_asked_one_does_not() {
        let defaulted = SocketLbOptions {
            mode: SocketLbMode::HostOnly,
            cgroup: None,
            asked: false,
            pod_veth_tc: PodVethTc::Auto,
        };
        assert_eq!(defaulted.effective().unwrap().mode, SocketLbMode::Off);
        let asked = SocketLbOptions { asked: true, ..defaulted.clone() };
        assert!(asked.effective().is_err(), "--socket-lb host-only without cgroup2 is an error");
        let attached = SocketLbOptions { cgroup: Some("/sys/fs/cgroup".into()), ..defaulted };
        assert_eq!(attached.effective().unwrap(), attached);
    }

    #[test]
    fn pod_veths_lose_tc_only_with_socket_lb_on_and_pod_veth_tc_auto() {
        use coverage::Coverage;
        let cgroup = PathBuf::from("/sys/fs/cgroup/no-such-child");
        let options = |mode, pod_veth_tc| SocketLbOptions {
            mode,
            cgroup: Some(cgroup.clone()),
            asked: true,
            pod_veth_tc,
        };
        assert_eq!(options(SocketLbMode::On, PodVethTc::Auto).coverage(), Coverage::Subtree(cgroup.clone()));
        assert_eq!(options(SocketLbMode::On, PodVethTc::On).coverage(), Coverage::Nothing);
        assert_eq!(options(SocketLbMode::HostOnly, PodVethTc::Auto).coverage(), Coverage::Nothing);
        assert_eq!(options(SocketLbMode::Off, PodVethTc::Auto).coverage(), Coverage::Nothing);
        // The datapath is told only when some veth may be bare.
        let bare = proxy_common::maps::SOCKET_LB_BARE_COVERED_VETHS;
        assert_eq!(options(SocketLbMode::On, PodVethTc::Auto).datapath_flags(), bare);
        assert_eq!(options(SocketLbMode::On, PodVethTc::On).datapath_flags(), 0);
        assert_eq!(options(SocketLbMode::HostOnly, PodVethTc::Auto).datapath_flags(), 0);
        assert_eq!(Coverage::Nothing.covered(&["veth0".into()]).unwrap(), BTreeSet::new());
        assert_eq!(
            Coverage::Everything.covered(&["veth0".into()]).unwrap(),
            BTreeSet::from(["veth0".into()])
        );
    }

    #[test]
    fn durations_like_kube_proxy_flags() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn config_carries_the_timeouts_and_the_hairpin_address() {
        let options = ConntrackOptions {
            timeouts: Timeouts { udp_ns: 5_000_000_000, ..Timeouts::DEFAULT },
            ..Default::default()
        };
        let config = options.config();
        assert_eq!(config.timeout_udp_ns, 5_000_000_000);
        assert_eq!(config.timeout_tcp_established_ns, Timeouts::DEFAULT.tcp_established_ns);
        assert_eq!(config.hairpin_addr, DEFAULT_HAIRPIN_ADDR);
        assert_eq!(Timeouts::from_config(&config), options.timeouts);
        assert_eq!(ConntrackOptions::default().config().timeout_tcp_syn_ns, 60_000_000_000);
    }
}
