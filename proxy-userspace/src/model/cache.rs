//! The model, rebuilt incrementally for the agent's API-server source.
//!
//! What the model makes of a Service on its own depends only on that Service,
//! its EndpointSlices and the options, so a sync rebuilds just the Services
//! whose objects changed (the watcher replaces an object's `Arc` when it
//! changes, so identity is the test) and reuses the rest; a change of options
//! rebuilds everything. The rules that span Services (an address:port/protocol
//! or a health check port belongs to the first Service that claims it) are
//! applied by the same merge as a full build, in the same order.
//!
//! When the rebuilt Services claim exactly what they claimed before (the same
//! addresses, ports and fields, the same errors: an endpoint change), who holds
//! what cannot have changed, so the last result is patched in place — their
//! frontends, health checks, trigger times and counters — instead of merged
//! again, and [`Update::changed`] says which frontends those are: an endpoint
//! change costs work for its Service, not for every Service.

use std::{borrow::Cow, sync::Arc};

use foldhash::{HashMap, HashMapExt as _};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::claims::{Merge, Parts, entry_stats};
use crate::{
    k8s::kept::{Kept, Slim, decoded},
    k8s::manifest::ManifestError,
    model::{self, Desired, Frontend, ModelOptions, Scope},
};

struct Entry {
    service: Arc<Kept<Service>>,
    slices: Vec<Arc<Kept<EndpointSlice>>>,
    parts: Parts,
}

/// One Service's part of the model, from its objects decoded.
fn build_parts(
    service: &Kept<Service>,
    slices: &[Arc<Kept<EndpointSlice>>],
    options: &ModelOptions,
) -> Parts {
    model::build_parts(&[service.sourced()], &decoded(slices), options)
}

/// The Service a slice belongs to: its namespace (`default` for none) and its label.
fn service_of(slice: &Kept<EndpointSlice>) -> Option<(&str, &str)> {
    Some((slice.namespace().unwrap_or("default"), slice.service_name()?))
}

/// A Service's namespace and name as its slices' label names it (`default` for no namespace).
fn service_key<T: Slim>(object: &Kept<T>) -> (&str, &str) {
    (object.namespace().unwrap_or("default"), object.name().unwrap_or_default())
}

/// Per-Service model results of the last sync, keyed by the identity of the
/// Service object they were built from.
#[derive(Default)]
pub struct ModelCache {
    entries: HashMap<*const Kept<Service>, Entry>,
    /// The options the entries were built with.
    options: Option<ModelOptions>,
    /// The last result, patched or replaced by the next call.
    last: Option<(Desired, Vec<ManifestError>)>,
    /// The objects of the last call, in order: a replaced slice is found by identity at its position.
    last_services: Vec<Arc<Kept<Service>>>,
    last_slices: Vec<Arc<Kept<EndpointSlice>>>,
    /// `last_services` is in (namespace, name) order, each once (as from the API server): a slice's
    /// Service is found by binary search.
    services_sorted: bool,
    /// Services rebuilt by the last call (for logs and tests).
    pub rebuilt: usize,
}

/// What [`ModelCache::update`] made of the objects.
pub struct Update<'a> {
    pub desired: &'a Desired,
    pub errors: &'a [ManifestError],
    /// `Some` when `desired` differs from the last call's only in these frontends (same keys, same
    /// holders); `None` when anything may have changed.
    pub changed: Option<Changed>,
}

/// The frontends one [`ModelCache::update`] changed in place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changed {
    /// Positions in [`Desired::frontends`]: every kept frontend of each rebuilt Service.
    pub frontends: Vec<usize>,
    /// The same frontends as the previous result had them, in the same order.
    pub before: Vec<Frontend>,
}

