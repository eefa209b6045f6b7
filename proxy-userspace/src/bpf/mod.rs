//! Loading, pinning, attaching and unloading the kernel programs.
//!
//! Layout under the pin directory (default `/sys/fs/bpf/kproxy`):
//! `maps/<map>`, `progs/<program>`, `links/<ifname>@<ifindex>-<ingress|egress>`.
//! Everything the datapath needs survives the process: an agent restart (or
//! crash) drops no established flow.

mod attach;
mod bpffs;
pub mod conntrack;
mod load;
mod lock;
mod log;
mod maps;
mod pins;
pub mod service_cidrs;
mod service_store;
mod stats;
#[cfg(test)]
mod tests;
pub mod trace;

pub use attach::{
    AttachReport, Interface, InterfaceSelector, XDP_SUFFIX, XdpSetting, attach_all, attach_matching,
    attach_socket_lb, cgroup2_mount, detach_socket_lb, interfaces, socket_link_cgroup,
};
pub use bpffs::{BpffsScope, bpffs_scope, ensure_bpffs};
pub use load::{
    Capacities, LoadError, Unloaded, btf_unions_as_structs, load, load_unpinned, load_unpinned_patched,
    load_unpinned_with, load_with, set_bpf_debug_log, unload, unload_after, unload_with,
};
pub(crate) use lock::flock;
pub use lock::{ClaimOptions, PinLock, claim, lock_holder, pin_lock_pid};
pub use log::forward_bpf_logs;
pub use maps::{
    ALL_MAPS, InheritedMap, Maps, expected_layout, map_usage, map_usage_where, remove_present, second_handle,
};
pub use pins::{DEFAULT_PIN_DIR, Hook, PinDir, SOCKET_PROGRAMS};
pub use service_store::{
    BpfStore, Store, read_entries, read_source_ranges, read_source_ranges6, rev_nat_capacity,
    source_range_key, source_range_key6,
};
pub use stats::read_stats;
