//! Where a frontend's address family picks its maps: IPv4 frontends and backends go to the `*_V4` maps,
//! IPv6 ones to the `*_V6` maps, under the same ids (one rev-NAT id space, one backend id space). The rest
//! of the syncer is written once for both families.

use std::net::IpAddr;

use anyhow::Result;
use proxy_common::maps::{BackendV4, RevNatId, RevNatV4, ServiceKeyV4, ServiceValueV4, VipV4};
use proxy_common::maps_v6::{BackendV6, RevNatV6, ServiceKeyV6};

use super::{FrontendKey, Store, Syncer};
use crate::model::BackendAddr;
use crate::net::Protocol;

impl<S: Store> Syncer<S> {
    pub(super) fn put_slot(&mut self, fk: &FrontendKey, slot: u16, value: ServiceValueV4) -> Result<()> {
        let (port, proto) = (fk.port.to_be_bytes(), fk.proto.number());
        match fk.vip {
            IpAddr::V4(vip) => {
                self.store.put_service(ServiceKeyV4::new(vip.octets(), port, proto, fk.scope, slot), value)
            }
            IpAddr::V6(vip) => {
                self.store.put_service6(ServiceKeyV6::new(vip.octets(), port, proto, fk.scope, slot), value)
            }
        }
    }

    pub(super) fn del_slot(&mut self, fk: &FrontendKey, slot: u16) -> Result<()> {
        let (port, proto) = (fk.port.to_be_bytes(), fk.proto.number());
        match fk.vip {
            IpAddr::V4(vip) => {
                self.store.del_service(&ServiceKeyV4::new(vip.octets(), port, proto, fk.scope, slot))
            }
            IpAddr::V6(vip) => {
                self.store.del_service6(&ServiceKeyV6::new(vip.octets(), port, proto, fk.scope, slot))
            }
        }
    }

    pub(super) fn put_backend_entry(
        &mut self,
        id: u32,
        backend: BackendAddr,
        proto: Protocol,
        flags: u8,
    ) -> Result<()> {
        let (port, proto) = (backend.port.to_be_bytes(), proto.number());
        match backend.addr {
            IpAddr::V4(addr) => {
                self.store.put_backend(id, BackendV4 { addr: addr.octets(), port, proto, flags })
            }
            IpAddr::V6(addr) => {
                self.store.put_backend6(id, BackendV6 { addr: addr.octets(), port, proto, flags })
            }
        }
    }

    pub(super) fn del_backend_entry(&mut self, id: u32, backend: BackendAddr) -> Result<()> {
        match backend.addr {
            IpAddr::V4(_) => self.store.del_backend(id),
            IpAddr::V6(_) => self.store.del_backend6(id),
        }
    }

    pub(super) fn put_rev_nat_entry(&mut self, fk: &FrontendKey, id: RevNatId) -> Result<()> {
        let (port, proto) = (fk.port.to_be_bytes(), fk.proto.number());
        match fk.vip {
            IpAddr::V4(vip) => {
                self.store.put_rev_nat(id, RevNatV4 { vip: vip.octets(), port, proto, _pad: 0 })
            }
            IpAddr::V6(vip) => {
                self.store.put_rev_nat6(id, RevNatV6 { vip: vip.octets(), port, proto, _pad: 0 })
            }
        }
    }

    pub(super) fn del_rev_nat_entry(&mut self, fk: &FrontendKey, id: RevNatId) -> Result<()> {
        match fk.vip {
            IpAddr::V4(_) => self.store.del_rev_nat(id),
            IpAddr::V6(_) => self.store.del_rev_nat6(id),
        }
    }

    pub(super) fn put_vip_entry(&mut self, vip: IpAddr, frontends: u32) -> Result<()> {
        match vip {
            IpAddr::V4(vip) => self.store.put_vip(vip.octets(), VipV4 { frontends }),
            IpAddr::V6(vip) => self.store.put_vip6(vip.octets(), VipV4 { frontends }),
        }
    }

    pub(super) fn del_vip_entry(&mut self, vip: IpAddr) -> Result<()> {
        match vip {
            IpAddr::V4(vip) => self.store.del_vip(vip.octets()),
            IpAddr::V6(vip) => self.store.del_vip6(vip.octets()),
        }
    }
}
