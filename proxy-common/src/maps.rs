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
pub const MAP_SNAT_V4: &str = "SNAT_V4";
pub const MAP_SOURCE_RANGES_V4: &str = "SOURCE_RANGES_V4";
pub const MAP_EXTERNAL_IFACES: &str = "EXTERNAL_IFACES";
pub const MAP_NODEPORT_CONFIG: &str = "NODEPORT_CONFIG";
pub const MAP_SOCK_REVNAT_V4: &str = "SOCK_REVNAT_V4";
pub const MAP_MAGLEV_V4: &str = "MAGLEV_V4";
pub const MAP_SOCKET_LB_CONFIG: &str = "SOCKET_LB_CONFIG";
pub const MAP_FRAGMENTS_V4: &str = "FRAGMENTS_V4";
pub const MAP_INHERITED_V4: &str = "INHERITED_V4";
pub const MAP_SERVICE_CIDRS_V4: &str = "SERVICE_CIDRS_V4";

/// Program names (the function names in proxy-ebpf).
pub const PROG_INGRESS: &str = "kproxy_ingress";
pub const PROG_EGRESS: &str = "kproxy_egress";
/// tc ingress of the node's external interfaces (NodePort, ExternalIPs, LB IPs).
pub const PROG_EXTERNAL_INGRESS: &str = "kproxy_external_ingress";
/// XDP on the node's external interfaces: the same path for remote backends.
pub const PROG_XDP: &str = "kproxy_xdp";
/// Socket-level load balancing (cgroup sock_addr hooks).
pub const PROG_CONNECT4: &str = "kproxy_connect4";
pub const PROG_SENDMSG4: &str = "kproxy_sendmsg4";
pub const PROG_RECVMSG4: &str = "kproxy_recvmsg4";
pub const PROG_GETPEERNAME4: &str = "kproxy_getpeername4";

pub const SERVICES_V4_CAPACITY: u32 = 65_536;
pub const BACKENDS_V4_CAPACITY: u32 = 65_536;
pub const REV_NAT_V4_CAPACITY: u32 = 65_536;
pub const CONNTRACK_V4_CAPACITY: u32 = 262_144;
pub const AFFINITY_V4_CAPACITY: u32 = 65_536;
pub const VIPS_V4_CAPACITY: u32 = 65_536;
/// Two entries per source-NATed flow.
pub const SNAT_V4_CAPACITY: u32 = CONNTRACK_V4_CAPACITY;
pub const SOURCE_RANGES_V4_CAPACITY: u32 = 16_384;
pub const EXTERNAL_IFACES_CAPACITY: u32 = 64;
pub const SOCK_REVNAT_V4_CAPACITY: u32 = 262_144;
/// Datagrams being fragmented at one time (an LRU: the oldest go first).
pub const FRAGMENTS_V4_CAPACITY: u32 = 8_192;
/// Up to three keys per inherited flow ([`crate::inherited`]); the agent
/// marks no more than fit.
pub const INHERITED_V4_CAPACITY: u32 = 131_072;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Which clients a frontend entry serves: pods and the node (and external
/// clients when there is no external entry)...
pub const SCOPE_INTERNAL: u8 = 0;
/// ...or clients arriving on an external interface, for
/// `externalTrafficPolicy: Local` (only this node's endpoints, no SNAT).
pub const SCOPE_EXTERNAL: u8 = 1;
pub const SCOPE_CLUSTER_IP: u8 = SCOPE_INTERNAL;

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

/// A frontend's rev-NAT id: 32 bits, so the agent can give every frontend of
/// 100k Services and their node ports one of its own (0 is never given).
pub type RevNatId = u32;

/// Slot 0: `count` active backends, the frontend's `rev_nat_id` and flags;
/// its `backend_id` is the affinity id and `maglev` the Maglev table
/// ([`ServiceValueV4::with_slot0_ids`]).
/// Slot i > 0: `backend_id` (and the same `rev_nat_id`, so a slot is
/// self-describing in dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceValueV4 {
    pub backend_id: u32,
    pub rev_nat_id: RevNatId,
    pub count: u16,
    pub flags: u16,
    pub terminating_count: u16,
    /// Slot 0: the Maglev table + 1 (0: none).
    pub maglev: u16,
    pub affinity_timeout_s: u32,
}

