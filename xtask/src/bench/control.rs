//! The control plane at 10k Services × 3 endpoints: initial sync from manifests and from the
//! API server, one endpoint change, the agent's peak RSS; beside `iptables-restore` of the
//! equivalent kube-proxy ruleset. Everything runs in a sandbox's node namespace (the API server
//! listens on 127.0.0.1 there), the agent attaches to no interface.
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{HashMap, MapData};
use kproxy::bpf::{Maps, PinDir};
use proxy_common::maps::{IPPROTO_TCP, SCOPE_CLUSTER_IP, ServiceKeyV4, ServiceValueV4};
use sandbox::{Sandbox, Spawned, apiserver::ApiServer, find_tool};

use super::{
    imp::Ctx,
    rules::{self, Svc},
    stats::{Measured, Summary, measured, percentile},
};

pub const PIN_DIR: &str = "/sys/fs/bpf/kproxy-bench-cp";
const SYNC_TIMEOUT: Duration = Duration::from_secs(180);

pub struct ControlResult {
    pub services: usize,
    pub runs: usize,
    /// Seconds from agent start until the last frontend is in the map.
    pub sync_manifests: Measured,
    pub sync_api: Measured,
    /// VmHWM in MiB.
    pub rss_manifests: Measured,
    pub rss_api: Measured,
    /// ms: (p50, p99, max, changes)
    pub change: Result<(f64, f64, f64, usize), String>,
    /// Seconds.
    pub iptables_restore: Measured,
    pub notes: Vec<String>,
}

struct Unload;

impl Drop for Unload {
    fn drop(&mut self) {
        let _ = kproxy::bpf::unload(&PinDir::new(PIN_DIR));
    }
}

fn key(svc: &Svc) -> ServiceKeyV4 {
    ServiceKeyV4::new(svc.vip.octets(), svc.port.to_be_bytes(), IPPROTO_TCP, SCOPE_CLUSTER_IP, 0)
}

fn vm_hwm_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kb / 1024.0)
}

struct Agent<'a> {
    ctx: &'a Ctx,
    sandbox: &'a Sandbox,
}

