//! A one-node cluster in a sandbox, driven by the real `kproxy agent`: a client
//! pod, three nginx pods behind `default/web` (10.96.0.100:80) and two dnsmasq
//! pods behind `kube-system/kube-dns` (10.96.0.10:53 UDP and TCP), programmed
//! from the manifests in examples/clusterip (copied, so tests may edit them).
//!
//! The agent runs with its default `--socket-lb` (host-only), its socket hooks attached to a
//! child cgroup the cluster creates and removes ([`Cluster::cgroup`]), never to the machine's.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use sandbox::{Pod, Sandbox, Spawned, apiserver::ApiServer, cgroup::ChildCgroup};

/// The same pods as the differential test's sandbox: one layout for both.
pub use sandbox::differential::{CLIENT_IP, DNS_PODS, WEB_PODS};

pub const WEB_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 100);
pub const DNS_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

pub use sandbox::kproxy_bin;

pub fn unique_pin_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    PathBuf::from(format!(
        "/sys/fs/bpf/kproxy-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// How the client pod's connections to Services are translated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Datapath {
    /// Per packet, by the tc programs on the pods' veths (the agent's default flags).
    Tc,
    /// `--socket-lb on --pod-veth-tc on`: at connect()/sendmsg() for the client's processes
    /// (started in [`Cluster::cgroup`]), and the tc programs still on every pod veth.
    SocketLbWithTc,
    /// `--socket-lb on --pod-veth-tc auto`: the same, and the client pod covered by the
    /// hooks — every process of its namespace is in the cgroup — so its veth has no tc program;
    /// the server pods' processes are outside the cgroup, so theirs keep it.
    SocketLbNoTc,
}

/// The client pod's server in socket-LB clusters, on [`CLIENT_SERVER_PORT`]: a process of the
/// client's network namespace that lives in the cgroup (what makes the pod covered), answering
/// `GET /whoami` with `client`.
pub const CLIENT_SERVER_PORT: u16 = 8080;

/// Where the agent reads Services and EndpointSlices from.
pub enum Mode {
    /// `--manifests DIR` (a copy of examples/clusterip).
    Files,
    /// `--master URL` of an in-process API server inside the node namespace,
    /// loaded with the same manifests.
    Api,
}

pub struct Cluster {
    // Field order matters only for readability: Drop below tears down explicitly.
    pub api: Option<ApiServer>,
    pub sandbox: Sandbox,
    pub client: Pod,
    pub web: Vec<Pod>,
    pub dns: Vec<Pod>,
    pub agent: Option<Spawned>,
    /// Added to `kproxy agent`'s arguments by [`Cluster::start_agent`].
    pub extra_agent_args: Vec<String>,
    pub pin_dir: PathBuf,
    pub manifests: PathBuf,
    _manifest_dir: TempDir,
    /// The agent's `--cgroup-root` (unless `extra_agent_args` name another): processes the
    /// test starts in it ([`ChildCgroup::command`]) get the socket hooks. Removed after the
    /// agent and the pins (fields drop after [`Cluster`]'s own `drop`).
    pub cgroup: ChildCgroup,
    pub datapath: Datapath,
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Cluster {
    pub fn start(tag: &str) -> Self {
        Self::start_with(tag, Mode::Files)
    }

    /// Starts the agent and waits until the example's frontends are programmed and the pods'
    /// veths attached as the datapath wants them.
    fn start_and_wait(&mut self) {
        self.start_agent();
        self.wait_for_frontends(&[
            ("10.96.0.100:80", "TCP", 3),
            ("10.96.0.10:53", "UDP", 2),
            ("10.96.0.10:53", "TCP", 2),
        ]);
        self.wait_for_attachment();
    }

    pub fn start_with(tag: &str, mode: Mode) -> Self {
        let mut cluster = Self::prepared(tag, mode);
        cluster.start_and_wait();
        cluster
    }

    /// The sandbox, its pods and manifests (in the API server too, with [`Mode::Api`]), without an
    /// agent: set [`Cluster::extra_agent_args`], then [`Cluster::start_agent`].
    pub fn prepared(tag: &str, mode: Mode) -> Self {
        let sandbox = Sandbox::new(tag).expect("building the sandbox (needs root; run `cargo xtask setup`)");
        let client = sandbox.add_pod("client", CLIENT_IP).unwrap();
        let web: Vec<Pod> = WEB_PODS
            .iter()
            .map(|(name, ip)| {
                let pod = sandbox.add_pod(name, *ip).unwrap();
                pod.start_nginx(&format!("{name}\n")).unwrap();
                pod
            })
            .collect();
        let dns: Vec<Pod> = DNS_PODS
            .iter()
            .map(|(name, ip)| {
                let pod = sandbox.add_pod(name, *ip).unwrap();
                pod.start_dnsmasq(WEB_VIP).unwrap();
                pod
            })
            .collect();

        let manifest_dir = sandbox.dir().join("manifests");
        std::fs::create_dir_all(&manifest_dir).unwrap();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/clusterip");
        for entry in std::fs::read_dir(&examples).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, manifest_dir.join(path.file_name().unwrap())).unwrap();
        }
        let api = match mode {
            Mode::Files => None,
            Mode::Api => {
                let api =
                    ApiServer::start_in_netns(&sandbox.node_netns_path()).expect("in-process API server");
                for entry in std::fs::read_dir(&manifest_dir).unwrap() {
                    api.apply_yaml(&std::fs::read_to_string(entry.unwrap().path()).unwrap()).unwrap();
                }
                Some(api)
            }
        };
        Cluster {
            api,
            sandbox,
            client,
            web,
            dns,
            agent: None,
            extra_agent_args: Vec::new(),
            pin_dir: unique_pin_dir(),
            manifests: manifest_dir.clone(),
            _manifest_dir: TempDir(manifest_dir),
            cgroup: ChildCgroup::new("kproxy-test").expect("a child cgroup for the socket hooks"),
            datapath: Datapath::Tc,
        }
    }

    /// A cluster whose client pod reaches Services through `datapath`, agent started, frontends
    /// programmed and the pods' veths attached as the datapath wants them.
    pub fn start_in(tag: &str, datapath: Datapath) -> Self {
        let mut cluster = Self::prepared(tag, Mode::Files);
        cluster.datapath = datapath;
        match datapath {
            Datapath::Tc => {}
            Datapath::SocketLbWithTc => {
                cluster.extra_agent_args =
                    ["--socket-lb", "on", "--pod-veth-tc", "on"].map(Into::into).to_vec()
            }
            Datapath::SocketLbNoTc => {
                cluster.extra_agent_args =
                    ["--socket-lb", "on", "--pod-veth-tc", "auto"].map(Into::into).to_vec()
            }
        }
        if datapath != Datapath::Tc {
            cluster.start_client_server();
        }
        cluster.start_and_wait();
        cluster
    }

    /// The client pod's server (see [`CLIENT_SERVER_PORT`]), started in the cgroup.
    fn start_client_server(&self) {
        let root = self.client.dir().join("www");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("whoami"), "client\n").unwrap();
        let port = CLIENT_SERVER_PORT.to_string();
        let root = root.display().to_string();
        let command = self.cgroup.command(
            self.client.netns(),
            &["python3", "-m", "http.server", &port, "--bind", "0.0.0.0", "--directory", &root],
        );
        let server = self.client.spawn_command(command).unwrap();
        self.client
            .wait_listening("tcp", CLIENT_SERVER_PORT, Some(&server), Duration::from_secs(10))
            .unwrap();
    }

    /// Whether the socket hooks cover `pod` in this cluster: its veth should carry no tc program.
    pub fn covered(&self, pod: &Pod) -> bool {
        self.datapath == Datapath::SocketLbNoTc && pod.name() == self.client.name()
    }

    /// `args` run in the client pod as its processes run in this datapath: in the cgroup with
    /// socket LB (outside it, a process would make the pod uncovered); its stdout, or an error
    /// when it fails.
    pub fn client_exec<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> anyhow::Result<String> {
        if self.datapath == Datapath::Tc {
            return self.client.exec(args);
        }
        let out = self.cgroup.command(self.client.netns(), args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "{:?} failed: {}{}",
            args.iter().map(|a| a.as_ref().to_string_lossy().into_owned()).collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The names of the TCX programs the kernel has on `veth` (in the node namespace), ingress and
    /// egress, sorted: asked with BPF_PROG_QUERY from a thread that enters the node's namespace
    /// (this bpftool predates TCX and lists none).
    pub fn tc_programs(&self, veth: &str) -> Vec<String> {
        use std::os::fd::AsRawFd;
        let netns = std::fs::File::open(self.sandbox.node_netns_path()).unwrap();
        let veth = veth.to_owned();
        std::thread::spawn(move || {
            // SAFETY: setns on this thread only, with a descriptor we hold.
            assert_eq!(unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            let mut names = Vec::new();
            for direction in [aya::programs::TcAttachType::Ingress, aya::programs::TcAttachType::Egress] {
                let (_, programs) = aya::programs::SchedClassifier::query_tcx(&veth, direction)
                    .unwrap_or_else(|e| panic!("querying the TCX programs of {veth}: {e}"));
                names.extend(programs.iter().map(|p| p.name_as_str().unwrap_or("?").to_owned()));
            }
            names.sort();
            names
        })
        .join()
        .unwrap()
    }

    /// Waits until every pod's veth has the ingress and egress programs (the agent attaches them
    /// within its --poll-ms, independently of programming the maps) — but the veths of pods the
    /// socket hooks cover ([`Cluster::covered`]), which must have none.
    pub fn wait_for_attachment(&self) {
        let pods: Vec<&Pod> = std::iter::once(&self.client).chain(&self.web).chain(&self.dns).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let links = self.link_pins();
            let attached = |veth: &str, hook: &str| {
                links.iter().any(|l| l.starts_with(&format!("{veth}@")) && l.ends_with(&format!("-{hook}")))
            };
            let as_wanted = |p: &&Pod| {
                let hooks = [attached(p.host_veth(), "ingress"), attached(p.host_veth(), "egress")];
                if self.covered(p) { hooks == [false, false] } else { hooks == [true, true] }
            };
            if pods.iter().all(as_wanted) {
                return;
            }
            assert!(Instant::now() < deadline, "pod veths not attached; agent log:\n{}", self.agent_log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The names of the agent's link pins.
    pub fn link_pins(&self) -> Vec<String> {
        std::fs::read_dir(self.pin_dir.join("links"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }

    pub fn start_agent(&mut self) {
        let bin = kproxy_bin();
        let mut args: Vec<std::ffi::OsString> = vec![
            bin.into(),
            "--pin-dir".into(),
            self.pin_dir.clone().into(),
            "agent".into(),
            "--interfaces".into(),
            "veth*".into(),
            "--poll-ms".into(),
            "100".into(),
            "--hostname-override".into(),
            "node-1".into(),
        ];
        match &self.api {
            Some(api) => args.extend(["--master".into(), api.url().into()]),
            None => args.extend(["--manifests".into(), self.manifests.clone().into()]),
        }
        if !self.extra_agent_args.iter().any(|a| a == "--cgroup-root" || a.starts_with("--cgroup-root=")) {
            args.extend(["--cgroup-root".into(), self.cgroup.path().into()]);
        }
        // Tests change objects one after the other and watch each change land (some within a
        // second): syncs 50 ms apart at most, not kube-proxy's default 1 s.
        if !self.extra_agent_args.iter().any(|a| a.starts_with("--min-sync-period")) {
            args.extend(["--min-sync-period".into(), "50ms".into()]);
        }
        args.extend(self.extra_agent_args.iter().map(Into::into));
        self.agent = Some(self.sandbox.node_spawn(args).unwrap());
    }

    pub fn api(&self) -> &ApiServer {
        self.api.as_ref().expect("a cluster started with Mode::Api")
    }

    /// `curl` from the node namespace (health and metrics listen there).
    pub fn node_curl(&self, url: &str) -> (u16, String) {
        let out = self
            .sandbox
            .node_exec(["curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", url])
            .unwrap_or_else(|e| panic!("curl {url}: {e:#}"));
        let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        (code.parse().unwrap_or(0), body.to_owned())
    }

    pub fn agent_log(&self) -> String {
        self.agent.as_ref().map(Spawned::log).unwrap_or_default()
    }

    /// `kproxy <args>` in the node namespace against this cluster's pins.
    pub fn kproxy(&self, args: &[&str]) -> String {
        let bin = kproxy_bin();
        let mut full =
            vec![bin.to_string_lossy().into_owned(), "--pin-dir".into(), self.pin_dir.display().to_string()];
        full.extend(args.iter().map(|s| (*s).to_owned()));
        self.sandbox.node_exec(&full).unwrap_or_else(|e| panic!("kproxy {args:?}: {e:#}"))
    }

    pub fn dump_json(&self, what: &str) -> serde_json::Value {
        serde_json::from_str(&self.kproxy(&["dump", what, "--json"])).unwrap()
    }

    /// A datapath counter from `kproxy dump stats`, by its name.
    pub fn stat(&self, reason: &str) -> u64 {
        let stats = self.dump_json("stats");
        let row = stats.as_array().unwrap().iter().find(|r| r["reason"] == reason);
        row.and_then(|r| r["packets"].as_u64()).unwrap_or_else(|| panic!("no counter {reason} in {stats}"))
    }

    /// Slot 0 of a frontend: its backend count, or None when absent.
    pub fn backend_count(&self, frontend: &str, proto: &str) -> Option<u64> {
        // Until the agent has pinned its maps, dump fails: not yet programmed.
        let bin = kproxy_bin();
        let pin_dir = self.pin_dir.display().to_string();
        let out = self
            .sandbox
            .node_exec_output([bin.to_str().unwrap(), "--pin-dir", &pin_dir, "dump", "services", "--json"])
            .ok()?;
        let rows: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        rows.as_array()?
            .iter()
            .find(|r| r["frontend"] == frontend && r["protocol"] == proto && r["slot"] == 0)
            .and_then(|r| r["count"].as_u64())
    }

    /// Waits until the agent has programmed each `(frontend, proto, count)`.
    pub fn wait_for_frontends(&self, expected: &[(&str, &str, u64)]) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if expected.iter().all(|(f, p, n)| self.backend_count(f, p) == Some(*n)) {
                return;
            }
            if let Some(agent) = &self.agent {
                assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
            }
            assert!(
                Instant::now() < deadline,
                "frontends {expected:?} not programmed; agent log:\n{}",
                self.agent_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the agent the way a DaemonSet rollout does (SIGTERM).
    pub fn stop_agent(&mut self) -> std::process::ExitStatus {
        let agent = self.agent.take().expect("agent running");
        agent.terminate(Duration::from_secs(5)).unwrap()
    }

    pub fn manifest(&self, name: &str) -> PathBuf {
        self.manifests.join(name)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            let _ = agent.terminate(Duration::from_secs(5));
        }
        // Unpin everything even when the test failed; the sandbox's own drop
        // then removes namespaces, veths and processes.
        let _ = std::process::Command::new(kproxy_bin())
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .arg("unload")
            .output();
    }
}

/// `kproxy trace --json` on a node, for two events, started and listening.
pub struct Trace(Spawned);

impl Trace {
    /// Starts `kproxy trace` with `filters` (e.g. `["--port", "53"]`) on `node` and waits until it
    /// listens.
    pub fn start(node: &Sandbox, pin_dir: &Path, filters: &[&str]) -> Self {
        Self::start_for(node, pin_dir, filters, 2)
    }

    /// [`Self::start`] for `events` events.
    pub fn start_for(node: &Sandbox, pin_dir: &Path, filters: &[&str], events: u32) -> Self {
        let events = events.to_string();
        let bin = kproxy_bin();
        let pin_dir = pin_dir.display().to_string();
        let mut args = vec![bin.to_str().unwrap(), "--pin-dir", &pin_dir, "trace"];
        args.extend(filters);
        args.extend(["--count", &events, "--timeout", "30", "--json"]);
        let trace = node.node_spawn(&args).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !trace.log().contains("tracing NAT events") {
            assert!(trace.is_running(), "trace exited: {}", trace.log());
            assert!(Instant::now() < deadline, "trace did not start: {}", trace.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        Self(trace)
    }

    /// Waits for the events and returns their steps (one JSON object per printed line).
    pub fn steps(self) -> Vec<serde_json::Value> {
        let status =
            self.0.wait_timeout(Duration::from_secs(10)).unwrap().expect("trace stops after its events");
        assert!(status.success(), "{}", self.0.log());
        self.0
            .log()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// What a client saw of one datagram sent on a connected UDP socket (5 s to answer).
#[derive(Debug, PartialEq)]
pub enum UdpOutcome {
    Answered,
    /// An ICMP port unreachable reached the socket, this many seconds after the send.
    Refused(f64),
    Timeout,
}

/// Sends one datagram from `pod` to `addr:port` (IPv4 or IPv6) with python on a connected socket,
/// which the kernel tells of an ICMP error about it (ECONNREFUSED on the next receive).
pub fn send_one_datagram(pod: &Pod, addr: &str, port: u16) -> UdpOutcome {
    let family = if addr.contains(':') { "AF_INET6" } else { "AF_INET" };
    let script = format!(
        "import socket, time\n\
         s = socket.socket(socket.{family}, socket.SOCK_DGRAM)\n\
         s.connect(('{addr}', {port}))\n\
         s.settimeout(5)\n\
         started = time.time()\n\
         s.send(b'hello')\n\
         try:\n    s.recv(512)\n    print('answered')\n\
         except ConnectionRefusedError:\n    print('refused', round(time.time() - started, 3))\n\
         except socket.timeout:\n    print('timeout')\n"
    );
    let out = pod.exec(["python3", "-c", &script]).unwrap();
    let fields: Vec<&str> = out.split_whitespace().collect();
    match fields.as_slice() {
        ["answered"] => UdpOutcome::Answered,
        ["refused", seconds] => UdpOutcome::Refused(seconds.parse().unwrap()),
        ["timeout"] => UdpOutcome::Timeout,
        _ => panic!("the UDP client printed {out:?}"),
    }
}
