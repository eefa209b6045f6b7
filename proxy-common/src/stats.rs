//! Datapath counters: one per-CPU `u64` per reason, summed by userspace.

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// Not IPv4 (ARP, IPv6, ...).
    PassNotIpv4 = 0,
    /// ICMP, SCTP and other non-TCP/UDP protocols.
    PassNotTcpUdp,
    /// Later IPv4 fragments whose first fragment was not seen (ports unknown),
    /// or whose datagram started no flow.
    PassFragment,
    /// Headers that contradict themselves.
    PassMalformed,
    /// Packets too short for their L4 header.
    PassTruncated,
    /// Matched no Service and no translated flow: TCP/UDP to no frontend (a
    /// pod, most often), a packet into a pod or to a SNAT port or the hairpin
    /// address that is no reply of one, an ICMP error quoting none.
    PassNoService,
    /// A new flow translated to a backend.
    DnatNew,
    /// A packet of a known flow translated.
    DnatEstablished,
    /// A reply rewritten back to the VIP.
    ReverseNat,
    /// A Service frontend without active backends.
    NoBackend,
    /// A slot or backend entry missing while the agent rewrote a Service.
    SlotMiss,
    /// The conntrack map refused an insert.
    ConntrackInsertFailed,
    /// A checksum or store helper failed; the packet was dropped.
    RewriteFailed,
    /// TCP to a VIP without endpoints (or on a port it does not have): RST sent.
    RejectTcp,
    /// UDP to a VIP without endpoints (or port): ICMP port unreachable sent.
    RejectUdp,
    /// TCP that is not a SYN, to a VIP, with no conntrack entry: dropped.
    DropInvalidTcp,
    /// A flow whose backend is gone was sent to another backend.
    Rebalanced,
    /// An expired conntrack entry was replaced by a new flow.
    ConntrackExpired,
    /// A new flow followed sessionAffinity to its client's backend.
    AffinityHit,
    /// A pod reached itself through its Service (source rewritten).
    Hairpin,
    /// `kproxy trace` listened but the event ring buffer was full.
    TraceDropped,
    /// A new external flow got a node address and SNAT port.
    SnatNew,
    /// A reply to a source-NATed flow was sent back to its client.
    SnatReverse,
    /// No free SNAT port after every attempt: the new flow was dropped.
    SnatPortExhausted,
    /// A client outside a LoadBalancer's loadBalancerSourceRanges: dropped.
    DropSourceRange,
    /// externalTrafficPolicy: Local and no endpoint on this node: dropped.
    DropNoLocalEndpoint,
    /// The route lookup for a rewritten packet failed: dropped by tc; XDP
    /// leaves such a packet to tc instead (before rewriting it).
    FibLookupFailed,
    /// XDP sent a rewritten packet out without the stack.
    XdpForwarded,
    /// XDP left a packet to the stack (and tc); its reason is counted too.
    XdpPass,
    /// A connect() or sendmsg() to a Service was sent to a backend.
    SockTranslated,
    /// A connect() or sendmsg() to a Service without endpoints was refused.
    SockRefused,
    /// recvmsg() or getpeername() showed the Service address again.
    SockReverse,
    /// A new flow's backend came from its frontend's Maglev table.
    MaglevPick,
    /// A later IPv4 fragment got its first fragment's ports (and translation).
    FragmentFollowed,
    /// An ICMP error quoting a translated flow was un-NATed for its client.
    IcmpErrorUnnat,
    /// A new flow's reply tuple was a live translated flow's: its source port
    /// was remapped so that both keep working.
    PortRemapped,
    /// A new flow took the reply tuple of a translated flow that was over
    /// (closed, idle or half-evicted), whose entries were removed.
    ClashYielded,
    /// A packet that would have been refused (RST, ICMP port unreachable), but
    /// whose source names no single host (broadcast, multicast, loopback,
    /// 0.0.0.0/8, 240.0.0.0/4) or that was sent to a link-layer group:
    /// dropped without an answer (RFC 1122).
    RejectUnanswerable,
    /// XDP left a Service's packet to tc by design: a local backend (its
    /// choice recorded for tc), externalTrafficPolicy: Local, a cluster IP
    /// reached from outside, a refusal or invalid segment, a fragment, a flow
    /// tc must re-balance or expire, an unresolved neighbour, a route out of
    /// another interface. Counted with `XdpPass`.
    XdpToTc,
    /// A source-NATed or port-remapped flow whose SNAT_V4 translation is gone
    /// (evicted from the LRU): its packet was left untranslated.
    SnatEntryMissing,
    /// A flow to source-NAT arrived on an external interface the agent has
    /// given no node address (EXTERNAL_IFACES): left untranslated.
    PassNoNodeAddress,
    /// A packet of a flow netfilter translated before kproxy attached
    /// (kube-proxy's): left to netfilter until the flow ends.
    PassInheritedFlow,
    /// A packet to an address inside a service CIDR that is no Service's
    /// (kube-proxy's nftables `cluster-ips-check`): dropped, so that it never
    /// leaves the node; a connect() or sendmsg() of the node's own fails with
    /// EPERM.
    DropUnallocatedServiceIp,
}

