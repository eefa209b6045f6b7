//! An in-memory [`Store`] for unit tests: the maps as BTreeMaps, so a real [`crate::sync::Syncer`]
//! programs them without BPF. Every write is logged (the apply order is what the syncer's tests
//! check), and backend inserts can be made to fail as on a full map.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use anyhow::Result;
use proxy_common::maps::{BackendV4, RevNatId, RevNatV4, ServiceKeyV4, ServiceValueV4, VipV4};
use proxy_common::maps_v6::{BackendV6, RevNatV6, ServiceKeyV6};

use crate::{bpf::Store, net::Cidr};

/// ServiceKeyV4 has no Ord: (vip, port, proto, scope, slot).
pub type ServiceKeyOrd = ([u8; 4], u16, u8, u8, u16);

pub fn ord(key: &ServiceKeyV4) -> ServiceKeyOrd {
    (key.vip, u16::from_be_bytes(key.port), key.proto, key.scope, key.slot)
}

#[derive(Clone, Default)]
pub struct MemStore {
    pub services: BTreeMap<ServiceKeyOrd, ServiceValueV4>,
    pub backends: BTreeMap<u32, BackendV4>,
    pub rev_nat: BTreeMap<RevNatId, RevNatV4>,
    pub names: BTreeMap<RevNatId, String>,
    pub vips: BTreeMap<[u8; 4], VipV4>,
    pub source_ranges: BTreeSet<(RevNatId, Cidr)>,
    /// MAGLEV_V4 entries written (index → backend id).
    pub maglev: BTreeMap<u32, u32>,
    /// The IPv6 maps: SERVICES_V6 by (vip, port, proto, scope, slot), BACKENDS_V6, REV_NAT_V6, VIPS_V6.
    pub services6: BTreeMap<([u8; 16], u16, u8, u8, u16), ServiceValueV4>,
    pub backends6: BTreeMap<u32, BackendV6>,
    pub rev_nat6: BTreeMap<RevNatId, RevNatV6>,
    pub vips6: BTreeMap<[u8; 16], VipV4>,
    pub log: Vec<String>,
    /// Refuse inserting new backends once this many exist.
    pub backend_capacity: Option<usize>,
}

fn ip(vip: [u8; 4]) -> Ipv4Addr {
    Ipv4Addr::from(vip)
}

