//! Loading the object (embedded by build.rs), pinning its programs over the previous ones, and unloading.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    programs::{CgroupSockAddr, SchedClassifier, Xdp, links::PinnedLink},
};
use proxy_common::maps::*;

use super::attach::{attach_socket_lb, detach_socket_lb, move_links, move_xdp_links, remove_file_if_present};
use super::bpffs::ensure_bpffs;
use super::lock::{PinLock, lock_holder};
use super::maps::{ALL_MAPS, expected_layout};
use super::pins::{Hook, PinDir, SOCKET_PROGRAMS};

/// The eBPF object built by build.rs, embedded so a node needs one file.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

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
    load_object(&ebpf_object(), capacities, &[])
}

/// [`load_unpinned_with`] on a copy of the object that `patch` changed first: benchmarks load
/// variants of the datapath this way (another flavour of a map, in its definition).
pub fn load_unpinned_patched(
    capacities: &Capacities,
    patch: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<Ebpf> {
    let mut object = ebpf_object();
    patch(object.bytes_mut())?;
    load_object(&object, capacities, &[])
}

/// A copy of the embedded object in 8-byte aligned memory, as the ELF parser wants it. Made for
/// each load and dropped after it: kept for the process's life, it was 3 MiB of the agent's RSS
/// from its start to its end.
struct Object {
    words: Vec<u64>,
}

impl Object {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the byte view covers exactly the vector's initialised u64s.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.words.len() * 8)
        };
        &mut bytes[..EBPF_OBJECT.len()]
    }
}

impl std::ops::Deref for Object {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: as in `bytes_mut`.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.words.len() * 8) };
        &bytes[..EBPF_OBJECT.len()]
    }
}

/// The embedded object with its BTF made acceptable to the kernel ([`btf_unions_as_structs`]).
fn ebpf_object() -> Object {
    let mut object = Object { words: vec![0u64; EBPF_OBJECT.len().div_ceil(8)] };
    let bytes = object.bytes_mut();
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
    object
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
fn load_object(
    object: &[u8],
    capacities: &Capacities,
    pin_paths: &[(&'static str, PathBuf)],
) -> Result<Ebpf> {
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
        // The IPv6 twins share the sizes: one `--bpf-lb-map-max` for both families.
        .map_max_entries(proxy_common::maps_v6::MAP_SERVICES_V6, capacities.services)
        .map_max_entries(proxy_common::maps_v6::MAP_BACKENDS_V6, capacities.backends)
        .map_max_entries(proxy_common::maps_v6::MAP_REV_NAT_V6, capacities.rev_nat)
        .map_max_entries(proxy_common::maps_v6::MAP_VIPS_V6, capacities.rev_nat)
        .map_max_entries(
            MAP_MAGLEV_V4,
            capacities.maglev_tables.max(1).saturating_mul(proxy_common::maglev::MAGLEV_TABLE_SIZE),
        )
        .load(object)
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

/// Loads the programs and pins them, reusing every map that is already pinned
/// (creating and pinning the others), then moves every pinned TCX link to the
/// new programs atomically. Established flows live in the reused maps, so an
/// agent restart — or an upgrade to a kproxy with new maps — drops nothing.
/// Returns true when nothing was pinned before (a fresh load).
pub fn load(pins: &PinDir) -> Result<bool, LoadError> {
    load_with(pins, &Capacities::default())
}

/// Why [`load_with`] failed, where a caller (or a test) tells the cases apart.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A pinned map made by a kproxy whose key or value layout differs: reusing it would misread every
    /// entry, so loading stops before anything is replaced. `map` is the first such map, `also` the
    /// others (a kproxy from before 32-bit rev-NAT ids left several).
    #[error(
        "the pinned map {} has keys of {key_size} and values of {value_size} bytes, this kproxy needs {want_key} \
         and {want_value}: it was made by an incompatible kproxy{}. `kproxy unload` removes the pinned \
         datapath (established connections through Services are lost), then load again",
        path.display(),
        also_text(also)
    )]
    IncompatiblePin {
        map: &'static str,
        path: PathBuf,
        key_size: u32,
        value_size: u32,
        want_key: u32,
        want_value: u32,
        also: Vec<&'static str>,
    },
    /// Anything else: bpffs, the pin directory, the object, the verifier, pinning and attaching.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// [`load`] with map sizes (used for maps created now; reused maps keep theirs).
pub fn load_with(pins: &PinDir, capacities: &Capacities) -> Result<bool, LoadError> {
    ensure_bpffs(pins)?;
    pins.prepare()?;
    let fresh = !pins.program(PROG_INGRESS).exists();
    check_pinned_maps(pins)?;
    pin_programs(pins, capacities)?;
    Ok(fresh)
}

fn also_text(also: &[&str]) -> String {
    if also.is_empty() {
        return String::new();
    }
    let names: Vec<String> = also.iter().map(|m| m.to_lowercase()).collect();
    format!(" (so were {})", names.join(", "))
}

/// Refuses pinned maps whose layout this kproxy does not share, naming each; replaces a stats map too
/// small for today's counters.
fn check_pinned_maps(pins: &PinDir) -> Result<(), LoadError> {
    let mut refused: Option<LoadError> = None;
    let mut stale_stats = None;
    for &name in ALL_MAPS {
        let path = pins.map(name);
        let (Some((key, value)), true) = (expected_layout(name), path.exists()) else { continue };
        let info =
            aya::maps::MapInfo::from_pin(&path).with_context(|| format!("reading {}", path.display()))?;
        if name == MAP_STATS && info.max_entries() < proxy_common::stats::Stat::COUNT {
            // Made by a kproxy that knew fewer counters: counting starts afresh in one that
            // has room for all of them.
            stale_stats = Some(path);
            continue;
        }
        if (info.key_size(), info.value_size()) != (key, value) {
            match &mut refused {
                Some(LoadError::IncompatiblePin { also, .. }) => also.push(name),
                _ => {
                    refused = Some(LoadError::IncompatiblePin {
                        map: name,
                        path,
                        key_size: info.key_size(),
                        value_size: info.value_size(),
                        want_key: key,
                        want_value: value,
                        also: Vec::new(),
                    })
                }
            }
        }
    }
    if let Some(refused) = refused {
        // Nothing is replaced, the stats map neither: the operator unloads first.
        return Err(refused);
    }
    if let Some(path) = stale_stats {
        tracing::info!(map = %path.display(), "the stats map lacks newer counters: replacing it");
        remove_file_if_present(&path)?;
    }
    Ok(())
}

/// Loads the object over the pinned maps and pins its programs in place of the previous ones, moving
/// their links.
fn pin_programs(pins: &PinDir, capacities: &Capacities) -> Result<()> {
    let paths: Vec<(&str, PathBuf)> = ALL_MAPS.iter().map(|name| (*name, pins.map(name))).collect();
    let mut ebpf = load_object(&ebpf_object(), capacities, &paths)?;
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
    unload_after(pins, force, || ()).map(|(report, _)| report)
}

/// [`unload_with`], running `before_detach` once the pin directory is held and before anything
/// is detached, while the datapath still runs (`kproxy unload` hands its flows to netfilter
/// there). `None` when nothing was loaded.
pub fn unload_after<T>(
    pins: &PinDir,
    force: bool,
    before_detach: impl FnOnce() -> T,
) -> Result<(Unloaded, Option<T>)> {
    let mut report = Unloaded::default();
    if !pins.root().exists() {
        return Ok((report, None));
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
    let before = before_detach();
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
    Ok((report, Some(before)))
}

fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match fs::remove_dir(dir) {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}
