//! Running commands with a deadline, in their own process group.
use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

/// `prog arg arg …` for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut text = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Sends SIGKILL to process group `pgid` (ignores a group that is already gone). Call it only while
/// the group leader is unreaped (running or a zombie), so the id cannot name another group.
pub(crate) fn kill_group(pgid: u32) {
    if let Ok(pgid) = i32::try_from(pgid)
        && pgid > 1
    {
        // SAFETY: kill has no memory-safety preconditions; a negative pid names a process group.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

/// Whether child `pid` has exited, without reaping it (so its pid, and the process group id it
/// leads, cannot be reused while the caller still signals the group).
pub(crate) fn has_exited(pid: u32) -> Result<bool> {
    let pid = libc::id_t::from(pid);
    // SAFETY: an all-zero siginfo_t is a valid value; waitid writes into it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable siginfo_t; WNOWAIT leaves the child waitable.
    let rc =
        unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("waitid");
    }
    // SAFETY: after a successful waitid, si_pid is 0 (no state change) or the child's pid.
    Ok(unsafe { info.si_pid() } != 0)
}

/// Runs `cmd` to completion in a new process group, capturing stdout and stderr. After `timeout`
/// the whole group is killed and an error is returned. Whatever the command left running in its
/// group is killed when it exits (long-running processes belong in `spawn`).
pub(crate) fn run(mut cmd: Command, timeout: Duration) -> Result<Output> {
    let what = describe(&cmd);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut child = cmd.spawn().with_context(|| format!("starting `{what}`"))?;
    let pid = child.id();
    let mut stdout = child.stdout.take().context("stdout pipe")?;
    let mut stderr = child.stderr.take().context("stderr pipe")?;
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if has_exited(pid).with_context(|| format!("waiting for `{what}`"))? {
            // The unreaped leader still reserves the group id: kill leftovers (they would keep
            // the pipes open), then reap.
            kill_group(pid);
            break Some(child.wait().with_context(|| format!("waiting for `{what}`"))?);
        }
        if Instant::now() >= deadline {
            kill_group(pid);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(status) => Ok(Output { status, stdout, stderr }),
        None => bail!(
            "`{what}` did not finish within {timeout:?}; stdout: {}; stderr: {}",
            String::from_utf8_lossy(&stdout).trim(),
            String::from_utf8_lossy(&stderr).trim()
        ),
    }
}

/// Runs `cmd` and returns its stdout; a non-zero exit is an error carrying stderr and stdout.
pub(crate) fn run_ok(cmd: Command, timeout: Duration) -> Result<String> {
    let what = describe(&cmd);
    let output = run(cmd, timeout)?;
    check(&what, output)
}

/// stdout of a successful `output`, or an error naming `what`.
pub(crate) fn check(what: &str, output: Output) -> Result<String> {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "`{what}` failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            if stdout.trim().is_empty() { String::new() } else { format!(" (stdout: {})", stdout.trim()) }
        );
    }
    Ok(stdout)
}
