//! Loading, pinning, attaching and unloading the kernel programs.
//!
//! Layout under the pin directory (default `/sys/fs/bpf/kproxy`):
//! `maps/<map>`, `progs/<program>`, `links/<ifname>@<ifindex>-<ingress|egress>`.
//! Everything the datapath needs survives the process: an agent restart (or
//! crash) drops no established flow.

use std::{
    collections::BTreeSet,
    ffi::CStr,
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray},
    programs::{
        CgroupAttachMode, CgroupSockAddr, SchedClassifier, TcAttachType, Xdp,
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpMode},
    },
};
use aya_obj::programs::CgroupSockAddrAttachType;
use proxy_common::maps::*;

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kproxy";
const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// The eBPF object built by build.rs, embedded so a node needs one file.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

const ALL_MAPS: [&str; 19] = [
    proxy_common::trace::MAP_EVENTS,
    proxy_common::trace::MAP_TRACE,
    MAP_SERVICES_V4,
    MAP_BACKENDS_V4,
    MAP_REV_NAT_V4,
    MAP_CONNTRACK_V4,
    MAP_STATS,
    MAP_FRONTEND_NAMES_V4,
    MAP_CONFIG,
    MAP_AFFINITY_V4,
    MAP_VIPS_V4,
    MAP_SNAT_V4,
    MAP_SOURCE_RANGES_V4,
    MAP_EXTERNAL_IFACES,
    MAP_NODEPORT_CONFIG,
    MAP_SOCK_REVNAT_V4,
    MAP_SOCKET_LB_CONFIG,
    MAP_MAGLEV_V4,
    MAP_FRAGMENTS_V4,
];

/// The socket-level load balancing programs and their hooks.
pub const SOCKET_PROGRAMS: [(&str, CgroupSockAddrAttachType); 4] = [
    (PROG_CONNECT4, CgroupSockAddrAttachType::Connect4),
    (PROG_SENDMSG4, CgroupSockAddrAttachType::UDPSendMsg4),
    (PROG_RECVMSG4, CgroupSockAddrAttachType::UDPRecvMsg4),
    (PROG_GETPEERNAME4, CgroupSockAddrAttachType::GetPeerName4),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    /// tc ingress of a pod's host-side veth: packets leaving the pod (DNAT).
    Ingress,
    /// tc egress of a pod's veth or of an external interface: replies
    /// un-NATed on their way to the client.
    Egress,
    /// tc ingress of an external interface: NodePort, ExternalIP, LB traffic.
    ExternalIngress,
}

impl Hook {
    pub const ALL: [Hook; 3] = [Hook::Ingress, Hook::Egress, Hook::ExternalIngress];
    /// The hooks of a pod-facing interface.
    pub const POD: [Hook; 2] = [Hook::Ingress, Hook::Egress];
    /// The hooks of an external interface.
    pub const EXTERNAL: [Hook; 2] = [Hook::ExternalIngress, Hook::Egress];

    pub fn program(self) -> &'static str {
        match self {
            Hook::Ingress => PROG_INGRESS,
            Hook::Egress => PROG_EGRESS,
            Hook::ExternalIngress => PROG_EXTERNAL_INGRESS,
        }
    }

    /// The end of a link pin's name; no suffix is the end of another.
    pub fn suffix(self) -> &'static str {
        match self {
            Hook::Ingress => "ingress",
            Hook::Egress => "egress",
            Hook::ExternalIngress => "external",
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress | Hook::ExternalIngress => TcAttachType::Ingress,
            Hook::Egress => TcAttachType::Egress,
        }
    }
}

/// Paths of the pins of one kproxy instance.
#[derive(Clone, Debug)]
pub struct PinDir {
    root: PathBuf,
}

