//! Where Services and EndpointSlices come from: the API server (kube-rs
//! watchers, the way kube-proxy's informers see them) or manifests on disk.
//! Both keep a [`Snapshot`] and wake the sync loop through [`Changes`].

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::Result;
use futures::AsyncBufReadExt as _;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};
use kube::{
    Api, Client, ResourceExt as _,
    api::{ListParams, WatchEvent, WatchParams},
    runtime::{utils::Backoff as _, watcher::DefaultBackoff},
};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

// The watchers' client comes from where the API server is decided (one place for agent, diff, doctor).
pub use crate::k8s::api_endpoint::{KubeOptions, client};
use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::time::parse_rfc3339;
use crate::k8s::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};

/// The label selector of the Services and EndpointSlices this agent lists: kube-proxy's
/// (`!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`: those that name
/// another proxy, or are headless, are not even listed), or, with `--service-proxy-name NAME`, only
/// those labelled with that name. The EndpointSlice controller copies a Service's labels to its
/// slices, so one selector serves both kinds; a Service whose label is removed stops matching and
/// the watch reports it deleted, which hands it back to the default proxy.
pub fn label_selector(service_proxy_name: Option<&str>) -> String {
    match service_proxy_name.filter(|name| !name.is_empty()) {
        Some(name) => format!("{LABEL_SERVICE_PROXY_NAME}={name},!{LABEL_HEADLESS}"),
        None => format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"),
    }
}

/// The Node label naming its zone (zone hints follow it).
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The taint the cluster autoscaler puts on a node it is about to remove.
const AUTOSCALER_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// namespace, name, and a disambiguator that keeps duplicate definitions in
/// manifest files apart (the model reports them); always 0 from the API. The
/// manifests source numbers objects in the order it first saw them, and
/// [`Snapshot::services`] hands them to the model in that order.
pub type ObjectKey = (String, String, u32);

/// Objects as last seen.
#[derive(Default, Clone)]
pub struct Snapshot {
    pub services: BTreeMap<ObjectKey, Arc<Sourced<Service>>>,
    pub slices: BTreeMap<ObjectKey, Arc<Sourced<EndpointSlice>>>,
    /// ServiceCIDRs (cluster-scoped: an empty namespace), for the drop of unallocated service addresses.
    pub service_cidrs: BTreeMap<ObjectKey, Arc<Sourced<ServiceCIDR>>>,
    /// Errors of the source itself (unreadable files, unparsable documents).
    pub errors: Vec<ManifestError>,
}

impl Snapshot {
    /// The objects, shared with the snapshot (no deep copy), in the order the
    /// model resolves their claims in (the first to claim an address keeps
    /// it): by the key's disambiguator, then by namespace and name. From the
    /// manifests source an address thus stays with the Service that held it
    /// while a newcomer claims it; from the API server this is key order.
    pub fn services(&self) -> Vec<Arc<Sourced<Service>>> {
        in_claim_order(&self.services)
    }

    pub fn slices(&self) -> Vec<Arc<Sourced<EndpointSlice>>> {
        in_claim_order(&self.slices)
    }
}

fn in_claim_order<T>(objects: &BTreeMap<ObjectKey, Arc<T>>) -> Vec<Arc<T>> {
    let mut ordered: Vec<(&ObjectKey, &Arc<T>)> = objects.iter().collect();
    // Stable: equal disambiguators stay in key order.
    ordered.sort_by_key(|(key, _)| key.2);
    ordered.into_iter().map(|(_, object)| Arc::clone(object)).collect()
}

/// The objects a sync reads.
pub struct Objects {
    pub services: Vec<Arc<Sourced<Service>>>,
    pub slices: Vec<Arc<Sourced<EndpointSlice>>>,
    pub errors: Vec<ManifestError>,
}

/// What happened since the last sync: the sync loop takes it whole.
#[derive(Default, Debug)]
pub struct Pending {
    pub service_changes: u64,
    pub endpoint_changes: u64,
    /// `last-change-trigger-time` of changed slices, for the network
    /// programming latency.
    pub trigger_times: Vec<SystemTime>,
}

