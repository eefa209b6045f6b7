//! Builds proxy-ebpf for the BPF target with nightly (via aya-build) and leaves
//! the object in OUT_DIR, where `datapath.rs` embeds it into the binary.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    commit_for_build_info();
    let out_dir = std::env::var("OUT_DIR").context("OUT_DIR")?;
    let object = std::path::Path::new(&out_dir).join("proxy-ebpf");
    if !object.exists() {
        // With AYA_BUILD_SKIP=1 (host-only unit tests) nothing is built; an
        // empty object keeps the crate compiling and fails clearly at load.
        std::fs::write(&object, b"").context("placeholder eBPF object")?;
    }
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir).join("../proxy-ebpf");
    let ebpf_dir = ebpf_dir.canonicalize().with_context(|| format!("{}", ebpf_dir.display()))?;
    let root_dir = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package { name: "proxy-ebpf", root_dir, ..Default::default() }],
        aya_build::Toolchain::Nightly,
    )
    .context(
        "building the eBPF programs failed; `cargo xtask setup` installs nightly rust-src and bpf-linker",
    )
}

/// `KPROXY_GIT_COMMIT` for the binary (`kproxy_build_info{commit}`): the variable if the build sets
/// it (an image built without `.git`), else `git rev-parse --short HEAD`, else `unknown`.
fn commit_for_build_info() {
    println!("cargo:rerun-if-env-changed=KPROXY_GIT_COMMIT");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git").args(args).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
    };
    // A new commit moves HEAD or the branch it names; only existing files are watched (a missing
    // one would rerun this script, and so the eBPF build, every time).
    let watch = |file: &str| {
        let path = git(&["rev-parse", "--git-path", file]).filter(|p| std::path::Path::new(p).exists());
        if let Some(path) = path {
            println!("cargo:rerun-if-changed={path}");
        }
    };
    watch("HEAD");
    watch("packed-refs");
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&branch);
    }
    let commit = std::env::var("KPROXY_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=KPROXY_GIT_COMMIT={commit}");
}
