//! Last good versions: a Service or EndpointSlice whose new version fails validation keeps its last
//! valid version programmed, so that a bad edit (a port out of range, an address that is not one)
//! does not take down what was working. The error names the object and the field, and says the last
//! good version stays. Pure: the sync loop passes every snapshot through [`LastGood::admit`] before
//! the model.
//!
//! An object never seen valid is passed on as it is (the model reports it and leaves out the bad
//! parts, as before), and an object that is gone is forgotten: nothing deleted comes back. Objects are
//! validated only when their shared handle changes (the sources replace an object's `Arc` when it
//! changes), so a sync of 100k unchanged Services validates nothing.

use std::{collections::HashMap, sync::Arc};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::{
    k8s::api_watch::Objects,
    k8s::manifest::{ManifestError, Sourced},
    model::{self, ModelOptions},
};

/// The decision about one object, kept until its version changes.
struct Decision<T> {
    /// The version last seen.
    seen: Arc<Sourced<T>>,
    /// The version to program: `seen` when valid (or never seen valid), else the last valid one.
    programmed: Arc<Sourced<T>>,
    /// Why `seen` is not programmed (empty when it is).
    kept: Vec<ManifestError>,
    /// `programmed` passed validation (false for an object never seen valid).
    valid: bool,
}

#[derive(Default)]
pub struct LastGood {
    services: KindState<Service>,
    slices: KindState<EndpointSlice>,
    /// The options the decisions were made with: validity depends on them (e.g. the proxy name).
    options: Option<ModelOptions>,
}

