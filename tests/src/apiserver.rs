//! An in-process Kubernetes API server for testing the agent's kube-rs watchers.
//!
//! **This is the only fake in the test suite**: a real API server cannot be installed here, so
//! [`ApiServer`] speaks the real list/watch protocol (HTTP/1.1, keep-alive, no TLS) over a real
//! TCP socket with real object JSON, for the kinds kproxy watches: `Service` (`v1`),
//! `EndpointSlice` (`discovery.k8s.io/v1`), `Node` (`v1`) and `ServiceCIDR` (`networking.k8s.io/v1`,
//! cluster-scoped, as served since Kubernetes 1.33). Everything else about the agent (its
//! kube-rs client, its watchers, its datapath) is the real thing.
//!
//! What it implements, modelled on kube-apiserver + etcd:
//! - a global resourceVersion counter; every create/update/delete gets the next one. Objects get
//!   `metadata.uid` and `metadata.creationTimestamp` on create (kept on update); an update that
//!   changes nothing is a no-op (no new resourceVersion, no event), as on a real server;
//! - `GET` of collections (cluster-wide or per namespace) and of single objects. Lists carry the
//!   current resourceVersion and omit the items' `kind`/`apiVersion`; `limit` + `continue`
//!   paginate (the token is opaque; an expired one gets `410 Expired`); `labelSelector` (`k`, `!k`,
//!   `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`) and `fieldSelector` (`metadata.name`,
//!   `metadata.namespace` with `=`, `==`, `!=`) filter. `resourceVersion`/`resourceVersionMatch`
//!   on lists are ignored (the current state is served);
//! - watches (`watch=true`/`1`): a chunked `application/json` stream, one event per line and per
//!   chunk. From `resourceVersion=N` every retained event newer than `N` is replayed; from a
//!   version older than the last [`ApiServer::compact`] the stream is a single `ERROR` event with
//!   a `410 Expired` Status ("too old resource version: N (M)"), as on a real server.
//!   Without a resourceVersion (or `0`) the current objects come first as `ADDED`.
//!   `sendInitialEvents=true` (streaming lists) sends the current objects then a `BOOKMARK`
//!   annotated `k8s.io/initial-events-end`. Selectors apply to events; an object that stops
//!   (starts) matching is sent as `DELETED` (`ADDED`). `timeoutSeconds` ends the stream cleanly;
//!   with `allowWatchBookmarks=true` a `BOOKMARK` is sent after [`BOOKMARK_INTERVAL`] of silence
//!   and on [`ApiServer::send_bookmarks`];
//! - errors are `Status` objects (`404 NotFound`, `400 BadRequest`, `405 MethodNotAllowed`,
//!   `500 InternalError` from [`ApiServer::fail_next`]).
//!
//! Faults, for testing how a client copes (each as a real server or the network between shows it):
//! [`ApiServer::expire_watches_with_410`] (an expired watch answered `410 Gone` itself rather than
//! with an ERROR event), [`ApiServer::cut_next_events`] (half an event line, then the connection
//! closes), [`ApiServer::garble_next_events`] (a line that is not an event in place of one),
//! [`ApiServer::truncate_next_events`] (half an event line, then the stream goes on),
//! [`ApiServer::fail_lists`] (`500` on every list), [`ApiServer::hide_service_cidrs`] (a server
//! without the kind), [`ApiServer::delay_lists`],
//! [`ApiServer::hold_watches`] (`timeoutSeconds` ignored, so only bookmarks show the watch is
//! alive), [`ApiServer::stop_answering`] (requests read but not answered, open watches silent) and
//! [`ApiServer::refuse_connections`] (nothing listening: connections refused).
//!
//! Not implemented: writes over HTTP (tests change state through [`ApiServer::apply`] and
//! friends), defaulting/validation/allocation (objects are stored as given), other kinds,
//! authentication, TLS, protobuf, gzip.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_json::{Value, json};

mod http;
mod selector;
mod serve;
#[cfg(test)]
mod tests;

