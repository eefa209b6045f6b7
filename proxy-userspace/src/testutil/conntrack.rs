//! Conntrack entries for unit tests: a DNATed flow's two entries.

use proxy_common::{
    conntrack::CtState,
    maps::{CT_DIR_FORWARD, CT_DIR_REPLY, CtEntryV4, CtKeyV4},
    maps_v6::{CtEntryV6, CtKeyV6},
};

pub const CLIENT: [u8; 4] = [10, 244, 0, 2];
pub const VIP: [u8; 4] = [10, 96, 0, 10];
pub const BACKEND: [u8; 4] = [10, 244, 0, 21];
pub const HAIRPIN: [u8; 4] = [169, 254, 42, 1];

pub fn key(s: [u8; 4], sp: u16, d: [u8; 4], dp: u16, proto: u8, direction: u8) -> CtKeyV4 {
    CtKeyV4 {
        saddr: s,
        daddr: d,
        sport: sp.to_be_bytes(),
        dport: dp.to_be_bytes(),
        proto,
        direction,
        _pad: [0; 2],
    }
}

/// A flow client:sport → VIP:53 DNATed to BACKEND, both entries.
pub fn flow(
    client: [u8; 4],
    sport: u16,
    proto: u8,
    state: CtState,
    fwd_seen: u64,
    reply_seen: u64,
) -> [(CtKeyV4, CtEntryV4); 2] {
    let fkey = key(client, sport, VIP, 53, proto, CT_DIR_FORWARD);
    let fwd = CtEntryV4 {
        last_seen_ns: fwd_seen,
        backend_id: 7,
        nat_addr: BACKEND,
        nat_port: 53u16.to_be_bytes(),
        rev_nat_id: 3,
        state: state as u8,
        ..Default::default()
    };
    let rkey = key(BACKEND, 53, client, sport, proto, CT_DIR_REPLY);
    let reply = CtEntryV4 { last_seen_ns: reply_seen, nat_addr: VIP, nat_port: 53u16.to_be_bytes(), ..fwd };
    [(fkey, fwd), (rkey, reply)]
}

pub const CLIENT6: [u8; 16] = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
pub const VIP6: [u8; 16] = [0xfd, 0, 0, 0x10, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a];
pub const BACKEND6: [u8; 16] = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x21];

/// An IPv6 flow CLIENT6:sport → VIP6:53 DNATed to BACKEND6 (backend 17, open, seen at 0), both
/// entries.
pub fn flow6(sport: u16, proto: u8, rev_nat_id: proxy_common::maps::RevNatId) -> [(CtKeyV6, CtEntryV6); 2] {
    let fkey = CtKeyV6 {
        saddr: CLIENT6,
        daddr: VIP6,
        sport: sport.to_be_bytes(),
        dport: 53u16.to_be_bytes(),
        proto,
        direction: CT_DIR_FORWARD,
        _pad: [0; 2],
    };
    let fwd = CtEntryV6 {
        backend_id: 17,
        nat_addr: BACKEND6,
        nat_port: 53u16.to_be_bytes(),
        rev_nat_id,
        state: CtState::Open as u8,
        ..Default::default()
    };
    let rkey = fkey.reply_of(BACKEND6, 53u16.to_be_bytes());
    let reply = CtEntryV6 { nat_addr: VIP6, ..fwd };
    [(fkey, fwd), (rkey, reply)]
}
