use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::{
    ArgMatches, CommandFactory as _, FromArgMatches as _, Parser, Subcommand, ValueEnum, parser::ValueSource,
};
use kproxy::{
    agent::kube_proxy_config::{self, FileSettings},
    agent::nodeport::{ClusterCidrs, NodePortAddresses},
    agent::{self, AgentConfig, ConntrackOptions, Source},
    bpf::{self, InterfaceSelector, Maps, PinDir},
    cmd::{conntrack, dump},
    k8s::api_watch::KubeOptions,
    model::ModelOptions,
};

/// `kproxy --version`: the release and the commit it was built from.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("KPROXY_GIT_COMMIT"), ")");

/// kproxy: a Kubernetes service proxy with an eBPF datapath.
#[derive(Parser)]
#[command(name = "kproxy", version = VERSION, about)]
struct Cli {
    /// Where programs, maps and links are pinned.
    #[arg(long, global = true, env = "KPROXY_PIN_DIR", default_value = bpf::DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log verbosity, as kube-proxy's -v: below 4 info, 4 and 5 debug, 6 and above trace.
    /// KPROXY_LOG, a tracing filter (e.g. `info,kproxy::k8s::api_watch=debug`), overrides it.
    #[arg(short = 'v', long = "v", global = true, value_name = "N", default_value_t = 0)]
    verbosity: u32,
    /// Load the datapath with its debug log on (aya-log; the agent prints the
    /// records). Fixed when the programs are loaded; off costs nothing.
    #[arg(long, global = true)]
    bpf_debug_log: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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
        diff: kproxy::cmd::diff::DiffArgs,
    },
    /// Follow the NAT of live flows: every step that changed a packet.
    Trace(kproxy::cmd::trace::TraceArgs),
    /// Check this node for what breaks a service proxy (exit status 1 on FAIL).
    Doctor(kproxy::cmd::doctor::DoctorArgs),
    /// Print a shell completion script (e.g. `kproxy completion bash > /etc/bash_completion.d/kproxy`).
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
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
    /// kube-proxy's configuration file (kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration,
    /// as kubeadm's ConfigMap kube-system/kube-proxy holds it in config.conf): the fields with a
    /// kproxy meaning set the flags they name, fields without one are listed in a warning. A flag
    /// given on the command line (or its environment variable) wins over the file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Write the effective configuration (the file's and the flags' settings that kproxy honours,
    /// as a KubeProxyConfiguration) to FILE and exit.
    #[arg(long, value_name = "FILE")]
    write_config_to: Option<PathBuf>,
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
    /// Changes closer together than this are applied in one sync (e.g. 50ms, 1s); a change after
    /// a quiet period is applied at once.
    #[arg(long, default_value = "1s", value_parser = kproxy::agent::parse_duration)]
    min_sync_period: Duration,
    /// Full resync interval; health turns 503 when a change waits twice as long.
    #[arg(long, default_value = "30s", value_parser = kproxy::agent::parse_duration)]
    sync_period: Duration,
    /// /healthz turns 503 when a watched kind (Services, EndpointSlices) shows no
    /// list, event or bookmark from the API server for this long.
    #[arg(long, default_value = "2m", value_parser = kproxy::agent::parse_duration)]
    api_progress_timeout: Duration,
    /// /healthz and /livez; empty disables them.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: String,
    /// /metrics and /proxyMode; empty disables them.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: String,
    /// Deprecated (kube-proxy's too): the port of --healthz-bind-address; 0 disables /healthz.
    #[arg(long, value_name = "PORT")]
    healthz_port: Option<u16>,
    /// Deprecated (kube-proxy's too): the port of --metrics-bind-address; 0 disables /metrics.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// Exit when a health or metrics port cannot be bound, instead of retrying every 5 s (as while
    /// kube-proxy still holds it during a migration).
    #[arg(long, num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set, value_name = "BOOL")]
    bind_address_hard_fail: bool,
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
    /// 192.168.0.0/16), or with `primary` on the node's primary address only (its Node object's
    /// InternalIP; with --manifests, the address of the interface holding the default route);
    /// none: on every address of the external interfaces.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "CIDR|primary")]
    nodeport_addresses: Vec<String>,
    /// The pod CIDR of the cluster: clients outside it that reach a cluster
    /// IP through an external interface are masqueraded to the node address.
    /// A dual-stack pair (10.244.0.0/16,fd00:10:244::/56) is accepted; its IPv6
    /// part is not served yet.
    #[arg(long)]
    cluster_cidr: Option<String>,
    /// Interfaces that carry traffic from outside the cluster (NodePorts,
    /// ExternalIPs, LoadBalancer IPs); none: every interface holding a
    /// non-loopback, non-link-local address that is not pod-facing.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    external_interfaces: Vec<String>,
    /// Source ports for flows SNATed to the node address (MIN-MAX).
    #[arg(long, default_value = "61000-65535", value_parser = kproxy::agent::nodeport::parse_port_range)]
    snat_port_range: (u16, u16),
    /// XDP on the external interfaces for NodePort/LB flows to remote backends.
    #[arg(long, value_enum, default_value = "native")]
    xdp: kproxy::bpf::XdpSetting,
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
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Command::Completion { shell } = cli.command {
        clap_complete::generate(shell, &mut Cli::command(), "kproxy", &mut std::io::stdout());
        return;
    }
    let notes = match prepare_agent(&mut cli, &matches) {
        Ok(notes) => notes,
        Err(e) => {
            eprintln!("kproxy: {e:#}");
            std::process::exit(1);
        }
    };
    init_logging(cli.log_format, cli.verbosity, cli.bpf_debug_log);
    bpf::set_bpf_debug_log(cli.bpf_debug_log);
    if let Command::Agent(args) = &cli.command {
        log_start(args);
    }
    for note in notes {
        tracing::warn!("{note}");
    }
    if let Err(e) = run(cli) {
        eprintln!("kproxy: {e:#}");
        std::process::exit(1);
    }
}

