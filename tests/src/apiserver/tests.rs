//! Protocol tests with a raw HTTP/1.1 client over `std::net::TcpStream`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

/// A keep-alive HTTP/1.1 connection.
struct Client {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Client { stream, reader }
    }

    fn send(&mut self, target: &str) {
        write!(self.stream, "GET {target} HTTP/1.1\r\nHost: apiserver\r\nAccept: application/json\r\n\r\n")
            .unwrap();
    }

    fn read_line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line
    }

    /// Status code and lower-cased headers.
    fn read_head(&mut self) -> (u16, HashMap<String, String>) {
        let status_line = self.read_line();
        assert!(status_line.starts_with("HTTP/1.1 "), "{status_line:?}");
        let code = status_line[9..12].parse().unwrap();
        let mut headers = HashMap::new();
        loop {
            let line = self.read_line();
            let line = line.trim_end();
            if line.is_empty() {
                return (code, headers);
            }
            let (name, value) = line.split_once(':').unwrap();
            headers.insert(name.to_ascii_lowercase(), value.trim().to_string());
        }
    }

    /// One chunk of a chunked body; `None` for the terminating chunk.
    fn read_chunk(&mut self) -> Option<String> {
        let size = usize::from_str_radix(self.read_line().trim_end(), 16).unwrap();
        let mut data = vec![0; size];
        self.reader.read_exact(&mut data).unwrap();
        assert_eq!(self.read_line(), "\r\n");
        (size > 0).then(|| String::from_utf8(data).unwrap())
    }

    /// A complete non-streaming request.
    fn get(&mut self, target: &str) -> (u16, Value) {
        self.send(target);
        let (code, headers) = self.read_head();
        assert_eq!(headers["content-type"], "application/json");
        let mut body = vec![0; headers["content-length"].parse().unwrap()];
        self.reader.read_exact(&mut body).unwrap();
        (code, serde_json::from_slice(&body).unwrap())
    }

    /// Starts a watch; events then come from `event`.
    fn watch(&mut self, target: &str) {
        self.send(target);
        let (code, headers) = self.read_head();
        assert_eq!(code, 200);
        assert_eq!(headers["transfer-encoding"], "chunked");
        assert_eq!(headers["content-type"], "application/json");
    }

    /// The next watch event (each is one chunk, one line); `None` at the end of the stream.
    fn event(&mut self) -> Option<Value> {
        let chunk = self.read_chunk()?;
        assert!(chunk.ends_with('\n') && chunk.matches('\n').count() == 1, "{chunk:?}");
        Some(serde_json::from_str(&chunk).unwrap())
    }

    /// The next event that is not a BOOKMARK.
    fn change(&mut self) -> Option<Value> {
        loop {
            let event = self.event()?;
            if event["type"] != "BOOKMARK" {
                return Some(event);
            }
        }
    }
}

