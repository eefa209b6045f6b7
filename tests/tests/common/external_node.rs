//! A node with an external interface for BPF_PROG_TEST_RUN tests of the north-south programs,
//! whose route lookups need an interface, routes and neighbours: a thread moves itself into a
//! new network namespace (`unshare(CLONE_NEWNET)`) holding veth pairs with static neighbours and
//! no route out; the namespace disappears with the thread.

use std::process::Command;

use kproxy::bpf;

pub const NODE: [u8; 4] = [192, 168, 100, 10];
/// The other node (a router on the way, and the way to its pods).
pub const PEER: [u8; 4] = [192, 168, 100, 11];
pub const EXT_CLIENT: [u8; 4] = [192, 168, 100, 200];
pub const OTHER_HOST: [u8; 4] = [192, 168, 100, 201];
pub const REMOTE_BACKEND: [u8; 4] = [10, 244, 1, 5];
pub const LOCAL_POD: [u8; 4] = [10, 244, 0, 5];
pub const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x11];
pub const EXT_CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xc8];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn ip(a: [u8; 4]) -> String {
    std::net::Ipv4Addr::from(a).to_string()
}

/// Runs `test` in a thread inside a fresh network namespace with `ext0` (the node's external
/// interface, NODE/24, the peer node, the client and another host as permanent neighbours, the
/// peer's pod CIDR routed via it) and `pod0` (a local pod's veth, 10.244.0.0/24 on it); `test`
/// gets ext0's index.
pub fn in_private_netns(test: impl FnOnce(u32) + Send + 'static) {
    let result = std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread, which owns nothing shared yet.
        let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(ret, 0, "unshare(CLONE_NEWNET) needs root: {}", std::io::Error::last_os_error());
        sh(&["ip", "link", "add", "ext0", "address", &mac(NODE_MAC), "type", "veth", "peer", "name", "ext1"]);
        sh(&["ip", "link", "add", "pod0", "type", "veth", "peer", "name", "pod1"]);
        for dev in ["lo", "ext0", "ext1", "pod0", "pod1"] {
            sh(&["ip", "link", "set", dev, "up"]);
        }
        sh(&["ip", "addr", "add", &format!("{}/24", ip(NODE)), "dev", "ext0"]);
        sh(&["ip", "route", "add", "10.244.1.0/24", "via", &ip(PEER)]);
        sh(&["ip", "route", "add", "10.244.0.0/24", "dev", "pod0"]);
        for (addr, m, dev) in [
            (PEER, PEER_MAC, "ext0"),
            (EXT_CLIENT, EXT_CLIENT_MAC, "ext0"),
            (OTHER_HOST, [0x02, 0, 0, 0, 0, 0xc9], "ext0"),
            (LOCAL_POD, [0x02, 0, 0, 0, 0, 0x05], "pod0"),
        ] {
            sh(&["ip", "neigh", "replace", &ip(addr), "lladdr", &mac(m), "dev", dev, "nud", "permanent"]);
        }
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap();
        let index = bpf::interfaces().unwrap().into_iter().find(|i| i.name == "ext0").unwrap().index;
        test(index);
    })
    .join();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