/// What the watchers tell whoever serves their health (the agent's `/healthz`), which lives outside
/// this module: it implements the trait, and the watchers never name it.
pub trait WatchObserver: Send + Sync {
    /// A change arrived at `at` that the datapath does not carry yet.
    fn queued(&self, at: SystemTime);
    /// Whether this node should receive load-balancer traffic, as last set.
    fn node_eligible(&self) -> bool;
    /// The Node object says whether this node is going away (kube-proxy's node eligibility).
    fn set_node_eligible(&self, eligible: bool);
    /// Registers an API watch called `name`: from `now` on it must show progress through the returned
    /// handle at least every `progress_timeout`, or it counts as blind.
    fn watch_source(
        &self,
        name: &'static str,
        progress_timeout: Duration,
        now: SystemTime,
    ) -> Arc<dyn WatchProgress>;
    /// Why the watches cannot see the cluster as of `now`, if they cannot.
    fn blind(&self, now: SystemTime) -> Option<String>;
}

/// What the metrics learn as changes are queued and taken, outside this module (the agent's
/// `/metrics` implements it). kube-proxy sets its `_changes_pending` gauges and the last-queued
/// time in its change trackers as a change arrives, and zeroes the gauges when a sync takes the
/// changes, so a sync loop that hangs shows as changes pending and a last-queued time after the
/// last sync.
pub trait QueueObserver: Send + Sync {
    /// `services` and `endpoints` changes now wait for a sync; the latest was queued at `at`.
    fn queued(&self, services: u64, endpoints: u64, at: SystemTime);
    /// A sync took every pending change.
    fn taken(&self);
}

/// One API watch's reports (see [`WatchObserver::watch_source`]).
pub trait WatchProgress: Send + Sync {
    /// An event, a bookmark, or a watch the server accepted at `at`: current as of then.
    fn progress(&self, at: SystemTime);
    /// A list was asked for at `at`.
    fn listing(&self, at: SystemTime);
    /// A complete list at `at`.
    fn listed(&self, at: SystemTime);
    /// A list failed with `error`.
    fn list_failed(&self, error: &str);
    /// A watch request or stream failed (`error` says which and how).
    fn failed(&self, error: &str);
}

/// Shared between the source tasks and the sync loop.
#[derive(Default)]
pub struct Changes {
    snapshot: Mutex<Snapshot>,
    pending: Mutex<Pending>,
    /// Set once every watcher has delivered its first complete list: syncing
    /// before would delete what a previous agent programmed.
    ready: Mutex<(bool, bool)>,
    pub notify: Notify,
    health: Option<Arc<dyn WatchObserver>>,
    queue_metrics: Option<Arc<dyn QueueObserver>>,
    /// This node's `topology.kubernetes.io/zone` label, from the Node watch.
    node_zone: Mutex<Option<String>>,
    /// This node's primary IPv4 address, from the Node watch (`--nodeport-addresses primary`).
    node_primary_ipv4: Mutex<Option<std::net::Ipv4Addr>>,
}

impl Changes {
    /// Changes that also tell the health server when a change is queued.
    pub fn with_health(health: Arc<dyn WatchObserver>) -> Self {
        Self { health: Some(health), ..Default::default() }
    }

