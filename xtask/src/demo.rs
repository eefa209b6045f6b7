//! `cargo xtask demo`: the ClusterIP demo in a network-namespace sandbox (see the `sandbox` crate).
use std::path::Path;

use anyhow::Result;

/// Runs the demo with the release `kproxy` at `kproxy_bin` and the manifests in `examples_dir`.
///
/// Placeholder until the demo lands: it says so and exits with status 1.
pub fn run(kproxy_bin: &Path, examples_dir: &Path) -> Result<()> {
    let _ = (kproxy_bin, examples_dir);
    println!("demo not yet implemented");
    std::process::exit(1);
}
