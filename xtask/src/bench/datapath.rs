//! ns per packet of the tc programs, through `BPF_PROG_TEST_RUN` on the real object.
//!
//! `BPF_PROG_TEST_RUN` with `repeat > 1` runs the program again and again on the *same* skb, and
//! the programs rewrite it: after the first DNAT the packet is addressed to the backend and every
//! later repetition is a service-map miss. So only the non-service packet (never rewritten) can
//! use the in-kernel loop; every case is also measured as K separate runs of a fresh frame with
//! `repeat = 1`, averaging the kernel-reported time of each run (that time includes about one
//! `ktime_get_ns` of timer overhead, which the two non-service rows show).
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf,
    maps::{HashMap, Map, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use kproxy::{
    bpf::{self, BpfStore, Capacities, Maps},
    model::{BackendAddr, Desired, Frontend, ServiceName},
    net::Protocol,
    sync::Syncer,
};
use proxy_common::{
    checksum,
    maps::*,
    maps_v6::{CtEntryV6, CtKeyV6},
};

use sandbox::constant_program;

use super::{
    imp::Ctx,
    rules,
    stats::{Measured, measured},
};

/// TC_ACT_UNSPEC (-1): pass on to the next program.
const PASS: u32 = u32::MAX;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const CLIENT: [u8; 4] = [10, 244, 0, 2];
const VIP: [u8; 4] = [10, 96, 0, 100];
const NOT_A_SERVICE: [u8; 4] = [10, 244, 0, 50];
const BACKENDS: [[u8; 4]; 3] = [[10, 244, 0, 11], [10, 244, 0, 12], [10, 244, 0, 13]];
const BACKEND_PORT: u16 = 8080;

/// The addresses of one family's cases: the client, the measured Service's cluster IP and backends, and
/// a pod address that is no Service.
struct Addrs {
    client: IpAddr,
    vip: IpAddr,
    not_a_service: IpAddr,
    backends: [IpAddr; 3],
}

fn addrs_v4() -> Addrs {
    Addrs {
        client: Ipv4Addr::from(CLIENT).into(),
        vip: Ipv4Addr::from(VIP).into(),
        not_a_service: Ipv4Addr::from(NOT_A_SERVICE).into(),
        backends: BACKENDS.map(|b| Ipv4Addr::from(b).into()),
    }
}

/// The same layout in IPv6: `fd00:10:244::<n>` pods, `fd00:10:96::100` the cluster IP.
fn addrs_v6() -> Addrs {
    let pod = |n: u16| IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, n));
    Addrs {
        client: pod(2),
        vip: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x100)),
        not_a_service: pod(0x50),
        backends: [pod(0x11), pod(0x12), pod(0x13)],
    }
}

/// `addr` + `n`, within its family.
fn offset(addr: IpAddr, n: u32) -> IpAddr {
    match addr {
        IpAddr::V4(a) => Ipv4Addr::from(u32::from(a) + n).into(),
        IpAddr::V6(a) => Ipv6Addr::from(u128::from(a) + u128::from(n)).into(),
    }
}
fn capacities() -> Capacities {
    Capacities {
        services: 500_000,
        backends: 400_000,
        // One rev-NAT id per frontend of either family, and FRONTEND_NAMES_V4 names them all: 100k
        // IPv4 and 100k IPv6 Services.
        rev_nat: 250_000,
        conntrack: 262_144,
        ..Default::default()
    }
}

pub const CASES: [&str; 8] = [
    "non-service packet (in-kernel loop)",
    "non-service packet",
    "new flow (DNAT + conntrack create)",
    "established flow (ingress)",
    "reply (egress un-NAT)",
    "non-service ACK (in-kernel loop)",
    "tc floor: a pass-all program (in-kernel loop)",
    "tc floor: a pass-all program",
];
pub const NEW_FLOW: usize = 2;
pub const ESTABLISHED: usize = 3;
pub const REPLY: usize = 4;
pub const NON_SERVICE_ACK: usize = 5;
/// The floor of any tc datapath, measured the same two ways: what `BPF_PROG_TEST_RUN` itself
/// costs (its loop, the skb, the timer), which every figure of kproxy's includes.
pub const FLOOR_LOOP: usize = 6;
pub const FLOOR_CALL: usize = 7;

