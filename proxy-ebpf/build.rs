//! Rebuild when bpf-linker changes (it is the linker of this crate's target).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
    // bpf-linker passes --bpf-expand-memcpy-in-order to LLVM by default, which also turns every
    // memset (a struct zeroed field by field, `[0; N]`) into a call to aya-ebpf's byte loop.
    // The verifier accepts a loop moving a stack pointer by its counter only from CAP_PERFMON
    // holders ("pointer arithmetic with it prohibited for !root"); inline stores, as clang
    // emits them by default, need CAP_BPF alone.
    println!("cargo:rustc-link-arg=--disable-expand-memcpy-in-order");
}
