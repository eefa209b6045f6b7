//! Attaching the tc, XDP and socket programs to interfaces and cgroups, and moving links on reload.

use std::{
    collections::BTreeSet,
    ffi::CStr,
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
};

use super::pins::{Hook, PinDir, SOCKET_PROGRAMS};
use anyhow::{Context as _, Result, anyhow};
use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, SchedClassifier, Xdp,
    links::{FdLink, PinnedLink},
    xdp::{XdpLink, XdpMode},
};
use proxy_common::maps::*;

/// The cgroup2 mount point, from /proc/self/mounts.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_, target, fstype) = (fields.next(), fields.next(), fields.next());
        if fstype == Some("cgroup2") { target.map(PathBuf::from) } else { None }
    })
}

/// Link pins of the socket programs: `cgroup@<cgroup path in hex>-<program>`
/// (bpffs holds no regular files and no dots, so the path that a reload must
/// re-attach to is kept in the name).
fn socket_link(pins: &PinDir, cgroup: &Path, program: &str) -> PathBuf {
    let hex: String = cgroup.as_os_str().as_encoded_bytes().iter().map(|b| format!("{b:02x}")).collect();
    pins.links_dir().join(format!("cgroup@{hex}-{program}"))
}

/// The cgroup of a socket link pin's name.
pub fn socket_link_cgroup(name: &str) -> Option<PathBuf> {
    let hex = name.strip_prefix("cgroup@")?.split('-').next()?;
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    String::from_utf8(bytes?).ok().map(PathBuf::from)
}

/// Attaches the socket-level load balancing programs to a cgroup (v2)
/// directory and everything below it. Idempotent. Returns the hooks attached.
pub fn attach_socket_lb(pins: &PinDir, cgroup: &Path) -> Result<Vec<String>> {
    let dir = fs::File::open(cgroup).with_context(|| format!("opening the cgroup {}", cgroup.display()))?;
    fs::create_dir_all(pins.links_dir())?;
    let mut attached = Vec::new();
    for (name, attach_type) in SOCKET_PROGRAMS {
        let link_path = socket_link(pins, cgroup, name);
        if link_path.exists() {
            continue;
        }
        let mut program = CgroupSockAddr::from_pin(pins.program(name), attach_type)
            .with_context(|| format!("opening pinned program {name}"))?;
        // A BPF link takes no attach flags; links always coexist with other
        // programs (another CNI's) on the same hook.
        let id = program
            .attach(&dir, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
        let link: FdLink = program.take_link(id)?.try_into().map_err(|e| anyhow!("{e:?}"))?;
        link.pin(&link_path).with_context(|| format!("pinning {}", link_path.display()))?;
        attached.push(format!("{}/{name}", cgroup.display()));
    }
    Ok(attached)
}

/// Detaches the socket programs from every cgroup; returns the cgroups they
/// were attached to.
pub fn detach_socket_lb(pins: &PinDir) -> Result<Vec<PathBuf>> {
    let mut cgroups = BTreeSet::new();
    if let Ok(entries) = fs::read_dir(pins.links_dir()) {
        for entry in entries {
            let path = entry?.path();
            let Some(cgroup) = path.file_name().and_then(|n| socket_link_cgroup(&n.to_string_lossy())) else {
                continue;
            };
            match PinnedLink::from_pin(&path) {
                Ok(link) => drop(link.unpin()?),
                Err(_) => remove_file_if_present(&path)?,
            }
            cgroups.insert(cgroup);
        }
    }
    Ok(cgroups.into_iter().collect())
}

/// The end of an XDP link pin's name.
pub const XDP_SUFFIX: &str = "xdp";

/// Moves the pinned XDP links to a newly loaded program, as [`move_links`].
pub(super) fn move_xdp_links(pins: &PinDir, program: &mut Xdp) -> Result<()> {
    let Ok(entries) = fs::read_dir(pins.links_dir()) else { return Ok(()) };
    let suffix = format!("-{XDP_SUFFIX}");
    for entry in entries {
        let path = entry?.path();
        if !path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(&suffix)) {
            continue;
        }
        let Ok(pinned) = PinnedLink::from_pin(&path) else { continue };
        let link = XdpLink::try_from(FdLink::from(pinned)).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let id = program
            .attach_to_link(link)
            .with_context(|| format!("moving {} to the new program", path.display()))?;
        drop(program.take_link(id)?);
    }
    Ok(())
}

/// How the XDP program is attached to external interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpSetting {
    /// In the driver where it supports XDP (veth does), else generic.
    Native,
    /// Generic (skb) mode everywhere.
    Generic,
    /// No XDP: the tc program does everything.
    Off,
}

