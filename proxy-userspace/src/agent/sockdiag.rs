//! Destroying the UDP sockets connected to backends that are gone.
//!
//! With socket-level load balancing a connected socket talks to the backend's own address: no
//! conntrack entry stands between it and a dead pod, and a connected UDP socket (a DNS client's)
//! would send into the void forever. So when a UDP backend leaves, the agent asks the kernel
//! (`NETLINK_SOCK_DIAG`, `SOCK_DESTROY`, like `ss -K`) to abort the UDP sockets that the socket
//! hooks connected to that backend, in every network namespace of the node (pods have their
//! own): the application sees ECONNABORTED and reconnects, through the Service again. This is
//! the socket-level form of kube-proxy's conntrack clean-up, which deletes stale UDP entries
//! only.
//!
//! TCP sockets are never destroyed. A backend leaves the EndpointSlice while its pod still
//! serves (a readiness flap, a relabelled pod), and kube-proxy never touches an established TCP
//! flow: the connection carries on to the pod as long as the pod answers, and a pod that is
//! really gone ends it by itself (RST, or the client's timeout).
//!
//! Only sockets the hooks translated are touched — their cookie and peer are in
//! `SOCK_REVNAT_V4`, or `SOCK_REVNAT_V6` for an AF_INET6 socket connected to a native IPv6
//! backend. An AF_INET6 socket connected to an IPv4-mapped backend (`::ffff:a.b.c.d`) went
//! through the IPv4 Service, and the hooks keep its entry in `SOCK_REVNAT_V4`: its peer is the
//! IPv4 address, so one IPv4 backend leaving reaches the sockets of both families. A socket an application connected to the pod's own address (a headless
//! Service, a StatefulSet peer) is its business: a pod leaving a Service, or just turning
//! unready, must not cut it.

use std::{
    collections::BTreeMap,
    ffi::c_void,
    fs, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
const REQ_LEN: usize = 56;
const MSG_LEN: usize = 72;

/// A UDP backend whose connected sockets must go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Peer {
    /// An IPv4-mapped address is never here: such a peer is its IPv4 address.
    pub addr: IpAddr,
    pub port: u16,
}

/// `struct inet_diag_sockid`, as the kernel reported it (it must be sent back unchanged,
/// cookie included, to name the socket), and the family of the dump that reported it, which
/// the destroy request must name too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SockId {
    family: u8,
    id: [u8; 48],
}

impl SockId {
    fn dst(&self) -> (IpAddr, u16) {
        let port = u16::from_be_bytes([self.id[2], self.id[3]]);
        let addr = if self.family == libc::AF_INET6 as u8 {
            let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&self.id[20..36]).unwrap());
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        } else {
            IpAddr::V4(Ipv4Addr::new(self.id[20], self.id[21], self.id[22], self.id[23]))
        };
        (addr, port)
    }

    /// `idiag_cookie`: the socket cookie (`SO_COOKIE`, `bpf_get_socket_cookie`), low half first.
    fn cookie(&self) -> u64 {
        let low = u32::from_ne_bytes(self.id[40..44].try_into().unwrap());
        let high = u32::from_ne_bytes(self.id[44..48].try_into().unwrap());
        u64::from(low) | (u64::from(high) << 32)
    }
}

/// A `SOL_SOCKET` option whose value is a u64 (`SO_COOKIE`, `SO_NETNS_COOKIE`).
pub fn socket_cookie_option(socket: &impl AsRawFd, option: i32) -> io::Result<u64> {
    let mut value = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writing a u64 into a live, correctly sized buffer.
    let ret = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut u64).cast(),
            &mut len,
        )
    };
    if ret != 0 { Err(io::Error::last_os_error()) } else { Ok(value) }
}

/// Whether the socket with this cookie was connected to `peer` by kproxy's socket hooks: an IPv4
/// peer in `SOCK_REVNAT_V4` (whatever the socket's family), an IPv6 one in `SOCK_REVNAT_V6`.
pub type Translated<'a> = &'a (dyn Fn(u64, &Peer) -> bool + Sync);

