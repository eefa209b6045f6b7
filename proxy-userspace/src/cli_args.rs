//! `kproxy agent`'s flags (kube-proxy's, where they exist), their parsers, and how a kube-proxy
//! configuration file (`--config`) fills in what the command line leaves unset.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{ArgMatches, ValueEnum, parser::ValueSource};
use kproxy::{
    agent::ConntrackOptions,
    agent::kube_proxy_config::FileSettings,
    agent::nodeport::{ClusterCidrs, NodePortAddresses},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
pub(crate) struct AgentArgs {
    /// kube-proxy's configuration file (kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration,
    /// as kubeadm's ConfigMap kube-system/kube-proxy holds it in config.conf): the fields with a
    /// kproxy meaning set the flags they name, fields without one are listed in a warning. A flag
    /// given on the command line (or its environment variable) wins over the file.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Write the effective configuration (the file's and the flags' settings that kproxy honours,
    /// as a KubeProxyConfiguration) to FILE and exit.
    #[arg(long, value_name = "FILE")]
    pub(crate) write_config_to: Option<PathBuf>,
    /// Read Services and EndpointSlices from a YAML/JSON file (multi-document
    /// allowed) or a directory of them instead of the API server.
    #[arg(long, conflicts_with_all = ["kubeconfig", "master"])]
    pub(crate) manifests: Option<PathBuf>,
    /// Kubeconfig file (default: in-cluster config, then ~/.kube/config).
    #[arg(long)]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// API server URL; overrides the kubeconfig's and --api-server-host.
    #[arg(long)]
    pub(crate) master: Option<String>,
    /// The API server itself (a name or address its certificate holds, e.g. kubeadm's
    /// controlPlaneEndpoint), for nodes where nothing translates the `kubernetes` Service's
    /// ClusterIP yet (no kube-proxy): the agent connects to https://HOST:PORT with the pod's
    /// service-account token and CA (or the kubeconfig's credentials). Default: the environment's
    /// KPROXY_API_SERVER_HOST (the DaemonSet sets it from ConfigMap kproxy-api-endpoint), else the
    /// kubeconfig's server, else in-cluster KUBERNETES_SERVICE_HOST, the ClusterIP.
    #[arg(long, value_name = "HOST", conflicts_with = "manifests")]
    pub(crate) api_server_host: Option<String>,
    /// The port of --api-server-host [default: 6443; with KPROXY_API_SERVER_HOST,
    /// KPROXY_API_SERVER_PORT].
    #[arg(long, value_name = "PORT", conflicts_with = "manifests")]
    pub(crate) api_server_port: Option<u16>,
    /// This node's name, for traffic policies Local and node hints; as kube-proxy, the host name
    /// (lowercased) when neither this nor NODE_NAME is set.
    #[arg(long, env = "NODE_NAME")]
    pub(crate) hostname_override: Option<String>,
    /// This node's zone, for zone hints (trafficDistribution PreferClose/PreferSameZone). From the API
    /// server it is read from the Node's topology.kubernetes.io/zone label, which this overrides.
    #[arg(long)]
    pub(crate) node_zone: Option<String>,
    /// Program only Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long)]
    pub(crate) service_proxy_name: Option<String>,
    /// Pod-facing interfaces (globs); interfaces appearing later are attached too.
    #[arg(long, num_args = 1.., default_values = ["veth*"])]
    pub(crate) interfaces: Vec<String>,
    /// How often interfaces (and manifest files) are checked, in milliseconds.
    #[arg(long, default_value_t = 250)]
    pub(crate) poll_ms: u64,
    /// Changes closer together than this are applied in one sync (e.g. 50ms, 1s); a change after
    /// a quiet period is applied at once.
    #[arg(long, default_value = "1s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) min_sync_period: Duration,
    /// Full resync interval; health turns 503 when a change waits twice as long.
    #[arg(long, default_value = "30s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) sync_period: Duration,
    /// /healthz turns 503 when a watched kind (Services, EndpointSlices) shows no
    /// list, event or bookmark from the API server for this long.
    #[arg(long, default_value = "2m", value_parser = kproxy::agent::parse_duration)]
    pub(crate) api_progress_timeout: Duration,
    /// /healthz and /livez; empty disables them.
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub(crate) healthz_bind_address: String,
    /// /metrics and /proxyMode; empty disables them.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub(crate) metrics_bind_address: String,
    /// Deprecated (kube-proxy's too): the port of --healthz-bind-address; 0 disables /healthz.
    #[arg(long, value_name = "PORT")]
    pub(crate) healthz_port: Option<u16>,
    /// Deprecated (kube-proxy's too): the port of --metrics-bind-address; 0 disables /metrics.
    #[arg(long, value_name = "PORT")]
    pub(crate) metrics_port: Option<u16>,
    /// Exit when a health or metrics port cannot be bound, instead of retrying every 5 s (as while
    /// kube-proxy still holds it during a migration).
    #[arg(long, num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set, value_name = "BOOL")]
    pub(crate) bind_address_hard_fail: bool,
    /// Idle timeout of a TCP flow whose handshake is not complete.
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) conntrack_tcp_timeout_syn: Duration,
    /// Idle timeout of an established TCP flow.
    #[arg(long, default_value = "6h", value_parser = kproxy::agent::parse_duration)]
    pub(crate) conntrack_tcp_timeout_established: Duration,
    /// Idle timeout of a TCP flow after a FIN or RST.
    #[arg(long, default_value = "10s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) conntrack_tcp_timeout_close: Duration,
    /// Idle timeout of a UDP flow.
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) conntrack_udp_timeout: Duration,
    /// Conntrack table size in entries (two per flow; the LRU evicts beyond it).
    /// Applies when the agent loads the datapath; a pinned table keeps its size.
    #[arg(long, default_value_t = proxy_common::maps::CONNTRACK_V4_CAPACITY,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) conntrack_max: u32,
    /// Entries of each load-balancing map (Cilium's flag): the services maps (one entry per
    /// frontend and one per backend slot), backends, rev-NAT ids (frontends: a Service port's
    /// cluster IP, each of its NodePort addresses, external and LB IPs) and their names, VIPs.
    /// Applies when the agent loads the datapath; pinned maps keep their size.
    #[arg(long, default_value_t = proxy_common::maps::SERVICES_V4_CAPACITY,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) bpf_lb_map_max: u32,
    /// First conntrack garbage collection interval; it then adapts between
    /// 5s and 5m (halved when a run deletes over 25 % or the table is over
    /// 90 % full, grown 1.5x when a run deletes under 5 %).
    #[arg(long, default_value = "30s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) conntrack_gc_interval: Duration,
    /// NodePorts answer on the node addresses inside these prefixes (e.g.
    /// 192.168.0.0/16), or with `primary` on the node's primary address only (its Node object's
    /// InternalIP; with --manifests, the address of the interface holding the default route);
    /// none: on every address of the external interfaces.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "CIDR|primary")]
    pub(crate) nodeport_addresses: Vec<String>,
    /// The pod CIDR of the cluster: clients outside it that reach a cluster
    /// IP through an external interface are masqueraded to the node address.
    /// A dual-stack pair (10.244.0.0/16,fd00:10:244::/56) gives each family its
    /// own. Without one for a family no client of it is masqueraded for being
    /// outside (kube-proxy's local-traffic detector then writes no such rule).
    #[arg(long)]
    pub(crate) cluster_cidr: Option<String>,
    /// Service IP ranges (CIDR[,CIDR]): a packet to an address inside one that is no Service's
    /// cluster IP is dropped on the node, never leaving it (a connect()/sendmsg() of the node's own
    /// fails with EPERM), as kube-proxy's nftables mode drops it. Added to the ranges of the cluster's
    /// ServiceCIDR objects (networking.k8s.io/v1), or of ServiceCIDR manifests with --manifests;
    /// kproxy-specific: kube-proxy has no such flag and reads only the objects. IPv6 ranges are
    /// ignored with a warning. None: nothing is dropped until a ServiceCIDR is seen.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "CIDR")]
    pub(crate) service_cidr: Vec<String>,
    /// Interfaces that carry traffic from outside the cluster (NodePorts,
    /// ExternalIPs, LoadBalancer IPs); none: every interface holding a
    /// non-loopback, non-link-local address that is not pod-facing.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub(crate) external_interfaces: Vec<String>,
    /// Source ports for flows SNATed to the node address (MIN-MAX).
    #[arg(long, default_value = "61000-65535", value_parser = kproxy::agent::nodeport::parse_port_range)]
    pub(crate) snat_port_range: (u16, u16),
    /// XDP on the external interfaces for NodePort/LB flows to remote backends.
    #[arg(long, value_enum, default_value = "native")]
    pub(crate) xdp: kproxy::bpf::XdpSetting,
    /// Socket-level load balancing: translate connect()/sendmsg() to Services
    /// for the processes of --cgroup-root (on), only for those in the host's
    /// network namespace (host-only: hostNetwork pods, the kubelet and node
    /// daemons reach cluster IPs, which the per-packet tc path on the pods'
    /// interfaces never sees), or leave it all to the tc path (off: the node's
    /// own processes cannot reach cluster IPs). [default: host-only; without a
    /// cgroup2 hierarchy the default runs without socket hooks, with a warning]
    #[arg(long, value_enum)]
    pub(crate) socket_lb: Option<kproxy::agent::SocketLbMode>,
    /// The cgroup (v2) the socket programs attach to; default: the cgroup2
    /// mount (every process of the node).
    #[arg(long)]
    pub(crate) cgroup_root: Option<PathBuf>,
    /// tc programs on pod veths: auto leaves none on the veths of pods the
    /// socket hooks cover (with --socket-lb on: pods whose every process is in
    /// --cgroup-root; all of them when it is the cgroup2 root), so their
    /// east–west traffic crosses no per-packet program; on keeps them on every
    /// pod veth. External interfaces and uncovered pods always keep tc. on by
    /// default: without a program on the backend's veth, a client outside the
    /// cluster reaching a cluster IP (masqueraded to the node's address) gets
    /// no answer from a local backend.
    #[arg(long, value_enum, default_value = "on")]
    pub(crate) pod_veth_tc: kproxy::agent::PodVethTc,
    /// How NodePort, ExternalIP and LoadBalancer frontends pick a backend for
    /// a new flow: at random, or by Maglev consistent hashing of the flow
    /// (every node picks the same backend; a backend change moves few flows).
    #[arg(long, value_enum, default_value = "random")]
    pub(crate) lb_algorithm: LbAlgorithm,
    /// The Maglev hash seed; must be the same on every node.
    #[arg(long, default_value_t = 0x6b70_726f)]
    pub(crate) maglev_seed: u32,
    /// Maglev tables (64 KiB each): one per NodePort/ExternalIP/LB frontend;
    /// those beyond use random selection.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) maglev_tables: u32,
    /// How long to wait for another agent holding the pin directory to stop (one agent per pin
    /// directory; a rolling update starts the new agent while the old one is stopping).
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    pub(crate) lock_timeout: Duration,
    /// Pin even into a bpffs private to this mount namespace (as under `ip netns exec`), where
    /// the datapath vanishes with the namespace: every flow breaks when the agent exits.
    #[arg(long)]
    pub(crate) allow_private_bpffs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LbAlgorithm {
    Random,
    Maglev,
}