impl Stat {
    pub const COUNT: u32 = 43;

    pub const ALL: [Stat; Self::COUNT as usize] = [
        Stat::PassNotIpv4,
        Stat::PassNotTcpUdp,
        Stat::PassFragment,
        Stat::PassMalformed,
        Stat::PassTruncated,
        Stat::PassNoService,
        Stat::DnatNew,
        Stat::DnatEstablished,
        Stat::ReverseNat,
        Stat::NoBackend,
        Stat::SlotMiss,
        Stat::ConntrackInsertFailed,
        Stat::RewriteFailed,
        Stat::RejectTcp,
        Stat::RejectUdp,
        Stat::DropInvalidTcp,
        Stat::Rebalanced,
        Stat::ConntrackExpired,
        Stat::AffinityHit,
        Stat::Hairpin,
        Stat::TraceDropped,
        Stat::SnatNew,
        Stat::SnatReverse,
        Stat::SnatPortExhausted,
        Stat::DropSourceRange,
        Stat::DropNoLocalEndpoint,
        Stat::FibLookupFailed,
        Stat::XdpForwarded,
        Stat::XdpPass,
        Stat::SockTranslated,
        Stat::SockRefused,
        Stat::SockReverse,
        Stat::MaglevPick,
        Stat::FragmentFollowed,
        Stat::IcmpErrorUnnat,
        Stat::PortRemapped,
        Stat::ClashYielded,
        Stat::RejectUnanswerable,
        Stat::XdpToTc,
        Stat::SnatEntryMissing,
        Stat::PassNoNodeAddress,
        Stat::PassInheritedFlow,
        Stat::DropUnallocatedServiceIp,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Stat::PassNotIpv4 => "pass_not_ipv4",
            Stat::PassNotTcpUdp => "pass_not_tcp_udp",
            Stat::PassFragment => "pass_fragment",
            Stat::PassMalformed => "pass_malformed",
            Stat::PassTruncated => "pass_truncated",
            Stat::PassNoService => "pass_no_service",
            Stat::DnatNew => "dnat_new_flow",
            Stat::DnatEstablished => "dnat_established",
            Stat::ReverseNat => "reverse_nat",
            Stat::NoBackend => "no_backend",
            Stat::SlotMiss => "slot_miss",
            Stat::ConntrackInsertFailed => "conntrack_insert_failed",
            Stat::RewriteFailed => "rewrite_failed",
            Stat::RejectTcp => "reject_tcp_rst",
            Stat::RejectUdp => "reject_udp_icmp",
            Stat::DropInvalidTcp => "drop_invalid_tcp",
            Stat::Rebalanced => "rebalanced_backend_gone",
            Stat::ConntrackExpired => "conntrack_expired",
            Stat::AffinityHit => "affinity_hit",
            Stat::Hairpin => "hairpin",
            Stat::TraceDropped => "trace_events_dropped",
            Stat::SnatNew => "snat_new_flow",
            Stat::SnatReverse => "snat_reverse",
            Stat::SnatPortExhausted => "snat_port_exhausted",
            Stat::DropSourceRange => "drop_source_range",
            Stat::DropNoLocalEndpoint => "drop_no_local_endpoint",
            Stat::FibLookupFailed => "fib_lookup_failed",
            Stat::XdpForwarded => "xdp_forwarded",
            Stat::XdpPass => "xdp_pass",
            Stat::SockTranslated => "socket_lb_translated",
            Stat::SockRefused => "socket_lb_refused",
            Stat::SockReverse => "socket_lb_reverse",
            Stat::MaglevPick => "maglev_pick",
            Stat::FragmentFollowed => "fragment_followed",
            Stat::IcmpErrorUnnat => "icmp_error_unnat",
            Stat::PortRemapped => "port_remapped",
            Stat::ClashYielded => "clash_yielded",
            Stat::RejectUnanswerable => "reject_unanswerable",
            Stat::XdpToTc => "xdp_to_tc",
            Stat::SnatEntryMissing => "snat_entry_missing",
            Stat::PassNoNodeAddress => "pass_no_node_address",
            Stat::PassInheritedFlow => "pass_inherited_flow",
            Stat::DropUnallocatedServiceIp => "drop_unallocated_service_ip",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_indexed_by_discriminant() {
        for (i, stat) in Stat::ALL.iter().enumerate() {
            assert_eq!(*stat as usize, i);
        }
    }
}
