//! The pin directory cannot be turned against the host. bpffs at /sys/fs/bpf is mode 1777 when
//! mounted without `mode=` (as kproxy and the DaemonSet's init container mount it), so an
//! unprivileged user can create kproxy's pin directory before the agent starts — with `links` a
//! symlink to a root-only directory whose files `load` and `unload` would otherwise delete. kproxy
//! refuses such a tree and names the path; nothing outside the pin directory is touched. Needs
//! root (it runs the preparation as `nobody` with setpriv).

mod common;

use std::{
    os::unix::fs::{PermissionsExt as _, symlink},
    path::{Path, PathBuf},
    process::{Command, Output},
};

use common::cluster::{kproxy_bin, unique_pin_dir};

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