impl PinDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.root.join("maps").join(name.to_ascii_lowercase())
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.root.join("progs").join(name)
    }

    fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }

    /// The directories kproxy creates, reads and deletes pins in.
    fn tree(&self) -> [PathBuf; 4] {
        [self.root.clone(), self.root.join("links"), self.root.join("maps"), self.root.join("progs")]
    }

    /// Refuses a pin directory that could be turned against the host: bpffs at
    /// /sys/fs/bpf is world-writable (mode 1777 unless mounted with `mode=`), so
    /// a user could create it first, with `links` a symlink to a root-only
    /// directory whose files the agent would then delete. Each directory of the
    /// tree must be a real directory (not a symlink), owned by this user,
    /// writable by nobody else, on a bpf filesystem; the path is named
    /// otherwise. Once verified, nobody else can change the tree: its
    /// directories are ours and closed to others, and /sys/fs/bpf is sticky.
    pub fn verify(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt as _;
        // SAFETY: a syscall without arguments.
        let euid = unsafe { libc::geteuid() };
        for dir in self.tree() {
            let meta = match fs::symlink_metadata(&dir) {
                Ok(meta) => meta,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(e).with_context(|| format!("checking the pin directory {}", dir.display()));
                }
            };
            if meta.file_type().is_symlink() {
                bail!("refusing the pin directory {}: it is a symbolic link", dir.display());
            }
            if !meta.is_dir() {
                bail!("refusing the pin directory {}: it is not a directory", dir.display());
            }
            if meta.uid() != euid {
                bail!(
                    "refusing the pin directory {}: it belongs to uid {}, not to this process (uid {euid}); \
                     remove it and let kproxy create it",
                    dir.display(),
                    meta.uid()
                );
            }
            if meta.mode() & 0o022 != 0 {
                bail!(
                    "refusing the pin directory {}: others may write to it (mode {:o}); remove it and let kproxy \
                     create it",
                    dir.display(),
                    meta.mode() & 0o7777
                );
            }
            if !on_bpffs(&dir)? {
                bail!("refusing the pin directory {}: it is not on a bpf filesystem", dir.display());
            }
        }
        Ok(())
    }

    /// Creates the tree (mode 0700) where it is missing, then [`PinDir::verify`]s it.
    pub fn prepare(&self) -> Result<()> {
        use std::os::unix::fs::DirBuilderExt as _;
        self.verify()?;
        for dir in self.tree() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .with_context(|| format!("creating {}", dir.display()))?;
        }
        self.verify()
    }

    pub fn xdp_link(&self, iface: &Interface) -> PathBuf {
        let name = iface.name.replace('.', "%2E");
        self.links_dir().join(format!("{name}@{}-{XDP_SUFFIX}", iface.index))
    }

    pub fn link(&self, iface: &Interface, hook: Hook) -> PathBuf {
        // bpffs refuses names with a dot (reserved by the kernel), and
        // interface names may have one (eth0.100).
        let name = iface.name.replace('.', "%2E");
        self.links_dir().join(format!("{name}@{}-{}", iface.index, hook.suffix()))
    }

    /// True when the programs and maps are pinned.
    pub fn is_loaded(&self) -> bool {
        Hook::ALL.iter().all(|h| self.program(h.program()).exists())
            && self.program(PROG_XDP).exists()
            && ALL_MAPS.iter().all(|m| self.map(m).exists())
    }
}

/// Map sizes, fixed when the datapath is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// Entries of the services map: one per frontend plus one per backend slot.
    pub services: u32,
    pub backends: u32,
    /// Frontends (rev-NAT ids; also the names map).
    pub rev_nat: u32,
    /// Conntrack entries (two per translated flow); LRU evicts beyond it.
    pub conntrack: u32,
    /// sessionAffinity entries (client × frontend); LRU.
    pub affinity: u32,
    /// Maglev tables (of MAGLEV_TABLE_SIZE entries) in MAGLEV_V4.
    pub maglev_tables: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Self {
            services: SERVICES_V4_CAPACITY,
            backends: BACKENDS_V4_CAPACITY,
            rev_nat: REV_NAT_V4_CAPACITY,
            conntrack: CONNTRACK_V4_CAPACITY,
            affinity: AFFINITY_V4_CAPACITY,
            maglev_tables: 1,
        }
    }
}