/// Maglev tables slot 0 can name: `maglev` keeps the table + 1 in 16 bits.
pub const MAGLEV_TABLES_MAX: u32 = 0xFFFF;

impl ServiceValueV4 {
    /// Slot 0 naming its Maglev table (`maglev`: the table + 1, 0: none) and
    /// its affinity id (in `backend_id`, which slot 0 has no backend for; 0:
    /// the frontend's own `rev_nat_id`).
    pub const fn with_slot0_ids(self, maglev_table: Option<u32>, affinity_id: RevNatId) -> Self {
        let maglev = match maglev_table {
            Some(table) if table < MAGLEV_TABLES_MAX => (table + 1) as u16,
            _ => 0,
        };
        Self { backend_id: affinity_id, maglev, ..self }
    }

    /// Slot 0: the Maglev table new flows pick from, when the frontend has one.
    pub const fn maglev_table(&self) -> Option<u32> {
        match self.maglev {
            0 => None,
            table => Some(table as u32 - 1),
        }
    }

    /// Slot 0: the affinity id as written (0: none named).
    pub const fn named_affinity_id(&self) -> RevNatId {
        self.backend_id
    }

    /// Slot 0: the `rev_nat_id` AFFINITY_V4 keys this frontend's clients by.
    /// Every frontend of one Service port (its cluster IP, node ports,
    /// external and load-balancer IPs) names its cluster IP frontend's id, so
    /// a client sticks to one endpoint whichever address it uses, as
    /// kube-proxy's affinity sets are per Service port and endpoint
    /// (pkg/proxy/nftables/proxier.go: "without regard to which service IP
    /// was used to reach the service").
    pub const fn affinity_id(&self) -> RevNatId {
        match self.named_affinity_id() {
            0 => self.rev_nat_id,
            id => id,
        }
    }
}

/// Slot 0 flags.
/// sessionAffinity: ClientIP (timeout in `affinity_timeout_s`).
pub const SVC_FLAG_AFFINITY: u16 = 1;
/// internalTrafficPolicy: Local (only node-local backends are in the slots).
pub const SVC_FLAG_LOCAL_ONLY: u16 = 2;
/// No ready endpoint was left: the slots hold serving, terminating ones.
pub const SVC_FLAG_TERMINATING_FALLBACK: u16 = 4;
/// loadBalancerSourceRanges: external clients must match SOURCE_RANGES_V4.
pub const SVC_FLAG_SOURCE_RANGES: u16 = 8;
/// externalTrafficPolicy: Local.
pub const SVC_FLAG_EXTERNAL_LOCAL: u16 = 16;
/// A NodePort, ExternalIP or LoadBalancer frontend (not a cluster IP).
pub const SVC_FLAG_EXTERNAL_ADDR: u16 = 32;
/// `--lb-algorithm=maglev`: new flows pick their backend from the Maglev
/// table `backend_id - 1` of MAGLEV_V4 (slot 0's `backend_id` is otherwise
/// unused), so every node picks the same backend for the same flow.
pub const SVC_FLAG_MAGLEV: u16 = 64;
/// A local-only frontend (internal or external traffic policy Local) without a
/// local backend, whose Service has endpoints on other nodes: new connections
/// are dropped, not refused (kube-proxy's "has no local endpoints" rule), so
/// clients time out and a load balancer's health check steers them away.
pub const SVC_FLAG_NO_LOCAL_ENDPOINTS: u16 = 128;

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
    pub state: u8,
    pub flags: u8,
    pub rev_nat_id: RevNatId,
    /// Union of the TCP flags seen in this direction.
    pub tcp_flags_seen: u8,
    /// Up to the struct's 8-byte alignment, as a field: an implicit hole would
    /// be bytes the kernel and userspace need not agree on.
    pub _pad: [u8; 7],
}

/// Conntrack entry flags.
/// The client reached itself through its Service: its source was rewritten
/// to [`ConfigV4::hairpin_addr`] so the reply comes back through the node.
pub const CT_FLAG_HAIRPIN: u8 = 1;
/// The client's address and port were also rewritten, to a node address and
/// a port from the SNAT range; SNAT_V4 holds both translations and the reply
/// entry is keyed by `backend → node address:port`.
pub const CT_FLAG_SNAT: u8 = 2;
/// Only the client's source port was rewritten (to a port from the SNAT
/// range; its address stays): the flow's reply tuple would have been the same
/// as a live translated flow's, so each gets its own (netfilter remaps a
/// clashing source port the same way). SNAT_V4 holds the two ports, and the
/// reply entry is keyed by `backend → client:remapped port`.
pub const CT_FLAG_REMAP: u8 = 4;
/// A flow to a pod's own address (no Service), tracked only because its
/// source port had to be remapped ([`CT_FLAG_REMAP`]): nothing but the port
/// is translated.
pub const CT_FLAG_DIRECT: u8 = 8;