fn service(ns: &str, name: &str, labels: Value, port: u16) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": port, "protocol": "TCP"}]},
    })
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            format!(
                "{}/{}",
                i["metadata"]["namespace"].as_str().unwrap_or(""),
                i["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

fn summary(event: &Value) -> (String, String, String) {
    (
        event["type"].as_str().unwrap().to_string(),
        event["object"]["metadata"]["name"].as_str().unwrap_or_default().to_string(),
        event["object"]["metadata"]["resourceVersion"].as_str().unwrap().to_string(),
    )
}

#[test]
fn server_is_shareable_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ApiServer>();
}

#[test]
fn apply_assigns_metadata_and_lists_paginate_and_filter() {
    let server = ApiServer::start().unwrap();
    assert!(server.url().starts_with("http://127.0.0.1:"));
    let rv1 = server.apply(service("b", "web", json!({"app": "web", "tier": "front"}), 80));
    server.apply(service("a", "db", json!({"app": "db"}), 5432));
    server.apply(service("a", "web", json!({"app": "web"}), 80));
    server.apply(service("b", "cache", json!({"app": "cache", "tier": "back"}), 6379));
    server.apply(json!({"kind": "Service", "metadata": {"name": "plain"}, "spec": {}}));
    assert_eq!(rv1, "1");
    assert_eq!(server.resource_version(), "5");
    // A no-op replace changes nothing; a real change gets the next resourceVersion, keeps uid.
    assert_eq!(server.apply(service("b", "web", json!({"app": "web", "tier": "front"}), 80)), "1");
    let mut c = Client::connect(server.addr());
    let (code, first) = c.get("/api/v1/namespaces/b/services/web");
    assert_eq!(code, 200);
    assert_eq!((first["kind"].as_str(), first["apiVersion"].as_str()), (Some("Service"), Some("v1")));
    assert_eq!(server.apply(service("b", "web", json!({"app": "web", "tier": "front"}), 8080)), "6");
    let (_, updated) = c.get("/api/v1/namespaces/b/services/web");
    assert_eq!(updated["metadata"]["resourceVersion"], "6");
    assert_eq!(updated["spec"]["ports"][0]["port"], 8080);
    assert_eq!(updated["metadata"]["uid"], first["metadata"]["uid"]);
    assert_eq!(updated["metadata"]["creationTimestamp"], first["metadata"]["creationTimestamp"]);
    let uid = first["metadata"]["uid"].as_str().unwrap();
    assert!(uid.len() == 36 && uid.chars().nth(14) == Some('4'), "{uid}");
    let ts = first["metadata"]["creationTimestamp"].as_str().unwrap();
    assert!(ts.len() == 20 && ts.starts_with("20") && ts.ends_with('Z'), "{ts}");

    // The whole list: etcd key order, no kind/apiVersion on items, current resourceVersion.
    let (code, all) = c.get("/api/v1/services");
    assert_eq!(code, 200);
    assert_eq!((all["kind"].as_str(), all["apiVersion"].as_str()), (Some("ServiceList"), Some("v1")));
    assert_eq!(all["metadata"]["resourceVersion"], "6");
    assert!(all["metadata"].get("continue").is_none());
    assert_eq!(names(&all), ["a/db", "a/web", "b/cache", "b/web", "default/plain"]);
    assert!(all["items"][0].get("kind").is_none() && all["items"][0].get("apiVersion").is_none());

    // Pagination the way kube-rs' watcher does it: limit, then continue tokens until none.
    let mut pages = Vec::new();
    let mut target = "/api/v1/services?&limit=2".to_string();
    loop {
        let (code, page) = c.get(&target);
        assert_eq!(code, 200, "{page}");
        assert_eq!(page["metadata"]["resourceVersion"], "6");
        pages.push(names(&page));
        match page["metadata"]["continue"].as_str() {
            Some(token) => {
                assert!(page["metadata"]["remainingItemCount"].as_u64().unwrap() > 0);
                target = format!("/api/v1/services?&limit=2&continue={token}");
            }
            None => break,
        }
        // A change between pages is visible in later pages (and replayed by a watch from rv 6).
        if pages.len() == 1 {
            server.apply(service("b", "zz", json!({}), 1));
        }
    }
    assert_eq!(pages, [vec!["a/db", "a/web"], vec!["b/cache", "b/web"], vec!["b/zz", "default/plain"]]);
    server.delete("service", Some("b"), "zz");

    // Selectors (URL-encoded as kube-rs sends them) and namespace paths.
    let q = |selector: &str| selector.replace('=', "%3D").replace(' ', "+").replace(',', "%2C");
    let cases: [(&str, &[&str]); 9] = [
        ("labelSelector=app", &["a/db", "a/web", "b/cache", "b/web"]),
        ("labelSelector=!app", &["default/plain"]),
        ("labelSelector=app=web", &["a/web", "b/web"]),
        ("labelSelector=app==web,tier", &["b/web"]),
        ("labelSelector=app!=web", &["a/db", "b/cache", "default/plain"]),
        ("labelSelector=app in (web,cache)", &["a/web", "b/cache", "b/web"]),
        ("labelSelector=tier notin (front)", &["a/db", "a/web", "b/cache", "default/plain"]),
        ("fieldSelector=metadata.name=web", &["a/web", "b/web"]),
        ("fieldSelector=metadata.namespace!=b,metadata.name!=plain", &["a/db", "a/web"]),
    ];
    for (query, expected) in cases {
        let (key, value) = query.split_once('=').unwrap();
        let (code, list) = c.get(&format!("/api/v1/services?{key}={}", q(value)));
        assert_eq!(code, 200, "{query}: {list}");
        assert_eq!(names(&list), expected, "{query}");
    }
    let (_, ns_b) = c.get("/api/v1/namespaces/b/services?labelSelector=tier");
    assert_eq!(names(&ns_b), ["b/cache", "b/web"]);

    // Errors are Status objects.
    let (code, err) = c.get("/api/v1/services?labelSelector=app+in+%28web");
    assert_eq!(
        (code, err["kind"].as_str(), err["reason"].as_str(), err["code"].as_u64()),
        (400, Some("Status"), Some("BadRequest"), Some(400))
    );
    let (code, err) = c.get("/api/v1/services?fieldSelector=spec.clusterIP%3Dx");
    assert_eq!(code, 400, "{err}");
    let (code, err) = c.get("/api/v1/namespaces/a/services/nope");
    assert_eq!(
        (code, err["reason"].as_str(), err["status"].as_str()),
        (404, Some("NotFound"), Some("Failure"))
    );
    assert_eq!(err["message"], "services \"nope\" not found");
    for unknown in ["/api/v1/pods", "/api/v1/namespaces/a/nodes", "/apis/apps/v1/deployments", "/healthz"] {
        let (code, err) = c.get(unknown);
        assert_eq!(
            (code, err["kind"].as_str(), err["code"].as_u64()),
            (404, Some("Status"), Some(404)),
            "{unknown}"
        );
    }

    // EndpointSlices and Nodes, from YAML.
    server
        .apply_yaml(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  namespace: a\n  \
             labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [10.244.0.11]\n\
             ports:\n- port: 80\n---\n---\napiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n",
        )
        .unwrap();
    assert!(server.apply_yaml("kind: Pod\nmetadata:\n  name: x\n").is_err());
    // JSON text, and a List of objects.
    server
        .apply_yaml(r#"{"kind": "List", "items": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-2"}}]}"#)
        .unwrap();
    assert!(server.delete("nodes", None, "node-2"));
    let (_, slices) =
        c.get("/apis/discovery.k8s.io/v1/namespaces/a/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Dweb");
    assert_eq!(
        (slices["kind"].as_str(), slices["apiVersion"].as_str()),
        (Some("EndpointSliceList"), Some("discovery.k8s.io/v1"))
    );
    assert_eq!(names(&slices), ["a/web-abc"]);
    assert_eq!(slices["items"][0]["endpoints"][0]["addresses"][0], "10.244.0.11");
    let (_, nodes) = c.get("/api/v1/nodes");
    assert_eq!((nodes["kind"].as_str(), names(&nodes)), (Some("NodeList"), vec!["/node-1".to_string()]));
    let (code, node) = c.get("/api/v1/nodes/node-1");
    assert_eq!((code, node["kind"].as_str()), (200, Some("Node")));
    assert!(node["metadata"].get("namespace").is_none());
    // ServiceCIDRs: cluster-scoped, networking.k8s.io/v1.
    server
        .apply_yaml(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\nspec:\n  \
             cidrs: [10.96.0.0/16]\n",
        )
        .unwrap();
    let (_, cidrs) = c.get("/apis/networking.k8s.io/v1/servicecidrs");
    assert_eq!(
        (cidrs["kind"].as_str(), cidrs["apiVersion"].as_str(), names(&cidrs)),
        (Some("ServiceCIDRList"), Some("networking.k8s.io/v1"), vec!["/kubernetes".to_string()])
    );
    assert_eq!(cidrs["items"][0]["spec"]["cidrs"][0], "10.96.0.0/16");
    assert_eq!(c.get("/apis/networking.k8s.io/v1/namespaces/a/servicecidrs").0, 404);
    assert!(server.delete("ServiceCIDR", None, "kubernetes"));

    // Requests are recorded as "METHOD TARGET".
    let requests = server.requests();
    assert_eq!(requests[0], "GET /api/v1/namespaces/b/services/web");
    assert!(requests.contains(&"GET /api/v1/services?&limit=2".to_string()), "{requests:?}");
}

#[test]
fn watch_replays_and_streams_changes_in_order() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({"app": "x"}), 1));
    let rv = server.apply(service("a", "two", json!({"app": "x"}), 2));
    server.apply(service("a", "one", json!({"app": "x"}), 11)); // rv 3, before the watch starts

    // From rv 2: the retained event after it, then live changes, each promptly.
    let mut w = Client::connect(server.addr());
    w.watch(&format!("/api/v1/namespaces/a/services?&watch=true&timeoutSeconds=290&resourceVersion={rv}"));
    let replayed = w.change().unwrap();
    assert_eq!(summary(&replayed), ("MODIFIED".into(), "one".into(), "3".into()));
    assert_eq!(
        (replayed["object"]["kind"].as_str(), replayed["object"]["apiVersion"].as_str()),
        (Some("Service"), Some("v1"))
    );
    assert_eq!(replayed["object"]["spec"]["ports"][0]["port"], 11);

    let started = Instant::now();
    server.apply(service("a", "three", json!({"app": "x"}), 3));
    assert_eq!(summary(&w.change().unwrap()), ("ADDED".into(), "three".into(), "4".into()));
    assert!(started.elapsed() < Duration::from_millis(200), "slow delivery: {:?}", started.elapsed());
    server.apply(service("other", "elsewhere", json!({}), 3)); // another namespace: not on this watch
    server.apply(service("a", "three", json!({"app": "x"}), 33));
    assert!(server.delete("Service", Some("a"), "two"));
    assert!(!server.delete("Service", Some("a"), "two"));
    assert_eq!(summary(&w.change().unwrap()), ("MODIFIED".into(), "three".into(), "6".into()));
    let deleted = w.change().unwrap();
    assert_eq!(summary(&deleted), ("DELETED".into(), "two".into(), "7".into()));
    assert_eq!(deleted["object"]["spec"]["ports"][0]["port"], 2, "DELETED carries the last state");

    // Without a resourceVersion: the current objects as ADDED first, then changes.
    let mut w2 = Client::connect(server.addr());
    w2.watch("/api/v1/services?watch=1");
    let initial: Vec<_> = (0..3).map(|_| summary(&w2.change().unwrap())).collect();
    assert_eq!(
        initial,
        [
            ("ADDED".into(), "one".into(), "3".into()),
            ("ADDED".into(), "three".into(), "6".into()),
            ("ADDED".into(), "elsewhere".into(), "5".into()),
        ]
    );
    server.delete("service", Some("other"), "elsewhere");
    assert_eq!(summary(&w2.change().unwrap()), ("DELETED".into(), "elsewhere".into(), "8".into()));
    // The namespaced watch never saw namespace `other`: its next event is this one.
    server.apply(service("a", "four", json!({}), 4));
    assert_eq!(summary(&w.change().unwrap()), ("ADDED".into(), "four".into(), "9".into()));

    // Selectors on events: an object that stops matching is DELETED, one that starts is ADDED.
    let mut sel = Client::connect(server.addr());
    sel.watch(&format!(
        "/api/v1/services?watch=true&labelSelector=app%3Dx&resourceVersion={}",
        server.resource_version()
    ));
    server.apply(service("a", "one", json!({"app": "y"}), 11));
    let gone = sel.change().unwrap();
    assert_eq!(summary(&gone), ("DELETED".into(), "one".into(), "10".into()));
    assert_eq!(gone["object"]["metadata"]["labels"]["app"], "x", "the last matching state");
    server.apply(service("a", "unrelated", json!({"app": "y"}), 1));
    server.apply(service("a", "one", json!({"app": "x"}), 11));
    assert_eq!(summary(&sel.change().unwrap()), ("ADDED".into(), "one".into(), "12".into()));

    // A field-selected watch of one object (what kube-rs' watch_object does).
    let mut one = Client::connect(server.addr());
    one.watch("/api/v1/namespaces/a/services?watch=true&fieldSelector=metadata.name%3Dthree");
    assert_eq!(summary(&one.change().unwrap()), ("ADDED".into(), "three".into(), "6".into()));
    server.apply(service("a", "one", json!({"app": "x"}), 111));
    server.apply(service("a", "three", json!({"app": "x"}), 333));
    assert_eq!(summary(&one.change().unwrap()), ("MODIFIED".into(), "three".into(), "14".into()));

    // Other kinds have their own streams.
    let mut nodes = Client::connect(server.addr());
    nodes.watch("/api/v1/nodes?watch=true&resourceVersion=1");
    server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}));
    let node = nodes.change().unwrap();
    assert_eq!(summary(&node), ("ADDED".into(), "n1".into(), "15".into()));
    assert_eq!(node["object"]["kind"], "Node");
}