/// Level of the datapath's aya-log records, fixed when the programs are
/// loaded: 0 (off, the default — the verifier removes the logging code
/// paths), or 4 for debug.
static BPF_LOG_LEVEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Enables (or disables) the datapath's debug log for programs loaded from now on.
pub fn set_bpf_debug_log(on: bool) {
    BPF_LOG_LEVEL.store(if on { 4 } else { 0 }, std::sync::atomic::Ordering::Relaxed);
}

/// Loads the embedded object without pinning anything: for BPF_PROG_TEST_RUN
/// tests and benchmarks, which must not touch a running datapath.
pub fn load_unpinned() -> Result<Ebpf> {
    load_unpinned_with(&Capacities::default())
}

pub fn load_unpinned_with(capacities: &Capacities) -> Result<Ebpf> {
    load_object(capacities, &[])
}

/// Loads the object and its programs; maps named in `pin_paths` are reused
/// from (or created and pinned at) those paths.
fn load_object(capacities: &Capacities, pin_paths: &[(&'static str, PathBuf)]) -> Result<Ebpf> {
    if EBPF_OBJECT.is_empty() {
        bail!("this kproxy was built with AYA_BUILD_SKIP: it carries no eBPF programs");
    }
    let log_level = BPF_LOG_LEVEL.load(std::sync::atomic::Ordering::Relaxed);
    let mut loader = EbpfLoader::new();
    for (name, path) in pin_paths {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader
        .override_global("AYA_LOG_LEVEL", &log_level, true)
        .map_max_entries(MAP_SERVICES_V4, capacities.services)
        .map_max_entries(MAP_BACKENDS_V4, capacities.backends)
        .map_max_entries(MAP_REV_NAT_V4, capacities.rev_nat)
        .map_max_entries(MAP_FRONTEND_NAMES_V4, capacities.rev_nat)
        .map_max_entries(MAP_CONNTRACK_V4, capacities.conntrack)
        .map_max_entries(MAP_SNAT_V4, capacities.conntrack)
        .map_max_entries(MAP_AFFINITY_V4, capacities.affinity)
        .map_max_entries(MAP_VIPS_V4, capacities.rev_nat)
        .map_max_entries(
            MAP_MAGLEV_V4,
            capacities.maglev_tables.max(1).saturating_mul(proxy_common::maglev::MAGLEV_TABLE_SIZE),
        )
        .load(EBPF_OBJECT)
        .context("loading the eBPF object")?;
    for hook in Hook::ALL {
        let program: &mut SchedClassifier = ebpf
            .program_mut(hook.program())
            .ok_or_else(|| anyhow!("program {} missing from the object", hook.program()))?
            .try_into()?;
        program.load().with_context(|| format!("verifier rejected {}", hook.program()))?;
    }
    let xdp: &mut Xdp = ebpf
        .program_mut(PROG_XDP)
        .ok_or_else(|| anyhow!("program {PROG_XDP} missing from the object"))?
        .try_into()?;
    xdp.load().with_context(|| format!("verifier rejected {PROG_XDP}"))?;
    for (name, _) in SOCKET_PROGRAMS {
        let program: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?
            .try_into()?;
        program.load().with_context(|| format!("verifier rejected {name}"))?;
    }
    Ok(ebpf)
}

/// Whether `path` is on a bpf filesystem (statfs magic BPF_FS_MAGIC).
fn on_bpffs(path: &Path) -> Result<bool> {
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
pub fn ensure_bpffs(pins: &PinDir) -> Result<()> {
    if !pins.root().starts_with(BPFFS_MOUNT) {
        return Ok(());
    }
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let mounted = mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (_, target, fstype) = (fields.next(), fields.next(), fields.next());
        target == Some(BPFFS_MOUNT) && fstype == Some("bpf")
    });
    if mounted {
        return Ok(());
    }
    tracing::info!("mounting bpffs at {BPFFS_MOUNT}");
    let status = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf", BPFFS_MOUNT])
        .status()
        .context("running mount")?;
    if !status.success() {
        bail!("mount -t bpf bpf {BPFFS_MOUNT} failed ({status})");
    }
    Ok(())
}

/// Loads the programs and pins them, reusing every map that is already pinned
/// (creating and pinning the others), then moves every pinned TCX link to the
/// new programs atomically. Established flows live in the reused maps, so an
/// agent restart — or an upgrade to a kproxy with new maps — drops nothing.
/// Returns true when nothing was pinned before (a fresh load).
pub fn load(pins: &PinDir) -> Result<bool> {
    load_with(pins, &Capacities::default())
}

/// Key and value sizes of each map, to refuse reusing a pinned map whose
/// layout this kproxy does not share.
fn expected_layout(name: &str) -> Option<(u32, u32)> {
    use std::mem::size_of;
    let sizes = |k: usize, v: usize| Some((k as u32, v as u32));
    match name {
        MAP_SERVICES_V4 => sizes(size_of::<ServiceKeyV4>(), size_of::<ServiceValueV4>()),
        MAP_BACKENDS_V4 => sizes(size_of::<u32>(), size_of::<BackendV4>()),
        MAP_REV_NAT_V4 => sizes(size_of::<u16>(), size_of::<RevNatV4>()),
        MAP_FRONTEND_NAMES_V4 => sizes(size_of::<u16>(), size_of::<FrontendNameV4>()),
        MAP_CONNTRACK_V4 => sizes(size_of::<CtKeyV4>(), size_of::<CtEntryV4>()),
        MAP_CONFIG => sizes(size_of::<u32>(), size_of::<ConfigV4>()),
        MAP_AFFINITY_V4 => sizes(size_of::<AffinityKeyV4>(), size_of::<AffinityValueV4>()),
        MAP_VIPS_V4 => sizes(4, size_of::<VipV4>()),
        MAP_STATS => sizes(size_of::<u32>(), size_of::<u64>()),
        MAP_SNAT_V4 => sizes(size_of::<CtKeyV4>(), size_of::<SnatEntryV4>()),
        MAP_SOURCE_RANGES_V4 => sizes(4 + size_of::<SourceRangeV4>(), 1),
        MAP_EXTERNAL_IFACES => sizes(size_of::<u32>(), size_of::<ExternalIfaceV4>()),
        MAP_NODEPORT_CONFIG => sizes(size_of::<u32>(), size_of::<NodePortConfigV4>()),
        MAP_SOCK_REVNAT_V4 => sizes(size_of::<SockRevNatKeyV4>(), size_of::<SockRevNatV4>()),
        MAP_SOCKET_LB_CONFIG => sizes(size_of::<u32>(), size_of::<SocketLbConfigV4>()),
        MAP_MAGLEV_V4 => sizes(size_of::<u32>(), size_of::<u32>()),
        MAP_FRAGMENTS_V4 => sizes(size_of::<FragmentKeyV4>(), size_of::<FragmentPortsV4>()),
        proxy_common::trace::MAP_TRACE => {
            sizes(size_of::<u32>(), size_of::<proxy_common::trace::TraceConfig>())
        }
        _ => None,
    }
}

/// [`load`] with map sizes (used for maps created now; reused maps keep theirs).
pub fn load_with(pins: &PinDir, capacities: &Capacities) -> Result<bool> {
    ensure_bpffs(pins)?;
    pins.prepare()?;
    let fresh = !pins.program(PROG_INGRESS).exists();
    for name in ALL_MAPS {
        let path = pins.map(name);
        let (Some((key, value)), true) = (expected_layout(name), path.exists()) else { continue };
        let info =
            aya::maps::MapInfo::from_pin(&path).with_context(|| format!("reading {}", path.display()))?;
        if name == MAP_STATS && info.max_entries() < proxy_common::stats::Stat::COUNT {
            // Made by a kproxy that knew fewer counters: counting starts afresh in one that
            // has room for all of them.
            tracing::info!(map = %path.display(), "the stats map lacks newer counters: replacing it");
            remove_file_if_present(&path)?;
            continue;
        }
        if (info.key_size(), info.value_size()) != (key, value) {
            bail!(
                "the pinned map {} has keys of {} and values of {} bytes, this kproxy needs {key} and {value}: \
                 it was made by an incompatible kproxy. `kproxy unload` removes it (established connections through \
                 Services are lost), then load again",
                path.display(),
                info.key_size(),
                info.value_size()
            );
        }
    }
    let paths: Vec<(&str, PathBuf)> = ALL_MAPS.iter().map(|name| (*name, pins.map(name))).collect();
    let mut ebpf = load_object(capacities, &paths)?;
    for hook in Hook::ALL {
        let program: &mut SchedClassifier =
            ebpf.program_mut(hook.program()).expect("loaded above").try_into()?;
        let path = pins.program(hook.program());
        // The old program stays alive through its links until they move.
        remove_file_if_present(&path)?;
        program.pin(&path).with_context(|| format!("pinning {}", path.display()))?;
        move_links(pins, hook, program)?;
    }
    let xdp: &mut Xdp = ebpf.program_mut(PROG_XDP).expect("loaded above").try_into()?;
    let path = pins.program(PROG_XDP);
    remove_file_if_present(&path)?;
    xdp.pin(&path).with_context(|| format!("pinning {}", path.display()))?;
    move_xdp_links(pins, xdp)?;
    let cgroups = detach_socket_lb(pins)?;
    for (name, _) in SOCKET_PROGRAMS {
        let program: &mut CgroupSockAddr = ebpf.program_mut(name).expect("loaded above").try_into()?;
        let path = pins.program(name);
        remove_file_if_present(&path)?;
        program.pin(&path).with_context(|| format!("pinning {}", path.display()))?;
    }
    // Socket hooks are re-attached rather than moved: between the two, new
    // sockets are translated per packet by the tc programs instead.
    for cgroup in cgroups {
        attach_socket_lb(pins, &cgroup)?;
    }
    Ok(fresh)
}

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
fn socket_link_cgroup(name: &str) -> Option<PathBuf> {
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
fn move_xdp_links(pins: &PinDir, program: &mut Xdp) -> Result<()> {
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

fn remove_file_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Points every pinned link of `hook` at `program` (bpf_link_update: no
/// moment without a program on the interface).
fn move_links(pins: &PinDir, hook: Hook, program: &mut SchedClassifier) -> Result<()> {
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

/// What `unload` removed.
#[derive(Debug, Default)]
pub struct Unloaded {
    pub links: Vec<String>,
    pub pins: usize,
}

/// Detaches every program and removes every pin, then the pin directory.
pub fn unload(pins: &PinDir) -> Result<Unloaded> {
    let mut report = Unloaded::default();
    if !pins.root().exists() {
        return Ok(report);
    }
    // Only pins, on bpffs, in a tree nobody else controls, are deleted.
    pins.verify()?;
    if let Ok(entries) = fs::read_dir(pins.links_dir()) {
        for entry in entries {
            let path = entry?.path();
            // Dropping the last reference to a TCX link detaches it.
            match PinnedLink::from_pin(&path) {
                Ok(link) => drop(link.unpin()?),
                Err(_) => fs::remove_file(&path)?,
            }
            report.links.push(path.file_name().unwrap_or_default().to_string_lossy().into_owned());
        }
    }
    for sub in ["links", "progs", "maps"] {
        let dir = pins.root().join(sub);
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries {
                fs::remove_file(entry?.path())?;
                report.pins += 1;
            }
        }
        remove_dir_if_present(&dir)?;
    }
    remove_dir_if_present(pins.root())?;
    Ok(report)
}

fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match fs::remove_dir(dir) {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
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
    patterns: Vec<glob::Pattern>,
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
    attach_all(pins, selector, &[], XdpSetting::Off)
}

/// Like [`attach_matching`], and also the external programs to the
/// interfaces named in `external` (interfaces that are both get the pod
/// programs only).
pub fn attach_all(
    pins: &PinDir,
    selector: &InterfaceSelector,
    external: &[String],
    xdp: XdpSetting,
) -> Result<AttachReport> {
    let mut report = AttachReport::default();
    let present = interfaces()?;
    let mut wanted: Vec<(&Interface, &[Hook])> = Vec::new();
    for iface in &present {
        if selector.matches(&iface.name) {
            wanted.push((iface, &Hook::POD));
        } else if external.contains(&iface.name) {
            wanted.push((iface, &Hook::EXTERNAL));
        }
    }
    let mut expected: BTreeSet<PathBuf> =
        wanted.iter().flat_map(|(i, hooks)| hooks.iter().map(|h| pins.link(i, *h))).collect();
    let xdp_targets: Vec<&Interface> = match xdp {
        XdpSetting::Off => Vec::new(),
        _ => wanted.iter().filter(|(_, hooks)| *hooks == Hook::EXTERNAL).map(|(i, _)| *i).collect(),
    };
    expected.extend(xdp_targets.iter().map(|i| pins.xdp_link(i)));

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
    Ok(report)
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

/// Typed handles on the maps, from pins or from a freshly loaded object.
pub struct Maps {
    pub services: HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
    pub backends: HashMap<MapData, u32, BackendV4>,
    pub rev_nat: HashMap<MapData, u16, RevNatV4>,
    pub names: HashMap<MapData, u16, FrontendNameV4>,
    pub conntrack: HashMap<MapData, CtKeyV4, CtEntryV4>,
    pub stats: PerCpuArray<MapData, u64>,
    pub config: Array<MapData, ConfigV4>,
    pub affinity: HashMap<MapData, AffinityKeyV4, AffinityValueV4>,
    pub vips: HashMap<MapData, [u8; 4], VipV4>,
    pub snat: HashMap<MapData, CtKeyV4, SnatEntryV4>,
    pub source_ranges: LpmTrie<MapData, SourceRangeV4, u8>,
    pub external_ifaces: HashMap<MapData, u32, ExternalIfaceV4>,
    pub nodeport_config: Array<MapData, NodePortConfigV4>,
    pub sock_revnat: HashMap<MapData, SockRevNatKeyV4, SockRevNatV4>,
    pub socket_lb_config: Array<MapData, SocketLbConfigV4>,
    pub maglev: Array<MapData, u32>,
}

fn open_pinned(pins: &PinDir, name: &str) -> Result<MapData> {
    let path = pins.map(name);
    MapData::from_pin(&path)
        .with_context(|| format!("opening {} (is kproxy loaded? run `kproxy load`)", path.display()))
}

/// The pinned `SOCK_REVNAT_V4` alone (the agent consults it when destroying sockets).
pub fn open_sock_revnat(pins: &PinDir) -> Result<HashMap<MapData, SockRevNatKeyV4, SockRevNatV4>> {
    Ok(HashMap::try_from(Map::LruHashMap(open_pinned(pins, MAP_SOCK_REVNAT_V4)?))?)
}

impl Maps {
    pub fn from_pins(pins: &PinDir) -> Result<Self> {
        let open = |name: &str| open_pinned(pins, name);
        Ok(Self {
            services: HashMap::try_from(Map::HashMap(open(MAP_SERVICES_V4)?))?,
            backends: HashMap::try_from(Map::HashMap(open(MAP_BACKENDS_V4)?))?,
            rev_nat: HashMap::try_from(Map::HashMap(open(MAP_REV_NAT_V4)?))?,
            names: HashMap::try_from(Map::HashMap(open(MAP_FRONTEND_NAMES_V4)?))?,
            conntrack: HashMap::try_from(Map::LruHashMap(open(MAP_CONNTRACK_V4)?))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(open(MAP_STATS)?))?,
            config: Array::try_from(Map::Array(open(MAP_CONFIG)?))?,
            affinity: HashMap::try_from(Map::LruHashMap(open(MAP_AFFINITY_V4)?))?,
            vips: HashMap::try_from(Map::HashMap(open(MAP_VIPS_V4)?))?,
            snat: HashMap::try_from(Map::LruHashMap(open(MAP_SNAT_V4)?))?,
            source_ranges: LpmTrie::try_from(Map::LpmTrie(open(MAP_SOURCE_RANGES_V4)?))?,
            external_ifaces: HashMap::try_from(Map::HashMap(open(MAP_EXTERNAL_IFACES)?))?,
            nodeport_config: Array::try_from(Map::Array(open(MAP_NODEPORT_CONFIG)?))?,
            sock_revnat: HashMap::try_from(Map::LruHashMap(open(MAP_SOCK_REVNAT_V4)?))?,
            socket_lb_config: Array::try_from(Map::Array(open(MAP_SOCKET_LB_CONFIG)?))?,
            maglev: Array::try_from(Map::Array(open(MAP_MAGLEV_V4)?))?,
        })
    }

    /// Takes the maps out of an object from [`load_unpinned`].
    pub fn from_ebpf(ebpf: &mut Ebpf) -> Result<Self> {
        let mut take = |name: &str| ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} missing"));
        Ok(Self {
            services: HashMap::try_from(take(MAP_SERVICES_V4)?)?,
            backends: HashMap::try_from(take(MAP_BACKENDS_V4)?)?,
            rev_nat: HashMap::try_from(take(MAP_REV_NAT_V4)?)?,
            names: HashMap::try_from(take(MAP_FRONTEND_NAMES_V4)?)?,
            conntrack: HashMap::try_from(take(MAP_CONNTRACK_V4)?)?,
            stats: PerCpuArray::try_from(take(MAP_STATS)?)?,
            config: Array::try_from(take(MAP_CONFIG)?)?,
            affinity: HashMap::try_from(take(MAP_AFFINITY_V4)?)?,
            vips: HashMap::try_from(take(MAP_VIPS_V4)?)?,
            snat: HashMap::try_from(take(MAP_SNAT_V4)?)?,
            source_ranges: LpmTrie::try_from(take(MAP_SOURCE_RANGES_V4)?)?,
            external_ifaces: HashMap::try_from(take(MAP_EXTERNAL_IFACES)?)?,
            nodeport_config: Array::try_from(take(MAP_NODEPORT_CONFIG)?)?,
            sock_revnat: HashMap::try_from(take(MAP_SOCK_REVNAT_V4)?)?,
            socket_lb_config: Array::try_from(take(MAP_SOCKET_LB_CONFIG)?)?,
            maglev: Array::try_from(take(MAP_MAGLEV_V4)?)?,
        })
    }
}

/// Forwards the datapath's aya-log records (debug level, when loaded with
/// it) to this process's log. Polled; returns when `stop` is set.
pub fn forward_bpf_logs(pins: &PinDir, stop: &std::sync::atomic::AtomicBool) -> Result<()> {
    let program = SchedClassifier::from_pin(pins.program(PROG_INGRESS))?;
    let id = program.info()?.id();
    let mut logger =
        aya_log::EbpfLogger::init_from_id(id).map_err(|e| anyhow!("attaching to the datapath log: {e}"))?;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        logger.flush();
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}
