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
use crate::k8s::kept::{IntoKept, Kept};
use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::time::parse_rfc3339;

const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// namespace, name, and a disambiguator that keeps duplicate definitions in
/// manifest files apart (the model reports them); always 0 from the API. The
/// manifests source numbers objects in the order it first saw them, and
/// [`Snapshot::services`] hands them to the model in that order.
pub type ObjectKey = (String, String, u32);

/// One kind's objects as last seen, by key. `insert` takes them kept compactly (the API server's) or
/// whole (the manifests', shared with that source). Each object keeps its position in the last list
/// the sync loop took ([`Changes::objects`]), and the map notes which keys were replaced in place
/// since, so that an endpoint change reaches the sync loop as that one object at its position
/// ([`Changes::take_replaced`]) rather than as every object again.
pub struct ObjectMap<T> {
    objects: BTreeMap<ObjectKey, Slot<T>>,
    /// Keys replaced in place since the last take.
    replaced: Vec<ObjectKey>,
    /// Keys came or went since the last whole take (or none was taken yet): positions moved.
    moved: bool,
}

struct Slot<T> {
    object: Arc<Kept<T>>,
    /// Position in the last whole list taken (meaningless while the map has `moved`).
    position: usize,
}

impl<T> Clone for Slot<T> {
    fn clone(&self) -> Self {
        Self { object: Arc::clone(&self.object), position: self.position }
    }
}

impl<T> Default for ObjectMap<T> {
    fn default() -> Self {
        Self { objects: BTreeMap::new(), replaced: Vec::new(), moved: true }
    }
}

impl<T> Clone for ObjectMap<T> {
    fn clone(&self) -> Self {
        Self { objects: self.objects.clone(), replaced: self.replaced.clone(), moved: self.moved }
    }
}

impl<T> ObjectMap<T> {
    pub fn insert(&mut self, key: ObjectKey, object: impl IntoKept<T>) -> Option<Arc<Kept<T>>> {
        let object = object.into_kept();
        match self.objects.get_mut(&key) {
            Some(slot) => {
                self.replaced.push(key);
                Some(std::mem::replace(&mut slot.object, object))
            }
            None => {
                self.moved = true;
                self.objects.insert(key, Slot { object, position: usize::MAX });
                None
            }
        }
    }

    pub fn remove(&mut self, key: &ObjectKey) -> Option<Arc<Kept<T>>> {
        let removed = self.objects.remove(key)?;
        self.moved = true;
        Some(removed.object)
    }

    pub fn clear(&mut self) {
        self.objects.clear();
        self.moved = true;
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    pub fn get(&self, key: &ObjectKey) -> Option<&Arc<Kept<T>>> {
        self.objects.get(key).map(|slot| &slot.object)
    }

    pub fn values(&self) -> impl Iterator<Item = &Arc<Kept<T>>> {
        self.objects.values().map(|slot| &slot.object)
    }

    /// The objects in the order the model resolves their claims in (see [`Snapshot::services`]).
    fn in_claim_order(&self) -> Vec<(&ObjectKey, &Arc<Kept<T>>)> {
        let mut ordered: Vec<(&ObjectKey, &Arc<Kept<T>>)> =
            self.objects.iter().map(|(key, slot)| (key, &slot.object)).collect();
        // Stable: equal disambiguators stay in key order.
        ordered.sort_by_key(|(key, _)| key.2);
        ordered
    }

    /// Every object in claim order, each remembering its position there; nothing is pending after.
    fn take_all(&mut self) -> Vec<Arc<Kept<T>>> {
        // Claim position of each object in key order (the key order itself from the API server).
        let mut by_claim: Vec<(u32, usize)> =
            self.objects.keys().enumerate().map(|(at, key)| (key.2, at)).collect();
        by_claim.sort_by_key(|&(disambiguator, _)| disambiguator);
        let mut positions = vec![0; by_claim.len()];
        for (position, &(_, at)) in by_claim.iter().enumerate() {
            positions[at] = position;
        }
        let mut all: Vec<Option<Arc<Kept<T>>>> = vec![None; positions.len()];
        for (slot, &position) in self.objects.values_mut().zip(&positions) {
            slot.position = position;
            all[position] = Some(Arc::clone(&slot.object));
        }
        self.replaced.clear();
        self.moved = false;
        all.into_iter().map(|object| object.expect("every position taken once")).collect()
    }

    /// The objects replaced in place since the last take, at their positions; `None` when keys came
    /// or went (then only a whole take says what the sync loop should hold).
    fn take_replaced(&mut self) -> Option<Vec<(usize, Arc<Kept<T>>)>> {
        if self.moved {
            return None;
        }
        self.replaced.sort();
        self.replaced.dedup();
        let replaced = self
            .replaced
            .drain(..)
            .filter_map(|key| self.objects.get(&key))
            .map(|slot| (slot.position, Arc::clone(&slot.object)))
            .collect();
        Some(replaced)
    }
}

/// Objects as last seen.
#[derive(Default, Clone)]
pub struct Snapshot {
    pub services: ObjectMap<Service>,
    pub slices: ObjectMap<EndpointSlice>,
    /// ServiceCIDRs (cluster-scoped: an empty namespace), for the drop of unallocated service addresses.
    pub service_cidrs: BTreeMap<ObjectKey, Arc<Sourced<ServiceCIDR>>>,
    /// Errors of the source itself (unreadable files, unparsable documents).
    pub errors: Vec<ManifestError>,
}

impl Snapshot {
    /// The objects, decoded, in the order the model resolves their claims in (the first to claim an
    /// address keeps it): by the key's disambiguator, then by namespace and name. From the manifests
    /// source an address thus stays with the Service that held it while a newcomer claims it; from
    /// the API server this is key order.
    pub fn services(&self) -> Vec<Arc<Sourced<Service>>> {
        self.services.in_claim_order().into_iter().map(|(_, object)| object.sourced()).collect()
    }