/// How long a bookmark-enabled watch may stay silent before the server sends a `BOOKMARK`.
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// The kinds the server knows.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Service, Kind::EndpointSlice, Kind::Node, Kind::ServiceCidr];

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
        }
    }

    /// The path prefix of the kind's group/version.
    fn prefix(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "/api/v1",
            Kind::EndpointSlice => "/apis/discovery.k8s.io/v1",
            Kind::ServiceCidr => "/apis/networking.k8s.io/v1",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::ServiceCidr => "servicecidrs",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Kind::Node | Kind::ServiceCidr)
    }

    /// `Service`, `service` or `services` (any case).
    fn parse(kind: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(kind) || k.plural().eq_ignore_ascii_case(kind))
    }
}

/// (kind, namespace or "" for cluster-scoped kinds, name); the order is etcd's key order.
type Key = (Kind, String, String);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One retained change (the watch cache / etcd history).
struct Event {
    rv: u64,
    kind: Kind,
    etype: EventType,
    /// The new state (for DELETED: the last state with the deletion's resourceVersion).
    object: Value,
    /// The state before a MODIFIED (to send DELETED/ADDED when selectors stop/start matching).
    prev: Option<Value>,
}

struct State {
    /// The last resourceVersion handed out.
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// Events newer than `compacted`, oldest first.
    events: VecDeque<Event>,
    /// Events up to this resourceVersion are forgotten.
    compacted: u64,
    /// Bumped by `drop_watches`/`compact`: watches started in an older epoch end.
    watch_epoch: u64,
    /// Bumped by `send_bookmarks`.
    bookmark_epoch: u64,
    fail_next: usize,
    faults: Faults,
    /// Bookmarks written on watches, oldest first.
    bookmarks: Vec<BookmarkSent>,
    /// Bumped by `refuse_connections`: the accept thread of an older epoch stops.
    listen_epoch: u64,
    requests: Vec<String>,
    /// Open connections (clones, to shut them down on drop).
    conns: HashMap<u64, TcpStream>,
    next_conn: u64,
    threads: Vec<JoinHandle<()>>,
    stopping: bool,
}

/// What the server is told to get wrong (see the fault methods of [`ApiServer`]).
#[derive(Default)]
struct Faults {
    /// A watch from an expired resourceVersion gets an HTTP `410` answer, not a stream with an ERROR.
    expired_watch_as_status: bool,
    /// The next this many event lines any watch sends are cut in half, then the connection closes.
    cut_events: usize,
    /// The next this many event lines any watch sends are replaced by [`GARBAGE_LINE`].
    garble_events: usize,
    /// The next this many event lines any watch sends lose their second half (the stream goes on).
    truncate_events: usize,
    lists_fail: bool,
    list_delay: Duration,
    hold_watches: bool,
    silent: bool,
    /// ServiceCIDRs are not served (`404`), as by an API server before Kubernetes 1.33.
    no_service_cidrs: bool,
}

/// What a garbled event line is replaced by: a proxy's error page, one line of it.
pub const GARBAGE_LINE: &str = "<html><body><h1>502 Bad Gateway</h1></body></html>";

/// A `BOOKMARK` the server wrote on a watch.
#[derive(Clone, Debug)]
pub struct BookmarkSent {
    /// The watched kind (`Service`, `EndpointSlice`, `Node`).
    pub kind: &'static str,
    pub resource_version: u64,
    pub at: Instant,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// An in-process Kubernetes API server (see the module docs). Drop stops it and closes every
/// connection.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The network namespace it listens in (None: the caller's), to listen again after
    /// [`ApiServer::refuse_connections`].
    netns: Option<PathBuf>,
    listening: Mutex<Option<Listening>>,
}

/// The listening socket and its accept thread.
struct Listening {
    /// A clone of the listening socket, shut down to wake the accept thread.
    listener: TcpListener,
    accept: JoinHandle<()>,
}

