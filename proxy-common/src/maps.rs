//! Map keys and values. Addresses and ports are kept as the bytes found in
//! the packet (network byte order) so the datapath never swaps bytes.

/// Map names as they appear in the object file and, lower-cased, as pin names.
pub const MAP_SERVICES_V4: &str = "SERVICES_V4";
pub const MAP_BACKENDS_V4: &str = "BACKENDS_V4";
pub const MAP_REV_NAT_V4: &str = "REV_NAT_V4";
pub const MAP_CONNTRACK_V4: &str = "CONNTRACK_V4";
pub const MAP_STATS: &str = "STATS";
pub const MAP_FRONTEND_NAMES_V4: &str = "FRONTEND_NAMES_V4";
pub const MAP_CONFIG: &str = "CONFIG";
pub const MAP_AFFINITY_V4: &str = "AFFINITY_V4";
pub const MAP_VIPS_V4: &str = "VIPS_V4";

/// Program names (the function names in proxy-ebpf).
pub const PROG_INGRESS: &str = "kproxy_ingress";
pub const PROG_EGRESS: &str = "kproxy_egress";

pub const SERVICES_V4_CAPACITY: u32 = 65_536;
pub const BACKENDS_V4_CAPACITY: u32 = 65_536;
pub const REV_NAT_V4_CAPACITY: u32 = 65_536;
pub const CONNTRACK_V4_CAPACITY: u32 = 262_144;
pub const AFFINITY_V4_CAPACITY: u32 = 65_536;
pub const VIPS_V4_CAPACITY: u32 = 65_536;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Where a frontend is reachable from. Only ClusterIP exists so far; NodePort,
/// ExternalIP and LoadBalancer scopes come with the north-south datapath.
pub const SCOPE_CLUSTER_IP: u8 = 0;

/// `(vip, port, proto, scope, slot)`: slot 0 is the frontend's master entry,
/// slots `1..=count` each name one active backend (Cilium's slot scheme).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceKeyV4 {
    pub vip: [u8; 4],
    pub port: [u8; 2],
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: [u8; 2],
}

impl ServiceKeyV4 {
    pub const fn new(vip: [u8; 4], port: [u8; 2], proto: u8, scope: u8, slot: u16) -> Self {
        Self { vip, port, proto, scope, slot, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }
}

/// Slot 0: `count` active backends, the frontend's `rev_nat_id` and flags.
/// Slot i > 0: `backend_id` (and the same `rev_nat_id`, so a slot is
/// self-describing in dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceValueV4 {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_id: u16,
    pub flags: u16,
    pub terminating_count: u16,
    pub affinity_timeout_s: u32,
}

/// Slot 0 flags.
/// sessionAffinity: ClientIP (timeout in `affinity_timeout_s`).
pub const SVC_FLAG_AFFINITY: u16 = 1;
/// internalTrafficPolicy: Local (only node-local backends are in the slots).
pub const SVC_FLAG_LOCAL_ONLY: u16 = 2;
/// No ready endpoint was left: the slots hold serving, terminating ones.
pub const SVC_FLAG_TERMINATING_FALLBACK: u16 = 4;

pub const BACKEND_FLAG_ACTIVE: u8 = 0;
pub const BACKEND_FLAG_TERMINATING: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BackendV4 {
    pub addr: [u8; 4],
    pub port: [u8; 2],
    pub proto: u8,
    pub flags: u8,
}

/// `rev_nat_id` → the frontend a translated flow belongs to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNatV4 {
    pub vip: [u8; 4],
    pub port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}

/// A flow as seen by the program that matches it.
pub const CT_DIR_FORWARD: u8 = 0;
/// The reply tuple of a translated flow: backend → client.
pub const CT_DIR_REPLY: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKeyV4 {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub direction: u8,
    pub _pad: [u8; 2],
}

impl CtKeyV4 {
    /// The key under which the reply to a flow DNATed to `backend` is found.
    pub const fn reply_of(&self, backend_addr: [u8; 4], backend_port: [u8; 2]) -> Self {
        Self {
            saddr: backend_addr,
            daddr: self.saddr,
            sport: backend_port,
            dport: self.sport,
            proto: self.proto,
            direction: CT_DIR_REPLY,
            _pad: [0; 2],
        }
    }
}

/// One direction of a translated flow. The forward entry holds the backend the
/// flow was sent to; the reply entry holds the VIP the reply is rewritten to,
/// so un-NAT needs a single lookup and survives the Service being deleted.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtEntryV4 {
    pub created_ns: u64,
    pub last_seen_ns: u64,
    pub packets: u64,
    pub bytes: u64,
    pub backend_id: u32,
    /// Forward: backend address; reply: VIP.
    pub nat_addr: [u8; 4],
    /// Forward: backend port; reply: VIP port.
    pub nat_port: [u8; 2],
    pub rev_nat_id: u16,
    pub state: u8,
    pub flags: u8,
    /// Union of the TCP flags seen in this direction.
    pub tcp_flags_seen: u8,
    pub _pad: u8,
}

/// Conntrack entry flags.
/// The client reached itself through its Service: its source was rewritten
/// to [`ConfigV4::hairpin_addr`] so the reply comes back through the node.
pub const CT_FLAG_HAIRPIN: u8 = 1;

/// The one entry of the CONFIG array: what the agent tells the datapath.
/// Timeouts are in nanoseconds of `bpf_ktime_get_ns`; zero means the built-in
/// default of [`crate::conntrack::Timeouts`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ConfigV4 {
    pub timeout_tcp_syn_ns: u64,
    pub timeout_tcp_established_ns: u64,
    pub timeout_tcp_closing_ns: u64,
    pub timeout_udp_ns: u64,
    /// Source address for hairpin flows (a pod reaching itself via its
    /// Service); link-local, never routed.
    pub hairpin_addr: [u8; 4],
    pub _pad: u32,
}

