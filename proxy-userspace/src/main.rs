use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::{ArgMatches, CommandFactory as _, FromArgMatches as _, Parser, Subcommand, ValueEnum};
use kproxy::{
    agent::kube_proxy_config::{self},
    agent::nodeport::NodePortAddresses,
    agent::{self, AgentConfig, Source},
    bpf::{self, InterfaceSelector, Maps, PinDir},
    cmd::{conntrack, dump, handover},
    k8s::api_watch::KubeOptions,
    model::ModelOptions,
};

mod cli_args;

use cli_args::{
    AgentArgs, LbAlgorithm, LogFormat, cluster_cidrs, effective_settings, given, merge_file, with_port,
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
    /// First the open flows kproxy translated are handed to netfilter (nf_conntrack), so that
    /// kube-proxy's restored rules carry them on.
    Unload {
        /// Unload even while an agent holds the pin directory.
        #[arg(long)]
        force: bool,
        /// Do not hand kproxy's flows to netfilter: their connections lose their translation.
        #[arg(long)]
        no_handover: bool,
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

#[derive(Clone, Copy, ValueEnum)]
enum DumpWhat {
    Services,
    Backends,
    Conntrack,
    Affinity,
    /// The address translations in effect (from the conntrack entries).
    Nat,
    Stats,
    /// The service CIDRs whose unallocated addresses are dropped.
    ServiceCidrs,
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
        // Which endpoint (--api-server-host, its environment variables, in-cluster) and why: the
        // `API server endpoint` line, once the client is built.
        (None, None, None) => "API server (the endpoint: the `API server endpoint` line)".to_owned(),
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
        Command::Load { interfaces, allow_private_bpffs } => load(&pins, &interfaces, allow_private_bpffs)?,
        Command::Unload { force, no_handover } => unload(&pins, force, no_handover)?,
        Command::Agent(args) => agent::run(agent_config(*args, pins)?)?,
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
                DumpWhat::ServiceCidrs => {
                    render(dump::service_cidrs(&maps)?, json, dump::service_cidrs_table)?
                }
                DumpWhat::Diff => unreachable!("handled above"),
            };
            print!("{text}");
        }
    }
    Ok(())
}

/// `kproxy load`: load and pin the datapath, attach to the matching interfaces.
fn load(pins: &PinDir, interfaces: &[String], allow_private_bpffs: bool) -> Result<()> {
    let selector = InterfaceSelector::new(interfaces)?;
    let options = bpf::ClaimOptions { lock_wait: Duration::ZERO, allow_private_bpffs };
    let _held = bpf::claim(pins, &options)?;
    if bpf::load(pins)? {
        println!("loaded and pinned under {}", pins.root().display());
    } else {
        println!("reloaded the programs under {}; pinned maps and links reused", pins.root().display());
    }
    let report = bpf::attach_matching(pins, &selector)?;
    for label in &report.attached {
        println!("attached {label}");
    }
    for (label, error) in &report.failed {
        eprintln!("failed to attach {label}: {error}");
    }
    if report.attached.is_empty() && report.already == 0 {
        println!("no interface matches {interfaces:?} yet; `kproxy agent` attaches to them as they appear");
    }
    if !report.failed.is_empty() {
        anyhow::bail!("{} attachments failed", report.failed.len());
    }
    Ok(())
}

/// `kproxy unload`: hand kproxy's open flows to netfilter, detach and remove every pin.
fn unload(pins: &PinDir, force: bool, no_handover: bool) -> Result<()> {
    let (report, handover) = bpf::unload_after(pins, force, || handover::before_unload(pins, !no_handover))?;
    if let Some(holder) = &report.forced_under {
        eprintln!("kproxy: unloading under {holder} (--force)");
    }
    print!("{}", handover.unwrap_or_default());
    for link in &report.links {
        println!("detached {link}");
    }
    println!("removed {} pins and {}", report.pins, pins.root().display());
    Ok(())
}

/// The agent's configuration from its flags (and `--config`, merged into them before).
fn agent_config(args: AgentArgs, pins: PinDir) -> Result<AgentConfig> {
    let conntrack = args.conntrack()?;
    let nodeport_addresses = NodePortAddresses::parse(&args.nodeport_addresses)
        .map_err(|e| anyhow::anyhow!("--nodeport-addresses {e}"))?;
    let cluster_cidrs = cluster_cidrs(&args)?;
    let service_cidrs = cli_args::service_cidrs(&args)?;
    let source = match args.manifests {
        Some(path) => Source::Files(path),
        None => Source::Cluster(KubeOptions {
            kubeconfig: args.kubeconfig,
            master: args.master,
            api_server_host: args.api_server_host,
            api_server_port: args.api_server_port,
        }),
    };
    let bind = |flag: &str, value: &str| -> Result<Option<SocketAddr>> {
        if value.is_empty() {
            return Ok(None);
        }
        value.parse().map(Some).with_context(|| format!("--{flag} {value:?} is not an address:port"))
    };
    Ok(AgentConfig {
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
            service_cidrs,
            ..Default::default()
        },
        conntrack,
        lb_map_max: args.bpf_lb_map_max,
        north_south: kproxy::agent::nodeport::NorthSouthOptions {
            nodeport_addresses,
            cluster_cidr: cluster_cidrs.ipv4,
            cluster_cidr6: cluster_cidrs.ipv6,
            external_interfaces: args.external_interfaces,
            snat_ports: args.snat_port_range,
            xdp: args.xdp,
            maglev_seed: args.maglev_seed,
        },
        maglev: (args.lb_algorithm == LbAlgorithm::Maglev)
            .then_some(kproxy::sync::MaglevSettings { seed: args.maglev_seed, tables: args.maglev_tables }),
        claim: bpf::ClaimOptions {
            lock_wait: args.lock_timeout,
            allow_private_bpffs: args.allow_private_bpffs,
        },
        socket_lb: kproxy::agent::SocketLbOptions {
            mode: args.socket_lb.unwrap_or(kproxy::agent::SocketLbMode::HostOnly),
            cgroup: args.cgroup_root.or_else(kproxy::bpf::cgroup2_mount),
            asked: args.socket_lb.is_some(),
            pod_veth_tc: args.pod_veth_tc,
        },
    })
}

fn render<T: serde::Serialize>(rows: Vec<T>, json: bool, table: fn(&[T]) -> String) -> Result<String> {
    if json { Ok(serde_json::to_string_pretty(&rows)? + "\n") } else { Ok(table(&rows)) }
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
    cluster_cidrs(args)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy::agent::kube_proxy_config::FileSettings;

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
