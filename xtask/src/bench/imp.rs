//! Runs the parts, each isolated (an error or a panic is recorded and the next part runs), then
//! writes the report.
use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use super::{Args, control, datapath, e2e, report};

pub struct Ctx {
    pub quick: bool,
    pub kproxy: PathBuf,
    pub stop: Arc<AtomicBool>,
}

impl Ctx {
    /// Runs per measurement.
    pub fn runs(&self) -> usize {
        if self.quick { 3 } else { 5 }
    }

    /// Errors once Ctrl-C (or SIGTERM) was received, so every loop ends and cleans up.
    pub fn check(&self) -> Result<()> {
        if self.stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }
}

/// The machine the figures come from.
pub struct Machine {
    pub nproc: String,
    pub cpu: String,
    pub kernel: String,
    pub memory: String,
    pub load_before: String,
    pub load_after: String,
    pub date: String,
    pub commit: String,
}

fn output(cmd: &mut Command) -> String {
    cmd.output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

impl Machine {
    fn probe(root: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or("unknown".into(), |kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0));
        let dirty =
            !output(Command::new("git").arg("-C").arg(root).args(["status", "--porcelain"])).is_empty();
        let commit = output(Command::new("git").arg("-C").arg(root).args(["rev-parse", "--short", "HEAD"]));
        Machine {
            nproc: output(&mut Command::new("nproc")),
            cpu,
            kernel: output(Command::new("uname").arg("-r")),
            memory,
            load_before: loadavg(),
            load_after: String::new(),
            date: output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])),
            commit: format!("{commit}{}", if dirty { " (with uncommitted changes)" } else { "" }),
        }
    }
}

/// A part's result, or why it failed.
pub type Part<T> = Option<Result<T, String>>;

fn part<T>(name: &str, wanted: bool, f: impl FnOnce() -> Result<T>) -> Part<T> {
    if !wanted {
        return None;
    }
    eprintln!("bench: {name}…");
    let started = Instant::now();
    let result = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(panic) => Err(format!(
            "panicked: {}",
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("?")
        )),
    };
    match &result {
        Ok(_) => eprintln!("bench: {name} done in {:.0} s", started.elapsed().as_secs_f64()),
        Err(e) => eprintln!("bench: {name} FAILED: {e}"),
    }
    Some(result)
}

pub fn run(root: &Path, args: &Args) -> Result<()> {
    let kproxy = match &args.kproxy {
        Some(bin) => bin.clone(),
        None => {
            crate::setup::run(crate::setup::Mode::Quiet)?;
            crate::build_kproxy(root, true)?
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).context("installing signal handlers")?;
    }
    for part in &args.only {
        if !["datapath", "e2e", "control"].contains(&part.as_str()) {
            bail!("--only {part}: expected datapath, e2e or control");
        }
    }
    let wants = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let ctx = Ctx { quick: args.quick, kproxy, stop };
    let mut machine = Machine::probe(root);
    let started = Instant::now();

    let datapath = part("datapath (BPF_PROG_TEST_RUN)", wants("datapath"), || datapath::run(&ctx));
    let e2e = part("end to end (sandbox, wrk, dnsperf)", wants("e2e"), || e2e::run(&ctx));
    let control = part("control plane", wants("control"), || control::run(&ctx));
    machine.load_after = loadavg();

    let out = args.out.clone().unwrap_or_else(|| root.join("docs/bench"));
    let results =
        report::Results { machine, quick: ctx.quick, datapath, e2e, control, elapsed: started.elapsed() };
    let summary = report::write(&out, &results)?;
    println!("{summary}");
    println!("report: {}", out.join("README.md").display());
    ctx.check()
}