fn same<T>(a: &[Arc<T>], b: &[Arc<T>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
}

/// [`Desired::frontends`]' sort key.
fn sort_key(f: &Frontend) -> (std::net::IpAddr, u16, crate::net::Protocol, Scope) {
    (f.vip, f.port, f.proto, f.scope)
}

/// Whether `new` claims what `old` did, field by field, with the same errors: then the merge gives
/// the same holders and the same conflicts, and only the claimed frontends' contents may differ.
fn same_claims(old: &Parts, new: &Parts) -> bool {
    old.errors == new.errors
        && old.services.len() == new.services.len()
        && old.services.iter().zip(&new.services).all(|(a, b)| {
            a.name == b.name
                && a.origin == b.origin
                && a.claims == b.claims
                && a.health_check.as_ref().map(|h| h.port) == b.health_check.as_ref().map(|h| h.port)
        })
        && old.claims.len() == new.claims.len()
        && old.claims.iter().zip(&new.claims).all(|(a, b)| {
            a.field == b.field
                && sort_key(&a.internal) == sort_key(&b.internal)
                && a.external.as_ref().map(sort_key) == b.external.as_ref().map(sort_key)
        })
}

/// Replaces in `desired` what `old` contributed with what `new` does, when [`same_claims`]: the
/// frontends the Service holds, its health check, its trigger time and the counters.
fn patch(desired: &mut Desired, old: &Parts, new: &Parts, changed: &mut Changed) {
    desired.stats.sub(&old.stats);
    desired.stats.add(&new.stats);
    for (old_service, service) in old.services.iter().zip(&new.services) {
        let claims = old.claims[old_service.claims.clone()].iter().zip(&new.claims[service.claims.clone()]);
        for (old_claim, claim) in claims {
            for (old_entry, entry) in old_claim.entries().zip(claim.entries()) {
                let Ok(at) = desired.frontends.binary_search_by_key(&sort_key(entry), sort_key) else {
                    continue;
                };
                // Held by an earlier Service: skipped before, skipped now.
                if desired.frontends[at].service != service.name {
                    continue;
                }
                debug_assert_eq!(&desired.frontends[at], old_entry);
                desired.stats.sub(&entry_stats(old_entry));
                desired.stats.add(&entry_stats(entry));
                changed.before.push(std::mem::replace(&mut desired.frontends[at], entry.clone()));
                changed.frontends.push(at);
            }
        }
        if let Some(check) = &service.health_check
            && let Ok(at) = desired.health_checks.binary_search_by_key(&check.port, |c| c.port)
            && desired.health_checks[at].service == service.name
        {
            desired.health_checks[at] = check.clone();
        }
        let times = &mut desired.trigger_times;
        let at = times.partition_point(|(name, _)| name < &service.name);
        if times.get(at).is_some_and(|(name, _)| name == &service.name) {
            times.remove(at);
        }
        if let Some(time) = &service.trigger_time {
            times.insert(at, (service.name.clone(), time.clone()));
        }
    }
}

impl ModelCache {
    /// The same result as [`model::build_with`] over all objects (for objects
    /// from the API server, where namespace/name is unique), rebuilding only
    /// the Services whose objects changed since the last call.
    pub fn build(
        &mut self,
        services: &[Arc<Kept<Service>>],
        slices: &[Arc<Kept<EndpointSlice>>],
        options: &ModelOptions,
    ) -> (Desired, Vec<ManifestError>) {
        let update = self.update(services, slices, options);
        (update.desired.clone(), update.errors.to_vec())
    }

    /// [`ModelCache::build`] without copying the result, saying which frontends changed when only
    /// some Services' endpoints did.
    pub fn update<'a>(
        &mut self,
        services: &'a [Arc<Kept<Service>>],
        slices: &'a [Arc<Kept<EndpointSlice>>],
        options: &ModelOptions,
    ) -> Update<'_> {
        if self.options.as_ref() != Some(options) {
            // The node name decides which endpoints are local and the node
            // addresses which NodePort frontends exist: nothing kept is valid.
            self.entries.clear();
            self.last = None;
            self.options = Some(options.clone());
        }
        let (patchable, replaced) = match self.rebuild_in_place(services, slices, options) {
            Some(replaced) => (true, replaced),
            None => self.rebuild(services, slices, options),
        };
        let patchable =
            patchable && replaced.iter().all(|(key, old)| same_claims(old, &self.entries[key].parts));
        let changed = if patchable && let Some((desired, _)) = self.last.as_mut() {
            let mut changed = Changed::default();
            for (key, old) in &replaced {
                patch(desired, old, &self.entries[key].parts, &mut changed);
            }
            Some(changed)
        } else {
            let mut merge = Merge::default();
            for service in services {
                merge.add(Cow::Borrowed(&self.entries[&Arc::as_ptr(service)].parts));
            }
            self.last = Some(merge.finish());
            None
        };
        let (desired, errors) = self.last.as_ref().expect("patched or built above");
        Update { desired, errors, changed }
    }

    /// [`ModelCache::update`] for objects replaced in place, each at its position in the last call's
    /// lists (the sync loop's [`Replaced`](crate::k8s::api_watch::Replaced), after last good
    /// versions): the same result ([`ModelCache::result`]), for the work of the Services those slices
    /// belong to — no pass over every object — and [`Update::changed`]. `None`, having changed
    /// nothing, when that does not follow from the last call (a Service replaced, a slice renamed or
    /// moved to another Service, other options): then [`ModelCache::update`] with every object.
    pub fn update_replaced(
        &mut self,
        services: &[(usize, Arc<Kept<Service>>)],
        slices: &[(usize, Arc<Kept<EndpointSlice>>)],
        options: &ModelOptions,
    ) -> Option<Option<Changed>> {
        if self.options.as_ref() != Some(options) || self.last.is_none() {
            return None;
        }
        let same_at = |list: &[Arc<Kept<Service>>], at: usize, object: &Arc<Kept<Service>>| {
            list.get(at).is_some_and(|last| Arc::ptr_eq(last, object))
        };
        if !services.iter().all(|(at, service)| same_at(&self.last_services, *at, service)) {
            return None;
        }
        // Each replaced slice and the Service entry holding its last version, as in rebuild_in_place.
        let mut replaced_slices = Vec::new();
        for (at, new) in slices {
            let old = self.last_slices.get(*at)?;
            if Arc::ptr_eq(old, new) {
                continue;
            }
            let service = service_of(new);
            if new.namespace() != old.namespace() || new.name() != old.name() || service != service_of(old) {
                return None;
            }
            let Some(service) = service else { continue };
            let Some(holder) = self.service_named(service) else { continue };
            let key = Arc::as_ptr(holder);
            if !self.entries.get(&key)?.slices.iter().any(|s| Arc::ptr_eq(s, old)) {
                return None;
            }
            replaced_slices.push((*at, key));
        }
        let mut replaced: Vec<(*const Kept<Service>, Parts)> = Vec::new();
        for &(at, key) in &replaced_slices {
            let new = &slices.iter().find(|(i, _)| *i == at).expect("listed above").1;
            let entry = self.entries.get_mut(&key).expect("checked above");
            for slice in entry.slices.iter_mut().filter(|s| Arc::ptr_eq(s, &self.last_slices[at])) {
                *slice = Arc::clone(new);
            }
            if !replaced.iter().any(|(k, _)| *k == key) {
                replaced.push((key, Parts::default()));
            }
        }
        for (key, old) in &mut replaced {
            let entry = self.entries.get_mut(key).expect("checked above");
            let parts = build_parts(&entry.service, &entry.slices, options);
            *old = std::mem::replace(&mut entry.parts, parts);
        }
        for (at, slice) in slices {
            self.last_slices[*at] = Arc::clone(slice);
        }
        self.rebuilt = replaced.len();
        let patchable = replaced.iter().all(|(key, old)| same_claims(old, &self.entries[key].parts));
        let changed = if patchable && let Some((desired, _)) = self.last.as_mut() {
            let mut changed = Changed::default();
            for (key, old) in &replaced {
                patch(desired, old, &self.entries[key].parts, &mut changed);
            }
            Some(changed)
        } else {
            let mut merge = Merge::default();
            for service in &self.last_services {
                merge.add(Cow::Borrowed(&self.entries[&Arc::as_ptr(service)].parts));
            }
            self.last = Some(merge.finish());
            None
        };
        Some(changed)
    }

    /// The result of the last [`ModelCache::update`] or [`ModelCache::update_replaced`] (empty before).
    pub fn result(&self) -> (&Desired, &[ManifestError]) {
        static EMPTY: std::sync::LazyLock<Desired> = std::sync::LazyLock::new(Desired::default);
        match &self.last {
            Some((desired, errors)) => (desired, errors),
            None => (&EMPTY, &[]),
        }
    }

    /// How many Services and EndpointSlices the last call had.
    pub fn object_counts(&self) -> (usize, usize) {
        (self.last_services.len(), self.last_slices.len())
    }

    /// The last call's Service of this namespace and name.
    fn service_named(&self, (namespace, name): (&str, &str)) -> Option<&Arc<Kept<Service>>> {
        if self.services_sorted {
            let at = self.last_services.binary_search_by(|s| service_key(s).cmp(&(namespace, name))).ok()?;
            return Some(&self.last_services[at]);
        }
        self.last_services.iter().find(|s| service_key(s) == (namespace, name))
    }

    /// Rebuilds the Services whose objects changed, regrouping every slice by its Service: whether the
    /// result may be patched (the same Services as last time), and each rebuilt Service's last parts.
    fn rebuild<'a>(
        &mut self,
        services: &'a [Arc<Kept<Service>>],
        slices: &'a [Arc<Kept<EndpointSlice>>],
        options: &ModelOptions,
    ) -> (bool, Vec<(*const Kept<Service>, Parts)>) {
        let mut by_service: HashMap<(&'a str, &'a str), Vec<Arc<Kept<EndpointSlice>>>> = HashMap::new();
        for slice in slices {
            let Some(name) = slice.service_name() else { continue };
            let namespace = slice.namespace().unwrap_or("default");
            by_service.entry((namespace, name)).or_default().push(Arc::clone(slice));
        }

        // Patching needs the same Services as last time, each rebuilt one with its last parts.
        let mut patchable = self.last.is_some() && services.len() == self.entries.len();
        let mut replaced: Vec<(*const Kept<Service>, Parts)> = Vec::new();
        let mut next = HashMap::with_capacity(services.len());
        self.rebuilt = 0;
        for service in services {
            let its_slices = by_service.remove(&service_key(service)).unwrap_or_default();
            let key = Arc::as_ptr(service);
            let entry = match self.entries.remove(&key) {
                Some(e) if Arc::ptr_eq(&e.service, service) && same(&e.slices, &its_slices) => e,
                found => {
                    self.rebuilt += 1;
                    let parts = build_parts(service, &its_slices, options);
                    match found {
                        Some(old) if Arc::ptr_eq(&old.service, service) => replaced.push((key, old.parts)),
                        _ => patchable = false,
                    }
                    Entry { service: Arc::clone(service), slices: its_slices, parts }
                }
            };
            next.insert(key, entry);
        }
        self.entries = next;
        self.services_sorted = services.windows(2).all(|w| service_key(&w[0]) < service_key(&w[1]));
        self.last_services = services.to_vec();
        self.last_slices = slices.to_vec();
        (patchable, replaced)
    }

    /// The common case, an EndpointSlice replaced by a version of the same name for the same Service
    /// (the same Services and slices at the same positions otherwise), found by identity: only the
    /// Services those slices belong to are rebuilt, without regrouping every slice. `None`, having
    /// changed nothing, when that is not the case.
    fn rebuild_in_place(
        &mut self,
        services: &[Arc<Kept<Service>>],
        slices: &[Arc<Kept<EndpointSlice>>],
        options: &ModelOptions,
    ) -> Option<Vec<(*const Kept<Service>, Parts)>> {
        if self.last.is_none()
            || services.len() != self.last_services.len()
            || slices.len() != self.last_slices.len()
            || !same(services, &self.last_services)
        {
            return None;
        }
        // Each replaced slice and the Service entry holding its last version (none for a slice of no
        // listed Service: it is in no entry, and stays in none).
        let mut replaced_slices = Vec::new();
        for at in (0..slices.len()).filter(|&at| !Arc::ptr_eq(&slices[at], &self.last_slices[at])) {
            let (new, old) = (&slices[at], &self.last_slices[at]);
            let service = service_of(new);
            if new.namespace() != old.namespace() || new.name() != old.name() || service != service_of(old) {
                return None;
            }
            let Some(service) = service else { continue };
            let holder = services.iter().find(|s| service_key(s) == service);
            let Some(holder) = holder else { continue };
            let key = Arc::as_ptr(holder);
            if !self.entries.get(&key)?.slices.iter().any(|s| Arc::ptr_eq(s, old)) {
                return None;
            }
            replaced_slices.push((at, key));
        }
        let mut replaced: Vec<(*const Kept<Service>, Parts)> = Vec::new();
        for &(at, key) in &replaced_slices {
            let entry = self.entries.get_mut(&key).expect("checked above");
            for slice in entry.slices.iter_mut().filter(|s| Arc::ptr_eq(s, &self.last_slices[at])) {
                *slice = Arc::clone(&slices[at]);
            }
            if !replaced.iter().any(|(k, _)| *k == key) {
                replaced.push((key, Parts::default()));
            }
        }
        for (key, old) in &mut replaced {
            let entry = self.entries.get_mut(key).expect("checked above");
            let parts = build_parts(&entry.service, &entry.slices, options);
            *old = std::mem::replace(&mut entry.parts, parts);
        }
        // Every replaced slice is remembered, those of no listed Service too.
        for (last, slice) in self.last_slices.iter_mut().zip(slices) {
            if !Arc::ptr_eq(last, slice) {
                *last = Arc::clone(slice);
            }
        }
        self.rebuilt = replaced.len();
        Some(replaced)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        k8s::manifest::{Sourced, parse_str},
        model::FrontendKind,
    };

    const OBJECTS: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.100
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11]}, {addresses: [10.244.0.12], conditions: {ready: false, serving: true, terminating: true}}]
ports: [{name: http, port: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP}, {name: bad, port: 70000, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-1, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.21]}]
ports: [{name: dns, port: 53, protocol: UDP}]
---
apiVersion: v1
kind: Service
metadata: {name: thief, namespace: default}
spec:
  clusterIP: 10.96.0.100
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: shop, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.200
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  externalIPs: [203.0.113.7, bogus]
  loadBalancerSourceRanges: [10.0.0.0/8, 10.0.0.0/40]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}]