#[test]
fn compacted_resource_version_gets_410_expired() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    server.apply(service("a", "one", json!({}), 2));
    let mut open = Client::connect(server.addr());
    open.watch("/api/v1/services?watch=true&resourceVersion=2");
    let (_, page) = Client::connect(server.addr()).get("/api/v1/services?limit=1");
    assert!(page["metadata"].get("continue").is_none());
    server.apply(service("a", "two", json!({}), 2));
    assert_eq!(summary(&open.change().unwrap()).2, "3");
    server.compact();
    assert_eq!(open.event(), None, "compaction ends open watches");

    let mut c = Client::connect(server.addr());
    c.watch("/api/v1/services?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=1");
    let error = c.event().unwrap();
    assert_eq!(error["type"], "ERROR");
    let status = &error["object"];
    assert_eq!((status["kind"].as_str(), status["apiVersion"].as_str()), (Some("Status"), Some("v1")));
    assert_eq!((status["code"].as_u64(), status["reason"].as_str()), (Some(410), Some("Expired")));
    assert_eq!(status["status"], "Failure");
    assert_eq!(status["message"], "too old resource version: 1 (4)");
    assert_eq!(c.event(), None);

    // Compaction takes a resourceVersion (an unrelated write): even the up-to-date version is
    // too old now, but the compaction point itself works, on the same connection.
    c.watch("/api/v1/services?watch=true&resourceVersion=3");
    assert_eq!(c.event().unwrap()["object"]["message"], "too old resource version: 3 (4)");
    assert_eq!(c.event(), None);
    assert_eq!(Client::connect(server.addr()).get("/api/v1/services").1["metadata"]["resourceVersion"], "4");
    c.watch("/api/v1/services?watch=true&resourceVersion=4");
    server.apply(service("a", "three", json!({}), 3));
    assert_eq!(summary(&c.change().unwrap()), ("ADDED".into(), "three".into(), "5".into()));

    // A continue token from before the compaction is expired too.
    let mut l = Client::connect(server.addr());
    let (_, page) = l.get("/api/v1/services?limit=1");
    let token = page["metadata"]["continue"].as_str().unwrap().to_string();
    server.apply(service("a", "four", json!({}), 4));
    server.compact();
    let (code, err) = l.get(&format!("/api/v1/services?limit=1&continue={token}"));
    assert_eq!((code, err["reason"].as_str()), (410, Some("Expired")), "{err}");
    let (code, _) = l.get("/api/v1/services?limit=1&continue=zz");
    assert_eq!(code, 400);
}

