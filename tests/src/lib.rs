//! Network-namespace sandboxes for kproxy's integration tests and `cargo xtask demo`.
//!
//! A [`Sandbox`] is one "node": a network namespace with `ip_forward=1` and no default route.
//! [`Sandbox::add_pod`] adds a pod the way Calico does: its own namespace, a veth pair whose pod
//! side is `eth0` with a /32 address and a default route via [`GATEWAY_IP`] (169.254.1.1, answered by
//! proxy ARP on the node side), and whose node side (`veth…`, the glob kproxy attaches to) carries
//! a /32 route to the pod. Pods reach each other only through the node, so a program on the host
//! veths sees every packet.
//!
//! Safety rules the sandbox keeps:
//! - every packet stays inside namespaces it created: no namespace has a route out, nothing is
//!   added to the root namespace, and nothing is sent from it;
//! - names are unique per process, sandbox and tag (`kp-<pid>-<n>-<tag>-…`);
//! - everything (processes, namespaces, veths, temp dirs) is removed on drop, panics included;
//!   [`cleanup_stale`] removes what a killed run left behind.
//!
//! Everything here needs root and a few Debian packages; a missing one is reported with a hint
//! to run `cargo xtask setup`.

pub mod apiserver;
pub mod cgroup;
mod cmd;
pub mod constant_program;
pub mod differential;
pub mod kube_proxy_rules;
pub mod multinode;
mod sandbox;
mod servers;
mod tools;
mod xdp_pass;

pub use sandbox::{GATEWAY_IP, NETNS_PREFIX, NODE_DEVICE, NODE_IP, Pod, Sandbox, Spawned, cleanup_stale};
pub use servers::{
    BIG_FILE_LEN, BIG_FILE_PATH, BIG_TXT_STRINGS, QueryLog, SLOW_FILE_PATH, big_dns_query_script,
    big_file_contents,
};
pub use tools::{find_tool, kproxy_bin, require_root, require_tools};

#[cfg(test)]
mod tests;
