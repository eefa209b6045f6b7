//! The report for the operator: the differences as a table, and the labels their texts name frontends,
//! backends and lists by.

use std::net::IpAddr;

use proxy_common::maps::{BACKEND_FLAG_TERMINATING, FrontendNameV4, SCOPE_CLUSTER_IP};

use super::Difference;
use super::state::{BackendEntry, RevNatEntry};
use crate::{
    model::{BackendAddr, Frontend},
    net::Protocol,
};

/// The differences as a table, or "no differences".
pub fn table(differences: &[Difference]) -> String {
    if differences.is_empty() {
        return "no differences\n".to_owned();
    }
    let rows: Vec<Vec<String>> = differences
        .iter()
        .map(|d| vec![d.kind.to_owned(), d.frontend.clone(), d.service.clone(), d.detail.clone()])
        .collect();
    let mut out = crate::cmd::dump::table(&["KIND", "FRONTEND", "SERVICE", "DETAIL"], &rows);
    let n = differences.len();
    out.push_str(&format!("{n} difference{}\n", if n == 1 { "" } else { "s" }));
    out
}

/// A frontend as the services map keys it: VIP, port, protocol number and scope.
pub(super) type Key = (IpAddr, u16, u8, u8);

pub(super) fn proto_name(n: u8) -> String {
    Protocol::from_number(n).map_or_else(|| format!("proto {n}"), |p| p.name().to_owned())
}

/// `vip:port/PROTO`, with the scope when it is not the cluster-IP one.
pub(super) fn frontend_label(key: &Key) -> String {
    let scope = if key.3 == SCOPE_CLUSTER_IP { String::new() } else { format!(" scope {}", key.3) };
    match key.0 {
        IpAddr::V4(vip) => format!("{vip}:{}/{}{scope}", key.1, proto_name(key.2)),
        IpAddr::V6(vip) => format!("[{vip}]:{}/{}{scope}", key.1, proto_name(key.2)),
    }
}

/// A backends map entry's address and port.
pub(super) fn backend_addr(b: &BackendEntry) -> BackendAddr {
    b.addr
}

pub(super) fn backend_label(b: &BackendEntry) -> String {
    b.addr.to_string()
}

pub(super) fn list<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items.into_iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

/// The wanted name of a frontend in the names map (truncated as the map stores it).
pub(super) fn wanted_name(frontend: &Frontend) -> String {
    FrontendNameV4::new(&format!("{}:{}", frontend.service, frontend.port_name)).as_str().to_owned()
}

/// A rev-NAT entry's frontend, `vip:port/PROTO`.
pub(super) fn rev_nat_label(r: &RevNatEntry) -> String {
    frontend_label(&(r.vip, r.port, r.proto, SCOPE_CLUSTER_IP))
}

/// A backend's state as its flags say.
pub(super) fn backend_state(flags: u8) -> &'static str {
    if flags & BACKEND_FLAG_TERMINATING != 0 { "terminating" } else { "active" }
}
