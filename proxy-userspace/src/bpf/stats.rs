//! The datapath's packet counters (STATS, one per [`Stat`], summed over the CPUs).

use anyhow::{Context as _, Result};
use proxy_common::stats::Stat;

use super::Maps;

/// Every counter with its total over the CPUs.
pub fn read_stats(maps: &Maps) -> Result<Vec<(Stat, u64)>> {
    Stat::ALL
        .iter()
        .map(|stat| {
            let per_cpu = maps.stats.get(&(*stat as u32), 0).context("reading the stats map")?;
            Ok((*stat, per_cpu.iter().sum()))
        })
        .collect()
}