/// Whether the reply entry of a flow with `flags` is keyed by a translated
/// client tuple found in SNAT_V4 (a node address, or a remapped port).
pub const fn reply_key_in_snat(flags: u8) -> bool {
    flags & (CT_FLAG_SNAT | CT_FLAG_REMAP) != 0
}

/// One direction of a source-NATed flow, keyed by the tuple as it is seen
/// after DNAT: `(client, backend)` forward → the node address and port the
/// client becomes; `(backend, node address:port)` reply → the client.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SnatEntryV4 {
    pub created_ns: u64,
    pub addr: [u8; 4],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}

/// The key of the forward SNAT entry of a flow: its own forward (pre-DNAT)
/// tuple, as its conntrack entry's. Two flows from one client port to one
/// backend through different frontends (two Services; a cluster IP and a
/// NodePort) have different ones; keyed by the tuple after DNAT, the second
/// overwrote the first's translation and both left with one port.
pub const fn snat_forward_key(forward: &CtKeyV4) -> CtKeyV4 {
    *forward
}

/// Where kproxy before the per-flow key kept a flow's forward SNAT entry
/// (the tuple after DNAT): still read, so flows translated before an upgrade
/// keep theirs.
pub const fn legacy_snat_forward_key(forward: &CtKeyV4, backend: [u8; 4], backend_port: [u8; 2]) -> CtKeyV4 {
    CtKeyV4 {
        saddr: forward.saddr,
        daddr: backend,
        sport: forward.sport,
        dport: backend_port,
        proto: forward.proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    }
}

/// The key under which a source-NATed flow's replies (and its reverse SNAT
/// entry) are found.
pub const fn snat_reply_key(
    proto: u8,
    backend: [u8; 4],
    backend_port: [u8; 2],
    node_addr: [u8; 4],
    node_port: [u8; 2],
) -> CtKeyV4 {
    CtKeyV4 {
        saddr: backend,
        daddr: node_addr,
        sport: backend_port,
        dport: node_port,
        proto,
        direction: CT_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// The data of a SOURCE_RANGES_V4 (LPM trie) key: the frontend, then the
/// client prefix. The prefix length of a key counts the 32 bits of
/// `rev_nat_id` (big-endian: the trie matches bits from the first byte), so
/// one trie holds every frontend's ranges.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SourceRangeV4 {
    pub rev_nat_id: [u8; 4],
    pub addr: [u8; 4],
}

/// Bits of a SOURCE_RANGES_V4 key before the address.
pub const SOURCE_RANGE_ID_BITS: u32 = 32;

impl SourceRangeV4 {
    pub const fn new(rev_nat_id: RevNatId, addr: [u8; 4]) -> Self {
        Self { rev_nat_id: rev_nat_id.to_be_bytes(), addr }
    }
}

/// An external interface (by ifindex): the node address its SNATed flows use.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ExternalIfaceV4 {
    pub addr: [u8; 4],
    pub _pad: u32,
}

/// A fragmented datagram: source, destination, IP identification, protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragmentKeyV4 {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}

/// The ports of a fragmented datagram, from its first fragment (network order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragmentPortsV4 {
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

/// A flow netfilter translated before kproxy attached (kube-proxy's DNAT),
/// under one of the keys [`crate::inherited::keys`] gives it: where
/// netfilter sends the flow (forward keys) or the address its replies are
/// rewritten to (the reply key).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct InheritedFlowV4 {
    pub nat_addr: [u8; 4],
    pub nat_port: [u8; 2],
    /// Whether the flow is still open (forward keys exist only then).
    pub open: u8,
    pub _pad: u8,
}

/// `(socket cookie, backend)` → the Service address the socket asked for:
/// what recvmsg and getpeername show instead of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNatKeyV4 {
    pub cookie: u64,
    pub addr: [u8; 4],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SockRevNatV4 {
    pub vip: [u8; 4],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
    pub rev_nat_id: RevNatId,
}

