//! `kproxy conntrack flush [--service ns/name]`.

use std::collections::BTreeSet;

use anyhow::Result;
use proxy_common::{
    maps::{CtEntryV4, CtKeyV4, RevNatId},
    maps_v6::{CtEntryV6, CtKeyV6},
};

use crate::bpf::{
    Maps,
    conntrack::{
        Snat6Index, SnatIndex, delete, delete6_flows, hairpin_addr, read_config, read_conntrack,
        read_conntrack6, reply_key6, select, select_pairs, snat_index, snat6_index,
    },
};

/// The entries `kproxy conntrack flush` deletes: all of them, or those of the
/// flows of the given frontends (by rev-NAT id), both directions.
pub fn plan_flush(
    entries: &[(CtKeyV4, CtEntryV4)],
    rev_nat_ids: Option<&BTreeSet<RevNatId>>,
    hairpin_addr: [u8; 4],
    snat: &SnatIndex,
) -> Vec<CtKeyV4> {
    match rev_nat_ids {
        None => entries.iter().map(|(k, _)| *k).collect(),
        Some(ids) => select(entries, hairpin_addr, snat, |_, entry| ids.contains(&entry.rev_nat_id)),
    }
}

/// [`plan_flush`] for CONNTRACK_V6. Rev-NAT ids are shared between the families, so the ids of a
/// Service's frontends select its flows of both.
pub fn plan_flush6(
    entries: &[(CtKeyV6, CtEntryV6)],
    rev_nat_ids: Option<&BTreeSet<RevNatId>>,
    snat6: &Snat6Index,
) -> Vec<CtKeyV6> {
    match rev_nat_ids {
        None => entries.iter().map(|(k, _)| *k).collect(),
        Some(ids) => {
            select_pairs(entries, |k, e| reply_key6(k, e, snat6), |_, entry| ids.contains(&entry.rev_nat_id))
        }
    }
}

/// The rev-NAT ids of a Service's frontends, from FRONTEND_NAMES_V4 entries
/// (`"namespace/name:port"`; the port name may be empty). `service` is
/// `namespace/name`.
pub fn service_rev_nat_ids<'a>(
    names: impl IntoIterator<Item = (RevNatId, &'a str)>,
    service: &str,
) -> BTreeSet<RevNatId> {
    names
        .into_iter()
        .filter(|(_, name)| name.rsplit_once(':').map_or(*name, |(svc, _)| svc) == service)
        .map(|(id, _)| id)
        .collect()
}

/// `kproxy conntrack flush [--service ns/name]`: deletes every conntrack
/// entry of both families, or those of the Service's frontends. Returns the number deleted.
pub fn flush(maps: &mut Maps, service: Option<&str>) -> Result<u64> {
    let hairpin = hairpin_addr(&read_config(maps));
    let ids = match service {
        None => None,
        Some(service) => {
            let names: Vec<(RevNatId, String)> =
                maps.names.iter().filter_map(|e| e.ok()).map(|(id, n)| (id, n.as_str().to_owned())).collect();
            let ids = service_rev_nat_ids(names.iter().map(|(id, n)| (*id, n.as_str())), service);
            if ids.is_empty() {
                anyhow::bail!("no frontend of Service {service} is programmed (expected namespace/name)");
            }
            Some(ids)
        }
    };
    let entries = read_conntrack(maps)?;
    let mut deleted = 0;
    for key in plan_flush(&entries, ids.as_ref(), hairpin, &snat_index(maps)) {
        deleted += u64::from(delete(maps, &key)?);
    }
    let entries6 = read_conntrack6(maps)?;
    let snat6 = snat6_index(maps);
    let keys6 = plan_flush6(&entries6, ids.as_ref(), &snat6);
    deleted += delete6_flows(maps, &entries6, &keys6, &snat6)?;
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::conntrack::NO_SNAT;
    use crate::testutil::conntrack::*;
    use proxy_common::conntrack::CtState;
    use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP};

    #[test]
    fn flush_all_or_by_service() {
        let a = flow(CLIENT, 5000, IPPROTO_UDP, CtState::Open, 0, 0);
        let mut b = flow(CLIENT, 5001, IPPROTO_TCP, CtState::Established, 0, 0);
        b[0].1.rev_nat_id = 4;
        b[1].1.rev_nat_id = 4;
        let entries = [a[0], a[1], b[0], b[1]];
        assert_eq!(plan_flush(&entries, None, HAIRPIN, &NO_SNAT).len(), 4);
        assert_eq!(plan_flush(&entries, Some(&[4].into()), HAIRPIN, &NO_SNAT), vec![b[0].0, b[1].0]);
        assert!(plan_flush(&entries, Some(&BTreeSet::new()), HAIRPIN, &NO_SNAT).is_empty());

        let names = [
            (3, "kube-system/kube-dns:dns"),
            (4, "kube-system/kube-dns:dns-tcp"),
            (5, "kube-system/kube-dns-upstream:dns"),
            (6, "default/web:"),
            (7, "kube-system/kube-dns:metrics"),
        ];
        assert_eq!(service_rev_nat_ids(names, "kube-system/kube-dns"), [3, 4, 7].into());
        assert_eq!(service_rev_nat_ids(names, "default/web"), [6].into());
        assert!(service_rev_nat_ids(names, "kube-dns").is_empty());
    }

    #[test]
    fn ipv6_flows_are_flushed_all_or_by_service_both_directions() {
        let a = flow6(5000, IPPROTO_UDP, 3);
        let b = flow6(5001, IPPROTO_TCP, 4);
        // An orphan reply of Service 4 (its forward entry was evicted).
        let [_, orphan] = flow6(5002, IPPROTO_UDP, 4);
        let entries = [a[0], a[1], b[0], b[1], orphan];
        assert_eq!(plan_flush6(&entries, None, &Snat6Index::new()).len(), 5);
        assert_eq!(
            plan_flush6(&entries, Some(&[4].into()), &Snat6Index::new()),
            vec![b[0].0, b[1].0, orphan.0]
        );
        assert_eq!(plan_flush6(&entries, Some(&[3].into()), &Snat6Index::new()), vec![a[0].0, a[1].0]);
        assert!(plan_flush6(&entries, Some(&BTreeSet::new()), &Snat6Index::new()).is_empty());
    }
}
