//! A full conntrack table (an LRU) evicts entries, and a flow's translation must live or die as
//! one: a client that keeps sending while its backend stays silent must not keep its forward
//! entry and lose the reply entry, or the backend's next reply leaves un-NATed. Real programs
//! through BPF_PROG_TEST_RUN; the table is churned from userspace with other flows' entries, as
//! a busy node's other connections would. Needs root.

mod common;

use common::{
    Packet,
    harness::{CLIENT, Harness, PASS, WEB_BACKENDS, WEB_VIP, ct_key},
};
use proxy_common::{
    maps::{CONNTRACK_V4_CAPACITY, CT_DIR_FORWARD, CT_DIR_REPLY, CtEntryV4, CtKeyV4, IPPROTO_TCP},
    packet::{TCP_ACK, TCP_SYN},
};

const FLOWS: u16 = 64;
const FIRST_PORT: u16 = 30000;

fn source(frame: &[u8]) -> ([u8; 4], u16) {
    (frame[26..30].try_into().unwrap(), u16::from_be_bytes([frame[34], frame[35]]))
}

fn destination(frame: &[u8]) -> ([u8; 4], u16) {
    (frame[30..34].try_into().unwrap(), u16::from_be_bytes([frame[36], frame[37]]))
}

/// Inserts `count` entries of unrelated flows (each a whole LRU's worth of churn eventually).
fn churn(h: &mut Harness, round: u32, count: u32) {
    for i in 0..count {
        let n = round * count + i;
        let key = CtKeyV4 {
            saddr: [10, 250, (n >> 16) as u8, (n >> 8) as u8],
            daddr: [10, 251, 0, n as u8],
            sport: [0x80, 0],
            dport: [0, 80],
            proto: IPPROTO_TCP,
            direction: CT_DIR_FORWARD,
            _pad: [0; 2],
        };
        h.conntrack.insert(key, CtEntryV4::default(), 0).unwrap();
    }
}

#[test]
fn a_busy_flow_keeps_its_un_nat_while_the_table_churns() {
    let mut h = Harness::new();
    let capacity = CONNTRACK_V4_CAPACITY;
    let mut backends = Vec::new();
    for i in 0..FLOWS {
        let (ret, out) = h.ingress(&Packet::tcp(CLIENT, FIRST_PORT + i, WEB_VIP, 80, TCP_SYN).frame());
        assert_eq!(ret, PASS);
        backends.push(destination(&out));
    }
    // Three times the table's size of other flows' entries, while every client keeps sending.
    let rounds = 48;
    for round in 0..rounds {
        churn(&mut h, round, capacity * 3 / rounds);
        for i in 0..FLOWS {
            let (ret, out) = h.ingress(&Packet::tcp(CLIENT, FIRST_PORT + i, WEB_VIP, 80, TCP_ACK).frame());
            assert_eq!(ret, PASS);
            assert_eq!(destination(&out), backends[usize::from(i)], "flow {i} stays on its backend");
        }
    }
    let mut leaked = Vec::new();
    for i in 0..FLOWS {
        let (backend, backend_port) = backends[usize::from(i)];
        assert!(WEB_BACKENDS.contains(&backend));
        let reply = Packet::tcp(backend, backend_port, CLIENT, FIRST_PORT + i, TCP_ACK).frame();
        let (ret, out) = h.egress(&reply);
        assert_eq!(ret, PASS);
        if source(&out) != (WEB_VIP, 80) {
            leaked.push((FIRST_PORT + i, source(&out)));
        }
    }
    assert!(leaked.is_empty(), "{} of {FLOWS} replies left un-NATed: {leaked:?}", leaked.len());
    let reply_key = ct_key(backends[0].0, backends[0].1, CLIENT, FIRST_PORT, IPPROTO_TCP, CT_DIR_REPLY);
    assert!(h.ct(&reply_key).is_some());
}

/// The other way round: a backend that keeps sending to a silent client (a server push, a
/// download the client does not acknowledge often) keeps the client's forward entry, so the
/// client's next segment is not taken for a flow picked up mid-stream (dropped as invalid).
#[test]
fn a_busy_backend_keeps_its_clients_forward_entry() {
    let mut h = Harness::new();
    let capacity = CONNTRACK_V4_CAPACITY;
    let mut backends = Vec::new();
    for i in 0..FLOWS {
        let (_, out) = h.ingress(&Packet::tcp(CLIENT, FIRST_PORT + i, WEB_VIP, 80, TCP_SYN).frame());
        backends.push(destination(&out));
    }
    let rounds = 48;
    for round in 0..rounds {
        churn(&mut h, round, capacity * 3 / rounds);
        for i in 0..FLOWS {
            let (backend, backend_port) = backends[usize::from(i)];
            let reply = Packet::tcp(backend, backend_port, CLIENT, FIRST_PORT + i, TCP_ACK).frame();
            let (_, out) = h.egress(&reply);
            assert_eq!(source(&out), (WEB_VIP, 80), "reply {i} un-NATed");
        }
    }
    for i in 0..FLOWS {
        let (ret, out) = h.ingress(&Packet::tcp(CLIENT, FIRST_PORT + i, WEB_VIP, 80, TCP_ACK).frame());
        assert_eq!(ret, PASS, "the client's segment {i} is not dropped as invalid");
        assert_eq!(destination(&out), backends[usize::from(i)]);
    }
}
