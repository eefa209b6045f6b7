//! End to end in a network-namespace sandbox: wrk (new connections and keep-alive requests) and
//! dnsperf (UDP DNS) from a client pod, (a) to a pod IP with no proxy, (a') the same with a
//! pass-all tc program on every pod veth (the floor), (b) to the ClusterIP through kproxy and
//! (a'') to the pod IP with kproxy attached, (c) to the ClusterIP through kube-proxy-shaped
//! iptables rules, (d) and (d') through kproxy's socket LB with and without tc on the pod veths,
//! at N Services.
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use kproxy::bpf::{Maps, PinDir};
use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP, SCOPE_CLUSTER_IP, ServiceKeyV4};
use sandbox::{Pod, QueryLog, Sandbox, find_tool};

use super::{
    imp::Ctx,
    rules::{self, Svc},
    stats::{Measured, measured},
};

pub const PIN_DIR: &str = "/sys/fs/bpf/kproxy-bench";
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 21);
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 100);
const DNS_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const WEB_PORT: u16 = 8080;
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const WRK_CONNECTIONS: &str = "16";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path3 {
    /// (a) the pod IP, no proxy.
    Direct,
    /// (a') the pod IP with a pass-all (TC_ACT_OK) program on both directions of every pod veth:
    /// the floor of any tc datapath.
    Floor,
    /// (a'') the pod IP with kproxy attached (tc on the pod veths, N Services programmed).
    KproxyPodIp,
    /// (b) the ClusterIP through kproxy.
    Kproxy,
    /// (c) the ClusterIP through kube-proxy's iptables rules.
    Iptables,
    /// (d) the ClusterIP through kproxy's socket-level load balancing (the client in a cgroup
    /// with the connect/sendmsg hooks): translated once per connection, no per-packet NAT, but
    /// the tc programs still on every pod veth (`--pod-veth-tc on`).
    SocketLb,
    /// (d') socket LB with no per-packet program: every pod's processes in the hooks' cgroup and
    /// `--pod-veth-tc auto` (asked for: the default is `on`), so the agent leaves the pod veths without tc.
    SocketLbNoTc,
}

/// How the agent of a kproxy path runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// tc on the pod veths, no socket hooks: (b) and (a'').
    Tc,
    /// (d).
    SocketLbTc,
    /// (d').
    SocketLbOnly,
}

pub struct Row {
    pub path: Path3,
    pub services: usize,
    /// New connections per second (wrk, `Connection: close`).
    pub close: Measured,
    /// Requests per second on kept-alive connections.
    pub keepalive: Measured,
    /// UDP DNS queries per second (dnsperf).
    pub dns: Measured,
}

pub struct E2eResult {
    pub sizes: Vec<usize>,
    pub rows: Vec<Row>,
    pub seconds: u64,
    pub dns_seconds: u64,
    pub runs: usize,
    pub notes: Vec<String>,
}

/// Unpins the benchmark's datapath when dropped (also on panic).
struct Unload(PathBuf);

impl Drop for Unload {
    fn drop(&mut self) {
        let _ = kproxy::bpf::unload(&PinDir::new(&self.0));
    }
}

fn web_svc(target_port: u16) -> Svc {
    Svc {
        namespace: rules::NAMESPACE.into(),
        name: "web".into(),
        vip: WEB_VIP,
        port: 80,
        proto: "TCP",
        port_name: "http",
        target_port,
        endpoints: vec![WEB_IP],
        ..Svc::default()
    }
}

fn dns_svc() -> Svc {
    Svc {
        namespace: rules::NAMESPACE.into(),
        name: "kube-dns".into(),
        vip: DNS_VIP,
        port: 53,
        proto: "UDP",
        port_name: "dns",
        target_port: 53,
        endpoints: vec![DNS_IP],
        ..Svc::default()
    }
}

struct Bench<'a> {
    ctx: &'a Ctx,
    sandbox: &'a Sandbox,
    client: &'a Pod,
    web: &'a Pod,
    /// nginx port of the next configuration.
    next_port: u16,
    dns_queries: PathBuf,
    seconds: u64,
    dns_seconds: u64,
    notes: Vec<String>,
    /// The cgroup the client's load generators run in (socket LB), if any.
    cgroup: Option<sandbox::cgroup::ChildCgroup>,
    /// The kproxy binary has `--pod-veth-tc` (socket LB without tc on covered pods' veths).
    pod_veth_tc: bool,
    /// The pods' network namespaces (client, web, dns), for (d'): their processes join the cgroup.
    pod_netns: Vec<PathBuf>,
    /// The pods' host-side veths.
    pod_veths: Vec<String>,
}

