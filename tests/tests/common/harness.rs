//! A loaded, unpinned datapath for BPF_PROG_TEST_RUN tests: the real object
//! in this kernel (needs root), maps programmed through the agent's Syncer.
#![allow(dead_code)]

use std::net::Ipv4Addr;

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions},
};
use kproxy::{
    bpf,
    model::{BackendAddr, Desired, Frontend, ServiceName},
    net::Protocol,
    sync::Syncer,
};
use proxy_common::{
    inherited::{NfTuple, keys},
    maps::{AffinityKeyV4, AffinityValueV4, ConfigV4, CtEntryV4, CtKeyV4, InheritedFlowV4},
    stats::Stat,
};

/// TC_ACT_UNSPEC: "next program / pass".
pub const PASS: u32 = u32::MAX;

pub const CLIENT: [u8; 4] = [10, 244, 0, 2];
pub const WEB_VIP: [u8; 4] = [10, 96, 0, 100];
pub const DNS_VIP: [u8; 4] = [10, 96, 0, 10];
pub const WEB_BACKENDS: [[u8; 4]; 3] = [[10, 244, 0, 11], [10, 244, 0, 12], [10, 244, 0, 13]];
pub const DNS_BACKEND: [u8; 4] = [10, 244, 0, 21];

pub struct Harness {
    pub ebpf: Ebpf,
    pub syncer: Syncer,
    pub conntrack: HashMap<MapData, CtKeyV4, CtEntryV4>,
    pub stats: PerCpuArray<MapData, u64>,
    pub config: Array<MapData, ConfigV4>,
    pub affinity: HashMap<MapData, AffinityKeyV4, AffinityValueV4>,
    pub inherited: HashMap<MapData, CtKeyV4, InheritedFlowV4>,
    pub service_cidrs: Array<MapData, proxy_common::service_cidr::ServiceCidrsV4>,
}

pub fn frontend(
    name: &str,
    port_name: &str,
    vip: [u8; 4],
    port: u16,
    proto: Protocol,
    backends: &[([u8; 4], u16)],
) -> Frontend {
    Frontend::new(
        ServiceName { namespace: "default".into(), name: name.into() },
        port_name,
        Ipv4Addr::from(vip),
        port,
        proto,
        backends.iter().map(|(a, p)| BackendAddr { addr: Ipv4Addr::from(*a).into(), port: *p }).collect(),
    )
}

pub fn desired() -> Desired {
    let web: Vec<([u8; 4], u16)> = WEB_BACKENDS.iter().map(|a| (*a, 8080)).collect();
    Desired::new(vec![
        frontend("dns", "dns", DNS_VIP, 53, Protocol::Udp, &[(DNS_BACKEND, 53)]),
        frontend("web", "http", WEB_VIP, 80, Protocol::Tcp, &web),
        frontend("empty", "http", [10, 96, 0, 200], 80, Protocol::Tcp, &[]),
    ])
}

impl Harness {
    pub fn new() -> Self {
        Self::with(&desired())
    }

    pub fn with(desired: &Desired) -> Self {
        let mut ebpf =
            bpf::load_unpinned().expect("loading the datapath needs root and a BPF-capable kernel");
        let maps = bpf::Maps::from_ebpf(&mut ebpf).unwrap();
        let store = bpf::BpfStore::new(maps.services, maps.backends, maps.rev_nat, maps.names, maps.vips);
        let syncer = Syncer::with_store(store).unwrap();
        let mut harness = Self {
            ebpf,
            syncer,
            conntrack: maps.conntrack,
            stats: maps.stats,
            config: maps.config,
            affinity: maps.affinity,
            inherited: maps.inherited,
            service_cidrs: maps.service_cidrs,
        };
        harness.apply(desired);
        harness
    }

    /// Programs `desired` as the agent would.
    pub fn apply(&mut self, desired: &Desired) -> kproxy::sync::SyncReport {
        let report = self.syncer.apply(desired);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        report
    }

    pub fn run(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier = self.ebpf.program(program).unwrap().try_into().unwrap();
        test_run(prog, frame, None)
    }

    pub fn ingress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run("kproxy_ingress", frame)
    }

    pub fn egress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run("kproxy_egress", frame)
    }

    pub fn stat(&self, stat: Stat) -> u64 {
        self.stats.get(&(stat as u32), 0).unwrap().iter().sum()
    }

    /// Marks a flow netfilter translated, as the agent does from nf_conntrack: `orig` as the client
    /// sent it, `reply` as its replies arrive; `(addr, port)` pairs.
    pub fn mark_inherited(
        &mut self,
        proto: u8,
        orig: [([u8; 4], u16); 2],
        reply: [([u8; 4], u16); 2],
        open: bool,
    ) {
        let tuple = |t: [([u8; 4], u16); 2]| NfTuple {
            src: t[0].0,
            dst: t[1].0,
            sport: t[0].1.to_be_bytes(),
            dport: t[1].1.to_be_bytes(),
        };
        let (entries, n) = keys(proto, tuple(orig), tuple(reply), open);
        for (key, value) in &entries[..n] {
            self.inherited.insert(key, value, 0).unwrap();
        }
    }

    pub fn ct(&self, key: &CtKeyV4) -> Option<CtEntryV4> {
        self.conntrack.get(key, 0).ok()
    }
}

pub fn ct_key(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, proto: u8, direction: u8) -> CtKeyV4 {
    CtKeyV4 {
        saddr: src,
        daddr: dst,
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto,
        direction,
        _pad: [0; 2],
    }
}

/// TC_ACT_REDIRECT: the packet was bounced back out of its interface.
pub const BOUNCE: u32 = 7;
/// TC_ACT_SHOT.
pub const DROP: u32 = 2;

/// One BPF_PROG_TEST_RUN of a tc or XDP program on `frame` (with `ctx` as its context, when
/// given): its return value and the frame as it came out.
pub fn test_run<P>(prog: &P, frame: &[u8], ctx: Option<&[u8]>) -> (u32, Vec<u8>)
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>,
{
    let mut out = vec![0u8; frame.len() + 256];
    let result = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: ctx,
            ..Default::default()
        })
        .map_err(|e: ProgramError| format!("{e:?}"))
        .unwrap_or_else(|e| panic!("test run of a {}-byte frame {frame:02x?}: {e}", frame.len()));
    out.truncate(result.data_size_out as usize);
    (result.return_value, out)
}
