//! The kernel's nf_conntrack table read and changed over ctnetlink (`kproxy::nf_conntrack`), on the
//! real kernel: a node namespace with kube-proxy's shape of rule (an nft DNAT from a ClusterIP to a
//! pod), real TCP and UDP flows through it from a client pod to a backend pod, and what the module
//! reads compared with what `conntrack -L` prints for the same namespace. The module's calls run
//! on a thread that entered the node namespace; nothing is sent from the root namespace. Needs
//! root.

use std::{
    collections::BTreeSet,
    fs::File,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use kproxy::{
    net::Protocol,
    nf_conntrack::{
        self, DnatFlow, Entry, IPS_ASSURED, IPS_CONFIRMED, IPS_SEEN_REPLY, NfConntrackError, TcpState, Tuple,
    },
};
use sandbox::{Pod, Sandbox, Spawned, require_tools};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// A ClusterIP no rule translates: only entries made with `create_dnat` do.
const VIP_WITHOUT_RULE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 3);
const TCP_BACKEND_PORT: u16 = 8080;
const UDP_BACKEND_PORT: u16 = 5353;

/// kube-proxy's DNAT for one ClusterIP, and its drop of packets conntrack finds INVALID, as an nft
/// table in the node namespace. Its nat chain is also what makes netfilter apply the NAT of
/// entries made over ctnetlink.
const RULES: &str = "table ip kp_nfct {
  chain prerouting {
    type nat hook prerouting priority dstnat; policy accept;
    ip daddr 10.96.0.10 tcp dport 80 dnat to 10.244.1.3:8080
    ip daddr 10.96.0.10 udp dport 53 dnat to 10.244.1.3:5353
  }
  chain forward {
    type filter hook forward priority filter; policy accept;
    ct state invalid counter drop
  }
}
";

/// The backend: a TCP echo server, and a UDP server that answers with who asked.
const SERVER: &str = r#"
import socket, threading
def tcp():
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(('0.0.0.0', 8080)); ls.listen(16)
    def serve(c):
        while True:
            data = c.recv(4096)
            if not data:
                break
            c.sendall(data)
        c.close()
    while True:
        threading.Thread(target=serve, args=(ls.accept()[0],), daemon=True).start()
threading.Thread(target=tcp, daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 5353))
while True:
    data, peer = u.recvfrom(4096)
    u.sendto(b'from %s:%d: ' % (peer[0].encode(), peer[1]) + data, peer)
"#;

/// A TCP connection from a fixed port that stays open until a file appears, then closes.
const TCP_CLIENT: &str = r#"
import os, socket, sys, time
port, addr, close_when = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', port)); s.settimeout(10); s.connect((addr, 80))
s.sendall(b'hello'); assert s.recv(5) == b'hello'
print('open', flush=True)
while not os.path.exists(close_when):
    time.sleep(0.02)
s.shutdown(socket.SHUT_WR)
while s.recv(4096):
    pass
s.close()
print('closed', flush=True)
"#;

/// A TCP connection from a fixed port that exchanges 1 MiB, waits for a file, then exchanges
/// 8 MiB more (far past any unscaled window) and checks every byte came back.
const BULK_CLIENT: &str = r#"
import hashlib, os, socket, sys, threading, time
port, addr, go_when = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', port)); s.settimeout(20); s.connect((addr, 80))
def exchange(size):
    data = os.urandom(size)
    sender = threading.Thread(target=s.sendall, args=(data,)); sender.start()
    got = bytearray()
    while len(got) < size:
        chunk = s.recv(1 << 16)
        assert chunk, 'closed by the peer'
        got += chunk
    sender.join()
    return hashlib.sha256(data).digest() == hashlib.sha256(got).digest()
assert exchange(1 << 20)
print('open', flush=True)
while not os.path.exists(go_when):
    time.sleep(0.02)
print('intact' if exchange(8 << 20) else 'corrupted', flush=True)
"#;