/// The agent's first log line: what runs, and how.
fn log_start(args: &AgentArgs) {
    let name = |value: Option<clap::builder::PossibleValue>| value.map(|v| v.get_name().to_owned());
    let source = match (&args.manifests, &args.kubeconfig, &args.master) {
        (Some(path), ..) => format!("manifests {}", path.display()),
        (None, Some(kubeconfig), master) => format!(
            "API server (kubeconfig {}{})",
            kubeconfig.display(),
            master.as_deref().map(|m| format!(", --master {m}")).unwrap_or_default()
        ),
        (None, None, Some(master)) => format!("API server {master}"),
        (None, None, None) => "API server (in-cluster config, else ~/.kube/config)".to_owned(),
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = env!("KPROXY_GIT_COMMIT"),
        datapath = "tc (TCX links)",
        xdp = name(args.xdp.to_possible_value()),
        socket_lb =
            args.socket_lb.and_then(|m| name(m.to_possible_value())).unwrap_or("host-only (default)".into()),
        source,
        "kproxy agent starting"
    );
}

/// `-v N` as a tracing filter (kube-proxy's klog levels: 0-3 info, 4-5 debug, 6 and up trace).
fn verbosity_filter(verbosity: u32) -> &'static str {
    match verbosity {
        0..=3 => "info",
        4..=5 => "debug",
        _ => "trace",
    }
}