/// The one entry of SOCKET_LB_CONFIG.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SocketLbConfigV4 {
    /// The agent's network namespace, for [`SOCKET_LB_HOST_ONLY`].
    pub host_netns_cookie: u64,
    pub mode: u32,
    /// [`SOCKET_LB_BARE_COVERED_VETHS`], or 0. Was padding: a datapath
    /// loaded before it reads 0 there, the earlier behaviour.
    pub flags: u32,
}

/// The veths of the pods the hooks cover carry no tc program
/// (`--pod-veth-tc auto` with `--socket-lb on`): a reply of such a pod is
/// seen by no kproxy program before it leaves the node, so the external
/// ingress does not source-NAT a flow to a local backend it would otherwise
/// masquerade (a client outside `--cluster-cidr` reaching a cluster IP) —
/// the external egress un-NATs the reply on its way out instead.
pub const SOCKET_LB_BARE_COVERED_VETHS: u32 = 1;

/// Socket-level load balancing off: the tc path translates everything.
pub const SOCKET_LB_OFF: u32 = 0;
/// Every socket in the attached cgroup is translated at connect/sendmsg.
pub const SOCKET_LB_ALL: u32 = 1;
/// Only sockets in the host's (the agent's) network namespace.
pub const SOCKET_LB_HOST_ONLY: u32 = 2;

/// The one entry of NODEPORT_CONFIG: the north-south settings.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodePortConfigV4 {
    /// Source ports for SNAT, inclusive; zero: the defaults below.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// `--cluster-cidr`: clients outside it reaching a cluster IP through an
    /// external interface are masqueraded. Prefix 0 with a zero address: no
    /// cluster CIDR known, no client is taken for an outside one (kube-proxy's
    /// no-op local detector: it then writes no masquerade rule).
    pub cluster_cidr: [u8; 4],
    pub cluster_cidr_prefix: u8,
    pub _pad: [u8; 3],
    /// `--maglev-seed`: the same on every node, so their tables agree.
    pub maglev_seed: u32,
}

/// Above the kernel's default ephemeral range (32768-60999) so that SNAT
/// ports do not meet the node's own connections, and outside the NodePort
/// range (30000-32767).
pub const DEFAULT_SNAT_PORT_MIN: u16 = 61000;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 65535;

impl NodePortConfigV4 {
    pub const fn port_range(&self) -> (u16, u16) {
        if self.snat_port_min == 0 || self.snat_port_max < self.snat_port_min {
            (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX)
        } else {
            (self.snat_port_min, self.snat_port_max)
        }
    }

    /// Whether `addr` is known to be outside `--cluster-cidr` (none known: no address is), so that
    /// its flows to a cluster IP are masqueraded.
    pub const fn outside_cluster_cidr(&self, addr: [u8; 4]) -> bool {
        self.cluster_cidr_prefix != 0 && !self.in_cluster_cidr(addr)
    }

    /// Whether `addr` is inside `--cluster-cidr`.
    pub const fn in_cluster_cidr(&self, addr: [u8; 4]) -> bool {
        if self.cluster_cidr_prefix == 0 {
            return false;
        }
        let prefix = if self.cluster_cidr_prefix > 32 { 32 } else { self.cluster_cidr_prefix };
        let mask = u32::MAX << (32 - prefix as u32);
        u32::from_be_bytes(addr) & mask == u32::from_be_bytes(self.cluster_cidr) & mask
    }
}

/// How many ports a new SNAT flow tries before it is dropped. Each attempt
/// is an independent random port, so a flow fails only if all of them are
/// taken: with a fraction `f` of the range in use that is `f^64` — 0.1 % at
/// 90 % fill, where probing consecutive ports from one random start failed
/// for a third of the flows (taken ports form runs that a start falls into).
pub const SNAT_PORT_ATTEMPTS: u32 = 64;

/// A candidate SNAT port in `min..=max` for a uniform `random` (multiply-shift:
/// no modulo bias, no division for the verifier to refuse).
pub const fn snat_port_candidate(random: u32, min: u16, max: u16) -> u16 {
    let span = (max as u64).saturating_sub(min as u64) + 1;
    (min as u64 + ((random as u64 * span) >> 32)) as u16
}

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
    pub rev_nat_id: RevNatId,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AffinityValueV4 {
    /// When a new connection last used this entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// The frontend slot the backend had when the entry was written: where the
    /// datapath checks first that the backend is still the frontend's.
    pub slot: u32,
}

