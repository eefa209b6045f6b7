//! `kproxy dump` against known map contents, in both forms: a datapath
//! pinned under a test directory, programmed by the agent's Syncer, one DNS
//! flow driven through the real program with BPF_PROG_TEST_RUN, then the
//! `kproxy dump ...` command's output compared with what must be there.

mod common;

use std::path::PathBuf;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use common::{
    Packet,
    cluster::kproxy_bin,
    harness::{CLIENT, DNS_BACKEND, DNS_VIP, desired},
};
use kproxy::{
    bpf::{self, Maps, PinDir},
    sync::Syncer,
};

/// Pins under a directory of this test; unloaded on drop, panic included.
struct Pinned(PinDir);

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = bpf::unload(&self.0);
    }
}

fn kproxy(pins: &PinDir, args: &[&str]) -> String {
    let out = std::process::Command::new(kproxy_bin())
        .arg("--pin-dir")
        .arg(pins.root())
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "kproxy {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_dump_shows_exactly_the_programmed_state() {
    let pins =
        Pinned(PinDir::new(PathBuf::from(format!("/sys/fs/bpf/kproxy-test-dump-{}", std::process::id()))));
    bpf::load(&pins.0).expect("loading needs root");
    let mut syncer = Syncer::from_maps(Maps::from_pins(&pins.0).unwrap()).unwrap();
    let report = syncer.apply(&desired());
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    // One DNS query and its answer through the pinned programs.
    let run = |program: &str, frame: Vec<u8>| {
        let prog = SchedClassifier::from_pin(pins.0.program(program)).unwrap();
        let mut out = vec![0u8; frame.len() + 64];
        prog.test_run(TestRunOptions {
            data_in: Some(&frame),
            data_out: Some(&mut out),
            ..Default::default()
        })
        .unwrap();
    };
    run("kproxy_ingress", Packet::udp(CLIENT, 56340, DNS_VIP, 53, b"query").frame());
    run("kproxy_egress", Packet::udp(DNS_BACKEND, 53, CLIENT, 56340, b"answer!").frame());

    assert_eq!(
        kproxy(&pins.0, &["dump", "services"]),
        "\
FRONTEND        PROTO  SLOT  TARGET                      REVNAT  SERVICE
10.96.0.10:53   UDP    0     1 backends                  1       default/dns:dns
10.96.0.10:53   UDP    1     backend 1 10.244.0.21:53    1       default/dns:dns
10.96.0.100:80  TCP    0     3 backends                  2       default/web:http
10.96.0.100:80  TCP    1     backend 2 10.244.0.11:8080  2       default/web:http
10.96.0.100:80  TCP    2     backend 3 10.244.0.12:8080  2       default/web:http
10.96.0.100:80  TCP    3     backend 4 10.244.0.13:8080  2       default/web:http
10.96.0.200:80  TCP    0     0 backends                  3       default/empty:http
"
    );
    let services: serde_json::Value =
        serde_json::from_str(&kproxy(&pins.0, &["dump", "services", "--json"])).unwrap();
    assert_eq!(services.as_array().unwrap().len(), 7);
    assert_eq!(services[3]["frontend"], "10.96.0.100:80");
    assert_eq!(services[3]["backend"], "10.244.0.11:8080");
    assert_eq!(services[3]["backend_id"], 2);

    assert_eq!(
        kproxy(&pins.0, &["dump", "backends"]),
        "\
ID  ADDRESS           PROTO  STATE
1   10.244.0.21:53    UDP    active
2   10.244.0.11:8080  TCP    active
3   10.244.0.12:8080  TCP    active
4   10.244.0.13:8080  TCP    active
"
    );

    let ct: serde_json::Value =
        serde_json::from_str(&kproxy(&pins.0, &["dump", "conntrack", "--json"])).unwrap();
    let rows = ct.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{ct:#}");
    let row = &rows[0];
    assert_eq!(row["original"], "10.244.0.2:56340 -> 10.96.0.10:53");
    assert_eq!(row["translated"], "10.244.0.2:56340 -> 10.244.0.21:53");
    assert_eq!(row["protocol"], "UDP");
    assert_eq!(row["service"], "default/dns:dns");
    assert_eq!(row["state"], "OPEN");
    assert_eq!((row["packets_out"].as_u64(), row["packets_reply"].as_u64()), (Some(1), Some(1)));
    assert_eq!((row["bytes_out"].as_u64(), row["bytes_reply"].as_u64()), (Some(33), Some(35)));
    assert_eq!(row["hairpin"], false);
    let table = kproxy(&pins.0, &["dump", "conntrack"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert!(lines[0].starts_with("PROTO  ORIGINAL"), "{table}");
    assert!(
        lines[1].starts_with(
            "UDP    10.244.0.2:56340 -> 10.96.0.10:53  10.244.0.2:56340 -> 10.244.0.21:53  OPEN"
        ),
        "{table}"
    );
    assert!(lines[1].ends_with("default/dns:dns"), "{table}");

    assert_eq!(
        kproxy(&pins.0, &["dump", "nat"]),
        "\
KIND    PROTO  FROM                               TO                                 SERVICE
DNAT    UDP    10.244.0.2:56340 > 10.96.0.10:53   10.244.0.2:56340 > 10.244.0.21:53  default/dns:dns
un-NAT  UDP    10.244.0.21:53 > 10.244.0.2:56340  10.96.0.10:53 > 10.244.0.2:56340   default/dns:dns
"
    );

    let stats: serde_json::Value =
        serde_json::from_str(&kproxy(&pins.0, &["dump", "stats", "--json"])).unwrap();
    let count = |reason: &str| {
        stats.as_array().unwrap().iter().find(|r| r["reason"] == reason).unwrap()["packets"].clone()
    };
    assert_eq!(count("dnat_new_flow"), 1);
    assert_eq!(count("reverse_nat"), 1);
    assert_eq!(count("dnat_established"), 0);

    assert_eq!(kproxy(&pins.0, &["dump", "affinity"]).lines().count(), 1, "only the header without affinity");
}
