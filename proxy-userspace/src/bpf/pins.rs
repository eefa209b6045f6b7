//! The pin directory: where programs, maps and links are pinned, and the hooks the links name.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::programs::TcAttachType;
use aya_obj::programs::CgroupSockAddrAttachType;
use proxy_common::maps::*;
use proxy_common::sock_v6::{PROG_CONNECT6, PROG_GETPEERNAME6, PROG_RECVMSG6, PROG_SENDMSG6};

use super::attach::{Interface, XDP_SUFFIX};
use super::bpffs::on_bpffs;
use super::maps::ALL_MAPS;

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kproxy";

/// The socket-level load balancing programs and their hooks: IPv4 sockets', then IPv6 sockets'
/// (which reach IPv4 Services by their IPv4-mapped addresses too).
pub const SOCKET_PROGRAMS: [(&str, CgroupSockAddrAttachType); 8] = [
    (PROG_CONNECT4, CgroupSockAddrAttachType::Connect4),
    (PROG_SENDMSG4, CgroupSockAddrAttachType::UDPSendMsg4),
    (PROG_RECVMSG4, CgroupSockAddrAttachType::UDPRecvMsg4),
    (PROG_GETPEERNAME4, CgroupSockAddrAttachType::GetPeerName4),
    (PROG_CONNECT6, CgroupSockAddrAttachType::Connect6),
    (PROG_SENDMSG6, CgroupSockAddrAttachType::UDPSendMsg6),
    (PROG_RECVMSG6, CgroupSockAddrAttachType::UDPRecvMsg6),
    (PROG_GETPEERNAME6, CgroupSockAddrAttachType::GetPeerName6),
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

    pub(super) fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Ingress | Hook::ExternalIngress => TcAttachType::Ingress,
            Hook::Egress => TcAttachType::Egress,
        }
    }
}

/// Paths of the pins of one kproxy instance.
#[derive(Clone, Debug)]
pub struct PinDir {
    pub(super) root: PathBuf,
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

    pub(super) fn links_dir(&self) -> PathBuf {
        self.root.join("links")
    }

    /// The directory of the map pins (`kproxy trace` sessions lock it, see `trace.rs`).
    pub fn maps_dir(&self) -> PathBuf {
        self.root.join("maps")
    }

    /// The directories kproxy creates, reads and deletes pins in.
    pub(super) fn tree(&self) -> [PathBuf; 4] {
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
