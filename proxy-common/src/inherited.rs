//! Inherited flows: connections netfilter translated before kproxy attached —
//! kube-proxy's DNAT to a backend, its masquerade — found by the agent in
//! nf_conntrack and marked in `INHERITED_V4`. The datapath leaves them to
//! netfilter until they end, so a node moves from kube-proxy to kproxy without
//! cutting a connection.
//!
//! An nf_conntrack entry has two tuples: the original one (as the client sent
//! it: client → Service address) and the reply one (as the reply arrives:
//! backend → the client, or → the node for a masqueraded flow). From them
//! [`keys`] derives what the datapath looks up:
//!
//! - the **forward key** (the original tuple, `CT_DIR_FORWARD`), while the flow
//!   is open: a packet of the flow with no kproxy conntrack entry is passed to
//!   netfilter instead of being dropped (a TCP segment that is not a SYN) or
//!   translated anew (UDP);
//! - for UDP, the same key with **no client address**, while open: the socket
//!   hooks see a sender's port but not always its address (an unbound socket),
//!   and leave such a datagram untranslated; tc then decides with the full key;
//! - the **reply key** (the reply tuple, `CT_DIR_REPLY`), open or over: a new
//!   kproxy flow whose reply tuple would be the same (the client reused a source
//!   port and kproxy picked the same backend) would clash with the netfilter
//!   entry, which drops it at confirmation; kproxy remaps the new flow's source
//!   port, or takes another SNAT port, instead.

use crate::maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CtKeyV4, IPPROTO_UDP, InheritedFlowV4};

/// One direction of an nf_conntrack entry, as the packets carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NfTuple {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    /// Network byte order, as in the packet.
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

/// The keys (at most three) under which an nf_conntrack entry of protocol
/// `proto` is marked; `open` is false for a TCP flow that is over (TIME_WAIT,
/// CLOSE), which keeps only its reply key.
pub fn keys(
    proto: u8,
    orig: NfTuple,
    reply: NfTuple,
    open: bool,
) -> ([(CtKeyV4, InheritedFlowV4); 3], usize) {
    let key = |t: NfTuple, direction: u8| CtKeyV4 {
        saddr: t.src,
        daddr: t.dst,
        sport: t.sport,
        dport: t.dport,
        proto,
        direction,
        _pad: [0; 2],
    };
    let towards_backend =
        InheritedFlowV4 { nat_addr: reply.src, nat_port: reply.sport, open: u8::from(open), _pad: 0 };
    let towards_service =
        InheritedFlowV4 { nat_addr: orig.dst, nat_port: orig.dport, open: u8::from(open), _pad: 0 };
    let reply_entry = (key(reply, CT_DIR_REPLY), towards_service);
    let mut out = [reply_entry; 3];
    let mut n = 1;
    if open {
        out[n] = (key(orig, CT_DIR_FORWARD), towards_backend);
        n += 1;
        if proto == IPPROTO_UDP {
            out[n] = (any_client(&key(orig, CT_DIR_FORWARD)), towards_backend);
            n += 1;
        }
    }
    (out, n)
}

/// A forward key without its client address: what the socket hooks look up.
pub const fn any_client(key: &CtKeyV4) -> CtKeyV4 {
    CtKeyV4 { saddr: [0; 4], ..*key }
}

/// Whether netfilter translated the entry's flow: its reply does not come back
/// from where the client sent it (DNAT) or not to the client (SNAT).
pub fn is_translated(orig: NfTuple, reply: NfTuple) -> bool {
    (reply.src, reply.sport) != (orig.dst, orig.dport) || (reply.dst, reply.dport) != (orig.src, orig.sport)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::IPPROTO_TCP;

    const CLIENT: [u8; 4] = [10, 244, 0, 5];
    const VIP: [u8; 4] = [10, 96, 0, 10];
    const BACKEND: [u8; 4] = [10, 244, 1, 7];
    const NODE: [u8; 4] = [192, 168, 0, 1];

    fn port(p: u16) -> [u8; 2] {
        p.to_be_bytes()
    }

    fn dnat() -> (NfTuple, NfTuple) {
        (
            NfTuple { src: CLIENT, dst: VIP, sport: port(40000), dport: port(53) },
            NfTuple { src: BACKEND, dst: CLIENT, sport: port(5353), dport: port(40000) },
        )
    }

    #[test]
    fn an_open_tcp_flow_has_its_forward_key_towards_the_backend_and_its_reply_key_towards_the_service() {
        let (orig, reply) = dnat();
        let (keys, n) = keys(IPPROTO_TCP, orig, reply, true);
        assert_eq!(n, 2);
        let (reply_key, reply_value) = keys[0];
        assert_eq!(
            (reply_key.saddr, reply_key.daddr, reply_key.sport, reply_key.dport, reply_key.direction),
            (BACKEND, CLIENT, port(5353), port(40000), CT_DIR_REPLY)
        );
        assert_eq!((reply_value.nat_addr, reply_value.nat_port, reply_value.open), (VIP, port(53), 1));
        let (forward_key, forward_value) = keys[1];
        assert_eq!(
            (
                forward_key.saddr,
                forward_key.daddr,
                forward_key.sport,
                forward_key.dport,
                forward_key.direction
            ),
            (CLIENT, VIP, port(40000), port(53), CT_DIR_FORWARD)
        );
        assert_eq!((forward_value.nat_addr, forward_value.nat_port), (BACKEND, port(5353)));
        assert_eq!(forward_key.proto, IPPROTO_TCP);
    }

    #[test]
    fn an_open_udp_flow_is_also_marked_for_any_client_address() {
        let (orig, reply) = dnat();
        let (keys, n) = keys(IPPROTO_UDP, orig, reply, true);
        assert_eq!(n, 3);
        assert_eq!(keys[2].0, CtKeyV4 { saddr: [0; 4], ..keys[1].0 });
        assert_eq!(keys[2].1, keys[1].1);
    }

    #[test]
    fn a_flow_that_is_over_keeps_only_its_reply_key() {
        let (orig, reply) = dnat();
        let (keys, n) = keys(IPPROTO_TCP, orig, reply, false);
        assert_eq!(n, 1);
        assert_eq!(keys[0].0.direction, CT_DIR_REPLY);
        assert_eq!(keys[0].1.open, 0);
    }

    #[test]
    fn a_masqueraded_node_port_flow_is_keyed_by_the_node_address_its_replies_come_back_to() {
        let orig = NfTuple { src: [203, 0, 113, 9], dst: NODE, sport: port(51000), dport: port(30080) };
        let reply = NfTuple { src: BACKEND, dst: NODE, sport: port(8080), dport: port(51000) };
        let (keys, _) = keys(IPPROTO_TCP, orig, reply, true);
        assert_eq!((keys[0].0.saddr, keys[0].0.daddr, keys[0].0.dport), (BACKEND, NODE, port(51000)));
        assert_eq!(
            (keys[1].0.saddr, keys[1].0.daddr, keys[1].0.dport),
            ([203, 0, 113, 9], NODE, port(30080))
        );
        assert!(is_translated(orig, reply));
    }

    #[test]
    fn an_untranslated_entry_is_not_translated() {
        let orig = NfTuple { src: CLIENT, dst: BACKEND, sport: port(40000), dport: port(80) };
        let reply = NfTuple { src: BACKEND, dst: CLIENT, sport: port(80), dport: port(40000) };
        assert!(!is_translated(orig, reply));
        let (orig, reply) = dnat();
        assert!(is_translated(orig, reply));
    }
}
