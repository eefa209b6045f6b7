//! `kproxy agent` configured as a kube-proxy operator configures kube-proxy: kubeadm's own
//! `config.conf` (KubeProxyConfiguration) through `--config`, with the flags on top; the health
//! and metrics servers as kube-proxy runs them (a port another process holds is retried, an empty
//! metrics address turns off metrics only); `--nodeport-addresses primary`. The real agent in a
//! sandbox node, the in-process API server as the cluster (the only fake), curl for what a user
//! sees. Needs root.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use common::cluster::{Cluster, Mode, WEB_VIP, kproxy_bin};
use sandbox::{NODE_DEVICE, NODE_IP, Spawned};

/// kube-proxy's config.conf as `kubeadm init` renders it into ConfigMap kube-system/kube-proxy.
fn kubeadm_config_conf() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../proxy-userspace/testdata/kubeadm-kube-proxy-config.conf");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A kubeconfig for the in-process API server (plain HTTP, no credentials).
fn write_kubeconfig(dir: &Path, server: &str) -> PathBuf {
    let path = dir.join("kubeconfig.conf");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: sandbox\n  cluster:\n    server: {server}\n\
         contexts:\n- name: sandbox\n  context:\n    cluster: sandbox\n    user: sandbox\n\
         current-context: sandbox\nusers:\n- name: sandbox\n  user: {{}}\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Replaces `from` (which must be in `text`) by `to`.
fn set(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} is not in the file");
    text.replacen(from, to, 1)
}

/// `kproxy agent ARGS` outside any sandbox (nothing is loaded: it exits before).
fn kproxy_agent(args: &[&str]) -> Output {
    Command::new(kproxy_bin())
        .arg("agent")
        .args(args)
        .env_remove("NODE_NAME")
        .output()
        .expect("running kproxy")
}