/// The default hairpin source, as Cilium's IPV4_LOOPBACK.
pub const DEFAULT_HAIRPIN_ADDR: [u8; 4] = [169, 254, 42, 1];

/// sessionAffinity: ClientIP — `(client, frontend)` → the backend it sticks to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityKeyV4 {
    pub client: [u8; 4],
    pub rev_nat_id: u16,
    pub _pad: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AffinityValueV4 {
    /// When a new connection last used this entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

/// `vip` → number of frontends on it: a packet to a known VIP on a port the
/// Service does not have is refused, like one to a Service without endpoints.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct VipV4 {
    pub frontends: u32,
}

/// `rev_nat_id` → "namespace/name:port", written by the agent so that dumps
/// name Services without asking it. The datapath never reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrontendNameV4 {
    pub len: u8,
    pub _pad: [u8; 3],
    pub name: [u8; FRONTEND_NAME_MAX],
}

pub const FRONTEND_NAME_MAX: usize = 188;

impl FrontendNameV4 {
    /// Truncates at a character boundary when the name is too long.
    pub fn new(name: &str) -> Self {
        let mut end = name.len().min(FRONTEND_NAME_MAX);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; FRONTEND_NAME_MAX];
        bytes[..end].copy_from_slice(&name.as_bytes()[..end]);
        Self { len: end as u8, _pad: [0; 3], name: bytes }
    }

    pub fn as_str(&self) -> &str {
        let len = usize::from(self.len).min(FRONTEND_NAME_MAX);
        core::str::from_utf8(&self.name[..len]).unwrap_or("?")
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), made of integers and byte arrays with
    // explicit padding fields, so every bit pattern is valid.
    unsafe impl aya::Pod for ServiceKeyV4 {}
    unsafe impl aya::Pod for ServiceValueV4 {}
    unsafe impl aya::Pod for BackendV4 {}
    unsafe impl aya::Pod for RevNatV4 {}
    unsafe impl aya::Pod for CtKeyV4 {}
    unsafe impl aya::Pod for CtEntryV4 {}
    unsafe impl aya::Pod for FrontendNameV4 {}
    unsafe impl aya::Pod for ConfigV4 {}
    unsafe impl aya::Pod for AffinityKeyV4 {}
    unsafe impl aya::Pod for AffinityValueV4 {}
    unsafe impl aya::Pod for VipV4 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    #[test]
    fn layouts_have_no_implicit_holes() {
        // Sizes equal the sum of the field sizes: a hole would make the kernel
        // and userspace disagree on a key's bytes.
        assert_eq!(size_of::<ServiceKeyV4>(), 4 + 2 + 1 + 1 + 2 + 2);
        assert_eq!(size_of::<ServiceValueV4>(), 4 + 2 + 2 + 2 + 2 + 4);
        assert_eq!(size_of::<BackendV4>(), 4 + 2 + 1 + 1);
        assert_eq!(size_of::<RevNatV4>(), 4 + 2 + 1 + 1);
        assert_eq!(size_of::<CtKeyV4>(), 4 + 4 + 2 + 2 + 1 + 1 + 2);
        assert_eq!(size_of::<CtEntryV4>(), 8 * 4 + 4 + 4 + 2 + 2 + 1 + 1 + 1 + 1);
        assert_eq!(align_of::<CtEntryV4>(), 8);
        assert_eq!(size_of::<ConfigV4>(), 8 * 4 + 4 + 4);
        assert_eq!(size_of::<AffinityKeyV4>(), 4 + 2 + 2);
        assert_eq!(size_of::<AffinityValueV4>(), 8 + 4 + 4);
        assert_eq!(size_of::<VipV4>(), 4);
    }

    #[test]
    fn frontend_names_round_trip_and_truncate() {
        assert_eq!(size_of::<FrontendNameV4>(), 4 + FRONTEND_NAME_MAX);
        assert_eq!(FrontendNameV4::new("kube-system/kube-dns:dns").as_str(), "kube-system/kube-dns:dns");
        let long = "é".repeat(200);
        let name = FrontendNameV4::new(&long);
        assert!(name.as_str().len() <= FRONTEND_NAME_MAX);
        assert!(name.as_str().chars().all(|c| c == 'é'));
    }

    #[test]
    fn reply_key_swaps_to_the_backend() {
        let fwd = CtKeyV4 {
            saddr: [10, 244, 0, 2],
            daddr: [10, 96, 0, 10],
            sport: 56340u16.to_be_bytes(),
            dport: 53u16.to_be_bytes(),
            proto: IPPROTO_UDP,
            direction: CT_DIR_FORWARD,
            _pad: [0; 2],
        };
        let reply = fwd.reply_of([10, 244, 0, 12], 53u16.to_be_bytes());
        assert_eq!(reply.saddr, [10, 244, 0, 12]);
        assert_eq!(reply.daddr, [10, 244, 0, 2]);
        assert_eq!(reply.sport, 53u16.to_be_bytes());
        assert_eq!(reply.dport, 56340u16.to_be_bytes());
        assert_eq!(reply.direction, CT_DIR_REPLY);
    }

    #[test]
    fn slot_key_keeps_the_frontend() {
        let key = ServiceKeyV4::new([10, 96, 0, 1], 80u16.to_be_bytes(), IPPROTO_TCP, 0, 0);
        let slot = key.with_slot(3);
        assert_eq!(slot.vip, key.vip);
        assert_eq!(slot.slot, 3);
        assert_eq!(key.slot, 0);
    }
}