    /// These changes, also telling `metrics` when changes are queued and taken.
    pub fn with_queue_metrics(self, metrics: Arc<dyn QueueObserver>) -> Self {
        Self { queue_metrics: Some(metrics), ..self }
    }

    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.lock().expect("poisoned").clone()
    }

    /// The objects and source errors as shared handles: what a sync needs,
    /// without copying the keys or the objects.
    pub fn objects(&self) -> Objects {
        let snapshot = self.snapshot.lock().expect("poisoned");
        Objects { services: snapshot.services(), slices: snapshot.slices(), errors: snapshot.errors.clone() }
    }

    /// The ServiceCIDR objects as last seen, in key order.
    pub fn service_cidrs(&self) -> Vec<Arc<Sourced<ServiceCIDR>>> {
        self.snapshot.lock().expect("poisoned").service_cidrs.values().cloned().collect()
    }

    /// Every change queued since the last call (a sync takes them as it starts).
    pub fn take_pending(&self) -> Pending {
        let mut pending = self.pending.lock().expect("poisoned");
        if let Some(metrics) = &self.queue_metrics {
            metrics.taken();
        }
        std::mem::take(&mut *pending)
    }

    pub fn is_ready(&self) -> bool {
        let ready = self.ready.lock().expect("poisoned");
        ready.0 && ready.1
    }

    fn queue(&self, service: u64, endpoint: u64, trigger: Option<SystemTime>) {
        let mut pending = self.pending.lock().expect("poisoned");
        pending.service_changes += service;
        pending.endpoint_changes += endpoint;
        let now = SystemTime::now();
        pending.trigger_times.extend(trigger);
        // Under the lock, so a sync taking the changes meanwhile cannot zero the gauges first.
        if let Some(metrics) = &self.queue_metrics {
            metrics.queued(pending.service_changes, pending.endpoint_changes, now);
        }
        drop(pending);
        if let Some(health) = &self.health {
            health.queued(now);
        }
        self.notify.notify_one();
    }

    /// This node's zone as its Node object says (for zone hints); `None` until seen or unlabelled.
    pub fn node_zone(&self) -> Option<String> {
        self.node_zone.lock().expect("poisoned").clone()
    }

    /// Takes what the Node object says: its zone (a change re-syncs, as hints depend on it) and
    /// whether the node is going away (kube-proxy's node eligibility for `/healthz`).
    fn node_seen(&self, zone: Option<String>, eligible: bool) {
        if let Some(health) = &self.health
            && health.node_eligible() != eligible
        {
            tracing::warn!(eligible, "this node's deletion state changed: /healthz follows (KEP-3836)");
            health.set_node_eligible(eligible);
        }
        let mut current = self.node_zone.lock().expect("poisoned");
        if *current != zone {
            tracing::info!(zone = zone.as_deref().unwrap_or("(none)"), "this node's zone");
            *current = zone;
            drop(current);
            self.queue(1, 0, None);
        }
    }

    /// This node's primary IPv4 address as its Node object says; `None` until seen.
    pub fn node_primary_ipv4(&self) -> Option<std::net::Ipv4Addr> {
        *self.node_primary_ipv4.lock().expect("poisoned")
    }

    /// Takes the Node object's primary IPv4 address; a change re-syncs (NodePorts may follow it).
    fn node_address_seen(&self, primary: Option<std::net::Ipv4Addr>) {
        let mut current = self.node_primary_ipv4.lock().expect("poisoned");
        if *current != primary {
            tracing::info!(address = ?primary, "this node's primary IPv4 address (its Node object)");
            *current = primary;
            drop(current);
            self.queue(1, 0, None);
        }
    }

    /// For the file source: replace everything at once.
    pub fn replace_all(&self, snapshot: Snapshot) {
        let (services, slices) = (snapshot.services.len() as u64, snapshot.slices.len() as u64);
        *self.snapshot.lock().expect("poisoned") = snapshot;
        *self.ready.lock().expect("poisoned") = (true, true);
        self.queue(services, slices, None);
    }
}

fn origin(kind: &str, resource_version: Option<String>) -> String {
    format!("api-server {kind} (resourceVersion {})", resource_version.unwrap_or_default())
}

fn key(namespace: Option<String>, name: String) -> ObjectKey {
    (namespace.unwrap_or_default(), name, 0)
}

fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let value = slice.annotations().get(TRIGGER_TIME_ANNOTATION)?;
    parse_rfc3339(value)
}

/// How the API watches judge their own progress (`--api-progress-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchOptions {
    /// A watched kind with no complete list, event, bookmark or accepted watch
    /// for this long makes `/healthz` answer 503. A real API server sends a
    /// bookmark on every watch at least once a minute (the watch cache's
    /// bookmark timer) and ends each watch at its `timeoutSeconds`, half of
    /// this, so a connected agent shows progress well within it.
    pub progress_timeout: Duration,
}

/// Twice the watch cache's bookmark period.
pub const DEFAULT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(120);

impl Default for WatchOptions {
    fn default() -> Self {
        Self { progress_timeout: DEFAULT_PROGRESS_TIMEOUT }
    }
}

impl WatchOptions {
    /// `timeoutSeconds` of each watch: half the progress timeout, so even a
    /// server without periodic bookmarks ends each watch (and the agent opens
    /// the next) within it; at most kube-runtime's 290 s.
    fn watch_timeout_secs(&self) -> u32 {
        (self.progress_timeout.as_secs() / 2).clamp(1, 290) as u32
    }

    /// A watch silent this long (no event, no bookmark, past the end the
    /// server was asked for) is presumed dead and opened again.
    fn idle_cutoff(&self) -> Duration {
        self.progress_timeout + self.progress_timeout / 2
    }
}

/// Objects per list page, as client-go's pager and kube-runtime ask.
const LIST_PAGE: u32 = 500;
/// A list page unanswered this long is given up: twice kube-apiserver's own
/// limit for a non-watch request (`--request-timeout`, 1 minute). A slow list
/// is waited for (and reported by `/healthz`), not cut short.
const LIST_TIMEOUT: Duration = Duration::from_secs(120);
/// A watch that ends sooner than this with nothing in it counts as a failure
/// (backed off), as client-go's reflector treats a "very short watch".
const SHORT_WATCH: Duration = Duration::from_secs(1);

