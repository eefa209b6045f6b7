use aya_ebpf::{helpers::bpf_get_prandom_u32, programs::TcContext};
use proxy_common::{
    icmp::IPPROTO_ICMP,
    maglev::{MAGLEV_TABLE_SIZE, flow_hash, table_index},
    maps::{
        AffinityKeyV4, AffinityValueV4, BACKEND_FLAG_TERMINATING, BackendV4, CT_FLAG_DIRECT, CtEntryV4,
        IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL, SOURCE_RANGE_ID_BITS, SVC_FLAG_AFFINITY,
        SVC_FLAG_MAGLEV, ServiceKeyV4, ServiceValueV4, SourceRangeV4, VipV4,
    },
    packet::{ETH_HLEN, IP_OFFSET_MASK},
    service_cidr::drops_other_protocol,
    slots::select_slot,
    stats::Stat,
    trace::{SLOT_BY_AFFINITY, SLOT_BY_MAGLEV},
};

use crate::{
    config,
    maps::{AFFINITY_V4, BACKENDS_V4, MAGLEV_V4, SERVICE_CIDRS_V4, SERVICES_V4, SOURCE_RANGES_V4, VIPS_V4},
    parse::Flow,
    stats,
    verdict::Verdict,
};

/// A frontend's slot 0 and the scope it was found in (its slots share it).
pub struct Frontend {
    pub value: &'static ServiceValueV4,
    pub scope: u8,
}

#[inline(always)]
fn lookup_scope(flow: &Flow, scope: u8) -> Option<Frontend> {
    let key = ServiceKeyV4::new(flow.daddr, flow.dport, flow.proto, scope, 0);
    // SAFETY: entries are replaced whole by userspace, never freed under us
    // for longer than the RCU section this program runs in.
    unsafe { SERVICES_V4.get(key) }.map(|value| Frontend { value, scope })
}

/// The frontend for a client inside the cluster (a pod).
#[inline(always)]
pub fn lookup_frontend(flow: &Flow) -> Option<Frontend> {
    lookup_scope(flow, SCOPE_INTERNAL)
}

/// The frontend for a client that arrived on an external interface: its
/// `externalTrafficPolicy: Local` entry if it has one, else the same one pods use.
#[inline(always)]
pub fn lookup_external_frontend(flow: &Flow) -> Option<Frontend> {
    lookup_scope(flow, SCOPE_EXTERNAL).or_else(|| lookup_scope(flow, SCOPE_INTERNAL))
}

/// Whether `client` is inside one of the frontend's loadBalancerSourceRanges.
#[inline(always)]
pub fn source_allowed(rev_nat_id: proxy_common::maps::RevNatId, client: [u8; 4]) -> bool {
    let key =
        aya_ebpf::maps::lpm_trie::Key::new(SOURCE_RANGE_ID_BITS + 32, SourceRangeV4::new(rev_nat_id, client));
    SOURCE_RANGES_V4.get(&key).is_some()
}

/// Whether `addr` is a Service's cluster IP (on any port). North–south addresses have entries
/// too, and are none.
#[inline(always)]
pub fn is_vip(addr: &[u8; 4]) -> bool {
    vip_entry(addr).is_some_and(|entry| entry.is_cluster_ip())
}

/// The VIPS_V4 entry of `addr`: `None` for an address with no frontend at all (a pod's, most
/// often), for which no service map needs a lookup.
#[inline(always)]
pub fn vip_entry(addr: &[u8; 4]) -> Option<VipV4> {
    // SAFETY: a word copied out at once.
    unsafe { VIPS_V4.get(addr) }.copied()
}

/// Whether `addr` is inside a service CIDR. Asked only of an address that is
/// no VIP: one array lookup (inlined by the verifier) and a few compares.
#[inline(always)]
pub fn in_service_cidr(addr: &[u8; 4]) -> bool {
    SERVICE_CIDRS_V4.get(0).is_some_and(|cidrs| cidrs.contains(*addr))
}

