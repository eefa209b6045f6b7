//! `kproxy dump diff`: what the agent wants against what the maps hold.
//!
//! The desired state is computed exactly as `kproxy agent` computes it (the
//! same sources, label selector and [`model::build_with`]); the maps are read
//! once. Every difference names its frontend (`vip:port/PROTO`) and Service:
//!
//! | kind | meaning |
//! |---|---|
//! | `missing-frontend` | wanted, but the services map has no slot 0 for it |
//! | `extra-frontend` | in the services map, not wanted |
//! | `backends` | the active backends (slots `1..=count`) differ: missing / extra addresses |
//! | `terminating-backends` | the serving-and-terminating ones (slots after `count`) differ |
//! | `slot0` | slot 0's flags or affinity timeout differ |
//! | `slots` | a slot is missing, above the total, points at an unknown backend or another rev-NAT id |
//! | `backend-flags` | a backend is active where it should be terminating, or the reverse |
//! | `rev-nat` | the frontend's rev-NAT entry is missing or names another VIP |
//! | `name` | the names map does not hold `namespace/name:port` for the frontend |
//! | `orphan-backend` | a backend no slot points at |
//! | `orphan-rev-nat`, `orphan-name` | entries of no frontend |
//! | `vip` | VIPS_V4 does not count the cluster-IP frontends the services map holds on a VIP |
//! | `source-ranges` | the source ranges of a LoadBalancer frontend differ: missing / extra ranges |
//! | `orphan-source-range` | a source range of no frontend |
//! | `maglev` | the Maglev table slot 0 names does not hold the table of its active backends |
//! | `service-cidrs` | SERVICE_CIDRS_V4 does not hold the IPv4 service CIDRs (ServiceCIDR objects and `--service-cidr`) |
//!
//! Frontends are keyed as the syncer keys them ([`FrontendKey::of`]: the
//! `externalTrafficPolicy: Local` entry of a north–south address has its own
//! scope), and flags are compared with [`frontend_flags`]; the Maglev bit is
//! the syncer's choice (it depends on free tables) and is checked through
//! the table it points at. VIPS_V4 is checked against the services map (what
//! the datapath refuses must match what it translates) and, as the syncer
//! writes it, counts cluster-IP frontends only, so a missing frontend is
//! reported once, not again as a VIP count.
//!
//! [`desired`] reads what the agent would program, [`state`] reads the maps, [`compare`] finds the differences
//! and [`render`] writes them for the operator.

mod compare;
mod desired;
mod render;
mod state;

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;

use crate::bpf::Maps;

pub use compare::compare;
pub use render::table;
pub use state::MapState;

/// Where the desired state comes from (as `kproxy agent` would read it).
#[derive(clap::Args, Debug, Default)]
pub struct DiffArgs {
    /// dump diff: read Services and EndpointSlices from this file or directory
    /// (as `kproxy agent --manifests`) instead of the API server.
    #[arg(long, conflicts_with_all = ["kubeconfig", "master"])]
    pub manifests: Option<PathBuf>,
    /// dump diff: kubeconfig file (default: in-cluster config, then ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// dump diff: API server URL; overrides the kubeconfig's.
    #[arg(long)]
    pub master: Option<String>,
    /// dump diff: this node's name, for internalTrafficPolicy: Local (as the agent's).
    #[arg(long, env = "NODE_NAME")]
    pub hostname_override: Option<String>,
    /// dump diff: only Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long)]
    pub service_proxy_name: Option<String>,
    /// dump diff: the agent's --service-cidr (ranges besides the ServiceCIDR objects').
    #[arg(long = "service-cidr", value_name = "CIDR[,CIDR]")]
    pub service_cidr: Vec<String>,
}

/// One difference between the desired state and the maps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub kind: &'static str,
    /// `vip:port/PROTO`; empty for entries of no frontend (orphans).
    pub frontend: String,
    /// `namespace/name:port` (the wanted one, or the names map's for extras).
    pub service: String,
    pub detail: String,
}

/// The report, and whether anything differs.
pub fn run(maps: &Maps, args: &DiffArgs, json: bool) -> Result<(String, bool)> {
    let wanted = desired::desired(args)?;
    let state = MapState::read(maps)?;
    let mut differences = compare(&wanted.desired, &state);
    differences.extend(compare::service_cidrs(&wanted.service_cidrs, &state.service_cidrs));
    let text = if json { serde_json::to_string_pretty(&differences)? + "\n" } else { table(&differences) };
    Ok((text, !differences.is_empty()))
}
