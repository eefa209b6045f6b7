//! A parser of the text format for the tests of every family, and the tests of the whole page.

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use super::kproxy::*;
use super::kube_proxy::*;
use super::process::*;
use super::*;

/// (name, labels, value)
pub(super) type Sample = (String, Vec<(String, String)>, String);

/// One parsed exposition: families in order with HELP/TYPE, and samples.
#[derive(Debug, Default)]
pub(super) struct Exposition {
    pub(super) help: BTreeMap<String, String>,
    pub(super) types: BTreeMap<String, String>,
    /// (name, labels, value) in order of appearance.
    pub(super) samples: Vec<Sample>,
}

impl Exposition {
    pub(super) fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<&str> {
        self.samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && l.iter().zip(labels).all(|((k, v), (k2, v2))| k == k2 && v == v2)
            })
            .map(|(_, _, v)| v.as_str())
    }
}

/// A strict-enough parser of the text format: every sample must belong to
/// a family whose HELP and TYPE were seen before it.
pub(super) fn parse(text: &str) -> Exposition {
    let mut exp = Exposition::default();
    assert!(text.ends_with('\n'), "exposition must end with a newline");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP text");
            assert!(exp.help.insert(name.into(), help.into()).is_none(), "dup HELP {name}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE kind");
            assert!(exp.help.contains_key(name), "TYPE before HELP for {name}");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "bad type {kind}");
            assert!(exp.types.insert(name.into(), kind.into()).is_none(), "dup TYPE {name}");
        } else {
            assert!(!line.starts_with('#') && !line.is_empty(), "bad line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect("sample value");
            let (name, labels) = match series.split_once('{') {
                None => (series.to_owned(), Vec::new()),
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    (name.to_owned(), parse_labels(body))
                }
            };
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    let base = name.strip_suffix(suffix)?;
                    (exp.types.get(base).map(String::as_str) == Some("histogram")).then(|| base.to_owned())
                })
                .unwrap_or_else(|| name.clone());
            assert!(exp.types.contains_key(&family), "sample {name} without TYPE");
            value
                .parse::<f64>()
                .or_else(|e| match value {
                    "+Inf" | "-Inf" | "NaN" => Ok(0.0),
                    _ => Err(e),
                })
                .unwrap_or_else(|_| panic!("bad value {value:?}"));
            exp.samples.push((name, labels, value.to_owned()));
        }
    }
    exp
}

/// `k="v",k2="v2"` with the text format's escapes.
fn parse_labels(body: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "label value must be quoted");
        let mut value = String::new();
        loop {
            match chars.next().expect("unterminated label value") {
                '"' => break,
                '\\' => match chars.next().expect("escape") {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    other => panic!("bad escape \\{other}"),
                },
                c => value.push(c),
            }
        }
        labels.push((key, value));
        match chars.next() {
            None => break,
            Some(',') => {}
            Some(other) => panic!("unexpected {other:?} after label"),
        }
    }
    labels
}

