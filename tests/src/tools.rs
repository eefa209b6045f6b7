//! Finding the programs the sandbox runs, with a clear hint when one is missing.
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// Program → Debian package that ships it (what `cargo xtask setup` installs).
const PACKAGES: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("ss", "iproute2"),
    ("nsenter", "util-linux"),
    ("sysctl", "procps"),
    ("nginx", "nginx-light"),
    ("dnsmasq", "dnsmasq-base"),
    ("curl", "curl"),
    ("dig", "dnsutils"),
    ("nc", "netcat-openbsd"),
    ("wrk", "wrk"),
    ("iperf3", "iperf3"),
    ("tcpdump", "tcpdump"),
    ("bpftool", "bpftool"),
    ("iptables", "iptables"),
];

/// Directories searched after `$PATH` (root's sbin directories may be missing from a CI `PATH`).
const EXTRA_DIRS: &[&str] = &["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Absolute path of program `name`, or an error that names its Debian package and says to run
/// `cargo xtask setup`.
pub fn find_tool(name: &str) -> Result<PathBuf> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path_var).chain(EXTRA_DIRS.iter().map(PathBuf::from));
    for dir in dirs {
        let candidate = dir.join(name);
        if is_executable(&candidate) {
            return Ok(candidate);
        }
    }
    match PACKAGES.iter().find(|(bin, _)| *bin == name) {
        Some((_, package)) => bail!(
            "`{name}` not found (Debian package {package}); run `cargo xtask setup` as root to install \
             what the sandbox tests need"
        ),
        None => bail!(
            "`{name}` not found; run `cargo xtask setup` as root to install what the sandbox tests need"
        ),
    }
}

/// Errors unless every program in `names` is installed.
pub fn require_tools(names: &[&str]) -> Result<()> {
    for name in names {
        find_tool(name)?;
    }
    Ok(())
}

/// Errors unless this process is root (namespaces, veths and sysctls need it).
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "network-namespace sandboxes need root; run the tests as root (e.g. `sudo -E cargo xtask test`) \
             after `cargo xtask setup`"
        );
    }
    Ok(())
}

/// The kproxy binary under test: `cargo xtask test` sets KPROXY_BIN.
pub fn kproxy_bin() -> PathBuf {
    let path = std::env::var_os("KPROXY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/kproxy"));
    assert!(
        path.exists(),
        "kproxy binary not found at {} — run the tests with `cargo xtask test` (it builds kproxy and sets KPROXY_BIN)",
        path.display()
    );
    path
}
