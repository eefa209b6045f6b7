//! Which pod-facing interfaces the socket hooks cover (`--socket-lb on --pod-veth-tc auto`): the
//! pods whose every process lives in `--cgroup-root` or below it, so that every socket the pod
//! opens is translated at connect()/sendmsg() and its veth needs no per-packet program.
//!
//! A cgroup root that is the cgroup2 hierarchy's own root holds every process of the node: every
//! pod is covered, nothing is scanned. A child cgroup (tests, the bench, a node that attaches
//! below the root) covers a pod when the network namespace at the other end of its veth has at
//! least one process and all of them (thread-group leaders, from /proc) are in the cgroup's
//! subtree. The veth's peer namespace is its `IFLA_LINK_NETNSID`, compared with the id
//! `RTM_GETNSID` gives each process's `/proc/PID/ns/net`.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use libc::c_void;

/// Who the socket hooks cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// No pod: tc on every pod veth (`--pod-veth-tc on`, or socket LB not `on`).
    Nothing,
    /// Every process of the node: the hooks sit on the cgroup2 hierarchy's root.
    Everything,
    /// The processes of this cgroup (a child one) and its descendants.
    Subtree(PathBuf),
}

impl Coverage {
    /// The coverage of hooks attached to `cgroup`.
    pub fn of_cgroup(cgroup: &Path) -> Self {
        // Every cgroup but the hierarchy's root has a `cgroup.type` (cgroup v2: CFTYPE_NOT_ON_ROOT).
        if cgroup.join("cgroup.procs").exists() && !cgroup.join("cgroup.type").exists() {
            Self::Everything
        } else {
            Self::Subtree(cgroup.to_path_buf())
        }
    }

    /// The interfaces among `pod_interfaces` whose pods the hooks cover.
    pub fn covered(&self, pod_interfaces: &[String]) -> Result<BTreeSet<String>> {
        match self {
            Self::Nothing => Ok(BTreeSet::new()),
            Self::Everything => Ok(pod_interfaces.iter().cloned().collect()),
            Self::Subtree(cgroup) => {
                if pod_interfaces.is_empty() {
                    return Ok(BTreeSet::new());
                }
                let inside = pids_in_subtree(cgroup)?;
                let namespaces = covered_namespaces(&inside);
                if namespaces.is_empty() {
                    return Ok(BTreeSet::new());
                }
                let rtnl = Rtnetlink::open()?;
                // The link dump first: listing a veth gives its peer namespace an id here.
                let links = rtnl.link_netnsids()?;
                let mut ids = BTreeSet::new();
                for pid in namespaces {
                    let Ok(netns) = fs::File::open(format!("/proc/{pid}/ns/net")) else { continue };
                    if let Some(id) = rtnl.netnsid_of(&netns)? {
                        ids.insert(id);
                    }
                }
                Ok(pod_interfaces
                    .iter()
                    .filter(|name| links.get(name.as_str()).is_some_and(|id| ids.contains(id)))
                    .cloned()
                    .collect())
            }
        }
    }
}

/// Every process of `cgroup` and its descendants.
fn pids_in_subtree(cgroup: &Path) -> Result<BTreeSet<u32>> {
    let mut pids = BTreeSet::new();
    let mut pending = vec![cgroup.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let procs = fs::read_to_string(dir.join("cgroup.procs"))
            .with_context(|| format!("reading {}/cgroup.procs", dir.display()))?;
        pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        // A child cgroup removed meanwhile just ends its walk.
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
    Ok(pids)
}

/// One process of each network namespace whose processes are all in `inside` (the pid to open
/// the namespace by).
fn covered_namespaces(inside: &BTreeSet<u32>) -> Vec<u32> {
    // netns inode → (a process inside, any process outside)
    let mut namespaces: BTreeMap<u64, (Option<u32>, bool)> = BTreeMap::new();
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        // A process that exited meanwhile (or a zombie) has no namespace to read.
        let Ok(netns) = fs::metadata(format!("/proc/{pid}/ns/net")) else { continue };
        let state = namespaces.entry(netns.ino()).or_default();
        if inside.contains(&pid) {
            state.0.get_or_insert(pid);
        } else {
            state.1 = true;
        }
    }
    namespaces.into_values().filter_map(|(inside, outside)| inside.filter(|_| !outside)).collect()
}

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWNSID: u16 = 88;
const RTM_GETNSID: u16 = 90;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINK_NETNSID: u16 = 37;
const NETNSA_NSID: u16 = 1;
const NETNSA_FD: u16 = 3;

fn message(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + body.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(body);
    msg
}

/// The netlink messages in `buf`: (type, payload).
fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        out.push((kind, &buf[at + NLMSG_HDRLEN..at + len]));
        at += (len + 3) & !3;
    }
    out
}

/// The route attributes in `buf`: (type, value).
fn attributes(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= buf.len() {
        let len = u16::from_ne_bytes([buf[at], buf[at + 1]]) as usize;
        if len < 4 || at + len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes([buf[at + 2], buf[at + 3]]) & 0x3fff;
        out.push((kind, &buf[at + 4..at + len]));
        at += (len + 3) & !3;
    }
    out
}

