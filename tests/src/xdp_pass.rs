//! A two-instruction XDP program (`return XDP_PASS`) for the underlay's bridge ports. A veth
//! only has a receive queue for frames redirected into it by its peer's XDP program when GRO or
//! an XDP program is on; GRO would also merge a bulk transfer's segments before the nodes' XDP
//! sees them, which no wire does. An XDP program on the port gives the queue without merging.

use std::{ffi::CString, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::{cmd, constant_program, tools::find_tool};

const BPF_OBJ_PIN: libc::c_long = 6;
const XDP_PASS: i32 = 2;

/// Attaches a pass-everything XDP program to `dev` in `netns` (through a pin at `pin`, which is
/// removed again: the attachment keeps the program).
pub fn attach(netns: &str, dev: &str, pin: &Path) -> Result<()> {
    let program = constant_program::load(constant_program::BPF_PROG_TYPE_XDP, XDP_PASS, "xdp_pass")?;
    let path = CString::new(pin.as_os_str().as_encoded_bytes()).context("pin path")?;
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&program) as u32).to_ne_bytes());
    constant_program::bpf(BPF_OBJ_PIN, &mut attr)
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