    pub fn slices(&self) -> Vec<Arc<Sourced<EndpointSlice>>> {
        self.slices.in_claim_order().into_iter().map(|(_, object)| object.sourced()).collect()
    }
}

/// The objects a sync reads, shared with the snapshot, in claim order (see [`Snapshot::services`]).
pub struct Objects {
    pub services: Vec<Arc<Kept<Service>>>,
    pub slices: Vec<Arc<Kept<EndpointSlice>>>,
    pub errors: Vec<ManifestError>,
}

/// What changed since the sync loop last took the objects, when only objects were replaced in place:
/// each at its position in the [`Objects`] taken then (see [`Changes::take_replaced`]).
pub struct Replaced {
    pub services: Vec<(usize, Arc<Kept<Service>>)>,
    pub slices: Vec<(usize, Arc<Kept<EndpointSlice>>)>,
    /// The source's errors, as [`Objects::errors`].
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
        let mut snapshot = self.snapshot.lock().expect("poisoned");
        let (services, slices) = (snapshot.services.take_all(), snapshot.slices.take_all());
        Objects { services, slices, errors: snapshot.errors.clone() }
    }

    /// The objects replaced in place since the last [`Changes::objects`] or `take_replaced`, at their
    /// positions in what that call returned: an endpoint change costs the sync loop that one object.
    /// `None`, taking nothing, when objects came or went since (then [`Changes::objects`] is the way).
    pub fn take_replaced(&self) -> Option<Replaced> {
        let mut snapshot = self.snapshot.lock().expect("poisoned");
        if snapshot.services.moved || snapshot.slices.moved {
            return None;
        }
        let services = snapshot.services.take_replaced()?;
        let slices = snapshot.slices.take_replaced()?;
        Some(Replaced { services, slices, errors: snapshot.errors.clone() })
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

    /// The object as the snapshot keeps it: without what the model never reads, encoded (see
    /// [`Kept`]). Done before the snapshot is locked.
    pub(super) fn kept(self) -> KeptKind {
        match self {
            Kinded::Service(object) => {
                let origin = origin("Service", object.resource_version());
                KeptKind::Service(Arc::new(Kept::compact(origin, *object)))
            }
            Kinded::Slice(object) => {
                let origin = origin("EndpointSlice", object.resource_version());
                KeptKind::Slice(Arc::new(Kept::compact(origin, *object)))
            }
        }
    }
}

/// A watched object as the snapshot keeps it.
pub(super) enum KeptKind {
    Service(Arc<Kept<Service>>),
    Slice(Arc<Kept<EndpointSlice>>),
}

impl KeptKind {
    pub(super) fn store(self, snapshot: &mut Snapshot, k: ObjectKey) {
        match self {
            KeptKind::Service(object) => {
                snapshot.services.insert(k, object);
            }
            KeptKind::Slice(object) => {
                snapshot.slices.insert(k, object);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, version: u32) -> Arc<Kept<Service>> {
        let mut object = Service::default();
        object.metadata.name = Some(name.to_owned());
        object.metadata.namespace = Some("default".to_owned());
        Arc::new(Kept::compact(format!("version {version}"), object))
    }

    fn key(name: &str) -> ObjectKey {
        ("default".to_owned(), name.to_owned(), 0)
    }

    fn names(objects: &[Arc<Kept<Service>>]) -> Vec<&str> {
        objects.iter().map(|o| o.name().unwrap()).collect()
    }

    /// An object replaced in place is handed over alone, at its position in the last list taken,
    /// once; a newcomer or a deletion moves the positions, and only the whole list says them again.
    #[test]
    fn a_replaced_object_is_taken_at_its_position_until_objects_come_or_go() {
        let changes = Changes::default();
        let insert = |name: &str, object: &Arc<Kept<Service>>| {
            changes.snapshot.lock().unwrap().services.insert(key(name), Arc::clone(object));
        };
        for name in ["a", "b", "c"] {
            insert(name, &service(name, 1));
        }
        assert!(changes.take_replaced().is_none(), "nothing was taken yet");
        assert_eq!(names(&changes.objects().services), ["a", "b", "c"]);
        assert!(changes.take_replaced().unwrap().services.is_empty());

        let b = service("b", 2);
        insert("b", &service("b", 3));
        insert("b", &b);
        let replaced = changes.take_replaced().unwrap();
        assert_eq!(replaced.services.len(), 1, "replaced twice, handed over once");
        assert_eq!(replaced.services[0].0, 1);
        assert!(Arc::ptr_eq(&replaced.services[0].1, &b), "its latest version");
        assert!(changes.take_replaced().unwrap().services.is_empty(), "taken");

        insert("aa", &service("aa", 1));
        insert("c", &service("c", 2));
        assert!(changes.take_replaced().is_none(), "a newcomer moves the positions");
        let all = changes.objects();
        assert_eq!(names(&all.services), ["a", "aa", "b", "c"]);
        assert_eq!(all.services[3].origin(), "version 2");
        insert("c", &service("c", 3));
        assert_eq!(changes.take_replaced().unwrap().services[0].0, 3);
        changes.snapshot.lock().unwrap().services.remove(&key("a"));
        assert!(changes.take_replaced().is_none(), "a deletion too");
    }
}