/// The floor row a case is measured against: the in-kernel loop's or the per-call one.
pub const fn floor_of(case: usize) -> usize {
    if case == 0 || case == NON_SERVICE_ACK || case == FLOOR_LOOP { FLOOR_LOOP } else { FLOOR_CALL }
}

pub struct DatapathResult {
    pub sizes: Vec<usize>,
    /// `rows[case][size]`, ns per packet.
    pub rows: Vec<Vec<Measured>>,
    /// The same cases over IPv6 (an IPv6 cluster IP among as many IPv6 Services), `rows6[case][size]`.
    pub rows6: Vec<Vec<Measured>>,
    /// For each of [`FLAVOURS`] (at 1 Service): ns per packet of every case, or why it failed.
    pub flavours: Vec<Result<Vec<Measured>, String>>,
    pub repeat: u32,
    pub packets_per_run: usize,
    pub runs: usize,
    pub notes: Vec<String>,
}

/// A TCP segment in an Ethernet frame, of the addresses' family.
fn frame(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, flags: u8) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => tcp_frame(s.octets(), sport, d.octets(), dport, flags),
        (IpAddr::V6(s), IpAddr::V6(d)) => tcp_frame6(s.octets(), sport, d.octets(), dport, flags),
        _ => unreachable!("one family per frame"),
    }
}

fn tcp_segment(sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut seg = Vec::with_capacity(20);
    seg.extend_from_slice(&sport.to_be_bytes());
    seg.extend_from_slice(&dport.to_be_bytes());
    seg.extend_from_slice(&0x0102_0304u32.to_be_bytes());
    seg.extend_from_slice(&(if flags & TCP_ACK != 0 { 1u32 } else { 0 }).to_be_bytes());
    seg.extend_from_slice(&[5 << 4, flags]);
    seg.extend_from_slice(&64240u16.to_be_bytes());
    seg.extend_from_slice(&[0, 0, 0, 0]);
    seg
}

fn tcp_frame6(src: [u8; 16], sport: u16, dst: [u8; 16], dport: u16, flags: u8) -> Vec<u8> {
    let mut seg = tcp_segment(sport, dport, flags);
    let check = checksum::l4_checksum_v6(&src, &dst, IPPROTO_TCP, &seg);
    seg[16..18].copy_from_slice(&check.to_be_bytes());
    let mut frame = vec![0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x86, 0xdd];
    frame.extend_from_slice(&[0x60, 0, 0, 0]);
    frame.extend_from_slice(&(seg.len() as u16).to_be_bytes());
    frame.extend_from_slice(&[IPPROTO_TCP, 64]);
    frame.extend_from_slice(&src);
    frame.extend_from_slice(&dst);
    frame.extend_from_slice(&seg);
    frame
}

fn tcp_frame(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
    let mut seg = tcp_segment(sport, dport, flags);
    let check = checksum::l4_checksum(src, dst, IPPROTO_TCP, &seg);
    seg[16..18].copy_from_slice(&check.to_be_bytes());
    let total = (20 + seg.len()) as u16;
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&[0x1c, 0x46, 0x40, 0x00, 64, IPPROTO_TCP, 0, 0]);
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let check = checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&check.to_be_bytes());
    let mut frame = vec![0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x08, 0x00];
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&seg);
    frame
}

/// (source, sport, destination, dport) of a frame built by [`frame`].
fn addresses(frame: &[u8]) -> (IpAddr, u16, IpAddr, u16) {
    let ip = &frame[14..];
    let port = |at: usize| u16::from_be_bytes([ip[at], ip[at + 1]]);
    if frame[12..14] == [0x86, 0xdd] {
        let addr = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&ip[at..at + 16]).expect("16 bytes"));
        return (addr(8), port(40), addr(24), port(42));
    }
    let addr = |at: usize| IpAddr::from(<[u8; 4]>::try_from(&ip[at..at + 4]).expect("4 bytes"));
    (addr(12), port(20), addr(16), port(22))
}