fn init_logging(format: LogFormat, verbosity: u32, bpf_debug: bool) {
    let level = verbosity_filter(verbosity);
    let default =
        if bpf_debug && level == "info" { format!("{level},proxy_ebpf=debug") } else { level.to_owned() };
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
            let options = bpf::ClaimOptions { lock_wait: Duration::ZERO, allow_private_bpffs };
            let _held = bpf::claim(&pins, &options)?;
            if bpf::load(&pins)? {
                println!("loaded and pinned under {}", pins.root().display());
            } else {
                println!(
                    "reloaded the programs under {}; pinned maps and links reused",
                    pins.root().display()
                );
            }
            let report = bpf::attach_matching(&pins, &selector)?;
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
            let report = bpf::unload_with(&pins, force)?;
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
            let nodeport_addresses = NodePortAddresses::parse(&args.nodeport_addresses)
                .map_err(|e| anyhow::anyhow!("--nodeport-addresses {e}"))?;
            let cluster_cidrs = cluster_cidrs(&args)?;
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
                watch: kproxy::k8s::api_watch::WatchOptions { progress_timeout: args.api_progress_timeout },
                metrics_bind: bind("metrics-bind-address", &args.metrics_bind_address)?,
                bind_address_hard_fail: args.bind_address_hard_fail,
                model: ModelOptions {
                    // kube-proxy's GetHostname: trimmed and lowercased.
                    node_name: args
                        .hostname_override
                        .map(|name| name.trim().to_lowercase())
                        .filter(|name| !name.is_empty())
                        .or_else(kproxy::agent::host_name),
                    service_proxy_name: args.service_proxy_name,
                    zone: args.node_zone,
                    ..Default::default()
                },
                conntrack,
                north_south: kproxy::agent::nodeport::NorthSouthOptions {
                    nodeport_addresses,
                    cluster_cidr: cluster_cidrs.ipv4,
                    external_interfaces: args.external_interfaces,
                    snat_ports: args.snat_port_range,
                    xdp: args.xdp,
                    maglev_seed: args.maglev_seed,
                },
                maglev: (args.lb_algorithm == LbAlgorithm::Maglev).then_some(kproxy::sync::MaglevSettings {
                    seed: args.maglev_seed,
                    tables: args.maglev_tables,
                }),
                claim: bpf::ClaimOptions {
                    lock_wait: args.lock_timeout,
                    allow_private_bpffs: args.allow_private_bpffs,
                },
                socket_lb: kproxy::agent::SocketLbOptions {
                    mode: args.socket_lb.unwrap_or(kproxy::agent::SocketLbMode::HostOnly),
                    cgroup: args.cgroup_root.or_else(kproxy::bpf::cgroup2_mount),
                    asked: args.socket_lb.is_some(),
                },
            };
            agent::run(config)?;
        }
        Command::CleanupKubeProxy { apply } => {
            print!("{}", kproxy::cmd::cleanup::run(apply)?);
        }
        Command::Conntrack { action: ConntrackAction::Flush { service } } => {
            let mut maps = Maps::from_pins(&pins)?;
            let deleted = conntrack::flush(&mut maps, service.as_deref())?;
            match service {
                Some(service) => println!("deleted {deleted} conntrack entries of Service {service}"),
                None => println!("deleted {deleted} conntrack entries"),
            }
        }
        Command::Completion { .. } => unreachable!("handled in main"),
        Command::Trace(args) => kproxy::cmd::trace::run(&pins, &args)?,
        Command::Doctor(args) => {
            let code = kproxy::cmd::doctor::run(&pins, &args)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Dump { what: DumpWhat::Diff, json, diff } => {
            let maps = Maps::from_pins(&pins)?;
            let (text, differs) = kproxy::cmd::diff::run(&maps, &diff, json)?;
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

fn cluster_cidrs(args: &AgentArgs) -> Result<ClusterCidrs> {
    let text = args.cluster_cidr.as_deref().unwrap_or_default();
    ClusterCidrs::parse(text).map_err(|e| anyhow::anyhow!("--cluster-cidr {e}"))
}

/// Whether the operator set `id` (on the command line or through its environment variable):
/// such a setting wins over the configuration file.
fn given(matches: &ArgMatches, id: &str) -> bool {
    // `value_source` panics on an id its level does not define (a global's is defined at both).
    matches.ids().any(|known| known.as_str() == id)
        && matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable))
}

