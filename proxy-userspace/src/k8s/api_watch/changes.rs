//! The objects as last seen and what changed since the last sync: shared between the watchers (or
//! the manifests source) and the sync loop.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};
use kube::ResourceExt as _;
use tokio::sync::Notify;

use super::{QueueObserver, WatchObserver};
use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::time::parse_rfc3339;

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

/// Shared between the source tasks and the sync loop.
#[derive(Default)]
pub struct Changes {
    pub(super) snapshot: Mutex<Snapshot>,
    pending: Mutex<Pending>,
    /// Set once every watcher has delivered its first complete list: syncing
    /// before would delete what a previous agent programmed.
    pub(super) ready: Mutex<(bool, bool)>,
    pub notify: Notify,
    pub(super) health: Option<Arc<dyn WatchObserver>>,
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

    pub(super) fn queue(&self, service: u64, endpoint: u64, trigger: Option<SystemTime>) {
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
    pub(super) fn node_seen(&self, zone: Option<String>, eligible: bool) {
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
    pub(super) fn node_address_seen(&self, primary: Option<std::net::Ipv4Addr>) {
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

pub(super) fn origin(kind: &str, resource_version: Option<String>) -> String {
    format!("api-server {kind} (resourceVersion {})", resource_version.unwrap_or_default())
}

pub(super) fn key(namespace: Option<String>, name: String) -> ObjectKey {
    (namespace.unwrap_or_default(), name, 0)
}

fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let value = slice.annotations().get(TRIGGER_TIME_ANNOTATION)?;
    parse_rfc3339(value)
}

/// A watched object with its origin, ready for the snapshot.
pub enum Kinded {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

impl From<Box<Service>> for Kinded {
    fn from(s: Box<Service>) -> Self {
        Kinded::Service(s)
    }
}

impl From<Box<EndpointSlice>> for Kinded {
    fn from(s: Box<EndpointSlice>) -> Self {
        Kinded::Slice(s)
    }
}

impl Kinded {
    pub(super) fn trigger_time(&self) -> Option<SystemTime> {
        match self {
            Kinded::Slice(slice) => trigger_time(slice),
            Kinded::Service(_) => None,
        }
    }

    pub(super) fn store(self, snapshot: &mut Snapshot, k: ObjectKey) {
        match self {
            Kinded::Service(mut object) => {
                object.metadata.managed_fields = None;
                let origin = origin("Service", object.resource_version());
                snapshot.services.insert(k, Arc::new(Sourced { origin, object: *object }));
            }
            Kinded::Slice(mut object) => {
                object.metadata.managed_fields = None;
                // Kept until the slice changes: without the spare room a decoded list leaves (an
                // endpoint is some 300 bytes, and 3 endpoints were decoded into room for 4).
                object.endpoints.shrink_to_fit();
                let origin = origin("EndpointSlice", object.resource_version());
                snapshot.slices.insert(k, Arc::new(Sourced { origin, object: *object }));
            }
        }
    }
}
