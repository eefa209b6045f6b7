use proxy_common::{
    conntrack::Timeouts,
    maps::{ConfigV4, DEFAULT_HAIRPIN_ADDR, NodePortConfigV4, SOCKET_LB_BARE_COVERED_VETHS},
};

use crate::maps::{CONFIG, NODEPORT_CONFIG, NODEPORT_CONFIG_V6, SOCKET_LB_CONFIG};

/// The agent's settings, with defaults where it wrote none (a datapath
/// loaded by `kproxy load` before any agent ran).
pub struct Config {
    pub timeouts: Timeouts,
    pub hairpin_addr: [u8; 4],
}

#[inline(always)]
pub fn get() -> Config {
    let stored = CONFIG.get(0).copied().unwrap_or(ConfigV4::default());
    Config { timeouts: Timeouts::from_config(&stored), hairpin_addr: hairpin_or_default(stored.hairpin_addr) }
}

/// The hairpin address alone: what every packet needs, without the timeouts, which only a packet
/// of a known flow does.
#[inline(always)]
pub fn hairpin_addr() -> [u8; 4] {
    hairpin_or_default(CONFIG.get(0).map_or([0; 4], |stored| stored.hairpin_addr))
}

#[inline(always)]
fn hairpin_or_default(stored: [u8; 4]) -> [u8; 4] {
    if stored == [0; 4] { DEFAULT_HAIRPIN_ADDR } else { stored }
}

/// SNAT port range and cluster CIDR.
#[inline(always)]
pub fn nodeport() -> NodePortConfigV4 {
    NODEPORT_CONFIG.get(0).copied().unwrap_or(NodePortConfigV4::default())
}

/// Whether `addr` is known to be outside `--cluster-cidr`'s IPv6 prefix (none known: nobody is).
#[inline(always)]
pub fn outside_cluster_cidr6(addr: &[u8; 16]) -> bool {
    NODEPORT_CONFIG_V6.get(0).is_some_and(|config| config.outside_cluster_cidr(addr))
}

/// Whether the veths of covered pods may carry no tc program, so a local
/// backend's reply meets kproxy only on the external interface's egress.
#[inline(always)]
pub fn bare_covered_veths() -> bool {
    SOCKET_LB_CONFIG.get(0).is_some_and(|c| c.flags & SOCKET_LB_BARE_COVERED_VETHS != 0)
}