#[test]
fn drop_watches_and_timeout_end_streams_cleanly() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    let mut c = Client::connect(server.addr());
    c.watch("/api/v1/services?watch=true&resourceVersion=1");
    let mut n = Client::connect(server.addr());
    n.watch("/api/v1/nodes?watch=true&allowWatchBookmarks=true");
    server.drop_watches();
    assert_eq!(c.event(), None);
    assert_eq!(n.change(), None);
    // Keep-alive: the same connection watches again, from where it was.
    server.apply(service("a", "two", json!({}), 2));
    c.watch("/api/v1/services?watch=true&resourceVersion=1");
    assert_eq!(summary(&c.change().unwrap()), ("ADDED".into(), "two".into(), "2".into()));

    server.drop_watches();
    assert_eq!(c.event(), None);

    let started = Instant::now();
    c.watch("/api/v1/services?watch=true&resourceVersion=2&timeoutSeconds=1");
    assert_eq!(c.event(), None);
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(950) && took < Duration::from_secs(3), "{took:?}");
    let (code, _) = c.get("/api/v1/services");
    assert_eq!(code, 200);
}

#[test]
fn bookmarks_arrive_when_allowed() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    let mut b = Client::connect(server.addr());
    b.watch("/api/v1/services?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=1");
    let mut plain = Client::connect(server.addr());
    plain.watch("/api/v1/services?watch=true&resourceVersion=1&timeoutSeconds=3");
    // Changes to another kind advance the resourceVersion a bookmark reports.
    server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}));
    server.send_bookmarks();
    let mark = b.event().unwrap();
    assert_eq!(mark["type"], "BOOKMARK");
    assert_eq!(
        mark["object"],
        json!({"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": "2"}})
    );
    // And periodically when idle.
    server.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"}}));
    let started = Instant::now();
    let mark = b.event().unwrap();
    assert_eq!(
        (mark["type"].as_str(), mark["object"]["metadata"]["resourceVersion"].as_str()),
        (Some("BOOKMARK"), Some("3"))
    );
    assert!(started.elapsed() < BOOKMARK_INTERVAL + Duration::from_millis(500), "{:?}", started.elapsed());
    // A watch that did not ask gets none (the stream ends at its timeout with nothing in it).
    assert_eq!(plain.event(), None);

    // Streaming lists: initial ADDED events, then a bookmark marking their end.
    let mut s = Client::connect(server.addr());
    s.watch("/api/v1/services?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0");
    assert_eq!(summary(&s.event().unwrap()), ("ADDED".into(), "one".into(), "1".into()));
    let end = s.event().unwrap();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"], "true");
    assert_eq!(end["object"]["metadata"]["resourceVersion"], "3");
}

