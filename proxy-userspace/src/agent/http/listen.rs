//! Binding a listener the way kube-proxy's Go listeners bind: an unspecified address of either
//! family (`0.0.0.0` or `::`) answers on every address of both families.
//!
//! Go's `net.Listen("tcp", "0.0.0.0:port")` opens one IPv6 socket with `IPV6_V6ONLY` off, so
//! kube-proxy's health check node ports answer IPv4 clients (as IPv4-mapped peers) and IPv6 clients
//! alike on a dual-stack node. One socket rather than two keeps a port either wholly ours or
//! wholly someone else's: a second process holding the port on either family makes the bind fail,
//! and it is retried as a whole.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::net::TcpListener;

/// The kernel caps the backlog at `net.core.somaxconn`; this is what tokio asks for too.
const BACKLOG: libc::c_int = 1024;

/// Binds `addr`; an unspecified address of either family binds every address of both families
/// (IPv4 alone where the kernel has no IPv6 sockets). Must run on a tokio runtime.
pub(crate) async fn bind_like_kube_proxy(addr: SocketAddr) -> io::Result<TcpListener> {
    if !addr.ip().is_unspecified() {
        return TcpListener::bind(addr).await;
    }
    match dual_stack(addr.port()) {
        Ok(listener) => TcpListener::from_std(listener),
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, addr.port())).await
        }
        Err(e) => Err(e),
    }
}

/// A non-blocking listener on `[::]:port` that takes IPv4 connections too.
fn dual_stack(port: u16) -> io::Result<std::net::TcpListener> {
    // SAFETY: socket(2) takes no pointers; a non-negative result is a descriptor we now own.
    let raw = unsafe {
        libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    // As tokio's bind does: a port whose old connections linger in TIME_WAIT can be bound again.
    set_option(&socket, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    // Explicitly off: `net.ipv6.bindv6only=1` would otherwise leave IPv4 clients unanswered.
    set_option(&socket, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    // SAFETY: all-zero is a valid sockaddr_in6 (the unspecified address, port 0).
    let mut address: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    address.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    address.sin6_port = port.to_be();
    // SAFETY: the pointer and length describe `address`, alive for the call.
    let bound = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    if bound < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) on a descriptor we own.
    if unsafe { libc::listen(socket.as_raw_fd(), BACKLOG) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::net::TcpListener::from(socket))
}

fn set_option(socket: &OwnedFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the pointer and length describe `value`, alive for the call.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;

    #[tokio::test]
    async fn a_specific_address_binds_that_address_alone() {
        let listener = bind_like_kube_proxy(SocketAddr::from((Ipv6Addr::LOCALHOST, 0))).await.unwrap();
        let bound = listener.local_addr().unwrap();
        assert_eq!(bound.ip(), Ipv6Addr::LOCALHOST);
        let v4 = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, bound.port())).await;
        assert!(v4.is_err(), "an IPv6 loopback listener takes no IPv4 connection");
        tokio::net::TcpStream::connect(bound).await.expect("the IPv6 client connects");
    }
}
