//! `cargo xtask setup`: installs what building and testing kproxy need on a Debian 12 machine,
//! idempotently (what is present is skipped), and mounts bpffs.
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

use crate::run as run_cmd;

/// Debian packages: LLVM 22 for bpf-linker, then the tools the tests and the demo run.
const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "iproute2",
    "iptables",
    "nginx-light",
    "dnsmasq-base",
    "dnsutils",
    "netcat-openbsd",
    "curl",
    "wrk",
    "tcpdump",
    "bpftool",
    "iperf3",
    // `cargo xtask bench`: DNS load and the charts.
    "dnsperf",
    "gnuplot-nox",
    "ethtool",
    "util-linux",
    "procps",
    "nftables",
    // The differential test's kube-proxy runs delete stale UDP entries as kube-proxy does.
    "conntrack",
    // The socket-level load balancing tests drive sockets from small scripts.
    "python3",
    // The API endpoint test makes the TLS certificates of its API server front.
    "openssl",
];

const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";
const BPFFS: &str = "/sys/fs/bpf";

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Also report what is already present (`cargo xtask setup`).
    Verbose,
    /// Report only what gets installed (setup as a step of another command).
    Quiet,
}

fn present(mode: Mode, what: &str) {
    if mode == Mode::Verbose {
        eprintln!("present: {what}");
    }
}

/// Whether `cmd` runs and exits 0 (output discarded).
fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// stdout of `cmd` if it runs and exits 0.
fn output_of(cmd: &mut Command) -> Option<String> {
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn deb_installed(package: &str) -> bool {
    output_of(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|status| status.trim() == "install ok installed")
}

fn apt_packages(mode: Mode) -> Result<()> {
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !deb_installed(p)).collect();
    for package in PACKAGES.iter().filter(|p| !missing.contains(p)) {
        present(mode, &format!("Debian package {package}"));
    }
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing Debian packages: {}", missing.join(" "));
    run_cmd(Command::new("apt-get").arg("update").env("DEBIAN_FRONTEND", "noninteractive"))?;
    run_cmd(
        Command::new("apt-get")
            .args(["install", "-y"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    let still_missing: Vec<&str> = missing.into_iter().filter(|p| !deb_installed(p)).collect();
    if !still_missing.is_empty() {
        bail!("apt-get finished but these packages are still not installed: {}", still_missing.join(" "));
    }
    Ok(())
}

fn rustup() -> Command {
    let mut cmd = Command::new("rustup");
    // Decide by the toolchain named on the command line, not by one the caller pinned.
    cmd.env_remove("RUSTUP_TOOLCHAIN");
    cmd
}

fn rust_toolchain(mode: Mode) -> Result<()> {
    if !succeeds(rustup().arg("--version")) {
        bail!("rustup is not installed; kproxy builds its eBPF programs with a rustup nightly toolchain");
    }
    let toolchains = output_of(rustup().args(["toolchain", "list"])).unwrap_or_default();
    if toolchains.lines().any(|l| l.starts_with("nightly")) {
        present(mode, "rust nightly toolchain");
    } else {
        eprintln!("installing the rust nightly toolchain");
        run_cmd(rustup().args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    let components = output_of(rustup().args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .unwrap_or_default();
    // rust-src for `-Z build-std=core`; clippy to lint proxy-ebpf for the BPF target.
    for component in ["rust-src", "clippy"] {
        if components.lines().any(|l| l.starts_with(component)) {
            present(mode, &format!("{component} for nightly"));
        } else {
            eprintln!("installing {component} for nightly");
            run_cmd(rustup().args(["component", "add", component, "--toolchain", "nightly"]))?;
        }
    }
    // rustfmt and clippy for the default toolchain (CI runs `cargo fmt` and `cargo clippy`).
    for (component, probe) in [("rustfmt", "fmt"), ("clippy", "clippy")] {
        if succeeds(Command::new("cargo").args([probe, "--version"])) {
            present(mode, component);
        } else {
            eprintln!("installing {component}");
            run_cmd(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    Ok(())
}

fn cargo_bin_dir() -> Option<PathBuf> {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map(|home| home.join("bin"))
}

fn bpf_linker_works() -> bool {
    if succeeds(Command::new("bpf-linker").arg("--version")) {
        return true;
    }
    // Installed but ~/.cargo/bin not on PATH: aya-build would not find it either.
    if let Some(bin) = cargo_bin_dir().map(|d| d.join("bpf-linker"))
        && succeeds(Command::new(&bin).arg("--version"))
    {
        eprintln!("warning: {} works but is not on PATH; add its directory to PATH", bin.display());
        return true;
    }
    false
}

fn bpf_linker(mode: Mode) -> Result<()> {
    if bpf_linker_works() {
        present(mode, "bpf-linker");
        return Ok(());
    }
    eprintln!("installing bpf-linker (built against LLVM 22; takes about a minute)");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![PathBuf::from(LLVM_BIN)];
    dirs.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(dirs).context("PATH")?;
    run_cmd(
        Command::new("cargo")
            .args(["install", "bpf-linker", "--no-default-features", "--features", "llvm-22"])
            .env("PATH", path)
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    if !bpf_linker_works() {
        bail!("bpf-linker was installed but `bpf-linker --version` still fails");
    }
    Ok(())
}

fn bpffs_mounted() -> Result<bool> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(mounts.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&BPFFS) && fields.get(2) == Some(&"bpf")
    }))
}

fn bpffs(mode: Mode) -> Result<()> {
    if bpffs_mounted()? {
        present(mode, &format!("bpffs at {BPFFS}"));
        return Ok(());
    }
    eprintln!("mounting bpffs at {BPFFS}");
    std::fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    run_cmd(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}

/// Where a cgroup2 hierarchy is mounted on a machine that has none (a cgroup
/// v1 host): the socket-level load balancing programs attach to cgroup2.
const CGROUP2_FALLBACK: &str = "/sys/fs/cgroup/unified";

fn cgroup2(mode: Mode) -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    if let Some(line) = mounts.lines().find(|l| l.split_whitespace().nth(2) == Some("cgroup2")) {
        present(mode, &format!("cgroup2 at {}", line.split_whitespace().nth(1).unwrap_or("?")));
        return Ok(());
    }
    eprintln!("mounting cgroup2 at {CGROUP2_FALLBACK}");
    std::fs::create_dir_all(CGROUP2_FALLBACK).with_context(|| format!("creating {CGROUP2_FALLBACK}"))?;
    run_cmd(Command::new("mount").args(["-t", "cgroup2", "none", CGROUP2_FALLBACK]))
}

/// Installs whatever is missing; with [`Mode::Verbose`] also lists what is present.
pub fn run(mode: Mode) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "setup must run as root: it installs Debian packages, mounts bpffs, and the tests create \
             network namespaces (try `sudo -E cargo xtask ...`)"
        );
    }
    apt_packages(mode)?;
    rust_toolchain(mode)?;
    bpf_linker(mode)?;
    bpffs(mode)?;
    cgroup2(mode)?;
    if mode == Mode::Verbose {
        eprintln!("setup complete");
    }
    Ok(())
}
