//! `kproxy doctor`: a mounted node image (`--root`, the ip_forward incident
//! of shared/cases/001) and a live node namespace with a running agent (attach checks
//! against the sandbox's own interfaces, never the machine's). The live test needs root.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use common::cluster::{TempDir, kproxy_bin};
use sandbox::{Sandbox, Spawned};
use serde_json::Value;

/// A node image: `files` as (path under the root, contents).
fn fake_root(files: &[(&str, &str)]) -> TempDir {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kproxy-doctor-root-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    TempDir(dir)
}

/// `kproxy doctor --root DIR [--json]`: (exit status, stdout).
fn doctor_root(root: &Path, json: bool) -> (i32, String) {
    let mut command = Command::new(kproxy_bin());
    command.arg("doctor").arg("--root").arg(root);
    if json {
        command.arg("--json");
    }
    let out = command.output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report:#}"))
}

/// The incident's file: a comment block, then forwarding turned off on line 12,
/// overriding a vendor file that turns it on (with the slash syntax).
const INCIDENT_99_SYSCTL: &str = "# /etc/sysctl.d/99-sysctl.conf
#
# kernel parameters
;
kernel.sysrq = 0
vm.swappiness = 10

# networking
net.ipv4.conf.all.accept_redirects = 0
-net.ipv4.conf.all.accept_source_route = 0

  net.ipv4.ip_forward   =   0
";

#[test]
fn persisted_ip_forward_0_is_named_with_its_file_and_line() {
    let root = fake_root(&[
        ("usr/lib/sysctl.d/50-k8s.conf", "net/ipv4/ip_forward = 1\n"),
        ("etc/sysctl.d/99-sysctl.conf", INCIDENT_99_SYSCTL),
        ("proc/sys/net/ipv4/ip_forward", "1\n"),
    ]);
    let (code, out) = doctor_root(&root.0, true);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(code, 0, "WARN is not a failure: {report:#}");
    let ip_forward = check(&report, "ip_forward");
    assert_eq!(ip_forward["status"], "WARN", "{ip_forward:#}");
    let finding = ip_forward["finding"].as_str().unwrap();
    assert!(
        finding.starts_with(
            "/etc/sysctl.d/99-sysctl.conf:12 sets net.ipv4.ip_forward = 0: the next reboot disables forwarding (the incident of cases/001)"
        ),
        "{finding}"
    );
    assert!(
        ip_forward["fix"].as_str().unwrap().contains("/etc/sysctl.d/99-sysctl.conf line 12"),
        "{ip_forward:#}"
    );
    // What an image cannot tell is said so, not guessed.
    assert_eq!(check(&report, "kernel")["status"], "WARN");
    assert!(
        check(&report, "kernel")["finding"]
            .as_str()
            .unwrap()
            .contains("cannot read runtime value under --root")
    );
    assert!(report["checks"].as_array().unwrap().iter().all(|c| c["name"] != "agent"), "{report:#}");

    // The human report carries the finding and the fix.
    let (code, text) = doctor_root(&root.0, false);
    assert_eq!(code, 0);
    assert!(text.contains("WARN  ip_forward"), "{text}");
    assert!(text.contains("/etc/sysctl.d/99-sysctl.conf:12 sets net.ipv4.ip_forward = 0"), "{text}");
    assert!(
        text.contains("fix: edit /etc/sysctl.d/99-sysctl.conf line 12 to `net.ipv4.ip_forward = 1`"),
        "{text}"
    );
}

