//! A two-instruction XDP program (`return XDP_PASS`) for the underlay's bridge ports. A veth
//! only has a receive queue for frames redirected into it by its peer's XDP program when GRO or
//! an XDP program is on; GRO would also merge a bulk transfer's segments before the nodes' XDP
//! sees them, which no wire does. An XDP program on the port gives the queue without merging.

use std::{ffi::CString, os::fd::FromRawFd, os::fd::OwnedFd, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::{cmd, tools::find_tool};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_TYPE_XDP: u32 = 6;
const XDP_PASS: i32 = 2;

fn bpf(command: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i32> {
    // SAFETY: the bpf(2) syscall with an attribute buffer of the size passed; the kernel reads
    // (and for some commands writes) only within it.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_mut_ptr(), attr.len()) };
    if ret < 0 { Err(std::io::Error::last_os_error()) } else { Ok(ret as i32) }
}

/// Loads the program; the descriptor owns it.
fn load() -> Result<OwnedFd> {
    // mov64 r0, XDP_PASS; exit
    let mut insns = [0u8; 16];
    insns[0] = 0xb7;
    insns[4..8].copy_from_slice(&XDP_PASS.to_ne_bytes());
    insns[8] = 0x95;
    let license = CString::new("GPL").unwrap();
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    let fd = bpf(BPF_PROG_LOAD, &mut attr).context("loading an XDP_PASS program (needs root and BPF)")?;
    // SAFETY: a fresh descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Attaches a pass-everything XDP program to `dev` in `netns` (through a pin at `pin`, which is
/// removed again: the attachment keeps the program).
pub fn attach(netns: &str, dev: &str, pin: &Path) -> Result<()> {
    let program = load()?;
    let path = CString::new(pin.as_os_str().as_encoded_bytes()).context("pin path")?;
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&program) as u32).to_ne_bytes());
    bpf(BPF_OBJ_PIN, &mut attr)
        .with_context(|| format!("pinning the XDP_PASS program at {}", pin.display()))?;
    // nsenter rather than `ip -n`: that one also remounts /sys, where the pin would not be.
    let mut command = Command::new(find_tool("nsenter")?);
    command.arg(format!("--net=/run/netns/{netns}")).arg(find_tool("ip")?);
    command.args(["link", "set", "dev", dev, "xdpdrv", "pinned"]).arg(pin);
    let attached = cmd::run_ok(command, std::time::Duration::from_secs(10));
    let _ = std::fs::remove_file(pin);
    attached.with_context(|| format!("attaching XDP_PASS to {dev}"))?;
    if !pin.exists() {
        return Ok(());
    }
    bail!("{} could not be removed", pin.display())
}
