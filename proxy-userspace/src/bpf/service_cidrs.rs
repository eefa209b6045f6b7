//! SERVICE_CIDRS_V4 and SERVICE_CIDRS_V6: the one entry of each holding the service CIDRs of its family the
//! datapath drops unallocated addresses of (the agent writes them at every sync; `kproxy dump` and `dump diff`
//! read them).

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use proxy_common::service_cidr::{ServiceCidrV4, ServiceCidrV6, ServiceCidrsV4, ServiceCidrsV6};

use crate::net::{Cidr, Cidr4, Cidr6};

/// The map's value for `cidrs` (the first [`proxy_common::service_cidr::SERVICE_CIDRS_MAX`]).
pub fn value_of(cidrs: &[Cidr4]) -> ServiceCidrsV4 {
    let prefixes: Vec<ServiceCidrV4> =
        cidrs.iter().map(|c| ServiceCidrV4::new(c.addr.octets(), c.prefix_len)).collect();
    ServiceCidrsV4::from_prefixes(&prefixes)
}

/// What the map holds, as prefixes.
pub fn cidrs_of(value: &ServiceCidrsV4) -> Vec<Cidr4> {
    value
        .prefixes()
        .iter()
        .filter_map(|p| Cidr4::new(std::net::Ipv4Addr::from(p.addr), p.prefix_len()))
        .collect()
}

/// Writes `cidrs` as the map's one entry (a single update: a packet sees the old set or the new one).
pub fn write(map: &mut Array<MapData, ServiceCidrsV4>, cidrs: &[Cidr4]) -> Result<()> {
    map.set(0, value_of(cidrs), 0).context("writing SERVICE_CIDRS_V4")
}

/// The service CIDRs the map holds.
pub fn read(map: &Array<MapData, ServiceCidrsV4>) -> Result<Vec<Cidr4>> {
    Ok(cidrs_of(&map.get(&0, 0).context("reading SERVICE_CIDRS_V4")?))
}

/// SERVICE_CIDRS_V6's value for `cidrs`, as [`value_of`].
pub fn value_of6(cidrs: &[Cidr6]) -> ServiceCidrsV6 {
    let prefixes: Vec<ServiceCidrV6> =
        cidrs.iter().map(|c| ServiceCidrV6::new(c.addr.octets(), c.prefix_len)).collect();
    ServiceCidrsV6::from_prefixes(&prefixes)
}

/// What SERVICE_CIDRS_V6 holds, as prefixes.
pub fn cidrs_of6(value: &ServiceCidrsV6) -> Vec<Cidr6> {
    value
        .prefixes()
        .iter()
        .filter_map(|p| Cidr6::new(std::net::Ipv6Addr::from(p.addr_bytes()), p.prefix_len()))
        .collect()
}

pub fn write6(map: &mut Array<MapData, ServiceCidrsV6>, cidrs: &[Cidr6]) -> Result<()> {
    map.set(0, value_of6(cidrs), 0).context("writing SERVICE_CIDRS_V6")
}

pub fn read6(map: &Array<MapData, ServiceCidrsV6>) -> Result<Vec<Cidr6>> {
    Ok(cidrs_of6(&map.get(&0, 0).context("reading SERVICE_CIDRS_V6")?))
}

/// Both maps' ranges, IPv4 first.
pub fn read_both(maps: &super::Maps) -> Result<Vec<Cidr>> {
    let v4 = read(&maps.service_cidrs)?.into_iter().map(Cidr::V4);
    Ok(v4.chain(read6(&maps.service_cidrs_v6)?.into_iter().map(Cidr::V6)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_value_holds_the_prefixes_and_reads_back_the_same() {
        let cidrs: Vec<Cidr4> = vec!["10.96.0.0/16".parse().unwrap(), "192.0.2.0/24".parse().unwrap()];
        let value = value_of(&cidrs);
        assert_eq!(value.count, 2);
        assert!(value.contains([10, 96, 3, 4]));
        assert!(!value.contains([10, 97, 3, 4]));
        assert_eq!(cidrs_of(&value), cidrs);
        assert_eq!(cidrs_of(&value_of(&[])), []);
        let cidrs6: Vec<Cidr6> = vec![Cidr6::new("fd00:10:96::".parse().unwrap(), 112).unwrap()];
        let value = value_of6(&cidrs6);
        assert!(value.contains(&"fd00:10:96::ff".parse::<std::net::Ipv6Addr>().unwrap().octets()));
        assert_eq!(cidrs_of6(&value), cidrs6);
    }
}