/// For `kproxy agent`: reads `--config` under the flags, applies the deprecated port flags and,
/// with `--write-config-to`, writes the effective configuration and exits. Returns the warnings
/// to log once logging is up (fields the file sets that kproxy ignores, in one line; an IPv6
/// cluster CIDR; deprecated flags).
fn prepare_agent(cli: &mut Cli, matches: &ArgMatches) -> Result<Vec<String>> {
    let Command::Agent(args) = &mut cli.command else { return Ok(Vec::new()) };
    let agent_matches = matches.subcommand_matches("agent").expect("the agent subcommand");
    let mut notes = Vec::new();
    if let Some(path) = args.config.clone() {
        let file = kube_proxy_config::read(&path)?;
        let given = |id: &str| given(agent_matches, id) || given(matches, id);
        merge_file(args, &mut cli.log_format, &mut cli.verbosity, &file, &given);
        if !file.ignored.is_empty() {
            notes.push(format!(
                "{}: kproxy does not use these KubeProxyConfiguration fields: {}",
                path.display(),
                file.ignored.join(", ")
            ));
        }
    }
    for (flag, port, address) in [
        ("--healthz-port", args.healthz_port, &mut args.healthz_bind_address),
        ("--metrics-port", args.metrics_port, &mut args.metrics_bind_address),
    ] {
        let Some(port) = port else { continue };
        let target =
            if flag == "--healthz-port" { "--healthz-bind-address" } else { "--metrics-bind-address" };
        notes.push(format!("{flag} is deprecated (as in kube-proxy): use {target}"));
        *address = with_port(address, port).map_err(|e| anyhow::anyhow!("{flag} {port}: {e}"))?;
    }
    let cidrs = cluster_cidrs(args)?;
    if let Some(ipv6) = &cidrs.ipv6 {
        notes.push(format!(
            "--cluster-cidr: IPv6 is not served yet, so {ipv6} is not used{}",
            cidrs.ipv4.map(|v4| format!("; {v4} is")).unwrap_or_default()
        ));
    }
    NodePortAddresses::parse(&args.nodeport_addresses)
        .map_err(|e| anyhow::anyhow!("--nodeport-addresses {e}"))?;
    if let Some(path) = &args.write_config_to {
        let settings = effective_settings(args, cli.log_format, cli.verbosity)?;
        std::fs::write(path, kube_proxy_config::to_yaml(&settings))
            .with_context(|| format!("--write-config-to {}", path.display()))?;
        std::process::exit(0);
    }
    Ok(notes)
}

