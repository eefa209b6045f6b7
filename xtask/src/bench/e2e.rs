//! End to end in a network-namespace sandbox: wrk (new connections and keep-alive requests) and
//! dnsperf (UDP DNS) from a client pod, (a) to a pod IP with no proxy, (b) to the ClusterIP
//! through kproxy, (c) to the ClusterIP through kube-proxy-shaped iptables rules, at N Services.
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
    /// (b) the ClusterIP through kproxy.
    Kproxy,
    /// (c) the ClusterIP through kube-proxy's iptables rules.
    Iptables,
    /// (d) the ClusterIP through kproxy's socket-level load balancing (the client in a cgroup
    /// with the connect/sendmsg hooks): translated once per connection, no per-packet NAT.
    SocketLb,
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

    /// Sanity check before measuring: the ClusterIP answers.
    fn check_vip(&self) -> Result<()> {
        self.client.curl(&format!("http://{WEB_VIP}/")).context("curl through the ClusterIP")?;
        self.client
            .dig(DNS_VIP, "web.default.svc.cluster.local", "A")
            .context("dig through the ClusterIP")?;
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

    fn kproxy(&mut self, services: usize, dir: &Path) -> Result<Row> {
        self.kproxy_with(services, dir, None)
    }

    /// (d): the agent attaches its socket programs to a cgroup made for the bench, and the load
    /// generators run in it.
    fn kproxy_socket_lb(&mut self, services: usize, dir: &Path) -> Result<Row> {
        let cgroup = sandbox::cgroup::ChildCgroup::new("kproxy-bench")?;
        let path = cgroup.path().to_path_buf();
        self.cgroup = Some(cgroup);
        let row = self.kproxy_with(services, dir, Some(&path));
        // Dropping it kills what is left in it and removes it.
        self.cgroup = None;
        row
    }

    fn kproxy_with(&mut self, services: usize, dir: &Path, socket_lb: Option<&Path>) -> Result<Row> {
        let port = self.new_backend()?;
        let svcs = rules::cluster(services, &[web_svc(port), dns_svc()]);
        let manifests = dir.join(format!("manifests-{services}"));
        std::fs::create_dir_all(&manifests)?;
        std::fs::write(manifests.join("services.json"), rules::manifests(&svcs))?;
        let _ = kproxy::bpf::unload(&PinDir::new(PIN_DIR));
        let _unload = Unload(PIN_DIR.into());
        let bin = self.ctx.kproxy.to_string_lossy().into_owned();
        let agent = self.sandbox.node_spawn([
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
        ])?;
        let path = if socket_lb.is_some() { Path3::SocketLb } else { Path3::Kproxy };
        let result = (|| {
            // client, web, dns: ingress + egress each (+ the 4 socket hooks).
            let links = 2 * 3 + if socket_lb.is_some() { 4 } else { 0 };
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
            if socket_lb.is_some() {
                return Ok(self.measure(path, services, &format!("http://{WEB_VIP}/"), DNS_VIP));
            }
            // Port reuse: the client's new connections to the backend pod's own address reuse
            // the source ports of the ClusterIP connections just closed, whose conntrack entries
            // are still there (closing, 10 s). Their replies must not be un-NATed; when they
            // were, this ran at 6–8 connections per second.
            let pod_url = format!("http://{WEB_IP}:{port}/");
            let before = self.wrk(&pod_url, true);
            let row = self.measure(path, services, &format!("http://{WEB_VIP}/"), DNS_VIP);
            let after = self.wrk(&pod_url, true);
            let show = |r: &Result<f64>| {
                r.as_ref().map_or_else(|e| format!("failed ({e:#})"), |v| format!("{v:.0}"))
            };
            self.notes.push(format!(
                "Port reuse, N={services}: new connections to the backend pod's own address with kproxy attached, \
                 {} conn/s before the ClusterIP load and {} conn/s right after it (its closing entries still in \
                 conntrack).",
                show(&before),
                show(&after)
            ));
            Ok(row)
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
    };

    let direct_port = bench.new_backend()?;
    let mut rows = vec![bench.measure(Path3::Direct, 0, &format!("http://{WEB_IP}:{direct_port}/"), DNS_IP)];
    let dir = sandbox.dir().to_path_buf();
    // kproxy first: once the nat table exists, netfilter conntrack runs in the node namespace.
    for &n in &sizes {
        ctx.check()?;
        rows.push(bench.kproxy(n, &dir).unwrap_or_else(|e| Bench::failed_row(Path3::Kproxy, n, &e)));
    }
    for &n in &sizes {
        ctx.check()?;
        rows.push(
            bench.kproxy_socket_lb(n, &dir).unwrap_or_else(|e| Bench::failed_row(Path3::SocketLb, n, &e)),
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