struct Runner<'a> {
    ingress: &'a SchedClassifier,
    egress: &'a SchedClassifier,
    /// `return TC_ACT_UNSPEC`: the floor (`sandbox::constant_program`).
    floor: std::os::fd::OwnedFd,
    out: Vec<u8>,
}

impl Runner<'_> {
    /// One test run: (return value, kernel-reported mean ns per repetition, output frame).
    fn run(&mut self, egress: bool, frame: &[u8], repeat: u32) -> Result<(u32, f64, &[u8])> {
        let prog = if egress { self.egress } else { self.ingress };
        self.out.resize(frame.len() + 256, 0);
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut self.out),
                repeat,
                ..Default::default()
            })
            .map_err(|e| anyhow!("BPF_PROG_TEST_RUN: {e:?}"))?;
        let len = (result.data_size_out as usize).min(self.out.len());
        Ok((result.return_value, result.duration.as_nanos() as f64, &self.out[..len]))
    }

    /// The floor program on `frame`, `repeat` times in one call: kernel-reported ns per repetition.
    fn run_floor(&self, frame: &[u8], repeat: u32) -> Result<f64> {
        let (ret, ns) = constant_program::test_run(&self.floor, frame, repeat)?;
        if ret != PASS {
            bail!("the floor program returned {ret}");
        }
        Ok(f64::from(ns))
    }

    /// Mean kernel ns over `frames` (one run each), checking every result with `check`.
    fn mean(
        &mut self,
        egress: bool,
        frames: impl Iterator<Item = Vec<u8>>,
        check: impl Fn(u32, &[u8]) -> Result<()>,
    ) -> Result<f64> {
        let (mut total, mut n) = (0.0, 0usize);
        for frame in frames {
            let (ret, ns, out) = self.run(egress, &frame, 1)?;
            check(ret, out)?;
            total += ns;
            n += 1;
        }
        if n == 0 {
            bail!("no packet");
        }
        Ok(total / n as f64)
    }
}

fn second_handle(ebpf: &Ebpf, name: &str) -> Result<MapData> {
    let data = match ebpf.map(name).ok_or_else(|| anyhow!("map {name} missing"))? {
        Map::HashMap(d) | Map::LruHashMap(d) => d,
        _ => bail!("map {name} is not a hash map"),
    };
    Ok(MapData::from_id(data.info()?.id())?)
}

fn frontend(svc: &rules::Svc) -> Frontend {
    Frontend::new(
        ServiceName { namespace: rules::NAMESPACE.into(), name: svc.name.clone() },
        svc.port_name,
        svc.vip,
        svc.port,
        Protocol::Tcp,
        svc.endpoints.iter().map(|a| BackendAddr { addr: (*a).into(), port: svc.target_port }).collect(),
    )
}

fn measured_service() -> rules::Svc {
    rules::Svc {
        namespace: rules::NAMESPACE.into(),
        name: "web".into(),
        vip: Ipv4Addr::from(VIP),
        port: 80,
        proto: "TCP",
        port_name: "http",
        target_port: BACKEND_PORT,
        endpoints: BACKENDS.iter().map(|b| Ipv4Addr::from(*b)).collect(),
        ..rules::Svc::default()
    }
}

