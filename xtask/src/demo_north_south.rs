//! The second part of `cargo xtask demo`: north–south traffic. Two node namespaces on an underlay
//! bridge (`sandbox::multinode`), a web pod on each, an external client, one `kproxy agent` per
//! node programmed from `examples/north-south`. It shows a NodePort reached through either node
//! (the remote backend sees the node's address, the local one the client's), the SNAT translation
//! in `kproxy dump nat`, externalTrafficPolicy: Local with its health check, and XDP at work.
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use sandbox::{Pod, Spawned, multinode::MultiNode};

use crate::demo::{heading, indent};

const PIN_DIRS: [&str; 2] = ["/sys/fs/bpf/kproxy-demo-n0", "/sys/fs/bpf/kproxy-demo-n1"];
const WEB: [(usize, &str, Ipv4Addr); 2] =
    [(0, "web-a", Ipv4Addr::new(10, 244, 0, 11)), (1, "web-b", Ipv4Addr::new(10, 244, 1, 11))];

struct NorthSouth {
    kproxy: PathBuf,
    stop: Arc<AtomicBool>,
    agents: Vec<Spawned>,
    _pods: Vec<Pod>,
    multi: MultiNode,
    /// Each agent's `--cgroup-root` (its host-only socket hooks), removed after the agents.
    cgroups: Vec<sandbox::cgroup::ChildCgroup>,
}

impl Drop for NorthSouth {
    fn drop(&mut self) {
        for agent in self.agents.drain(..) {
            let _ = agent.terminate(Duration::from_secs(5));
        }
        for pins in PIN_DIRS {
            let _ = std::process::Command::new(&self.kproxy).args(["--pin-dir", pins, "unload"]).output();
        }
        println!("\ncleaned up: agents stopped, datapaths unloaded, nodes, client and underlay deleted");
    }
}

impl NorthSouth {
    fn kproxy(&self, node: usize, args: &[&str]) -> Result<String> {
        let mut full =
            vec![self.kproxy.to_string_lossy().into_owned(), "--pin-dir".into(), PIN_DIRS[node].into()];
        full.extend(args.iter().map(|s| (*s).to_owned()));
        self.multi.node(node).node_exec(&full)
    }

    fn check_interrupted(&self) -> Result<()> {
        if self.stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }

    /// The body (and the HTTP status when it is not 200), or why there was none.
    fn curl(&self, url: &str) -> String {
        match self.multi.external_exec(["curl", "-sS", "--max-time", "2", "-w", "\n%{http_code}", url]) {
            Ok(out) => match out.trim_end().rsplit_once('\n') {
                Some((body, "200")) => body.trim().to_owned(),
                Some((body, code)) => format!("HTTP {code} {}", body.trim()),
                None => out.trim().to_owned(),
            },
            Err(e) if e.to_string().contains("(28)") => {
                "no answer: the node dropped it (curl timed out)".into()
            }
            Err(e) => format!("no answer ({e})"),
        }
    }
}

pub fn run(kproxy_bin: &Path, examples_dir: &Path, stop: Arc<AtomicBool>) -> Result<()> {
    for pins in PIN_DIRS {
        let _ = std::process::Command::new(kproxy_bin).args(["--pin-dir", pins, "unload"]).output();
    }
    heading("north-south: two nodes on an underlay (192.168.100.10, .11), an external client at .200");
    let multi = MultiNode::new("demo-ns", 2)?;
    let mut pods = Vec::new();
    for (node, name, ip) in WEB {
        let pod = multi.add_pod(node, name, ip)?;
        pod.start_nginx(&format!("{name}\n"))?;
        println!("   node {node}: {name:<6} {ip:<12} nginx");
        pods.push(pod);
    }
    let dns = multi.add_pod(1, "dns-b", Ipv4Addr::new(10, 244, 1, 21))?;
    dns.start_dnsmasq(WEB[1].2)?;
    pods.push(dns);
    let cgroups =
        (0..2).map(|_| sandbox::cgroup::ChildCgroup::new("kproxy-demo")).collect::<Result<Vec<_>>>()?;
    let mut demo = NorthSouth {
        kproxy: kproxy_bin.to_path_buf(),
        stop,
        agents: Vec::new(),
        _pods: pods,
        multi,
        cgroups,
    };

    let manifests = examples_dir.join("north-south");
    heading(&format!(
        "on each node: kproxy agent --manifests {} --external-interfaces eth0 --cluster-cidr 10.244.0.0/16",
        manifests.display()
    ));
    for (node, pins) in PIN_DIRS.iter().enumerate() {
        let hostname = format!("node-{node}");
        let agent = demo.multi.node(node).node_spawn([
            kproxy_bin.to_string_lossy().as_ref(),
            "--pin-dir",
            pins,
            "agent",
            "--manifests",
            manifests.to_string_lossy().as_ref(),
            "--interfaces",
            "veth*",
            "--external-interfaces",
            "eth0",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--hostname-override",
            &hostname,
            "--cgroup-root",
            demo.cgroups[node].path().to_string_lossy().as_ref(),
        ])?;
        demo.agents.push(agent);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = |n: usize| {
        demo.kproxy(n, &["dump", "services"]).is_ok_and(|s| s.contains(":30080"))
            && demo.multi.node(n).node_exec(["ip", "link", "show", "eth0"]).is_ok_and(|l| l.contains("xdp"))
    };
    while !(0..2).all(ready) {
        demo.check_interrupted()?;
        if Instant::now() > deadline {
            bail!("the agents did not program the NodePorts in 30 s:\n{}", demo.agents[0].log());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    indent(&demo.kproxy(0, &["dump", "services"])?);

    heading("curl <node>:30080/whoami from the client: \"<backend> <address the backend saw>\"");
    for node in 0..2 {
        let ip = demo.multi.node_ip(node);
        for i in 1..=4 {
            println!(
                "   via node {node} ({ip}), request {i}: {}",
                demo.curl(&format!("http://{ip}:30080/whoami"))
            );
            demo.check_interrupted()?;
        }
    }
    println!("   (a backend on the other node sees the entry node's address: SNAT brings its reply back;");
    println!("    a local backend sees the client itself)");

    heading("kproxy dump nat on node 0: the translations of those flows");
    indent(&demo.kproxy(0, &["dump", "nat"])?);

    heading("externalTrafficPolicy: Local (default/web-local, endpoint on node 1 only)");
    for node in 0..2 {
        let ip = demo.multi.node_ip(node);
        println!("   curl {ip}:30081/whoami → {}", demo.curl(&format!("http://{ip}:30081/whoami")));
        println!("   health check {ip}:32081 → {}", demo.curl(&format!("http://{ip}:32081/")));
    }

    heading("XDP on node 0's eth0 and the datapath's counters there");
    let link = demo.multi.node(0).node_exec(["ip", "-d", "link", "show", "eth0"])?;
    indent(&link.lines().filter(|l| l.contains("xdp")).collect::<Vec<_>>().join("\n"));
    let stats = demo.kproxy(0, &["dump", "stats"])?;
    indent(
        &stats
            .lines()
            .filter(|l| ["REASON", "snat", "xdp", "dnat", "drop_no_local"].iter().any(|k| l.contains(k)))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    Ok(())
}