/// What `--write-config-to` writes for `kproxy agent ARGS`.
fn effective_config(dir: &Path, name: &str, args: &[&str]) -> String {
    let out_path = dir.join(name);
    let mut all: Vec<&str> = args.to_vec();
    let out_str = out_path.to_str().unwrap();
    all.extend(["--write-config-to", out_str]);
    let out = kproxy_agent(&all);
    assert!(out.status.success(), "kproxy agent {all:?}: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::read_to_string(&out_path).unwrap()
}

/// Waits until `url` (from the node namespace) answers `code`.
fn wait_for_status(cluster: &Cluster, url: &str, code: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = cluster
            .sandbox
            .node_exec(["curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", url])
            .unwrap_or_default();
        let (body, status) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        if status.parse::<u16>().ok() == Some(code) {
            return body.to_owned();
        }
        if let Some(agent) = &cluster.agent {
            assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
        }
        assert!(
            Instant::now() < deadline,
            "{url} is not {code} ({out:?}); agent log:\n{}",
            cluster.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether anything accepts a TCP connection at `addr:port` in the node namespace.
fn listening(cluster: &Cluster, addr: &str, port: u16) -> bool {
    let probe = format!(
        "import socket,sys\ns=socket.socket()\ns.settimeout(2)\nsys.exit(s.connect_ex(('{addr}',{port})))"
    );
    cluster.sandbox.node_exec_output(["python3", "-c", &probe]).map(|o| o.status.success()).unwrap_or(false)
}

#[test]
fn kubeadms_config_conf_runs_the_agent_as_the_same_flags_do_and_a_flag_wins() {
    let mut cluster = Cluster::prepared("kpconf", Mode::Api);
    let dir = cluster.sandbox.dir().to_path_buf();
    let kubeconfig = write_kubeconfig(&dir, &cluster.api().url());
    let kubeconfig = kubeconfig.to_str().unwrap();
    // kubeadm's file, pointed at this cluster, with two settings operators commonly change.
    let mut conf = set(&kubeadm_config_conf(), "/var/lib/kube-proxy/kubeconfig.conf", kubeconfig);
    conf = set(&conf, "hostnameOverride: \"\"", "hostnameOverride: node-1");
    conf = set(&conf, "metricsBindAddress: \"\"", "metricsBindAddress: 0.0.0.0:10249");
    conf = set(&conf, "healthzBindAddress: \"\"", "healthzBindAddress: 0.0.0.0:10256");
    conf = set(&conf, "logging:\n", "logging:\n  format: json\n");
    let conf_path = dir.join("config.conf");
    std::fs::write(&conf_path, &conf).unwrap();
    let conf_path = conf_path.to_str().unwrap();

    // The file's effective settings are those of the flags that say the same.
    let from_file = effective_config(&dir, "from-file.yaml", &["--config", conf_path]);
    let from_flags = effective_config(
        &dir,
        "from-flags.yaml",
        &[
            "--kubeconfig",
            kubeconfig,
            "--hostname-override",
            "node-1",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--metrics-bind-address",
            "0.0.0.0:10249",
            "--healthz-bind-address",
            "0.0.0.0:10256",
            "--log-format",
            "json",
        ],
    );
    assert_eq!(from_file, from_flags);
    let defaults = effective_config(&dir, "defaults.yaml", &[]);
    assert_ne!(from_file, defaults, "the file changed nothing:\n{from_file}");
    assert!(from_file.contains("\nclusterCIDR: 10.244.0.0/16\n"), "{from_file}");
    // A flag on the command line wins over the file.
    let overridden = effective_config(
        &dir,
        "overridden.yaml",
        &["--config", conf_path, "--healthz-bind-address", "127.0.0.1:10257"],
    );
    assert!(overridden.contains("\nhealthzBindAddress: 127.0.0.1:10257\n"), "{overridden}");
    assert!(overridden.contains("\nmetricsBindAddress: 0.0.0.0:10249\n"), "{overridden}");

    // The real agent on the file (and that one flag): it reaches the API server through the
    // file's kubeconfig and programs the cluster.
    let pin_dir = cluster.pin_dir.display().to_string();
    let cgroup = cluster.cgroup.path().display().to_string();
    let args = [
        kproxy_bin().display().to_string(),
        "--pin-dir".into(),
        pin_dir,
        "agent".into(),
        "--config".into(),
        conf_path.into(),
        "--healthz-bind-address".into(),
        "127.0.0.1:10257".into(),
        "--interfaces".into(),
        "veth*".into(),
        "--poll-ms".into(),
        "100".into(),
        "--cgroup-root".into(),
        cgroup,
    ];
    cluster.agent = Some(cluster.sandbox.node_spawn(&args).unwrap());
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3), ("10.96.0.10:53", "UDP", 2)]);
    cluster.wait_for_attachment();
    let page = cluster.client.curl(&format!("http://{WEB_VIP}/")).unwrap();
    assert!(page.starts_with("web-"), "{page}");
    // /healthz where the flag says, not where the file does; /metrics where the file says (on
    // every address, so the node's own answers too).
    wait_for_status(&cluster, "http://127.0.0.1:10257/healthz", 200);
    assert!(!listening(&cluster, "127.0.0.1", 10256), "/healthz also on the file's port");
    let metrics = wait_for_status(&cluster, &format!("http://{NODE_IP}:10249/metrics"), 200);
    assert!(metrics.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"), "{metrics}");

    // logging.format from the file: JSON lines, the first one saying what runs.
    let log = cluster.agent_log();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap())
        .unwrap_or_else(|e| panic!("not a JSON log line ({e}):\n{log}"));
    let fields = &first["fields"];
    assert_eq!(fields["message"], "kproxy agent starting", "{first}");
    assert_eq!(fields["version"], env!("CARGO_PKG_VERSION"), "{first}");
    assert!(fields["commit"].as_str().is_some_and(|c| !c.is_empty()), "{first}");
    assert_eq!(fields["source"], format!("API server (kubeconfig {kubeconfig})"), "{first}");
    assert_eq!(fields["xdp"], "native", "{first}");
    // kubeadm's file sets nothing kproxy ignores: no warning about it.
    assert!(!log.contains("does not use these KubeProxyConfiguration fields"), "{log}");
}