/// Every address with a frontend → how many cluster-IP frontends it has, and whether it has
/// north–south ones (node addresses' NodePorts, external and LB IPs). The datapath looks up a
/// frontend only for a packet whose destination is here: a packet to any other address (a pod,
/// most of a node's packets) costs this one lookup of a 4-byte key instead of a service-map lookup
/// per scope. A packet to a cluster IP on a port the Service does not have is refused, like one to
/// a Service without endpoints; north–south addresses carry other traffic too, and are not.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct VipV4 {
    /// The cluster-IP frontends, with [`VipV4::NORTH_SOUTH`] set when there are north–south
    /// ones (one word, so that the map keeps the layout of the version that counted cluster IPs
    /// alone).
    pub frontends: u32,
}

impl VipV4 {
    pub const NORTH_SOUTH: u32 = 1 << 31;

    pub const fn new(cluster_ip_frontends: u32, north_south: bool) -> Self {
        let flag = if north_south { Self::NORTH_SOUTH } else { 0 };
        VipV4 { frontends: (cluster_ip_frontends & !Self::NORTH_SOUTH) | flag }
    }

    pub const fn cluster_ip_frontends(self) -> u32 {
        self.frontends & !Self::NORTH_SOUTH
    }

    pub const fn has_north_south(self) -> bool {
        self.frontends & Self::NORTH_SOUTH != 0
    }

    /// The entry with one more frontend: a cluster IP's, or a north–south one.
    pub const fn with_frontend(self, north_south: bool) -> Self {
        if north_south {
            VipV4::new(self.cluster_ip_frontends(), true)
        } else {
            VipV4::new(self.cluster_ip_frontends() + 1, self.has_north_south())
        }
    }

    /// Whether the address is a cluster IP: its ports without a frontend are refused.
    pub const fn is_cluster_ip(self) -> bool {
        self.cluster_ip_frontends() != 0
    }
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
    unsafe impl aya::Pod for SnatEntryV4 {}
    unsafe impl aya::Pod for SourceRangeV4 {}
    unsafe impl aya::Pod for ExternalIfaceV4 {}
    unsafe impl aya::Pod for NodePortConfigV4 {}
    unsafe impl aya::Pod for SockRevNatKeyV4 {}
    unsafe impl aya::Pod for FragmentKeyV4 {}
    unsafe impl aya::Pod for FragmentPortsV4 {}
    unsafe impl aya::Pod for InheritedFlowV4 {}
    unsafe impl aya::Pod for SockRevNatV4 {}
    unsafe impl aya::Pod for SocketLbConfigV4 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    #[test]
    fn a_vip_entry_tells_cluster_ips_from_north_south_addresses() {
        let cluster_ip = VipV4::new(3, false);
        assert_eq!(
            cluster_ip,
            VipV4 { frontends: 3 },
            "the layout of an entry that counted cluster IPs alone"
        );
        assert!(cluster_ip.is_cluster_ip() && !cluster_ip.has_north_south());
        let node_address = VipV4::new(0, true);
        assert!(!node_address.is_cluster_ip(), "a node address's other ports are not refused");
        assert!(node_address.has_north_south());
        let both = VipV4::default().with_frontend(false).with_frontend(true).with_frontend(false);
        assert_eq!((both.cluster_ip_frontends(), both.has_north_south()), (2, true));
        assert_eq!(
            VipV4::new(u32::MAX, false).cluster_ip_frontends(),
            VipV4::NORTH_SOUTH - 1,
            "the count never sets the flag"
        );
    }

