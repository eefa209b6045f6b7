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
    time::{Duration, Instant},
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

    /// The directory of the map pins (`kproxy trace` sessions lock it, see `trace.rs`).
    pub fn maps_dir(&self) -> PathBuf {
        self.root.join("maps")
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

/// The embedded object with its BTF made acceptable to the kernel ([`btf_unions_as_structs`]),
/// in 8-byte aligned memory as the ELF parser wants it.
fn ebpf_object() -> &'static [u8] {
    static OBJECT: std::sync::OnceLock<Vec<u64>> = std::sync::OnceLock::new();
    let words = OBJECT.get_or_init(|| {
        let mut words = vec![0u64; EBPF_OBJECT.len().div_ceil(8)];
        // SAFETY: the byte view covers exactly the vector's initialised u64s.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 8) };
        let bytes = &mut bytes[..EBPF_OBJECT.len()];
        bytes.copy_from_slice(EBPF_OBJECT);
        // Reordering members would change the member indexes CO-RE relocations name; aya's
        // objects have none, and an object that has some is left as it is.
        let core_relocations = elf_section(bytes, b".BTF.ext").is_some_and(|ext| {
            let ext = &bytes[ext];
            let word =
                |at: usize| ext.get(at..at + 4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")));
            word(4).is_some_and(|header_len| header_len >= 32) && word(28).is_some_and(|len| len > 0)
        });
        if let (Some(btf), false) = (elf_section(bytes, b".BTF"), core_relocations) {
            let rewritten = btf_unions_as_structs(&mut bytes[btf]);
            tracing::debug!(rewritten, "BTF: unions of Rust enums rewritten as structs");
        }
        words
    });
    // SAFETY: as above; the vector lives for the rest of the process.
    let bytes = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 8) };
    &bytes[..EBPF_OBJECT.len()]
}

/// The byte range of a section of a little-endian ELF64 object, by name.
fn elf_section(object: &[u8], name: &[u8]) -> Option<std::ops::Range<usize>> {
    if object.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let u16_at = |at: usize| Some(u16::from_le_bytes(object.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_le_bytes(object.get(at..at + 4)?.try_into().ok()?));
    let u64_at =
        |at: usize| usize::try_from(u64::from_le_bytes(object.get(at..at + 8)?.try_into().ok()?)).ok();
    let (table, entry_size) = (u64_at(0x28)?, usize::from(u16_at(0x3a)?));
    let (count, names_index) = (usize::from(u16_at(0x3c)?), usize::from(u16_at(0x3e)?));
    // (name offset, file offset, size) of section `i`.
    let header = |i: usize| {
        let at = table.checked_add(i.checked_mul(entry_size)?)?;
        Some((usize::try_from(u32_at(at)?).ok()?, u64_at(at + 24)?, u64_at(at + 32)?))
    };
    let (_, names_at, names_size) = header(names_index)?;
    let names = object.get(names_at..names_at.checked_add(names_size)?)?;
    (0..count).find_map(|i| {
        let (name_at, at, size) = header(i)?;
        let rest = names.get(name_at..)?;
        let range = at..at.checked_add(size)?;
        (rest.starts_with(name) && rest.get(name.len()) == Some(&0) && range.end <= object.len())
            .then_some(range)
    })
}

/// Rust enums that carry data (`Result<Flow, Stat>` and the like, in the signatures of the
/// programs' non-inlined functions) reach BTF as LLVM encodes a DWARF variant part: a UNION
/// of the variants plus the tag (or niche) member at its real offset. The kernel allows union
/// members only at offset 0 and so rejects the whole object BTF ("Invalid member
/// bits_offset"); aya then loads the programs without BTF and logs ~100 lines of BTF dump as a
/// warning at every start. Such a union is rewritten in place as a STRUCT with the same members
/// in offset order (a struct's members may overlap), so every offset stays true. Returns the
/// number of unions rewritten; BTF holding a kind this does not know is left alone.
pub fn btf_unions_as_structs(btf: &mut [u8]) -> usize {
    const KIND_STRUCT: u32 = 4;
    const KIND_UNION: u32 = 5;
    let u32_at = |btf: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(btf.get(at..at.checked_add(4)?)?.try_into().ok()?))
    };
    if btf.get(..2) != Some(&[0x9f, 0xeb]) {
        return 0;
    }
    let (Some(header_len), Some(types_at), Some(types_len)) =
        (u32_at(btf, 4), u32_at(btf, 8), u32_at(btf, 12))
    else {
        return 0;
    };
    let start = header_len as usize + types_at as usize;
    let end = start + types_len as usize;
    if end > btf.len() {
        return 0;
    }
    // Walk every type first: what follows a type's 12-byte header depends on its kind.
    let mut unions = Vec::new();
    let mut at = start;
    while at < end {
        let Some(info) = u32_at(btf, at + 4) else { return 0 };
        let vlen = (info & 0xffff) as usize;
        let trailing = match (info >> 24) & 0x1f {
            2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
            1 | 14 | 17 => 4,          // INT, VAR, DECL_TAG
            3 => 12,                   // ARRAY
            4 | 5 | 15 | 19 => 12 * vlen, // STRUCT, UNION, DATASEC, ENUM64
            6 | 13 => 8 * vlen,        // ENUM, FUNC_PROTO
            _ => return 0,
        };
        if (info >> 24) & 0x1f == KIND_UNION {
            unions.push((at, info, vlen));
        }
        at += 12 + trailing;
    }
    if at != end {
        return 0;
    }
    let mut rewritten = 0;
    for (at, info, vlen) in unions {
        // With the kind flag, a member's offset word holds the bitfield size in its top byte.
        let bit_offset = |member: &[u8]| {
            let word = u32::from_le_bytes(member[8..12].try_into().expect("12-byte member"));
            if info >> 31 == 1 { word & 0x00ff_ffff } else { word }
        };
        let members_at = at + 12;
        let mut members: Vec<Vec<u8>> =
            btf[members_at..members_at + 12 * vlen].chunks_exact(12).map(<[u8]>::to_vec).collect();
        if members.iter().all(|m| bit_offset(m) == 0) {
            continue;
        }
        members.sort_by_key(|m| bit_offset(m));
        btf[members_at..members_at + 12 * vlen].copy_from_slice(&members.concat());
        let info = (info & !(0x1f << 24)) | (KIND_STRUCT << 24);
        btf[at + 4..at + 8].copy_from_slice(&info.to_le_bytes());
        rewritten += 1;
    }
    rewritten
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
        .load(ebpf_object())
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
    _dir: fs::File,
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
    /// With `force`: the holder of the pin directory it was unloaded under.
    pub forced_under: Option<String>,
}