impl AgentArgs {
    pub(crate) fn conntrack(&self) -> Result<ConntrackOptions> {
        let ns = |flag: &str, d: Duration| -> Result<u64> {
            let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            if ns == 0 {
                anyhow::bail!("--{flag} must be above zero");
            }
            Ok(ns)
        };
        if self.conntrack_gc_interval.is_zero() {
            anyhow::bail!("--conntrack-gc-interval must be above zero");
        }
        Ok(ConntrackOptions {
            timeouts: proxy_common::conntrack::Timeouts {
                tcp_syn_ns: ns("conntrack-tcp-timeout-syn", self.conntrack_tcp_timeout_syn)?,
                tcp_established_ns: ns(
                    "conntrack-tcp-timeout-established",
                    self.conntrack_tcp_timeout_established,
                )?,
                tcp_closing_ns: ns("conntrack-tcp-timeout-close", self.conntrack_tcp_timeout_close)?,
                udp_ns: ns("conntrack-udp-timeout", self.conntrack_udp_timeout)?,
            },
            max: self.conntrack_max,
            gc_interval: self.conntrack_gc_interval,
        })
    }
}

/// `--service-cidr`'s ranges, of both families.
pub(crate) fn service_cidrs(args: &AgentArgs) -> Result<Vec<kproxy::net::Cidr>> {
    kproxy::model::service_cidrs::parse_flag(&args.service_cidr)
        .map_err(|e| anyhow::anyhow!("--service-cidr {e}"))
}