    #[test]
    fn layouts_have_no_implicit_holes() {
        // Sizes equal the sum of the field sizes: a hole would make the kernel
        // and userspace disagree on a key's bytes.
        assert_eq!(size_of::<ServiceKeyV4>(), 4 + 2 + 1 + 1 + 2 + 2);
        assert_eq!(size_of::<ServiceValueV4>(), 4 + 4 + 2 + 2 + 2 + 2 + 4);
        assert_eq!(size_of::<BackendV4>(), 4 + 2 + 1 + 1);
        assert_eq!(size_of::<RevNatV4>(), 4 + 2 + 1 + 1);
        assert_eq!(size_of::<CtKeyV4>(), 4 + 4 + 2 + 2 + 1 + 1 + 2);
        assert_eq!(size_of::<CtEntryV4>(), 8 * 4 + 4 + 4 + 2 + 1 + 1 + 4 + 1 + 7);
        assert_eq!(align_of::<CtEntryV4>(), 8);
        assert_eq!(size_of::<ConfigV4>(), 8 * 4 + 4 + 4);
        assert_eq!(size_of::<AffinityKeyV4>(), 4 + 4);
        assert_eq!(size_of::<AffinityValueV4>(), 8 + 4 + 4);
        assert_eq!(size_of::<VipV4>(), 4);
        assert_eq!(size_of::<SnatEntryV4>(), 8 + 4 + 2 + 2);
        assert_eq!(size_of::<SourceRangeV4>(), 4 + 4);
        assert_eq!(size_of::<ExternalIfaceV4>(), 4 + 4);
        assert_eq!(size_of::<NodePortConfigV4>(), 2 + 2 + 4 + 1 + 3 + 4);
        assert_eq!(size_of::<SockRevNatKeyV4>(), 8 + 4 + 2 + 2);
        assert_eq!(size_of::<FragmentKeyV4>(), 4 + 4 + 2 + 1 + 1);
        assert_eq!(size_of::<FragmentPortsV4>(), 4);
        assert_eq!(size_of::<InheritedFlowV4>(), 4 + 2 + 1 + 1);
        assert_eq!(size_of::<SockRevNatV4>(), 4 + 2 + 2 + 4);
        assert_eq!(size_of::<SocketLbConfigV4>(), 8 + 4 + 4);
    }

    #[test]
    fn snat_ports_stay_in_range_and_cover_it() {
        let (min, max) = (61000, 61009);
        let mut seen = [false; 10];
        for i in 0..10u32 {
            let port = snat_port_candidate(i * (u32::MAX / 10) + u32::MAX / 20, min, max);
            assert!((min..=max).contains(&port));
            seen[usize::from(port - min)] = true;
        }
        assert!(seen.iter().all(|s| *s), "the whole range is reachable");
        assert_eq!(snat_port_candidate(u32::MAX, 1, 65535), 65535);
        assert_eq!(snat_port_candidate(0, 1, 65535), 1);
        assert_eq!(snat_port_candidate(u32::MAX, 0, 65535), 65535);
        assert_eq!(snat_port_candidate(u32::MAX, 5000, 5000), 5000);
    }

