use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kproxy::{
    agent::{self, AgentConfig, ConntrackOptions, Source},
    datapath::{self, InterfaceSelector, Maps, PinDir},
    dump, gc,
    model::ModelOptions,
    source::KubeOptions,
};

/// kproxy: a Kubernetes service proxy with an eBPF datapath.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Where programs, maps and links are pinned.
    #[arg(long, global = true, env = "KPROXY_PIN_DIR", default_value = datapath::DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Load the datapath with its debug log on (aya-log; the agent prints the
    /// records). Fixed when the programs are loaded; off costs nothing.
    #[arg(long, global = true)]
    bpf_debug_log: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Load and pin the datapath and attach it to the matching interfaces.
    Load {
        /// Pod-facing interfaces (globs).
        #[arg(long, num_args = 1.., default_values = ["veth*"])]
        interfaces: Vec<String>,
        /// Pin even into a bpffs private to this mount namespace (as under `ip netns exec`),
        /// where the datapath vanishes with the namespace.
        #[arg(long)]
        allow_private_bpffs: bool,
    },
    /// Detach the programs and remove every pin (refused while an agent holds the pin directory).
    Unload {
        /// Unload even while an agent holds the pin directory.
        #[arg(long)]
        force: bool,
    },
    /// Keep the datapath equal to the cluster's Services and EndpointSlices (from
    /// the API server, or from --manifests on disk) until SIGTERM or Ctrl-C.
    Agent(Box<AgentArgs>),
    /// Remove kube-proxy's iptables and nftables rules (KUBE-SERVICES and
    /// friends) after migrating to kproxy. Prints what it would remove unless
    /// --apply is given.
    CleanupKubeProxy {
        /// Remove the rules instead of only listing them.
        #[arg(long)]
        apply: bool,
    },
    /// Operate on the conntrack table.
    Conntrack {
        #[command(subcommand)]
        action: ConntrackAction,
    },
    /// Print a map (or, with `diff`, what differs from the agent's desired state).
    Dump {
        #[arg(value_enum)]
        what: DumpWhat,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        diff: kproxy::diff::DiffArgs,
    },
    /// Follow the NAT of live flows: every step that changed a packet.
    Trace(kproxy::trace::TraceArgs),
    /// Check this node for what breaks a service proxy (exit status 1 on FAIL).
    Doctor(kproxy::doctor::DoctorArgs),
}

