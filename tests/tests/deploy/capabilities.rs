//! The capabilities overlay, run for real in a sandbox node: `kproxy agent` with the arguments
//! the base DaemonSet gives it (the ConfigMap's values, the in-process API server as the
//! cluster), holding exactly the capabilities deploy/overlays/capabilities/security.yaml adds
//! after `drop: [ALL]` (read from that file), with no_new_privs for `allowPrivilegeEscalation:
//! false` and, for `readOnlyRootFilesystem`, every mount read-only in a private mount namespace
//! but /proc, /dev, bpffs and cgroup2 (the pod's volumes). It must load, attach and translate a
//! pod's connection and a node process's through a ClusterIP, and restart on its own pins; with
//! any one capability removed it must fail, naming what the kernel refused, with nothing
//! attached: the set is sufficient and each capability in it necessary. Its memory under 10k
//! Services stays within the DaemonSet's limit. Needs root; socket hooks go only to the
//! cluster's child cgroup.

use std::{
    collections::BTreeMap,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    process::ExitStatus,
    time::{Duration, Instant},
};

use kproxy::bpf::{Maps, PinDir};
use proxy_common::maps::{IPPROTO_TCP, SCOPE_CLUSTER_IP, ServiceKeyV4};
use sandbox::{Spawned, cgroup::cgroup2_root, kube_proxy_rules as rules};
use serde_yaml::Value;

use super::{deploy_file, strings};
use crate::common::cluster::{Cluster, DNS_VIP, Mode, WEB_VIP, kproxy_bin};

/// Why each capability is in the overlay: what the agent reports when the kernel refuses the
/// operation that needs it (seen on 6.18). A capability the overlay adds that is not here fails
/// the test until its reason is found and written down.
const REFUSED_WITHOUT: &[(&str, &str)] = &[
    // bpf(BPF_MAP_CREATE), the first bpf() the agent makes.
    ("BPF", "failed to create map"),
    // BPF_PROG_LOAD of sched_cls (and XDP, cgroup sock_addr) programs is for CAP_NET_ADMIN.
    ("NET_ADMIN", "BPF_PROG_LOAD syscall returned Operation not permitted"),
];

/// linux/capability.h: the bit of each capability in /proc/PID/status masks.
const CAPABILITY_BITS: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

fn capability_mask(caps: &[String]) -> u64 {
    caps.iter()
        .map(|c| {
            let bit =
                CAPABILITY_BITS.iter().position(|b| b == c).unwrap_or_else(|| panic!("capability {c}?"));
            1u64 << bit
        })
        .fold(0, |mask, bit| mask | bit)
}

/// The agent container's security context in the capabilities overlay.
struct Overlay {
    add: Vec<String>,
    no_new_privs: bool,
    read_only_root: bool,
}

fn overlay() -> Overlay {
    let patch = deploy_file("overlays/capabilities/security.yaml");
    let containers = patch["spec"]["template"]["spec"]["containers"].as_sequence().unwrap();
    let agent = containers.iter().find(|c| c["name"].as_str() == Some("kproxy")).unwrap();
    let context = &agent["securityContext"];
    assert_eq!(
        strings(&context["capabilities"]["drop"]),
        ["ALL"],
        "the overlay must drop every capability first, or the runtime's defaults come on top of `add`"
    );
    Overlay {
        add: strings(&context["capabilities"]["add"]),
        no_new_privs: context["allowPrivilegeEscalation"].as_bool() == Some(false),
        read_only_root: context["readOnlyRootFilesystem"].as_bool() == Some(true),
    }
}

/// `kproxy agent`'s arguments as the base DaemonSet passes them, each `$(VAR)` replaced by the
/// ConfigMap value or downward-API field its env var names; `--cgroup-root` is `cgroup` (the
/// test's own, never the machine's root).
fn deployed_agent_args(node_name: &str, cgroup: &Path) -> Vec<String> {
    let ds = deploy_file("base/daemonset.yaml");
    let config = deploy_file("base/configmap.yaml");
    let containers = ds["spec"]["template"]["spec"]["containers"].as_sequence().unwrap();
    let agent = containers.iter().find(|c| c["name"].as_str() == Some("kproxy")).unwrap();
    let mut env = BTreeMap::new();
    for var in agent["env"].as_sequence().unwrap() {
        let name = var["name"].as_str().unwrap().to_owned();
        if var["valueFrom"]["configMapKeyRef"]["optional"].as_bool() == Some(true) {
            continue; // an optional ConfigMap deploy/ does not create (kproxy-api-endpoint): unset
        }
        let value = if let Some(key) = var["valueFrom"]["configMapKeyRef"]["key"].as_str() {
            config["data"][key].as_str().unwrap_or_else(|| panic!("ConfigMap key {key}")).to_owned()
        } else if var["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("spec.nodeName") {
            node_name.to_owned()
        } else {
            var["value"].as_str().unwrap_or_else(|| panic!("env {name}: no value this test knows")).to_owned()
        };
        env.insert(name, value);
    }
    let mut args: Vec<String> = strings(&agent["args"])
        .into_iter()
        .map(|arg| env.iter().fold(arg, |arg, (name, value)| arg.replace(&format!("$({name})"), value)))
        .filter(|arg| !arg.starts_with("--cgroup-root"))
        .collect();
    assert_eq!(args[0], "agent");
    assert!(args.iter().all(|a| !a.contains("$(")), "{args:?}");
    args.push(format!("--cgroup-root={}", cgroup.display()));
    args
}