/// One UDP exchange from a fixed port: prints the answer and where it came from, or the error.
const UDP_CLIENT: &str = r#"
import socket, sys
port, addr, dport = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', port)); s.settimeout(2)
s.sendto(b'ping', (addr, dport))
try:
    data, peer = s.recvfrom(4096)
    print('%s:%d %s' % (peer[0], peer[1], data.decode()))
except OSError as e:
    print('no answer: %s' % e)
"#;

/// A client pod and a backend pod behind a node namespace with [`RULES`].
struct Node {
    sandbox: Sandbox,
    client: Pod,
    _backend: Pod,
    _server: Spawned,
}

impl Node {
    fn new(tag: &str) -> Node {
        require_tools(&["nft", "conntrack", "python3"]).unwrap();
        let sandbox = Sandbox::new(tag).unwrap();
        let client = sandbox.add_pod("client", CLIENT_IP).unwrap();
        let backend = sandbox.add_pod("backend", BACKEND_IP).unwrap();
        let rules = sandbox.dir().join("rules.nft");
        std::fs::write(&rules, RULES).unwrap();
        sandbox.node_exec([Path::new("nft").as_os_str(), "-f".as_ref(), rules.as_os_str()]).unwrap();
        let server = backend.spawn(["python3", "-c", SERVER]).unwrap();
        backend.wait_listening("tcp", TCP_BACKEND_PORT, Some(&server), Duration::from_secs(10)).unwrap();
        backend.wait_listening("udp", UDP_BACKEND_PORT, Some(&server), Duration::from_secs(10)).unwrap();
        Node { sandbox, client, _backend: backend, _server: server }
    }

    /// Runs `f` on a thread that has entered the node namespace (only that thread moves).
    fn inside<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = self.sandbox.node_netns_path();
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    let ns = File::open(&path).unwrap();
                    // SAFETY: setns on this thread only, with a descriptor we hold.
                    let ret = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                    assert_eq!(ret, 0, "setns {}: {}", path.display(), std::io::Error::last_os_error());
                    f()
                })
                .join()
                .expect("the thread inside the node namespace panicked")
        })
    }

    fn dump(&self) -> Vec<Entry> {
        self.inside(|| {
            assert!(nf_conntrack::is_available(), "nf_conntrack in the node namespace");
            nf_conntrack::dump_v4().unwrap()
        })
    }

    /// The entry whose original tuple is `orig`, if any.
    fn find(&self, proto: Protocol, orig: Tuple) -> Option<Entry> {
        self.dump().into_iter().find(|e| e.proto == proto && e.orig == orig)
    }

    fn udp_exchange(&self, sport: u16, addr: Ipv4Addr, dport: u16) -> String {
        let out = self.client.exec([
            "python3",
            "-c",
            UDP_CLIENT,
            &sport.to_string(),
            &addr.to_string(),
            &dport.to_string(),
        ]);
        out.unwrap().trim().to_owned()
    }

    fn conntrack_list(&self) -> String {
        self.sandbox.node_exec(["conntrack", "-L", "-o", "extended"]).unwrap()
    }
}

fn tuple(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Tuple {
    Tuple { src, dst, sport, dport }
}

/// An entry as both sources can say it (the timeout moves between the two reads).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Seen {
    proto: &'static str,
    orig: Tuple,
    reply: Tuple,
    state: Option<String>,
    assured: bool,
    unreplied: bool,
    mark: u32,
}

fn seen_by_module(entries: &[Entry]) -> BTreeSet<Seen> {
    entries
        .iter()
        .map(|e| Seen {
            proto: if e.proto == Protocol::Tcp { "tcp" } else { "udp" },
            orig: e.orig,
            reply: e.reply,
            state: e.tcp_state.map(|s| s.name().to_owned()),
            assured: e.status & IPS_ASSURED != 0,
            unreplied: e.status & IPS_SEEN_REPLY == 0,
            mark: e.mark,
        })
        .collect()
}