/// Detaches every program and removes every pin, then the pin directory; refused while an
/// agent holds the pin directory ([`unload_with`] can force it).
pub fn unload(pins: &PinDir) -> Result<Unloaded> {
    unload_with(pins, false)
}

/// [`unload`]; with `force` also under a running agent (stop it afterwards: it cannot serve
/// without its pins).
pub fn unload_with(pins: &PinDir, force: bool) -> Result<Unloaded> {
    let mut report = Unloaded::default();
    if !pins.root().exists() {
        return Ok(report);
    }
    // Only pins, on bpffs, in a tree nobody else controls, are deleted.
    pins.verify()?;
    let _lock = match PinLock::try_acquire(pins)? {
        Some(lock) => Some(lock),
        None if force => {
            report.forced_under = Some(lock_holder(pins.root()));
            None
        }
        None => bail!(
            "the pin directory {} is held by {}: a running kproxy agent keeps the datapath loaded. Stop it first \
             (the pins stay when it stops), or pass --force to unload under it",
            pins.root().display(),
            lock_holder(pins.root())
        ),
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// BTF with `u8` (1), `struct Ok { u32 }` (2), an enum's union whose tag sits at byte 4
    /// (3), and a plain union whose members all start at 0 (4).
    fn enum_btf() -> Vec<u8> {
        let ty = |name: u32, kind: u32, vlen: u32, size: u32| {
            [name.to_le_bytes(), ((kind << 24) | vlen).to_le_bytes(), size.to_le_bytes()].concat()
        };
        let member = |name: u32, ty: u32, bits: u32| [name, ty, bits].map(u32::to_le_bytes).concat();
        let types = [
            ty(1, 1, 0, 1),
            8u32.to_le_bytes().to_vec(),
            ty(4, 4, 1, 4),
            member(7, 1, 0),
            ty(0, 5, 2, 8),
            member(0, 1, 32),
            member(4, 2, 0),
            ty(0, 5, 2, 4),
            member(7, 1, 0),
            member(4, 2, 0),
        ]
        .concat();
        let strings = b"\0u8\0Ok\0v\0".to_vec();
        let header = [
            vec![0x9f, 0xeb, 1, 0],
            24u32.to_le_bytes().to_vec(),
            0u32.to_le_bytes().to_vec(),
            (types.len() as u32).to_le_bytes().to_vec(),
            (types.len() as u32).to_le_bytes().to_vec(),
            (strings.len() as u32).to_le_bytes().to_vec(),
        ]
        .concat();
        [header, types, strings].concat()
    }

    #[test]
    fn a_union_with_a_member_past_offset_0_becomes_a_struct_in_offset_order() {
        let mut btf = enum_btf();
        let before = btf.clone();
        assert_eq!(btf_unions_as_structs(&mut btf), 1);
        let word = |btf: &[u8], at: usize| u32::from_le_bytes(btf[at..at + 4].try_into().unwrap());
        // Type 3 starts after the header (24), type 1 (16) and type 2 (24).
        let at = 24 + 16 + 24;
        assert_eq!(word(&btf, at + 4) >> 24, 4, "now a STRUCT");
        assert_eq!(word(&btf, at + 4) & 0xffff, 2);
        assert_eq!([word(&btf, at + 16), word(&btf, at + 20)], [2, 0], "Ok at bit 0 first");
        assert_eq!([word(&btf, at + 28), word(&btf, at + 32)], [1, 32], "then the tag at bit 32");
        // The union whose members all start at 0 stays as it was, and so does everything else.
        assert_eq!(btf[..at], before[..at]);
        assert_eq!(btf[at + 36..], before[at + 36..]);
    }

    #[test]
    fn btf_of_an_unknown_kind_is_left_alone() {
        let mut btf = enum_btf();
        // Type 1's kind becomes 31, which BTF does not define.
        btf[24 + 7] = 31;
        let before = btf.clone();
        assert_eq!(btf_unions_as_structs(&mut btf), 0);
        assert_eq!(btf, before);
    }
}
