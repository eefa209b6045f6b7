//! The agent against a faulty API server. The server is the in-process one (sandbox::apiserver):
//! the only fake this suite allows, since no API server can be installed here; it speaks the real
//! list/watch protocol and injects each fault as a real server or the network in between shows it.
//! The agent is the real `kproxy agent` binary with the real datapath in a sandbox.
//!
//! One test per fault: a 410 answered to the watch request itself, a 410 ERROR event in the
//! stream, a stream cut mid-event, lines that are not events in place of events, lists failing
//! with 500, a list slower than the progress timeout, quiet watches kept alive by bookmarks only,
//! a server that stops answering, and one that refuses connections. In each, objects change
//! during the fault (a Service added, one deleted, an endpoint removed); each ends with the maps
//! equal to the server's objects (`kproxy dump diff` against the server) and checks what
//! `/healthz` said meanwhile: 503 with the reason while the agent could not see the cluster, 200
//! after (and 200 throughout where it could). Recovery waits on kube-runtime's backoff (0.8 s
//! doubling, up to 30 s), so the deadlines are generous; nothing here measures time. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Mode, kproxy_bin};
use sandbox::apiserver::ApiServer;
use serde_json::{Value, json};

/// The agent's `--api-progress-timeout` here (2 minutes by default): short, so blindness shows fast.
const PROGRESS_TIMEOUT: &str = "4s";
const HEALTHZ: &str = "http://127.0.0.1:10256/healthz";

/// A cluster on the API server whose agent runs with [`PROGRESS_TIMEOUT`].
fn cluster(tag: &str) -> Cluster {
    let mut cluster = Cluster::start_with(tag, Mode::Api);
    cluster.stop_agent();
    cluster.extra_agent_args.extend(["--api-progress-timeout".to_owned(), PROGRESS_TIMEOUT.to_owned()]);
    cluster.start_agent();
    let mut seen = Seen::default();
    seen.wait(&cluster, "the restarted agent to list both kinds and be healthy", 30, |c, code, _| {
        let log = c.agent_log();
        code == 200 && log.contains("listed the Services") && log.contains("listed the EndpointSlices")
    });
    cluster
}

/// List requests (not watches) the server got for `plural` (`services`, `endpointslices`).
fn lists(api: &ApiServer, plural: &str) -> usize {
    let path = format!("/{plural}?");
    api.requests().iter().filter(|r| r.contains(&path) && !r.contains("watch=")).count()
}

fn service(name: &str, cluster_ip: &str, port: u16) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 80}]}
    })
}

fn slice(name: &str, service: &str, addresses: &[&str]) -> Value {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true, "serving": true, "terminating": false}, "nodeName": "node-1"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]
    })
}

/// The changes made during each fault: a Service added (`extra`, 10.96.0.201:8080, one backend),
/// one deleted (`kube-system/kube-dns`), an endpoint removed (web-3 from `web`).
fn change_objects(api: &ApiServer) {
    api.apply(service("extra", "10.96.0.201", 8080));
    api.apply(slice("extra-abcde", "extra", &["10.244.0.11"]));
    assert!(api.delete("Service", Some("kube-system"), "kube-dns"));
    api.apply(slice("web-7x2kq", "web", &["10.244.0.11", "10.244.0.12"]));
}

/// Whether the maps show every change of [`change_objects`].
fn changes_programmed(cluster: &Cluster) -> bool {
    cluster.backend_count("10.96.0.201:8080", "TCP") == Some(1)
        && cluster.backend_count("10.96.0.100:80", "TCP") == Some(2)
        && cluster.backend_count("10.96.0.10:53", "UDP").is_none()
        && cluster.backend_count("10.96.0.10:53", "TCP").is_none()
}