#[test]
fn empty_metrics_render_every_family() {
    let exp = parse(&Metrics::new().render());
    for (name, kind) in [
        (SYNC_DURATION, "histogram"),
        (NETWORK_PROGRAMMING, "histogram"),
        (LAST_SYNC_TIMESTAMP, "gauge"),
        (LAST_QUEUED_TIMESTAMP, "gauge"),
        (ENDPOINT_CHANGES_PENDING, "gauge"),
        (ENDPOINT_CHANGES_TOTAL, "counter"),
        (SERVICE_CHANGES_PENDING, "gauge"),
        (SERVICE_CHANGES_TOTAL, "counter"),
        (MAP_ENTRIES, "gauge"),
        (MAP_CAPACITY, "gauge"),
        (DATAPATH_PACKETS, "counter"),
        (SYNC_ERRORS, "counter"),
        (FRONTENDS, "gauge"),
        (BACKENDS, "gauge"),
        (CT_GC_RUNS, "counter"),
        (CT_GC_DELETED, "counter"),
        (CT_GC_INTERVAL, "gauge"),
        (CT_PURGED, "counter"),
        (INHERITED_OPEN, "gauge"),
        (CT_CREATED, "counter"),
        (CT_EVICTED, "counter"),
        (AFFINITY_GC_DELETED, "counter"),
        (SYNC_FULL_DURATION, "histogram"),
        (SYNC_PARTIAL_DURATION, "histogram"),
        (NO_LOCAL_ENDPOINTS, "gauge"),
        (TOPOLOGY_PORTS, "gauge"),
        (HEALTHZ_TOTAL, "counter"),
        (LIVEZ_TOTAL, "counter"),
        (CT_RECONCILER_DURATION, "histogram"),
        (CT_RECONCILER_DELETED, "counter"),
        (BUILD_INFO, "gauge"),
        (PROCESS_CPU, "counter"),
        (PROCESS_RESIDENT, "gauge"),
        (PROCESS_VIRTUAL, "gauge"),
        (PROCESS_VIRTUAL_MAX, "gauge"),
        (PROCESS_START, "gauge"),
        (PROCESS_OPEN_FDS, "gauge"),
        (PROCESS_MAX_FDS, "gauge"),
    ] {
        assert_eq!(exp.types.get(name).map(String::as_str), Some(kind), "{name}");
    }
    let v4 = [("ip_family", "IPv4")];
    // kube-proxy's per-family series in both families (kproxy serves both; kube-proxy runs a proxier
    // per family on any node that supports both).
    for family in ["IPv4", "IPv6"] {
        let of_family = |name: &str| -> Vec<&str> {
            exp.samples
                .iter()
                .filter(|(n, labels, _)| n == &format!("{name}_bucket") && labels[0].1 == family)
                .map(|(_, labels, _)| labels[1].1.as_str())
                .collect()
        };
        for name in [SYNC_DURATION, SYNC_FULL_DURATION, SYNC_PARTIAL_DURATION, CT_RECONCILER_DURATION] {
            let buckets = of_family(name);
            assert_eq!(buckets.len(), 16, "{name} {family}");
            assert_eq!((buckets[0], buckets[14], buckets[15]), ("0.001", "16.384", "+Inf"), "{name}");
            assert_eq!(exp.value(&format!("{name}_count"), &[("ip_family", family)]), Some("0"), "{name}");
        }
        assert_eq!(of_family(NETWORK_PROGRAMMING).len(), 81, "{family}");
        assert_eq!(exp.value(LAST_SYNC_TIMESTAMP, &[("ip_family", family)]), Some("0"));
        for policy in ["internal", "external"] {
            assert_eq!(
                exp.value(NO_LOCAL_ENDPOINTS, &[("ip_family", family), ("traffic_policy", policy)]),
                Some("0")
            );
        }
        assert_eq!(exp.value(CT_RECONCILER_DELETED, &[("ip_family", family)]), Some("0"));
        for topology in ["PreferSameZone", "PreferSameNode"] {
            assert_eq!(
                exp.value(TOPOLOGY_PORTS, &[("ip_family", family), ("topology", topology)]),
                Some("0")
            );
        }
    }
    let np_buckets =
        exp.samples.iter().filter(|(n, _, _)| n == &format!("{NETWORK_PROGRAMMING}_bucket")).count();
    assert_eq!(np_buckets, 2 * 81, "one set per family, nothing else");
    assert_eq!(exp.value(LAST_SYNC_TIMESTAMP, &v4), Some("0"));
    assert_eq!(
        exp.value(BUILD_INFO, &[("commit", BUILD_COMMIT), ("version", env!("CARGO_PKG_VERSION"))]),
        Some("1")
    );
    assert!(!BUILD_COMMIT.is_empty());
    // Families without ip_family in kube-proxy 1.34 have none here either.
    assert_eq!(exp.value(ENDPOINT_CHANGES_TOTAL, &[]), Some("0"));
    assert_eq!(exp.value(SERVICE_CHANGES_PENDING, &[]), Some("0"));
}