impl Agent<'_> {
    fn spawn(&self, source: &[&str]) -> Result<Spawned> {
        let bin = self.ctx.kproxy.to_string_lossy().into_owned();
        let mut args = vec![bin.as_str(), "--pin-dir", PIN_DIR, "agent"];
        args.extend_from_slice(source);
        // Control-plane figures only: no socket hooks, no cgroup of the machine's touched, no
        // servers; changes 100 ms apart are each their own sync (the default is kube-proxy's 1 s).
        args.extend([
            "--interfaces",
            "nomatch",
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "",
            "--socket-lb",
            "off",
            "--min-sync-period",
            "50ms",
        ]);
        self.sandbox.node_spawn(args)
    }

    /// Starts the agent on empty pins and waits for `last` to be programmed: (seconds, the
    /// running agent, its services map).
    fn sync(
        &self,
        source: &[&str],
        last: &Svc,
    ) -> Result<(f64, Spawned, HashMap<MapData, ServiceKeyV4, ServiceValueV4>)> {
        kproxy::bpf::unload(&PinDir::new(PIN_DIR))?;
        let started = Instant::now();
        let agent = self.spawn(source)?;
        let pins = PinDir::new(PIN_DIR);
        let key = key(last);
        let mut services = None;
        loop {
            if started.elapsed() > SYNC_TIMEOUT {
                bail!("no sync within {SYNC_TIMEOUT:?}; agent log:\n{}", agent.log());
            }
            self.ctx.check()?;
            if services.is_none() {
                if pins.is_loaded() {
                    services = Maps::from_pins(&pins).ok().map(|m| m.services);
                }
                if !agent.is_running() {
                    bail!("the agent exited:\n{}", agent.log());
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            let map = services.as_ref().expect("set above");
            if map.get(&key, 0).is_ok_and(|v| v.count == last.endpoints.len() as u16) {
                let seconds = started.elapsed().as_secs_f64();
                return Ok((seconds, agent, services.expect("set above")));
            }
            if !agent.is_running() {
                bail!("the agent exited:\n{}", agent.log());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// `KPROXY_BENCH_CONTROL_SERVICES` sets the number of Services (e.g. the 10k with `--quick`'s
/// fewer runs and changes); otherwise 2k with `--quick`, 10k without.
pub const SERVICES_ENV: &str = "KPROXY_BENCH_CONTROL_SERVICES";

fn services(ctx: &Ctx) -> Result<usize> {
    match std::env::var(SERVICES_ENV) {
        Ok(v) => v.parse().with_context(|| format!("{SERVICES_ENV}={v}: expected a number of Services")),
        Err(_) => Ok(if ctx.quick { 2_000 } else { 10_000 }),
    }
}

pub fn run(ctx: &Ctx) -> Result<ControlResult> {
    let n = services(ctx)?;
    let runs = ctx.runs();
    let sandbox = Sandbox::new("bench-cp")?;
    let _unload = Unload;
    let svcs = rules::cluster(n, &[]);
    let last = svcs.last().context("no Services")?.clone();
    let dir = sandbox.dir().join("manifests");
    std::fs::create_dir_all(&dir)?;
    super::e2e::write_manifests(&dir, &svcs)?;
    let agent = Agent { ctx, sandbox: &sandbox };
    let mut notes = Vec::new();

    // (a) from manifests.
    let (mut times, mut rss, mut error) = (Vec::new(), Vec::new(), None);
    let dir_arg = dir.to_string_lossy().into_owned();
    for _ in 0..runs {
        ctx.check()?;
        match agent.sync(&["--manifests", &dir_arg], &last) {
            Ok((seconds, spawned, _)) => {
                times.push(seconds);
                std::thread::sleep(Duration::from_millis(300));
                rss.extend(vm_hwm_mib(spawned.pid()));
                let _ = spawned.terminate(Duration::from_secs(5));
            }
            Err(e) => error = Some(format!("{e:#}")),
        }
        eprintln!("bench: control plane: sync from manifests {:?}", times.last());
    }
    let sync_manifests = match &error {
        Some(e) if times.is_empty() => Err(e.clone()),
        _ => measured("sync", &times),
    };
    let rss_manifests = measured("RSS", &rss);

    // (b) from the API server, then one endpoint change at a time.
    let (sync_api, rss_api, change) = match from_api(ctx, &agent, &sandbox, &svcs, &last, runs) {
        Ok(r) => r,
        Err(e) => {
            let e = format!("{e:#}");
            (Err(e.clone()), Err(e.clone()), Err(e))
        }
    };

    let iptables_restore =
        iptables_restore(ctx, &sandbox, &svcs, runs).unwrap_or_else(|e| Err(format!("{e:#}")));
    let lines = rules::kube_proxy_ruleset(&svcs, "10.244.0.0/16").lines().count();
    notes.push(format!(
        "The kube-proxy ruleset for {n} Services × 3 endpoints has {lines} lines (nat table)."
    ));
    Ok(ControlResult {
        services: n,
        runs,
        sync_manifests,
        sync_api,
        rss_manifests,
        rss_api,
        change,
        iptables_restore,
        notes,
    })
}

type ApiResults = (Measured, Measured, Result<(f64, f64, f64, usize), String>);

fn from_api(
    ctx: &Ctx,
    agent: &Agent<'_>,
    sandbox: &Sandbox,
    svcs: &[Svc],
    last: &Svc,
    runs: usize,
) -> Result<ApiResults> {
    let api = ApiServer::start_in_netns(&sandbox.node_netns_path())?;
    for svc in svcs {
        api.apply(rules::service_json(svc));
        api.apply(rules::slice_json(svc, &svc.endpoints));
    }
    let url = api.url();
    let (mut times, mut rss, mut error) = (Vec::new(), Vec::new(), None);
    let mut change = Err("no agent synced".to_owned());
    for run in 0..runs {
        ctx.check()?;
        match agent.sync(&["--master", &url], last) {
            Ok((seconds, spawned, services)) => {
                times.push(seconds);
                std::thread::sleep(Duration::from_millis(300));
                if run + 1 == runs {
                    change = changes(
                        ctx,
                        &api,
                        &services,
                        &svcs[svcs.len() / 2],
                        if ctx.quick { 30 } else { 100 },
                    )
                    .map_err(|e| format!("{e:#}"));
                }
                rss.extend(vm_hwm_mib(spawned.pid()));
                let _ = spawned.terminate(Duration::from_secs(5));
            }
            Err(e) => error = Some(format!("{e:#}")),
        }
        eprintln!("bench: control plane: sync from the API server {:?}", times.last());
    }
    let sync = match &error {
        Some(e) if times.is_empty() => Err(e.clone()),
        _ => measured("sync", &times),
    };
    Ok((sync, measured("RSS", &rss), change))
}

/// `count` endpoint changes of `svc` (3 → 2 → 3 … endpoints), each timed from `api.apply` until
/// slot 0 of its frontend shows the new count: (p50, p99, max) in ms.
fn changes(
    ctx: &Ctx,
    api: &ApiServer,
    services: &HashMap<MapData, ServiceKeyV4, ServiceValueV4>,
    svc: &Svc,
    count: usize,
) -> Result<(f64, f64, f64, usize)> {
    let key = key(svc);
    let mut latencies = Vec::new();
    for i in 0..count {
        ctx.check()?;
        let endpoints = if i % 2 == 0 { &svc.endpoints[..2] } else { &svc.endpoints[..] };
        let started = Instant::now();
        api.apply(rules::slice_json(svc, endpoints));
        loop {
            if services.get(&key, 0).is_ok_and(|v| usize::from(v.count) == endpoints.len()) {
                latencies.push(started.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("change {i} not programmed within 10 s");
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        // More than the agent's --min-sync-period (50ms, given): each change is its own sync.
        std::thread::sleep(Duration::from_millis(100));
    }
    let p = |q| percentile(&latencies, q).unwrap_or(f64::NAN);
    let max = Summary::of(&latencies).map_or(f64::NAN, |s| s.max);
    Ok((p(50.0), p(99.0), max, latencies.len()))
}

fn iptables_restore(ctx: &Ctx, sandbox: &Sandbox, svcs: &[Svc], runs: usize) -> Result<Measured> {
    let dir: PathBuf = sandbox.dir().to_path_buf();
    let file = dir.join("kube-proxy.rules");
    std::fs::write(&file, rules::kube_proxy_ruleset(svcs, "10.244.0.0/16"))?;
    let empty = dir.join("empty.rules");
    std::fs::write(&empty, rules::EMPTY_NAT)?;
    let restore = find_tool("iptables-restore")?;
    let mut times = Vec::new();
    for _ in 0..runs {
        ctx.check()?;
        sandbox.node_exec([restore.as_os_str(), empty.as_os_str()])?;
        let started = Instant::now();
        sandbox.node_exec([restore.as_os_str(), Path::new(&file).as_os_str()])?;
        times.push(started.elapsed().as_secs_f64());
        eprintln!("bench: control plane: iptables-restore {:?}", times.last());
    }
    Ok(measured("iptables-restore", &times))
}