#[test]
fn injected_failures_and_drop_close_connections() {
    let server = ApiServer::start().unwrap();
    let mut c = Client::connect(server.addr());
    server.fail_next(2);
    for _ in 0..2 {
        let (code, err) = c.get("/api/v1/services?limit=500");
        assert_eq!(
            (code, err["kind"].as_str(), err["reason"].as_str(), err["code"].as_u64()),
            (500, Some("Status"), Some("InternalError"), Some(500))
        );
    }
    assert_eq!(c.get("/api/v1/services?limit=500").0, 200);
    assert_eq!(server.requests().len(), 3);
    // Connection: close is honoured.
    let mut once = TcpStream::connect(server.addr()).unwrap();
    once.write_all(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut all = String::new();
    once.read_to_string(&mut all).unwrap();
    assert!(all.starts_with("HTTP/1.1 200 OK\r\n") && all.contains("gitVersion"), "{all}");

    let mut w = Client::connect(server.addr());
    w.watch("/api/v1/services?watch=true");
    let started = Instant::now();
    drop(server);
    let mut rest = Vec::new();
    let _ = w.reader.read_to_end(&mut rest);
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
}

#[test]
fn an_expired_watch_can_be_answered_410_itself() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    server.compact();
    server.expire_watches_with_410(true);
    let mut c = Client::connect(server.addr());
    let (code, status) = c.get("/api/v1/services?watch=true&resourceVersion=1");
    assert_eq!(
        (code, status["kind"].as_str(), status["reason"].as_str()),
        (410, Some("Status"), Some("Expired"))
    );
    assert_eq!(status["message"], "too old resource version: 1 (2)");
    // A watch from the compaction point is a stream as before, on the same connection.
    c.watch("/api/v1/services?watch=true&resourceVersion=2");
    server.apply(service("a", "two", json!({}), 2));
    assert_eq!(summary(&c.change().unwrap()), ("ADDED".into(), "two".into(), "3".into()));
    // Off again: the ERROR event.
    server.expire_watches_with_410(false);
    let mut e = Client::connect(server.addr());
    e.watch("/api/v1/services?watch=true&resourceVersion=1");
    assert_eq!(e.event().unwrap()["type"], "ERROR");
}

