//! What the service maps should hold for a frontend: its key, slot layout and flags, and its Maglev table
//! (its source-range keys are `bpf::source_range_key`). The one description of the maps' contents: the
//! [`Syncer`](super::Syncer) writes it and `kproxy dump diff` compares the maps with it.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::Result;
use proxy_common::maps::*;

use crate::model::{BackendAddr, Frontend, FrontendKind, Scope, ServiceName};
use crate::net::Protocol;

/// A frontend as the maps key it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub vip: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    /// [`SCOPE_INTERNAL`] or [`SCOPE_EXTERNAL`].
    pub scope: u8,
}

impl FrontendKey {
    pub fn of(frontend: &Frontend) -> Self {
        let scope = match frontend.scope {
            Scope::Internal => SCOPE_INTERNAL,
            Scope::External => SCOPE_EXTERNAL,
        };
        Self { vip: frontend.vip, port: frontend.port, proto: frontend.proto, scope }
    }
}

/// `--lb-algorithm=maglev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevSettings {
    /// Shared by all nodes.
    pub seed: u32,
    /// Tables in MAGLEV_V4: external frontends beyond it use random selection.
    pub tables: u32,
}

/// The Maglev table of `backends` (ids aligned with their addresses): the
/// backend id of each of its [`proxy_common::maglev::MAGLEV_TABLE_SIZE`] entries. A frontend's backends are of its own
/// family; the IPv4 and IPv6 identities hash differently, so a mixed list is refused.
pub fn build_maglev_table(backends: &[(BackendAddr, u32)], proto: Protocol, seed: u32) -> Result<Vec<u32>> {
    use proxy_common::maglev::{BackendIdentityV4, BackendIdentityV6};
    let first = backends.first().map(|(b, _)| b.addr.is_ipv4()).unwrap_or(true);
    if let Some((b, _)) = backends.iter().find(|(b, _)| b.addr.is_ipv4() != first) {
        anyhow::bail!("Maglev table: backend {b} is not of the family of {}", backends[0].0);
    }
    let port = |b: &BackendAddr| b.port.to_be_bytes();
    let indices = if first {
        let identities: Vec<BackendIdentityV4> = backends
            .iter()
            .filter_map(|(b, _)| match b.addr {
                IpAddr::V4(addr) => Some(BackendIdentityV4::new(addr.octets(), port(b), proto.number())),
                IpAddr::V6(_) => None,
            })
            .collect();
        maglev_indices(&identities, seed)?
    } else {
        let identities: Vec<BackendIdentityV6> = backends
            .iter()
            .filter_map(|(b, _)| match b.addr {
                IpAddr::V6(addr) => Some(BackendIdentityV6::new(addr.octets(), port(b), proto.number())),
                IpAddr::V4(_) => None,
            })
            .collect();
        maglev_indices(&identities, seed)?
    };
    Ok(indices.into_iter().map(|i| backends[i as usize].1).collect())
}

/// [`proxy_common::maglev::populate`] into a table of [`proxy_common::maglev::MAGLEV_TABLE_SIZE`] indices.
fn maglev_indices<I: proxy_common::maglev::BackendIdentity>(identities: &[I], seed: u32) -> Result<Vec<u32>> {
    use proxy_common::maglev::{MAGLEV_TABLE_SIZE, populate, scratch_len};
    let mut table = vec![0u32; MAGLEV_TABLE_SIZE as usize];
    let mut scratch = vec![0u32; scratch_len(identities.len())];
    populate(identities, seed, MAGLEV_TABLE_SIZE, &mut table, &mut scratch)
        .map_err(|e| anyhow::anyhow!("Maglev table: {e}"))?;
    Ok(table)
}

/// The flag each backend of `frontends` should carry: active when any
/// frontend sends new connections to it, terminating when frontends only keep
/// its existing flows. (With `publishNotReadyAddresses` one Service may see
/// an endpoint as ready that another sees as terminating; active wins, since
/// the flag only stops new connections from following affinity to it.)
pub fn desired_backend_flags<'a>(
    frontends: impl IntoIterator<Item = &'a Frontend>,
) -> BTreeMap<(BackendAddr, Protocol), u8> {
    let mut flags = BTreeMap::new();
    for fe in frontends {
        for b in &fe.backends {
            flags.insert((*b, fe.proto), BACKEND_FLAG_ACTIVE);
        }
        for b in &fe.terminating_backends {
            flags.entry((*b, fe.proto)).or_insert(BACKEND_FLAG_TERMINATING);
        }
    }
    flags
}