pub(crate) fn cluster_cidrs(args: &AgentArgs) -> Result<ClusterCidrs> {
    let text = args.cluster_cidr.as_deref().unwrap_or_default();
    ClusterCidrs::parse(text).map_err(|e| anyhow::anyhow!("--cluster-cidr {e}"))
}

/// Whether the operator set `id` (on the command line or through its environment variable):
/// such a setting wins over the configuration file.
pub(crate) fn given(matches: &ArgMatches, id: &str) -> bool {
    // `value_source` panics on an id its level does not define (a global's is defined at both).
    matches.ids().any(|known| known.as_str() == id)
        && matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable))
}

/// `address` with its port set to `port` (kube-proxy's deprecated port flags); 0 disables the
/// server.
pub(crate) fn with_port(address: &str, port: u16) -> Result<String, String> {
    if port == 0 {
        return Ok(String::new());
    }
    let ip = match address.parse::<SocketAddr>() {
        Ok(addr) => addr.ip(),
        Err(_) => {
            address.parse::<std::net::IpAddr>().map_err(|_| format!("{address:?} is not an address"))?
        }
    };
    Ok(SocketAddr::new(ip, port).to_string())
}

/// Lays the file's settings under the flags: each one applies unless its flag was `given`.
pub(crate) fn merge_file(
    args: &mut AgentArgs,
    log_format: &mut LogFormat,
    verbosity: &mut u32,
    file: &FileSettings,
    given: &dyn Fn(&str) -> bool,
) {
    fn set<T: Clone>(given: &dyn Fn(&str) -> bool, id: &str, target: &mut T, value: Option<&T>) {
        if let Some(value) = value
            && !given(id)
        {
            *target = value.clone();
        }
    }
    // The file's kubeconfig is for the API server; --manifests and --master do without it.
    if !given("manifests") && !given("master") {
        set(
            given,
            "kubeconfig",
            &mut args.kubeconfig,
            file.kubeconfig.as_ref().map(|k| Some(PathBuf::from(k))).as_ref(),
        );
    }
    set(
        given,
        "hostname_override",
        &mut args.hostname_override,
        file.hostname_override.clone().map(Some).as_ref(),
    );
    set(given, "healthz_bind_address", &mut args.healthz_bind_address, file.healthz_bind_address.as_ref());
    set(given, "metrics_bind_address", &mut args.metrics_bind_address, file.metrics_bind_address.as_ref());
    set(
        given,
        "bind_address_hard_fail",
        &mut args.bind_address_hard_fail,
        file.bind_address_hard_fail.as_ref(),
    );
    let cidrs = (!file.cluster_cidrs.is_empty()).then(|| Some(file.cluster_cidrs.join(",")));
    set(given, "cluster_cidr", &mut args.cluster_cidr, cidrs.as_ref());
    set(given, "interfaces", &mut args.interfaces, file.interfaces.clone().map(|glob| vec![glob]).as_ref());
    let nodeport = (!file.nodeport_addresses.is_empty()).then(|| file.nodeport_addresses.clone());
    set(given, "nodeport_addresses", &mut args.nodeport_addresses, nodeport.as_ref());
    set(given, "min_sync_period", &mut args.min_sync_period, file.min_sync_period.as_ref());
    set(given, "sync_period", &mut args.sync_period, file.sync_period.as_ref());
    set(
        given,
        "conntrack_tcp_timeout_established",
        &mut args.conntrack_tcp_timeout_established,
        file.conntrack_tcp_timeout_established.as_ref(),
    );
    set(given, "conntrack_udp_timeout", &mut args.conntrack_udp_timeout, file.conntrack_udp_timeout.as_ref());
    set(given, "conntrack_max", &mut args.conntrack_max, file.conntrack_max.as_ref());
    let format =
        file.log_format.as_deref().map(|f| if f == "json" { LogFormat::Json } else { LogFormat::Text });
    set(given, "log_format", log_format, format.as_ref());
    set(given, "verbosity", verbosity, file.verbosity.as_ref());
}

