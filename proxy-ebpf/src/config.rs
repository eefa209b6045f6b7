use proxy_common::{
    conntrack::Timeouts,
    maps::{ConfigV4, DEFAULT_HAIRPIN_ADDR, NodePortConfigV4, SOCKET_LB_BARE_COVERED_VETHS},
};

use crate::maps::{CONFIG, NODEPORT_CONFIG, SOCKET_LB_CONFIG};

/// The agent's settings, with defaults where it wrote none (a datapath
/// loaded by `kproxy load` before any agent ran).
pub struct Config {
    pub timeouts: Timeouts,
    pub hairpin_addr: [u8; 4],
}

#[inline(always)]
pub fn get() -> Config {
    let stored = CONFIG.get(0).copied().unwrap_or(ConfigV4::default());
    let hairpin_addr = if stored.hairpin_addr == [0; 4] { DEFAULT_HAIRPIN_ADDR } else { stored.hairpin_addr };
    Config { timeouts: Timeouts::from_config(&stored), hairpin_addr }
}

/// SNAT port range and cluster CIDR.
#[inline(always)]
pub fn nodeport() -> NodePortConfigV4 {
    NODEPORT_CONFIG.get(0).copied().unwrap_or(NodePortConfigV4::default())
}

/// Whether the veths of covered pods may carry no tc program, so a local
/// backend's reply meets kproxy only on the external interface's egress.
#[inline(always)]
pub fn bare_covered_veths() -> bool {
    SOCKET_LB_CONFIG.get(0).is_some_and(|c| c.flags & SOCKET_LB_BARE_COVERED_VETHS != 0)
}