#[derive(Subcommand)]
enum ConntrackAction {
    /// Delete every conntrack entry, or those of one Service's flows. Established
    /// TCP connections affected lose their translation (their next packet is
    /// dropped as invalid); UDP flows pick a backend again.
    Flush {
        /// Only the flows of this Service (namespace/name).
        #[arg(long)]
        service: Option<String>,
    },
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Read Services and EndpointSlices from a YAML/JSON file (multi-document
    /// allowed) or a directory of them instead of the API server.
    #[arg(long, conflicts_with_all = ["kubeconfig", "master"])]
    manifests: Option<PathBuf>,
    /// Kubeconfig file (default: in-cluster config, then ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// API server URL; overrides the kubeconfig's.
    #[arg(long)]
    master: Option<String>,
    /// This node's name, for traffic policies Local and node hints; as kube-proxy, the host name
    /// (lowercased) when neither this nor NODE_NAME is set.
    #[arg(long, env = "NODE_NAME")]
    hostname_override: Option<String>,
    /// This node's zone, for zone hints (trafficDistribution PreferClose/PreferSameZone). From the API
    /// server it is read from the Node's topology.kubernetes.io/zone label, which this overrides.
    #[arg(long)]
    node_zone: Option<String>,
    /// Program only Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long)]
    service_proxy_name: Option<String>,
    /// Pod-facing interfaces (globs); interfaces appearing later are attached too.
    #[arg(long, num_args = 1.., default_values = ["veth*"])]
    interfaces: Vec<String>,
    /// How often interfaces (and manifest files) are checked, in milliseconds.
    #[arg(long, default_value_t = 250)]
    poll_ms: u64,
    /// Changes closer together than this are applied in one sync (e.g. 50ms, 1s).
    #[arg(long, default_value = "50ms", value_parser = kproxy::agent::parse_duration)]
    min_sync_period: Duration,
    /// Full resync interval; health turns 503 when a change waits twice as long.
    #[arg(long, default_value = "30s", value_parser = kproxy::agent::parse_duration)]
    sync_period: Duration,
    /// /healthz turns 503 when a watched kind (Services, EndpointSlices) shows no
    /// list, event or bookmark from the API server for this long.
    #[arg(long, default_value = "2m", value_parser = kproxy::agent::parse_duration)]
    api_progress_timeout: Duration,
    /// /healthz and /livez; empty disables health and metrics servers.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: String,
    /// /metrics and /proxyMode.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: String,
    /// Idle timeout of a TCP flow whose handshake is not complete.
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    conntrack_tcp_timeout_syn: Duration,
    /// Idle timeout of an established TCP flow.
    #[arg(long, default_value = "6h", value_parser = kproxy::agent::parse_duration)]
    conntrack_tcp_timeout_established: Duration,
    /// Idle timeout of a TCP flow after a FIN or RST.
    #[arg(long, default_value = "10s", value_parser = kproxy::agent::parse_duration)]
    conntrack_tcp_timeout_close: Duration,
    /// Idle timeout of a UDP flow.
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    conntrack_udp_timeout: Duration,
    /// Conntrack table size in entries (two per flow; the LRU evicts beyond it).
    /// Applies when the agent loads the datapath; a pinned table keeps its size.
    #[arg(long, default_value_t = proxy_common::maps::CONNTRACK_V4_CAPACITY,
          value_parser = clap::value_parser!(u32).range(1..))]
    conntrack_max: u32,
    /// First conntrack garbage collection interval; it then adapts between
    /// 5s and 5m (halved when a run deletes over 25 % or the table is over
    /// 90 % full, grown 1.5x when a run deletes under 5 %).
    #[arg(long, default_value = "30s", value_parser = kproxy::agent::parse_duration)]
    conntrack_gc_interval: Duration,
    /// NodePorts answer on the node addresses inside these prefixes (e.g.
    /// 192.168.0.0/16); none: on every address of the external interfaces.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    nodeport_addresses: Vec<kproxy::model::Cidr4>,
    /// The pod CIDR of the cluster: clients outside it that reach a cluster
    /// IP through an external interface are masqueraded to the node address.
    #[arg(long)]
    cluster_cidr: Option<kproxy::model::Cidr4>,
    /// Interfaces that carry traffic from outside the cluster (NodePorts,
    /// ExternalIPs, LoadBalancer IPs); none: every interface holding a
    /// non-loopback, non-link-local address that is not pod-facing.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    external_interfaces: Vec<String>,
    /// Source ports for flows SNATed to the node address (MIN-MAX).
    #[arg(long, default_value = "61000-65535", value_parser = kproxy::nodeport::parse_port_range)]
    snat_port_range: (u16, u16),
    /// XDP on the external interfaces for NodePort/LB flows to remote backends.
    #[arg(long, value_enum, default_value = "native")]
    xdp: kproxy::datapath::XdpSetting,
    /// Socket-level load balancing: translate connect()/sendmsg() to Services
    /// for the processes of --cgroup-root (on), only for those in the host's
    /// network namespace (host-only: hostNetwork pods, the kubelet and node
    /// daemons reach cluster IPs, which the per-packet tc path on the pods'
    /// interfaces never sees), or leave it all to the tc path (off: the node's
    /// own processes cannot reach cluster IPs). [default: host-only; without a
    /// cgroup2 hierarchy the default runs without socket hooks, with a warning]
    #[arg(long, value_enum)]
    socket_lb: Option<kproxy::agent::SocketLbMode>,
    /// The cgroup (v2) the socket programs attach to; default: the cgroup2
    /// mount (every process of the node).
    #[arg(long)]
    cgroup_root: Option<PathBuf>,
    /// How NodePort, ExternalIP and LoadBalancer frontends pick a backend for
    /// a new flow: at random, or by Maglev consistent hashing of the flow
    /// (every node picks the same backend; a backend change moves few flows).
    #[arg(long, value_enum, default_value = "random")]
    lb_algorithm: LbAlgorithm,
    /// The Maglev hash seed; must be the same on every node.
    #[arg(long, default_value_t = 0x6b70_726f)]
    maglev_seed: u32,
    /// Maglev tables (64 KiB each): one per NodePort/ExternalIP/LB frontend;
    /// those beyond use random selection.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=4096))]
    maglev_tables: u32,
    /// How long to wait for another agent holding the pin directory to stop (one agent per pin
    /// directory; a rolling update starts the new agent while the old one is stopping).
    #[arg(long, default_value = "60s", value_parser = kproxy::agent::parse_duration)]
    lock_timeout: Duration,
    /// Pin even into a bpffs private to this mount namespace (as under `ip netns exec`), where
    /// the datapath vanishes with the namespace: every flow breaks when the agent exits.
    #[arg(long)]
    allow_private_bpffs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LbAlgorithm {
    Random,
    Maglev,
}

