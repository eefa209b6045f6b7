//! `kproxy dump diff`: what the agent wants against what the maps hold.

use anyhow::Result;

use crate::datapath::Maps;

/// Where the desired state comes from (as `kproxy agent` would read it).
#[derive(clap::Args, Debug, Default)]
pub struct DiffArgs {}

/// The report, and whether anything differs.
pub fn run(maps: &Maps, args: &DiffArgs, json: bool) -> Result<(String, bool)> {
    let _ = (maps, args, json);
    anyhow::bail!("dump diff is not implemented yet")
}