/// `kproxy dump diff` against the API server, as the agent reads it: (exit status, stdout).
fn diff(cluster: &Cluster) -> (i32, String) {
    let bin = kproxy_bin();
    let (pins, url) = (cluster.pin_dir.display().to_string(), cluster.api().url());
    let args = [bin.to_str().unwrap(), "--pin-dir", &pins, "dump", "diff", "--master", &url];
    let out =
        cluster.sandbox.node_exec_output(args.iter().chain(&["--hostname-override", "node-1"])).unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What `/healthz` answered, in order: (status, `reason` if any).
#[derive(Default)]
struct Seen(Vec<(u16, Option<String>)>);

impl Seen {
    /// One `GET /healthz` from the node namespace; status 0 when nothing answers.
    fn sample(&mut self, cluster: &Cluster) -> (u16, Option<String>) {
        let curl = ["curl", "-sS", "--max-time", "5", "-w", "\n%{http_code}", HEALTHZ];
        let out = cluster.sandbox.node_exec_output(curl).unwrap();
        let out = String::from_utf8_lossy(&out.stdout);
        let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        let code: u16 = code.parse().unwrap_or(0);
        let reason =
            serde_json::from_str::<Value>(body).ok().and_then(|v| v["reason"].as_str().map(str::to_owned));
        self.0.push((code, reason.clone()));
        (code, reason)
    }

    /// Samples `/healthz` every 200 ms until `done(cluster, status, reason)`, for at most
    /// `deadline_secs`.
    fn wait(
        &mut self,
        cluster: &Cluster,
        what: &str,
        deadline_secs: u64,
        mut done: impl FnMut(&Cluster, u16, Option<&str>) -> bool,
    ) {
        let started = Instant::now();
        let deadline = started + Duration::from_secs(deadline_secs);
        loop {
            let (code, reason) = self.sample(cluster);
            if done(cluster, code, reason.as_deref()) {
                eprintln!("{what}: after {:.1}s", started.elapsed().as_secs_f64());
                return;
            }
            if let Some(agent) = &cluster.agent {
                assert!(agent.is_running(), "the agent exited:\n{}", agent.log());
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; /healthz said {}; agent log:\n{}",
                self.summary(),
                cluster.agent_log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits for a 503 whose reason contains every one of `parts`; returns the reason.
    fn wait_for_blind(&mut self, cluster: &Cluster, parts: &[&str], deadline_secs: u64) -> String {
        let what = format!("/healthz 503 with a reason containing {parts:?}");
        self.wait(cluster, &what, deadline_secs, |_, code, reason| {
            code == 503 && reason.is_some_and(|r| parts.iter().all(|p| r.contains(p)))
        });
        self.0.last().and_then(|(_, r)| r.clone()).unwrap()
    }

    /// Waits until the maps hold the changes and equal the server's objects, and `/healthz` is 200.
    fn wait_caught_up(&mut self, cluster: &Cluster, deadline_secs: u64) {
        self.wait(cluster, "the changes in the maps and /healthz 200", deadline_secs, |c, code, _| {
            code == 200 && changes_programmed(c)
        });
        let (code, out) = diff(cluster);
        assert_eq!((code, out.as_str()), (0, "no differences\n"), "agent log:\n{}", cluster.agent_log());
        assert_eq!(self.sample(cluster).0, 200, "{}", self.summary());
        eprintln!("/healthz said: {}", self.summary());
    }

    /// Each run of equal answers once: `200 ×12, 503 "…" ×20, 200 ×3`.
    fn summary(&self) -> String {
        let mut runs: Vec<(u16, &Option<String>, usize)> = Vec::new();
        for (code, reason) in &self.0 {
            match runs.last_mut() {
                Some((c, r, n)) if c == code && *r == reason => *n += 1,
                _ => runs.push((*code, reason, 1)),
            }
        }
        let runs: Vec<String> = runs
            .iter()
            .map(|(code, reason, n)| match reason {
                Some(reason) => format!("{code} {reason:?} ×{n}"),
                None => format!("{code} ×{n}"),
            })
            .collect();
        runs.join(", ")
    }

    fn all_healthy(&self) -> bool {
        self.0.iter().all(|(code, _)| *code == 200)
    }
}

#[test]
fn a_410_answered_to_the_watch_request_itself_makes_the_agent_list_again() {
    let cluster = cluster("apif-410req");
    let api = cluster.api();
    let (services, slices) = (lists(api, "services"), lists(api, "endpointslices"));
    let mut seen = Seen::default();
    api.expire_watches_with_410(true);
    // Ends every watch; the resourceVersion each agent watch resumes from is now too old.
    api.compact();
    change_objects(api);
    seen.wait_caught_up(&cluster, 60);
    assert!(lists(api, "services") > services && lists(api, "endpointslices") > slices);
    let log = cluster.agent_log();
    assert!(log.contains("watch: 410 Gone: too old resource version"), "{log}");
    // It listed again within a backoff step: it never stopped seeing the cluster for 4 s.
    assert!(seen.all_healthy(), "/healthz said {}", seen.summary());
}

#[test]
fn a_410_error_event_in_the_stream_makes_the_agent_list_again() {
    let cluster = cluster("apif-410ev");
    let api = cluster.api();
    let (services, slices) = (lists(api, "services"), lists(api, "endpointslices"));
    let mut seen = Seen::default();
    api.compact();
    change_objects(api);
    seen.wait_caught_up(&cluster, 60);
    assert!(lists(api, "services") > services && lists(api, "endpointslices") > slices);
    let log = cluster.agent_log();
    assert!(log.contains("watch: 410 Gone: too old resource version"), "{log}");
    assert!(seen.all_healthy(), "/healthz said {}", seen.summary());
}

#[test]
fn a_watch_cut_mid_event_resumes_where_it_was_without_listing() {
    let cluster = cluster("apif-cut");
    let api = cluster.api();
    let (services, slices) = (lists(api, "services"), lists(api, "endpointslices"));
    let mut seen = Seen::default();
    // The Service watch gets half of the ADDED of `extra`, then its connection closes.
    api.cut_next_events(1);
    change_objects(api);
    seen.wait(&cluster, "the changes in the maps", 60, |c, _, _| changes_programmed(c));
    assert_eq!(api.faults_pending(), 0, "the cut happened");
    // Resumed from the last resourceVersion: the server sent the cut event again, no list needed.
    assert_eq!((lists(api, "services"), lists(api, "endpointslices")), (services, slices));
    seen.wait_caught_up(&cluster, 30);
    assert!(seen.all_healthy(), "/healthz said {}", seen.summary());
}

#[test]
fn lines_that_are_not_events_make_the_agent_list_again() {
    let cluster = cluster("apif-garbage");
    let api = cluster.api();
    let (services, slices) = (lists(api, "services"), lists(api, "endpointslices"));
    let mut seen = Seen::default();
    // In place of the ADDED of Service `extra`: a proxy's error page; in place of the ADDED of
    // its EndpointSlice: the first half of that event's JSON (a line kube-client's own watch
    // decoder skips without a word). Both streams go on; the changes those lines carried are
    // lost to them.
    api.garble_next_events(1);
    api.apply(service("extra", "10.96.0.201", 8080));
    seen.wait(&cluster, "the garbage line sent", 30, |_, _, _| api.faults_pending() == 0);
    api.truncate_next_events(1);
    api.apply(slice("extra-abcde", "extra", &["10.244.0.11"]));
    seen.wait(&cluster, "the truncated line sent", 30, |_, _, _| api.faults_pending() == 0);
    assert!(api.delete("Service", Some("kube-system"), "kube-dns"));
    api.apply(slice("web-7x2kq", "web", &["10.244.0.11", "10.244.0.12"]));
    seen.wait(&cluster, "the changes in the maps", 60, |c, _, _| changes_programmed(c));
    assert!(lists(api, "services") > services && lists(api, "endpointslices") > slices);
    let log = cluster.agent_log();
    assert!(log.contains("unreadable line") && log.contains("502 Bad Gateway"), "{log}");
    seen.wait_caught_up(&cluster, 30);
    assert!(seen.all_healthy(), "/healthz said {}", seen.summary());
}

#[test]
fn lists_failing_with_500_are_503_with_the_reason_until_a_list_succeeds() {
    let cluster = cluster("apif-list500");
    let api = cluster.api();
    let mut seen = Seen::default();
    api.fail_lists(true);
    // An ERROR 410 on every watch: the agent must list again, and cannot.
    api.compact();
    change_objects(api);
    // Each kind keeps failing its lists (its own jittered backoff decides when it has failed 5).
    let parts = [
        "EndpointSlice watch: list failed ",
        "; Service watch: list failed ",
        " times: 500 Internal Server Error",
    ];
    seen.wait_for_blind(&cluster, &parts, 90);
    seen.wait(&cluster, "the log to say so", 10, |c, _, _| {
        c.agent_log().contains("cannot see the cluster: /healthz answers 503")
    });
    // The datapath keeps the last good state meanwhile.
    assert_eq!(cluster.backend_count("10.96.0.100:80", "TCP"), Some(3));
    api.fail_lists(false);
    seen.wait_caught_up(&cluster, 90);
    seen.wait(&cluster, "the log to say the watches are current", 10, |c, _, _| {
        c.agent_log().contains("the API watches are current again")
    });
}

#[test]
fn a_list_slower_than_the_progress_timeout_is_503_until_it_answers() {
    let cluster = cluster("apif-slowlist");
    let api = cluster.api();
    let mut seen = Seen::default();
    api.delay_lists(Duration::from_secs(12));
    api.compact();
    change_objects(api);
    seen.wait_for_blind(
        &cluster,
        &["Service watch: no list, event or bookmark for", "a list has waited"],
        30,
    );
    // Only lists asked from now on are quick; the agent's pending one answers at its 12 s.
    api.delay_lists(Duration::ZERO);
    seen.wait_caught_up(&cluster, 60);
}

#[test]
fn bookmarks_keep_a_quiet_watch_healthy_and_its_resource_version_current() {
    let cluster = cluster("apif-bookmarks");
    let api = cluster.api();
    let mut seen = Seen::default();
    // From now on watches outlive their timeoutSeconds: only bookmarks show they are alive.
    api.hold_watches(true);
    let held = Instant::now();
    // A change to EndpointSlices only: the Service watch hears of the new resourceVersion from
    // bookmarks alone.
    api.apply(slice("web-7x2kq", "web", &["10.244.0.11", "10.244.0.12"]));
    let version: u64 = api.resource_version().parse().unwrap();
    let quiet_for = Duration::from_secs(8); // twice the progress timeout
    seen.wait(&cluster, "Service bookmarks at the new resourceVersion for 8 s", 40, |c, _, _| {
        c.backend_count("10.96.0.100:80", "TCP") == Some(2)
            && api
                .bookmarks_sent()
                .iter()
                .any(|b| b.kind == "Service" && b.resource_version == version && b.at >= held + quiet_for)
    });
    assert!(seen.all_healthy(), "bookmarks alone kept the watches alive; /healthz said {}", seen.summary());

    // History forgotten up to now and every watch ended: watches resume from the bookmarks'
    // resourceVersion, which the server still serves, so nothing is listed again.
    let (services, slices) = (lists(api, "services"), lists(api, "endpointslices"));
    let watches_before = api.requests().len();
    api.forget_history();
    api.drop_watches();
    api.hold_watches(false);
    let resumed = format!("&resourceVersion={version}");
    seen.wait(&cluster, "both kinds watched again from the bookmarks' resourceVersion", 30, |_, _, _| {
        let requests = api.requests();
        ["/services?", "/endpointslices?"].iter().all(|kind| {
            requests[watches_before..]
                .iter()
                .any(|r| r.contains(kind) && r.contains("watch=true") && r.ends_with(&resumed))
        })
    });
    change_objects(api);
    seen.wait(&cluster, "the changes in the maps", 30, |c, _, _| changes_programmed(c));
    assert_eq!((lists(api, "services"), lists(api, "endpointslices")), (services, slices), "listed again");
    seen.wait_caught_up(&cluster, 30);
    assert!(seen.all_healthy(), "/healthz said {}", seen.summary());
}

#[test]
fn a_server_that_stops_answering_is_503_then_the_agent_catches_up() {
    let cluster = cluster("apif-silent");
    let api = cluster.api();
    let mut seen = Seen::default();
    api.stop_answering();
    change_objects(api);
    let both =
        ["Service watch: no list, event or bookmark for", "EndpointSlice watch: no list, event or bookmark"];
    seen.wait_for_blind(&cluster, &both, 30);
    assert_eq!(cluster.backend_count("10.96.0.100:80", "TCP"), Some(3), "the last good state stays");
    api.answer_again();
    seen.wait_caught_up(&cluster, 90);
}

#[test]
fn refused_connections_are_503_then_the_agent_catches_up() {
    let cluster = cluster("apif-refused");
    let api = cluster.api();
    let mut seen = Seen::default();
    api.refuse_connections();
    change_objects(api);
    let parts =
        ["Service watch: no list, event or bookmark", "EndpointSlice watch: no list", "Connection refused"];
    seen.wait_for_blind(&cluster, &parts, 30);
    assert_eq!(cluster.backend_count("10.96.0.100:80", "TCP"), Some(3), "the last good state stays");
    api.accept_connections().unwrap();
    seen.wait_caught_up(&cluster, 90);
}