/// `conntrack -L -o extended`'s TCP and UDP lines, e.g. `ipv4 2 tcp 6 431999 ESTABLISHED
/// src=… dst=… sport=… dport=… src=… dst=… sport=… dport=… [ASSURED] mark=0 use=1`.
fn seen_by_conntrack_cli(text: &str) -> BTreeSet<Seen> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let proto = match words.get(2) {
            Some(&"tcp") => "tcp",
            Some(&"udp") => "udp",
            _ => continue,
        };
        let value = |key: &str, nth: usize| -> &str {
            words
                .iter()
                .filter_map(|w| w.strip_prefix(key))
                .nth(nth)
                .unwrap_or_else(|| panic!("{key} in {line}"))
        };
        let direction = |nth| Tuple {
            src: value("src=", nth).parse().unwrap(),
            dst: value("dst=", nth).parse().unwrap(),
            sport: value("sport=", nth).parse().unwrap(),
            dport: value("dport=", nth).parse().unwrap(),
        };
        out.insert(Seen {
            proto,
            orig: direction(0),
            reply: direction(1),
            state: (proto == "tcp").then(|| words[5].to_owned()),
            assured: words.contains(&"[ASSURED]"),
            unreplied: words.contains(&"[UNREPLIED]"),
            mark: value("mark=", 0).parse().unwrap(),
        });
    }
    out
}

