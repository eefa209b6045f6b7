//! Developer commands, run as `cargo xtask <command>` (alias in .cargo/config.toml).
mod bench;
mod demo;
mod demo_north_south;
mod setup;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", bin_name = "cargo xtask", about = "kproxy developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need (Debian packages, nightly rust-src, bpf-linker),
    /// and mount bpffs; skips what is already there. Needs root.
    Setup,
    /// Setup, then build the release `kproxy` binary (eBPF programs included).
    Build,
    /// Setup, build the debug `kproxy`, then run `cargo test --workspace` (all but the BPF-only
    /// proxy-ebpf) with KPROXY_BIN set.
    /// Arguments go to `cargo test`; those after `--` go to the test binaries.
    Test {
        /// Extra `cargo test` arguments (e.g. `-p kproxy-tests --test clusterip`); after `--`,
        /// arguments for the test binaries (e.g. `-- --nocapture dns`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Setup, build release, then run the ClusterIP demo in a network-namespace sandbox.
    Demo,
    /// Setup, build release, then measure the datapath, end-to-end rates and the control plane
    /// beside their baselines; writes docs/bench/ (README.md, PNG charts).
    Bench(bench::Args),
    /// Build release, then `kproxy load ARGS...`.
    Load {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Build release, then `kproxy unload ARGS...`.
    Unload {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Build release, then `kproxy dump ARGS...` (e.g. `dump services --json`).
    Dump {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// Where cargo puts build output: `$CARGO_TARGET_DIR` (relative to the root) or `<root>/target`.
fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    }
}

/// The cargo that runs us (`$CARGO`), or `cargo` from PATH.
fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

/// Runs `cmd`, echoing it first; a non-zero exit is an error.
fn run(cmd: &mut Command) -> Result<()> {
    let text = describe(cmd);
    eprintln!("+ {text}");
    let status = cmd.status().with_context(|| format!("starting `{text}`"))?;
    if !status.success() {
        bail!("`{text}` failed ({status})");
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    let mut text = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// `cargo build [--release] -p proxy-userspace`; the path of the `kproxy` binary it made.
fn build_kproxy(root: &Path, release: bool) -> Result<PathBuf> {
    let mut cmd = cargo(root);
    cmd.args(["build", "-p", "proxy-userspace"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)?;
    let bin = target_dir(root).join(if release { "release" } else { "debug" }).join("kproxy");
    if !bin.is_file() {
        bail!("build finished but {} is missing", bin.display());
    }
    Ok(bin)
}

fn run_kproxy(root: &Path, subcommand: &str, args: &[OsString]) -> Result<()> {
    setup::run(setup::Mode::Quiet)?;
    let bin = build_kproxy(root, true)?;
    run(Command::new(bin).arg(subcommand).args(args))
}

fn test(root: &Path, cargo_args: &[OsString], harness_args: &[OsString]) -> Result<()> {
    setup::run(setup::Mode::Quiet)?;
    let bin = build_kproxy(root, false)?;
    let mut cmd = cargo(root);
    cmd.arg("test");
    let picks_packages = cargo_args.iter().any(|a| {
        let a = a.to_string_lossy();
        a == "-p" || a.starts_with("--package") || (a.starts_with("-p") && a.len() > 2)
    });
    if !picks_packages {
        // proxy-ebpf is a no_std BPF program: it is built for the BPF target by proxy-userspace's
        // build.rs and cannot be linked as a host test binary.
        cmd.args(["--workspace", "--exclude", "proxy-ebpf"]);
    }
    cmd.args(cargo_args);
    if !harness_args.is_empty() {
        cmd.arg("--").args(harness_args);
    }
    cmd.env("KPROXY_BIN", &bin);
    eprintln!("KPROXY_BIN={}", bin.display());
    run_counting_tests(&mut cmd)
}

/// Runs `cargo test`, echoing its output, and ends with one summary line over
/// all test binaries (the last binary cargo runs is often one without tests).
fn run_counting_tests(cmd: &mut Command) -> Result<()> {
    use std::io::{BufRead as _, BufReader};
    let text = describe(cmd);
    eprintln!("+ {text}");
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("starting `{text}`"))?;
    let (mut passed, mut failed, mut ignored) = (0u64, 0u64, 0u64);
    for line in BufReader::new(child.stdout.take().expect("piped stdout")).lines() {
        let line = line?;
        println!("{line}");
        if let Some(summary) = line.strip_prefix("test result: ") {
            let count = |what: &str| -> u64 {
                summary
                    .split(';')
                    .filter_map(|part| {
                        part.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").split_once(' ')
                    })
                    .find(|(_, name)| *name == what)
                    .and_then(|(n, _)| n.parse().ok())
                    .unwrap_or(0)
            };
            passed += count("passed");
            failed += count("failed");
            ignored += count("ignored");
        }
    }
    let status = child.wait()?;
    println!("kproxy: {passed} passed, {failed} failed, {ignored} skipped");
    if !status.success() {
        bail!("`{text}` failed ({status})");
    }
    Ok(())
}

/// Splits what follows `test` on the command line, as typed (clap drops a leading `--`), into
/// `cargo test` arguments and test-harness arguments (after the first `--`).
fn split_test_args(raw: &[OsString]) -> (Vec<OsString>, Vec<OsString>) {
    match raw.iter().position(|a| a == "--") {
        Some(i) => (raw[..i].to_vec(), raw[i + 1..].to_vec()),
        None => (raw.to_vec(), Vec::new()),
    }
}

/// The arguments after the `test` subcommand, as typed.
fn raw_test_args(argv: &[OsString]) -> Vec<OsString> {
    match argv.iter().skip(1).position(|a| a == "test") {
        Some(i) => argv[i + 2..].to_vec(),
        None => Vec::new(),
    }
}

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let cli = Cli::parse_from(&argv);
    let root = workspace_root();
    let result = match cli.command {
        Cmd::Setup => setup::run(setup::Mode::Verbose),
        Cmd::Build => setup::run(setup::Mode::Quiet).and_then(|()| build_kproxy(&root, true).map(drop)),
        Cmd::Test { .. } => {
            let (cargo_args, harness_args) = split_test_args(&raw_test_args(&argv));
            test(&root, &cargo_args, &harness_args)
        }
        Cmd::Demo => setup::run(setup::Mode::Quiet).and_then(|()| {
            let bin = build_kproxy(&root, true)?;
            demo::run(&bin, &root.join("examples"))
        }),
        Cmd::Bench(args) => bench::run(&root, &args),
        Cmd::Load { args } => run_kproxy(&root, "load", &args),
        Cmd::Unload { args } => run_kproxy(&root, "unload", &args),
        Cmd::Dump { args } => run_kproxy(&root, "dump", &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cmd {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied())).unwrap().command
    }

    fn split(args: &[&str]) -> (Vec<OsString>, Vec<OsString>) {
        let argv: Vec<OsString> = args.iter().map(OsString::from).collect();
        assert!(Cli::try_parse_from(&argv).is_ok(), "{args:?} must parse");
        split_test_args(&raw_test_args(&argv))
    }

    #[test]
    fn test_splits_cargo_and_harness_args() {
        let (cargo, harness) = split(&[
            "xtask",
            "test",
            "-p",
            "kproxy-tests",
            "--test",
            "clusterip",
            "--",
            "--nocapture",
            "dns",
        ]);
        assert_eq!(cargo, ["-p", "kproxy-tests", "--test", "clusterip"]);
        assert_eq!(harness, ["--nocapture", "dns"]);
        let (cargo, harness) = split(&["xtask", "test", "--", "--nocapture"]);
        assert!(cargo.is_empty());
        assert_eq!(harness, ["--nocapture"]);
        let (cargo, harness) = split(&["xtask", "test", "--release"]);
        assert_eq!(cargo, ["--release"]);
        assert!(harness.is_empty());
        let (cargo, harness) = split(&["xtask", "test"]);
        assert!(cargo.is_empty() && harness.is_empty());
    }

    #[test]
    fn kproxy_commands_pass_arguments_through() {
        let Cmd::Dump { args } = parse(&["dump", "services", "--json"]) else { panic!("not dump") };
        assert_eq!(args, ["services", "--json"]);
        let Cmd::Load { args } = parse(&["load", "--interfaces", "veth*", "--pin-dir", "/sys/fs/bpf/x"])
        else {
            panic!("not load")
        };
        assert_eq!(args, ["--interfaces", "veth*", "--pin-dir", "/sys/fs/bpf/x"]);
        assert!(matches!(parse(&["unload"]), Cmd::Unload { args } if args.is_empty()));
    }

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        assert!(workspace_root().join("xtask/Cargo.toml").is_file());
        assert!(workspace_root().join("proxy-userspace").is_dir());
    }
}
