//! Restarting (or upgrading) the agent reloads the programs, reuses the pinned
//! maps, creates the maps an older kproxy did not have, and moves the pinned
//! TCX links to the new programs atomically: a transfer through the VIP keeps
//! flowing. A pinned map of another layout is refused with a clear error.
//! Needs root.

mod common;

use std::time::Duration;

use common::cluster::{Cluster, WEB_VIP};

fn program_id(cluster: &Cluster, program: &str) -> u64 {
    let pin = cluster.pin_dir.join("progs").join(program);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "prog", "show", "pinned"])
        .arg(&pin)
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["id"].as_u64().unwrap()
}

/// Waits (the agent attaches new interfaces every 100 ms) until `program`
/// has `n` links.
fn wait_links(program: u64, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while links_to(program) != n {
        assert!(
            std::time::Instant::now() < deadline,
            "program {program}: {} links, want {n}",
            links_to(program)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn links_to(program: u64) -> usize {
    let out = std::process::Command::new("bpftool").args(["-j", "link", "show"]).output().unwrap();
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    links.as_array().unwrap().iter().filter(|l| l["prog_id"].as_u64() == Some(program)).count()
}

#[test]
fn an_agent_with_new_programs_and_maps_takes_over_without_dropping_a_flow() {
    let mut cluster = Cluster::start("upgrade");
    let old_ingress = program_id(&cluster, "kproxy_ingress");
    wait_links(old_ingress, 6);

    let out = cluster.sandbox.dir().join("slow.bin");
    let download = cluster.client.download_slowly(&WEB_VIP.to_string(), &out).unwrap();
    std::thread::sleep(Duration::from_millis(700));

    // As if the running datapath came from an older kproxy without tracing, and with fewer
    // counters.
    cluster.stop_agent();
    for map in ["events", "trace"] {
        std::fs::remove_file(cluster.pin_dir.join("maps").join(map)).unwrap();
    }
    let stats = cluster.pin_dir.join("maps/stats");
    std::fs::remove_file(&stats).unwrap();
    let created = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&stats)
        .args(["type", "percpu_array", "key", "4", "value", "8", "entries", "33", "name", "STATS"])
        .status()
        .unwrap();
    assert!(created.success());
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cluster.agent_log().contains("reloaded the programs") {
        assert!(std::time::Instant::now() < deadline, "{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }

    let new_ingress = program_id(&cluster, "kproxy_ingress");
    assert_ne!(new_ingress, old_ingress, "the programs were replaced");
    assert_eq!(links_to(new_ingress), 6, "every link moved to the new program");
    assert_eq!(links_to(old_ingress), 0);
    assert!(cluster.pin_dir.join("maps/trace").exists() && cluster.pin_dir.join("maps/events").exists());
    assert!(cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap().starts_with("web-"));
    let counters = cluster.dump_json("stats");
    let newest = proxy_common::stats::Stat::ALL.last().unwrap().name();
    assert!(
        counters.as_array().unwrap().iter().any(|r| r["reason"] == newest),
        "the stats map was not replaced: {counters}"
    );

    let status = download.wait_timeout(Duration::from_secs(30)).unwrap().expect("download finished");
    assert!(status.success(), "the flow broke during the takeover: {}", download.log());
    assert!(std::fs::read(&out).unwrap() == sandbox::big_file_contents(), "the download arrived corrupted");
}

#[test]
fn a_pinned_map_of_another_layout_is_refused_by_name() {
    let mut cluster = Cluster::start("layout");
    cluster.stop_agent();
    let vips = cluster.pin_dir.join("maps/vips_v4");
    std::fs::remove_file(&vips).unwrap();
    let status = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&vips)
        .args(["type", "hash", "key", "8", "value", "4", "entries", "16", "name", "VIPS_V4"])
        .status()
        .unwrap();
    assert!(status.success());
    let bin = common::cluster::kproxy_bin();
    let out = std::process::Command::new(bin)
        .arg("--pin-dir")
        .arg(&cluster.pin_dir)
        .args(["load", "--interfaces", "nomatch"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("vips_v4") && err.contains("kproxy unload"), "{err}");
    // The library says which map, as a variant a caller can act on.
    let refused = kproxy::bpf::load(&kproxy::bpf::PinDir::new(&cluster.pin_dir)).unwrap_err();
    assert!(
        matches!(refused, kproxy::bpf::LoadError::IncompatiblePin { map: "VIPS_V4", key_size: 8, .. }),
        "{refused:?}"
    );
}

/// A datapath pinned by a kproxy from before 32-bit rev-NAT ids (16-bit ids: 16-byte services values,
/// 2-byte rev-NAT and names keys, 48-byte conntrack entries) is refused as a whole, every map whose
/// layout changed named, before anything is replaced; `kproxy unload` and a fresh load are the way
/// out, as the error says.
#[test]
fn a_datapath_with_16_bit_rev_nat_ids_is_refused_naming_every_changed_map() {
    let mut cluster = Cluster::start("revnat16");
    cluster.stop_agent();
    let old_ingress = program_id(&cluster, "kproxy_ingress");
    let old_layouts = [
        ("services_v4", "hash", "12", "16", "SERVICES_V4"),
        ("rev_nat_v4", "hash", "2", "8", "REV_NAT_V4"),
        ("frontend_names_v4", "hash", "2", "192", "FRONTEND_NAMES"),
        ("conntrack_v4", "lru_hash", "16", "48", "CONNTRACK_V4"),
    ];
    for (pin, kind, key, value, name) in old_layouts {
        let path = cluster.pin_dir.join("maps").join(pin);
        std::fs::remove_file(&path).unwrap();
        let status = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&path)
            .args(["type", kind, "key", key, "value", value, "entries", "16", "name", name])
            .status()
            .unwrap();
        assert!(status.success(), "bpftool map create {pin}");
    }
    let load = |pins: &std::path::Path| {
        std::process::Command::new(common::cluster::kproxy_bin())
            .arg("--pin-dir")
            .arg(pins)
            .args(["load", "--interfaces", "nomatch"])
            .output()
            .unwrap()
    };
    let out = load(&cluster.pin_dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for (pin, ..) in old_layouts {
        assert!(err.contains(pin), "{pin} not named: {err}");
    }
    assert!(err.contains("kproxy unload"), "{err}");
    let refused = kproxy::bpf::load(&kproxy::bpf::PinDir::new(&cluster.pin_dir)).unwrap_err();
    match &refused {
        kproxy::bpf::LoadError::IncompatiblePin { map, also, .. } => {
            let mut named: Vec<&str> = also.clone();
            named.push(map);
            named.sort();
            assert_eq!(
                named,
                ["CONNTRACK_V4", "FRONTEND_NAMES_V4", "REV_NAT_V4", "SERVICES_V4"],
                "{refused}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Nothing was replaced: the old programs are still the pinned ones.
    assert_eq!(program_id(&cluster, "kproxy_ingress"), old_ingress);

    let unload = std::process::Command::new(common::cluster::kproxy_bin())
        .arg("--pin-dir")
        .arg(&cluster.pin_dir)
        .arg("unload")
        .output()
        .unwrap();
    assert!(unload.status.success(), "{}", String::from_utf8_lossy(&unload.stderr));
    let out = load(&cluster.pin_dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rev_nat = aya::maps::MapInfo::from_pin(cluster.pin_dir.join("maps/rev_nat_v4")).unwrap();
    assert_eq!(rev_nat.key_size(), 4, "the fresh load made 32-bit rev-NAT ids");
}
