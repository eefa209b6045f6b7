//! The datapath's aya-log records, forwarded to this process's log.

use super::pins::PinDir;
use anyhow::{Result, anyhow};
use aya::programs::SchedClassifier;
use proxy_common::maps::*;

/// Forwards the datapath's aya-log records (debug level, when loaded with
/// it) to this process's log. Polled; returns when `stop` is set.
pub fn forward_bpf_logs(pins: &PinDir, stop: &std::sync::atomic::AtomicBool) -> Result<()> {
    let program = SchedClassifier::from_pin(pins.program(PROG_INGRESS))?;
    let id = program.info()?.id();
    let mut logger =
        aya_log::EbpfLogger::init_from_id(id).map_err(|e| anyhow!("attaching to the datapath log: {e}"))?;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        logger.flush();
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}