/// The `NLMSG_ERROR` payload's error code as an error (0 is an acknowledgement).
fn check_error(payload: &[u8]) -> Result<()> {
    let code = payload.get(..4).map_or(0, |c| i32::from_ne_bytes(c.try_into().unwrap()));
    if code != 0 {
        return Err(io::Error::from_raw_os_error(-code)).context("rtnetlink");
    }
    Ok(())
}

struct Rtnetlink(OwnedFd);

impl Rtnetlink {
    fn open() -> Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a NETLINK_ROUTE socket");
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn send(&self, msg: &[u8]) -> Result<()> {
        // SAFETY: sending from a live buffer of the given length.
        let sent = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr() as *const c_void, msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error()).context("sending to rtnetlink");
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> Result<usize> {
        // SAFETY: receiving into a live buffer of the given length.
        let got = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut c_void, buf.len(), 0) };
        if got < 0 {
            return Err(io::Error::last_os_error()).context("receiving from rtnetlink");
        }
        Ok(got as usize)
    }

    /// Interface name → the id of the namespace its other end is in (veths in another namespace).
    fn link_netnsids(&self) -> Result<BTreeMap<String, i32>> {
        // struct ifinfomsg, all zero: every family, every link.
        self.send(&message(RTM_GETLINK, (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16, 1, &[0; 16]))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut out = BTreeMap::new();
        loop {
            let n = self.recv(&mut buf)?;
            for (kind, payload) in messages(&buf[..n]) {
                match kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => check_error(payload)?,
                    RTM_NEWLINK if payload.len() >= 16 => {
                        let (mut name, mut netnsid) = (None, None);
                        for (attr, value) in attributes(&payload[16..]) {
                            match attr {
                                IFLA_IFNAME => {
                                    let text = value.split(|b| *b == 0).next().unwrap_or_default();
                                    name = Some(String::from_utf8_lossy(text).into_owned());
                                }
                                IFLA_LINK_NETNSID if value.len() >= 4 => {
                                    netnsid = Some(i32::from_ne_bytes(value[..4].try_into().unwrap()));
                                }
                                _ => {}
                            }
                        }
                        if let (Some(name), Some(id)) = (name, netnsid) {
                            out.insert(name, id);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// The id this namespace gives the namespace `netns` is a handle of; None when it has none
    /// (no link of ours ends there).
    fn netnsid_of(&self, netns: &fs::File) -> Result<Option<i32>> {
        // struct rtgenmsg (family, padded to 4), then NETNSA_FD.
        let mut body = vec![0u8; 4];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&NETNSA_FD.to_ne_bytes());
        body.extend_from_slice(&(netns.as_raw_fd() as u32).to_ne_bytes());
        self.send(&message(RTM_GETNSID, libc::NLM_F_REQUEST as u16, 2, &body))?;
        let mut buf = [0u8; 512];
        let n = self.recv(&mut buf)?;
        for (kind, payload) in messages(&buf[..n]) {
            match kind {
                NLMSG_ERROR => check_error(payload)?,
                RTM_NEWNSID if payload.len() >= 4 => {
                    for (attr, value) in attributes(&payload[4..]) {
                        if attr == NETNSA_NSID && value.len() >= 4 {
                            let id = i32::from_ne_bytes(value[..4].try_into().unwrap());
                            return Ok((id >= 0).then_some(id));
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_cgroup_is_a_subtree_and_a_directory_without_cgroup_type_the_hierarchy_root() {
        let dir = std::env::temp_dir().join(format!("kproxy-coverage-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("cgroup.procs"), "").unwrap();
        assert_eq!(Coverage::of_cgroup(&dir), Coverage::Everything);
        fs::write(dir.join("cgroup.type"), "domain\n").unwrap();
        assert_eq!(Coverage::of_cgroup(&dir), Coverage::Subtree(dir.clone()));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn messages_and_attributes_are_walked_at_their_aligned_lengths() {
        let mut attrs = Vec::new();
        attrs.extend_from_slice(&7u16.to_ne_bytes());
        attrs.extend_from_slice(&IFLA_IFNAME.to_ne_bytes());
        attrs.extend_from_slice(b"ab\0\0");
        attrs.extend_from_slice(&8u16.to_ne_bytes());
        attrs.extend_from_slice(&IFLA_LINK_NETNSID.to_ne_bytes());
        attrs.extend_from_slice(&5i32.to_ne_bytes());
        let found = attributes(&attrs);
        assert_eq!(found, vec![(IFLA_IFNAME, &b"ab\0"[..]), (IFLA_LINK_NETNSID, &5i32.to_ne_bytes()[..])]);
        let mut two = message(RTM_NEWLINK, 0, 1, &[1, 2, 3]);
        two.push(0);
        two.extend(message(NLMSG_DONE, 0, 1, &[]));
        assert_eq!(messages(&two), vec![(RTM_NEWLINK, &[1u8, 2, 3][..]), (NLMSG_DONE, &[][..])]);
    }
}
