//! `kproxy trace`: NAT events from the datapath's ring buffer.

use anyhow::Result;

use crate::datapath::PinDir;

#[derive(clap::Args, Debug, Default)]
pub struct TraceArgs {}

pub fn run(pins: &PinDir, args: &TraceArgs) -> Result<()> {
    let _ = (pins, args);
    anyhow::bail!("trace is not implemented yet")
}