/// Watches Services and EndpointSlices in all namespaces (and this node) until
/// the process stops. Each kind is listed, then watched from the list's
/// resourceVersion, as client-go's reflector does for kube-proxy: a watch
/// that ends or breaks resumes from the last resourceVersion seen (events and
/// bookmarks advance it); a 410 Gone, whether the answer to the watch request
/// or an ERROR event in the stream, and an unreadable line in the stream (the
/// change it carried is lost) start over with a list, which replaces that
/// kind's snapshot. Failures are retried with kube-runtime's default backoff.
///
/// kube-runtime's `watcher` is not used: it retries a watch request answered
/// 410 with the same stale resourceVersion forever, skips an unreadable line
/// and carries on (losing that change), and shows neither bookmarks nor
/// accepted watches, so a quiet cluster and a dead connection look alike to
/// `/healthz`.
pub async fn watch_cluster(
    client: Client,
    node_name: Option<String>,
    service_proxy_name: Option<String>,
    changes: Arc<Changes>,
    options: WatchOptions,
) -> Result<()> {
    let selector = label_selector(service_proxy_name.as_deref());
    let now = SystemTime::now();
    let track = |name| changes.health.as_ref().map(|h| h.watch_source(name, options.progress_timeout, now));
    let (service_health, slice_health) = (track("Service watch"), track("EndpointSlice watch"));
    let services = watch_kind::<Service>(
        client.clone(),
        selector.clone(),
        Arc::clone(&changes),
        options,
        service_health,
    );
    let slices =
        watch_kind::<EndpointSlice>(client.clone(), selector, Arc::clone(&changes), options, slice_health);
    let node = watch_node(client.clone(), node_name, Arc::clone(&changes), options);
    let service_cidrs = watch_service_cidrs(client, Arc::clone(&changes), options);
    let blindness = report_blindness(changes.health.clone());
    tokio::join!(services, slices, node, service_cidrs, blindness);
    Ok(())
}

/// One kind into the snapshot, for ever.
async fn watch_kind<K>(
    client: Client,
    selector: String,
    changes: Arc<Changes>,
    options: WatchOptions,
    health: Option<Arc<dyn WatchProgress>>,
) where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    K: Into<Kinded>,
{
    let is_service = K::kind(&()) == "Service";
    let selectors = Selectors { labels: Some(selector), fields: None };
    reflect(client, selectors, options, health, |update: Update<K>| match update {
        Update::Listed(objects) => {
            let count = objects.len() as u64;
            {
                let mut snapshot = changes.snapshot.lock().expect("poisoned");
                if is_service {
                    snapshot.services.clear();
                } else {
                    snapshot.slices.clear();
                }
                for object in objects {
                    let k = key(object.namespace(), object.name_any());
                    object.into().store(&mut snapshot, k);
                }
            }
            {
                let mut ready = changes.ready.lock().expect("poisoned");
                if is_service {
                    ready.0 = true;
                } else {
                    ready.1 = true;
                }
            }
            if is_service { changes.queue(count, 0, None) } else { changes.queue(0, count, None) }
        }
        Update::Applied(object) => {
            let k = key(object.namespace(), object.name_any());
            let kinded: Kinded = object.into();
            let trigger = kinded.trigger_time();
            kinded.store(&mut changes.snapshot.lock().expect("poisoned"), k);
            if is_service { changes.queue(1, 0, None) } else { changes.queue(0, 1, trigger) }
        }
        Update::Deleted(object) => {
            let k = key(object.namespace(), object.name_any());
            {
                let mut snapshot = changes.snapshot.lock().expect("poisoned");
                if is_service {
                    snapshot.services.remove(&k);
                } else {
                    snapshot.slices.remove(&k);
                }
            }
            if is_service { changes.queue(1, 0, None) } else { changes.queue(0, 1, None) }
        }
    })
    .await
}

/// This node, for `internalTrafficPolicy: Local`; kproxy only needs to know
/// it exists, so its events are logged.
async fn watch_node(client: Client, node_name: Option<String>, changes: Arc<Changes>, options: WatchOptions) {
    let Some(name) = node_name else {
        tracing::warn!("no --hostname-override or NODE_NAME: every endpoint counts as remote");
        return;
    };
    let selectors = Selectors { labels: None, fields: Some(format!("metadata.name={name}")) };
    let mut seen = false;
    reflect(client, selectors, options, None, |update: Update<k8s_openapi::api::core::v1::Node>| {
        let node = match update {
            Update::Listed(nodes) => nodes.into_iter().next(),
            Update::Applied(node) => Some(node),
            Update::Deleted(_) => None,
        };
        if let Some(node) = node.as_ref().filter(|_| !seen) {
            tracing::info!(node = %node.name_any(), "watching this node");
            seen = true;
        }
        let zone = node.as_ref().and_then(|n| n.labels().get(ZONE_LABEL)).filter(|z| !z.is_empty()).cloned();
        // A node that is gone, being deleted or drained by the cluster autoscaler should lose its load
        // balancer traffic before its pods go: kube-proxy's /healthz says 503 (KEP-3836).
        let eligible = node.as_ref().is_some_and(|n| {
            n.metadata.deletion_timestamp.is_none()
                && !n.spec.iter().flat_map(|s| s.taints.iter().flatten()).any(|t| t.key == AUTOSCALER_TAINT)
        });
        changes.node_seen(zone, eligible || node.is_none() && !seen);
        changes.node_address_seen(node.as_ref().and_then(node_primary_ipv4));
    })
    .await
}