#[test]
fn a_typo_or_a_wrong_type_in_the_file_is_refused_naming_field_and_file() {
    let dir =
        common::cluster::TempDir(std::env::temp_dir().join(format!("kproxy-conf-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    for (name, from, to, field) in [
        ("typo.conf", "hostnameOverride: \"\"", "hostnameOveride: \"\"", "hostnameOveride"),
        ("nested.conf", "  tcpBeLiberal: false", "  tcpBeLiberal: false\n  tcpTimeout: 1s", "tcpTimeout"),
        ("type.conf", "  verbosity: 0", "  verbosity: loud", "logging.verbosity"),
    ] {
        let path = dir.0.join(name);
        std::fs::write(&path, set(&kubeadm_config_conf(), from, to)).unwrap();
        // The agent itself, not only --write-config-to: it stops before touching anything.
        let out = kproxy_agent(&["--config", path.to_str().unwrap(), "--manifests", "/nonexistent"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} accepted: {stderr}");
        assert!(stderr.contains(path.to_str().unwrap()) && stderr.contains(field), "{name}: {stderr}");
    }
    // kube-proxy's ignored settings are listed in one warning line.
    let ipvs = dir.0.join("ipvs.conf");
    std::fs::write(&ipvs, set(&kubeadm_config_conf(), "mode: \"\"", "mode: ipvs")).unwrap();
    let out = kproxy_agent(&[
        "--config",
        ipvs.to_str().unwrap(),
        "--manifests",
        "/nonexistent",
        "--pin-dir",
        "/nonexistent/pins",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("does not use these")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("mode (ipvs: kproxy is its own datapath)"), "{stderr}");
}

/// A process in the node namespace holding `addr` (as kube-proxy holds :10256 during a migration).
fn hold_port(cluster: &Cluster, addr: &str, port: u16) -> Spawned {
    let script = format!(
        "import socket,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
         s.bind(('{addr}',{port}))\ns.listen()\nprint('listening',flush=True)\ntime.sleep(600)"
    );
    let holder = cluster.sandbox.node_spawn(["python3", "-c", &script]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !holder.log().contains("listening") {
        assert!(holder.is_running() && Instant::now() < deadline, "holder: {}", holder.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    holder
}

#[test]
fn a_held_health_port_is_retried_unless_hard_fail_and_an_empty_metrics_address_keeps_healthz() {
    // kube-proxy still holds :10256: the agent programs the node anyway and takes the port when
    // it is free.
    let mut cluster = Cluster::prepared("kpbind", Mode::Files);
    let holder = hold_port(&cluster, "0.0.0.0", 10256);
    cluster.extra_agent_args = vec!["--metrics-bind-address".into(), String::new()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.100:80", "TCP", 3)]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.agent_log().contains("binding failed; retrying") {
        assert!(Instant::now() < deadline, "no retry logged:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(cluster.agent.as_ref().unwrap().is_running());
    holder.kill().unwrap();
    wait_for_status(&cluster, "http://127.0.0.1:10256/healthz", 200);
    // --metrics-bind-address "": metrics off, /healthz on.
    assert!(!listening(&cluster, "127.0.0.1", 10249), "metrics are served though disabled");
    cluster.stop_agent();

    // --bind-address-hard-fail: the agent exits, naming the address.
    let holder = hold_port(&cluster, "0.0.0.0", 10256);
    cluster.extra_agent_args = vec!["--bind-address-hard-fail".into()];
    cluster.start_agent();
    let agent = cluster.agent.take().unwrap();
    let status = agent.wait_timeout(Duration::from_secs(20)).unwrap().expect("the agent exits");
    assert!(!status.success());
    let log = agent.log();
    assert!(log.contains("--bind-address-hard-fail") && log.contains("0.0.0.0:10256"), "{log}");
    holder.kill().unwrap();
}

fn node_yaml(internal_ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\nspec: {{}}\nstatus:\n  addresses:\n  \
         - {{type: Hostname, address: node-1}}\n  - {{type: InternalIP, address: {internal_ip}}}\n"
    )
}

/// A NodePort Service in front of the web pods, and its slice.
const NODEPORT_SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web-np\n  namespace: default\n\
    spec:\n  type: NodePort\n  clusterIP: 10.96.0.150\n  selector: {app: web}\n  ports:\n  \
    - {name: http, port: 80, targetPort: 80, protocol: TCP, nodePort: 30080}\n\
    ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-np-1\n  namespace: default\n  \
    labels: {kubernetes.io/service-name: web-np}\naddressType: IPv4\nports: [{name: http, port: 80, protocol: TCP}]\n\
    endpoints:\n- {addresses: [10.244.0.11], conditions: {ready: true}, nodeName: node-1}\n\
    - {addresses: [10.244.0.12], conditions: {ready: true}, nodeName: node-1}\n";

#[test]
fn nodeport_addresses_primary_follows_the_node_objects_internal_ip() {
    let mut cluster = Cluster::prepared("kpprimary", Mode::Api);
    // A second node address: NodePorts must answer on the primary one only.
    cluster.sandbox.node_exec(["ip", "addr", "add", "10.0.0.2/32", "dev", NODE_DEVICE]).unwrap();
    cluster.api().apply_yaml(NODEPORT_SERVICE).unwrap();
    cluster.api().apply_yaml(&node_yaml("10.0.0.2")).unwrap();
    cluster.extra_agent_args = vec!["--nodeport-addresses".into(), "primary".into()];
    cluster.start_agent();
    cluster.wait_for_frontends(&[("10.96.0.150:80", "TCP", 2)]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.backend_count("10.0.0.2:30080", "TCP") != Some(2) {
        assert!(Instant::now() < deadline, "no NodePort on the primary address:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        cluster.backend_count(&format!("{NODE_IP}:30080"), "TCP"),
        None,
        "NodePort on a secondary address"
    );

    // The Node's InternalIP changes: the NodePort follows it.
    cluster.api().apply_yaml(&node_yaml(&NODE_IP.to_string())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.backend_count("10.0.0.2:30080", "TCP").is_some()
        || cluster.backend_count(&format!("{NODE_IP}:30080"), "TCP").is_none()
    {
        assert!(Instant::now() < deadline, "the NodePort did not follow the Node:\n{}", cluster.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn nodeport_addresses_primary_without_a_node_object_needs_a_default_route() {
    // The sandbox node has no default route: with --manifests there is no primary address.
    let mut cluster = Cluster::prepared("kpnoroute", Mode::Files);
    cluster.extra_agent_args = vec!["--nodeport-addresses".into(), "primary".into()];
    cluster.start_agent();
    let agent = cluster.agent.take().unwrap();
    let status = agent.wait_timeout(Duration::from_secs(20)).unwrap().expect("the agent exits");
    assert!(!status.success());
    let log = agent.log();
    assert!(log.contains("no default route") && log.contains("give the node's CIDRs"), "{log}");

    // 'primary' is alone or not at all, as kube-proxy validates it.
    let out = kproxy_agent(&["--manifests", "/nonexistent", "--nodeport-addresses", "primary,10.0.0.0/8"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("can't use both 'primary' and CIDRs"));
}

#[test]
fn version_and_completion() {
    let out = Command::new(kproxy_bin()).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.starts_with(&format!("kproxy {} (commit ", env!("CARGO_PKG_VERSION"))), "{version}");
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(kproxy_bin()).args(["completion", shell]).output().unwrap();
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && script.contains("cleanup-kube-proxy"), "{shell}: {script}");
    }
    // bash really loads it and completes a subcommand.
    let script = Command::new(kproxy_bin()).args(["completion", "bash"]).output().unwrap().stdout;
    let check = format!(
        "{}\nCOMP_WORDS=(kproxy dum); COMP_CWORD=1; _kproxy kproxy dum kproxy; echo \"${{COMPREPLY[@]}}\"",
        String::from_utf8_lossy(&script)
    );
    let out = Command::new("bash").args(["-c", &check]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "dump",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
