//! `kproxy doctor`: checks the node for what breaks a service proxy.

use anyhow::Result;

use crate::datapath::PinDir;

#[derive(clap::Args, Debug, Default)]
pub struct DoctorArgs {}

/// Prints the report; returns the process exit status (non-zero on FAIL).
pub fn run(pins: &PinDir, args: &DoctorArgs) -> Result<i32> {
    let _ = (pins, args);
    anyhow::bail!("doctor is not implemented yet")
}