#[test]
fn event_lines_can_be_cut_or_garbled() {
    let server = ApiServer::start().unwrap();
    let mut c = Client::connect(server.addr());
    c.watch("/api/v1/services?watch=true&resourceVersion=0");
    server.garble_next_events(1);
    server.apply(service("a", "one", json!({}), 1));
    server.apply(service("a", "two", json!({}), 2));
    assert_eq!(c.read_chunk().unwrap(), format!("{GARBAGE_LINE}\n"));
    assert_eq!(summary(&c.change().unwrap()), ("ADDED".into(), "two".into(), "2".into()));
    assert_eq!(server.faults_pending(), 0);
    server.truncate_next_events(1);
    server.apply(service("a", "one", json!({}), 11));
    server.apply(service("a", "two", json!({}), 12));
    let half = c.read_chunk().unwrap();
    assert!(
        half.starts_with(r#"{"object":"#)
            && half.ends_with('\n')
            && serde_json::from_str::<Value>(&half).is_err()
    );
    assert_eq!(summary(&c.change().unwrap()), ("MODIFIED".into(), "two".into(), "4".into()));

    // Cut: a chunk announced at the line's length, half of it, then the connection closes.
    server.cut_next_events(1);
    server.apply(service("a", "three", json!({}), 3));
    let size = usize::from_str_radix(c.read_line().trim_end(), 16).unwrap();
    let mut rest = Vec::new();
    c.reader.read_to_end(&mut rest).unwrap();
    assert_eq!(rest.len(), size / 2);
    assert!(String::from_utf8(rest).unwrap().starts_with(r#"{"object":"#));
    // The event itself is intact: a watch from before it gets it whole.
    let mut again = Client::connect(server.addr());
    again.watch("/api/v1/services?watch=true&resourceVersion=4");
    assert_eq!(summary(&again.change().unwrap()), ("ADDED".into(), "three".into(), "5".into()));
}

#[test]
fn lists_can_fail_or_be_slow_and_watches_held_open() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    let mut c = Client::connect(server.addr());
    server.fail_lists(true);
    let (code, status) = c.get("/api/v1/services?limit=500");
    assert_eq!((code, status["reason"].as_str()), (500, Some("InternalError")));
    assert_eq!(c.get("/api/v1/namespaces/a/services/one").0, 200, "a get is not a list");
    server.fail_lists(false);
    server.delay_lists(Duration::from_millis(300));
    let started = Instant::now();
    assert_eq!(names(&c.get("/api/v1/services").1), ["a/one"]);
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.delay_lists(Duration::ZERO);

    // Held: timeoutSeconds=1 is ignored, bookmarks keep coming, and each is recorded.
    server.hold_watches(true);
    let mut w = Client::connect(server.addr());
    w.watch("/api/v1/services?watch=true&allowWatchBookmarks=true&timeoutSeconds=1&resourceVersion=1");
    let started = Instant::now();
    let mut marks = 0;
    while started.elapsed() < Duration::from_millis(2500) {
        assert_eq!(w.event().unwrap()["type"], "BOOKMARK");
        marks += 1;
    }
    assert!(marks >= 2);
    let sent = server.bookmarks_sent();
    assert!(
        sent.len() >= marks && sent.iter().all(|b| b.kind == "Service" && b.resource_version == 1),
        "{sent:?}"
    );
    server.hold_watches(false);
    assert_eq!(w.change(), None, "released, the watch ends (its timeout has passed)");
}

#[test]
fn a_server_can_stop_answering_and_refuse_connections() {
    let server = ApiServer::start().unwrap();
    server.apply(service("a", "one", json!({}), 1));
    let mut w = Client::connect(server.addr());
    w.watch("/api/v1/services?watch=true&allowWatchBookmarks=true&resourceVersion=1");
    server.stop_answering();
    let mut c = Client::connect(server.addr());
    c.stream.set_read_timeout(Some(Duration::from_millis(1500))).unwrap();
    c.send("/api/v1/services");
    let mut byte = [0u8; 1];
    let err = c.reader.read(&mut byte).unwrap_err();
    assert!(matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{err:?}");
    // Silent watch: no bookmark although over a second passed; a change waits too.
    server.apply(service("a", "two", json!({}), 2));
    w.stream.set_read_timeout(Some(Duration::from_millis(1500))).unwrap();
    assert!(w.reader.read(&mut byte).is_err(), "the held watch sent something");
    server.answer_again();
    c.stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (code, headers) = c.read_head();
    assert_eq!(code, 200);
    let mut body = vec![0; headers["content-length"].parse().unwrap()];
    c.reader.read_exact(&mut body).unwrap();
    w.stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(summary(&w.change().unwrap()), ("ADDED".into(), "two".into(), "2".into()));

    server.refuse_connections();
    let mut rest = Vec::new();
    w.reader.read_to_end(&mut rest).expect("open connections are closed");
    let refused = TcpStream::connect(server.addr()).unwrap_err();
    assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
    server.accept_connections().unwrap();
    assert_eq!(names(&Client::connect(server.addr()).get("/api/v1/services").1), ["a/one", "a/two"]);
}

/// A network namespace that is deleted on drop (panics included).
struct TestNetns(String);

impl TestNetns {
    fn create() -> TestNetns {
        let name = format!("kpapi-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let status = Command::new("ip").args(["netns", "add", &name]).status().expect("running ip");
        assert!(status.success(), "ip netns add {name}");
        TestNetns(name)
    }

    fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.0)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[test]
fn start_in_netns_listens_inside_the_namespace() {
    crate::require_root().unwrap();
    let netns = TestNetns::create();
    let server = ApiServer::start_in_netns(&netns.path()).unwrap();
    server.apply(service("a", "one", json!({}), 1));
    let addr = server.addr();
    let path = netns.path();
    let (tx, rx) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || {
        let ns = File::open(&path).unwrap();
        // SAFETY: plain syscall; it moves only this thread.
        assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        let mut c = Client::connect(addr);
        let (code, list) = c.get("/api/v1/services");
        assert_eq!((code, names(&list)), (200, vec!["a/one".to_string()]));
        c.watch("/api/v1/services?watch=true&resourceVersion=1");
        tx.send(()).unwrap();
        summary(&c.change().unwrap())
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the client in the netns got its list");
    server.apply(service("a", "two", json!({}), 2));
    assert_eq!(client.join().unwrap(), ("ADDED".into(), "two".into(), "2".into()));
    // Nothing listens on that port in this (the caller's) namespace.
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
    drop(server);
}