impl Store for MemStore {
    fn read_services(&self) -> Result<Vec<(ServiceKeyV4, ServiceValueV4)>> {
        Ok(self
            .services
            .iter()
            .map(|((vip, port, proto, scope, slot), v)| {
                (ServiceKeyV4::new(*vip, port.to_be_bytes(), *proto, *scope, *slot), *v)
            })
            .collect())
    }
    fn read_backends(&self) -> Result<Vec<(u32, BackendV4)>> {
        Ok(self.backends.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn read_vips(&self) -> Result<Vec<([u8; 4], VipV4)>> {
        Ok(self.vips.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn read_name(&self, id: RevNatId) -> Option<String> {
        self.names.get(&id).cloned()
    }
    fn put_service(&mut self, key: ServiceKeyV4, value: ServiceValueV4) -> Result<()> {
        let (vip, port, _, _, slot) = ord(&key);
        self.log.push(format!("put slot {}:{port}#{slot}", ip(vip)));
        self.services.insert(ord(&key), value);
        Ok(())
    }
    fn del_service(&mut self, key: &ServiceKeyV4) -> Result<()> {
        let (vip, port, _, _, slot) = ord(key);
        if self.services.remove(&ord(key)).is_some() {
            self.log.push(format!("del slot {}:{port}#{slot}", ip(vip)));
        }
        Ok(())
    }
    fn put_backend(&mut self, id: u32, value: BackendV4) -> Result<()> {
        if !self.backends.contains_key(&id)
            && self.backend_capacity.is_some_and(|cap| self.backends.len() >= cap)
        {
            anyhow::bail!("the map is full");
        }
        self.log.push(format!("put backend {id} flags {}", value.flags));
        self.backends.insert(id, value);
        Ok(())
    }
    fn del_backend(&mut self, id: u32) -> Result<()> {
        self.log.push(format!("del backend {id}"));
        self.backends.remove(&id);
        Ok(())
    }
    fn put_rev_nat(&mut self, id: RevNatId, value: RevNatV4) -> Result<()> {
        self.log.push(format!("put revnat {id}"));
        self.rev_nat.insert(id, value);
        Ok(())
    }
    fn del_rev_nat(&mut self, id: RevNatId) -> Result<()> {
        self.log.push(format!("del revnat {id}"));
        self.rev_nat.remove(&id);
        Ok(())
    }
    fn put_name(&mut self, id: RevNatId, name: &str) -> Result<()> {
        self.names.insert(id, name.to_owned());
        Ok(())
    }
    fn del_name(&mut self, id: RevNatId) -> Result<()> {
        self.names.remove(&id);
        Ok(())
    }
    fn put_vip(&mut self, vip: [u8; 4], value: VipV4) -> Result<()> {
        self.log.push(format!("put vip {} {}", ip(vip), value.frontends));
        self.vips.insert(vip, value);
        Ok(())
    }
    fn del_vip(&mut self, vip: [u8; 4]) -> Result<()> {
        self.log.push(format!("del vip {}", ip(vip)));
        self.vips.remove(&vip);
        Ok(())
    }
    fn read_source_ranges(&self) -> Result<Vec<(RevNatId, Cidr)>> {
        Ok(self.source_ranges.iter().copied().collect())
    }
    fn put_source_range(&mut self, rev_nat_id: RevNatId, range: Cidr) -> Result<()> {
        self.source_ranges.insert((rev_nat_id, range));
        Ok(())
    }
    fn del_source_range(&mut self, rev_nat_id: RevNatId, range: Cidr) -> Result<()> {
        self.source_ranges.remove(&(rev_nat_id, range));
        Ok(())
    }
    fn put_maglev(&mut self, index: u32, backend_id: u32) -> Result<()> {
        self.maglev.insert(index, backend_id);
        Ok(())
    }
    fn read_services6(&self) -> Result<Vec<(ServiceKeyV6, ServiceValueV4)>> {
        Ok(self
            .services6
            .iter()
            .map(|((vip, port, proto, scope, slot), v)| {
                (ServiceKeyV6::new(*vip, port.to_be_bytes(), *proto, *scope, *slot), *v)
            })
            .collect())
    }
    fn read_backends6(&self) -> Result<Vec<(u32, BackendV6)>> {
        Ok(self.backends6.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn read_vips6(&self) -> Result<Vec<([u8; 16], VipV4)>> {
        Ok(self.vips6.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_service6(&mut self, key: ServiceKeyV6, value: ServiceValueV4) -> Result<()> {
        let port = u16::from_be_bytes(key.port);
        self.log.push(format!("put slot [{}]:{port}#{}", std::net::Ipv6Addr::from(key.vip), key.slot));
        self.services6.insert((key.vip, port, key.proto, key.scope, key.slot), value);
        Ok(())
    }
    fn del_service6(&mut self, key: &ServiceKeyV6) -> Result<()> {
        let port = u16::from_be_bytes(key.port);
        if self.services6.remove(&(key.vip, port, key.proto, key.scope, key.slot)).is_some() {
            self.log.push(format!("del slot [{}]:{port}#{}", std::net::Ipv6Addr::from(key.vip), key.slot));
        }
        Ok(())
    }
    fn put_backend6(&mut self, id: u32, value: BackendV6) -> Result<()> {
        self.log.push(format!("put backend6 {id} flags {}", value.flags));
        self.backends6.insert(id, value);
        Ok(())
    }
    fn del_backend6(&mut self, id: u32) -> Result<()> {
        self.log.push(format!("del backend6 {id}"));
        self.backends6.remove(&id);
        Ok(())
    }
    fn put_rev_nat6(&mut self, id: RevNatId, value: RevNatV6) -> Result<()> {
        self.log.push(format!("put revnat6 {id}"));
        self.rev_nat6.insert(id, value);
        Ok(())
    }
    fn del_rev_nat6(&mut self, id: RevNatId) -> Result<()> {
        self.log.push(format!("del revnat6 {id}"));
        self.rev_nat6.remove(&id);
        Ok(())
    }
    fn put_vip6(&mut self, vip: [u8; 16], value: VipV4) -> Result<()> {
        self.log.push(format!("put vip [{}] {}", std::net::Ipv6Addr::from(vip), value.frontends));
        self.vips6.insert(vip, value);
        Ok(())
    }
    fn del_vip6(&mut self, vip: [u8; 16]) -> Result<()> {
        self.log.push(format!("del vip [{}]", std::net::Ipv6Addr::from(vip)));
        self.vips6.remove(&vip);
        Ok(())
    }
}
