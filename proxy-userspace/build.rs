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
    )?;
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    // A host-only build (AYA_BUILD_SKIP) builds nothing and needs no LLVM; an object left by an
    // earlier build was stripped then.
    let skipped = std::env::var_os("AYA_BUILD_SKIP").is_some_and(|v| v != "0" && !v.is_empty());
    if !skipped && std::fs::metadata(&object).is_ok_and(|m| m.len() > 0) {
        strip_debug(&object)?;
    }
    Ok(())
}

/// LLVM 22's objcopy, which bpf-linker's LLVM brings (Debian's llvm-22, as `cargo xtask setup` and the
/// Dockerfile install it).
const OBJCOPY: [&str; 2] = ["/usr/lib/llvm-22/bin/llvm-objcopy", "llvm-objcopy"];

/// Drops the object's DWARF (`.debug_*`, three quarters of its 2.9 MiB): the kernel reads the BTF
/// (`.BTF`, `.BTF.ext`'s line info for the verifier's messages), which bpf-linker made from it, and
/// nothing reads the DWARF; embedded, it was resident in every agent.
fn strip_debug(object: &std::path::Path) -> anyhow::Result<()> {
    for objcopy in OBJCOPY {
        match std::process::Command::new(objcopy).arg("--strip-debug").arg(object).status() {
            Ok(status) if status.success() => return Ok(()),
            Ok(status) => anyhow::bail!("{objcopy} --strip-debug {}: {status}", object.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("running {objcopy}")),
        }
    }
    anyhow::bail!("llvm-objcopy not found ({OBJCOPY:?}); `cargo xtask setup` installs LLVM 22")
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
