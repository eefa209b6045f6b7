//! NAT events for `kproxy trace`: written to a ring buffer by the datapath
//! only while someone listens (the TRACE flag), read and printed by userspace.

pub const MAP_EVENTS: &str = "EVENTS";
pub const MAP_TRACE: &str = "TRACE";
/// Ring buffer size: a burst of ~4k events; beyond it events are dropped,
/// never waited for.
pub const EVENTS_BYTES: u32 = 256 * 1024;

/// A new flow was DNATed to a backend.
pub const EV_DNAT_NEW: u8 = 1;
/// A packet of a known flow was DNATed.
pub const EV_DNAT_ESTABLISHED: u8 = 2;
/// A reply was rewritten back to the VIP.
pub const EV_UNNAT: u8 = 3;
/// The packet was refused (RST or ICMP port unreachable sent back).
pub const EV_REJECT: u8 = 4;
/// INVALID TCP to a VIP was dropped.
pub const EV_DROP_INVALID: u8 = 5;
/// An ICMP error quoting a translated flow was un-NATed for its client: the
/// "before" tuple is the quoted packet as it arrived, "after" as rewritten.
pub const EV_ICMP_UNNAT: u8 = 6;

/// The TRACE array's only entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceConfig {
    /// Non-zero while a `kproxy trace` listens.
    pub enabled: u32,
}

/// One step that changed (or refused) a packet: the tuple before and after. Generic over the
/// family's address (`[u8; 4]`, `[u8; 16]`): both families write to the one EVENTS ring buffer, and a
/// record's length tells which it is ([`TraceEventV4`] and [`TraceEventV6`] differ in size).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEvent<A> {
    pub timestamp_ns: u64,
    /// When the flow's conntrack entry was created (0 when none).
    pub ct_created_ns: u64,
    pub backend_id: u32,
    pub ifindex: u32,
    pub before_saddr: A,
    pub before_daddr: A,
    pub after_saddr: A,
    pub after_daddr: A,
    pub before_sport: [u8; 2],
    pub before_dport: [u8; 2],
    pub after_sport: [u8; 2],
    pub after_dport: [u8; 2],
    pub rev_nat_id: crate::maps::RevNatId,
    /// 1-based slot the backend was picked from (new flows); [`SLOT_BY_AFFINITY`] or
    /// [`SLOT_BY_MAGLEV`] when no slot was drawn; 0 for other events.
    pub backend_slot: u16,
    /// Active backends of the frontend when the slot was picked.
    pub backend_count: u16,
    pub kind: u8,
    pub proto: u8,
    pub ct_flags: u8,
    pub _pad: [u8; 5],
}

/// `backend_slot` of a new flow whose backend the client's session affinity kept.
pub const SLOT_BY_AFFINITY: u16 = 0;
/// `backend_slot` of a new flow whose backend the frontend's Maglev table gave (no slot is drawn;
/// 1-based slots stop below it, as a frontend has fewer backends than a u16 counts).
pub const SLOT_BY_MAGLEV: u16 = u16::MAX;

pub type TraceEventV4 = TraceEvent<[u8; 4]>;
pub type TraceEventV6 = TraceEvent<[u8; 16]>;

impl<A> TraceEvent<A> {
    /// The same event with its addresses converted (userspace reads both families as one type).
    pub fn map_addrs<B>(self, mut f: impl FnMut(A) -> B) -> TraceEvent<B> {
        TraceEvent {
            timestamp_ns: self.timestamp_ns,
            ct_created_ns: self.ct_created_ns,
            backend_id: self.backend_id,
            ifindex: self.ifindex,
            before_saddr: f(self.before_saddr),
            before_daddr: f(self.before_daddr),
            after_saddr: f(self.after_saddr),
            after_daddr: f(self.after_daddr),
            before_sport: self.before_sport,
            before_dport: self.before_dport,
            after_sport: self.after_sport,
            after_dport: self.after_dport,
            rev_nat_id: self.rev_nat_id,
            backend_slot: self.backend_slot,
            backend_count: self.backend_count,
            kind: self.kind,
            proto: self.proto,
            ct_flags: self.ct_flags,
            _pad: self._pad,
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C) integers and byte arrays with explicit padding.
    unsafe impl aya::Pod for super::TraceConfig {}
    unsafe impl aya::Pod for super::TraceEventV4 {}
    unsafe impl aya::Pod for super::TraceEventV6 {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_layout_has_no_holes() {
        assert_eq!(core::mem::size_of::<TraceEventV4>(), 8 + 8 + 4 + 4 + 16 + 8 + 4 + 2 + 2 + 1 + 1 + 1 + 5);
        assert_eq!(core::mem::size_of::<TraceEventV4>() % 8, 0);
        assert_eq!(core::mem::size_of::<TraceEventV6>(), 8 + 8 + 4 + 4 + 64 + 8 + 4 + 2 + 2 + 1 + 1 + 1 + 5);
        assert_eq!(core::mem::size_of::<TraceEventV6>() % 8, 0);
    }
}