#[test]
fn healthy_image_and_forwarding_off_at_runtime() {
    let root = fake_root(&[
        ("etc/sysctl.d/99-sysctl.conf", "net.ipv4.ip_forward = 1\n"),
        ("proc/sys/net/ipv4/ip_forward", "1\n"),
        ("proc/sys/net/ipv4/conf/all/rp_filter", "0\n"),
        ("proc/sys/net/ipv4/conf/default/rp_filter", "2\n"),
    ]);
    let (code, out) = doctor_root(&root.0, true);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(code, 0);
    let ip_forward = check(&report, "ip_forward");
    assert_eq!(ip_forward["status"], "OK", "{ip_forward:#}");
    assert!(
        ip_forward["finding"].as_str().unwrap().contains("/etc/sysctl.d/99-sysctl.conf:1"),
        "{ip_forward:#}"
    );
    assert_eq!(check(&report, "rp_filter")["status"], "OK");

    // Forwarding off right now, strict rp_filter persisted: FAIL, exit status 1.
    let broken = fake_root(&[
        ("etc/sysctl.conf", "net.ipv4.ip_forward=0\n"),
        ("usr/lib/sysctl.d/50-rp.conf", "net.ipv4.conf.*.rp_filter = 1\n"),
        ("proc/sys/net/ipv4/ip_forward", "0\n"),
    ]);
    let (code, out) = doctor_root(&broken.0, true);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(code, 1, "{report:#}");
    let ip_forward = check(&report, "ip_forward");
    assert_eq!(ip_forward["status"], "FAIL");
    assert!(ip_forward["finding"].as_str().unwrap().contains("/etc/sysctl.conf:1"), "{ip_forward:#}");
    let rp = check(&report, "rp_filter");
    assert_eq!(rp["status"], "WARN", "{rp:#}");
    assert!(rp["finding"].as_str().unwrap().contains("/usr/lib/sysctl.d/50-rp.conf:1"), "{rp:#}");
}

/// The agent and its pins: on drop (panic included) the agent is stopped and
/// the datapath unloaded before the sandbox goes.
struct Agent {
    process: Option<Spawned>,
    pin_dir: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(agent) = self.process.take() {
            let _ = agent.terminate(Duration::from_secs(5));
        }
        let _ = Command::new(kproxy_bin()).arg("--pin-dir").arg(&self.pin_dir).arg("unload").output();
    }
}

