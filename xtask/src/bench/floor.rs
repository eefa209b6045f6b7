//! (a'), the floor of any tc datapath: a two-instruction `return TC_ACT_OK` program attached with
//! TCX (as kproxy attaches its own) to both directions of every pod veth, so that the end-to-end
//! figures can say what kproxy costs beyond the mere presence of a per-packet program.
//!
//! Loaded with bpf(2) directly: the program is too small to need an object, and it must not be
//! one of kproxy's (it would then be pinned and attached by the agent's loader).
use std::{
    ffi::CString,
    fs::File,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result, anyhow};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// TC_ACT_OK: the packet goes on (TCX_PASS).
const TC_ACT_OK: i32 = 0;

fn bpf(command: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i32> {
    // SAFETY: the bpf(2) syscall with an attribute buffer of the size passed; the kernel reads
    // (and for some commands writes) only within it.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_mut_ptr(), attr.len()) };
    if ret < 0 { Err(std::io::Error::last_os_error()) } else { Ok(ret as i32) }
}

/// The pass-all program; the descriptor owns it.
fn load() -> Result<OwnedFd> {
    // mov64 r0, TC_ACT_OK; exit
    let mut insns = [0u8; 16];
    insns[0] = 0xb7;
    insns[4..8].copy_from_slice(&TC_ACT_OK.to_ne_bytes());
    insns[8] = 0x95;
    let license = CString::new("GPL").expect("no NUL");
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[48..60].copy_from_slice(b"bench_floor\0");
    let fd = bpf(BPF_PROG_LOAD, &mut attr).context("loading the TC_ACT_OK program")?;
    // SAFETY: a fresh descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The floor program on ingress and egress of `devices` in the network namespace at `netns`;
/// detached when dropped (the links are only held by these descriptors).
pub struct Floor {
    _links: Vec<OwnedFd>,
}

impl Floor {
    pub fn attach(netns: &Path, devices: &[&str]) -> Result<Self> {
        let program = load()?;
        let netns = File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
        let devices: Vec<String> = devices.iter().map(|d| (*d).to_owned()).collect();
        // A thread of its own enters the namespace (ifindexes are per namespace); the links it
        // makes are descriptors of the whole process.
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: setns on this thread only, with a namespace descriptor we opened.
                    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(anyhow!("setns: {}", std::io::Error::last_os_error()));
                    }
                    let mut links = Vec::new();
                    for dev in &devices {
                        let name = CString::new(dev.as_str())?;
                        // SAFETY: a NUL-terminated name.
                        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
                        if ifindex == 0 {
                            return Err(anyhow!("no interface {dev} in the node namespace"));
                        }
                        for attach_type in [BPF_TCX_INGRESS, BPF_TCX_EGRESS] {
                            let mut attr = [0u8; 128];
                            attr[0..4].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
                            attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
                            attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
                            let fd = bpf(BPF_LINK_CREATE, &mut attr)
                                .with_context(|| format!("attaching the floor program to {dev} (TCX)"))?;
                            // SAFETY: a fresh descriptor the kernel just returned to us.
                            links.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                    Ok(Floor { _links: links })
                })
                .join()
                .map_err(|_| anyhow!("the thread attaching the floor program panicked"))?
        })
    }
}