/// The ServiceCIDRs (`networking.k8s.io/v1`), as kube-proxy's ServiceCIDR informer watches them: a
/// change re-syncs. Not part of `/healthz` nor of the first sync's readiness: until a list arrives no
/// range is known and nothing is dropped, as with kube-proxy. An API server that does not serve the
/// kind (before Kubernetes 1.33, or with it disabled) is told once, and not asked again.
async fn watch_service_cidrs(client: Client, changes: Arc<Changes>, options: WatchOptions) {
    let api: Api<ServiceCIDR> = Api::all(client.clone());
    if let Err(kube::Error::Api(status)) = api.list(&ListParams::default().limit(1)).await
        && status.code == 404
    {
        tracing::warn!(
            "the API server serves no ServiceCIDRs (networking.k8s.io/v1): unallocated service addresses \
             are dropped only inside --service-cidr"
        );
        return;
    }
    let selectors = Selectors { labels: None, fields: None };
    reflect(client, selectors, options, None, |update: Update<ServiceCIDR>| {
        {
            let mut snapshot = changes.snapshot.lock().expect("poisoned");
            let store = |object: ServiceCIDR, snapshot: &mut Snapshot| {
                let k = key(None, object.name_any());
                let origin = origin("ServiceCIDR", object.resource_version());
                snapshot.service_cidrs.insert(k, Arc::new(Sourced { origin, object }));
            };
            match update {
                Update::Listed(objects) => {
                    snapshot.service_cidrs.clear();
                    for object in objects {
                        store(object, &mut snapshot);
                    }
                }
                Update::Applied(object) => store(object, &mut snapshot),
                Update::Deleted(object) => {
                    snapshot.service_cidrs.remove(&key(None, object.name_any()));
                }
            }
        }
        // A sync, but no Service or endpoint change for the metrics: kube-proxy counts none either.
        changes.queue(0, 0, None);
    })
    .await
}

/// The node's primary IPv4 address as kube-proxy reads it (`GetNodeHostIPs`): the first IPv4
/// address among its InternalIPs, then its ExternalIPs.
pub fn node_primary_ipv4(node: &k8s_openapi::api::core::v1::Node) -> Option<std::net::Ipv4Addr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"]
        .into_iter()
        .flat_map(|kind| addresses.iter().filter(move |a| a.type_ == kind))
        .find_map(|a| a.address.trim().parse().ok())
}

/// Logs when the API watches turn blind and when they see again (`/healthz`
/// tells the same at any time); checked every second.
async fn report_blindness(health: Option<Arc<dyn WatchObserver>>) {
    let Some(health) = health else { return };
    let mut blind = false;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        match (blind, health.blind(SystemTime::now())) {
            (false, Some(reason)) => {
                tracing::error!(%reason, "cannot see the cluster: /healthz answers 503");
                blind = true;
            }
            (true, None) => {
                tracing::info!("the API watches are current again");
                blind = false;
            }
            _ => {}
        }
    }
}

struct Selectors {
    labels: Option<String>,
    fields: Option<String>,
}

/// What a list or watch brings.
enum Update<K> {
    /// Every object, from a complete list: replaces what was there.
    Listed(Vec<K>),
    Applied(K),
    Deleted(K),
}

/// How one watch request ended.
enum WatchEnd {
    /// Closed by the server or the network: watch again from this version.
    Closed(String),
    /// Failed: after a backoff, watch again from this version, or list again.
    Failed { resume: Option<String>, error: String },
}

impl WatchEnd {
    fn failed(resume: Option<String>, error: String) -> Self {
        WatchEnd::Failed { resume, error }
    }
}

