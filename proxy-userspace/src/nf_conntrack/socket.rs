//! The `NETLINK_NETFILTER` socket: one per call, in the calling thread's network namespace.

use std::{
    ffi::c_void,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use super::{
    NfConntrackError,
    reply::{Replies, Reply},
};

const NETLINK_NETFILTER: i32 = 12;

/// Big enough for any datagram a dump sends (the kernel fills at most 32 KiB per read).
pub(super) const RECV_BUF_LEN: usize = 64 * 1024;
/// How long one read waits for the kernel before the call gives up.
pub(super) const RECV_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) struct Socket(OwnedFd);

impl Socket {
    pub(super) fn open(op: &'static str) -> Result<Self, NfConntrackError> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_NETFILTER) };
        if fd < 0 {
            return Err(NfConntrackError::from_errno(op, last_errno()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let socket = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
        let timeout = libc::timeval { tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
        // SAFETY: setsockopt reading a live timeval of the given size.
        let ret = unsafe {
            libc::setsockopt(
                socket.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if ret != 0 {
            return Err(NfConntrackError::from_errno(op, last_errno()));
        }
        Ok(socket)
    }

    pub(super) fn send(&self, op: &'static str, msg: &[u8]) -> Result<(), NfConntrackError> {
        loop {
            // SAFETY: sending from a live buffer of the given length (to the kernel, port 0).
            let sent = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr() as *const c_void, msg.len(), 0) };
            if sent >= 0 {
                return Ok(());
            }
            match last_errno() {
                libc::EINTR => continue,
                errno => return Err(NfConntrackError::from_errno(op, errno)),
            }
        }
    }

    /// One datagram into `buf`; its length.
    pub(super) fn recv(&self, op: &'static str, buf: &mut [u8]) -> Result<usize, NfConntrackError> {
        loop {
            // SAFETY: receiving into a live buffer of the given length. MSG_TRUNC makes the
            // return value the datagram's full length, so a cut one is seen.
            let got = unsafe {
                libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut c_void, buf.len(), libc::MSG_TRUNC)
            };
            if got >= 0 {
                let got = got as usize;
                if got > buf.len() {
                    return Err(NfConntrackError::Truncated {
                        op,
                        what: format!("a datagram of {got} bytes, more than the {} read", buf.len()),
                    });
                }
                return Ok(got);
            }
            match last_errno() {
                libc::EINTR => continue,
                errno => return Err(NfConntrackError::from_errno(op, errno)),
            }
        }
    }

    /// The error code of the kernel's answer to request `seq` (0 for success).
    pub(super) fn ack(&self, op: &'static str, seq: u32) -> Result<i32, NfConntrackError> {
        let mut buf = vec![0u8; 8192];
        loop {
            let n = self.recv(op, &mut buf)?;
            for reply in Replies::new(op, &buf[..n]) {
                if let (reply_seq, Reply::Ack(code)) = reply?
                    && reply_seq == seq
                {
                    return Ok(-code);
                }
            }
        }
    }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}