/// The number after `label` on a line of `text` (e.g. `Requests/sec:  1234.5`).
fn number_after(text: &str, label: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix(label)?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

impl Bench<'_> {
    /// Runs a load generator in the client pod, inside [`Bench::cgroup`] when set (`sh` joins
    /// it, then enters the pod's network namespace).
    fn client_exec(&self, args: &[String]) -> Result<String> {
        let Some(cgroup) = &self.cgroup else { return self.client.exec(args) };
        let out = cgroup
            .command(self.client.netns(), args)
            .output()
            .context("running a load generator in the bench cgroup")?;
        if !out.status.success() {
            bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn wrk(&self, url: &str, close: bool) -> Result<f64> {
        let wrk = find_tool("wrk")?.to_string_lossy().into_owned();
        let mut args =
            vec![wrk, "-t1".into(), format!("-c{WRK_CONNECTIONS}"), format!("-d{}s", self.seconds)];
        args.extend(["--timeout".into(), "2s".into()]);
        if close {
            args.extend(["-H".into(), "Connection: close".into()]);
        }
        args.push(url.into());
        let out = self.client_exec(&args)?;
        let rate =
            number_after(&out, "Requests/sec:").with_context(|| format!("no rate in wrk output:\n{out}"))?;
        let requests = out
            .lines()
            .find(|l| l.contains("requests in"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(0.0);
        if let Some(line) = out.lines().find(|l| l.contains("Socket errors") || l.contains("Non-2xx")) {
            let errors: f64 = line
                .split_once(':')
                .map_or("", |(_, counts)| counts)
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse::<f64>().ok())
                .sum::<f64>()
                .max(0.0);
            if errors > 0.01 * requests.max(1.0) {
                bail!("wrk {url}: {} ({requests} requests)", line.trim());
            }
        }
        Ok(rate)
    }

    fn dnsperf(&self, server: Ipv4Addr) -> Result<f64> {
        let dnsperf = find_tool("dnsperf")?.to_string_lossy().into_owned();
        let args = vec![
            dnsperf,
            "-s".into(),
            server.to_string(),
            "-d".into(),
            self.dns_queries.to_string_lossy().into_owned(),
            "-l".into(),
            self.dns_seconds.to_string(),
            "-c".into(),
            "4".into(),
            "-q".into(),
            "64".into(),
            "-t".into(),
            "1".into(),
        ];
        let out = self.client_exec(&args)?;
        let qps = number_after(&out, "Queries per second:")
            .with_context(|| format!("no rate in dnsperf output:\n{out}"))?;
        if let Some(lost) = number_after(&out, "Queries lost:")
            && let Some(sent) = number_after(&out, "Queries sent:")
            && lost > 0.01 * sent
        {
            bail!("dnsperf @{server}: {lost} of {sent} queries lost");
        }
        Ok(qps)
    }

    /// `runs` rounds of (close, keep-alive, DNS) against `web_url` / `dns`.
    fn measure(&mut self, path: Path3, services: usize, web_url: &str, dns: Ipv4Addr) -> Row {
        let (mut close, mut keepalive, mut qps) = (Vec::new(), Vec::new(), Vec::new());
        let mut errors: [Option<String>; 3] = [None, None, None];
        for _ in 0..self.ctx.runs() {
            if self.ctx.check().is_err() {
                break;
            }
            let results = [self.wrk(web_url, true), self.wrk(web_url, false), self.dnsperf(dns)];
            for ((result, sink), error) in
                results.into_iter().zip([&mut close, &mut keepalive, &mut qps]).zip(&mut errors)
            {
                match result {
                    Ok(v) => sink.push(v),
                    Err(e) => *error = Some(format!("{e:#}")),
                }
            }
        }
        let finish = |values: &[f64], error: &Option<String>, what: &str| match error {
            Some(e) if values.len() < self.ctx.runs() => Err(e.clone()),
            _ => measured(what, values),
        };
        let row = Row {
            path,
            services,
            close: finish(&close, &errors[0], "new connections"),
            keepalive: finish(&keepalive, &errors[1], "keep-alive requests"),
            dns: finish(&qps, &errors[2], "DNS queries"),
        };
        let show = |m: &Measured| m.as_ref().map_or("failed".to_owned(), |s| format!("{:.0}", s.median));
        eprintln!(
            "bench: e2e {path:?} N={services}: {} conn/s, {} req/s keep-alive, {} DNS q/s",
            show(&row.close),
            show(&row.keepalive),
            show(&row.dns)
        );
        row
    }

    fn failed_row(path: Path3, services: usize, error: &anyhow::Error) -> Row {
        let e = format!("{error:#}");
        Row { path, services, close: Err(e.clone()), keepalive: Err(e.clone()), dns: Err(e) }
    }

    /// Sanity check before measuring: the ClusterIP answers (from inside [`Bench::cgroup`] when
    /// set, as the load generators: without tc only the socket hooks translate).
    fn check_vip(&self) -> Result<()> {
        let curl = find_tool("curl")?.to_string_lossy().into_owned();
        let url = format!("http://{WEB_VIP}/");
        self.client_exec(&[curl, "-sS".into(), "--max-time".into(), "5".into(), url])
            .context("curl through the ClusterIP")?;
        let dig = find_tool("dig")?.to_string_lossy().into_owned();
        let answer = self
            .client_exec(&[
                dig,
                "+short".into(),
                "+time=2".into(),
                "+tries=1".into(),
                format!("@{DNS_VIP}"),
                "web.default.svc.cluster.local".into(),
                "A".into(),
            ])
            .context("dig through the ClusterIP")?;
        if answer.trim() != WEB_VIP.to_string() {
            bail!("dig through the ClusterIP answered {answer:?}");
        }
        Ok(())
    }

    /// A fresh nginx on its own port for each configuration: with `Connection: close` the
    /// server closes first and keeps TIME_WAIT for each client port, and a SYN from another path
    /// (another timestamp offset) reusing such a 4-tuple would wait for a retransmission.
    fn new_backend(&mut self) -> Result<u16> {
        let port = self.next_port;
        self.next_port += 1;
        self.web.start_nginx_on(port, "ok\n")?;
        Ok(port)
    }

    /// (b), then (a'') with the same agent.
    fn kproxy(&mut self, services: usize, dir: &Path) -> Result<Vec<Row>> {
        self.kproxy_with(services, dir, Mode::Tc, None)
    }

    /// (d) and (d'): the agent attaches its socket programs to a cgroup made for the bench, and
    /// the load generators run in it (for (d'), every pod's processes too).
    fn kproxy_socket_lb(&mut self, services: usize, dir: &Path, mode: Mode) -> Result<Row> {
        if mode == Mode::SocketLbOnly && !self.pod_veth_tc {
            bail!(
                "not measurable: this kproxy has no --pod-veth-tc, so socket LB keeps tc on every pod veth \
                 (that is (d))"
            );
        }
        let cgroup = sandbox::cgroup::ChildCgroup::new("kproxy-bench")?;
        let path = cgroup.path().to_path_buf();
        self.cgroup = Some(cgroup);
        let rows = self.kproxy_with(services, dir, mode, Some(&path));
        // Dropping it kills what is left in it and removes it.
        self.cgroup = None;
        rows?.into_iter().next().context("no row")
    }

    fn kproxy_with(
        &mut self,
        services: usize,
        dir: &Path,
        mode: Mode,
        socket_lb: Option<&Path>,
    ) -> Result<Vec<Row>> {
        let port = self.new_backend()?;
        // (d'): every process of the three pods in the hooks' cgroup before the agent starts,
        // so that it finds all of them covered; the client pod gets a process of its own (its
        // load generators come and go).
        let mut moved = Vec::new();
        let mut holder = None;
        if mode == Mode::SocketLbOnly
            && let (Some(cgroup), Some(path)) = (&self.cgroup, socket_lb)
        {
            let mut sleeper = cgroup.command(self.client.netns(), &["sleep", "3600"]);
            holder = Some(sleeper.spawn().context("a process for the client pod in the bench cgroup")?);
            for netns in &self.pod_netns {
                moved.extend(move_netns_processes(netns, path)?);
            }
        }
        let result = self.kproxy_agent(services, dir, mode, socket_lb, port);
        if let Some(mut holder) = holder {
            let _ = holder.kill();
            let _ = holder.wait();
        }
        // Back where they were: dropping the bench cgroup kills what is in it, and the DNS
        // server serves the later paths too.
        for (pid, cgroup) in moved {
            let _ = std::fs::write(cgroup.join("cgroup.procs"), pid.to_string());
        }
        result
    }

    fn kproxy_agent(
        &mut self,
        services: usize,
        dir: &Path,
        mode: Mode,
        socket_lb: Option<&Path>,
        port: u16,
    ) -> Result<Vec<Row>> {
        let svcs = rules::cluster(services, &[web_svc(port), dns_svc()]);
        let manifests = dir.join(format!("manifests-{services}"));
        std::fs::create_dir_all(&manifests)?;
        write_manifests(&manifests, &svcs)?;
        let _ = kproxy::bpf::unload(&PinDir::new(PIN_DIR));
        let _unload = Unload(PIN_DIR.into());
        let bin = self.ctx.kproxy.to_string_lossy().into_owned();
        let mut extra: Vec<&str> = Vec::new();
        if mode == Mode::SocketLbTc && self.pod_veth_tc {
            extra.extend(["--pod-veth-tc", "on"]);
        }
        // Explicit: the default became `on` (b9f57ae).
        if mode == Mode::SocketLbOnly {
            extra.extend(["--pod-veth-tc", "auto"]);
        }
        let agent = self.sandbox.node_spawn(
            [
                bin.as_str(),
                "--pin-dir",
                PIN_DIR,
                "agent",
                "--manifests",
                &manifests.to_string_lossy(),
                "--interfaces",
                "veth*",
                "--healthz-bind-address",
                "",
                "--metrics-bind-address",
                "",
                "--socket-lb",
                if socket_lb.is_some() { "on" } else { "off" },
                "--cgroup-root",
                &socket_lb.map_or(String::from("/nonexistent"), |p| p.to_string_lossy().into_owned()),
            ]
            .into_iter()
            .chain(extra),
        )?;
        let path = match mode {
            Mode::Tc => Path3::Kproxy,
            Mode::SocketLbTc => Path3::SocketLb,
            Mode::SocketLbOnly => Path3::SocketLbNoTc,
        };
        let result = (|| {
            // client, web, dns: ingress + egress each (+ the 4 socket hooks); none on the pod
            // veths for (d').
            let links = match mode {
                Mode::Tc => 2 * 3,
                Mode::SocketLbTc => 2 * 3 + 4,
                Mode::SocketLbOnly => 4,
            };
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                self.ctx.check()?;
                if !agent.is_running() {
                    bail!("the agent exited:\n{}", agent.log());
                }
                if programmed(services) && count_links() >= links {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("the agent did not program {services} Services in 120 s:\n{}", agent.log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            self.check_vip()?;
            if mode == Mode::SocketLbOnly {
                // The agent may attach before it has looked at the pods: wait for it to settle
                // with no program on their veths, and say which links there were.
                let veths = self.pod_veths.clone();
                let on_pod_veths = || {
                    link_names()
                        .into_iter()
                        .filter(|l| veths.iter().any(|v| l.starts_with(&format!("{v}@"))))
                        .collect::<Vec<_>>()
                };
                let deadline = Instant::now() + Duration::from_secs(10);
                while !on_pod_veths().is_empty() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let (pods_before, all) = (on_pod_veths(), link_names());
                let row = self.measure(path, services, &format!("http://{WEB_VIP}/"), DNS_VIP);
                let others: Vec<&String> = all.iter().filter(|l| !l.starts_with("cgroup@")).collect();
                self.notes.push(format!(
                    "(d') N={services}: {} links on the pod veths while measured ({} after): [{}]; socket hooks {}; \
                     other interfaces (the node's uplink keeps tc and XDP): {}.",
                    pods_before.len(),
                    on_pod_veths().len(),
                    pods_before.join(", "),
                    all.iter().filter(|l| l.starts_with("cgroup@")).count(),
                    others.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ));
                return Ok(vec![row]);
            }
            if socket_lb.is_some() {
                return Ok(vec![self.measure(path, services, &format!("http://{WEB_VIP}/"), DNS_VIP)]);
            }
            let row = self.measure(path, services, &format!("http://{WEB_VIP}/"), DNS_VIP);
            // Port reuse: new connections to the backend pod's own address right after the
            // ClusterIP load reuse the source ports of the connections just closed, whose conntrack
            // entries are still there (closing, 10 s). Their replies must not be un-NATed; when
            // they were, this ran at 6–8 connections per second. (The same nginx: its TIME_WAIT
            // sockets of those connections slow it too, so it is a note, not (a'').)
            let reused = self.wrk(&format!("http://{WEB_IP}:{port}/"), true);
            self.notes.push(format!(
                "Port reuse, N={services}: new connections to the backend pod's own address (the same nginx) right \
                 after the ClusterIP load: {} conn/s.",
                reused.as_ref().map_or_else(|e| format!("failed ({e:#})"), |v| format!("{v:.0}"))
            ));
            // (a'') on an nginx of its own, as every path: the ClusterIP connections left TIME_WAIT
            // sockets in the other one.
            let pod_port = self.new_backend()?;
            let pod =
                self.measure(Path3::KproxyPodIp, services, &format!("http://{WEB_IP}:{pod_port}/"), DNS_IP);
            Ok(vec![row, pod])
        })();
        let _ = agent.terminate(Duration::from_secs(5));
        result
    }

    fn iptables(&mut self, services: usize, dir: &Path) -> Result<Row> {
        let port = self.new_backend()?;
        let svcs = rules::cluster(services, &[web_svc(port), dns_svc()]);
        let file = dir.join(format!("kube-proxy-{services}.rules"));
        std::fs::write(&file, rules::kube_proxy_ruleset(&svcs, CLUSTER_CIDR))?;
        let empty = dir.join("empty-nat.rules");
        std::fs::write(&empty, rules::EMPTY_NAT)?;
        let restore = find_tool("iptables-restore")?;
        self.sandbox.node_exec([restore.as_os_str(), file.as_os_str()])?;
        let result = self
            .check_vip()
            .map(|()| self.measure(Path3::Iptables, services, &format!("http://{WEB_VIP}/"), DNS_VIP));
        let _ = self.sandbox.node_exec([restore.as_os_str(), empty.as_os_str()]);
        result
    }
}

/// Services per manifest file: the agent refuses a file over 4 MiB (10k Services in one are ~7 MB).
const SERVICES_PER_FILE: usize = 2_000;

/// `svcs` (with their EndpointSlices) as JSON `List`s in `dir`, [`SERVICES_PER_FILE`] a file.
pub(super) fn write_manifests(dir: &Path, svcs: &[Svc]) -> Result<()> {
    for (i, chunk) in svcs.chunks(SERVICES_PER_FILE).enumerate() {
        std::fs::write(dir.join(format!("services-{i:03}.json")), rules::manifests(chunk))?;
    }
    Ok(())
}

/// Both measured Services are in the pinned services map with their backend.
fn programmed(services: usize) -> bool {
    let Ok(maps) = Maps::from_pins(&PinDir::new(PIN_DIR)) else { return false };
    [(WEB_VIP, 80u16, IPPROTO_TCP), (DNS_VIP, 53, IPPROTO_UDP)].iter().all(|(vip, port, proto)| {
        let key = ServiceKeyV4::new(vip.octets(), port.to_be_bytes(), *proto, SCOPE_CLUSTER_IP, 0);
        maps.services.get(&key, 0).is_ok_and(|v| v.count == 1)
    }) && {
        // The last Service written (highest VIP) is there too: the whole sync is done.
        let last = rules::filler(services.saturating_sub(3) as u32);
        services < 3 || {
            let key =
                ServiceKeyV4::new(last.vip.octets(), 80u16.to_be_bytes(), IPPROTO_TCP, SCOPE_CLUSTER_IP, 0);
            maps.services.get(&key, 0).is_ok()
        }
    }
}

fn count_links() -> usize {
    std::fs::read_dir(Path::new(PIN_DIR).join("links")).map_or(0, |d| d.count())
}

/// The agent's pinned links, by name (interface@ifindex-hook, or a socket hook), sorted.
fn link_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(Path::new(PIN_DIR).join("links"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// Moves every process whose network namespace is the one at `netns` into the cgroup at `into`;
/// returns each with the cgroup it was in.
fn move_netns_processes(netns: &Path, into: &Path) -> Result<Vec<(u32, PathBuf)>> {
    use std::os::unix::fs::MetadataExt as _;
    let root = sandbox::cgroup::cgroup2_root().context("no cgroup2 hierarchy")?;
    let target = std::fs::metadata(netns).with_context(|| format!("{}", netns.display()))?;
    let mut moved = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(ns) = std::fs::metadata(entry.path().join("ns/net")) else { continue };
        if ns.ino() != target.ino() || ns.dev() != target.dev() {
            continue;
        }
        let Ok(cgroup) = std::fs::read_to_string(entry.path().join("cgroup")) else { continue };
        let Some(relative) = cgroup.lines().find_map(|l| l.strip_prefix("0::")) else { continue };
        let was = root.join(relative.trim_start_matches('/'));
        std::fs::write(into.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving process {pid} into {}", into.display()))?;
        moved.push((pid, was));
    }
    Ok(moved)
}

/// Whether the kproxy binary has `--pod-veth-tc` (socket LB leaving covered pods without tc).
fn has_pod_veth_tc(kproxy: &Path) -> bool {
    std::process::Command::new(kproxy)
        .args(["agent", "--help"])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("--pod-veth-tc"))
}

pub fn run(ctx: &Ctx) -> Result<E2eResult> {
    let sizes: Vec<usize> = if ctx.quick { vec![1, 1_000] } else { vec![1, 1_000, 10_000] };
    let sandbox = Sandbox::new("bench")?;
    let client = sandbox.add_pod("client", CLIENT_IP)?;
    // Many short connections to one address:port: widen the port range and reuse TIME_WAIT
    // ports (both per namespace), or the client runs out of source ports.
    client.exec([
        "sysctl",
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=1024 65535",
        "net.ipv4.tcp_tw_reuse=1",
    ])?;
    let web = sandbox.add_pod("web", WEB_IP)?;
    let dns = sandbox.add_pod("dns", DNS_IP)?;
    dns.start_dnsmasq_with(WEB_VIP, QueryLog::Off)?;
    let dns_queries = sandbox.dir().join("queries.txt");
    std::fs::write(&dns_queries, "web.default.svc.cluster.local A\n")?;
    let seconds = if ctx.quick { 1 } else { 3 };
    let dns_seconds = if ctx.quick { 1 } else { 2 };
    let mut bench = Bench {
        ctx,
        sandbox: &sandbox,
        client: &client,
        web: &web,
        next_port: WEB_PORT,
        dns_queries,
        seconds,
        dns_seconds,
        notes: Vec::new(),
        cgroup: None,
        pod_veth_tc: has_pod_veth_tc(&ctx.kproxy),
        pod_netns: vec![client.netns_path(), web.netns_path(), dns.netns_path()],
        pod_veths: [&client, &web, &dns].iter().map(|p| p.host_veth().to_owned()).collect(),
    };

    let direct_port = bench.new_backend()?;
    let mut rows = vec![bench.measure(Path3::Direct, 0, &format!("http://{WEB_IP}:{direct_port}/"), DNS_IP)];
    {
        let floor_port = bench.new_backend()?;
        let veths = [client.host_veth(), web.host_veth(), dns.host_veth()];
        rows.push(match super::floor::Floor::attach(&sandbox.node_netns_path(), &veths) {
            Ok(_floor) => bench.measure(Path3::Floor, 0, &format!("http://{WEB_IP}:{floor_port}/"), DNS_IP),
            Err(e) => Bench::failed_row(Path3::Floor, 0, &e),
        });
    }
    let dir = sandbox.dir().to_path_buf();
    // kproxy first: once the nat table exists, netfilter conntrack runs in the node namespace.
    for &n in &sizes {
        ctx.check()?;
        match bench.kproxy(n, &dir) {
            Ok(r) => rows.extend(r),
            Err(e) => {
                rows.push(Bench::failed_row(Path3::Kproxy, n, &e));
                rows.push(Bench::failed_row(Path3::KproxyPodIp, n, &e));
            }
        }
    }
    for (mode, path) in [(Mode::SocketLbTc, Path3::SocketLb), (Mode::SocketLbOnly, Path3::SocketLbNoTc)] {
        for &n in &sizes {
            ctx.check()?;
            rows.push(
                bench.kproxy_socket_lb(n, &dir, mode).unwrap_or_else(|e| Bench::failed_row(path, n, &e)),
            );
        }
    }
    if !bench.pod_veth_tc {
        bench.notes.push(
            "This kproxy has no `--pod-veth-tc`: (d) ran with tc on every pod veth (the only socket-LB mode it \
             has) and (d') could not be measured."
                .into(),
        );
    }
    for &n in &sizes {
        ctx.check()?;
        rows.push(bench.iptables(n, &dir).unwrap_or_else(|e| Bench::failed_row(Path3::Iptables, n, &e)));
    }
    let mut notes = std::mem::take(&mut bench.notes);
    let version =
        sandbox.node_exec([find_tool("iptables")?.as_os_str(), "--version".as_ref()]).unwrap_or_default();
    notes.push(format!("iptables baseline: `{}`.", version.trim()));
    Ok(E2eResult { sizes, rows, seconds, dns_seconds, runs: ctx.runs(), notes })
}