/// Lists then watches `api` for ever, handing each change to `apply` (see
/// [`watch_cluster`]) and telling `health` how it goes.
async fn reflect<K>(
    client: Client,
    selectors: Selectors,
    options: WatchOptions,
    health: Option<Arc<dyn WatchProgress>>,
    mut apply: impl FnMut(Update<K>),
) where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let kind = K::kind(&());
    let api: Api<K> = Api::all(client.clone());
    let (list_params, watch_params) = request_params(selectors, options);
    let mut backoff = DefaultBackoff::default();
    let mut resume: Option<String> = None;
    let mut last_listed: Option<tokio::time::Instant> = None;
    loop {
        let error = match resume.take() {
            None => match list_and_apply(&api, &list_params, health.as_ref(), &mut apply).await {
                Ok(version) => {
                    backoff.reset();
                    resume = Some(version);
                    last_listed = Some(tokio::time::Instant::now());
                    continue;
                }
                Err(error) => error,
            },
            Some(version) => {
                let request = WatchRequest {
                    client: &client,
                    url_path: api.resource_url(),
                    params: &watch_params,
                    options,
                    health: health.as_ref(),
                };
                match watch_once(&request, version, &mut apply, &mut backoff).await {
                    WatchEnd::Closed(version) => {
                        resume = Some(version);
                        continue;
                    }
                    WatchEnd::Failed { resume: next, error } => {
                        if let Some(health) = &health {
                            health.failed(&error);
                        }
                        resume = next;
                        // A 410 or a lost change: the server answers, the view is stale, so list
                        // at once; unless the last list was just now (a server that fails every
                        // watch that way is backed off like any failure).
                        if resume.is_none() && last_listed.is_none_or(|at| at.elapsed() >= SHORT_WATCH) {
                            tracing::warn!(%kind, %error, "watch failed; listing again");
                            continue;
                        }
                        error
                    }
                }
            }
        };
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        tracing::warn!(%kind, %error, retry_in_ms = delay.as_millis() as u64, "watch failed; retrying");
        tokio::time::sleep(delay).await;
    }
}

/// The list (paged) and watch (with bookmarks, ended by the server) parameters of one kind.
fn request_params(selectors: Selectors, options: WatchOptions) -> (ListParams, WatchParams) {
    let list_params = ListParams {
        label_selector: selectors.labels.clone(),
        field_selector: selectors.fields.clone(),
        limit: Some(LIST_PAGE),
        ..Default::default()
    };
    let watch_params = WatchParams {
        label_selector: selectors.labels,
        field_selector: selectors.fields,
        timeout: Some(options.watch_timeout_secs()),
        bookmarks: true,
        ..Default::default()
    };
    (list_params, watch_params)
}

/// One complete list handed to `apply`: the version to watch from, or the error to back off on.
async fn list_and_apply<K>(
    api: &Api<K>,
    params: &ListParams,
    health: Option<&Arc<dyn WatchProgress>>,
    apply: &mut impl FnMut(Update<K>),
) -> Result<String, String>
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    if let Some(health) = health {
        health.listing(SystemTime::now());
    }
    match list_all(api, params).await {
        Ok((objects, version)) => {
            tracing::info!(objects = objects.len(), resource_version = %version, "listed the {kind}s");
            if let Some(health) = health {
                health.listed(SystemTime::now());
            }
            apply(Update::Listed(objects));
            Ok(version)
        }
        Err(error) => {
            if let Some(health) = health {
                health.list_failed(&error);
            }
            Err(format!("list failed: {error}"))
        }
    }
}

/// Every page of a list: the objects and the list's resourceVersion.
async fn list_all<K>(api: &Api<K>, params: &ListParams) -> Result<(Vec<K>, String), String>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.clone();
    let mut objects = Vec::new();
    loop {
        let page = tokio::time::timeout(LIST_TIMEOUT, api.list(&params))
            .await
            .map_err(|_| format!("no answer within {}s", LIST_TIMEOUT.as_secs()))?
            .map_err(|error| describe(&error))?;
        objects.extend(page.items);
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => {
                let version = page.metadata.resource_version.filter(|v| !v.is_empty());
                return version
                    .map(|v| (objects, v))
                    .ok_or_else(|| "the list has no resourceVersion".to_owned());
            }
        }
    }
}

/// What every watch request of one kind shares.
struct WatchRequest<'a> {
    client: &'a Client,
    url_path: &'a str,
    params: &'a WatchParams,
    options: WatchOptions,
    health: Option<&'a Arc<dyn WatchProgress>>,
}

