//! Types and pure logic shared by the kernel programs (`proxy-ebpf`) and the
//! `kproxy` binary. Everything here is `no_std`, `#[repr(C)]` with explicit
//! padding so that both sides agree on every byte, and unit-tested on the host.
#![no_std]

pub mod checksum;
pub mod conntrack;
pub mod icmp;
pub mod icmp6;
pub mod inherited;
pub mod maglev;
pub mod maps;
pub mod maps_v6;
pub mod packet;
pub mod packet6;
pub mod reject;
pub mod reject6;
pub mod service_cidr;
pub mod slots;
pub mod sock_v6;
pub mod stats;
pub mod trace;

#[cfg(test)]
extern crate std;