/// Whether a packet of neither TCP nor UDP (ICMP echo, SCTP, GRE, ...) goes to
/// an address inside a service CIDR that is no VIP, and opens a connection
/// there as netfilter's conntrack sees it: then it is dropped, as kube-proxy's
/// cluster-ips-check drops every protocol
/// ([`proxy_common::service_cidr::drops_other_protocol`]). Not inlined: called
/// from the program itself, for packets `parse::flow` left alone.
#[inline(never)]
pub fn unallocated_other_protocol(ctx: &TcContext) -> bool {
    let Ok(header) = ctx.load::<[u8; 20]>(ETH_HLEN) else { return false };
    let daddr = [header[16], header[17], header[18], header[19]];
    if !in_service_cidr(&daddr) || is_vip(&daddr) {
        return false;
    }
    let proto = header[9];
    let first = u16::from_be_bytes([header[6], header[7]]) & IP_OFFSET_MASK == 0;
    let icmp_type = if first && proto == IPPROTO_ICMP {
        // Bounded for the verifier: IHL is at most 15 words.
        match ctx.load::<u8>(ETH_HLEN + usize::from(header[0] & 0x0f) * 4) {
            Ok(icmp_type) => Some(icmp_type),
            Err(_) => return false,
        }
    } else {
        None
    };
    drops_other_protocol(proto, icmp_type)
}

/// Whether the backend a conntrack entry points at still exists with the
/// address the flow was sent to (ids may be reused after a removal).
#[inline(always)]
pub fn backend_is_current(entry: &CtEntryV4) -> bool {
    // SAFETY: as in `lookup_frontend`.
    match unsafe { BACKENDS_V4.get(entry.backend_id) } {
        Some(b) => b.addr == entry.nat_addr && b.port == entry.nat_port,
        None => false,
    }
}

/// Whether a known flow stays on the backend its entry records. TCP always
/// does, as with kube-proxy (it never touches a TCP flow's conntrack entry):
/// a readiness flap or a pod leaving its slice while it still serves must
/// not break its connections, and a backend that is really gone stops
/// answering either way. UDP moves once its backend is gone (the CoreDNS
/// problem: a client that keeps its source port reaches a live backend with
/// its next datagram); direct flows have no backend to lose.
#[inline(always)]
pub fn keeps_backend(entry: &CtEntryV4, proto: u8) -> bool {
    proto == IPPROTO_TCP || entry.flags & CT_FLAG_DIRECT != 0 || backend_is_current(entry)
}

/// Slots searched for a sticky backend that is no longer in its hint's.
const AFFINITY_SLOT_SCAN: u16 = 64;

/// The active slot of `frontend` (1..=count) that holds `backend_id`, trying
/// `hint` first: a sticky backend must still be the frontend's own — the
/// same backend id may serve other Services after it left this one (kube-proxy
/// forgets affinity with the endpoint's chain). Frontends with more active
/// backends than the scan covers keep a sticky backend found past it.
#[inline(always)]
fn slot_of(flow: &Flow, found: &Frontend, backend_id: u32, hint: u32) -> Option<u16> {
    let count = found.value.count;
    let holds = |slot: u16| {
        let key = ServiceKeyV4::new(flow.daddr, flow.dport, flow.proto, found.scope, slot);
        // SAFETY: as in `lookup_frontend`.
        unsafe { SERVICES_V4.get(key) }.is_some_and(|v| v.backend_id == backend_id)
    };
    if hint >= 1 && hint <= u32::from(count) && holds(hint as u16) {
        return Some(hint as u16);
    }
    // A counted loop: RangeInclusive's exhausted flag compiled (with slot 0's wider rev-NAT id) to
    // code whose repeated states the verifier takes for an infinite loop.
    let scan = if count < AFFINITY_SLOT_SCAN { count } else { AFFINITY_SLOT_SCAN };
    let mut slot = 1;
    while slot <= scan {
        if holds(slot) {
            return Some(slot);
        }
        slot += 1;
    }
    (count > AFFINITY_SLOT_SCAN).then_some(0)
}

pub struct Choice {
    pub backend_id: u32,
    pub backend: BackendV4,
    /// The slot it was picked from, or `SLOT_BY_AFFINITY` / `SLOT_BY_MAGLEV` (what the trace says).
    pub slot: u16,
}

