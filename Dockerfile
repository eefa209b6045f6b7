# syntax=docker/dockerfile:1
#
# The kproxy image: `docker build -t REGISTRY/kproxy:0.1.0 .` from the workspace root.
# Not built in CI (there is no container engine there); see docs/deploy.md.

# --- build: the same toolchain `cargo xtask setup` installs on a developer machine.
FROM rust:1.95-bookworm AS build
ENV DEBIAN_FRONTEND=noninteractive
# LLVM 22 for bpf-linker. Debian ships it for bookworm through bookworm-security
# (1:22.x~deb12u1), which the rust image's apt sources already list.
RUN apt-get update \
    && apt-get install -y --no-install-recommends llvm-22-dev libpolly-22-dev \
    && rm -rf /var/lib/apt/lists/*
# The eBPF crate is built with nightly and -Z build-std=core (proxy-userspace's build.rs).
RUN rustup toolchain install nightly --profile minimal --component rust-src
RUN PATH=/usr/lib/llvm-22/bin:$PATH \
    cargo install --locked bpf-linker --no-default-features --features llvm-22
WORKDIR /src
COPY . .
# The eBPF object is embedded in the binary: the runtime image needs nothing else.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p proxy-userspace \
    && install -m 0755 target/release/kproxy /usr/local/bin/kproxy

# --- runtime
FROM debian:bookworm-slim
# iproute2 and mount: the bpffs init container and debugging (`ip link`, `tc`);
# iptables and nftables: `kproxy cleanup-kube-proxy`, run with kubectl exec.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 mount iptables nftables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/kproxy /usr/local/bin/kproxy
ENTRYPOINT ["/usr/local/bin/kproxy"]
CMD ["--help"]
