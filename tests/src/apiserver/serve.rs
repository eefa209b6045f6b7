//! Connections, routing, list/get and watch.

use std::io::{self, BufReader};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, Request};
use super::selector::{FieldSelector, LabelSelector};
use super::{BOOKMARK_INTERVAL, BookmarkSent, EventType, GARBAGE_LINE, Kind, Shared, State, status};

/// A watch without `timeoutSeconds` ends after this long (the real server picks 30–60 min).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// Accepts until the server stops or stops listening (`listen_epoch` moves past `epoch`).
pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener, epoch: u64) {
    loop {
        let accepted = listener.accept();
        let mut st = shared.lock();
        if st.stopping || st.listen_epoch != epoch {
            return;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                drop(st);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else { continue };
        let id = st.next_conn;
        st.next_conn += 1;
        st.conns.insert(id, clone);
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new().name(format!("apiserver-conn-{id}")).spawn(move || {
            let _ = serve_connection(&conn_shared, &stream);
            conn_shared.lock().conns.remove(&id);
        });
        st.threads.retain(|t| !t.is_finished());
        match spawned {
            Ok(handle) => st.threads.push(handle),
            Err(_) => {
                st.conns.remove(&id);
            }
        }
    }
}

fn serve_connection(shared: &Shared, stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    while let Some(request) = http::read_request(&mut reader)? {
        handle(shared, stream, &request)?;
        if !request.keep_alive {
            break;
        }
    }
    Ok(())
}

/// What a request path names.
struct Route {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
}

fn route(path: &str) -> Option<Route> {
    let path = path.strip_suffix('/').unwrap_or(path);
    Kind::ALL.into_iter().find_map(|kind| {
        let rest = path.strip_prefix(kind.prefix())?.strip_prefix('/')?;
        let segments: Vec<&str> = rest.split('/').collect();
        let (namespace, tail) = match segments.as_slice() {
            ["namespaces", ns, tail @ ..] if kind.namespaced() && !tail.is_empty() => {
                (Some(ns.to_string()), tail)
            }
            tail => (None, tail),
        };
        match tail {
            [plural] if *plural == kind.plural() => Some(Route { kind, namespace, name: None }),
            [plural, name]
                if *plural == kind.plural()
                    && !name.is_empty()
                    && (namespace.is_some() || !kind.namespaced()) =>
            {
                Some(Route { kind, namespace, name: Some(name.to_string()) })
            }
            _ => None,
        }
    })
}

fn handle(shared: &Shared, stream: &TcpStream, req: &Request) -> io::Result<()> {
    let keep = req.keep_alive;
    {
        let mut st = shared.lock();
        st.requests.push(format!("{} {}", req.method, req.target));
        // Not answering: hold the request until told to answer again, or the client gives up.
        while st.faults.silent && !st.stopping {
            if peer_closed(stream) {
                return Err(io::ErrorKind::ConnectionAborted.into());
            }
            st = shared
                .changed
                .wait_timeout(st, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if st.fail_next > 0 {
            st.fail_next -= 1;
            drop(st);
            let body = status(
                500,
                "InternalError",
                "an error on the server (\"injected by the test\") has prevented the request from succeeding",
            );
            return http::write_json(stream, 500, &body, keep);
        }
    }
    if req.method == "GET" && req.path == "/version" {
        let version = json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-kproxy-fake", "platform": "linux/amd64"});
        return http::write_json(stream, 200, &version, keep);
    }
    let hidden = |route: &Route| route.kind == Kind::ServiceCidr && shared.lock().faults.no_service_cidrs;
    let Some(route) = route(&req.path).filter(|route| !hidden(route)) else {
        let body = status(404, "NotFound", "the server could not find the requested resource");
        return http::write_json(stream, 404, &body, keep);
    };
    if req.method != "GET" {
        let body =
            status(405, "MethodNotAllowed", &format!("{} is not supported by this test server", req.method));
        return http::write_json(stream, 405, &body, keep);
    }
    let filter = match Filter::new(&route, req) {
        Ok(filter) => filter,
        Err(message) => return http::write_json(stream, 400, &status(400, "BadRequest", &message), keep),
    };
    if matches!(req.param("watch"), Some("true" | "1")) {
        return watch(shared, stream, req, &filter);
    }
    if route.name.is_none() {
        let (fail, delay) = {
            let st = shared.lock();
            (st.faults.lists_fail, st.faults.list_delay)
        };
        if fail {
            let body = status(
                500,
                "InternalError",
                "an error on the server (\"lists fail, as the test asked\") has prevented the request from succeeding",
            );
            return http::write_json(stream, 500, &body, keep);
        }
        pause(shared, delay);
    }
    let (code, body) = match &route.name {
        Some(name) => get(&shared.lock(), &route, name),
        None => list(&shared.lock(), req, &filter),
    };
    http::write_json(stream, code, &body, keep)
}

/// Which objects a request sees: its kind, namespace/name from the path, and its selectors.
struct Filter {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filter {
    fn new(route: &Route, req: &Request) -> Result<Filter, String> {
        Ok(Filter {
            kind: route.kind,
            namespace: route.namespace.clone(),
            name: route.name.clone(),
            labels: LabelSelector::parse(req.param("labelSelector").unwrap_or_default())?,
            fields: FieldSelector::parse(req.param("fieldSelector").unwrap_or_default())?,
        })
    }

    fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        self.namespace.as_deref().is_none_or(|ns| meta["namespace"].as_str() == Some(ns))
            && self.name.as_deref().is_none_or(|name| meta["name"].as_str() == Some(name))
            && self.labels.matches(object)
            && self.fields.matches(object)
    }

    /// The current objects of the kind that match, in key order.
    fn current<'a>(&'a self, st: &'a State) -> impl Iterator<Item = (&'a (Kind, String, String), &'a Value)> {
        st.objects.iter().filter(move |(key, object)| key.0 == self.kind && self.matches(object))
    }
}

fn get(st: &State, route: &Route, name: &str) -> (u16, Value) {
    let key = (route.kind, route.namespace.clone().unwrap_or_default(), name.to_string());
    match st.objects.get(&key) {
        Some(object) => (200, object.clone()),
        None => {
            let plural = route.kind.plural();
            let mut body = status(404, "NotFound", &format!("{plural} \"{name}\" not found"));
            body["details"] = json!({"name": name, "kind": plural});
            (404, body)
        }
    }
}

/// Continue tokens: opaque to clients; here hex of `rv/namespace/name` of the last item sent.
fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    format!("{rv}/{ns}/{name}").bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<(u64, String, String)> {
    if !token.len().is_multiple_of(2) || !token.is_ascii() {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..token.len()).step_by(2).map(|i| u8::from_str_radix(&token[i..i + 2], 16).ok()).collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.splitn(3, '/');
    Some((parts.next()?.parse().ok()?, parts.next()?.to_string(), parts.next()?.to_string()))
}

fn list(st: &State, req: &Request, filter: &Filter) -> (u16, Value) {
    let (list_rv, after) = match req.param("continue").filter(|t| !t.is_empty()) {
        None => (st.rv, None),
        Some(token) => match decode_continue(token) {
            None => {
                return (
                    400,
                    status(400, "BadRequest", "continue key is not valid: not a token of this server"),
                );
            }
            Some((rv, _, _)) if rv < st.compacted => {
                let message = "The provided continue parameter is too old to display a consistent list result. \
                               You can start a new list without the continue parameter.";
                return (410, status(410, "Expired", message));
            }
            Some((rv, ns, name)) => (rv, Some((ns, name))),
        },
    };
    let limit = match req.param("limit").map(str::parse::<usize>) {
        None | Some(Ok(0)) => usize::MAX,
        Some(Ok(limit)) => limit,
        Some(Err(_)) => return (400, status(400, "BadRequest", "limit must be a non-negative integer")),
    };
    let mut remaining = filter
        .current(st)
        .filter(|(key, _)| after.as_ref().is_none_or(|(ns, name)| (&key.1, &key.2) > (ns, name)));
    let mut items = Vec::new();
    let mut last = None;
    for (key, object) in remaining.by_ref().take(limit) {
        let mut item = object.clone();
        if let Some(map) = item.as_object_mut() {
            map.remove("kind");
            map.remove("apiVersion");
        }
        items.push(item);
        last = Some(key);
    }
    let left = remaining.count();
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if left > 0
        && let Some((_, ns, name)) = last
    {
        metadata["continue"] = encode_continue(list_rv, ns, name).into();
        metadata["remainingItemCount"] = left.into();
    }
    let kind = filter.kind;
    (
        200,
        json!({"kind": format!("{}List", kind.name()), "apiVersion": kind.api_version(), "metadata": metadata, "items": items}),
    )
}

fn event_line(etype: &str, object: &Value) -> String {
    let mut line = json!({"type": etype, "object": object}).to_string();
    line.push('\n');
    line
}

fn bookmark_line(kind: Kind, rv: u64, initial_events_end: bool) -> String {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": kind.name(), "apiVersion": kind.api_version(), "metadata": metadata}),
    )
}

/// Waits `delay`, or less if the server stops.
fn pause(shared: &Shared, delay: Duration) {
    let until = Instant::now() + delay;
    let mut st = shared.lock();
    while !st.stopping {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        st = shared.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// True once the client has closed (or reset) its side of the connection.
fn peer_closed(stream: &TcpStream) -> bool {
    let mut fds = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, no waiting.
    let ready = unsafe { libc::poll(&mut fds, 1, 0) };
    ready > 0 && fds.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn watch(shared: &Shared, stream: &TcpStream, req: &Request, filter: &Filter) -> io::Result<()> {
    let timeout = match req.param("timeoutSeconds").map(str::parse::<u64>) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(Ok(secs)) => Duration::from_secs(secs),
        Some(Err(_)) => {
            let body = status(400, "BadRequest", "timeoutSeconds must be a non-negative integer");
            return http::write_json(stream, 400, &body, req.keep_alive);
        }
    };
    let deadline = Instant::now() + timeout;
    let bookmarks = req.param("allowWatchBookmarks") == Some("true");
    let initial_events = req.param("sendInitialEvents") == Some("true");
    let since = match req.param("resourceVersion").unwrap_or_default() {
        "" | "0" => None,
        rv => match rv.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => {
                let body = status(400, "BadRequest", &format!("invalid resource version: {rv}"));
                return http::write_json(stream, 400, &body, req.keep_alive);
            }
        },
    };

    let st = shared.lock();
    let epoch = st.watch_epoch;
    let mut bookmark_epoch = st.bookmark_epoch;
    let mut first = Vec::new();
    let mut cursor = match since {
        Some(rv) if rv < st.compacted && !initial_events && st.faults.expired_watch_as_status => {
            let message = format!("too old resource version: {rv} ({})", st.compacted);
            drop(st);
            return http::write_json(stream, 410, &status(410, "Expired", &message), req.keep_alive);
        }
        Some(rv) if rv < st.compacted && !initial_events => {
            let message = format!("too old resource version: {rv} ({})", st.compacted);
            drop(st);
            http::write_stream_head(stream)?;
            http::write_chunks(stream, &[event_line("ERROR", &status(410, "Expired", &message))])?;
            return http::write_stream_end(stream);
        }
        Some(rv) if !initial_events => rv,
        _ => {
            first.extend(filter.current(&st).map(|(_, object)| event_line("ADDED", object)));
            if initial_events && bookmarks {
                first.push(bookmark_line(filter.kind, st.rv, true));
            }
            st.rv
        }
    };
    drop(st);
    http::write_stream_head(stream)?;
    http::write_chunks(stream, &first)?;
    let mut last_sent = Instant::now();

    loop {
        let mut lines = Vec::new();
        // An event line to write only half of before closing the connection.
        let mut cut = None;
        let mut st = shared.lock();
        loop {
            let now = Instant::now();
            let silent = st.faults.silent;
            let held = st.faults.hold_watches || silent;
            if st.stopping || st.watch_epoch != epoch || (now >= deadline && !held) {
                drop(st);
                return http::write_stream_end(stream);
            }
            if !silent {
                let start = st.events.partition_point(|e| e.rv <= cursor);
                let mut event_lines = Vec::new();
                for event in st.events.range(start..).filter(|e| e.kind == filter.kind) {
                    let now_matches = filter.matches(&event.object);
                    let line = match (event.etype, event.prev.as_ref().map(|prev| filter.matches(prev))) {
                        (EventType::Modified, Some(true)) if !now_matches => {
                            // Stopped matching: DELETED with the old state at the new resourceVersion.
                            let mut old = event.prev.clone().unwrap_or_default();
                            old["metadata"]["resourceVersion"] = event.rv.to_string().into();
                            Some(event_line("DELETED", &old))
                        }
                        (EventType::Modified, Some(false)) if now_matches => {
                            Some(event_line("ADDED", &event.object))
                        }
                        (EventType::Modified, Some(false)) => None,
                        (etype, _) if now_matches => Some(event_line(etype.as_str(), &event.object)),
                        _ => None,
                    };
                    event_lines.extend(line);
                }
                cursor = cursor.max(st.rv);
                for line in event_lines {
                    if st.faults.cut_events > 0 {
                        st.faults.cut_events -= 1;
                        cut = Some(line);
                        break;
                    }
                    if st.faults.garble_events > 0 {
                        st.faults.garble_events -= 1;
                        lines.push(format!("{GARBAGE_LINE}\n"));
                    } else if st.faults.truncate_events > 0 {
                        st.faults.truncate_events -= 1;
                        lines.push(format!("{}\n", &line[..line.len() / 2]));
                    } else {
                        lines.push(line);
                    }
                }
                if cut.is_some() {
                    break;
                }
                let mut bookmark = false;
                if st.bookmark_epoch != bookmark_epoch {
                    bookmark_epoch = st.bookmark_epoch;
                    bookmark = bookmarks;
                }
                if bookmarks && lines.is_empty() && now >= last_sent + BOOKMARK_INTERVAL {
                    bookmark = true;
                }
                if bookmark {
                    lines.push(bookmark_line(filter.kind, cursor, false));
                    let sent = BookmarkSent { kind: filter.kind.name(), resource_version: cursor, at: now };
                    st.bookmarks.push(sent);
                }
            }
            if !lines.is_empty() {
                break;
            }
            drop(st);
            if peer_closed(stream) {
                return Ok(());
            }
            let mut wait =
                if held { Duration::from_secs(1) } else { deadline.saturating_duration_since(now) };
            wait = wait.min(Duration::from_secs(1));
            if bookmarks && !silent {
                wait = wait.min((last_sent + BOOKMARK_INTERVAL).saturating_duration_since(now));
            }
            st = shared.lock();
            // Re-check before sleeping: a change may have landed while unlocked.
            if st.events.back().is_some_and(|e| e.rv > cursor)
                || st.bookmark_epoch != bookmark_epoch
                || st.watch_epoch != epoch
                || st.stopping
                || st.faults.silent != silent
            {
                continue;
            }
            st = shared.changed.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(st);
        http::write_chunks(stream, &lines)?;
        if let Some(line) = cut {
            http::write_half_chunk(stream, &line)?;
            let _ = stream.shutdown(Shutdown::Both);
            return Ok(());
        }
        last_sent = Instant::now();
    }
}