/// Runs its arguments in a private mount namespace. With `ro` = yes every mount but /proc, /dev,
/// bpffs and the cgroup2 mount `$2` (the DaemonSet's volumes) is remounted read-only, as
/// `readOnlyRootFilesystem` (and a read-only /sys) leaves the container; with `$3` = yes an
/// empty tmpfs hides bpffs, as on a node that never mounted it. Per-mount flags of a private copy:
/// the host's mounts are untouched.
const MOUNT_SCRIPT: &str = r#"ro="$1" keep="$2" hide_bpffs="$3"; shift 3
if [ "$ro" = yes ]; then
  while read -r _ target _; do
    case "$target" in /proc|/proc/*|/dev|/dev/*|/sys/fs/bpf|"$keep") continue ;; esac
    mount -o remount,bind,ro "$target" || { echo "could not make $target read-only" >&2; exit 1; }
  done < /proc/self/mounts
  if [ -w / ]; then echo "/ is still writable" >&2; exit 1; fi
fi
if [ "$hide_bpffs" = yes ]; then mount -t tmpfs no-bpffs /sys/fs/bpf || exit 1; fi
exec "$@""#;

/// Starts the deployed agent in `cluster`'s node with only `caps` (bounding set; root gets
/// exactly these on exec), as the overlay's container runs it.
fn spawn_agent(cluster: &Cluster, overlay: &Overlay, caps: &[String], hide_bpffs: bool) -> Spawned {
    let bounding: Vec<String> = std::iter::once("-all".to_owned())
        .chain(caps.iter().map(|c| format!("+{}", c.to_ascii_lowercase())))
        .collect();
    let cgroup2 = cgroup2_root().expect("a cgroup2 mount");
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_owned();
    let mut args: Vec<String> =
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", MOUNT_SCRIPT, "sh"]
            .map(String::from)
            .into();
    args.extend([yes_no(overlay.read_only_root), cgroup2.display().to_string(), yes_no(hide_bpffs)]);
    args.extend(["setpriv", "--bounding-set", &bounding.join(","), "--inh-caps", "-all"].map(String::from));
    if overlay.no_new_privs {
        args.push("--no-new-privs".into());
    }
    args.extend(["--".into(), kproxy_bin().display().to_string()]);
    let deployed = deployed_agent_args("node-1", cluster.cgroup.path());
    args.extend([deployed[0].clone(), "--pin-dir".into(), cluster.pin_dir.display().to_string()]);
    args.extend(deployed[1..].iter().cloned());
    args.extend(["--master".into(), cluster.api().url()]);
    cluster.sandbox.node_spawn(&args).unwrap()
}

/// The `Cap*`/`NoNewPrivs` lines of the agent's status once the exec chain reached kproxy.
fn agent_status(agent: &Spawned) -> BTreeMap<String, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let proc = Path::new("/proc").join(agent.pid().to_string());
    while std::fs::read_to_string(proc.join("comm")).unwrap_or_default().trim() != "kproxy" {
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(Instant::now() < deadline, "kproxy never started:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = std::fs::read_to_string(proc.join("status")).unwrap();
    status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| k.starts_with("Cap") || k == "NoNewPrivs")
        .collect()
}

fn mask(status: &BTreeMap<String, String>, key: &str) -> u64 {
    u64::from_str_radix(&status[key], 16).unwrap()
}

/// How the agent ends when it is expected to fail: its exit status. One that serves /healthz
/// instead is working, which fails the test right away.
fn wait_exit(cluster: &Cluster, agent: &Spawned, what: &str) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = agent.try_wait().unwrap() {
            return status;
        }
        assert!(healthz(cluster) != "200", "the agent works {what}:\n{}", agent.log());
        assert!(Instant::now() < deadline, "the agent {what} still runs after 60 s:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn links(cluster: &Cluster) -> Vec<String> {
    std::fs::read_dir(cluster.pin_dir.join("links"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// A fresh node: the root agent [`Cluster`] starts is stopped and its pins removed.
fn fresh_node(cluster: &mut Cluster) {
    cluster.stop_agent();
    cluster.kproxy(&["unload"]);
    assert!(!cluster.pin_dir.exists());
}

/// The ConfigMap's healthz-bind-address, in the node namespace.
const HEALTHZ: &str = "http://127.0.0.1:10256/healthz";

/// The HTTP status of /healthz, "000" while nothing listens (node_curl would panic on that).
fn healthz(cluster: &Cluster) -> String {
    let curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "2", HEALTHZ];
    let out = cluster.sandbox.node_exec_output(curl).unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_healthy(cluster: &Cluster, agent: &Spawned) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let code = healthz(cluster);
        if code == "200" {
            return;
        }
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(Instant::now() < deadline, "/healthz answers {code:?}; agent log:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn assert_translates(cluster: &Cluster) {
    let page = cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap();
    assert!(page.starts_with("web-"), "pod → ClusterIP (tc): {page:?}");
    let answer = cluster.client.dig(DNS_VIP, "web.default.svc.cluster.local", "A").unwrap();
    assert_eq!(answer.trim(), WEB_VIP.to_string(), "pod → DNS ClusterIP over UDP");
    // A node process in the cgroup the socket hooks are attached to (socket-lb from the ConfigMap).
    let out = cluster
        .cgroup
        .command(
            cluster.sandbox.node_netns(),
            &["curl", "-sS", "--max-time", "5", &format!("http://{WEB_VIP}/")],
        )
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && page.starts_with("web-"),
        "node → ClusterIP (socket LB): {page:?} {out:?}"
    );
}

#[test]
fn the_agent_runs_with_exactly_the_overlays_capabilities_and_fails_without_each() {
    let overlay = overlay();
    assert!(overlay.no_new_privs && overlay.read_only_root, "this test runs what the overlay sets");
    let mut cluster = Cluster::start_with("caps", Mode::Api);
    fresh_node(&mut cluster);

    // Without each capability: a clear refusal, and nothing attached.
    for cap in &overlay.add {
        let (_, refusal) = REFUSED_WITHOUT.iter().find(|(c, _)| c == cap).unwrap_or_else(|| {
            panic!("the overlay adds {cap}: write down what fails without it in REFUSED_WITHOUT")
        });
        let fewer: Vec<String> = overlay.add.iter().filter(|c| *c != cap).cloned().collect();
        let agent = spawn_agent(&cluster, &overlay, &fewer, false);
        let status = wait_exit(&cluster, &agent, &format!("without {cap}"));
        let log = agent.log();
        assert!(!status.success(), "the agent ran without {cap}: the overlay does not need it\n{log}");
        assert!(log.contains(refusal), "without {cap}: expected {refusal:?} in\n{log}");
        assert!(links(&cluster).is_empty(), "without {cap} something was attached: {:?}", links(&cluster));
        cluster.kproxy(&["unload"]);
    }

    // A node that did not mount bpffs: the overlay has no init container to do it, and the agent
    // cannot (no CAP_SYS_ADMIN). It must say so rather than pin into a private mount.
    let agent = spawn_agent(&cluster, &overlay, &overlay.add, true);
    let status = wait_exit(&cluster, &agent, "without bpffs");
    assert!(!status.success(), "{}", agent.log());
    let last = agent.log().lines().rev().find(|l| l.starts_with("kproxy:")).map(str::to_owned);
    assert!(last.as_deref().is_some_and(|l| l.contains("/sys/fs/bpf")), "{last:?}\n{}", agent.log());
    assert!(!cluster.pin_dir.exists(), "pins left on the host's bpffs");

    // Exactly the overlay's set: loads, attaches, translates.
    let agent = spawn_agent(&cluster, &overlay, &overlay.add, false);
    let status = agent_status(&agent);
    let expected = capability_mask(&overlay.add);
    for set in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(mask(&status, set), expected, "{set}: {status:?}");
    }
    assert_eq!(mask(&status, "CapInh") | mask(&status, "CapAmb"), 0, "{status:?}");
    assert_eq!(status["NoNewPrivs"], "1");
    cluster.agent = Some(agent);
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3), ("10.96.0.10:53", "UDP", 2)]);
    cluster.wait_for_attachment();
    wait_healthy(&cluster, cluster.agent.as_ref().unwrap());
    assert_translates(&cluster);
    assert_no_refusal(&cluster.agent_log());

    // A rollout: the next agent adopts the pinned maps and moves the links, with the same set.
    assert!(cluster.stop_agent().success(), "{}", cluster.agent_log());
    let agent = spawn_agent(&cluster, &overlay, &overlay.add, false);
    wait_healthy(&cluster, &agent);
    cluster.agent = Some(agent);
    cluster.wait_for_attachment();
    assert_translates(&cluster);
    assert_no_refusal(&cluster.agent_log());
}

/// A refusal the agent warns about and carries on after (an interface it could not attach to, a
/// socket it could not destroy) would leave the overlay's set short without failing the start.
fn assert_no_refusal(log: &str) {
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .filter(|l| l.contains("Operation not permitted") || l.contains("Permission denied"))
        .collect();
    assert!(refusals.is_empty(), "{refusals:#?}");
}

/// Bytes the kernel charges for a pinned map (its fdinfo `memlock`): since 5.11 that memory is
/// charged to the memory cgroup of the process that created the map.
fn map_memlock(path: &Path) -> u64 {
    let map = aya::maps::MapData::from_pin(path).unwrap();
    let fd = map.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
    info.lines().find_map(|l| l.strip_prefix("memlock:")).unwrap().trim().parse().unwrap()
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("{key}"));
    line.trim_start_matches(':').split_whitespace().next().unwrap().parse().unwrap()
}

fn quantity_bytes(text: &str) -> u64 {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let unit = match unit {
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => panic!("unit {other:?} of {text:?}"),
    };
    number.parse::<u64>().unwrap() * unit
}

/// The DaemonSet's memory limit holds what a fresh node's agent needs with 10k Services × 3
/// endpoints from the API server: its peak RSS plus the maps it creates (both charged to its
/// memory cgroup; file-backed RSS counts too, which makes this an upper bound).
#[test]
fn the_agent_with_10k_services_stays_within_the_daemonsets_memory_limit() {
    let ds = deploy_file("base/daemonset.yaml");
    let containers = ds["spec"]["template"]["spec"]["containers"].as_sequence().unwrap();
    let agent = containers.iter().find(|c| c["name"].as_str() == Some("kproxy")).unwrap();
    let limit: &Value = &agent["resources"]["limits"]["memory"];
    let limit = quantity_bytes(limit.as_str().expect("a memory limit"));

    let overlay = overlay();
    let mut cluster = Cluster::start_with("caps-mem", Mode::Api);
    fresh_node(&mut cluster);
    let svcs = rules::cluster(10_000, &[]);
    for svc in &svcs {
        cluster.api().apply(rules::service_json(svc));
        cluster.api().apply(rules::slice_json(svc, &svc.endpoints));
    }
    let started = Instant::now();
    let agent = spawn_agent(&cluster, &overlay, &overlay.add, false);
    let pid = agent.pid();
    cluster.agent = Some(agent);
    let last = svcs.last().unwrap();
    let key = ServiceKeyV4::new(last.vip.octets(), last.port.to_be_bytes(), IPPROTO_TCP, SCOPE_CLUSTER_IP, 0);
    let pins = PinDir::new(&cluster.pin_dir);
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let programmed = pins.is_loaded()
            && Maps::from_pins(&pins).is_ok_and(|m| m.services.get(&key, 0).is_ok_and(|v| v.count == 3));
        if programmed {
            break;
        }
        let agent = cluster.agent.as_ref().unwrap();
        assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        assert!(Instant::now() < deadline, "10k Services not programmed:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let synced = started.elapsed();
    wait_healthy(&cluster, cluster.agent.as_ref().unwrap());
    assert_translates(&cluster);

    let hwm = status_kib(pid, "VmHWM") << 10;
    let mut maps = 0;
    for entry in std::fs::read_dir(cluster.pin_dir.join("maps")).unwrap() {
        maps += map_memlock(&entry.unwrap().path());
    }
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    eprintln!(
        "10k Services from the API server, overlay capabilities: synced in {synced:.1?}, VmHWM {:.1} MiB, \
         maps {:.1} MiB, limit {:.0} MiB",
        mib(hwm),
        mib(maps),
        mib(limit)
    );
    assert!(
        hwm + maps < limit,
        "peak RSS {:.1} MiB + maps {:.1} MiB exceed the DaemonSet's memory limit {:.0} MiB",
        mib(hwm),
        mib(maps),
        mib(limit)
    );
}
