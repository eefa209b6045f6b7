//! The model, rebuilt incrementally for the agent's API-server source.
//!
//! What the model makes of a Service depends only on that Service and its
//! EndpointSlices, so a sync rebuilds just the Services whose objects changed
//! (the watcher replaces an object's `Arc` when it changes, so identity is the
//! test) and reuses the rest. The one rule that spans Services — a
//! VIP:port/protocol belongs to the first Service that claims it — is applied
//! when the cached results are merged, in the same order as a full build.

use std::{collections::HashMap, net::Ipv4Addr, sync::Arc};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::{
    manifest::{ManifestError, Sourced},
    model::{self, Desired, LABEL_SERVICE_NAME, ModelOptions, ModelStats, Protocol, ServiceName},
};

struct Entry {
    service: Arc<Sourced<Service>>,
    slices: Vec<Arc<Sourced<EndpointSlice>>>,
    desired: Desired,
    errors: Vec<ManifestError>,
}

/// Per-Service model results of the last sync, keyed by the identity of the
/// Service object they were built from.
#[derive(Default)]
pub struct ModelCache {
    entries: HashMap<*const Sourced<Service>, Entry>,
    /// Services rebuilt by the last call (for logs and tests).
    pub rebuilt: usize,
}

fn add(total: &mut ModelStats, part: &ModelStats) {
    total.services_seen += part.services_seen;
    total.services_programmed += part.services_programmed;
    total.services_skipped_headless += part.services_skipped_headless;
    total.services_skipped_external_name += part.services_skipped_external_name;
    total.services_skipped_other_proxy += part.services_skipped_other_proxy;
    total.frontends += part.frontends;
    total.frontends_without_backends += part.frontends_without_backends;
    total.frontends_terminating_fallback += part.frontends_terminating_fallback;
    total.endpoints_ready += part.endpoints_ready;
    total.endpoints_terminating += part.endpoints_terminating;
    total.endpoints_not_ready += part.endpoints_not_ready;
}

fn same<T>(a: &[Arc<T>], b: &[Arc<T>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(x, y))
}

impl ModelCache {
    /// The same result as [`model::build_with`] over all objects (for objects
    /// from the API server, where namespace/name is unique), rebuilding only
    /// the Services whose objects changed since the last call.
    pub fn build<'a>(
        &mut self,
        services: &'a [Arc<Sourced<Service>>],
        slices: &'a [Arc<Sourced<EndpointSlice>>],
        options: &ModelOptions,
    ) -> (Desired, Vec<ManifestError>) {
        let mut by_service: HashMap<(&'a str, &'a str), Vec<Arc<Sourced<EndpointSlice>>>> = HashMap::new();
        for slice in slices {
            let meta = &slice.object.metadata;
            let Some(name) = meta.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME)) else { continue };
            let namespace = meta.namespace.as_deref().unwrap_or("default");
            by_service.entry((namespace, name.as_str())).or_default().push(Arc::clone(slice));
        }

        let mut next = HashMap::with_capacity(services.len());
        let mut frontends = Vec::new();
        let mut errors = Vec::new();
        let mut stats = ModelStats::default();
        let mut trigger_times = Vec::new();
        let mut taken: HashMap<(Ipv4Addr, u16, Protocol), ServiceName> = HashMap::new();
        self.rebuilt = 0;
        for service in services {
            let meta = &service.object.metadata;
            let name =
                (meta.namespace.as_deref().unwrap_or("default"), meta.name.as_deref().unwrap_or_default());
            let its_slices = by_service.remove(&name).unwrap_or_default();
            let key = Arc::as_ptr(service);
            let entry = match self.entries.remove(&key) {
                Some(e) if Arc::ptr_eq(&e.service, service) && same(&e.slices, &its_slices) => e,
                _ => {
                    self.rebuilt += 1;
                    let (desired, errors) =
                        model::build_with(std::slice::from_ref(service), &its_slices, options);
                    Entry { service: Arc::clone(service), slices: its_slices, desired, errors }
                }
            };
            let mut part = entry.desired.stats.clone();
            let mut kept = 0;
            for frontend in &entry.desired.frontends {
                let claim = (frontend.vip, frontend.port, frontend.proto);
                if let Some(other) = taken.get(&claim) {
                    part.frontends -= 1;
                    part.frontends_without_backends -= usize::from(frontend.backends.is_empty());
                    part.frontends_terminating_fallback -= usize::from(frontend.terminating_fallback);
                    errors.push(ManifestError {
                        origin: service.origin.clone(),
                        object: Some(format!("Service {}", frontend.service)),
                        field: Some("spec.ports".to_owned()),
                        message: format!(
                            "{}:{}/{} is already used by Service {other}; the port is skipped",
                            frontend.vip, frontend.port, frontend.proto
                        ),
                    });
                    continue;
                }
                taken.insert(claim, frontend.service.clone());
                frontends.push(frontend.clone());
                kept += 1;
            }
            if kept == 0 {
                part.services_programmed = 0;
            }
            errors.extend(entry.errors.iter().cloned());
            add(&mut stats, &part);
            trigger_times.extend(entry.desired.trigger_times.iter().cloned());
            next.insert(key, entry);
        }
        self.entries = next;
        frontends.sort_by_key(|f| (f.vip, f.port, f.proto));
        trigger_times.sort();
        (Desired { frontends, stats, trigger_times, health_checks: Vec::new() }, errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::parse_str;

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
";

    type Shared = (Vec<Arc<Sourced<Service>>>, Vec<Arc<Sourced<EndpointSlice>>>);

    fn objects(text: &str) -> Shared {
        let parsed = parse_str(text, "test.yaml");
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        (
            parsed.services.into_iter().map(Arc::new).collect(),
            parsed.slices.into_iter().map(Arc::new).collect(),
        )
    }

    #[test]
    fn equals_a_full_build_and_rebuilds_only_what_changed() {
        let (services, slices) = objects(OBJECTS);
        let options = ModelOptions::default();
        let mut cache = ModelCache::default();
        let (desired, errors) = cache.build(&services, &slices, &options);
        let (full, full_errors) = model::build_with(&services, &slices, &options);
        assert_eq!(desired, full);
        assert_eq!(errors.len(), full_errors.len(), "{errors:?} / {full_errors:?}");
        assert!(errors.iter().any(|e| e.to_string().contains("already used by Service default/web")));
        assert!(errors.iter().any(|e| e.to_string().contains("70000")));
        assert_eq!(cache.rebuilt, 3);

        // Nothing changed: nothing rebuilt, same result.
        let (again, _) = cache.build(&services, &slices, &options);
        assert_eq!((again, cache.rebuilt), (full.clone(), 0));

        // One slice changes: only its Service is rebuilt.
        let (_, changed) = objects(&OBJECTS.replace("10.244.0.21", "10.244.0.22"));
        let mut slices2 = slices.clone();
        slices2[1] = Arc::clone(&changed[1]);
        let (desired, _) = cache.build(&services, &slices2, &options);
        assert_eq!(cache.rebuilt, 1);
        assert_eq!(desired, model::build_with(&services, &slices2, &options).0);

        // A Service goes away: its frontends go; the thief does not get the VIP
        // because web still owns it.
        let (desired, _) = cache.build(&services[1..], &slices2, &options);
        assert_eq!(desired, model::build_with(&services[1..], &slices2, &options).0);
        assert_eq!(cache.rebuilt, 0);
    }
}
