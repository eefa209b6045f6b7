//! The service CIDRs: the ranges whose addresses that are no Service's cluster IP are dropped, as
//! kube-proxy's nftables mode drops them (`pkg/proxy/nftables/proxier.go`: the `cluster-ips-check`
//! chain, "Drop traffic to unallocated ClusterIPs"). kube-proxy takes them from the ServiceCIDR
//! objects (`pkg/proxy/config` `ServiceCIDRConfig`: the set of every object's `spec.cidrs`, of its
//! own IP family); kproxy also from `--service-cidr`, which kube-proxy does not have. None known:
//! nothing is dropped.

use std::collections::BTreeSet;

use k8s_openapi::api::networking::v1::ServiceCIDR;
use proxy_common::service_cidr::SERVICE_CIDRS_MAX;

use crate::k8s::manifest::{ManifestError, Sourced};
use crate::net::{Cidr, Cidr4, Cidr6};

/// The service CIDRs to program, and what was left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceCidrs {
    /// Sorted, without duplicates; at most [`SERVICE_CIDRS_MAX`] (SERVICE_CIDRS_V4).
    pub ipv4: Vec<Cidr4>,
    /// The same for IPv6 (SERVICE_CIDRS_V6).
    pub ipv6: Vec<Cidr6>,
    /// Ranges beyond [`SERVICE_CIDRS_MAX`] of their family: not dropped.
    pub overflow: Vec<Cidr>,
}

/// The union of `flag` (`--service-cidr`) and every object's `spec.cidrs`, of both families. An entry
/// that is no CIDR is reported with the object (or the flag) naming it, and skipped.
pub fn resolve<S: std::borrow::Borrow<Sourced<ServiceCIDR>>>(
    flag: &[Cidr],
    objects: &[S],
) -> (ServiceCidrs, Vec<ManifestError>) {
    let mut all: BTreeSet<Cidr> = flag.iter().copied().collect();
    let mut errors = Vec::new();
    for sourced in objects {
        let sourced = sourced.borrow();
        let name = sourced.object.metadata.name.as_deref().unwrap_or_default();
        let cidrs = sourced.object.spec.as_ref().and_then(|spec| spec.cidrs.as_ref());
        for (i, text) in cidrs.into_iter().flatten().enumerate() {
            match range(text.trim()) {
                Some(cidr) => {
                    all.insert(cidr);
                }
                None => errors.push(
                    ManifestError::new(&sourced.origin, format!("{:?} is not a CIDR; ignored", text.trim()))
                        .with_object(format!("ServiceCIDR {name}"))
                        .with_field(format!("spec.cidrs[{i}]")),
                ),
            }
        }
    }
    let mut cidrs = ServiceCidrs::default();
    for cidr in all {
        match cidr {
            Cidr::V4(v4) if cidrs.ipv4.len() < SERVICE_CIDRS_MAX => cidrs.ipv4.push(v4),
            Cidr::V6(v6) if cidrs.ipv6.len() < SERVICE_CIDRS_MAX => cidrs.ipv6.push(v6),
            _ => cidrs.overflow.push(cidr),
        }
    }
    (cidrs, errors)
}

/// A range in CIDR notation (`addr/len`: a bare address is no range).
fn range(text: &str) -> Option<Cidr> {
    if !text.contains('/') {
        return None;
    }
    text.parse::<Cidr>().ok()
}

/// `--service-cidr`: CIDRs of either family, comma-separated.
pub fn parse_flag(values: &[String]) -> Result<Vec<Cidr>, String> {
    values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|value| range(value).ok_or_else(|| format!("{value:?} is not a CIDR (address/length)")))
        .collect()
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

    fn cidr6(text: &str) -> Cidr6 {
        match text.parse::<Cidr>().unwrap() {
            Cidr::V6(v6) => v6,
            Cidr::V4(_) => panic!("{text} is IPv4"),
        }
    }

    #[test]
    fn every_object_and_the_flag_add_their_ranges_once_per_family() {
        let objects = [
            object("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]),
            object("extra", &["10.100.0.0/24", "10.96.0.0/16", "fd00:10:96::/112"]),
        ];
        let flag = ["172.30.0.0/16".parse().unwrap(), "fd00:30::/108".parse().unwrap()];
        let (cidrs, errors) = resolve(&flag, &objects);
        assert_eq!(errors, []);
        assert_eq!(cidrs.ipv4, [cidr("10.96.0.0/16"), cidr("10.100.0.0/24"), cidr("172.30.0.0/16")]);
        assert_eq!(cidrs.ipv6, [cidr6("fd00:10:96::/112"), cidr6("fd00:30::/108")]);
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
        assert_eq!(cidrs.overflow, [Cidr::V4(cidr("10.8.0.0/16")), Cidr::V4(cidr("10.9.0.0/16"))]);
    }

    #[test]
    fn the_flag_takes_cidrs_of_both_families() {
        let values = ["10.96.0.0/12,fd00::/108".to_owned(), " 10.200.0.0/24".to_owned()];
        assert_eq!(
            parse_flag(&values),
            Ok(vec![
                Cidr::V4(cidr("10.96.0.0/12")),
                Cidr::V6(cidr6("fd00::/108")),
                Cidr::V4(cidr("10.200.0.0/24"))
            ])
        );
        assert!(parse_flag(&["10.96.0.1".to_owned()]).is_err(), "an address is no range");
        assert!(parse_flag(&["10.96.0.0/33".to_owned()]).is_err());
        assert!(parse_flag(&["fd00::/200".to_owned()]).is_err());
    }
}