/// What `--write-config-to` writes: every setting kproxy takes from a KubeProxyConfiguration,
/// at its effective value.
pub(crate) fn effective_settings(
    args: &AgentArgs,
    log_format: LogFormat,
    verbosity: u32,
) -> Result<FileSettings> {
    let cidrs = cluster_cidrs(args)?;
    let nodeport = NodePortAddresses::parse(&args.nodeport_addresses).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(FileSettings {
        kubeconfig: args.kubeconfig.as_ref().map(|k| k.display().to_string()),
        hostname_override: args.hostname_override.clone(),
        healthz_bind_address: Some(args.healthz_bind_address.clone()),
        metrics_bind_address: Some(args.metrics_bind_address.clone()),
        bind_address_hard_fail: Some(args.bind_address_hard_fail),
        cluster_cidrs: cidrs
            .to_config_string()
            .split(',')
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect(),
        interfaces: Some(args.interfaces.join(" ")),
        nodeport_addresses: nodeport.to_strings(),
        min_sync_period: Some(args.min_sync_period),
        sync_period: Some(args.sync_period),
        conntrack_tcp_timeout_established: Some(args.conntrack_tcp_timeout_established),
        conntrack_udp_timeout: Some(args.conntrack_udp_timeout),
        conntrack_max: Some(args.conntrack_max),
        log_format: Some(if log_format == LogFormat::Json { "json" } else { "text" }.to_owned()),
        verbosity: Some(verbosity),
        ignored: Vec::new(),
    })
}
