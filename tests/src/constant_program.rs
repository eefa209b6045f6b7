//! Programs of two instructions (`return VALUE`), loaded with bpf(2) directly: the underlay's
//! XDP_PASS on bridge ports (`xdp_pass`) and the bench's tc floor (`return TC_ACT_OK`). Too small
//! to need an object, and they must not be kproxy's (its loader would pin and attach them).

use std::{
    ffi::CString,
    os::fd::{FromRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result};

pub const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
pub const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_PROG_LOAD: libc::c_long = 5;

/// The bpf(2) syscall with a 128-byte attribute buffer.
pub fn bpf(command: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i32> {
    // SAFETY: the bpf(2) syscall with an attribute buffer of the size passed; the kernel reads
    // (and for some commands writes) only within it.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, command, attr.as_mut_ptr(), attr.len()) };
    if ret < 0 { Err(std::io::Error::last_os_error()) } else { Ok(ret as i32) }
}

/// Loads `mov64 r0, value; exit` as a program of `prog_type` named `name` (at most 15 bytes);
/// the descriptor owns it.
pub fn load(prog_type: u32, value: i32, name: &str) -> Result<OwnedFd> {
    let mut insns = [0u8; 16];
    insns[0] = 0xb7;
    insns[4..8].copy_from_slice(&value.to_ne_bytes());
    insns[8] = 0x95;
    let license = CString::new("GPL").expect("no NUL");
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&prog_type.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    let name = &name.as_bytes()[..name.len().min(15)];
    attr[48..48 + name.len()].copy_from_slice(name);
    let fd = bpf(BPF_PROG_LOAD, &mut attr)
        .with_context(|| format!("loading a program returning {value} (needs root and BPF)"))?;
    // SAFETY: a fresh descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// One `BPF_PROG_TEST_RUN` of the program `fd` on `data` repeated `repeat` times: its return
/// value and the kernel's mean ns per repetition (the bench's floor, measured as kproxy's
/// programs are).
pub fn test_run(fd: &OwnedFd, data: &[u8], repeat: u32) -> Result<(u32, u32)> {
    use std::os::fd::AsRawFd as _;
    let mut out = vec![0u8; data.len() + 256];
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(data.len() as u32).to_ne_bytes());
    attr[12..16].copy_from_slice(&(out.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(data.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(out.as_mut_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&repeat.to_ne_bytes());
    bpf(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN of a constant program")?;
    let word = |at: usize| u32::from_ne_bytes([attr[at], attr[at + 1], attr[at + 2], attr[at + 3]]);
    Ok((word(4), word(36)))
}