status:
  loadBalancer:
    ingress: [{ip: 198.51.100.10}, {ip: 198.51.100.11, ipMode: Proxy}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: shop-1, namespace: default, labels: {kubernetes.io/service-name: shop}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.31], nodeName: worker-1}
- {addresses: [10.244.2.31], nodeName: worker-2}
- {addresses: [10.244.1.32], nodeName: worker-1, conditions: {ready: false, serving: true, terminating: true}}
ports: [{name: http, port: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: copycat, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.201
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 81, protocol: TCP, nodePort: 30080}, {name: other, port: 82, protocol: TCP, nodePort: 30082}]
";

    fn on_node(addresses: &[&str]) -> ModelOptions {
        ModelOptions {
            node_name: Some("worker-1".into()),
            node_addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            ..Default::default()
        }
    }

    fn sorted(errors: &[ManifestError]) -> Vec<String> {
        let mut texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
        texts.sort();
        texts
    }

    type Shared = (Vec<Arc<Kept<Service>>>, Vec<Arc<Kept<EndpointSlice>>>);

    fn kept<T: crate::k8s::kept::Slim + serde::Serialize + serde::de::DeserializeOwned>(
        object: Sourced<T>,
    ) -> Arc<Kept<T>> {
        Arc::new(Kept::compact(object.origin, object.object))
    }

    /// The full model of the same objects.
    fn full_build(
        services: &[Arc<Kept<Service>>],
        slices: &[Arc<Kept<EndpointSlice>>],
        options: &ModelOptions,
    ) -> (Desired, Vec<ManifestError>) {
        model::build_with(&decoded(services), &decoded(slices), options)
    }

    fn objects(text: &str) -> Shared {
        let parsed = parse_str(text, "test.yaml");
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        (parsed.services.into_iter().map(kept).collect(), parsed.slices.into_iter().map(kept).collect())
    }

    /// An endpoint change patches the last result in place — the Service's frontends, its health check's
    /// local counts, the counters — to exactly what a full build gives, and names the frontends it
    /// changed; a Service that lost its address to an earlier one changes none.
    #[test]
    fn an_endpoint_change_patches_the_result_in_place() {
        let (services, slices) = objects(OBJECTS);
        let options = on_node(&["192.168.1.10"]);
        let mut cache = ModelCache::default();
        assert!(cache.update(&services, &slices, &options).changed.is_none(), "the first build");
        let (_, edited) = objects(
            &OBJECTS
                .replace("10.244.0.21", "10.244.0.22")
                .replace("{addresses: [10.244.1.32], nodeName: worker-1, conditions: {ready: false, serving: true, terminating: true}}", "{addresses: [10.244.1.33], nodeName: worker-1}"),
        );
        let mut next = slices.clone();
        for (i, service) in [(1, "dns"), (2, "shop")] {
            next[i] = Arc::clone(&edited[i]);
            let update = cache.update(&services, &next, &options);
            let (full, full_errors) = full_build(&services, &next, &options);
            assert_eq!(update.desired, &full, "{service}");
            assert_eq!(sorted(update.errors), sorted(&full_errors), "{service}");
            let changed = update.changed.expect("patched in place");
            assert!(!changed.frontends.is_empty());
            assert!(changed.frontends.iter().all(|&at| full.frontends[at].service.name == service));
            assert_eq!(changed.before.len(), changed.frontends.len());
            assert_eq!(cache.rebuilt, 1);
        }
        assert_eq!(cache.update(&services, &slices, &options).desired.health_checks[0].local_ready, 1);
        // Another Service whose slice names the stolen VIP's Service: nothing of it is programmed.
        let thief_slice = parse_str(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: thief-1, namespace: default, labels: {kubernetes.io/service-name: thief}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.0.99]}]\nports: [{name: http, port: 8080, protocol: TCP}]\n",
            "test.yaml",
        );
        let mut with_thief = slices.clone();
        with_thief.push(kept(thief_slice.slices.into_iter().next().unwrap()));
        let update = cache.update(&services, &with_thief, &options);
        assert_eq!(update.desired, &full_build(&services, &with_thief, &options).0);
        assert_eq!(update.changed.expect("patched in place").frontends, Vec::<usize>::new());
    }

    /// Slices replaced in place and given by their position alone give what a whole update gives, with
    /// the Services in key order (as from the API server: found by binary search) or not; a Service
    /// replaced is not for that path.
    #[test]
    fn slices_replaced_at_their_positions_give_what_a_whole_update_gives() {
        let options = on_node(&["192.168.1.10"]);
        let (mut services, slices) = objects(OBJECTS);
        let edited = OBJECTS.replace("10.244.0.21", "10.244.0.22").replace("10.244.2.31", "10.244.2.39");
        let (edited_services, edited) = objects(&edited);
        for in_key_order in [false, true] {
            if in_key_order {
                services.sort_by(|a, b| service_key(a).cmp(&service_key(b)));
            }
            let mut cache = ModelCache::default();
            let _ = cache.update(&services, &slices, &options);
            let mut next = slices.clone();
            for (i, service) in [(1, "dns"), (2, "shop")] {
                next[i] = Arc::clone(&edited[i]);
                let changed = cache.update_replaced(&[], &[(i, Arc::clone(&edited[i]))], &options);
                let changed = changed.expect("replaced in place").expect("patched");
                let (full, full_errors) = full_build(&services, &next, &options);
                let (desired, errors) = cache.result();
                assert_eq!(desired, &full, "{service}, in key order: {in_key_order}");
                assert_eq!(sorted(errors), sorted(&full_errors));
                assert!(!changed.frontends.is_empty());
                assert!(changed.frontends.iter().all(|&at| full.frontends[at].service.name == service));
                assert_eq!(cache.rebuilt, 1);
            }
            let _ = cache.update(&services, &next, &options);
            assert_eq!(cache.rebuilt, 0, "a whole update after finds nothing left to rebuild");
            let replaced_service = [(0, Arc::clone(&edited_services[0]))];
            assert!(cache.update_replaced(&replaced_service, &[], &options).is_none());
            assert_eq!(cache.result().0, &full_build(&services, &next, &options).0, "unchanged");
        }
    }

    #[test]
    fn equals_a_full_build_and_rebuilds_only_what_changed() {
        let (services, slices) = objects(OBJECTS);
        let options = on_node(&["192.168.1.10", "10.0.0.5"]);
        let mut cache = ModelCache::default();
        let (desired, errors) = cache.build(&services, &slices, &options);
        let (full, full_errors) = full_build(&services, &slices, &options);
        assert_eq!(desired, full);
        assert_eq!(sorted(&errors), sorted(&full_errors));
        assert!(errors.iter().any(|e| e.to_string().contains("already used by Service default/web")));
        assert!(errors.iter().any(|e| e.to_string().contains("70000")));
        assert!(errors.iter().any(|e| e.to_string().contains("spec.externalIPs[1]")));
        assert!(errors.iter().any(|e| e.to_string().contains("spec.loadBalancerSourceRanges[1]")));
        let collisions = errors.iter().filter(|e| e.field.as_deref() == Some("spec.ports[0].nodePort"));
        assert_eq!(collisions.count(), 2, "copycat's nodePort on each node address: {errors:#?}");
        assert!(errors.iter().any(|e| e.field.as_deref() == Some("spec.healthCheckNodePort")));
        // shop: cluster IP, two node addresses, an external IP and a load-balancer IP (the Proxy-mode one
        // is left out), each but the cluster IP in both scopes; copycat: two cluster-IP ports, and 82 on
        // both node addresses, in both scopes.
        assert_eq!(full.frontends.iter().filter(|f| f.service.name == "shop").count(), 9);
        assert_eq!(full.frontends.iter().filter(|f| f.service.name == "copycat").count(), 6);
        assert_eq!(full.health_checks.len(), 1);
        assert_eq!((full.health_checks[0].local_ready, full.health_checks[0].local_terminating), (1, 1));
        assert_eq!(cache.rebuilt, 5);

        // Nothing changed: nothing rebuilt, same result.
        let (again, _) = cache.build(&services, &slices, &options);
        assert_eq!((again, cache.rebuilt), (full.clone(), 0));

        // One slice changes: only its Service is rebuilt.
        let (_, changed) = objects(&OBJECTS.replace("10.244.0.21", "10.244.0.22"));
        let mut slices2 = slices.clone();
        slices2[1] = Arc::clone(&changed[1]);
        let (desired, _) = cache.build(&services, &slices2, &options);
        assert_eq!(cache.rebuilt, 1);
        assert_eq!(desired, full_build(&services, &slices2, &options).0);

        // A Service goes away: its frontends go; the thief does not get the VIP
        // because web still owns it.
        let (desired, _) = cache.build(&services[1..], &slices2, &options);
        assert_eq!(desired, full_build(&services[1..], &slices2, &options).0);
        assert_eq!(cache.rebuilt, 0);

        // Other options (node addresses, node name) invalidate everything.
        for options in
            [on_node(&["192.168.1.11"]), ModelOptions { node_name: None, ..on_node(&["192.168.1.11"]) }]
        {
            let (desired, errors) = cache.build(&services, &slices2, &options);
            assert_eq!(cache.rebuilt, services.len());
            let (full, full_errors) = full_build(&services, &slices2, &options);
            assert_eq!(desired, full);
            assert_eq!(sorted(&errors), sorted(&full_errors));
        }
        let node_ports = |desired: &Desired| -> Vec<std::net::IpAddr> {
            let mut vips: Vec<_> = desired
                .frontends
                .iter()
                .filter(|f| f.kind == FrontendKind::NodePort)
                .map(|f| f.vip)
                .collect();
            vips.dedup();
            vips
        };
        assert_eq!(
            node_ports(&cache.build(&services, &slices2, &on_node(&["192.168.1.12"])).0),
            [std::net::IpAddr::from(Ipv4Addr::new(192, 168, 1, 12))]
        );
    }
}
