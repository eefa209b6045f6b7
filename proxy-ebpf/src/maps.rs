use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
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
pub static REV_NAT_V4: HashMap<u16, RevNatV4> = HashMap::with_max_entries(REV_NAT_V4_CAPACITY, 0);

#[map(name = "CONNTRACK_V4")]
pub static CONNTRACK_V4: LruHashMap<CtKeyV4, CtEntryV4> =
    LruHashMap::with_max_entries(CONNTRACK_V4_CAPACITY, 0);

#[map(name = "STATS")]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);

#[map(name = "FRONTEND_NAMES_V4")]
pub static FRONTEND_NAMES_V4: HashMap<u16, FrontendNameV4> =
    HashMap::with_max_entries(REV_NAT_V4_CAPACITY, 0);

/// Written by the agent: timeouts and the hairpin address.
#[map(name = "CONFIG")]
pub static CONFIG: Array<ConfigV4> = Array::with_max_entries(1, 0);

#[map(name = "AFFINITY_V4")]
pub static AFFINITY_V4: LruHashMap<AffinityKeyV4, AffinityValueV4> =
    LruHashMap::with_max_entries(AFFINITY_V4_CAPACITY, 0);

#[map(name = "VIPS_V4")]
pub static VIPS_V4: HashMap<[u8; 4], VipV4> = HashMap::with_max_entries(VIPS_V4_CAPACITY, 0);

/// NAT events for `kproxy trace`, written only while TRACE says someone listens.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

#[map(name = "TRACE")]
pub static TRACE: Array<TraceConfig> = Array::with_max_entries(1, 0);
