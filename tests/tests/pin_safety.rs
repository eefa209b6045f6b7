//! The pin directory cannot be turned against the host, belongs to one agent at a time, and lives
//! in the host's bpffs. bpffs at /sys/fs/bpf is mode 1777 when mounted without `mode=` (kproxy and
//! the DaemonSet's init container now mount it 0700, but a node may have it so), so an
//! unprivileged user can create kproxy's pin directory before the agent starts — with `links` a
//! symlink to a root-only directory whose files `load` and `unload` would otherwise delete. kproxy
//! refuses such a tree and names the path; nothing outside the pin directory is touched. A second
//! agent on one pin directory waits for the first and gives up naming it; `unload` refuses under a
//! running agent. Under `ip netns exec` (a mount namespace of its own, /sys remounted) kproxy
//! would pin into a bpffs that vanishes with the process: it refuses unless told to. Needs root
//! (it runs the preparation as `nobody` with setpriv).

mod common;

use std::{
    ffi::OsString,
    os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use common::cluster::{kproxy_bin, unique_pin_dir};
use sandbox::{Sandbox, Spawned};

/// A root-only directory holding a file the attack aims at; removed on drop with the pin dir.
struct Victim {
    dir: PathBuf,
    pins: PathBuf,
}

impl Victim {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kproxy-victim-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(dir.join("precious"), "root's data\n").unwrap();
        Self { dir, pins: unique_pin_dir() }
    }

    fn intact(&self) -> bool {
        std::fs::read_to_string(self.dir.join("precious")).is_ok_and(|t| t == "root's data\n")
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.pins.join("links"));
        let _ = std::fs::remove_dir_all(&self.pins);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn as_nobody(args: &[&str]) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(args)
        .output()
        .expect("setpriv (util-linux)");
    assert!(out.status.success(), "as nobody {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn kproxy(pins: &Path, args: &[&str]) -> Output {
    Command::new(kproxy_bin()).arg("--pin-dir").arg(pins).args(args).output().unwrap()
}

fn refused(out: &Output, path: &Path) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "accepted: {stderr}");
    assert!(stderr.contains(&path.display().to_string()), "the path is not named: {stderr}");
    stderr
}

#[test]
fn a_pin_directory_an_unprivileged_user_prepared_is_refused_and_nothing_outside_it_is_touched() {
    let victim = Victim::new("user");
    let pins = victim.pins.to_str().unwrap();
    as_nobody(&["mkdir", pins]);
    as_nobody(&["ln", "-s", victim.dir.to_str().unwrap(), &format!("{pins}/links")]);

    let err = refused(&kproxy(&victim.pins, &["load"]), &victim.pins);
    assert!(err.contains("belongs to uid 65534"), "{err}");
    let err = refused(&kproxy(&victim.pins, &["unload"]), &victim.pins);
    assert!(err.contains("belongs to uid 65534"), "{err}");
    assert!(victim.intact(), "a file outside the pin directory was deleted");
    assert!(std::fs::symlink_metadata(victim.pins.join("links")).unwrap().file_type().is_symlink());
}

