//! (a'), the floor of any tc datapath: a two-instruction `return TC_ACT_OK` program attached with
//! TCX (as kproxy attaches its own) to both directions of every pod veth, so that the end-to-end
//! figures can say what kproxy costs beyond the mere presence of a per-packet program.
//!
//! Loaded by `sandbox::constant_program` (bpf(2) directly, not one of kproxy's programs).
use std::{
    ffi::CString,
    fs::File,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result, anyhow};
use sandbox::constant_program;

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// TC_ACT_OK: the packet goes on (TCX_PASS).
const TC_ACT_OK: i32 = 0;

/// The floor program on ingress and egress of `devices` in the network namespace at `netns`;
/// detached when dropped (the links are only held by these descriptors).
pub struct Floor {
    _links: Vec<OwnedFd>,
}

impl Floor {
    pub fn attach(netns: &Path, devices: &[&str]) -> Result<Self> {
        let program =
            constant_program::load(constant_program::BPF_PROG_TYPE_SCHED_CLS, TC_ACT_OK, "bench_floor")?;
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
                            let fd = constant_program::bpf(BPF_LINK_CREATE, &mut attr)
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
