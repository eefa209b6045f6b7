//! The service CIDRs: the ranges whose addresses that are no Service's cluster IP are dropped, as
//! kube-proxy's nftables mode drops them (`pkg/proxy/nftables/proxier.go`: the `cluster-ips-check`
//! chain, "Drop traffic to unallocated ClusterIPs"). kube-proxy takes them from the ServiceCIDR
//! objects (`pkg/proxy/config` `ServiceCIDRConfig`: the set of every object's `spec.cidrs`, of its
//! own IP family); kproxy also from `--service-cidr`, which kube-proxy does not have. None known:
//! nothing is dropped.

use std::collections::BTreeSet;
use std::net::Ipv6Addr;

use k8s_openapi::api::networking::v1::ServiceCIDR;
use proxy_common::service_cidr::SERVICE_CIDRS_MAX;

use crate::k8s::manifest::{ManifestError, Sourced};
use crate::net::Cidr4;

/// The service CIDRs to program, and what was left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceCidrs {
    /// Sorted, without duplicates; at most [`SERVICE_CIDRS_MAX`].
    pub ipv4: Vec<Cidr4>,
    /// IPv6 ranges, sorted: kproxy serves IPv4 only (the agent warns once).
    pub ignored_ipv6: Vec<String>,
    /// IPv4 ranges beyond [`SERVICE_CIDRS_MAX`]: not dropped.
    pub overflow: Vec<Cidr4>,
}

/// The union of `flag` (`--service-cidr`) and every object's `spec.cidrs`. An entry that is no CIDR is
/// reported with the object (or the flag) naming it, and skipped.
pub fn resolve<S: std::borrow::Borrow<Sourced<ServiceCIDR>>>(
    flag: &[Cidr4],
    objects: &[S],
) -> (ServiceCidrs, Vec<ManifestError>) {
    let mut ipv4: BTreeSet<Cidr4> = flag.iter().copied().collect();
    let mut ipv6 = BTreeSet::new();
    let mut errors = Vec::new();
    for sourced in objects {
        let sourced = sourced.borrow();
        let name = sourced.object.metadata.name.as_deref().unwrap_or_default();
        let cidrs = sourced.object.spec.as_ref().and_then(|spec| spec.cidrs.as_ref());
        for (i, text) in cidrs.into_iter().flatten().enumerate() {
            let text = text.trim();
            if text.contains(':') {
                if is_cidr6(text) {
                    ipv6.insert(text.to_owned());
                    continue;
                }
            } else if let Ok(cidr) = text.parse::<Cidr4>()
                && text.contains('/')
            {
                ipv4.insert(cidr);
                continue;
            }
            errors.push(
                ManifestError::new(&sourced.origin, format!("{text:?} is not a CIDR; ignored"))
                    .with_object(format!("ServiceCIDR {name}"))
                    .with_field(format!("spec.cidrs[{i}]")),
            );
        }
    }
    let mut ipv4: Vec<Cidr4> = ipv4.into_iter().collect();
    let overflow = ipv4.split_off(ipv4.len().min(SERVICE_CIDRS_MAX));
    (ServiceCidrs { ipv4, ignored_ipv6: ipv6.into_iter().collect(), overflow }, errors)
}

fn is_cidr6(text: &str) -> bool {
    text.split_once('/').is_some_and(|(addr, len)| {
        addr.parse::<Ipv6Addr>().is_ok() && len.parse::<u8>().is_ok_and(|len| len <= 128)
    })
}

/// `--service-cidr`: IPv4 CIDRs, comma-separated; IPv6 ones are returned apart (kproxy ignores them).
pub fn parse_flag(values: &[String]) -> Result<(Vec<Cidr4>, Vec<String>), String> {
    let mut ipv4 = Vec::new();
    let mut ipv6 = Vec::new();
    for value in values.iter().flat_map(|v| v.split(',')).map(str::trim).filter(|v| !v.is_empty()) {
        if value.contains(':') {
            if !is_cidr6(value) {
                return Err(format!("{value:?} is not a CIDR"));
            }
            ipv6.push(value.to_owned());
        } else if !value.contains('/') {
            return Err(format!("{value:?} is not a CIDR (a.b.c.d/len)"));
        } else {
            ipv4.push(value.parse::<Cidr4>()?);
        }
    }
    Ok((ipv4, ipv6))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str, cidrs: &[&str]) -> Sourced<ServiceCIDR> {
        let json = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": name},
            "spec": {"cidrs": cidrs},
        });
        Sourced { origin: format!("test {name}"), object: serde_json::from_value(json).unwrap() }
    }

    fn cidr(text: &str) -> Cidr4 {
        text.parse().unwrap()
    }

    #[test]
    fn every_object_and_the_flag_add_their_ranges_once_and_ipv6_is_set_apart() {
        let objects = [
            object("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]),
            object("extra", &["10.100.0.0/24", "10.96.0.0/16"]),
        ];
        let (cidrs, errors) = resolve(&[cidr("172.30.0.0/16")], &objects);
        assert_eq!(errors, []);
        assert_eq!(cidrs.ipv4, [cidr("10.96.0.0/16"), cidr("10.100.0.0/24"), cidr("172.30.0.0/16")]);
        assert_eq!(cidrs.ignored_ipv6, ["fd00:10:96::/112"]);
        assert_eq!(cidrs.overflow, []);
    }

    #[test]
    fn nothing_known_means_nothing_to_drop() {
        let (cidrs, errors) = resolve::<Sourced<ServiceCIDR>>(&[], &[]);
        assert_eq!((cidrs, errors), (ServiceCidrs::default(), vec![]));
        let (cidrs, _) = resolve(&[], &[object("empty", &[])]);
        assert!(cidrs.ipv4.is_empty());
    }

    #[test]
    fn a_bad_entry_is_named_and_skipped_and_ranges_beyond_eight_are_left_out() {
        let (cidrs, errors) = resolve(&[], &[object("bad", &["10.96.0.0/16", "10.97.0.1", "nonsense/8"])]);
        assert_eq!(cidrs.ipv4, [cidr("10.96.0.0/16")]);
        let shown: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "test bad: ServiceCIDR bad: spec.cidrs[1]: \"10.97.0.1\" is not a CIDR; ignored",
                "test bad: ServiceCIDR bad: spec.cidrs[2]: \"nonsense/8\" is not a CIDR; ignored",
            ]
        );
        let many: Vec<String> = (0..10).map(|i| format!("10.{i}.0.0/16")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let (cidrs, _) = resolve(&[], &[object("many", &many)]);
        assert_eq!(cidrs.ipv4.len(), SERVICE_CIDRS_MAX);
        assert_eq!(cidrs.overflow, [cidr("10.8.0.0/16"), cidr("10.9.0.0/16")]);
    }

    #[test]
    fn the_flag_takes_ipv4_cidrs_and_sets_ipv6_apart() {
        let values = ["10.96.0.0/12,fd00::/108".to_owned(), " 10.200.0.0/24".to_owned()];
        assert_eq!(
            parse_flag(&values),
            Ok((vec![cidr("10.96.0.0/12"), cidr("10.200.0.0/24")], vec!["fd00::/108".to_owned()]))
        );
        assert!(parse_flag(&["10.96.0.1".to_owned()]).is_err(), "an address is no range");
        assert!(parse_flag(&["10.96.0.0/33".to_owned()]).is_err());
        assert!(parse_flag(&["fd00::/200".to_owned()]).is_err());
    }
}