impl ApiServer {
    /// Listens on 127.0.0.1:<ephemeral> in the caller's network namespace.
    pub fn start() -> Result<ApiServer> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the API server on 127.0.0.1")?;
        Self::serve(listener, None)
    }

    /// Listens on 127.0.0.1:<ephemeral> inside the network namespace at `netns_path` (e.g.
    /// `/run/netns/NAME`): a helper thread enters the namespace and creates the listening socket,
    /// which stays in that namespace while the serving threads run in this process, so an agent
    /// running there (`nsenter --net=…`) can reach it. Brings the namespace's `lo` up if it is down
    /// (as in a fresh `ip netns add` namespace).
    pub fn start_in_netns(netns_path: &Path) -> Result<ApiServer> {
        let listener = listen_in_netns(netns_path, "127.0.0.1:0".parse()?)?;
        Self::serve(listener, Some(netns_path.to_path_buf()))
    }

    fn serve(listener: TcpListener, netns: Option<PathBuf>) -> Result<ApiServer> {
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 0,
                objects: BTreeMap::new(),
                events: VecDeque::new(),
                compacted: 0,
                watch_epoch: 0,
                bookmark_epoch: 0,
                fail_next: 0,
                faults: Faults::default(),
                bookmarks: Vec::new(),
                listen_epoch: 0,
                requests: Vec::new(),
                conns: HashMap::new(),
                next_conn: 0,
                threads: Vec::new(),
                stopping: false,
            }),
            changed: Condvar::new(),
        });
        let listening = Self::accept_on(&shared, listener, 0)?;
        Ok(ApiServer { shared, addr, netns, listening: Mutex::new(Some(listening)) })
    }

    fn accept_on(shared: &Arc<Shared>, listener: TcpListener, epoch: u64) -> Result<Listening> {
        let accept_listener = listener.try_clone()?;
        let accept_shared = shared.clone();
        let accept = std::thread::Builder::new()
            .name("apiserver-accept".into())
            .spawn(move || serve::accept_loop(&accept_shared, &accept_listener, epoch))?;
        Ok(Listening { listener, accept })
    }

    /// Closes the listening socket and every connection (clients see their watches end and then
    /// `connection refused`) until [`ApiServer::accept_connections`].
    pub fn refuse_connections(&self) {
        let listening = self.listening.lock().unwrap_or_else(|p| p.into_inner()).take();
        {
            let mut st = self.shared.lock();
            st.listen_epoch += 1;
            for conn in st.conns.values() {
                let _ = conn.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        if let Some(listening) = listening {
            // Wakes the blocked accept() (EINVAL on Linux); the thread sees the new epoch and ends.
            // SAFETY: plain syscall on a valid fd we own.
            unsafe { libc::shutdown(listening.listener.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = listening.accept.join();
        }
    }

    /// Listens again, on the same address, after [`ApiServer::refuse_connections`].
    pub fn accept_connections(&self) -> Result<()> {
        let mut listening = self.listening.lock().unwrap_or_else(|p| p.into_inner());
        if listening.is_some() {
            return Ok(());
        }
        let listener = match &self.netns {
            Some(path) => listen_in_netns(path, self.addr)?,
            None => {
                TcpListener::bind(self.addr).with_context(|| format!("listening on {} again", self.addr))?
            }
        };
        let epoch = self.shared.lock().listen_epoch;
        *listening = Some(Self::accept_on(&self.shared, listener, epoch)?);
        Ok(())
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current (last handed out) resourceVersion.
    pub fn resource_version(&self) -> String {
        self.shared.lock().rv.to_string()
    }

    /// Creates or replaces an object (`kind` Service, EndpointSlice or Node, with `apiVersion`
    /// optional but checked, `metadata.name`, and `metadata.namespace` for namespaced kinds,
    /// `default` if absent). Assigns `metadata.resourceVersion` (global counter), and on create
    /// `uid` and `creationTimestamp` (kept on replace); emits ADDED or MODIFIED. Returns the
    /// object's resourceVersion: unchanged, with no event, if the replacement changes nothing.
    ///
    /// Panics on an object the server cannot store (unknown kind, no name): a test bug.
    pub fn apply(&self, object: Value) -> String {
        let mut object = object;
        let (kind, key) = match identify(&mut object) {
            Ok(found) => found,
            Err(err) => panic!("ApiServer::apply: {err:#}: {object}"),
        };
        let mut st = self.shared.lock();
        let prev = st.objects.get(&key).cloned();
        let etype = match &prev {
            Some(old) => {
                for field in ["uid", "creationTimestamp", "resourceVersion"] {
                    object["metadata"][field] = old["metadata"][field].clone();
                }
                if &object == old {
                    return old["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string();
                }
                EventType::Modified
            }
            None => {
                let meta = &mut object["metadata"];
                if meta.get("uid").and_then(Value::as_str).is_none_or(str::is_empty) {
                    meta["uid"] = new_uid().into();
                }
                meta["creationTimestamp"] = rfc3339_now().into();
                EventType::Added
            }
        };
        st.rv += 1;
        let rv = st.rv;
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        st.objects.insert(key, object.clone());
        st.events.push_back(Event { rv, kind, etype, object, prev });
        drop(st);
        self.shared.changed.notify_all();
        rv.to_string()
    }

    /// Parses YAML (multi-document, `---`) or JSON text and applies each object (a `kind: List`
    /// applies its items).
    pub fn apply_yaml(&self, text: &str) -> Result<()> {
        let mut objects = Vec::new();
        for document in serde_yaml::Deserializer::from_str(text) {
            let value = Value::deserialize(document).context("parsing YAML")?;
            match value {
                Value::Null => {}
                Value::Object(ref map) if map.get("kind").and_then(Value::as_str) == Some("List") => {
                    objects.extend(map.get("items").and_then(Value::as_array).cloned().unwrap_or_default())
                }
                value => objects.push(value),
            }
        }
        // Check everything before changing anything.
        for object in &objects {
            identify(&mut object.clone()).with_context(|| format!("cannot apply {object}"))?;
        }
        for object in objects {
            self.apply(object);
        }
        Ok(())
    }

    /// Deletes an object (`kind` as `Service`/`service`/`services`; `namespace` ignored for
    /// cluster-scoped kinds, `default` if `None` for namespaced ones). Emits DELETED with the last
    /// state and a new resourceVersion. `false` if there is no such object.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> bool {
        let kind = Kind::parse(kind).unwrap_or_else(|| panic!("ApiServer::delete: unknown kind {kind:?}"));
        let ns = if kind.namespaced() { namespace.unwrap_or("default") } else { "" };
        let mut st = self.shared.lock();
        let Some(mut object) = st.objects.remove(&(kind, ns.to_string(), name.to_string())) else {
            return false;
        };
        st.rv += 1;
        let rv = st.rv;
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        st.events.push_back(Event { rv, kind, etype: EventType::Deleted, object, prev: None });
        drop(st);
        self.shared.changed.notify_all();
        true
    }

    /// Ends every open watch response cleanly (terminating chunk): clients must watch again.
    pub fn drop_watches(&self) {
        self.shared.lock().watch_epoch += 1;
        self.shared.changed.notify_all();
    }

    /// Compacts the event history (etcd compaction) and ends every open watch. Like a real
    /// cluster, where unrelated writes (leases, events) keep advancing the global resourceVersion,
    /// it first takes one resourceVersion for such a write, then forgets every event up to it.
    /// So every client, even one that was up to date, re-watches from an older resourceVersion
    /// and gets a `410 Expired` ERROR event, then relists; continue tokens from before expire.
    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.rv += 1;
        st.compacted = st.rv;
        st.events.clear();
        st.watch_epoch += 1;
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Sends a `BOOKMARK` (current resourceVersion) on every open watch that asked for
    /// `allowWatchBookmarks=true`.
    pub fn send_bookmarks(&self) {
        self.shared.lock().bookmark_epoch += 1;
        self.shared.changed.notify_all();
    }

    /// Every request received so far, as `"METHOD TARGET"` (e.g.
    /// `"GET /api/v1/services?&watch=true&timeoutSeconds=290&resourceVersion=5"`).
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// Makes the next `n` requests fail with `500 InternalError` (a Status object).
    pub fn fail_next(&self, n: usize) {
        self.shared.lock().fail_next = n;
    }

    fn set_fault(&self, set: impl FnOnce(&mut Faults)) {
        set(&mut self.shared.lock().faults);
        self.shared.changed.notify_all();
    }

    /// While on, a watch from a resourceVersion older than the last [`ApiServer::compact`] is
    /// answered `410 Gone` with an `Expired` Status (the HTTP status of the watch request itself),
    /// instead of a `200` stream holding one ERROR event.
    pub fn expire_watches_with_410(&self, on: bool) {
        self.set_fault(|f| f.expired_watch_as_status = on);
    }

    /// The next `n` event lines (ADDED/MODIFIED/DELETED, on any watch) are cut: the first half of
    /// the line is written (inside a chunk announced at full length), then the connection closes.
    pub fn cut_next_events(&self, n: usize) {
        self.set_fault(|f| f.cut_events = n);
    }

    /// The next `n` event lines (on any watch) are replaced by [`GARBAGE_LINE`]; the stream goes
    /// on, so the change each carried is lost to that watch.
    pub fn garble_next_events(&self, n: usize) {
        self.set_fault(|f| f.garble_events = n);
    }

    /// The next `n` event lines (on any watch) lose their second half: a JSON object cut short,
    /// then a newline, and the stream goes on.
    pub fn truncate_next_events(&self, n: usize) {
        self.set_fault(|f| f.truncate_events = n);
    }

    /// Event lines still to be cut, garbled or truncated (0 once those faults have struck).
    pub fn faults_pending(&self) -> usize {
        let st = self.shared.lock();
        st.faults.cut_events + st.faults.garble_events + st.faults.truncate_events
    }

    /// While on, every list (a collection `GET` without `watch`) fails with `500 InternalError`.
    /// While on, `networking.k8s.io/v1` `servicecidrs` are answered `404 NotFound`, as an API server
    /// without the kind answers (before Kubernetes 1.33, or with it disabled).
    pub fn hide_service_cidrs(&self, on: bool) {
        self.set_fault(|f| f.no_service_cidrs = on);
    }

    pub fn fail_lists(&self, on: bool) {
        self.set_fault(|f| f.lists_fail = on);
    }

    /// Lists are answered `delay` late (with the objects as they are then).
    pub fn delay_lists(&self, delay: Duration) {
        self.set_fault(|f| f.list_delay = delay);
    }

    /// While on, watches ignore `timeoutSeconds` and stay open until dropped (or the server stops),
    /// so bookmarks are the only sign of life of a quiet watch.
    pub fn hold_watches(&self, on: bool) {
        self.set_fault(|f| f.hold_watches = on);
    }

    /// From now until [`ApiServer::answer_again`] requests are read but not answered and open
    /// watches send nothing (no events, no bookmarks, no end), as a server that hangs or a network
    /// that drops everything; held requests are then answered, held watches carry on.
    pub fn stop_answering(&self) {
        self.set_fault(|f| f.silent = true);
    }

    /// Ends [`ApiServer::stop_answering`].
    pub fn answer_again(&self) {
        self.set_fault(|f| f.silent = false);
    }

    /// Forgets the event history up to the current resourceVersion without taking a new one or
    /// ending any watch: a client that is up to date (through an event or a bookmark) can still
    /// resume from its resourceVersion, an older one gets `410 Expired`.
    pub fn forget_history(&self) {
        let mut st = self.shared.lock();
        st.compacted = st.rv;
        st.events.clear();
    }

    /// Every `BOOKMARK` written so far, oldest first.
    pub fn bookmarks_sent(&self) -> Vec<BookmarkSent> {
        self.shared.lock().bookmarks.clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.stopping = true;
            for conn in st.conns.values() {
                let _ = conn.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
        if let Some(listening) = self.listening.lock().unwrap_or_else(|p| p.into_inner()).take() {
            // Wakes the blocked accept() (EINVAL on Linux).
            // SAFETY: plain syscall on a valid fd we own.
            unsafe { libc::shutdown(listening.listener.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = listening.accept.join();
        }
        let threads = std::mem::take(&mut self.shared.lock().threads);
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// Checks `object` and fills in its apiVersion and namespace; returns its kind and key.
fn identify(object: &mut Value) -> Result<(Kind, Key)> {
    let Some(map) = object.as_object_mut() else { bail!("not a JSON object") };
    let kind_name = map.get("kind").and_then(Value::as_str).unwrap_or_default();
    let Some(kind) = Kind::ALL.into_iter().find(|k| k.name() == kind_name) else {
        bail!("unsupported kind {kind_name:?} (the server knows Service, EndpointSlice, Node, ServiceCIDR)")
    };
    match map.get("apiVersion").and_then(Value::as_str) {
        None => {
            map.insert("apiVersion".into(), kind.api_version().into());
        }
        Some(v) if v == kind.api_version() => {}
        Some(v) => bail!("{kind_name} must be apiVersion {}, not {v}", kind.api_version()),
    }
    let Some(meta) = map.get_mut("metadata").and_then(Value::as_object_mut) else { bail!("no metadata") };
    let name = meta.get("name").and_then(Value::as_str).unwrap_or_default().to_string();
    if name.is_empty() {
        bail!("no metadata.name");
    }
    let ns = if kind.namespaced() {
        let ns = meta.get("namespace").and_then(Value::as_str).unwrap_or_default();
        let ns = if ns.is_empty() { "default".to_string() } else { ns.to_string() };
        meta.insert("namespace".into(), ns.clone().into());
        ns
    } else {
        meta.remove("namespace");
        String::new()
    };
    Ok((kind, (kind, ns, name)))
}

/// A listening socket on `addr` inside the network namespace at `netns_path`: a helper thread
/// enters the namespace and creates it (the socket stays in that namespace), bringing `lo` up first
/// if it is down.
fn listen_in_netns(netns_path: &Path, addr: SocketAddr) -> Result<TcpListener> {
    let path = netns_path.to_path_buf();
    std::thread::spawn(move || -> Result<TcpListener> {
        let ns = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: plain syscall on a valid fd; it only changes this (helper) thread.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error()).context(format!("setns({})", path.display()));
        }
        // A fresh namespace has lo down: bind() works but nothing can connect.
        bring_lo_up().context("bringing lo up")?;
        Ok(TcpListener::bind(addr)?)
    })
    .join()
    .map_err(|_| anyhow!("the netns helper thread panicked"))?
    .with_context(|| format!("listening on {addr} in {}", netns_path.display()))
}

/// Sets IFF_UP on `lo` in the calling thread's network namespace.
fn bring_lo_up() -> io::Result<()> {
    // SAFETY: socket/ioctl with a zeroed, correctly sized ifreq; the fd is owned.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        if req.ifr_ifru.ifru_flags & libc::IFF_UP as libc::c_short != 0 {
            return Ok(());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A Status object, as the API server sends for errors.
fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// A random version-4 UUID.
fn new_uid() -> String {
    use std::hash::{BuildHasher, RandomState};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let hasher = RandomState::new();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
    let a = hasher.hash_one((COUNTER.fetch_add(1, Ordering::Relaxed), nanos, std::process::id()));
    let b = hasher.hash_one(a);
    let hex = format!("{a:016x}{b:016x}");
    let variant = ["8", "9", "a", "b"][(b & 3) as usize];
    format!("{}-{}-4{}-{variant}{}-{}", &hex[0..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..32])
}

/// Now, as RFC 3339 UTC with second precision (`metav1.Time`).
fn rfc3339_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    rfc3339(secs)
}

fn rfc3339(unix_secs: i64) -> String {
    let (days, sod) = (unix_secs.div_euclid(86_400), unix_secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", sod / 3600, sod % 3600 / 60, sod % 60)
}