pub(super) fn remove_file_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Points every pinned link of `hook` at `program` (bpf_link_update: no
/// moment without a program on the interface).
pub(super) fn move_links(pins: &PinDir, hook: Hook, program: &mut SchedClassifier) -> Result<()> {
    let Ok(entries) = fs::read_dir(pins.links_dir()) else { return Ok(()) };
    let suffix = format!("-{}", hook.suffix());
    for entry in entries {
        let path = entry?.path();
        if !path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(&suffix)) {
            continue;
        }
        let Ok(pinned) = PinnedLink::from_pin(&path) else { continue };
        let link = aya::programs::tc::SchedClassifierLink::try_from(FdLink::from(pinned))
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let id = program
            .attach_to_link(link)
            .with_context(|| format!("moving {} to the new program", path.display()))?;
        // The pin keeps the link; this process's handle can go.
        drop(program.take_link(id)?);
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interface {
    pub name: String,
    pub index: u32,
}

/// Interfaces of the network namespace this process runs in (netlink-backed
/// `if_nameindex`, unlike /sys/class/net which shows the namespace sysfs was
/// mounted in).
pub fn interfaces() -> Result<Vec<Interface>> {
    // SAFETY: if_nameindex returns a NULL-terminated array we free below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return Err(std::io::Error::last_os_error()).context("if_nameindex");
        }
        let mut out = Vec::new();
        let mut cursor = list;
        while (*cursor).if_index != 0 && !(*cursor).if_name.is_null() {
            let name = CStr::from_ptr((*cursor).if_name).to_string_lossy().into_owned();
            out.push(Interface { name, index: (*cursor).if_index });
            cursor = cursor.add(1);
        }
        libc::if_freenameindex(list);
        out.sort();
        Ok(out)
    }
}

/// Interface name globs (`veth*`, `cali*`); an interface matching any is a
/// pod-facing interface.
#[derive(Clone, Debug)]
pub struct InterfaceSelector {
    pub(super) patterns: Vec<glob::Pattern>,
}

impl InterfaceSelector {
    pub fn new(globs: &[String]) -> Result<Self> {
        let patterns = globs
            .iter()
            .map(|g| glob::Pattern::new(g).with_context(|| format!("--interfaces {g:?} is not a valid glob")))
            .collect::<Result<_>>()?;
        Ok(Self { patterns })
    }

    pub fn matches(&self, name: &str) -> bool {
        self.patterns.iter().any(|p| p.matches(name))
    }
}

/// Result of one attach pass.
#[derive(Debug, Default)]
pub struct AttachReport {
    pub attached: Vec<String>,
    pub already: usize,
    pub pruned: Vec<String>,
    pub failed: Vec<(String, String)>,
}

/// Attaches both programs to every matching interface that lacks them, and
/// forgets link pins whose interface is gone. Idempotent; safe to call often.
pub fn attach_matching(pins: &PinDir, selector: &InterfaceSelector) -> Result<AttachReport> {
    attach_all(pins, selector, &[], XdpSetting::Off, &BTreeSet::new())
}

/// Like [`attach_matching`], and also the external programs to the
/// interfaces named in `external` (interfaces that are both get the pod
/// programs only). Pod interfaces named in `untranslated` (pods the socket
/// hooks cover, `--pod-veth-tc auto`) get no program, and lose the ones they
/// had.
pub fn attach_all(
    pins: &PinDir,
    selector: &InterfaceSelector,
    external: &[String],
    xdp: XdpSetting,
    untranslated: &BTreeSet<String>,
) -> Result<AttachReport> {
    let mut report = AttachReport::default();
    let present = interfaces()?;
    let wanted = wanted_hooks(&present, selector, external, untranslated);
    let mut expected: BTreeSet<PathBuf> =
        wanted.iter().flat_map(|(i, hooks)| hooks.iter().map(|h| pins.link(i, *h))).collect();
    let xdp_targets: Vec<&Interface> = match xdp {
        XdpSetting::Off => Vec::new(),
        _ => wanted.iter().filter(|(_, hooks)| *hooks == Hook::EXTERNAL).map(|(i, _)| *i).collect(),
    };
    expected.extend(xdp_targets.iter().map(|i| pins.xdp_link(i)));

    prune_links(pins, &expected, &mut report)?;
    attach_tc_hooks(pins, wanted, &mut report)?;
    attach_xdp_hooks(pins, xdp_targets, xdp, &mut report)?;
    Ok(report)
}

/// The tc hooks each present interface gets: the pod hooks where the selector matches (none
/// where the pod is `untranslated`: its sockets are translated by the socket hooks), else the
/// external ones where it is named external.
fn wanted_hooks<'i>(
    present: &'i [Interface],
    selector: &InterfaceSelector,
    external: &[String],
    untranslated: &BTreeSet<String>,
) -> Vec<(&'i Interface, &'static [Hook])> {
    let mut wanted: Vec<(&Interface, &[Hook])> = Vec::new();
    for iface in present {
        if selector.matches(&iface.name) {
            if !untranslated.contains(&iface.name) {
                wanted.push((iface, &Hook::POD));
            }
        } else if external.contains(&iface.name) {
            wanted.push((iface, &Hook::EXTERNAL));
        }
    }
    wanted
}