/// One watch request from `version`, until it ends. The stream is read line
/// by line here rather than through `Api::watch`, which silently skips a
/// line that is cut short JSON (its change would be lost unnoticed).
async fn watch_once<K>(
    watch: &WatchRequest<'_>,
    mut version: String,
    apply: &mut impl FnMut(Update<K>),
    backoff: &mut DefaultBackoff,
) -> WatchEnd
where
    K: DeserializeOwned + kube::Resource,
{
    let opened = tokio::time::Instant::now();
    let body = match open_watch(watch, &version).await {
        Ok(body) => body,
        Err(end) => return end,
    };
    // Accepted from `version`: the server will send whatever changed since.
    if let Some(health) = watch.health {
        health.progress(SystemTime::now());
    }
    let mut body = std::pin::pin!(body);
    let mut line = String::new();
    let mut lines = 0u64;
    loop {
        line.clear();
        let idle_cutoff = watch.options.idle_cutoff();
        let read = tokio::time::timeout(idle_cutoff, body.read_line(&mut line)).await;
        let read = match bytes_read(read, idle_cutoff, &version) {
            Ok(read) => read,
            Err(end) => return end,
        };
        if read == 0 {
            return stream_closed(lines, opened, version);
        }
        if !line.ends_with('\n') {
            // Cut mid-line: whatever it carried comes again from `version`.
            return WatchEnd::failed(
                Some(version),
                "watch: the stream ended in the middle of a line".to_owned(),
            );
        }
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let (update, next_version) =
            match parse_event::<K>(text).and_then(|event| event_update(event, &version)) {
                Ok(step) => step,
                Err(end) => return end,
            };
        version = next_version;
        lines += 1;
        backoff.reset();
        if let Some(health) = watch.health {
            health.progress(SystemTime::now());
        }
        if let Some(update) = update {
            apply(update);
        }
    }
}

/// Sends the watch request from `version` and waits for the server to accept it.
async fn open_watch<'w>(
    watch: &WatchRequest<'w>,
    version: &str,
) -> Result<impl futures::AsyncBufRead + use<'w>, WatchEnd> {
    let WatchRequest { client, url_path, params, options, .. } = *watch;
    let request = match kube::core::Request::new(url_path).watch(params, version) {
        Ok(request) => request,
        Err(error) => return Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: {error}"))),
    };
    match tokio::time::timeout(options.progress_timeout, client.request_stream(request)).await {
        Err(_) => {
            let error = format!("watch: no answer within {}s", options.progress_timeout.as_secs_f64());
            Err(WatchEnd::failed(Some(version.to_owned()), error))
        }
        Ok(Err(kube::Error::Api(status))) if status.code == 410 => {
            Err(WatchEnd::failed(None, format!("watch: {}; listing again", status_text(&status))))
        }
        Ok(Err(error)) => {
            Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: {}", describe(&error))))
        }
        Ok(Ok(body)) => Ok(body),
    }
}

/// One line's read: its length, or how the watch ends when the stream went quiet, broke or
/// carried bytes that are not text (which loses a change, so list again).
fn bytes_read(
    read: Result<std::io::Result<usize>, tokio::time::error::Elapsed>,
    idle_cutoff: Duration,
    version: &str,
) -> Result<usize, WatchEnd> {
    match read {
        Err(_) => {
            let error = format!("watch: no event or bookmark for {}s", idle_cutoff.as_secs_f64());
            Err(WatchEnd::failed(Some(version.to_owned()), error))
        }
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::InvalidData => {
            Err(WatchEnd::failed(None, format!("watch: unreadable line ({error}); listing again")))
        }
        Ok(Err(error)) => {
            Err(WatchEnd::failed(Some(version.to_owned()), format!("watch: the stream broke: {error}")))
        }
        Ok(Ok(read)) => Ok(read),
    }
}

/// The server closed the stream: a normal end, unless it closed an empty watch at once (a server
/// that does so every time would otherwise be asked again without a pause).
fn stream_closed(lines: u64, opened: tokio::time::Instant, version: String) -> WatchEnd {
    if lines == 0 && opened.elapsed() < SHORT_WATCH {
        return WatchEnd::failed(Some(version), "watch: closed at once, with nothing in it".to_owned());
    }
    WatchEnd::Closed(version)
}

/// A line of the stream as an event; a Status line is an error event. A line that is neither
/// lost a change, so the watch ends with a list.
fn parse_event<K: DeserializeOwned>(text: &str) -> Result<WatchEvent<K>, WatchEnd> {
    match serde_json::from_str::<WatchEvent<K>>(text) {
        Ok(event) => Ok(event),
        Err(error) => match serde_json::from_str::<kube::core::Status>(text) {
            Ok(status) if status.code != 0 => Ok(WatchEvent::Error(Box::new(status))),
            _ => {
                let excerpt: String = text.chars().take(80).collect();
                let error = format!(
                    "watch: unreadable line ({error}): {excerpt:?}; listing again, as the change it carried is lost"
                );
                Err(WatchEnd::failed(None, error))
            }
        },
    }
}