/// The backend Maglev table `table` gives a flow: the same on every node for
/// the same flow, seed and backends.
#[inline(always)]
fn maglev_backend(flow: &Flow, table: u32) -> Option<Choice> {
    let seed = config::nodeport().maglev_seed;
    let hash = flow_hash(flow.saddr, flow.daddr, flow.sport, flow.dport, flow.proto, seed);
    let index = table.checked_mul(MAGLEV_TABLE_SIZE)?.checked_add(table_index(hash, MAGLEV_TABLE_SIZE))?;
    let backend_id = *MAGLEV_V4.get(index)?;
    // SAFETY: the value is copied out at once.
    let backend = unsafe { BACKENDS_V4.get(backend_id) }.copied()?;
    if backend.flags & BACKEND_FLAG_TERMINATING != 0 {
        return None;
    }
    stats::count(Stat::MaglevPick);
    Some(Choice { backend_id, backend, slot: SLOT_BY_MAGLEV })
}

/// The backend for a new flow: the client's sticky one while its affinity
/// entry is fresh, otherwise one of the active backends with equal probability.
#[inline(always)]
pub fn select_backend(flow: &Flow, found: &Frontend, now: u64) -> Result<Choice, Verdict> {
    // SAFETY: a helper without side effects.
    select_backend_by(flow, found, now, unsafe { bpf_get_prandom_u32() })
}

/// [`select_backend`] with the value that picks among the slots when neither
/// affinity nor Maglev decides (uniform over u32).
#[inline(always)]
pub fn select_backend_by(flow: &Flow, found: &Frontend, now: u64, pick: u32) -> Result<Choice, Verdict> {
    let frontend = found.value;
    let affinity = frontend.flags & SVC_FLAG_AFFINITY != 0;
    // Keyed per Service port, not per frontend: the client keeps its endpoint
    // whichever of the port's addresses it uses (kube-proxy's affinity sets).
    let affinity_key = AffinityKeyV4 { client: flow.saddr, rev_nat_id: frontend.affinity_id() };
    if affinity && let Some(sticky) = AFFINITY_V4.get_ptr_mut(affinity_key) {
        // SAFETY: as in `lookup_frontend`; the value is ours to update.
        unsafe {
            let timeout_ns = u64::from(frontend.affinity_timeout_s) * 1_000_000_000;
            let backend_id = (*sticky).backend_id;
            if now.saturating_sub((*sticky).last_used_ns) <= timeout_ns
                && let Some(slot) = slot_of(flow, found, backend_id, (*sticky).slot)
                && let Some(backend) = BACKENDS_V4.get(backend_id)
                && backend.flags & BACKEND_FLAG_TERMINATING == 0
            {
                (*sticky).last_used_ns = now;
                (*sticky).slot = u32::from(slot);
                stats::count(Stat::AffinityHit);
                return Ok(Choice { backend_id, backend: *backend, slot: SLOT_BY_AFFINITY });
            }
        }
    }

    if frontend.flags & SVC_FLAG_MAGLEV != 0
        && let Some(table) = frontend.maglev_table()
        && let Some(choice) = maglev_backend(flow, table)
    {
        return Ok(choice);
    }

    let slot = select_slot(pick, frontend.count).ok_or(Verdict::pass(Stat::NoBackend))?;
    let key = ServiceKeyV4::new(flow.daddr, flow.dport, flow.proto, found.scope, slot);
    // SAFETY: as in `lookup_frontend`.
    let backend_id =
        unsafe { SERVICES_V4.get(key) }.map(|v| v.backend_id).ok_or(Verdict::pass(Stat::SlotMiss))?;
    // SAFETY: as above; the value is copied out.
    let backend = unsafe { BACKENDS_V4.get(backend_id) }.copied().ok_or(Verdict::pass(Stat::SlotMiss))?;
    if affinity {
        let value = AffinityValueV4 { last_used_ns: now, backend_id, slot: u32::from(slot) };
        // A full LRU evicts an old client; a failure only costs stickiness.
        let _ = AFFINITY_V4.insert(affinity_key, value, 0);
    }
    Ok(Choice { backend_id, backend, slot })
}