fn wait_for_log(process: &Spawned, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !process.log().lines().any(|l| l == line) {
        assert!(
            Instant::now() < deadline,
            "no {line:?} from `{}`; its output:\n{}",
            process.command_line(),
            process.log()
        );
        assert!(
            process.is_running() || process.log().lines().any(|l| l == line),
            "exited:\n{}",
            process.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Flows through kube-proxy's DNAT are dumped with their tuples, NAT status and TCP state as
/// `conntrack -L` shows them; a TCP flow that closes reaches TIME_WAIT; a deleted entry is gone.
#[test]
fn flows_natted_by_netfilter_are_dumped_followed_and_deleted() {
    let node = Node::new("nfct-dump");
    let close_when: PathBuf = node.client.dir().join("close");
    let tcp_client = node
        .client
        .spawn(["python3", "-c", TCP_CLIENT, "41000", &VIP.to_string(), &close_when.display().to_string()])
        .unwrap();
    wait_for_log(&tcp_client, "open");
    let answer = node.udp_exchange(42000, VIP, 53);
    assert_eq!(answer, format!("{VIP}:53 from {CLIENT_IP}:42000: ping"), "DNATed there and un-NATed back");

    let entries = node.dump();
    let tcp_orig = tuple(CLIENT_IP, 41000, VIP, 80);
    let udp_orig = tuple(CLIENT_IP, 42000, VIP, 53);
    let tcp = entries.iter().find(|e| e.proto == Protocol::Tcp && e.orig == tcp_orig).expect("the TCP flow");
    assert_eq!(tcp.reply, tuple(BACKEND_IP, TCP_BACKEND_PORT, CLIENT_IP, 41000));
    assert!(tcp.is_dst_nat() && !tcp.is_src_nat(), "status {:#x}", tcp.status);
    assert_eq!(tcp.tcp_state, Some(TcpState::Established));
    assert!(!tcp.is_over());
    assert!(tcp.status & IPS_ASSURED != 0 && tcp.status & IPS_CONFIRMED != 0, "status {:#x}", tcp.status);
    assert!((1..=432_000).contains(&tcp.timeout_secs), "{}", tcp.timeout_secs);
    let udp = entries.iter().find(|e| e.proto == Protocol::Udp && e.orig == udp_orig).expect("the UDP flow");
    assert_eq!(udp.reply, tuple(BACKEND_IP, UDP_BACKEND_PORT, CLIENT_IP, 42000));
    assert!(udp.is_dst_nat() && !udp.is_src_nat(), "status {:#x}", udp.status);
    assert_eq!(udp.tcp_state, None);
    assert!((1..=120).contains(&udp.timeout_secs), "{}", udp.timeout_secs);
    assert_eq!((udp.mark, udp.zone), (0, 0));
    // Everything, as the conntrack tool reads the same namespace.
    assert_eq!(seen_by_module(&entries), seen_by_conntrack_cli(&node.conntrack_list()));

    // The client closes; the server closes its side on EOF.
    std::fs::write(&close_when, b"").unwrap();
    wait_for_log(&tcp_client, "closed");
    let deadline = Instant::now() + Duration::from_secs(10);
    let closed = loop {
        let entry = node.find(Protocol::Tcp, tcp_orig).expect("a closed flow's entry lingers");
        if entry.is_over() {
            break entry;
        }
        assert!(Instant::now() < deadline, "still {:?}", entry.tcp_state);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(matches!(closed.tcp_state, Some(TcpState::TimeWait | TcpState::Close)), "{:?}", closed.tcp_state);
    assert_eq!(seen_by_module(&node.dump()), seen_by_conntrack_cli(&node.conntrack_list()));

    // Deleting one entry removes that one only.
    let udp = udp.clone();
    assert!(node.inside(|| nf_conntrack::delete(&udp)).unwrap(), "the entry existed");
    assert!(node.find(Protocol::Udp, udp_orig).is_none());
    assert!(node.find(Protocol::Tcp, tcp_orig).is_some(), "the TCP entry stays");
    let listed = node.sandbox.node_exec(["conntrack", "-L", "-p", "udp"]).unwrap();
    assert!(!listed.contains("sport=42000"), "{listed}");
    assert!(!node.inside(|| nf_conntrack::delete(&udp)).unwrap(), "already gone");

    // Without CAP_NET_ADMIN (dropped on the calling thread only) the error says what is missing.
    let err = node.inside(|| {
        drop_cap_net_admin();
        nf_conntrack::dump_v4().unwrap_err()
    });
    assert!(matches!(err, NfConntrackError::NeedsCapNetAdmin { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "conntrack dump needs CAP_NET_ADMIN in this network namespace (the kernel answered EPERM)"
    );
}

/// Clears CAP_NET_ADMIN from the calling thread's effective set (capabilities are per thread).
fn drop_cap_net_admin() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_NET_ADMIN: u32 = 12;
    let mut header = Header { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a version-3 header and the two data words it reads and writes.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()), 0);
        data[0].effective &= !(1 << CAP_NET_ADMIN);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()), 0);
    }
}

/// Entries made with `create_dnat` for a ClusterIP no rule translates make netfilter translate
/// those flows both ways: the backend sees the client, the client's replies come from the
/// ClusterIP. A flow without such an entry gets no answer. An entry whose reply tuple another
/// entry holds is refused until that one is deleted.
#[test]
fn entries_created_over_ctnetlink_translate_their_flows() {
    let node = Node::new("nfct-create");
    let create = |flow: DnatFlow| node.inside(move || nf_conntrack::create_dnat(&flow)).unwrap();
    let udp_flow = DnatFlow {
        proto: Protocol::Udp,
        client: SocketAddrV4::new(CLIENT_IP, 40100),
        vip: SocketAddrV4::new(VIP_WITHOUT_RULE, 53),
        backend: SocketAddrV4::new(BACKEND_IP, UDP_BACKEND_PORT),
        timeout_secs: 60,
        mark: 0,
        zone: 0,
    };
    assert!(create(udp_flow), "created");
    assert!(!create(udp_flow), "the second time it exists");
    let orig = tuple(CLIENT_IP, 40100, VIP_WITHOUT_RULE, 53);
    let entry = node.find(Protocol::Udp, orig).expect("the created entry");
    assert_eq!(
        entry.reply,
        tuple(BACKEND_IP, UDP_BACKEND_PORT, CLIENT_IP, 40100),
        "the kernel NATed the reply"
    );
    assert!(entry.is_dst_nat() && !entry.is_src_nat(), "status {:#x}", entry.status);
    let wanted = IPS_CONFIRMED | IPS_ASSURED | IPS_SEEN_REPLY;
    assert_eq!(entry.status & wanted, wanted, "status {:#x}", entry.status);
    assert!((1..=60).contains(&entry.timeout_secs), "{}", entry.timeout_secs);
    assert_eq!(seen_by_module(&node.dump()), seen_by_conntrack_cli(&node.conntrack_list()));

    let answer = node.udp_exchange(40100, VIP_WITHOUT_RULE, 53);
    assert_eq!(answer, format!("{VIP_WITHOUT_RULE}:53 from {CLIENT_IP}:40100: ping"));
    let answer = node.udp_exchange(40101, VIP_WITHOUT_RULE, 53);
    assert!(answer.starts_with("no answer"), "no entry, no rule, no translation: {answer}");

    // TCP: the entry starts ESTABLISHED; a connection from its port is carried through it.
    let tcp_flow = DnatFlow {
        proto: Protocol::Tcp,
        client: SocketAddrV4::new(CLIENT_IP, 40200),
        vip: SocketAddrV4::new(VIP_WITHOUT_RULE, 80),
        backend: SocketAddrV4::new(BACKEND_IP, TCP_BACKEND_PORT),
        timeout_secs: 300,
        mark: 0x40,
        zone: 0,
    };
    assert!(create(tcp_flow));
    let orig = tuple(CLIENT_IP, 40200, VIP_WITHOUT_RULE, 80);
    let entry = node.find(Protocol::Tcp, orig).expect("the created TCP entry");
    assert_eq!(entry.reply, tuple(BACKEND_IP, TCP_BACKEND_PORT, CLIENT_IP, 40200));
    assert_eq!((entry.tcp_state, entry.mark), (Some(TcpState::Established), 0x40));
    assert!(entry.is_dst_nat());
    let close_when = node.client.dir().join("close-tcp");
    std::fs::write(&close_when, b"").unwrap();
    let tcp_client = node
        .client
        .spawn([
            "python3",
            "-c",
            TCP_CLIENT,
            "40200",
            &VIP_WITHOUT_RULE.to_string(),
            &close_when.display().to_string(),
        ])
        .unwrap();
    wait_for_log(&tcp_client, "closed");
    assert!(tcp_client.log().contains("open"), "{}", tcp_client.log());

    // A plain entry (the client reached the backend directly, as when kproxy translated before
    // netfilter) holds the reply tuple backend -> client: the NATed entry must wait for it.
    let answer = node.udp_exchange(40300, BACKEND_IP, UDP_BACKEND_PORT);
    assert_eq!(answer, format!("{BACKEND_IP}:{UDP_BACKEND_PORT} from {CLIENT_IP}:40300: ping"));
    let plain =
        node.find(Protocol::Udp, tuple(CLIENT_IP, 40300, BACKEND_IP, UDP_BACKEND_PORT)).expect("plain entry");
    assert!(!plain.is_dst_nat());
    let handed_over = DnatFlow { client: SocketAddrV4::new(CLIENT_IP, 40300), ..udp_flow };
    assert!(!create(handed_over), "the reply tuple is taken (not a remapped client port)");
    assert!(node.inside(|| nf_conntrack::delete(&plain)).unwrap());
    assert!(create(handed_over), "created once the plain entry is gone");
    let answer = node.udp_exchange(40300, VIP_WITHOUT_RULE, 53);
    assert_eq!(answer, format!("{VIP_WITHOUT_RULE}:53 from {CLIENT_IP}:40300: ping"));
}

/// A table of 100 000 entries (a busy node's) is read whole, as `conntrack -L` lists it.
#[test]
fn a_table_of_100k_entries_is_read_whole() {
    const ENTRIES: u32 = 100_000;
    let node = Node::new("nfct-big");
    let created = node.inside(|| {
        (0..ENTRIES)
            .filter(|n| {
                let client = Ipv4Addr::new(10, 250, (n >> 8) as u8 & 0x7f, *n as u8);
                let flow = DnatFlow {
                    proto: Protocol::Udp,
                    client: SocketAddrV4::new(client, 10_000 + (n >> 15) as u16),
                    vip: SocketAddrV4::new(VIP_WITHOUT_RULE, 53),
                    backend: SocketAddrV4::new(BACKEND_IP, UDP_BACKEND_PORT),
                    timeout_secs: 600,
                    mark: 0,
                    zone: 0,
                };
                nf_conntrack::create_dnat(&flow).unwrap()
            })
            .count()
    });
    assert_eq!(created, ENTRIES as usize, "each flow is distinct");
    let started = Instant::now();
    let entries = node.dump();
    eprintln!("dumped {} entries in {:?}", entries.len(), started.elapsed());
    // Every TCP and UDP entry, as the conntrack tool lists the same table.
    assert_eq!(seen_by_module(&entries), seen_by_conntrack_cli(&node.conntrack_list()));
    let ours = entries.iter().filter(|e| e.orig.dst == VIP_WITHOUT_RULE && e.is_dst_nat()).count();
    assert_eq!(ours, ENTRIES as usize);
    let distinct: BTreeSet<Tuple> = entries.iter().map(|e| e.orig).collect();
    assert_eq!(distinct.len(), entries.len(), "no entry twice");
}

/// A TCP connection whose conntrack entry is replaced mid-stream by one from `create_dnat` (as
/// when kproxy hands a flow it translated to netfilter) goes on: 8 MiB each way, window-scaled,
/// with nothing dropped as INVALID.
#[test]
fn a_tcp_connection_carries_on_through_an_entry_created_mid_stream() {
    let node = Node::new("nfct-handoff");
    // No picking up of mid-stream packets: between the delete and the create, a packet would
    // otherwise make an entry of its own.
    node.sandbox.node_exec(["sysctl", "-q", "-w", "net.netfilter.nf_conntrack_tcp_loose=0"]).unwrap();
    let go_when = node.client.dir().join("go");
    let client = node
        .client
        .spawn(["python3", "-c", BULK_CLIENT, "40500", &VIP.to_string(), &go_when.display().to_string()])
        .unwrap();
    wait_for_log(&client, "open");
    let orig = tuple(CLIENT_IP, 40500, VIP, 80);
    let by_rule = node.find(Protocol::Tcp, orig).expect("the rule's entry");
    assert_eq!(by_rule.reply, tuple(BACKEND_IP, TCP_BACKEND_PORT, CLIENT_IP, 40500));
    let flow = DnatFlow {
        proto: Protocol::Tcp,
        client: SocketAddrV4::new(CLIENT_IP, 40500),
        vip: SocketAddrV4::new(VIP, 80),
        backend: SocketAddrV4::new(BACKEND_IP, TCP_BACKEND_PORT),
        timeout_secs: 600,
        mark: 0,
        zone: 0,
    };
    node.inside(|| {
        assert!(nf_conntrack::delete(&by_rule).unwrap());
        assert!(nf_conntrack::create_dnat(&flow).unwrap(), "created in the rule's entry's place");
    });
    let invalid_before = invalid_drops(&node);
    std::fs::write(&go_when, b"").unwrap();
    wait_for_log(&client, "intact");
    assert_eq!(invalid_drops(&node), invalid_before, "no packet of the flow was INVALID");
    // The client has closed by now: the created entry followed the connection to its end.
    let entry = node.find(Protocol::Tcp, orig).expect("the created entry");
    assert!(entry.is_dst_nat() && entry.is_over(), "{entry:?}");
}

/// Packets the node's `ct state invalid counter drop` rule has dropped.
fn invalid_drops(node: &Node) -> u64 {
    let table = node.sandbox.node_exec(["nft", "list", "chain", "ip", "kp_nfct", "forward"]).unwrap();
    let words: Vec<&str> = table.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "packets").unwrap_or_else(|| panic!("a counter in {table}"));
    words[at + 1].parse().unwrap()
}
