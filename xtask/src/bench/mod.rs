//! `cargo xtask bench`: every performance claim measured by one command, beside its baselines in
//! the same run, published as `docs/bench/README.md` with PNG charts (gnuplot).
//!
//! Three parts, each of which reports instead of failing (a part that breaks is recorded in the
//! report and the others still run):
//! - `datapath`: ns per packet of the tc programs through `BPF_PROG_TEST_RUN`, at 1 to 100k
//!   Services;
//! - `e2e`: wrk and dnsperf in a network-namespace sandbox: a pod IP with no proxy and with a
//!   pass-all tc program (the floor), the ClusterIP and the pod IP through kproxy, its socket LB
//!   with and without tc on the pod veths, and kube-proxy-shaped iptables rules for N Services;
//! - `control`: initial sync of 10k Services (manifests and API server), one endpoint change,
//!   agent peak RSS, beside `iptables-restore` of the equivalent kube-proxy ruleset.
//!
//! Linking the `kproxy` library builds the eBPF programs, which needs what `cargo xtask setup`
//! installs; so the measuring code is behind xtask's `bench` feature and the default xtask (the
//! one that runs `setup` on a fresh machine) only runs setup, builds the release `kproxy` and
//! re-runs itself with `--features bench`.
use std::path::{Path, PathBuf};

use anyhow::Result;

#[cfg(feature = "bench")]
mod control;
#[cfg(feature = "bench")]
mod datapath;
#[cfg(feature = "bench")]
mod e2e;
#[cfg(feature = "bench")]
mod floor;
#[cfg(feature = "bench")]
mod imp;
#[cfg(feature = "bench")]
mod report;
#[cfg(feature = "bench")]
use sandbox::kube_proxy_rules as rules;
#[cfg(feature = "bench")]
mod stats;

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Fewer sizes, runs and seconds (for development); the report says so.
    #[arg(long)]
    pub quick: bool,
    /// Run only these parts (datapath, e2e, control; comma-separated). Default: all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Where docs/bench goes (default: <workspace>/docs/bench).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The release kproxy binary (passed by the outer `cargo xtask bench`).
    #[arg(long, hide = true)]
    pub kproxy: Option<PathBuf>,
}

/// Without the `bench` feature: setup, build the release kproxy, then run the benchmark with the
/// feature (same target dir), waiting for it also on Ctrl-C so its cleanup finishes first.
#[cfg(not(feature = "bench"))]
pub fn run(root: &Path, args: &Args) -> Result<()> {
    use anyhow::Context as _;
    use std::sync::{Arc, atomic::AtomicBool};

    crate::setup::run(crate::setup::Mode::Quiet)?;
    let bin = crate::build_kproxy(root, true)?;
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&interrupted))
            .context("installing signal handlers")?;
    }
    let mut cmd = crate::cargo(root);
    cmd.args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "xtask",
        "--features",
        "bench",
        "--",
        "bench",
        "--kproxy",
    ])
    .arg(&bin);
    if args.quick {
        cmd.arg("--quick");
    }
    if !args.only.is_empty() {
        cmd.arg("--only").arg(args.only.join(","));
    }
    if let Some(out) = &args.out {
        cmd.arg("--out").arg(out);
    }
    crate::run(&mut cmd)
}

#[cfg(feature = "bench")]
pub fn run(root: &Path, args: &Args) -> Result<()> {
    imp::run(root, args)
}