/// Slot 0 and slots `1..=active+terminating` of a frontend: active backends
/// first (the datapath picks among `1..=count`), then the terminating ones.
pub fn slot_layout(
    active: &[u32],
    terminating: &[u32],
    rev_nat_id: RevNatId,
    flags: u16,
    affinity_timeout_s: u32,
) -> Result<Vec<(u16, ServiceValueV4)>> {
    let total = active.len() + terminating.len();
    if total > usize::from(u16::MAX) {
        // Slots are u16 in the key: a limit per frontend, not on how many frontends there are.
        anyhow::bail!("{total} endpoints exceed the 65535 slots of a frontend");
    }
    let mut slots = Vec::with_capacity(total + 1);
    slots.push((
        0,
        ServiceValueV4 {
            count: active.len() as u16,
            terminating_count: terminating.len() as u16,
            rev_nat_id,
            flags,
            affinity_timeout_s,
            ..Default::default()
        },
    ));
    for (i, id) in active.iter().chain(terminating).enumerate() {
        slots.push((i as u16 + 1, ServiceValueV4 { backend_id: *id, rev_nat_id, ..Default::default() }));
    }
    Ok(slots)
}

/// Slot 0 flags of a frontend.
pub fn frontend_flags(frontend: &Frontend) -> u16 {
    let mut flags = 0;
    if frontend.session_affinity_timeout.is_some() {
        flags |= SVC_FLAG_AFFINITY;
    }
    if frontend.local_only {
        flags |= SVC_FLAG_LOCAL_ONLY;
    }
    if frontend.terminating_fallback {
        flags |= SVC_FLAG_TERMINATING_FALLBACK;
    }
    if frontend.kind != FrontendKind::ClusterIp {
        flags |= SVC_FLAG_EXTERNAL_ADDR;
    }
    if frontend.external_local {
        flags |= SVC_FLAG_EXTERNAL_LOCAL;
    }
    if !frontend.source_ranges.is_empty() {
        flags |= SVC_FLAG_SOURCE_RANGES;
    }
    if frontend.no_local_endpoints {
        flags |= SVC_FLAG_NO_LOCAL_ENDPOINTS;
    }
    flags
}

/// A Service port as kube-proxy names it (`ServicePortName` and protocol), in one family (true: IPv4): what its
/// session affinity is kept per.
pub type ServicePortKey = (ServiceName, String, Protocol, bool);

/// The Service port `frontend` belongs to.
pub fn service_port(frontend: &Frontend) -> ServicePortKey {
    // Per family: a dual-stack Service's IPv4 NodePort shares its clients' affinity with the IPv4
    // cluster IP, not the IPv6 one (kube-proxy's affinity lives in each family's proxier).
    (frontend.service.clone(), frontend.port_name.clone(), frontend.proto, frontend.vip.is_ipv4())
}

/// The cluster-IP frontend of each Service port among `frontends`: the one whose rev-NAT id the port's other
/// frontends key session affinity by.
pub fn cluster_ip_frontends<'a>(
    frontends: impl IntoIterator<Item = &'a Frontend>,
) -> BTreeMap<ServicePortKey, FrontendKey> {
    frontends
        .into_iter()
        .filter(|f| f.kind == FrontendKind::ClusterIp && f.scope == Scope::Internal)
        .map(|f| (service_port(f), FrontendKey::of(f)))
        .collect()
}

/// The affinity id slot 0 of `frontend` carries ([`ServiceValueV4::with_slot0_ids`]): for a node port,
/// external or load-balancer IP of a Service with `sessionAffinity: ClientIP`, the rev-NAT id of the port's
/// cluster-IP frontend (`rev_nat_id_of` gives a programmed frontend's), so that AFFINITY_V4 holds one entry per
/// client and Service port as kube-proxy's affinity sets do (pkg/proxy/nftables/proxier.go: affinity "to a
/// particular ServicePort (without regard to which service IP was used to reach the service)"; the iptables
/// proxier's `recent` lists likewise). 0 — the frontend's own id — for the cluster IP itself, without affinity,
/// or while the cluster IP is not programmed.
pub fn affinity_id(
    frontend: &Frontend,
    cluster_ips: &BTreeMap<ServicePortKey, FrontendKey>,
    rev_nat_id_of: impl Fn(&FrontendKey) -> Option<RevNatId>,
) -> RevNatId {
    if frontend.session_affinity_timeout.is_none() || frontend.kind == FrontendKind::ClusterIp {
        return 0;
    }
    cluster_ips.get(&service_port(frontend)).and_then(rev_nat_id_of).unwrap_or(0)
}