impl AgentArgs {
    fn conntrack(&self) -> Result<ConntrackOptions> {
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

#[derive(Clone, Copy, ValueEnum)]
enum DumpWhat {
    Services,
    Backends,
    Conntrack,
    Affinity,
    /// The address translations in effect (from the conntrack entries).
    Nat,
    Stats,
    /// What the agent wants (computed from --manifests or the API server) against what the maps hold.
    Diff,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format, cli.bpf_debug_log);
    datapath::set_bpf_debug_log(cli.bpf_debug_log);
    if let Err(e) = run(cli) {
        eprintln!("kproxy: {e:#}");
        std::process::exit(1);
    }
}

fn init_logging(format: LogFormat, bpf_debug: bool) {
    let default = if bpf_debug { "info,proxy_ebpf=debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPROXY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(cli: Cli) -> Result<()> {
    let pins = PinDir::new(&cli.pin_dir);
    match cli.command {
        Command::Load { interfaces, allow_private_bpffs } => {
            let selector = InterfaceSelector::new(&interfaces)?;
            let options = datapath::ClaimOptions { lock_wait: Duration::ZERO, allow_private_bpffs };
            let _held = datapath::claim(&pins, &options)?;
            if datapath::load(&pins)? {
                println!("loaded and pinned under {}", pins.root().display());
            } else {
                println!(
                    "reloaded the programs under {}; pinned maps and links reused",
                    pins.root().display()
                );
            }
            let report = datapath::attach_matching(&pins, &selector)?;
            for label in &report.attached {
                println!("attached {label}");
            }
            for (label, error) in &report.failed {
                eprintln!("failed to attach {label}: {error}");
            }
            if report.attached.is_empty() && report.already == 0 {
                println!(
                    "no interface matches {interfaces:?} yet; `kproxy agent` attaches to them as they appear"
                );
            }
            if !report.failed.is_empty() {
                anyhow::bail!("{} attachments failed", report.failed.len());
            }
        }
        Command::Unload { force } => {
            let report = datapath::unload_with(&pins, force)?;
            if let Some(holder) = &report.forced_under {
                eprintln!("kproxy: unloading under {holder} (--force)");
            }
            for link in &report.links {
                println!("detached {link}");
            }
            println!("removed {} pins and {}", report.pins, pins.root().display());
        }
        Command::Agent(args) => {
            let args = *args;
            let conntrack = args.conntrack()?;
            let source = match args.manifests {
                Some(path) => Source::Files(path),
                None => Source::Cluster(KubeOptions { kubeconfig: args.kubeconfig, master: args.master }),
            };
            let bind = |flag: &str, value: &str| -> Result<Option<SocketAddr>> {
                if value.is_empty() {
                    return Ok(None);
                }
                value.parse().map(Some).with_context(|| format!("--{flag} {value:?} is not an address:port"))
            };
            let config = AgentConfig {
                pins,
                source,
                interfaces: args.interfaces,
                poll: Duration::from_millis(args.poll_ms),
                min_sync_period: args.min_sync_period,
                sync_period: args.sync_period,
                healthz_bind: bind("healthz-bind-address", &args.healthz_bind_address)?,
                watch: kproxy::source::WatchOptions { progress_timeout: args.api_progress_timeout },
                metrics_bind: bind("metrics-bind-address", &args.metrics_bind_address)?,
                model: ModelOptions {
                    node_name: args.hostname_override.or_else(kproxy::agent::host_name),
                    service_proxy_name: args.service_proxy_name,
                    zone: args.node_zone,
                    ..Default::default()
                },
                conntrack,
                north_south: kproxy::nodeport::NorthSouthOptions {
                    nodeport_addresses: args.nodeport_addresses,
                    cluster_cidr: args.cluster_cidr,
                    external_interfaces: args.external_interfaces,
                    snat_ports: args.snat_port_range,
                    xdp: args.xdp,
                    maglev_seed: args.maglev_seed,
                },
                maglev: (args.lb_algorithm == LbAlgorithm::Maglev).then_some(kproxy::sync::MaglevSettings {
                    seed: args.maglev_seed,
                    tables: args.maglev_tables,
                }),
                claim: datapath::ClaimOptions {
                    lock_wait: args.lock_timeout,
                    allow_private_bpffs: args.allow_private_bpffs,
                },
                socket_lb: kproxy::agent::SocketLbOptions {
                    mode: args.socket_lb.unwrap_or(kproxy::agent::SocketLbMode::HostOnly),
                    cgroup: args.cgroup_root.or_else(kproxy::datapath::cgroup2_mount),
                    asked: args.socket_lb.is_some(),
                },
            };
            agent::run(config)?;
        }
        Command::CleanupKubeProxy { apply } => {
            print!("{}", kproxy::cleanup::run(apply)?);
        }
        Command::Conntrack { action: ConntrackAction::Flush { service } } => {
            let mut maps = Maps::from_pins(&pins)?;
            let deleted = gc::flush(&mut maps, service.as_deref())?;
            match service {
                Some(service) => println!("deleted {deleted} conntrack entries of Service {service}"),
                None => println!("deleted {deleted} conntrack entries"),
            }
        }
        Command::Trace(args) => kproxy::trace::run(&pins, &args)?,
        Command::Doctor(args) => {
            let code = kproxy::doctor::run(&pins, &args)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Dump { what: DumpWhat::Diff, json, diff } => {
            let maps = Maps::from_pins(&pins)?;
            let (text, differs) = kproxy::diff::run(&maps, &diff, json)?;
            print!("{text}");
            if differs {
                std::process::exit(1);
            }
        }
        Command::Dump { what, json, .. } => {
            let maps = Maps::from_pins(&pins)?;
            let text = match what {
                DumpWhat::Services => render(dump::services(&maps)?, json, dump::services_table)?,
                DumpWhat::Backends => render(dump::backends(&maps)?, json, dump::backends_table)?,
                DumpWhat::Conntrack => render(dump::conntrack(&maps)?, json, dump::conntrack_table)?,
                DumpWhat::Affinity => render(dump::affinity(&maps)?, json, dump::affinity_table)?,
                DumpWhat::Nat => render(dump::nat(&maps)?, json, dump::nat_table)?,
                DumpWhat::Stats => render(dump::stats(&maps)?, json, dump::stats_table)?,
                DumpWhat::Diff => unreachable!("handled above"),
            };
            print!("{text}");
        }
    }
    Ok(())
}

fn render<T: serde::Serialize>(rows: Vec<T>, json: bool, table: fn(&[T]) -> String) -> Result<String> {
    if json { Ok(serde_json::to_string_pretty(&rows)? + "\n") } else { Ok(table(&rows)) }
}
