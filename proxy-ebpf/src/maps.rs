use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
};
use proxy_common::{
    maps::*,
    stats::Stat,
    trace::{EVENTS_BYTES, TraceConfig},
};

#[map(name = "SERVICES_V4")]
pub static SERVICES_V4: HashMap<ServiceKeyV4, ServiceValueV4> =
    HashMap::with_max_entries(SERVICES_V4_CAPACITY, 0);

#[map(name = "BACKENDS_V4")]
pub static BACKENDS_V4: HashMap<u32, BackendV4> = HashMap::with_max_entries(BACKENDS_V4_CAPACITY, 0);

/// Read by userspace to name the frontend of a conntrack entry; the datapath
/// keeps the VIP in the reply entry itself.
#[map(name = "REV_NAT_V4")]
pub static REV_NAT_V4: HashMap<proxy_common::maps::RevNatId, RevNatV4> =
    HashMap::with_max_entries(REV_NAT_V4_CAPACITY, 0);

#[map(name = "CONNTRACK_V4")]
pub static CONNTRACK_V4: LruHashMap<CtKeyV4, CtEntryV4> =
    LruHashMap::with_max_entries(CONNTRACK_V4_CAPACITY, 0);

#[map(name = "STATS")]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);

#[map(name = "FRONTEND_NAMES_V4")]
pub static FRONTEND_NAMES_V4: HashMap<proxy_common::maps::RevNatId, FrontendNameV4> =
    HashMap::with_max_entries(REV_NAT_V4_CAPACITY, 0);

/// Written by the agent: timeouts and the hairpin address.
#[map(name = "CONFIG")]
pub static CONFIG: Array<ConfigV4> = Array::with_max_entries(1, 0);

#[map(name = "AFFINITY_V4")]
pub static AFFINITY_V4: LruHashMap<AffinityKeyV4, AffinityValueV4> =
    LruHashMap::with_max_entries(AFFINITY_V4_CAPACITY, 0);

#[map(name = "VIPS_V4")]
pub static VIPS_V4: HashMap<[u8; 4], VipV4> = HashMap::with_max_entries(VIPS_V4_CAPACITY, 0);

/// The service CIDRs: an address inside one that is no VIP is dropped.
#[map(name = "SERVICE_CIDRS_V4")]
pub static SERVICE_CIDRS_V4: Array<proxy_common::service_cidr::ServiceCidrsV4> =
    Array::with_max_entries(1, 0);

/// NAT events for `kproxy trace`, written only while TRACE says someone listens.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

#[map(name = "TRACE")]
pub static TRACE: Array<TraceConfig> = Array::with_max_entries(1, 0);

/// Source NAT of external flows whose backend is elsewhere (or that must be
/// masqueraded); see [`proxy_common::maps::SnatEntryV4`].
#[map(name = "SNAT_V4")]
pub static SNAT_V4: LruHashMap<CtKeyV4, SnatEntryV4> = LruHashMap::with_max_entries(SNAT_V4_CAPACITY, 0);

