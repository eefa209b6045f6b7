//! The `kproxy` agent and operator commands, in folders by role. Imports run downward only:
//! `cmd` and `agent` never import each other, `bpf` imports nothing of the crate but `net`, and
//! `model` does no I/O.

/// The daemon: reconcile what the cluster says into the maps, clean up conntrack, serve health and metrics.
pub mod agent;
/// The kernel boundary: loading, pinning and attaching the programs, and the maps as typed handles.
pub mod bpf;
/// Operator commands: dump, diff, trace, conntrack flush, cleanup, doctor.
pub mod cmd;
/// Which pods the socket hooks cover (a leaf: the agent leaves their veths bare, doctor expects it).
pub mod coverage;
/// What the cluster says: manifests, API and manifest watchers, object errors.
pub mod k8s;
/// Pure: Services and EndpointSlices → the desired frontends.
pub mod model;
/// Protocol and IPv4 prefix, the leaf every module may use.
pub mod net;
/// The kernel's nf_conntrack table over ctnetlink: dump, delete, create (a leaf beside `net`).
pub mod nf_conntrack;
/// The desired frontends → the service maps, and what the maps should hold (`sync::image`).
pub mod sync;

#[cfg(test)]
mod testutil;