/// `nlmsghdr` + `inet_diag_req_v2` for UDP sockets of `family` in any state.
fn request(kind: u16, flags: u16, seq: u32, family: u8, id: Option<&[u8; 48]>) -> Vec<u8> {
    let mut msg = Vec::with_capacity(NLMSG_HDRLEN + REQ_LEN);
    msg.extend_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.push(family);
    msg.push(libc::IPPROTO_UDP as u8);
    msg.push(0); // no extensions
    msg.push(0);
    msg.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    msg.extend_from_slice(id.unwrap_or(&[0u8; 48]));
    msg
}

/// The sockets of one dump reply buffer; `None` at NLMSG_DONE.
fn parse_dump(buf: &[u8]) -> Result<Option<Vec<SockId>>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().unwrap());
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            bail!("truncated netlink message");
        }
        match kind {
            NLMSG_DONE => return Ok(None),
            NLMSG_ERROR => {
                let code = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().unwrap());
                return Err(io::Error::from_raw_os_error(-code)).context("sock_diag dump");
            }
            SOCK_DIAG_BY_FAMILY if len >= NLMSG_HDRLEN + MSG_LEN => {
                let body = &buf[at + NLMSG_HDRLEN..at + len];
                let mut id = [0u8; 48];
                id.copy_from_slice(&body[4..52]);
                out.push(SockId { family: body[0], id });
            }
            _ => {}
        }
        at += (len + 3) & !3;
    }
    Ok(Some(out))
}

struct Netlink(OwnedFd);

impl Netlink {
    fn open() -> Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a NETLINK_SOCK_DIAG socket");
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn send(&self, msg: &[u8]) -> Result<()> {
        // SAFETY: sending from a live buffer of the given length.
        let sent = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr() as *const c_void, msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error()).context("sending to sock_diag");
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [u8]) -> Result<usize> {
        // SAFETY: receiving into a live buffer of the given length.
        let got = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr() as *mut c_void, buf.len(), 0) };
        if got < 0 {
            return Err(io::Error::last_os_error()).context("receiving from sock_diag");
        }
        Ok(got as usize)
    }

    fn dump(&self, family: u8) -> Result<Vec<SockId>> {
        self.send(&request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, family, None))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut all = Vec::new();
        loop {
            let n = self.recv(&mut buf)?;
            match parse_dump(&buf[..n])? {
                Some(mut part) => all.append(&mut part),
                None => return Ok(all),
            }
        }
    }

    fn destroy(&self, id: &SockId) -> Result<()> {
        self.send(&request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, 2, id.family, Some(&id.id)))?;
        let mut buf = [0u8; 512];
        let n = self.recv(&mut buf)?;
        if n >= NLMSG_HDRLEN + 4 && u16::from_ne_bytes([buf[4], buf[5]]) == NLMSG_ERROR {
            let code = i32::from_ne_bytes(buf[16..20].try_into().unwrap());
            // ENOENT: the socket closed meanwhile.
            if code != 0 && code != -libc::ENOENT {
                return Err(io::Error::from_raw_os_error(-code)).context("SOCK_DESTROY");
            }
        }
        Ok(())
    }
}

/// Destroys, in this thread's network namespace, the UDP sockets whose peer is one of `peers`
/// and that `translated` claims. Returns how many.
pub fn destroy_here(peers: &[Peer], translated: Translated) -> Result<usize> {
    if peers.is_empty() {
        return Ok(0);
    }
    let netlink = Netlink::open()?;
    let mut destroyed = 0;
    // AF_INET6 even with IPv4 peers only: a dual-stack socket reaches an IPv4 backend by its
    // mapped address.
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for id in netlink.dump(family)? {
            let (addr, port) = id.dst();
            let peer = Peer { addr, port };
            if peers.contains(&peer) && translated(id.cookie(), &peer) {
                netlink.destroy(&id)?;
                destroyed += 1;
            }
        }
    }
    Ok(destroyed)
}