pub fn run(ctx: &Ctx) -> Result<DatapathResult> {
    let sizes: Vec<usize> = if ctx.quick { vec![1, 1_000, 10_000] } else { vec![1, 1_000, 10_000, 100_000] };
    let runs = ctx.runs();
    let repeat: u32 = if ctx.quick { 20_000 } else { 100_000 };
    let k: usize = if ctx.quick { 3_000 } else { 20_000 };
    let mut notes = Vec::new();

    let mut ebpf = bpf::load_unpinned_with(&capacities()).context("loading the datapath")?;
    let mut conntrack: HashMap<MapData, CtKeyV4, CtEntryV4> =
        HashMap::try_from(Map::LruHashMap(second_handle(&ebpf, MAP_CONNTRACK_V4)?))?;
    let mut conntrack6: HashMap<MapData, CtKeyV6, CtEntryV6> =
        HashMap::try_from(Map::LruHashMap(second_handle(&ebpf, proxy_common::maps_v6::MAP_CONNTRACK_V6)?))?;
    let maps = Maps::from_ebpf(&mut ebpf)?;
    let mut syncer = Syncer::with_store(BpfStore::from_maps(maps, false))?;
    let ingress: &SchedClassifier = ebpf.program(PROG_INGRESS).context("ingress program")?.try_into()?;
    let egress: &SchedClassifier = ebpf.program(PROG_EGRESS).context("egress program")?.try_into()?;
    let floor =
        constant_program::load(constant_program::BPF_PROG_TYPE_SCHED_CLS, PASS as i32, "bench_floor")?;
    let mut runner = Runner { ingress, egress, floor, out: Vec::new() };

    let web = measured_service();
    let v6 = addrs_v6();
    let web6 = {
        let mut web6 = frontend(&web);
        web6.vip = v6.vip;
        web6.backends = v6.backends.iter().map(|&addr| BackendAddr { addr, port: BACKEND_PORT }).collect();
        web6
    };
    let mut rows: Vec<Vec<Measured>> = vec![Vec::new(); CASES.len()];
    let mut rows6: Vec<Vec<Measured>> = vec![Vec::new(); CASES.len()];
    for &size in &sizes {
        ctx.check()?;
        // Program `size` Services through the agent's Syncer: the measured one among size - 1 others
        // (32-bit rev-NAT ids: no ceiling at 65,535 frontends).
        // As many IPv6 Services beside the measured IPv6 one (fd00:10:97::/64, backends in fd00:10:245::/64).
        let all = rules::cluster(size, std::slice::from_ref(&web));
        let fillers6 = (0..size as u32 - 1).map(|i| {
            let mut f = frontend(&rules::filler(i));
            f.vip = Ipv6Addr::from(0xfd00_0010_0097_0000_0000_0000_0000_0000u128 + u128::from(i)).into();
            f.backends = (0..3u32)
                .map(|j| {
                    let addr =
                        Ipv6Addr::from(0xfd00_0010_0245_0000_0000_0000_0000_0000u128 + u128::from(i * 3 + j));
                    BackendAddr { addr: addr.into(), port: BACKEND_PORT }
                })
                .collect();
            f
        });
        let wanted = all.iter().map(frontend).chain(fillers6).chain([web6.clone()]).collect();
        let started = std::time::Instant::now();
        let report = syncer.apply(&Desired::new(wanted));
        if !report.errors.is_empty() {
            // The first few name the cause; a full map fails every frontend after it.
            let first: Vec<String> = report.errors.iter().take(3).map(ToString::to_string).collect();
            bail!(
                "programming {size} Services failed ({} errors): {}",
                report.errors.len(),
                first.join("; ")
            );
        }
        if report.frontends_added > 1 {
            notes.push(format!(
                "The agent's Syncer added {} frontends ({} backends) in {:.2} s when growing to {size} Services.",
                report.frontends_added,
                report.backends_added,
                started.elapsed().as_secs_f64()
            ));
        }
        // The families' runs interleaved, so that both see the same machine.
        let mut samples: [Vec<Vec<f64>>; 2] = [vec![Vec::new(); CASES.len()], vec![Vec::new(); CASES.len()]];
        let mut errors: [Vec<Option<String>>; 2] = [vec![None; CASES.len()], vec![None; CASES.len()]];
        let v4 = addrs_v4();
        for _ in 0..runs {
            ctx.check()?;
            let outcomes = [
                one_run(&mut runner, &mut || clear_conntrack(&mut conntrack), &v4, repeat, k),
                one_run(&mut runner, &mut || clear_conntrack(&mut conntrack6), &v6, repeat, k),
            ];
            for (family, outcome) in outcomes.into_iter().enumerate() {
                for (case, result) in outcome.into_iter().enumerate() {
                    match result {
                        Ok(ns) => samples[family][case].push(ns),
                        Err(e) => errors[family][case] = Some(format!("{e:#}")),
                    }
                }
            }
        }
        for (family, rows) in [&mut rows, &mut rows6].into_iter().enumerate() {
            for case in 0..CASES.len() {
                rows[case].push(match &errors[family][case] {
                    Some(e) => Err(e.clone()),
                    None => measured(CASES[case], &samples[family][case]),
                });
            }
        }
        eprintln!(
            "bench: datapath at {size} Services: {}",
            CASES
                .iter()
                .zip(&rows)
                .map(|(c, r)| match r.last() {
                    Some(Ok(s)) => format!("{c} {:.0} ns", s.median),
                    _ => format!("{c} failed"),
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    drop(runner);
    drop(ebpf);
    let flavours = FLAVOURS
        .iter()
        .map(|&(name, map_type, flags)| {
            let result = flavour(ctx, map_type, flags, runs, repeat, k).map_err(|e| format!("{e:#}"));
            eprintln!(
                "bench: datapath, conntrack as {name}: {}",
                if result.is_ok() { "measured" } else { "failed" }
            );
            result
        })
        .collect();
    Ok(DatapathResult { sizes, rows, rows6, flavours, repeat, packets_per_run: k, runs, notes })
}

const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_NO_COMMON_LRU: u32 = 2;

/// Flavours of CONNTRACK_V4 measured on a copy of the object whose map definition says so (name,
/// map type, flags); the first is kproxy's own.
pub const FLAVOURS: [(&str, u32, u32); 4] = [
    ("LRU hash, one LRU list for all CPUs (kproxy's)", BPF_MAP_TYPE_LRU_HASH, 0),
    ("LRU hash, BPF_F_NO_COMMON_LRU (an LRU list per CPU)", BPF_MAP_TYPE_LRU_HASH, BPF_F_NO_COMMON_LRU),
    ("hash, preallocated (no eviction)", BPF_MAP_TYPE_HASH, 0),
    ("hash, BPF_F_NO_PREALLOC (no eviction)", BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC),
];

/// Rewrites the type and flags of the legacy map definition (`struct bpf_map_def`, in section
/// `maps`) of symbol `name` in a little-endian ELF64 object.
fn patch_map(object: &mut [u8], name: &str, map_type: u32, flags: u32) -> Result<()> {
    let u16_at = |o: &[u8], at: usize| o.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at =
        |o: &[u8], at: usize| o.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize);
    let u64_at =
        |o: &[u8], at: usize| o.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let bad = || anyhow!("not the ELF object expected");
    let o: &[u8] = object;
    let (table, entry) = (u64_at(o, 0x28).ok_or_else(bad)?, u16_at(o, 0x3a).ok_or_else(bad)?);
    let count = u16_at(o, 0x3c).ok_or_else(bad)?;
    // (type, offset, size, link) of section `i`.
    let section = |i: usize| -> Option<(usize, usize, usize, usize)> {
        let at = table + i * entry;
        Some((u32_at(o, at + 4)?, u64_at(o, at + 24)?, u64_at(o, at + 32)?, u32_at(o, at + 40)?))
    };
    const SHT_SYMTAB: usize = 2;
    let (_, symtab, symtab_size, strtab_index) =
        (0..count).filter_map(section).find(|s| s.0 == SHT_SYMTAB).ok_or_else(bad)?;
    let (_, strtab, _, _) = section(strtab_index).ok_or_else(bad)?;
    for sym in (symtab..symtab + symtab_size).step_by(24) {
        let name_at = strtab + u32_at(o, sym).ok_or_else(bad)?;
        let matches = o
            .get(name_at..name_at + name.len() + 1)
            .is_some_and(|n| &n[..name.len()] == name.as_bytes() && n[name.len()] == 0);
        if !matches {
            continue;
        }
        let (shndx, value, size) = (
            u16_at(o, sym + 6).ok_or_else(bad)?,
            u64_at(o, sym + 8).ok_or_else(bad)?,
            u64_at(o, sym + 16).ok_or_else(bad)?,
        );
        if size != 28 {
            bail!("{name} is not a legacy map definition ({size} bytes)");
        }
        let (_, offset, _, _) = section(shndx).ok_or_else(bad)?;
        let def = offset + value;
        object[def..def + 4].copy_from_slice(&map_type.to_le_bytes());
        object[def + 16..def + 20].copy_from_slice(&flags.to_le_bytes());
        return Ok(());
    }
    bail!("no symbol {name} in the object")
}

/// Every case at 1 Service on a datapath whose conntrack map is of `map_type` with `flags`.
fn flavour(
    ctx: &Ctx,
    map_type: u32,
    flags: u32,
    runs: usize,
    repeat: u32,
    k: usize,
) -> Result<Vec<Measured>> {
    let mut ebpf = bpf::load_unpinned_patched(&capacities(), |object| {
        patch_map(object, MAP_CONNTRACK_V4, map_type, flags)
    })
    .context("loading the datapath with another conntrack map")?;
    let maps = Maps::from_ebpf(&mut ebpf)?;
    let mut conntrack = maps.conntrack;
    let mut syncer =
        Syncer::with_store(BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips))?;
    let report = syncer.apply(&Desired::new(vec![frontend(&measured_service())]));
    if !report.errors.is_empty() {
        bail!("programming the Service failed");
    }
    let ingress: &SchedClassifier = ebpf.program(PROG_INGRESS).context("ingress program")?.try_into()?;
    let egress: &SchedClassifier = ebpf.program(PROG_EGRESS).context("egress program")?.try_into()?;
    let floor =
        constant_program::load(constant_program::BPF_PROG_TYPE_SCHED_CLS, PASS as i32, "bench_floor")?;
    let mut runner = Runner { ingress, egress, floor, out: Vec::new() };
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    for _ in 0..runs {
        ctx.check()?;
        let outcome = one_run(&mut runner, &mut || clear_conntrack(&mut conntrack), &addrs_v4(), repeat, k);
        for (case, result) in outcome.into_iter().enumerate() {
            samples[case].push(result?);
        }
    }
    Ok(samples.iter().enumerate().map(|(case, s)| measured(CASES[case], s)).collect())
}

fn clear_conntrack<K: aya::Pod, V: aya::Pod>(conntrack: &mut HashMap<MapData, K, V>) -> Result<()> {
    let keys: Vec<K> = conntrack.keys().collect::<Result<_, _>>()?;
    for key in keys {
        let _ = conntrack.remove(&key);
    }
    Ok(())
}

/// One run of every case for one family's addresses; ns per packet or why the case failed.
/// `clear_conntrack` empties that family's conntrack map.
fn one_run(
    runner: &mut Runner<'_>,
    clear_conntrack: &mut dyn FnMut() -> Result<()>,
    addrs: &Addrs,
    repeat: u32,
    k: usize,
) -> Vec<Result<f64>> {
    let mut out = Vec::new();
    let pass_unchanged = |frame: Vec<u8>| {
        move |ret: u32, out: &[u8]| {
            if ret != PASS || out != frame.as_slice() {
                bail!("a non-service packet came back changed or not passed (return {ret})");
            }
            Ok(())
        }
    };
    let (client, vip) = (addrs.client, addrs.vip);
    let other = frame(client, 40_000, addrs.not_a_service, 80, TCP_SYN);
    out.push(
        runner
            .run(false, &other, repeat)
            .and_then(|(ret, ns, _)| if ret == PASS { Ok(ns) } else { bail!("return {ret}") }),
    );
    out.push(runner.mean(false, std::iter::repeat_n(other.clone(), k), pass_unchanged(other.clone())));

    let backends = addrs.backends;
    let dnat_check = move |ret: u32, out: &[u8]| {
        let (_, _, dst, dport) = addresses(out);
        if ret != PASS || !backends.contains(&dst) || dport != BACKEND_PORT {
            bail!("a packet to the ClusterIP was not DNATed to a backend (return {ret}, dst {dst}:{dport})");
        }
        Ok(())
    };
    out.push(clear_conntrack().and_then(|()| {
        let frames = (0..k).map(|i| {
            let i = i as u32;
            frame(offset(client, i / 50_000), 10_000 + (i % 50_000) as u16, vip, 80, TCP_SYN)
        });
        runner.mean(false, frames, dnat_check)
    }));

    // One flow: SYN, SYN-ACK, then K established packets each way.
    let flow = clear_conntrack().and_then(|()| {
        let syn = frame(client, 40_001, vip, 80, TCP_SYN);
        let (ret, _, dnated) = runner.run(false, &syn, 1)?;
        dnat_check(ret, dnated)?;
        let (_, _, backend, _) = addresses(dnated);
        let syn_ack = frame(backend, BACKEND_PORT, client, 40_001, TCP_SYN | TCP_ACK);
        let (ret, _, unnated) = runner.run(true, &syn_ack, 1)?;
        if ret != PASS || addresses(unnated).0 != vip {
            bail!("the SYN-ACK was not un-NATed (return {ret})");
        }
        Ok(backend)
    });
    match flow {
        Ok(backend) => {
            let ack = frame(client, 40_001, vip, 80, TCP_ACK);
            out.push(runner.mean(false, std::iter::repeat_n(ack, k), move |ret, o| {
                if ret != PASS || addresses(o).2 != backend {
                    bail!("an established packet did not go to its backend (return {ret})");
                }
                Ok(())
            }));
            let reply = frame(backend, BACKEND_PORT, client, 40_001, TCP_ACK);
            out.push(runner.mean(true, std::iter::repeat_n(reply, k), |ret, o| {
                if ret != PASS || addresses(o).0 != vip || addresses(o).1 != 80 {
                    bail!("a reply was not un-NATed to the ClusterIP (return {ret})");
                }
                Ok(())
            }));
        }
        Err(e) => {
            out.push(Err(anyhow!("setting up the flow: {e:#}")));
            out.push(Err(anyhow!("setting up the flow: {e:#}")));
        }
    }
    // A segment of an established connection to a pod: most of a node's packets. It opens no flow,
    // so unlike the SYN above it cannot clash with a translated flow's reply tuple.
    let ack = frame(client, 40_002, addrs.not_a_service, 80, TCP_ACK);
    out.push(runner.run(false, &ack, repeat).and_then(|(ret, ns, out)| {
        if ret == PASS && out == ack.as_slice() { Ok(ns) } else { bail!("return {ret}") }
    }));
    out.push(runner.run_floor(&ack, repeat));
    out.push((|| {
        let mut total = 0.0;
        for _ in 0..k {
            total += runner.run_floor(&ack, 1)?;
        }
        Ok(total / k as f64)
    })());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_have_valid_checksums() {
        let v4 = addrs_v4();
        let f = frame(v4.client, 1234, v4.vip, 80, TCP_SYN);
        assert_eq!(f.len(), 14 + 20 + 20);
        assert!(checksum::is_valid(checksum::add_words(0, &f[14..34])));
        let sum = checksum::pseudo_header_sum(CLIENT, VIP, IPPROTO_TCP, 20);
        assert!(checksum::is_valid(checksum::add_words(sum, &f[34..])));
        assert_eq!(addresses(&f), (v4.client, 1234, v4.vip, 80));

        let v6 = addrs_v6();
        let f = frame(v6.client, 1234, v6.vip, 80, TCP_SYN);
        assert_eq!(f.len(), 14 + 40 + 20);
        let (IpAddr::V6(client), IpAddr::V6(vip)) = (v6.client, v6.vip) else { unreachable!() };
        let sum = checksum::pseudo_header_sum_v6(&client.octets(), &vip.octets(), IPPROTO_TCP, 20);
        assert!(checksum::is_valid(checksum::add_words(sum, &f[54..])));
        assert_eq!(addresses(&f), (v6.client, 1234, v6.vip, 80));
        assert_eq!(offset(v6.client, 3), "fd00:10:244::5".parse::<IpAddr>().unwrap());
    }
}