    /// The datapath's allocation (random candidates, [`SNAT_PORT_ATTEMPTS`] of
    /// them, first free one wins) run against the default range filled to a
    /// given fraction: new flows must keep succeeding until it is nearly full.
    #[test]
    fn snat_allocation_rarely_fails_until_the_range_is_nearly_full() {
        let (min, max) = (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX);
        let span = usize::from(max - min) + 1;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u32
        };
        for (fill, max_failure_rate) in [(0.5, 0.0001), (0.8, 0.0005), (0.9, 0.005), (0.95, 0.06)] {
            let mut taken = std::vec![false; span];
            let target = (span as f64 * fill) as usize;
            let mut used = 0;
            // Fill by the same scheme, so the taken ports are where allocation puts them.
            while used < target {
                let port = snat_port_candidate(random(), min, max);
                let slot = &mut taken[usize::from(port - min)];
                if !*slot {
                    *slot = true;
                    used += 1;
                }
            }
            let (mut failures, trials) = (0, 20_000);
            for _ in 0..trials {
                let free = (0..SNAT_PORT_ATTEMPTS)
                    .any(|_| !taken[usize::from(snat_port_candidate(random(), min, max) - min)]);
                failures += usize::from(!free);
            }
            let rate = failures as f64 / trials as f64;
            assert!(
                rate <= max_failure_rate,
                "{:.0} % full: {:.3} % of new flows failed",
                fill * 100.0,
                rate * 100.0
            );
        }
    }

    #[test]
    fn default_port_range_when_unset_or_inverted() {
        let unset = NodePortConfigV4::default();
        assert_eq!(unset.port_range(), (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX));
        let inverted = NodePortConfigV4 { snat_port_min: 2000, snat_port_max: 1000, ..Default::default() };
        assert_eq!(inverted.port_range(), (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX));
        let set = NodePortConfigV4 { snat_port_min: 40000, snat_port_max: 40100, ..Default::default() };
        assert_eq!(set.port_range(), (40000, 40100));
    }

    #[test]
    fn cluster_cidr_membership() {
        let config =
            NodePortConfigV4 { cluster_cidr: [10, 244, 0, 0], cluster_cidr_prefix: 16, ..Default::default() };
        assert!(config.in_cluster_cidr([10, 244, 3, 7]));
        assert!(!config.in_cluster_cidr([10, 245, 0, 1]));
        assert!(!config.in_cluster_cidr([192, 168, 100, 200]));
        assert!(!NodePortConfigV4::default().in_cluster_cidr([10, 244, 3, 7]));
        assert!(config.outside_cluster_cidr([192, 168, 100, 200]));
        assert!(!config.outside_cluster_cidr([10, 244, 3, 7]));
        assert!(
            !NodePortConfigV4::default().outside_cluster_cidr([192, 168, 100, 200]),
            "no cluster CIDR known: nobody is outside it"
        );
        let host =
            NodePortConfigV4 { cluster_cidr: [10, 0, 0, 1], cluster_cidr_prefix: 32, ..Default::default() };
        assert!(host.in_cluster_cidr([10, 0, 0, 1]));
        assert!(!host.in_cluster_cidr([10, 0, 0, 2]));
    }

    #[test]
    fn snat_keys_pair_up() {
        let forward = CtKeyV4 {
            saddr: [192, 168, 100, 200],
            daddr: [192, 168, 100, 10],
            sport: 40000u16.to_be_bytes(),
            dport: 30080u16.to_be_bytes(),
            proto: IPPROTO_TCP,
            direction: CT_DIR_FORWARD,
            _pad: [0; 2],
        };
        let backend = [10, 244, 1, 5];
        assert_eq!(snat_forward_key(&forward), forward, "one per flow, whatever its backend");
        let legacy = legacy_snat_forward_key(&forward, backend, 80u16.to_be_bytes());
        assert_eq!(
            (legacy.saddr, legacy.daddr, legacy.sport, legacy.dport),
            (forward.saddr, backend, forward.sport, 80u16.to_be_bytes())
        );
        let reply =
            snat_reply_key(IPPROTO_TCP, backend, 80u16.to_be_bytes(), forward.daddr, 61001u16.to_be_bytes());
        assert_eq!(reply.saddr, backend);
        assert_eq!(reply.daddr, forward.daddr);
        assert_eq!(reply.dport, 61001u16.to_be_bytes());
        assert_eq!(reply.direction, CT_DIR_REPLY);
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
    fn slot0_holds_the_maglev_table_and_a_32_bit_affinity_id() {
        let master =
            ServiceValueV4 { rev_nat_id: 70_000, count: 3, flags: SVC_FLAG_AFFINITY, ..Default::default() };
        let plain = master.with_slot0_ids(None, 0);
        assert_eq!((plain.backend_id, plain.maglev_table(), plain.affinity_id()), (0, None, 70_000));
        let shared = master.with_slot0_ids(Some(0), 3);
        assert_eq!((shared.maglev_table(), shared.affinity_id()), (Some(0), 3));
        // Ids past 16 bits and the last table each keep all their bits, and the rest of slot 0 is kept.
        let last = master.with_slot0_ids(Some(MAGLEV_TABLES_MAX - 1), u32::MAX);
        assert_eq!((last.maglev_table(), last.affinity_id()), (Some(MAGLEV_TABLES_MAX - 1), u32::MAX));
        assert_eq!((last.rev_nat_id, last.count, last.flags), (70_000, 3, SVC_FLAG_AFFINITY));
        let wide = master.with_slot0_ids(Some(2), 0x0001_0000);
        assert_eq!((wide.maglev_table(), wide.named_affinity_id()), (Some(2), 0x0001_0000));
        // A table slot 0 cannot name is none, not another table.
        assert_eq!(master.with_slot0_ids(Some(MAGLEV_TABLES_MAX), 1).maglev_table(), None);
    }

    #[test]
    fn source_range_keys_order_the_32_bit_id_big_endian() {
        // The trie matches from the first byte: ids that differ only above bit 15 are other frontends.
        let a = SourceRangeV4::new(0x0001_0005, [10, 0, 0, 1]);
        let b = SourceRangeV4::new(0x0000_0005, [10, 0, 0, 1]);
        assert_eq!(a.rev_nat_id, [0, 1, 0, 5]);
        assert_ne!(a, b);
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
