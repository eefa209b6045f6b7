//! bpffs: mounting it where the pins go, and whether a pin directory outlives the mount namespace.

use std::{fs, io::ErrorKind, path::Path};

use super::pins::PinDir;
use anyhow::{Context as _, Result};

const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// Whether `path` is on a bpf filesystem (statfs magic BPF_FS_MAGIC).
pub(super) fn on_bpffs(path: &Path) -> Result<bool> {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{}: not a valid path", path.display()))?;
    // SAFETY: zeroed plain data for the kernel to fill in.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a statfs buffer that outlive the call.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("statfs {}", path.display()));
    }
    Ok(stat.f_type as i64 == BPF_FS_MAGIC)
}

/// Mounts bpffs at /sys/fs/bpf when the pin directory lives there and nothing
/// is mounted yet (DESIGN: `kproxy load` needs nobody to prepare the node).
/// Mode 0700, nosuid, nodev, noexec, as systemd mounts it: bpffs mounted without
/// `mode=` is world-writable (1777), which let any local user create kproxy's pin
/// directory first. An existing mount is left as it is. Returns whether it mounted.
pub fn ensure_bpffs(pins: &PinDir) -> Result<bool> {
    if !pins.root().starts_with(BPFFS_MOUNT) {
        return Ok(false);
    }
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let mounted = mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (_, target, fstype) = (fields.next(), fields.next(), fields.next());
        target == Some(BPFFS_MOUNT) && fstype == Some("bpf")
    });
    if mounted {
        return Ok(false);
    }
    tracing::info!("mounting bpffs at {BPFFS_MOUNT} (mode 0700)");
    // SAFETY: NUL-terminated literals that outlive the call.
    let status = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            c"/sys/fs/bpf".as_ptr(),
            c"bpf".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"mode=0700".as_ptr().cast(),
        )
    };
    if status != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount -t bpf -o mode=0700 bpf {BPFFS_MOUNT}"));
    }
    Ok(true)
}

/// Whether pins made under a path outlive this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BpffsScope {
    /// The host's bpffs: the pins stay when this process and its mount namespace go.
    Host(String),
    /// A bpffs only this process's mount namespace has (`ip netns exec` remounts /sys, so
    /// kproxy would mount one of its own there): the pins, and with them every link and
    /// every flow, vanish with the namespace.
    Private(String),
    /// Neither could be established.
    Unknown(String),
}

/// The nsfs inode number of the initial mount namespace, fixed since Linux 6.18
/// (`MNT_NS_INIT_INO`, include/uapi/linux/nsfs.h). Older kernels number it like any other
/// namespace, from 0xF0000000 up, so no other namespace ever has this one.
const MNT_NS_INIT_INO: u64 = 0xEFFF_FFF8;

fn mount_namespace(pid: &str) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(fs::metadata(format!("/proc/{pid}/ns/mnt"))?.ino())
}

/// A process of the initial mount namespace whose view of the filesystem this process may
/// read: what the host has mounted where, when PID 1 (the usual witness) is unreadable.
fn process_in_initial_mount_namespace() -> Option<u32> {
    fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let ns = mount_namespace(&pid.to_string()).ok()?;
        (ns == MNT_NS_INIT_INO && fs::metadata(format!("/proc/{pid}/root/")).is_ok()).then_some(pid)
    })
}

/// Whether the bpffs holding `path` is the host's: this process runs in the initial mount
/// namespace or in PID 1's, or the host's mount namespace (seen through `/proc/PID/root` of
/// PID 1, or of a process known to be in the initial namespace) has the same bpffs (the same
/// superblock, so the same device number) at the same place. `mounted_here`: kproxy has just
/// mounted that bpffs itself, so nothing outside this namespace can hold it.
pub fn bpffs_scope(path: &Path, mounted_here: bool) -> BpffsScope {
    use std::os::unix::fs::MetadataExt as _;
    let own = match mount_namespace("self") {
        Ok(ns) => ns,
        Err(e) => return BpffsScope::Unknown(format!("cannot read /proc/self/ns/mnt: {e}")),
    };
    if own == MNT_NS_INIT_INO {
        return BpffsScope::Host("this process runs in the host's initial mount namespace".to_owned());
    }
    let pid1 = mount_namespace("1");
    if pid1.as_ref().is_ok_and(|ns| *ns == own) {
        return BpffsScope::Host(format!("this process runs in PID 1's mount namespace (mnt:[{own}])"));
    }
    let anchor = path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    if !on_bpffs(anchor).unwrap_or(false) {
        return if path.starts_with(BPFFS_MOUNT) {
            BpffsScope::Private(format!(
                "there is no bpffs at {BPFFS_MOUNT} in mount namespace mnt:[{own}], which is not known to be the \
                 host's (neither the initial one nor PID 1's): kproxy would mount one of its own there, which \
                 nothing outside this namespace holds"
            ))
        } else {
            BpffsScope::Unknown(format!("{} is not on a bpf filesystem", anchor.display()))
        };
    }
    let witness = match &pid1 {
        Ok(ns) => Some((1, *ns)),
        Err(_) => process_in_initial_mount_namespace().map(|pid| (pid, MNT_NS_INIT_INO)),
    };
    let Some((pid, host_ns)) = witness else {
        return if mounted_here {
            BpffsScope::Private(format!(
                "kproxy mounted a new bpffs at {BPFFS_MOUNT} in mount namespace mnt:[{own}], which is not known \
                 to be the host's (neither the initial one nor PID 1's): nothing outside this namespace holds it"
            ))
        } else {
            let why = pid1.err().map(|e| e.to_string()).unwrap_or_default();
            BpffsScope::Unknown(format!(
                "this process runs in mount namespace mnt:[{own}] and cannot see the host's to compare its bpffs \
                 at {} (PID 1's namespace: {why})",
                anchor.display()
            ))
        };
    };
    let ours = match fs::metadata(anchor) {
        Ok(meta) => meta.dev(),
        Err(e) => return BpffsScope::Unknown(format!("{}: {e}", anchor.display())),
    };
    let through = Path::new("/proc")
        .join(pid.to_string())
        .join("root")
        .join(anchor.strip_prefix("/").unwrap_or(anchor));
    let elsewhere = format!(
        "this process runs in mount namespace mnt:[{own}], not the host's (mnt:[{host_ns}], seen through PID \
         {pid}), and its bpffs at {}",
        anchor.display()
    );
    match fs::metadata(&through) {
        Ok(meta) if meta.dev() == ours && on_bpffs(&through).unwrap_or(false) => BpffsScope::Host(format!(
            "the bpffs at {} is the host's: PID {pid}'s mount namespace (mnt:[{host_ns}]) has the same one there",
            anchor.display()
        )),
        Ok(_) => BpffsScope::Private(format!("{elsewhere} is not the one the host has there")),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            BpffsScope::Private(format!("{elsewhere} does not exist on the host"))
        }
        Err(e) => {
            BpffsScope::Unknown(format!("{elsewhere}: cannot compare it with {}: {e}", through.display()))
        }
    }
}
