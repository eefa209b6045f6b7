//! `kproxy cleanup-kube-proxy`: removes what kube-proxy left in netfilter.

use anyhow::Result;

/// Lists (and with `apply`, removes) kube-proxy's chains; returns the report.
pub fn run(apply: bool) -> Result<String> {
    let _ = apply;
    anyhow::bail!("cleanup-kube-proxy is not implemented yet")
}