/// loadBalancerSourceRanges of every frontend, as `(rev_nat_id, prefix)`.
#[map(name = "SOURCE_RANGES_V4")]
pub static SOURCE_RANGES_V4: LpmTrie<SourceRangeV4, u8> =
    LpmTrie::with_max_entries(SOURCE_RANGES_V4_CAPACITY, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// The IPv6 service CIDRs, as SERVICE_CIDRS_V4.
#[map(name = "SERVICE_CIDRS_V6")]
pub static SERVICE_CIDRS_V6: Array<proxy_common::service_cidr::ServiceCidrsV6> =
    Array::with_max_entries(1, 0);

/// loadBalancerSourceRanges of IPv6 frontends, as SOURCE_RANGES_V4.
#[map(name = "SOURCE_RANGES_V6")]
pub static SOURCE_RANGES_V6: LpmTrie<proxy_common::maps_v6::SourceRangeV6, u8> = LpmTrie::with_max_entries(
    proxy_common::maps_v6::SOURCE_RANGES_V6_CAPACITY,
    aya_ebpf::bindings::BPF_F_NO_PREALLOC,
);

/// The node's external interfaces (ifindex) and the address each SNATs to.
#[map(name = "EXTERNAL_IFACES")]
pub static EXTERNAL_IFACES: HashMap<u32, ExternalIfaceV4> =
    HashMap::with_max_entries(EXTERNAL_IFACES_CAPACITY, 0);

#[map(name = "NODEPORT_CONFIG")]
pub static NODEPORT_CONFIG: Array<NodePortConfigV4> = Array::with_max_entries(1, 0);

/// IPv6's cluster CIDR (the SNAT range and Maglev seed are NODEPORT_CONFIG's).
#[map(name = "NODEPORT_CONFIG_V6")]
pub static NODEPORT_CONFIG_V6: Array<proxy_common::maps_v6::NodePortConfigV6> = Array::with_max_entries(1, 0);

/// Scratch space for route lookups: the parameters would not fit on the BPF
/// stack next to the rest of the external ingress program. Not pinned.
#[map(name = "FIB_SCRATCH")]
pub static FIB_SCRATCH: PerCpuArray<aya_ebpf::bindings::bpf_fib_lookup> = PerCpuArray::with_max_entries(1, 0);

/// Where trace events are built before they are copied to EVENTS. Not pinned.
#[map(name = "EVENT_SCRATCH")]
pub static EVENT_SCRATCH: PerCpuArray<proxy_common::trace::TraceEventV4> =
    PerCpuArray::with_max_entries(1, 0);

/// IPv6's, as EVENT_SCRATCH. Not pinned.
#[map(name = "EVENT_SCRATCH_V6")]
pub static EVENT_SCRATCH_V6: PerCpuArray<proxy_common::trace::TraceEventV6> =
    PerCpuArray::with_max_entries(1, 0);

/// Socket-level load balancing: what a translated socket asked for.
#[map(name = "SOCK_REVNAT_V4")]
pub static SOCK_REVNAT_V4: LruHashMap<SockRevNatKeyV4, SockRevNatV4> =
    LruHashMap::with_max_entries(SOCK_REVNAT_V4_CAPACITY, 0);

#[map(name = "SOCKET_LB_CONFIG")]
pub static SOCKET_LB_CONFIG: Array<SocketLbConfigV4> = Array::with_max_entries(1, 0);

/// Socket-level load balancing of IPv6 sockets to native IPv6 backends: what a translated socket
/// asked for (IPv4-mapped backends are in SOCK_REVNAT_V4).
#[map(name = "SOCK_REVNAT_V6")]
pub static SOCK_REVNAT_V6: LruHashMap<
    proxy_common::sock_v6::SockRevNatKeyV6,
    proxy_common::sock_v6::SockRevNatV6,
> = LruHashMap::with_max_entries(proxy_common::sock_v6::SOCK_REVNAT_V6_CAPACITY, 0);

/// `--lb-algorithm=maglev`: the lookup tables, MAGLEV_TABLE_SIZE backend ids
/// each, one per external frontend (sized by the agent at load).
#[map(name = "MAGLEV_V4")]
pub static MAGLEV_V4: Array<u32> = Array::with_max_entries(proxy_common::maglev::MAGLEV_TABLE_SIZE, 0);

/// A first fragment's ports, for the later fragments of its datagram (which
/// carry no L4 header).
#[map(name = "FRAGMENTS_V4")]
pub static FRAGMENTS_V4: LruHashMap<FragmentKeyV4, FragmentPortsV4> =
    LruHashMap::with_max_entries(FRAGMENTS_V4_CAPACITY, 0);

/// Flows netfilter translated before kproxy attached, written by the agent
/// from nf_conntrack (see [`proxy_common::inherited`]). Read only here.
#[map(name = "INHERITED_V4")]
pub static INHERITED_V4: HashMap<CtKeyV4, InheritedFlowV4> =
    HashMap::with_max_entries(INHERITED_V4_CAPACITY, aya_ebpf::bindings::BPF_F_NO_PREALLOC);

/// Where XDP builds the keys it looks up in INHERITED_V4: its stack is full.
/// Not pinned.
#[map(name = "KEY_SCRATCH")]
pub static KEY_SCRATCH: PerCpuArray<CtKeyV4> = PerCpuArray::with_max_entries(1, 0);

// IPv6 (issue 19): the maps parallel to the IPv4 ones above, layouts in `proxy_common::maps_v6`.
// Rev-NAT and backend ids are shared with IPv4.

#[map(name = "SERVICES_V6")]
pub static SERVICES_V6: HashMap<proxy_common::maps_v6::ServiceKeyV6, proxy_common::maps_v6::ServiceValueV6> =
    HashMap::with_max_entries(proxy_common::maps_v6::SERVICES_V6_CAPACITY, 0);

#[map(name = "BACKENDS_V6")]
pub static BACKENDS_V6: HashMap<u32, proxy_common::maps_v6::BackendV6> =
    HashMap::with_max_entries(proxy_common::maps_v6::BACKENDS_V6_CAPACITY, 0);

/// Read by userspace to name the frontend of an IPv6 conntrack entry, as REV_NAT_V4.
#[map(name = "REV_NAT_V6")]
pub static REV_NAT_V6: HashMap<proxy_common::maps::RevNatId, proxy_common::maps_v6::RevNatV6> =
    HashMap::with_max_entries(proxy_common::maps_v6::REV_NAT_V6_CAPACITY, 0);

#[map(name = "CONNTRACK_V6")]
pub static CONNTRACK_V6: LruHashMap<proxy_common::maps_v6::CtKeyV6, proxy_common::maps_v6::CtEntryV6> =
    LruHashMap::with_max_entries(proxy_common::maps_v6::CONNTRACK_V6_CAPACITY, 0);

/// The remapped source ports of IPv6 flows that clashed with a live translated flow's reply tuple
/// (`snat6`; see [`proxy_common::maps_v6::SnatEntryV6`]), as SNAT_V4.
#[map(name = "SNAT_V6")]
pub static SNAT_V6: LruHashMap<proxy_common::maps_v6::CtKeyV6, proxy_common::maps_v6::SnatEntryV6> =
    LruHashMap::with_max_entries(proxy_common::maps_v6::SNAT_V6_CAPACITY, 0);

#[map(name = "VIPS_V6")]
pub static VIPS_V6: HashMap<[u8; 16], proxy_common::maps_v6::VipV6> =
    HashMap::with_max_entries(proxy_common::maps_v6::VIPS_V6_CAPACITY, 0);

/// Where the IPv4 tc programs keep the packet they parse (`parse::Flow`), outside the 512-byte
/// stack their stages share. Not pinned.
#[map(name = "FLOW_SCRATCH")]
pub static FLOW_SCRATCH: PerCpuArray<crate::parse::Flow> = PerCpuArray::with_max_entries(1, 0);

/// Where the IPv6 programs keep the packet they parse (`parse6::Flow6`): the IPv6 chain shares
/// the 512-byte stack with the entry point's frame, sized by the IPv4 stages. Not pinned.
#[map(name = "FLOW6_SCRATCH")]
pub static FLOW6_SCRATCH: PerCpuArray<crate::parse6::Flow6> = PerCpuArray::with_max_entries(1, 0);

/// Where an IPv6 refusal is built (`reject6`). Not pinned.
#[map(name = "REFUSAL6_SCRATCH")]
pub static REFUSAL6_SCRATCH: PerCpuArray<crate::reject6::Refusal6> = PerCpuArray::with_max_entries(1, 0);

/// An IPv6 first fragment's ports, for the later fragments of its datagram, as FRAGMENTS_V4.
#[map(name = "FRAGMENTS_V6")]
pub static FRAGMENTS_V6: LruHashMap<proxy_common::maps_v6::FragmentKeyV6, FragmentPortsV4> =
    LruHashMap::with_max_entries(proxy_common::maps_v6::FRAGMENTS_V6_CAPACITY, 0);

/// Where an ICMPv6 error about a translated flow is read (`icmp6`). Not pinned.
#[map(name = "ICMP6_SCRATCH")]
pub static ICMP6_SCRATCH: PerCpuArray<crate::icmp6::Icmp6Scratch> = PerCpuArray::with_max_entries(1, 0);

/// sessionAffinity: ClientIP for IPv6 clients, as AFFINITY_V4.
#[map(name = "AFFINITY_V6")]
pub static AFFINITY_V6: LruHashMap<proxy_common::maps_v6::AffinityKeyV6, AffinityValueV4> =
    LruHashMap::with_max_entries(proxy_common::maps_v6::AFFINITY_V6_CAPACITY, 0);

/// Where the IPv6 ingress program keeps a new flow's backend between `lb6::select_backend` and
/// `new_flow`. Not pinned.
#[map(name = "CHOICE6_SCRATCH")]
pub static CHOICE6_SCRATCH: PerCpuArray<crate::lb6::Choice6> = PerCpuArray::with_max_entries(1, 0);

/// The node's external interfaces (ifindex) and the IPv6 address each SNATs to, as EXTERNAL_IFACES.
#[map(name = "EXTERNAL_IFACES_V6")]
pub static EXTERNAL_IFACES_V6: HashMap<u32, proxy_common::maps_v6::ExternalIfaceV6> =
    HashMap::with_max_entries(proxy_common::maps_v6::EXTERNAL_IFACES_V6_CAPACITY, 0);

/// What the IPv6 external ingress stages share: a redirect's route and the node address a new
/// flow is source-NATed to (`external6`). Not pinned.
#[map(name = "EXTERNAL6_SCRATCH")]
pub static EXTERNAL6_SCRATCH: PerCpuArray<crate::external6::External6> = PerCpuArray::with_max_entries(1, 0);

/// The rewrite and route of an IPv6 packet XDP sends (`xdp6`). Not pinned.
#[map(name = "XDP6_SCRATCH")]
pub static XDP6_SCRATCH: PerCpuArray<crate::xdp6::Xdp6> = PerCpuArray::with_max_entries(1, 0);
