//! SERVICE_CIDRS_V4: the one entry holding the service CIDRs the datapath drops unallocated addresses of
//! (the agent writes it at every sync; `kproxy dump` and `dump diff` read it).

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use proxy_common::service_cidr::{ServiceCidrV4, ServiceCidrsV4};

use crate::net::Cidr4;

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
    }
}