#[test]
fn rendered_text_reflects_updates() {
    let m = Metrics::new();
    let finished = UNIX_EPOCH + Duration::from_millis(1_700_000_000_500);
    m.observe_sync(Duration::from_millis(3), finished, true);
    m.observe_sync(Duration::from_millis(20), finished, false);
    m.observe_sync(Duration::from_secs(60), finished, false);
    m.observe_network_programming(Duration::from_millis(700));
    m.observe_network_programming(Duration::from_secs(400));
    m.queued(1, 4, UNIX_EPOCH + Duration::from_secs(1_700_000_100));
    m.add_changes(3, 2);
    m.add_changes(2, 0);
    m.inc_sync_errors(1);
    m.inc_sync_errors(2);
    m.set_map_usage("services", 10, 65536);
    m.set_map_usage("odd\"name\\x", 1, 2);
    m.set_map_usage("services", 12, 65536);
    m.set_map_usage("conntrack_v6", 8, 262144);
    m.set_datapath_counters(&[("forwarded", 100), ("no_backend", 3)]);
    m.set_datapath_counters(&[("forwarded", 150)]);
    m.set_programmed(7, 21);

    let text = m.render();
    let exp = parse(&text);

    // Sync duration: 3 ms lands in le=0.004, 20 ms in le=0.032, 60 s only in +Inf.
    let v4 = [("ip_family", "IPv4")];
    let bucket =
        |name: &str, le: &str| exp.value(&format!("{name}_bucket"), &[("ip_family", "IPv4"), ("le", le)]);
    assert_eq!(bucket(SYNC_DURATION, "0.002"), Some("0"));
    assert_eq!(bucket(SYNC_DURATION, "0.004"), Some("1"));
    assert_eq!(bucket(SYNC_DURATION, "0.016"), Some("1"));
    assert_eq!(bucket(SYNC_DURATION, "0.032"), Some("2"));
    assert_eq!(bucket(SYNC_DURATION, "16.384"), Some("2"));
    assert_eq!(bucket(SYNC_DURATION, "+Inf"), Some("3"));
    assert_eq!(exp.value(&format!("{SYNC_DURATION}_count"), &v4), Some("3"));
    let sum: f64 = exp.value(&format!("{SYNC_DURATION}_sum"), &v4).unwrap().parse().unwrap();
    assert!((sum - 60.023).abs() < 1e-9, "{sum}");
    // The first sync was full, the other two partial; each is also in the overall histogram.
    assert_eq!(bucket(SYNC_FULL_DURATION, "0.004"), Some("1"));
    assert_eq!(exp.value(&format!("{SYNC_FULL_DURATION}_count"), &v4), Some("1"));
    assert_eq!(bucket(SYNC_PARTIAL_DURATION, "0.004"), Some("0"));
    assert_eq!(bucket(SYNC_PARTIAL_DURATION, "0.032"), Some("1"));
    assert_eq!(bucket(SYNC_PARTIAL_DURATION, "+Inf"), Some("2"));
    assert_eq!(exp.value(&format!("{SYNC_PARTIAL_DURATION}_count"), &v4), Some("2"));

    assert_eq!(bucket(NETWORK_PROGRAMMING, "0.5"), Some("0"));
    assert_eq!(bucket(NETWORK_PROGRAMMING, "1"), Some("1"));
    assert_eq!(bucket(NETWORK_PROGRAMMING, "300"), Some("1"));
    assert_eq!(bucket(NETWORK_PROGRAMMING, "+Inf"), Some("2"));

    // Buckets are cumulative (non-decreasing) and end with +Inf == count, per family; one sync
    // programs both families, so the IPv6 series hold the same observations.
    for name in [SYNC_DURATION, SYNC_FULL_DURATION, SYNC_PARTIAL_DURATION, NETWORK_PROGRAMMING] {
        for family in ["IPv4", "IPv6"] {
            let series: Vec<_> = exp
                .samples
                .iter()
                .filter(|(n, labels, _)| n == &format!("{name}_bucket") && labels[0].1 == family)
                .collect();
            let counts: Vec<u64> = series.iter().map(|(_, _, v)| v.parse().unwrap()).collect();
            assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{name}");
            assert_eq!(
                series.last().unwrap().1,
                vec![("ip_family".into(), family.into()), ("le".into(), "+Inf".into())]
            );
            let count = exp.value(&format!("{name}_count"), &[("ip_family", family)]);
            assert_eq!(count.map(str::to_owned), Some(counts.last().unwrap().to_string()), "{name} {family}");
        }
        let count = |family| exp.value(&format!("{name}_count"), &[("ip_family", family)]);
        assert_eq!(count("IPv4"), count("IPv6"), "{name}");
    }

    for family in [v4, [("ip_family", "IPv6")]] {
        assert_eq!(exp.value(LAST_SYNC_TIMESTAMP, &family), Some("1700000000.5"));
        assert_eq!(exp.value(LAST_QUEUED_TIMESTAMP, &family), Some("1700000100"));
    }
    assert_eq!(exp.value(ENDPOINT_CHANGES_PENDING, &[]), Some("4"));
    assert_eq!(exp.value(SERVICE_CHANGES_PENDING, &[]), Some("1"));
    assert_eq!(exp.value(ENDPOINT_CHANGES_TOTAL, &[]), Some("5"));
    assert_eq!(exp.value(SERVICE_CHANGES_TOTAL, &[]), Some("2"));
    assert_eq!(exp.value(SYNC_ERRORS, &[]), Some("3"));
    assert_eq!(exp.value(MAP_ENTRIES, &[("map", "services")]), Some("12"));
    assert_eq!(exp.value(MAP_CAPACITY, &[("map", "services")]), Some("65536"));
    assert_eq!(exp.value(MAP_ENTRIES, &[("map", "odd\"name\\x")]), Some("1"));
    assert_eq!(exp.value(MAP_ENTRIES, &[("map", "conntrack_v6")]), Some("8"));
    assert_eq!(exp.value(MAP_CAPACITY, &[("map", "conntrack_v6")]), Some("262144"));
    assert!(text.contains(r#"kproxy_bpf_map_capacity{map="odd\"name\\x"} 2"#));
    assert_eq!(exp.value(DATAPATH_PACKETS, &[("reason", "forwarded")]), Some("150"));
    assert_eq!(exp.value(DATAPATH_PACKETS, &[("reason", "no_backend")]), Some("3"));
    assert_eq!(exp.value(FRONTENDS, &[]), Some("7"));
    assert_eq!(exp.value(BACKENDS, &[]), Some("21"));
}

#[test]
fn topology_narrowed_service_ports_per_family_and_rule() {
    let m = Metrics::new();
    m.set_topology_narrowed([(2, 1), (0, 3)]);
    let exp = parse(&m.render());
    let value =
        |family, topology| exp.value(TOPOLOGY_PORTS, &[("ip_family", family), ("topology", topology)]);
    assert_eq!(value("IPv4", "PreferSameZone"), Some("2"));
    assert_eq!(value("IPv4", "PreferSameNode"), Some("1"));
    assert_eq!(value("IPv6", "PreferSameZone"), Some("0"));
    assert_eq!(value("IPv6", "PreferSameNode"), Some("3"));
}