/// One `/proc/<pid>/ns/net` per network namespace of the node.
fn network_namespaces() -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    let mut by_inode: BTreeMap<(u64, u64), PathBuf> = BTreeMap::new();
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let path = entry.path().join("ns/net");
        if let Ok(meta) = fs::metadata(&path) {
            by_inode.entry((meta.dev(), meta.ino())).or_insert(path);
        }
    }
    by_inode.into_values().collect()
}

/// [`destroy_here`] in every network namespace of the node (each visited from a thread of its
/// own, which enters it with setns). Returns how many.
pub fn destroy_everywhere(peers: &[Peer], translated: Translated) -> Result<usize> {
    if peers.is_empty() {
        return Ok(0);
    }
    let mut total = 0;
    for ns in network_namespaces() {
        let visit = std::thread::scope(|scope| {
            scope
                .spawn(|| -> Result<usize> {
                    let file = fs::File::open(&ns).with_context(|| format!("opening {}", ns.display()))?;
                    // SAFETY: setns on this thread only, with a descriptor we hold.
                    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(io::Error::last_os_error())
                            .with_context(|| format!("entering {}", ns.display()));
                    }
                    destroy_here(peers, translated)
                })
                .join()
        });
        match visit {
            Ok(Ok(n)) => total += n,
            // A process (and its namespace) may be gone by now.
            Ok(Err(e)) => tracing::debug!(error = %format!("{e:#}"), "destroying sockets in a namespace"),
            Err(_) => bail!("a socket-destroying thread panicked"),
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<libc::nlmsghdr>(), NLMSG_HDRLEN);
        let msg = request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 7, libc::AF_INET as u8, None);
        assert_eq!(msg.len(), NLMSG_HDRLEN + REQ_LEN);
        assert_eq!(u32::from_ne_bytes(msg[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes(msg[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
        assert_eq!(msg[16], libc::AF_INET as u8);
        assert_eq!(msg[17], libc::IPPROTO_UDP as u8);
        assert_eq!(&msg[20..24], &[0xff; 4], "all states");
    }

    #[test]
    fn dump_replies_yield_peers_and_end_at_done() {
        let mut id = [0u8; 48];
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[20..24].copy_from_slice(&[10, 244, 0, 21]);
        let mut buf = Vec::new();
        buf.extend_from_slice(&((NLMSG_HDRLEN + MSG_LEN) as u32).to_ne_bytes());
        buf.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        buf.extend_from_slice(&[0; 10]);
        let mut body = [0u8; MSG_LEN];
        body[0] = libc::AF_INET as u8;
        body[1] = 1;
        body[4..52].copy_from_slice(&id);
        buf.extend_from_slice(&body);
        let parsed = parse_dump(&buf).unwrap().unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].dst(), (IpAddr::V4(Ipv4Addr::new(10, 244, 0, 21)), 53));
        let mut done = Vec::new();
        done.extend_from_slice(&20u32.to_ne_bytes());
        done.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        done.extend_from_slice(&[0; 14]);
        assert!(parse_dump(&done).unwrap().is_none());
    }

    #[test]
    fn an_ipv6_dump_reply_yields_native_and_mapped_peers() {
        let reply = |dst: Ipv6Addr| {
            let mut buf = Vec::new();
            buf.extend_from_slice(&((NLMSG_HDRLEN + MSG_LEN) as u32).to_ne_bytes());
            buf.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
            buf.extend_from_slice(&[0; 10]);
            let mut body = [0u8; MSG_LEN];
            body[0] = libc::AF_INET6 as u8;
            body[1] = 1;
            body[6..8].copy_from_slice(&53u16.to_be_bytes());
            body[24..40].copy_from_slice(&dst.octets());
            buf.extend_from_slice(&body);
            parse_dump(&buf).unwrap().unwrap()
        };
        let native: Ipv6Addr = "fd00:10:244::15".parse().unwrap();
        let parsed = reply(native);
        assert_eq!(parsed[0].family, libc::AF_INET6 as u8, "the destroy request must name it");
        assert_eq!(parsed[0].dst(), (IpAddr::V6(native), 53));
        // A dual-stack socket's IPv4 backend: its SOCK_REVNAT_V4 entry names the IPv4 address.
        let mapped = Ipv4Addr::new(10, 244, 0, 21).to_ipv6_mapped();
        assert_eq!(reply(mapped)[0].dst(), (IpAddr::V4(Ipv4Addr::new(10, 244, 0, 21)), 53));
    }

    fn cookie_of(socket: &std::net::UdpSocket) -> u64 {
        socket_cookie_option(socket, libc::SO_COOKIE).expect("SO_COOKIE")
    }

    /// On loopback in the test's namespace: of two sockets connected to a gone peer, the one the
    /// hooks translated (its cookie claimed) is destroyed, the one connected to it directly is
    /// not; neither is a socket connected elsewhere.
    #[test]
    fn a_translated_udp_socket_to_a_gone_peer_is_destroyed() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let peer = server.local_addr().unwrap();
        client.connect(peer).unwrap();
        let direct = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        direct.connect(peer).unwrap();
        let other = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        other.connect(client.local_addr().unwrap()).unwrap();
        let gone = Peer { addr: IpAddr::V4(Ipv4Addr::LOCALHOST), port: peer.port() };
        let client_cookie = cookie_of(&client);
        let translated = |cookie: u64, p: &Peer| cookie == client_cookie && *p == gone;
        let destroyed = destroy_here(&[gone], &translated).expect("needs root and CONFIG_INET_DIAG_DESTROY");
        assert_eq!(destroyed, 1, "only the translated socket connected to the gone peer");
        direct.send(b"untouched").unwrap();
        // The owner learns it on its next receive, and the socket is no longer connected.
        client.set_read_timeout(Some(std::time::Duration::from_secs(1))).unwrap();
        let err = client.recv(&mut [0u8; 16]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
        let err = client.send(b"hello").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EDESTADDRREQ), "{err}");
        other.send(b"still fine").unwrap();
    }

    /// A TCP connection to the same address and port as a gone UDP peer, claimed as translated,
    /// is left alone: the backend left the Service, not necessarily the network, and kube-proxy
    /// lets an established TCP flow run on.
    #[test]
    fn a_tcp_connection_to_a_gone_peer_is_never_destroyed() {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let udp_server = std::net::UdpSocket::bind(("127.0.0.1", port)).expect("the same port for UDP");
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        let udp_client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        udp_client.connect(udp_server.local_addr().unwrap()).unwrap();
        let gone = Peer { addr: IpAddr::V4(Ipv4Addr::LOCALHOST), port };
        let destroyed = destroy_here(&[gone], &|_, p: &Peer| *p == gone)
            .expect("needs root and CONFIG_INET_DIAG_DESTROY");
        assert_eq!(destroyed, 1, "the connected UDP socket only");
        stream.write_all(b"still here").unwrap();
        let mut got = [0u8; 10];
        accepted.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"still here");
    }

    /// As [`a_translated_udp_socket_to_a_gone_peer_is_destroyed`], with AF_INET6 sockets on ::1
    /// and a native IPv6 peer (`SOCK_REVNAT_V6`).
    #[test]
    fn a_translated_ipv6_udp_socket_to_a_gone_peer_is_destroyed() {
        let server = std::net::UdpSocket::bind("[::1]:0").unwrap();
        let client = std::net::UdpSocket::bind("[::1]:0").unwrap();
        let peer = server.local_addr().unwrap();
        client.connect(peer).unwrap();
        let direct = std::net::UdpSocket::bind("[::1]:0").unwrap();
        direct.connect(peer).unwrap();
        let other = std::net::UdpSocket::bind("[::1]:0").unwrap();
        other.connect(client.local_addr().unwrap()).unwrap();
        let gone = Peer { addr: IpAddr::V6(Ipv6Addr::LOCALHOST), port: peer.port() };
        let client_cookie = cookie_of(&client);
        let translated = |cookie: u64, p: &Peer| cookie == client_cookie && *p == gone;
        let destroyed = destroy_here(&[gone], &translated).expect("needs root and CONFIG_INET_DIAG_DESTROY");
        assert_eq!(destroyed, 1, "only the translated socket connected to the gone peer");
        direct.send(b"untouched").unwrap();
        client.set_read_timeout(Some(std::time::Duration::from_secs(1))).unwrap();
        let err = client.recv(&mut [0u8; 16]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
        let err = client.send(b"hello").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EDESTADDRREQ), "{err}");
        other.send(b"still fine").unwrap();
        assert_eq!(server.recv(&mut [0u8; 16]).unwrap(), 9, "the untranslated socket still reaches its peer");
    }

    /// An AF_INET6 socket that does not refuse IPv4 (IPV6_V6ONLY off, whatever the sysctl says).
    fn dual_stack_udp() -> std::net::UdpSocket {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0, "{}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let socket = unsafe { std::net::UdpSocket::from_raw_fd(fd) };
        let off: libc::c_int = 0;
        // SAFETY: setsockopt reading a c_int from a live buffer of that size.
        let ret = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                (&off as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(ret, 0, "{}", io::Error::last_os_error());
        socket
    }

    /// A dual-stack socket the hooks connected to an IPv4 backend by its mapped address
    /// (`::ffff:127.0.0.1`) is claimed through its IPv4 peer, as the hooks keep its entry in
    /// `SOCK_REVNAT_V4`, and is destroyed when that IPv4 backend leaves.
    #[test]
    fn a_dual_stack_socket_to_a_gone_ipv4_peer_is_destroyed() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let mapped = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST.to_ipv6_mapped(), port));
        let client = dual_stack_udp();
        client.connect(mapped).unwrap();
        let direct = dual_stack_udp();
        direct.connect(mapped).unwrap();
        let gone = Peer { addr: IpAddr::V4(Ipv4Addr::LOCALHOST), port };
        let client_cookie = cookie_of(&client);
        // Claimed by its IPv4 peer only: an IPv6 peer `::ffff:127.0.0.1` would match nothing.
        let translated = |cookie: u64, p: &Peer| cookie == client_cookie && *p == gone;
        let destroyed = destroy_here(&[gone], &translated).expect("needs root and CONFIG_INET_DIAG_DESTROY");
        assert_eq!(destroyed, 1, "only the translated dual-stack socket");
        client.set_read_timeout(Some(std::time::Duration::from_secs(1))).unwrap();
        let err = client.recv(&mut [0u8; 16]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
        direct.send(b"untouched").unwrap();
        assert_eq!(server.recv(&mut [0u8; 16]).unwrap(), 9);
    }

    /// As [`a_tcp_connection_to_a_gone_peer_is_never_destroyed`], over ::1.
    #[test]
    fn an_ipv6_tcp_connection_to_a_gone_peer_is_never_destroyed() {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("[::1]:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let udp_server = std::net::UdpSocket::bind(("::1", port)).expect("the same port for UDP");
        let mut stream = std::net::TcpStream::connect(("::1", port)).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        let udp_client = std::net::UdpSocket::bind("[::1]:0").unwrap();
        udp_client.connect(udp_server.local_addr().unwrap()).unwrap();
        let gone = Peer { addr: IpAddr::V6(Ipv6Addr::LOCALHOST), port };
        let destroyed = destroy_here(&[gone], &|_, p: &Peer| *p == gone)
            .expect("needs root and CONFIG_INET_DIAG_DESTROY");
        assert_eq!(destroyed, 1, "the connected UDP socket only");
        stream.write_all(b"still here").unwrap();
        let mut got = [0u8; 10];
        accepted.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"still here");
    }
}
