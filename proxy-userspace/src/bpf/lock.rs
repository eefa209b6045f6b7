//! The pin lock: one agent per pin directory, and who holds it.

use std::{
    fs,
    path::Path,
    time::{Duration, Instant},
};

use super::bpffs::{BpffsScope, bpffs_scope, ensure_bpffs};
use super::pins::PinDir;
use anyhow::{Context as _, Result, bail};

/// How a process that writes pins (the agent, `load`) takes the pin directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimOptions {
    /// How long to wait for another kproxy holding the pin directory to let go of it (a
    /// rolling update starts the new agent while the old one is still stopping).
    pub lock_wait: Duration,
    /// Pin into a bpffs that vanishes with this mount namespace, with a warning.
    pub allow_private_bpffs: bool,
}

/// Readies the pin directory for a process that writes pins: bpffs mounted (mode 0700) if
/// missing, the host's one (or a private one when allowed), the tree created and verified,
/// and held by this process alone ([`PinLock`]) until the returned lock is dropped.
pub fn claim(pins: &PinDir, options: &ClaimOptions) -> Result<PinLock> {
    let mounted = ensure_bpffs(pins)?;
    match bpffs_scope(pins.root(), mounted) {
        BpffsScope::Private(why) if !options.allow_private_bpffs => bail!(
            "refusing to pin under {}: {why}. Pins there vanish with this mount namespace, and every link and \
             flow with them when kproxy exits. `ip netns exec` runs a command in a mount namespace of its own with \
             /sys mounted afresh: enter only the network namespace (`nsenter --net=/run/netns/NAME`), give a \
             container the host's /sys/fs/bpf (hostPath), or pass --allow-private-bpffs to pin there anyway",
            pins.root().display()
        ),
        BpffsScope::Private(why) => tracing::warn!(
            pins = %pins.root().display(),
            "pinning into a private bpffs (--allow-private-bpffs): {why}; the datapath vanishes with this mount \
             namespace"
        ),
        BpffsScope::Unknown(why) => {
            tracing::info!(pins = %pins.root().display(), "cannot tell whether the bpffs is the host's: {why}")
        }
        BpffsScope::Host(why) => tracing::debug!(pins = %pins.root().display(), "{why}"),
    }
    pins.prepare()?;
    PinLock::acquire(pins, options.lock_wait)
}

pub(crate) fn flock(file: &fs::File, operation: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a file descriptor this `File` owns for the duration of the call.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Opens a directory of the pin tree (which [`PinDir::verify`] has checked) without following
/// a symlink put in its place.
fn open_dir(dir: &Path) -> Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
        .with_context(|| format!("opening {}", dir.display()))
}

/// One writer per pin directory: an exclusive flock on the pin directory itself (bpffs holds
/// no regular files to lock), held by the agent for its lifetime and by `load` and `unload`
/// while they run. The kernel releases it when the process exits, however it exits.
#[derive(Debug)]
pub struct PinLock {
    pub(super) _dir: fs::File,
}

impl PinLock {
    /// Takes the lock, waiting up to `wait` (logging once whom it waits for) while another
    /// process holds it; the error names the pin directory and the holder.
    pub fn acquire(pins: &PinDir, wait: Duration) -> Result<PinLock> {
        let deadline = Instant::now() + wait;
        let mut announced = false;
        loop {
            if let Some(lock) = Self::try_acquire(pins)? {
                if announced {
                    tracing::info!(pins = %pins.root().display(), "took over the pin directory");
                }
                return Ok(lock);
            }
            let holder = lock_holder(pins.root());
            let now = Instant::now();
            if now >= deadline {
                let waited = if wait.is_zero() { String::new() } else { format!(" (waited {wait:?})") };
                bail!(
                    "the pin directory {} is held by {holder}{waited}: one kproxy agent per pin directory. Stop \
                     that one first",
                    pins.root().display()
                );
            }
            if !announced {
                tracing::info!(
                    pins = %pins.root().display(),
                    timeout = ?wait,
                    "waiting for {holder} to release the pin directory"
                );
                announced = true;
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(100)));
        }
    }

    /// The lock if nobody holds it, else None.
    pub fn try_acquire(pins: &PinDir) -> Result<Option<PinLock>> {
        let dir = open_dir(pins.root())?;
        match flock(&dir, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => Ok(Some(PinLock { _dir: dir })),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("locking {}", pins.root().display())),
        }
    }
}

/// Who holds the flock on `dir`, from /proc/locks: `PID N (command line)`, or, for a holder in
/// another PID namespace (whose locks this one does not list), a sentence saying so.
pub fn lock_holder(dir: &Path) -> String {
    pin_lock_pid(dir).map_or_else(
        || "another process (not visible from this PID namespace)".to_owned(),
        |pid| {
            let command = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|raw| {
                    let words: Vec<String> = raw
                        .split(|b| *b == 0)
                        .filter(|w| !w.is_empty())
                        .map(|w| String::from_utf8_lossy(w).into_owned())
                        .collect();
                    words.join(" ")
                })
                .unwrap_or_default();
            let command: String = command.chars().take(120).collect();
            if command.is_empty() { format!("PID {pid}") } else { format!("PID {pid} ({command})") }
        },
    )
}

/// The PID /proc/locks gives for the flock on `dir`, if it lists one.
pub fn pin_lock_pid(dir: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = fs::metadata(dir).ok()?;
    let id = format!("{:02x}:{:02x}:{}", libc::major(meta.dev()), libc::minor(meta.dev()), meta.ino());
    fs::read_to_string("/proc/locks").ok()?.lines().find_map(|line| {
        // `1: FLOCK  ADVISORY  WRITE 1234 00:28:1573033 0 EOF`; waiters' lines start with `->`.
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first() == Some(&"->")
            || fields.get(1) != Some(&"FLOCK")
            || fields.get(5) != Some(&id.as_str())
        {
            return None;
        }
        fields.get(4)?.parse().ok().filter(|pid| *pid > 0)
    })
}