/// `address` with its port set to `port` (kube-proxy's deprecated port flags); 0 disables the
/// server.
fn with_port(address: &str, port: u16) -> Result<String, String> {
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
fn merge_file(
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
fn effective_settings(args: &AgentArgs, log_format: LogFormat, verbosity: u32) -> Result<FileSettings> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `kproxy agent ARGS`, lays `file` under it as main does, and returns the effective
    /// configuration as --write-config-to writes it.
    fn effective(args: &[&str], file: Option<&FileSettings>) -> FileSettings {
        let argv = ["kproxy", "agent"].iter().chain(args).copied();
        let matches = Cli::command().try_get_matches_from(argv).unwrap();
        let mut cli = Cli::from_arg_matches(&matches).unwrap();
        let agent_matches = matches.subcommand_matches("agent").unwrap();
        let Command::Agent(agent) = &mut cli.command else { unreachable!() };
        if let Some(file) = file {
            let given = |id: &str| given(agent_matches, id) || given(&matches, id);
            merge_file(agent, &mut cli.log_format, &mut cli.verbosity, file, &given);
        }
        effective_settings(agent, cli.log_format, cli.verbosity).unwrap()
    }

    fn kubeadm_file() -> FileSettings {
        FileSettings {
            kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
            hostname_override: Some("worker-3".into()),
            healthz_bind_address: Some("0.0.0.0:10256".into()),
            metrics_bind_address: Some("0.0.0.0:10249".into()),
            bind_address_hard_fail: Some(true),
            cluster_cidrs: vec!["10.244.0.0/16".into(), "fd00:10:244::/56".into()],
            interfaces: Some("cali*".into()),
            nodeport_addresses: vec!["primary".into()],
            min_sync_period: Some(Duration::from_secs(2)),
            sync_period: Some(Duration::from_secs(60)),
            conntrack_tcp_timeout_established: Some(Duration::from_secs(86400)),
            conntrack_udp_timeout: Some(Duration::from_secs(120)),
            conntrack_max: Some(262_144),
            log_format: Some("json".into()),
            verbosity: Some(4),
            ignored: vec!["mode (ipvs: kproxy is its own datapath)".into()],
        }
    }

    #[test]
    fn the_file_sets_what_the_flags_leave_unset() {
        let file = kubeadm_file();
        let merged = effective(&[], Some(&file));
        assert_eq!(merged, FileSettings { ignored: vec![], ..file });
    }

    #[test]
    fn a_flag_on_the_command_line_wins_over_the_file() {
        let file = kubeadm_file();
        let merged = effective(
            &[
                "--hostname-override",
                "node-9",
                "--min-sync-period",
                "250ms",
                "--cluster-cidr",
                "10.100.0.0/16",
                "--nodeport-addresses",
                "192.168.0.0/16",
                "--interfaces",
                "veth*",
                "lxc*",
                "--bind-address-hard-fail=false",
                "--log-format",
                "text",
                "-v",
                "2",
            ],
            Some(&file),
        );
        assert_eq!(merged.hostname_override.as_deref(), Some("node-9"));
        assert_eq!(merged.min_sync_period, Some(Duration::from_millis(250)));
        assert_eq!(merged.cluster_cidrs, ["10.100.0.0/16"]);
        assert_eq!(merged.nodeport_addresses, ["192.168.0.0/16"]);
        assert_eq!(merged.interfaces.as_deref(), Some("veth* lxc*"));
        assert_eq!(merged.bind_address_hard_fail, Some(false));
        assert_eq!(merged.log_format.as_deref(), Some("text"));
        assert_eq!(merged.verbosity, Some(2));
        // What no flag named still comes from the file.
        assert_eq!(merged.sync_period, Some(Duration::from_secs(60)));
        assert_eq!(merged.conntrack_max, Some(262_144));
    }

    #[test]
    fn the_files_kubeconfig_gives_way_to_manifests_and_master() {
        let file = kubeadm_file();
        assert_eq!(effective(&["--manifests", "/tmp/m"], Some(&file)).kubeconfig, None);
        assert_eq!(effective(&["--master", "http://127.0.0.1:8080"], Some(&file)).kubeconfig, None);
    }

    #[test]
    fn without_a_file_the_defaults_are_kube_proxys() {
        let defaults = effective(&[], None);
        assert_eq!(defaults.min_sync_period, Some(Duration::from_secs(1)));
        assert_eq!(defaults.sync_period, Some(Duration::from_secs(30)));
        assert_eq!(defaults.healthz_bind_address.as_deref(), Some("0.0.0.0:10256"));
        assert_eq!(defaults.metrics_bind_address.as_deref(), Some("127.0.0.1:10249"));
        assert_eq!(defaults.bind_address_hard_fail, Some(false));
        assert_eq!(defaults.verbosity, Some(0));
        assert!(defaults.nodeport_addresses.is_empty());
        assert_eq!(effective(&["--bind-address-hard-fail"], None).bind_address_hard_fail, Some(true));
        assert_eq!(effective(&["--v=6"], None).verbosity, Some(6));
    }

    #[test]
    fn deprecated_ports_set_the_port_of_the_address_and_zero_disables() {
        assert_eq!(with_port("0.0.0.0:10256", 12345).unwrap(), "0.0.0.0:12345");
        assert_eq!(with_port("127.0.0.1", 9100).unwrap(), "127.0.0.1:9100");
        assert_eq!(with_port("[::1]:10249", 9100).unwrap(), "[::1]:9100");
        assert_eq!(with_port("0.0.0.0:10256", 0).unwrap(), "");
        assert!(with_port("localhost:1", 5).is_err());
    }

    #[test]
    fn verbosity_levels_as_klogs() {
        assert_eq!(verbosity_filter(0), "info");
        assert_eq!(verbosity_filter(3), "info");
        assert_eq!(verbosity_filter(4), "debug");
        assert_eq!(verbosity_filter(6), "trace");
        assert_eq!(verbosity_filter(10), "trace");
    }

    #[test]
    fn version_names_the_commit() {
        let version = Cli::command().render_version();
        assert!(version.starts_with(&format!("kproxy {} (commit ", env!("CARGO_PKG_VERSION"))), "{version}");
    }
}
