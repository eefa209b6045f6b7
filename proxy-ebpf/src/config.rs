use proxy_common::{
    conntrack::Timeouts,
    maps::{ConfigV4, DEFAULT_HAIRPIN_ADDR, NodePortConfigV4},
};

use crate::maps::{CONFIG, NODEPORT_CONFIG};

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