/// Removes the pinned interface links that are not `expected`, leaving the cgroup ones.
fn prune_links(pins: &PinDir, expected: &BTreeSet<PathBuf>, report: &mut AttachReport) -> Result<()> {
    fs::create_dir_all(pins.links_dir())?;
    for entry in fs::read_dir(pins.links_dir())? {
        let path = entry?.path();
        // Socket programs are attached to cgroups, not interfaces.
        let socket_link = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("cgroup@"));
        if !expected.contains(&path) && !socket_link {
            // The interface is gone (or renamed): its link is already
            // detached by the kernel or no longer wanted.
            if let Ok(link) = PinnedLink::from_pin(&path) {
                drop(link.unpin()?);
            } else {
                let _ = fs::remove_file(&path);
            }
            report.pruned.push(path.file_name().unwrap_or_default().to_string_lossy().into_owned());
        }
    }
    Ok(())
}

/// Attaches each wanted tc hook that has no pinned link yet, opening each pinned program once.
fn attach_tc_hooks(
    pins: &PinDir,
    wanted: Vec<(&Interface, &[Hook])>,
    report: &mut AttachReport,
) -> Result<()> {
    let mut programs: Vec<Option<SchedClassifier>> = vec![None, None, None];
    for (iface, hooks) in wanted {
        for &hook in hooks {
            let slot = Hook::ALL.iter().position(|h| *h == hook).expect("every hook is in ALL");
            let link_path = pins.link(iface, hook);
            if link_path.exists() {
                report.already += 1;
                continue;
            }
            let program = match &mut programs[slot] {
                Some(p) => p,
                empty => empty.insert(
                    SchedClassifier::from_pin(pins.program(hook.program()))
                        .with_context(|| format!("opening pinned program {}", hook.program()))?,
                ),
            };
            let label = format!("{}/{}", iface.name, hook.suffix());
            match attach_one(program, iface, hook, &link_path) {
                Ok(()) => report.attached.push(label),
                Err(e) => report.failed.push((label, format!("{e:#}"))),
            }
        }
    }
    Ok(())
}

/// Attaches XDP to each target that has no pinned link yet, opening the pinned program once.
fn attach_xdp_hooks(
    pins: &PinDir,
    xdp_targets: Vec<&Interface>,
    xdp: XdpSetting,
    report: &mut AttachReport,
) -> Result<()> {
    let mut xdp_program: Option<Xdp> = None;
    for iface in xdp_targets {
        let link_path = pins.xdp_link(iface);
        if link_path.exists() {
            report.already += 1;
            continue;
        }
        let program = match &mut xdp_program {
            Some(p) => p,
            empty => empty.insert(
                Xdp::from_pin(pins.program(PROG_XDP), aya_obj::programs::XdpAttachType::Interface)
                    .with_context(|| format!("opening pinned program {PROG_XDP}"))?,
            ),
        };
        match attach_xdp(program, iface, xdp, &link_path) {
            Ok(mode) => report.attached.push(format!("{}/xdp ({mode})", iface.name)),
            Err(e) => report.failed.push((format!("{}/xdp", iface.name), format!("{e:#}"))),
        }
    }
    Ok(())
}

/// Attaches XDP in the driver when asked and supported, else in generic
/// mode; returns the mode used.
fn attach_xdp(
    program: &mut Xdp,
    iface: &Interface,
    setting: XdpSetting,
    link_path: &Path,
) -> Result<&'static str> {
    let (id, mode) = match setting {
        XdpSetting::Native => match program.attach(&iface.name, XdpMode::Driver) {
            Ok(id) => (id, "native"),
            Err(native) => {
                tracing::info!(interface = %iface.name, error = %native, "no native XDP; using generic mode");
                (program.attach(&iface.name, XdpMode::Skb)?, "generic")
            }
        },
        _ => (program.attach(&iface.name, XdpMode::Skb)?, "generic"),
    };
    let link: FdLink = program.take_link(id)?.try_into().map_err(|e| anyhow!("{e:?}"))?;
    link.pin(link_path).with_context(|| format!("pinning {}", link_path.display()))?;
    Ok(mode)
}

fn attach_one(program: &mut SchedClassifier, iface: &Interface, hook: Hook, link_path: &Path) -> Result<()> {
    let id = program.attach(&iface.name, hook.attach_type())?;
    let link: FdLink = program.take_link(id)?.try_into().map_err(|e| anyhow!("{e:?}"))?;
    link.pin(link_path).with_context(|| format!("pinning {}", link_path.display()))?;
    Ok(())
}
