//! Where Services and EndpointSlices come from: the API server (kube-rs
//! watchers, the way kube-proxy's informers see them) or manifests on disk.
//! Both keep a [`Snapshot`] and wake the sync loop through [`Changes`].

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client, ResourceExt as _,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::Notify;

use crate::manifest::{ManifestError, Sourced};

/// kube-proxy's label selector: Services (and their slices) that name another
/// proxy, or are headless, are not ours and are not even listed.
const NOT_OURS_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

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
    /// When the oldest unapplied change arrived.
    pub oldest_queued: Option<SystemTime>,
    /// `last-change-trigger-time` of changed slices, for the network
    /// programming latency.
    pub trigger_times: Vec<SystemTime>,
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
    health: Option<crate::health::Health>,
}

impl Changes {
    /// Changes that also tell the health server when a change is queued.
    pub fn with_health(health: crate::health::Health) -> Self {
        Self { health: Some(health), ..Default::default() }
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

    pub fn take_pending(&self) -> Pending {
        std::mem::take(&mut *self.pending.lock().expect("poisoned"))
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
        pending.oldest_queued.get_or_insert(now);
        pending.trigger_times.extend(trigger);
        drop(pending);
        if let Some(health) = &self.health {
            health.queued(now);
        }
        self.notify.notify_one();
    }

    /// For the file source: replace everything at once.
    pub fn replace_all(&self, snapshot: Snapshot) {
        let (services, slices) = (snapshot.services.len() as u64, snapshot.slices.len() as u64);
        *self.snapshot.lock().expect("poisoned") = snapshot;
        *self.ready.lock().expect("poisoned") = (true, true);
        self.queue(services, slices, None);
    }
}

/// How to reach the API server.
#[derive(Clone, Debug, Default)]
pub struct KubeOptions {
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
}

pub async fn client(options: &KubeOptions) -> Result<Client> {
    let mut config = match &options.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("--kubeconfig {}", path.display()))?
        }
        None if options.master.is_some() => {
            kube::Config::new("http://localhost".parse().expect("a valid URI"))
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig or --master, and neither in-cluster config nor ~/.kube/config works")?,
    };
    if let Some(master) = &options.master {
        config.cluster_url = master.parse().with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Client::try_from(config).context("building the Kubernetes client")
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

/// Parses the RFC 3339 timestamps Kubernetes writes (`2026-11-29T14:00:00Z`,
/// optionally with fractional seconds and a numeric offset).
pub fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let bytes = text.as_bytes();
    let num = |range: std::ops::Range<usize>| -> Option<i64> { text.get(range)?.parse().ok() };
    if bytes.len() < 20 || bytes[4] != b'-' || bytes[7] != b'-' || !matches!(bytes[10], b'T' | b't') {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut rest = &text[19..];
    let mut nanos = 0u32;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        let padded = format!("{:0<9}", &frac[..digits.min(9)]);
        nanos = padded.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6 && matches!(&rest[..1], "+" | "-") => {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (rest[1..3].parse::<i64>().ok()? * 3600 + rest[4..6].parse::<i64>().ok()? * 60)
        }
        _ => return None,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset;
    let secs = u64::try_from(secs).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Watches Services and EndpointSlices in all namespaces until the process
/// stops, with kube-runtime's relist on 410 Gone, bookmarks and backoff.
pub async fn watch_cluster(client: Client, node_name: Option<String>, changes: Arc<Changes>) -> Result<()> {
    let services = watch_kind::<Service>(Api::all(client.clone()), Arc::clone(&changes), true);
    let slices = watch_kind::<EndpointSlice>(Api::all(client.clone()), Arc::clone(&changes), false);
    let node = watch_node(client, node_name);
    tokio::try_join!(services, slices, node)?;
    Ok(())
}

async fn watch_kind<K>(api: Api<K>, changes: Arc<Changes>, is_service: bool) -> Result<()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
    K: Into<Kinded>,
{
    let config = watcher::Config::default().labels(NOT_OURS_SELECTOR);
    let mut stream = watcher(api, config).default_backoff().boxed();
    let kind = K::kind(&());
    let mut initial: BTreeMap<ObjectKey, Kinded> = BTreeMap::new();
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%kind, %error, "watch failed; retrying with backoff");
                continue;
            }
        };
        match event {
            watcher::Event::Init => initial.clear(),
            watcher::Event::InitApply(object) => {
                let k = key(object.namespace(), object.name_any());
                initial.insert(k, object.into());
            }
            watcher::Event::InitDone => {
                let count = initial.len() as u64;
                {
                    let mut snapshot = changes.snapshot.lock().expect("poisoned");
                    if is_service {
                        snapshot.services.clear();
                    } else {
                        snapshot.slices.clear();
                    }
                    for (k, object) in std::mem::take(&mut initial) {
                        object.store(&mut snapshot, k);
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
                tracing::info!(%kind, objects = count, "listed");
                if is_service { changes.queue(count, 0, None) } else { changes.queue(0, count, None) }
            }
            watcher::Event::Apply(object) => {
                let k = key(object.namespace(), object.name_any());
                let kinded: Kinded = object.into();
                let trigger = kinded.trigger_time();
                kinded.store(&mut changes.snapshot.lock().expect("poisoned"), k);
                if is_service { changes.queue(1, 0, None) } else { changes.queue(0, 1, trigger) }
            }
            watcher::Event::Delete(object) => {
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
        }
    }
    Ok(())
}

/// This node, for `internalTrafficPolicy: Local`; kproxy only needs to know
/// it exists, so its events are logged.
async fn watch_node(client: Client, node_name: Option<String>) -> Result<()> {
    let Some(name) = node_name else {
        tracing::warn!("no --hostname-override or NODE_NAME: every endpoint counts as remote");
        return Ok(());
    };
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config).default_backoff().applied_objects().boxed();
    let mut seen = false;
    while let Some(node) = stream.try_next().await.transpose() {
        match node {
            Ok(node) if !seen => {
                tracing::info!(node = %node.name_any(), "watching this node");
                seen = true;
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%name, %error, "node watch failed; retrying"),
        }
    }
    Ok(())
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
    fn rfc3339_timestamps_as_kubernetes_writes_them() {
        let at = |s| parse_rfc3339(s).map(|t| t.duration_since(SystemTime::UNIX_EPOCH).unwrap());
        assert_eq!(at("1970-01-01T00:00:00Z"), Some(Duration::ZERO));
        assert_eq!(at("2026-11-29T14:00:00Z"), Some(Duration::from_secs(1_795_960_800)));
        assert_eq!(at("2026-11-29T14:00:00.25Z"), Some(Duration::new(1_795_960_800, 250_000_000)));
        assert_eq!(at("2026-11-29T15:00:00+01:00"), Some(Duration::from_secs(1_795_960_800)));
        assert_eq!(at("2000-02-29T00:00:00Z"), Some(Duration::from_secs(951_782_400)));
        assert_eq!(at("2026-13-01T00:00:00Z"), None);
        assert_eq!(at("yesterday"), None);
        assert_eq!(at("2026-11-29 14:00:00Z"), None);
    }
}
