//! `cargo xtask demo`: a ClusterIP Service through kproxy's eBPF datapath, in a
//! network-namespace sandbox (see the `sandbox` crate): one node, a client pod,
//! three nginx pods behind `default/web` and two DNS pods (dnsmasq standing in
//! for CoreDNS) behind `kube-system/kube-dns`, programmed from `examples/clusterip`, and the web pods
//! again behind the dual-stack `default/web-dual-stack` (`examples/dual-stack`), reached on its IPv4
//! and its IPv6 cluster IP.
//! Then north–south traffic on two nodes (`demo_north_south`). Everything it
//! makes is removed at the end, on error and on Ctrl-C.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use sandbox::{Pod, Sandbox, Spawned};

const PIN_DIR: &str = "/sys/fs/bpf/kproxy-demo";
const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(10, 244, 0, 2));
const WEB: [(&str, Ipv4Addr); 3] = [
    ("web-1", Ipv4Addr::new(10, 244, 0, 11)),
    ("web-2", Ipv4Addr::new(10, 244, 0, 12)),
    ("web-3", Ipv4Addr::new(10, 244, 0, 13)),
];
const DNS: [(&str, Ipv4Addr); 2] =
    [("coredns-1", Ipv4Addr::new(10, 244, 0, 21)), ("coredns-2", Ipv4Addr::new(10, 244, 0, 22))];
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 100);
const DUAL_STACK_VIPS: (Ipv4Addr, Ipv6Addr) =
    (Ipv4Addr::new(10, 96, 0, 101), Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x101));

/// A demo pod's IPv6 address: `fd00:10:244::<its last IPv4 octet, written the same>`, as the
/// dual-stack example's IPv6 slice names them.
fn ipv6_of(ip: Ipv4Addr) -> Ipv6Addr {
    format!("fd00:10:244::{}", ip.octets()[3]).parse().expect("a valid IPv6 address")
}
const DNS_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

struct Demo {
    kproxy: PathBuf,
    stop: Arc<AtomicBool>,
    // Dropped in this order: the agent first, then the sandbox (processes,
    // namespaces, veths), then the cgroup; `Drop for Demo` unpins the datapath
    // before them.
    agent: Option<Spawned>,
    sandbox: Sandbox,
    /// The agent's `--cgroup-root`: the socket hooks (host-only, the default)
    /// attach here, not to the machine's cgroups; the demo's node processes run in it.
    cgroup: sandbox::cgroup::ChildCgroup,
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            let _ = agent.terminate(Duration::from_secs(5));
        }
        let _ = std::process::Command::new(&self.kproxy).args(["--pin-dir", PIN_DIR, "unload"]).output();
        println!(
            "\ncleaned up: agent stopped, datapath unloaded ({PIN_DIR} removed), sandbox namespaces deleted"
        );
    }
}

impl Demo {
    fn check_interrupted(&self) -> Result<()> {
        if self.stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }

    fn kproxy(&self, args: &[&str]) -> Result<String> {
        let mut full = vec![self.kproxy.to_string_lossy().into_owned(), "--pin-dir".into(), PIN_DIR.into()];
        full.extend(args.iter().map(|s| (*s).to_owned()));
        self.sandbox.node_exec(&full)
    }
}

pub fn heading(text: &str) {
    println!("\n\x1b[1m== {text}\x1b[0m");
}

pub fn indent(text: &str) {
    for line in text.lines() {
        println!("   {line}");
    }
}

