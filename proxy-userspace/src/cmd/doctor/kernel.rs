//! Kernel checks: version, BTF, bpffs and cgroup2 mounts.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{Check, host, read};
use crate::bpf::{self, PinDir};

/// `6.18.0-1-amd64` → (6, 18).
pub fn parse_kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The decision on a kernel release (`source` says where it was read).
pub fn kernel_verdict(release: &str, source: &str) -> Check {
    match parse_kernel_version(release) {
        None => Check::warn(
            "kernel",
            format!("cannot parse kernel release {release:?} ({source})"),
            "check `uname -r`",
        ),
        Some((major, minor)) if (major, minor) < (6, 6) => Check::fail(
            "kernel",
            format!("kernel {release} ({source}) is older than 6.6: no TCX links, kproxy cannot attach"),
            "boot a kernel 6.6 or newer",
        ),
        Some(_) => Check::ok("kernel", format!("kernel {release} ({source}) has TCX (6.6+)")),
    }
}

pub(super) fn kernel_check(root: Option<&Path>) -> Check {
    if let Some(release) = read(&host(root, "/proc/sys/kernel/osrelease")) {
        return kernel_verdict(release.trim(), "running");
    }
    let Some(root) = root else {
        return Check::warn(
            "kernel",
            "cannot read /proc/sys/kernel/osrelease",
            "check `uname -r`: 6.6+ is needed",
        );
    };
    // An image: the newest kernel installed.
    let mut installed: Vec<(Option<(u32, u32)>, String)> = ["lib/modules", "usr/lib/modules"]
        .iter()
        .filter_map(|d| fs::read_dir(root.join(d)).ok())
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .map(|name| (parse_kernel_version(&name), name))
        .collect();
    installed.sort();
    match installed.pop() {
        Some((_, newest)) => {
            kernel_verdict(&newest, "newest in lib/modules; cannot read runtime value under --root")
        }
        None => Check::warn(
            "kernel",
            "cannot read runtime value under --root (no proc/sys/kernel/osrelease, no lib/modules)",
            "check that the node boots a kernel 6.6 or newer",
        ),
    }
}

pub(super) fn btf_check(root: Option<&Path>) -> Check {
    if host(root, "/sys/kernel/btf/vmlinux").exists() {
        return Check::ok("btf", "/sys/kernel/btf/vmlinux present");
    }
    if let Some(root) = root {
        let configs: Vec<PathBuf> = fs::read_dir(root.join("boot"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("config-")))
            .collect();
        if let Some(config) = configs
            .iter()
            .find(|p| read(p).is_some_and(|t| t.lines().any(|l| l.trim() == "CONFIG_DEBUG_INFO_BTF=y")))
        {
            let shown = config.strip_prefix(root).unwrap_or(config);
            return Check::ok("btf", format!("/{} has CONFIG_DEBUG_INFO_BTF=y", shown.display()));
        }
        return Check::warn(
            "btf",
            "cannot read runtime value under --root (no sys/kernel/btf/vmlinux, no boot/config-* with BTF)",
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        );
    }
    Check::warn(
        "btf",
        "/sys/kernel/btf/vmlinux missing: the kernel has no BTF (CO-RE programs and bpftool cannot resolve kernel types)",
        "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y",
    )
}

/// `(mount point, fstype)` of /proc/mounts.
fn mount_points(mounts: &str) -> Vec<(&str, &str)> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_, target, fstype) = (f.next()?, f.next()?, f.next()?);
            Some((target, fstype))
        })
        .collect()
}

pub fn bpffs_check(mounts: Option<&str>, under_root: bool) -> Check {
    let Some(mounts) = mounts else {
        return if under_root {
            Check::warn(
                "bpffs",
                "cannot read runtime value under --root (no proc/mounts)",
                "make sure /sys/fs/bpf is mounted at boot (kproxy load mounts it)",
            )
        } else {
            Check::warn("bpffs", "cannot read /proc/mounts", "mount -t bpf -o mode=0700 bpf /sys/fs/bpf")
        };
    };
    let points = mount_points(mounts);
    if points.iter().any(|(t, f)| *t == "/sys/fs/bpf" && *f == "bpf") {
        return Check::ok("bpffs", "bpffs mounted at /sys/fs/bpf");
    }
    let elsewhere: Vec<&str> = points.iter().filter(|(_, f)| *f == "bpf").map(|(t, _)| *t).collect();
    let also =
        if elsewhere.is_empty() { String::new() } else { format!(" (bpffs is at {})", elsewhere.join(", ")) };
    Check::warn(
        "bpffs",
        format!("no bpffs at /sys/fs/bpf{also}: pins cannot outlive the agent"),
        "mount -t bpf -o mode=0700 bpf /sys/fs/bpf (kproxy load does it) and add it to /etc/fstab",
    )
}

/// Whether pins under the pin directory outlive the process that makes them: a bpffs private
/// to this mount namespace (`ip netns exec` remounts /sys) takes the datapath with it.
pub fn bpffs_host_check(pins: &PinDir) -> Check {
    match bpf::bpffs_scope(pins.root(), false) {
        bpf::BpffsScope::Host(why) => Check::ok("bpffs-host", why),
        bpf::BpffsScope::Private(why) => Check::fail(
            "bpffs-host",
            format!(
                "{why}; pins made from here vanish with this mount namespace, the links and flows with them"
            ),
            "run kproxy in the host's mount namespace: `nsenter --net=/run/netns/NAME` enters only a network \
             namespace, `ip netns exec` also remounts /sys; a container needs the host's /sys/fs/bpf (hostPath)",
        ),
        bpf::BpffsScope::Unknown(why) => Check::warn(
            "bpffs-host",
            why,
            "make sure kproxy runs where it sees the host's /sys/fs/bpf (the host's mount namespace, or a hostPath \
             mount in a container)",
        ),
    }
}

pub fn cgroup2_check(mounts: Option<&str>, under_root: bool) -> Check {
    let Some(mounts) = mounts else {
        let finding = if under_root {
            "cannot read runtime value under --root (no proc/mounts)"
        } else {
            "cannot read /proc/mounts"
        };
        return Check::warn("cgroup2", finding, "make sure cgroup v2 is mounted (unified or hybrid layout)");
    };
    let points = mount_points(mounts);
    match points.iter().find(|(_, f)| *f == "cgroup2") {
        Some((target, _)) if *target == "/sys/fs/cgroup" => {
            Check::ok("cgroup2", "cgroup v2 mounted at /sys/fs/cgroup (unified layout)")
        }
        Some((target, _)) => Check::ok("cgroup2", format!("cgroup v2 mounted at {target} (hybrid layout)")),
        None => Check::warn(
            "cgroup2",
            "no cgroup2 mount: the socket-level load balancing (cgroup connect4/sendmsg4 hooks) cannot attach",
            "boot with systemd.unified_cgroup_hierarchy=1, or mount -t cgroup2 none /sys/fs/cgroup/unified",
        ),
    }
}
