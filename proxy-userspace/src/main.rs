use std::{
    path::PathBuf,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kproxy::{
    agent::{self, AgentConfig},
    datapath::{self, InterfaceSelector, Maps, PinDir},
    dump,
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
    },
    /// Detach the programs and remove every pin.
    Unload,
    /// Program the datapath from Service and EndpointSlice manifests and keep
    /// it in step with them until SIGTERM or Ctrl-C.
    Agent {
        /// A YAML/JSON file (multi-document allowed) or a directory of them.
        #[arg(long)]
        manifests: PathBuf,
        /// Pod-facing interfaces (globs); interfaces appearing later are attached too.
        #[arg(long, num_args = 1.., default_values = ["veth*"])]
        interfaces: Vec<String>,
        /// How often interfaces and manifests are checked, in milliseconds.
        #[arg(long, default_value_t = 250)]
        poll_ms: u64,
    },
    /// Print a map.
    Dump {
        #[arg(value_enum)]
        what: DumpWhat,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum DumpWhat {
    Services,
    Backends,
    Conntrack,
    Stats,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    if let Err(e) = run(cli) {
        eprintln!("kproxy: {e:#}");
        std::process::exit(1);
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPROXY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(cli: Cli) -> Result<()> {
    let pins = PinDir::new(&cli.pin_dir);
    match cli.command {
        Command::Load { interfaces } => {
            let selector = InterfaceSelector::new(&interfaces)?;
            if datapath::load(&pins)? {
                println!("loaded and pinned under {}", pins.root().display());
            } else {
                println!("already loaded under {}", pins.root().display());
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
        Command::Unload => {
            let report = datapath::unload(&pins)?;
            for link in &report.links {
                println!("detached {link}");
            }
            println!("removed {} pins and {}", report.pins, pins.root().display());
        }
        Command::Agent { manifests, interfaces, poll_ms } => {
            let stop = Arc::new(AtomicBool::new(false));
            for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
                signal_hook::flag::register(signal, Arc::clone(&stop))
                    .context("installing signal handlers")?;
            }
            let config = AgentConfig { pins, manifests, interfaces, poll: Duration::from_millis(poll_ms) };
            agent::run(&config, stop)?;
        }
        Command::Dump { what, json } => {
            let maps = Maps::from_pins(&pins)?;
            let text = match what {
                DumpWhat::Services => render(dump::services(&maps)?, json, dump::services_table)?,
                DumpWhat::Backends => render(dump::backends(&maps)?, json, dump::backends_table)?,
                DumpWhat::Conntrack => render(dump::conntrack(&maps)?, json, dump::conntrack_table)?,
                DumpWhat::Stats => render(dump::stats(&maps)?, json, dump::stats_table)?,
            };
            print!("{text}");
        }
    }
    Ok(())
}

fn render<T: serde::Serialize>(rows: Vec<T>, json: bool, table: fn(&[T]) -> String) -> Result<String> {
    if json { Ok(serde_json::to_string_pretty(&rows)? + "\n") } else { Ok(table(&rows)) }
}
