//! A child cgroup (v2) for the socket-level load balancing tests and bench: its processes are
//! moved in by a wrapper shell, killed on drop, and the cgroup removed. Socket programs are only
//! ever attached to such a cgroup, never to the machine's root.
use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The cgroup2 mount point, from /proc/self/mounts.
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_, target, fstype) = (fields.next(), fields.next(), fields.next());
        if fstype == Some("cgroup2") { target.map(PathBuf::from) } else { None }
    })
}

pub struct ChildCgroup(PathBuf);

impl ChildCgroup {
    /// `<cgroup2 root>/<prefix>-<pid>-<n>`.
    pub fn new(prefix: &str) -> Result<Self> {
        let root = cgroup2_root().context(
            "no cgroup2 hierarchy is mounted: `cargo xtask setup` mounts one at /sys/fs/cgroup/unified",
        )?;
        let path =
            root.join(format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir(&path).with_context(|| format!("creating the cgroup {}", path.display()))?;
        Ok(Self(path))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `args` run in network namespace `netns` from inside this cgroup: `sh` joins the cgroup
    /// first (`ip netns exec` remounts /sys, hiding the cgroup hierarchy), so every process the
    /// command starts belongs to it.
    pub fn command<S: AsRef<OsStr>>(&self, netns: &str, args: &[S]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#, "sh"]);
        cmd.arg(&self.0).args(["ip", "netns", "exec", netns]).args(args);
        cmd
    }
}

impl Drop for ChildCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: signalling processes started in this cgroup for a test or bench.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(&self.0).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