/// What an event changes and the version to resume from after it, or how the watch ends.
fn event_update<K: kube::Resource>(
    event: WatchEvent<K>,
    version: &str,
) -> Result<(Option<Update<K>>, String), WatchEnd> {
    let (update, next_version) = match event {
        WatchEvent::Added(object) | WatchEvent::Modified(object) => {
            let next = object.resource_version();
            (Some(Update::Applied(object)), next)
        }
        WatchEvent::Deleted(object) => {
            let next = object.resource_version();
            (Some(Update::Deleted(object)), next)
        }
        WatchEvent::Bookmark(bookmark) => (None, Some(bookmark.metadata.resource_version)),
        WatchEvent::Error(status) if status.code == 410 => {
            return Err(WatchEnd::failed(None, format!("watch: {}; listing again", status_text(&status))));
        }
        WatchEvent::Error(status) => {
            return Err(WatchEnd::failed(
                Some(version.to_owned()),
                format!("watch: error event: {}", status_text(&status)),
            ));
        }
    };
    let Some(next_version) = next_version.filter(|v| !v.is_empty()) else {
        return Err(WatchEnd::failed(
            None,
            "watch: an event without a resourceVersion; listing again".to_owned(),
        ));
    };
    Ok((update, next_version))
}

/// `410 Gone: too old resource version: 5 (7)`.
fn status_text(status: &kube::core::Status) -> String {
    let phrase =
        hyper::StatusCode::from_u16(status.code).ok().and_then(|c| c.canonical_reason()).unwrap_or("");
    match (status.message.as_str(), phrase) {
        ("", _) => format!("{} {phrase}", status.code),
        (message, _) => format!("{} {phrase}: {message}", status.code),
    }
}

/// An API error as its Status, anything else with its causes
/// (`... tcp connect error: Connection refused (os error 111)`); doctor's API check says it too.
pub(crate) fn describe(error: &kube::Error) -> String {
    if let kube::Error::Api(status) = error {
        return status_text(status);
    }
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A watched object with its origin, ready for the snapshot.
pub enum Kinded {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

impl From<Service> for Kinded {
    fn from(s: Service) -> Self {
        Kinded::Service(Box::new(s))
    }
}

impl From<EndpointSlice> for Kinded {
    fn from(s: EndpointSlice) -> Self {
        Kinded::Slice(Box::new(s))
    }
}

impl Kinded {
    fn trigger_time(&self) -> Option<SystemTime> {
        match self {
            Kinded::Slice(slice) => trigger_time(slice),
            Kinded::Service(_) => None,
        }
    }

    fn store(self, snapshot: &mut Snapshot, k: ObjectKey) {
        match self {
            Kinded::Service(mut object) => {
                object.metadata.managed_fields = None;
                let origin = origin("Service", object.resource_version());
                snapshot.services.insert(k, Arc::new(Sourced { origin, object: *object }));
            }
            Kinded::Slice(mut object) => {
                object.metadata.managed_fields = None;
                let origin = origin("EndpointSlice", object.resource_version());
                snapshot.slices.insert(k, Arc::new(Sourced { origin, object: *object }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_primary_ipv4_is_the_first_internal_then_external_one() {
        let node = |addresses: &str| -> k8s_openapi::api::core::v1::Node {
            serde_json::from_str(&format!(
                r#"{{"metadata":{{"name":"n"}},"status":{{"addresses":[{addresses}]}}}}"#
            ))
            .unwrap()
        };
        let address = |kind: &str, ip: &str| format!(r#"{{"type":"{kind}","address":"{ip}"}}"#);
        let dual = node(
            &[
                address("Hostname", "n"),
                address("ExternalIP", "203.0.113.5"),
                address("InternalIP", "fd00::5"),
                address("InternalIP", "192.168.1.5"),
            ]
            .join(","),
        );
        assert_eq!(node_primary_ipv4(&dual), Some("192.168.1.5".parse().unwrap()));
        let external_only = node(&address("ExternalIP", "203.0.113.5"));
        assert_eq!(node_primary_ipv4(&external_only), Some("203.0.113.5".parse().unwrap()));
        assert_eq!(node_primary_ipv4(&node(&address("InternalIP", "fd00::5"))), None);
        assert_eq!(node_primary_ipv4(&node("")), None);
    }
}