#[test]
fn live_node_reports_attached_programs_and_a_healthy_agent() {
    let sandbox = Sandbox::new("doctor").expect("building the sandbox (needs root)");
    let pods = [
        sandbox.add_pod("client", "10.244.0.2".parse().unwrap()).unwrap(),
        sandbox.add_pod("web-1", "10.244.0.11".parse().unwrap()).unwrap(),
    ];
    let manifests = sandbox.dir().join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/clusterip");
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, manifests.join(path.file_name().unwrap())).unwrap();
    }
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/kproxy-test-doctor-{}", std::process::id()));
    let bin = kproxy_bin();
    // The agent's default --socket-lb (host-only) attaches here, never to the machine's cgroups.
    let cgroup = sandbox::cgroup::ChildCgroup::new("kproxy-test").unwrap();
    let mut agent = Agent { process: None, pin_dir: pin_dir.clone() };
    agent.process = Some(
        sandbox
            .node_spawn([
                bin.as_os_str(),
                "--pin-dir".as_ref(),
                pin_dir.as_os_str(),
                "agent".as_ref(),
                "--manifests".as_ref(),
                manifests.as_os_str(),
                "--interfaces".as_ref(),
                "veth*".as_ref(),
                "--poll-ms".as_ref(),
                "100".as_ref(),
                "--cgroup-root".as_ref(),
                cgroup.path().as_os_str(),
            ])
            .unwrap(),
    );
    // A pod-facing interface the agent does not attach to (not veth*).
    sandbox.node_exec(["ip", "link", "add", "kpdoc0", "type", "bridge"]).unwrap();

    let doctor = |extra: &[&str]| -> (i32, Value) {
        let mut args =
            vec![bin.to_str().unwrap(), "--pin-dir", pin_dir.to_str().unwrap(), "doctor", "--json"];
        args.extend_from_slice(extra);
        let out = sandbox.node_exec_output(&args).unwrap();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        (out.status.code().unwrap_or(-1), report)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (code, report) = loop {
        let (code, report) = doctor(&[]);
        let ok = |name| {
            report["checks"].as_array().unwrap().iter().any(|c| c["name"] == name && c["status"] == "OK")
        };
        if ok("datapath") && ok("attach") && ok("agent") {
            break (code, report);
        }
        let process = agent.process.as_ref().unwrap();
        assert!(process.is_running(), "the agent exited:\n{}", process.log());
        assert!(Instant::now() < deadline, "doctor never saw a healthy agent: {report:#}\n{}", process.log());
        std::thread::sleep(Duration::from_millis(200));
    };
    let attach = check(&report, "attach");
    let finding = attach["finding"].as_str().unwrap();
    for pod in &pods {
        assert!(finding.contains(pod.host_veth()), "{finding}");
    }
    assert!(check(&report, "agent")["finding"].as_str().unwrap().contains("200"), "{report:#}");
    let socket_lb = check(&report, "socket-lb");
    assert_eq!(socket_lb["status"], "OK", "{socket_lb:#}");
    assert!(socket_lb["finding"].as_str().unwrap().contains("host-only (8 cgroup hooks)"), "{socket_lb:#}");
    let conntrack = check(&report, "conntrack fill");
    assert_eq!(conntrack["status"], "OK", "{conntrack:#}");
    assert_eq!(check(&report, "map services_v4")["status"], "OK");
    let fails = report["checks"].as_array().unwrap().iter().any(|c| c["status"] == "FAIL");
    assert_eq!(code, i32::from(fails), "exit status 1 exactly when a check fails: {report:#}");

    // The pins are in the host's bpffs, and the running agent holds them.
    assert_eq!(check(&report, "bpffs-host")["status"], "OK", "{report:#}");
    let agent_pid = agent.process.as_ref().unwrap().pid();
    let datapath = check(&report, "datapath")["finding"].as_str().unwrap();
    assert!(datapath.contains(&format!("held by PID {agent_pid}")), "{datapath}");

    // A glob that matches nothing (a Calico node checked with the default veth*): FAIL, naming
    // the interfaces there are.
    let (code, report) = doctor(&["--interfaces", "cali*"]);
    let attach = check(&report, "attach");
    assert_eq!(attach["status"], "FAIL", "{attach:#}");
    let finding = attach["finding"].as_str().unwrap();
    assert!(finding.contains("no interface matches cali*"), "{finding}");
    for interface in pods.iter().map(|p| p.host_veth()).chain(["kpdoc0", "lo"]) {
        assert!(finding.contains(interface), "{interface} not listed: {finding}");
    }
    assert!(attach["fix"].as_str().unwrap().contains("--interfaces"), "{attach:#}");
    assert_eq!(code, 1, "{report:#}");

    // An interface matching --interfaces without programs: one WARN naming it.
    let (_, report) = doctor(&["--interfaces", "veth*", "kpdoc*"]);
    let warn = check(&report, "attach kpdoc0");
    assert_eq!(warn["status"], "WARN", "{warn:#}");
    assert!(warn["finding"].as_str().unwrap().contains("no ingress"), "{warn:#}");
    assert!(report["checks"].as_array().unwrap().iter().all(|c| c["name"] != "attach"), "{report:#}");

    // Without the agent: WARN "no agent is running", the pinned datapath stays.
    let process = agent.process.take().unwrap();
    process.terminate(Duration::from_secs(5)).unwrap();
    let (_, report) = doctor(&[]);
    let health = check(&report, "agent");
    assert_eq!(health["status"], "WARN", "{health:#}");
    assert!(health["finding"].as_str().unwrap().contains("no agent is running"), "{health:#}");
    assert_eq!(check(&report, "datapath")["status"], "OK");
}

/// kproxy takes SNAT and remapped ports (61000-65535 by default) without seeing the node's own
/// sockets: an ephemeral range that reaches into it is named, with the sysctl that fixes it.
#[test]
fn an_ephemeral_port_range_reaching_into_the_snat_ports_is_named() {
    let overlapping = fake_root(&[("proc/sys/net/ipv4/ip_local_port_range", "1024\t65535\n")]);
    let (code, out) = doctor_root(&overlapping.0, true);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(code, 0, "WARN is not a failure: {report:#}");
    let ports = check(&report, "snat-ports");
    assert_eq!(ports["status"], "WARN", "{ports:#}");
    assert!(
        ports["fix"].as_str().unwrap().contains("net.ipv4.ip_local_reserved_ports=61000-65535"),
        "{ports:#}"
    );

    let reserved = fake_root(&[
        ("proc/sys/net/ipv4/ip_local_port_range", "1024\t65535\n"),
        ("proc/sys/net/ipv4/ip_local_reserved_ports", "61000-65535\n"),
    ]);
    let (_, out) = doctor_root(&reserved.0, true);
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(check(&report, "snat-ports")["status"], "OK", "{report:#}");
}