fn key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> (String, String) {
    (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
}

/// The decisions about one kind, and the objects of the last call in their order: the sources hand
/// the objects over in key order, so an endpoint change is one object replaced in place, and the
/// objects at the same position as last time are decided without looking them up (at 10k
/// Services, keying every object afresh was a sixth of an endpoint change's sync).
struct KindState<T> {
    decisions: HashMap<(String, String), Decision<T>>,
    /// The objects of the last call, in the order given.
    last: Vec<Admitted<T>>,
    /// The last call had two objects of the same name (manifests): the next one decides afresh.
    last_had_duplicates: bool,
}

impl<T> Default for KindState<T> {
    fn default() -> Self {
        Self { decisions: HashMap::new(), last: Vec::new(), last_had_duplicates: false }
    }
}

/// One object of the last call: as given, what was programmed for it, and why that differs.
struct Admitted<T> {
    given: Arc<Sourced<T>>,
    programmed: Arc<Sourced<T>>,
    kept: Vec<ManifestError>,
}

impl<T> Admitted<T> {
    fn of(given: &Arc<Sourced<T>>, decision: &Decision<T>) -> Self {
        Self {
            given: Arc::clone(given),
            programmed: Arc::clone(&decision.programmed),
            kept: decision.kept.clone(),
        }
    }
}

type Meta<T> = fn(&T) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The decision for `object`, given the one kept for its name (if any).
fn decide<T>(
    object: &Arc<Sourced<T>>,
    last: Option<Decision<T>>,
    problems: &impl Fn(&Sourced<T>) -> Vec<ManifestError>,
) -> Decision<T> {
    match last {
        Some(decision) if Arc::ptr_eq(&decision.seen, object) => decision,
        last => {
            let found = problems(object);
            match last.filter(|last| last.valid && !found.is_empty()) {
                // Invalid now, valid before: the last valid version stays.
                Some(last) => Decision {
                    seen: Arc::clone(object),
                    programmed: last.programmed,
                    kept: found
                        .into_iter()
                        .map(|mut e| {
                            e.message.push_str("; its last good version stays programmed");
                            e
                        })
                        .collect(),
                    valid: true,
                },
                None => Decision {
                    seen: Arc::clone(object),
                    programmed: Arc::clone(object),
                    kept: Vec::new(),
                    valid: found.is_empty(),
                },
            }
        }
    }
}

impl<T> KindState<T> {
    /// Decides for each object of one kind; `problems` validates one version.
    fn admit(
        &mut self,
        objects: Vec<Arc<Sourced<T>>>,
        meta: Meta<T>,
        problems: impl Fn(&Sourced<T>) -> Vec<ManifestError>,
        errors: &mut Vec<ManifestError>,
    ) -> Vec<Arc<Sourced<T>>> {
        if !self.admit_in_place(&objects, meta, &problems) {
            self.admit_all(&objects, meta, &problems);
        }
        let mut out = Vec::with_capacity(self.last.len());
        for admitted in &self.last {
            out.push(Arc::clone(&admitted.programmed));
            errors.extend(admitted.kept.iter().cloned());
        }
        out
    }

    /// The common case: the same names at the same positions as last time, some objects replaced.
    /// Returns false (having changed nothing) when that is not the case.
    fn admit_in_place(
        &mut self,
        objects: &[Arc<Sourced<T>>],
        meta: Meta<T>,
        problems: &impl Fn(&Sourced<T>) -> Vec<ManifestError>,
    ) -> bool {
        if self.last_had_duplicates || objects.len() != self.last.len() {
            return false;
        }
        let replaced: Vec<usize> =
            (0..objects.len()).filter(|&i| !Arc::ptr_eq(&objects[i], &self.last[i].given)).collect();
        let same_names = replaced.iter().all(|&i| {
            let (new, old) = (&meta(&objects[i].object), &meta(&self.last[i].given.object));
            new.namespace == old.namespace && new.name == old.name
        });
        if !same_names {
            return false;
        }
        for i in replaced {
            let k = key(meta(&objects[i].object));
            let decision = decide(&objects[i], self.decisions.remove(&k), problems);
            self.last[i] = Admitted::of(&objects[i], &decision);
            self.decisions.insert(k, decision);
        }
        true
    }

    /// Decides every object again from its name, forgetting the names that are gone.
    fn admit_all(
        &mut self,
        objects: &[Arc<Sourced<T>>],
        meta: Meta<T>,
        problems: &impl Fn(&Sourced<T>) -> Vec<ManifestError>,
    ) {
        let mut previous = std::mem::take(&mut self.decisions);
        self.last.clear();
        self.last_had_duplicates = false;
        for object in objects {
            let k = key(meta(&object.object));
            let decision = decide(object, previous.remove(&k), problems);
            self.last.push(Admitted::of(object, &decision));
            if self.decisions.contains_key(&k) {
                // The same name twice (manifests): the model reports it; no decision is kept for either.
                self.last_had_duplicates = true;
                continue;
            }
            self.decisions.insert(k, decision);
        }
    }
}

impl LastGood {
    /// The objects to model: each invalid one replaced by its last valid version, with an error saying
    /// so (added to `objects.errors`).
    pub fn admit(&mut self, objects: Objects, options: &ModelOptions) -> Objects {
        if self.options.as_ref() != Some(options) {
            // Validity depends on the options: decide again, but keep the last valid versions.
            for decision in self.services.decisions.values_mut() {
                decision.seen = Arc::new(Sourced { origin: String::new(), object: Service::default() });
            }
            for decision in self.slices.decisions.values_mut() {
                decision.seen = Arc::new(Sourced { origin: String::new(), object: EndpointSlice::default() });
            }
            // Every object is decided again.
            self.services.last.clear();
            self.slices.last.clear();
            self.options = Some(options.clone());
        }
        let Objects { services, slices, mut errors } = objects;
        let services = self.services.admit(
            services,
            |s: &Service| &s.metadata,
            |s| model::service_problems(s, options),
            &mut errors,
        );
        let slices = self.slices.admit(
            slices,
            |s: &EndpointSlice| &s.metadata,
            |s| model::slice_problems(s, options),
            &mut errors,
        );
        Objects { services, slices, errors }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::manifest;

    fn objects(text: &str) -> Objects {
        let parsed = manifest::parse_str(text, "test.yaml");
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        Objects {
            services: parsed.services.into_iter().map(Arc::new).collect(),
            slices: parsed.slices.into_iter().map(Arc::new).collect(),
            errors: Vec::new(),
        }
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  clusterIP: 10.96.0.100\n  ports:\n  - name: http\n    port: PORT\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  namespace: default\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [ADDR]\nports:\n- name: http\n  port: 80\n";

    fn web(port: &str, addr: &str) -> String {
        format!("{}---\n{}", WEB.replace("PORT", port), SLICE.replace("ADDR", addr))
    }

    fn port_of(objects: &Objects) -> i32 {
        objects.services[0].object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port
    }

    #[test]
    fn an_invalid_version_keeps_the_last_valid_one_and_says_so() {
        let options = ModelOptions::default();
        let mut last_good = LastGood::default();
        let admitted = last_good.admit(objects(&web("80", "10.244.0.11")), &options);
        assert!(admitted.errors.is_empty());
        assert_eq!(port_of(&admitted), 80);

        // A port out of range and an address that is not one: both keep their last good version.
        let admitted = last_good.admit(objects(&web("70000", "10.244.0.300")), &options);
        assert_eq!(port_of(&admitted), 80);
        assert_eq!(admitted.slices[0].object.endpoints[0].addresses, ["10.244.0.11"]);
        let errors: Vec<String> = admitted.errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 2, "{errors:#?}");
        assert!(
            errors[0].contains("Service default/web") && errors[0].contains("spec.ports[0].port"),
            "{errors:#?}"
        );
        assert!(errors[0].ends_with("; its last good version stays programmed"), "{errors:#?}");
        assert!(
            errors[1].contains("EndpointSlice default/web-abc")
                && errors[1].contains("endpoints[0].addresses[0]")
        );

        // Fixed: the new version is programmed.
        let admitted = last_good.admit(objects(&web("8080", "10.244.0.12")), &options);
        assert!(admitted.errors.is_empty());
        assert_eq!(port_of(&admitted), 8080);
        assert_eq!(admitted.slices[0].object.endpoints[0].addresses, ["10.244.0.12"]);
    }

    #[test]
    fn never_valid_is_passed_on_and_deleted_is_forgotten() {
        let options = ModelOptions::default();
        let mut last_good = LastGood::default();
        // Never seen valid: the model gets it (and reports it) as before.
        let admitted = last_good.admit(objects(&web("70000", "10.244.0.11")), &options);
        assert_eq!(port_of(&admitted), 70000);
        assert!(admitted.errors.is_empty(), "the model reports it, not this");
        // Invalid again in another way: still nothing valid to keep.
        let admitted = last_good.admit(objects(&web("0", "10.244.0.11")), &options);
        assert_eq!(port_of(&admitted), 0);

        let _ = last_good.admit(objects(&web("80", "10.244.0.11")), &options);
        // Gone, then back invalid: nothing to keep, the old version does not come back.
        let gone = last_good.admit(Objects { services: vec![], slices: vec![], errors: vec![] }, &options);
        assert!(gone.services.is_empty());
        let admitted = last_good.admit(objects(&web("70000", "10.244.0.11")), &options);
        assert_eq!(port_of(&admitted), 70000);
    }

    #[test]
    fn an_unchanged_object_is_not_validated_again() {
        let options = ModelOptions::default();
        let mut last_good = LastGood::default();
        let first = objects(&web("80", "10.244.0.11"));
        let services = first.services.clone();
        let _ = last_good.admit(first, &options);
        let again = Objects { services: services.clone(), slices: vec![], errors: vec![] };
        let admitted = last_good.admit(again, &options);
        assert!(Arc::ptr_eq(&admitted.services[0], &services[0]));
    }

    /// The fast path (objects at the same positions, one replaced) decides exactly as deciding every
    /// object again does: the kept version and its error stay while other objects change around it.
    #[test]
    fn a_kept_version_and_its_error_stay_while_other_objects_are_replaced() {
        let options = ModelOptions::default();
        let mut last_good = LastGood::default();
        let two = |web_port: &str, addr: &str| {
            let mut o = objects(&web(web_port, addr));
            let other = objects(&web("81", "10.244.0.21").replace("name: web", "name: zweb"));
            o.services.extend(other.services);
            o
        };
        let first = last_good.admit(two("80", "10.244.0.11"), &options);
        assert_eq!(port_of(&first), 80);
        let bad = last_good.admit(two("70000", "10.244.0.11"), &options);
        assert_eq!(port_of(&bad), 80);
        assert_eq!(bad.errors.len(), 1, "{:?}", bad.errors);
        // The next snapshot replaces the slice only: the bad Service version is the same object.
        let mut next = two("70000", "10.244.0.12");
        next.services = bad_services(&last_good);
        let again = last_good.admit(next, &options);
        assert_eq!(port_of(&again), 80, "still the last good version");
        assert_eq!(again.errors.len(), 1, "its error is still reported: {:?}", again.errors);
        assert_eq!(again.slices[0].object.endpoints[0].addresses, ["10.244.0.12"]);
    }

    fn bad_services(last_good: &LastGood) -> Vec<Arc<Sourced<Service>>> {
        last_good.services.last.iter().map(|a| Arc::clone(&a.given)).collect()
    }
}