#[test]
fn a_symlink_or_a_world_writable_directory_in_the_tree_is_refused() {
    let victim = Victim::new("link");
    std::fs::create_dir(&victim.pins).unwrap();
    symlink(&victim.dir, victim.pins.join("links")).unwrap();
    let links = victim.pins.join("links");
    let err = refused(&kproxy(&victim.pins, &["load"]), &links);
    assert!(err.contains("symbolic link"), "{err}");
    refused(&kproxy(&victim.pins, &["unload"]), &links);
    assert!(victim.intact());

    std::fs::remove_file(&links).unwrap();
    std::fs::set_permissions(&victim.pins, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = refused(&kproxy(&victim.pins, &["load"]), &victim.pins);
    assert!(err.contains("others may write"), "{err}");
}

#[test]
fn unload_deletes_nothing_off_bpffs() {
    let victim = Victim::new("tmpfs");
    // A pin directory given on another filesystem: its "pins" are ordinary files.
    let fake = victim.dir.join("pins");
    std::fs::create_dir_all(fake.join("maps")).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(fake.join("maps"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(fake.join("maps/config"), "not a pin\n").unwrap();
    let err = refused(&kproxy(&fake, &["unload"]), &fake);
    assert!(err.contains("not on a bpf filesystem"), "{err}");
    assert!(fake.join("maps/config").exists());
}

/// What kproxy creates itself passes its own check, closed to others.
#[test]
fn a_fresh_load_creates_a_private_tree_and_unloads_it() {
    let victim = Victim::new("fresh");
    let out = kproxy(&victim.pins, &["load", "--interfaces", "kp-none-*"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for dir in ["", "links", "maps", "progs"] {
        let mode = std::fs::metadata(victim.pins.join(dir)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{dir}");
    }
    let out = kproxy(&victim.pins, &["unload"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!victim.pins.exists());
}

/// Unloads a pin directory when dropped (declared before the sandbox, so its agents are gone by
/// then).
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = kproxy(&self.0, &["unload", "--force"]);
    }
}

/// `kproxy agent` with nothing to do but hold its pins: an empty manifests directory, no
/// interface to attach to, no socket hooks, no health port.
fn agent_args(pins: &Path, manifests: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut args: Vec<OsString> =
        vec![kproxy_bin().into(), "--pin-dir".into(), pins.into(), "agent".into(), "--manifests".into()];
    args.push(manifests.into());
    args.extend(
        [
            "--interfaces",
            "kp-none-*",
            "--external-interfaces",
            "kp-none0",
            "--xdp",
            "off",
            "--socket-lb",
            "off",
            "--healthz-bind-address",
            "",
            "--poll-ms",
            "100",
        ]
        .map(OsString::from),
    );
    args.extend(extra.iter().map(OsString::from));
    args
}

fn wait_for_log(process: &Spawned, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !process.log().contains(text) {
        assert!(process.is_running(), "exited before logging {text:?}:\n{}", process.log());
        assert!(Instant::now() < deadline, "no {text:?} in the log:\n{}", process.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn empty_manifests(sandbox: &Sandbox) -> PathBuf {
    let dir = sandbox.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn one_agent_per_pin_directory_the_next_waits_for_it_and_unload_refuses_under_it() {
    let pins = Pins(unique_pin_dir());
    let sandbox = Sandbox::new("pinlock").expect("building the sandbox (needs root)");
    let manifests = empty_manifests(&sandbox);
    let first = sandbox.node_spawn(agent_args(&pins.0, &manifests, &[])).unwrap();
    wait_for_log(&first, "adopted the maps' contents");
    // A clean start: the kernel took the object's BTF (aya logged ~100 lines of BTF dump as a
    // warning when it refused it), and the programs carry it.
    assert!(!first.log().contains("BTF"), "{}", first.log());
    let program = pins.0.join("progs/kproxy_ingress");
    let shown =
        Command::new("bpftool").args(["-j", "prog", "show", "pinned"]).arg(&program).output().unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert!(shown["btf_id"].as_u64().is_some_and(|id| id > 0), "no BTF on the program: {shown}");

    // A second agent waits for the first (a rolling update), then gives up naming both.
    let holder = format!("PID {}", first.pid());
    let second = sandbox.node_spawn(agent_args(&pins.0, &manifests, &["--lock-timeout", "1s"])).unwrap();
    let status = second.wait_timeout(Duration::from_secs(20)).unwrap().expect("the second agent gives up");
    let log = second.log();
    assert!(!status.success(), "{log}");
    assert!(log.contains(&format!("waiting for {holder}")), "{log}");
    assert!(log.contains(&format!("the pin directory {} is held by {holder}", pins.0.display())), "{log}");

    // unload refuses while the agent runs, and says who holds the pins.
    let err = refused(&kproxy(&pins.0, &["unload"]), &pins.0);
    assert!(err.contains(&holder) && err.contains("--force"), "{err}");
    assert!(program.exists(), "unload removed pins under a running agent");
    let err = refused(&kproxy(&pins.0, &["load", "--interfaces", "kp-none-*"]), &pins.0);
    assert!(err.contains(&holder), "{err}");

    // The next agent takes over once the first one stops.
    let third = sandbox.node_spawn(agent_args(&pins.0, &manifests, &["--lock-timeout", "30s"])).unwrap();
    wait_for_log(&third, &format!("waiting for {holder}"));
    assert!(first.terminate(Duration::from_secs(5)).unwrap().success(), "{}", first.log());
    wait_for_log(&third, "took over the pin directory");
    wait_for_log(&third, "reloaded the programs");

    // --force unloads under it, and says so.
    let out = kproxy(&pins.0, &["unload", "--force"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("unloading under PID {}", third.pid())), "{stderr}");
    assert!(!program.exists());
    third.terminate(Duration::from_secs(5)).unwrap();
}

/// `ip netns exec` gives the command a mount namespace of its own and mounts a fresh sysfs on
/// /sys, so /sys/fs/bpf is no bpffs there: kproxy would mount one of its own, which vanishes with
/// the process, pins, links and flows with it.
#[test]
fn a_private_bpffs_under_ip_netns_exec_is_refused_unless_allowed() {
    let sandbox = Sandbox::new("privbpf").expect("building the sandbox (needs root)");
    let manifests = empty_manifests(&sandbox);
    let pins = unique_pin_dir();
    let host_bpffs = std::fs::metadata("/sys/fs/bpf").unwrap().dev();
    let in_netns = |args: Vec<OsString>| {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", sandbox.node_netns()]).args(args);
        command
    };
    // Bounded: a kproxy that is not refused keeps running (the agent) or succeeds (load).
    let refused_here = |command: Command| {
        let process = sandbox.node_spawn_command(command).unwrap();
        let status = process.wait_timeout(Duration::from_secs(20)).unwrap();
        let log = process.log();
        let Some(status) = status else {
            process.kill().unwrap();
            panic!("not refused: it runs\n{log}");
        };
        assert!(!status.success(), "accepted: {log}");
        let pins = pins.display().to_string();
        for cause in [pins.as_str(), "mount namespace", "ip netns exec", "--allow-private-bpffs"] {
            assert!(log.contains(cause), "{cause:?} not named: {log}");
        }
    };
    refused_here(in_netns(agent_args(&pins, &manifests, &[])));
    let load: Vec<OsString> =
        [kproxy_bin().into(), "--pin-dir".into(), pins.clone().into_os_string(), "load".into()].into();
    refused_here(in_netns(load.clone()));

    // doctor there says the same.
    let mut doctor = load[..3].to_vec();
    doctor.extend(["doctor".into(), "--json".into()]);
    let out = in_netns(doctor).output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = report["checks"].as_array().unwrap().iter().find(|c| c["name"] == "bpffs-host").unwrap();
    assert_eq!(check["status"], "FAIL", "{check:#}");
    assert!(check["finding"].as_str().unwrap().contains("mount namespace"), "{check:#}");
    assert_eq!(out.status.code(), Some(1));

    // Allowed, the agent starts and warns; the bpffs kproxy mounted for itself is mode 0700.
    let agent = sandbox
        .node_spawn_command(in_netns(agent_args(&pins, &manifests, &["--allow-private-bpffs"])))
        .unwrap();
    wait_for_log(&agent, "adopted the maps' contents");
    assert!(agent.log().contains("pinning into a private bpffs"), "{}", agent.log());
    agent.terminate(Duration::from_secs(5)).unwrap();
    let mut load_and_stat: Vec<OsString> = vec!["sh".into(), "-c".into()];
    load_and_stat.push(
        format!(
            "{} --pin-dir {} load --interfaces 'kp-none-*' --allow-private-bpffs >&2 && stat -c %a /sys/fs/bpf",
            kproxy_bin().display(),
            pins.display()
        )
        .into(),
    );
    let out = in_netns(load_and_stat).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // bpffs always sets the sticky bit on its root; nobody but root may enter it.
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1700");

    // The host's bpffs was never touched.
    assert_eq!(std::fs::metadata("/sys/fs/bpf").unwrap().dev(), host_bpffs);
    assert!(!pins.exists(), "pins made in the private bpffs appeared on the host");
}