pub fn run(kproxy_bin: &Path, examples_dir: &Path) -> Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).context("installing the Ctrl-C handler")?;
    }
    // A demo killed before it could clean up leaves its pins behind.
    let _ = std::process::Command::new(kproxy_bin).args(["--pin-dir", PIN_DIR, "unload"]).output();

    heading("building the sandbox: one node namespace, six pods on veth pairs, no route out");
    let sandbox = Sandbox::new("demo")?;
    let cgroup = sandbox::cgroup::ChildCgroup::new("kproxy-demo")?;
    let mut demo = Demo { kproxy: kproxy_bin.to_path_buf(), stop, agent: None, sandbox, cgroup };
    let mut client = demo.sandbox.add_pod(CLIENT.0, CLIENT.1)?;
    client.add_ipv6(ipv6_of(CLIENT.1))?;
    println!("   {:<10} {:<12} {:<16} {}", CLIENT.0, CLIENT.1, client.host_veth(), ipv6_of(CLIENT.1));
    let mut pods: Vec<Pod> = Vec::new();
    for (name, ip) in WEB {
        let mut pod = demo.sandbox.add_pod(name, ip)?;
        pod.add_ipv6(ipv6_of(ip))?;
        pod.start_nginx(&format!("{name}\n"))?;
        println!("   {name:<10} {ip:<12} {:<16} {} nginx", pod.host_veth(), ipv6_of(ip));
        pods.push(pod);
        demo.check_interrupted()?;
    }
    for (name, ip) in DNS {
        let pod = demo.sandbox.add_pod(name, ip)?;
        pod.start_dnsmasq(WEB_VIP)?;
        println!("   {name:<10} {ip:<12} {:<16} dnsmasq (as CoreDNS)", pod.host_veth());
        pods.push(pod);
        demo.check_interrupted()?;
    }

    // The agent reads one directory: the ClusterIP examples and the dual-stack one, copied together.
    let manifests = demo.sandbox.dir().join("manifests");
    std::fs::create_dir_all(&manifests)?;
    for example in ["clusterip", "dual-stack"] {
        for entry in std::fs::read_dir(examples_dir.join(example))? {
            let path = entry?.path();
            std::fs::copy(&path, manifests.join(path.file_name().expect("a file name")))?;
        }
    }
    heading(&format!(
        "kproxy agent --manifests {} --interfaces 'veth*' --cgroup-root {}",
        manifests.display(),
        demo.cgroup.path().display()
    ));
    let agent = demo.sandbox.node_spawn([
        kproxy_bin.as_os_str(),
        "--pin-dir".as_ref(),
        PIN_DIR.as_ref(),
        "agent".as_ref(),
        "--manifests".as_ref(),
        manifests.as_os_str(),
        "--interfaces".as_ref(),
        "veth*".as_ref(),
        "--cgroup-root".as_ref(),
        demo.cgroup.path().as_os_str(),
    ])?;
    demo.agent = Some(agent);
    wait_until_programmed(&demo)?;
    indent(&demo.kproxy(&["dump", "services"])?);

    heading(&format!("curl http://{WEB_VIP}/ from the client pod: six new connections to default/web"));
    for i in 1..=6 {
        let body = client.curl(&format!("http://{WEB_VIP}/"))?;
        println!("   connection {i}: answered by {}", body.trim());
        demo.check_interrupted()?;
    }

    heading(&format!("dig @{DNS_VIP} from the client pod: kube-system/kube-dns over UDP"));
    for i in 1..=6 {
        let who = client.dig(DNS_VIP, "whoami.kproxy.test", "TXT")?;
        println!("   query {i}: whoami.kproxy.test TXT answered by {}", who.trim().trim_matches('"'));
        demo.check_interrupted()?;
    }
    let a = client.dig(DNS_VIP, "web.default.svc.cluster.local", "A")?;
    println!("   web.default.svc.cluster.local A → {}", a.trim());
    println!("   (dig accepts an answer only from the address it asked: each reply came from {DNS_VIP})");

    let (vip4, vip6) = DUAL_STACK_VIPS;
    heading(&format!(
        "a dual-stack Service: curl http://[{vip6}]/ and http://{vip4}/ from the client pod (default/web-dual-stack)"
    ));
    for i in 1..=3 {
        let body6 = client.curl(&format!("http://[{vip6}]/"))?;
        let body4 = client.curl(&format!("http://{vip4}/"))?;
        println!("   connection {i}: IPv6 answered by {}, IPv4 answered by {}", body6.trim(), body4.trim());
        demo.check_interrupted()?;
    }
    let seen = client.curl(&format!("http://[{vip6}]/client"))?;
    println!("   the backend saw the client as {} (its own IPv6 address: no source NAT)", seen.trim());

    heading(&format!(
        "curl http://{WEB_VIP}/ from the node itself (a hostNetwork pod, the kubelet): the socket hooks"
    ));
    let node_netns = demo.sandbox.node_netns().to_owned();
    for i in 1..=3 {
        let out = demo
            .cgroup
            .command(&node_netns, &["curl", "-sS", "--max-time", "5", &format!("http://{WEB_VIP}/")])
            .output()
            .context("curl from the node")?;
        if !out.status.success() {
            bail!("curl from the node failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        println!("   connection {i}: answered by {}", String::from_utf8_lossy(&out.stdout).trim());
        demo.check_interrupted()?;
    }
    println!(
        "   (--socket-lb host-only, the default: connect() from the node's network namespace goes straight\n    \
         to a backend; the node's packets never cross the pods' veths, where the tc programs sit)"
    );

    heading("a 2 KB DNS query and its 2 KB answer: IP fragments, only the first with the UDP ports");
    let out = client.exec(["python3", "-c", &sandbox::big_dns_query_script(DNS_VIP, 53)])?;
    let fields: Vec<&str> = out.split_whitespace().collect();
    if let [query, answer, source, pod] = fields[..] {
        println!("   a {query}-byte query, a {answer}-byte answer from {source}, answered by {pod}");
    } else {
        bail!("unexpected output of the fragmented query: {out}");
    }
    let stats = demo.kproxy(&["dump", "stats"])?;
    if let Some(line) = stats.lines().find(|l| l.starts_with("fragment_followed")) {
        println!("   {line}   (later fragments translated with their first fragment's ports)");
    }

    heading("who un-NATs the return packet? one DNS query as the node's interfaces saw it");
    show_one_query(&demo, &client)?;

    heading("the same question asked of kproxy: `kproxy trace --client 10.244.0.2 --port 53`");
    show_trace(&demo, &client)?;

    heading("kproxy dump conntrack");
    indent(&demo.kproxy(&["dump", "conntrack"])?);
    heading("kproxy dump stats");
    indent(&demo.kproxy(&["dump", "stats"])?);
    let stop = Arc::clone(&demo.stop);
    drop(demo);
    crate::demo_north_south::run(kproxy_bin, examples_dir, stop)
}

fn wait_until_programmed(demo: &Demo) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        demo.check_interrupted()?;
        let agent = demo.agent.as_ref().expect("agent started");
        if !agent.is_running() {
            bail!("the agent exited:\n{}", agent.log());
        }
        if let Ok(json) = demo.kproxy(&["dump", "services", "--json"]) {
            let rows: serde_json::Value = serde_json::from_str(&json)?;
            let masters = rows.as_array().map_or(0, |r| r.iter().filter(|r| r["slot"] == 0).count());
            // Maps programmed, and the programs attached to all six pod veths.
            let attached = std::fs::read_dir(Path::new(PIN_DIR).join("links")).map_or(0, |d| {
                d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("veth")).count()
            });
            // Three IPv4 frontends (web, kube-dns UDP and TCP) and web-dual-stack's two.
            if masters == 5 && attached == 12 {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the agent did not program the Services in 20 s:\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// tcpdump on every interface of the node: ingress is captured before the tc
/// ingress program and egress after the tc egress program, so the four lines
/// show the query before DNAT, after DNAT, the reply before un-NAT and after.
fn show_one_query(demo: &Demo, client: &Pod) -> Result<()> {
    let filter = format!("udp port 53 and host {}", CLIENT.1);
    let tcpdump = demo.sandbox.node_spawn(["tcpdump", "-i", "any", "-n", "-l", "-c", "4", &filter])?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tcpdump.log().contains("listening on") {
        if Instant::now() > deadline {
            bail!("tcpdump did not start:\n{}", tcpdump.log());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    client.dig(DNS_VIP, "web.default.svc.cluster.local", "A")?;
    if tcpdump.wait_timeout(Duration::from_secs(5))?.is_none() {
        let _ = tcpdump.kill();
    }
    let notes = [
        "the pod asks the ClusterIP",
        "kproxy_ingress on the client's veth DNATed it to a DNS pod",
        "the DNS pod answers from its own address",
        "kproxy_egress on the client's veth rewrote the source back to the ClusterIP",
    ];
    let lines: Vec<String> = tcpdump
        .log()
        .lines()
        .filter(|l| l.contains(" IP "))
        .map(|l| l.split_once(' ').map_or(l, |(_time, rest)| rest).to_owned())
        .collect();
    for (line, note) in lines.iter().zip(notes) {
        println!("   {line}");
        println!("      \x1b[2m↳ {note}\x1b[0m");
    }
    println!("   The conntrack entry that made the last step possible is in the table below.");
    Ok(())
}

/// `kproxy trace` while the client asks one DNS question: the four steps.
fn show_trace(demo: &Demo, client: &Pod) -> Result<()> {
    let bin = demo.kproxy.to_string_lossy().into_owned();
    let client_ip = CLIENT.1.to_string();
    let trace = demo.sandbox.node_spawn([
        bin.as_str(),
        "--pin-dir",
        PIN_DIR,
        "trace",
        "--client",
        &client_ip,
        "--port",
        "53",
        "--count",
        "2",
        "--timeout",
        "10",
    ])?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !trace.log().contains("tracing NAT events") {
        if Instant::now() > deadline || !trace.is_running() {
            bail!("kproxy trace did not start:\n{}", trace.log());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    client.dig(DNS_VIP, "whoami.kproxy.test", "TXT")?;
    if trace.wait_timeout(Duration::from_secs(5))?.is_none() {
        let _ = trace.kill();
    }
    for line in trace.log().lines().filter(|l| !l.starts_with("tracing")) {
        println!("   {line}");
    }
    Ok(())
}
