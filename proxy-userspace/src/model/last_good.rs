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
    k8s::api_watch::{Objects, Replaced},
    k8s::kept::{Kept, Slim},
    k8s::manifest::{ManifestError, Sourced},
    model::{self, ModelOptions},
};

/// The decision about one object, kept until its version changes.
struct Decision<T> {
    /// The version last seen.
    seen: Arc<Kept<T>>,
    /// The version to program: `seen` when valid (or never seen valid), else the last valid one.
    programmed: Arc<Kept<T>>,
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

fn key<T: Slim>(object: &Kept<T>) -> (String, String) {
    (object.namespace().unwrap_or_default().to_owned(), object.name().unwrap_or_default().to_owned())
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
    /// How many of `last` keep an older version (with its error): none, and no error is looked for.
    kept: usize,
}

impl<T> Default for KindState<T> {
    fn default() -> Self {
        Self { decisions: HashMap::new(), last: Vec::new(), last_had_duplicates: false, kept: 0 }
    }
}

/// One object of the last call: as given, what was programmed for it, and why that differs.
struct Admitted<T> {
    given: Arc<Kept<T>>,
    programmed: Arc<Kept<T>>,
    kept: Vec<ManifestError>,
}

impl<T> Admitted<T> {
    fn of(given: &Arc<Kept<T>>, decision: &Decision<T>) -> Self {
        Self {
            given: Arc::clone(given),
            programmed: Arc::clone(&decision.programmed),
            kept: decision.kept.clone(),
        }
    }
}

/// The decision for `object`, given the one kept for its name (if any).
fn decide<T: Slim>(
    object: &Arc<Kept<T>>,
    last: Option<Decision<T>>,
    problems: &impl Fn(&Kept<T>) -> Vec<ManifestError>,
) -> Decision<T> {
    match last {
        Some(decision) if Kept::same(&decision.seen, object) => decision,
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

impl<T: Slim> KindState<T> {
    /// Decides for each object of one kind; `problems` validates one version.
    fn admit(
        &mut self,
        objects: Vec<Arc<Kept<T>>>,
        problems: impl Fn(&Kept<T>) -> Vec<ManifestError>,
        errors: &mut Vec<ManifestError>,
    ) -> Vec<Arc<Kept<T>>> {
        if !self.admit_in_place(&objects, &problems) {
            self.admit_all(&objects, &problems);
        }
        self.kept_errors(errors);
        self.last.iter().map(|admitted| Arc::clone(&admitted.programmed)).collect()
    }

    /// Why the objects that keep an older version do.
    fn kept_errors(&self, errors: &mut Vec<ManifestError>) {
        if self.kept > 0 {
            errors.extend(self.last.iter().flat_map(|admitted| admitted.kept.iter().cloned()));
        }
    }

    /// Decides for the objects replaced at these positions of the last call's list: what to program
    /// at each. `None` when the positions are not the last call's (having decided some of them, which
    /// a whole admit decides the same way again).
    fn admit_replaced(
        &mut self,
        replaced: Vec<(usize, Arc<Kept<T>>)>,
        problems: impl Fn(&Kept<T>) -> Vec<ManifestError>,
        errors: &mut Vec<ManifestError>,
    ) -> Option<Vec<(usize, Arc<Kept<T>>)>> {
        if self.last_had_duplicates {
            return None;
        }
        let mut out = Vec::with_capacity(replaced.len());
        for (i, object) in replaced {
            let last = self.last.get(i)?;
            if object.namespace() != last.given.namespace() || object.name() != last.given.name() {
                return None;
            }
            self.replace(i, &object, &problems);
            out.push((i, Arc::clone(&self.last[i].programmed)));
        }
        self.kept_errors(errors);
        Some(out)
    }

    /// Decides again for the object now at position `i` of the last call's list (the same name).
    fn replace(
        &mut self,
        i: usize,
        object: &Arc<Kept<T>>,
        problems: &impl Fn(&Kept<T>) -> Vec<ManifestError>,
    ) {
        let k = key(object);
        let decision = decide(object, self.decisions.remove(&k), problems);
        let admitted = Admitted::of(object, &decision);
        self.kept =
            self.kept + usize::from(!admitted.kept.is_empty()) - usize::from(!self.last[i].kept.is_empty());
        self.last[i] = admitted;
        self.decisions.insert(k, decision);
    }

    /// The common case: the same names at the same positions as last time, some objects replaced.
    /// Returns false (having changed nothing) when that is not the case.
    fn admit_in_place(
        &mut self,
        objects: &[Arc<Kept<T>>],
        problems: &impl Fn(&Kept<T>) -> Vec<ManifestError>,
    ) -> bool {
        if self.last_had_duplicates || objects.len() != self.last.len() {
            return false;
        }
        let replaced: Vec<usize> =
            (0..objects.len()).filter(|&i| !Kept::same(&objects[i], &self.last[i].given)).collect();
        let same_names = replaced.iter().all(|&i| {
            let (new, old) = (&objects[i], &self.last[i].given);
            new.namespace() == old.namespace() && new.name() == old.name()
        });
        if !same_names {
            return false;
        }
        for i in replaced {
            self.replace(i, &objects[i], problems);
        }
        true
    }

    /// Decides every object again from its name, forgetting the names that are gone.
    fn admit_all(&mut self, objects: &[Arc<Kept<T>>], problems: &impl Fn(&Kept<T>) -> Vec<ManifestError>) {
        let mut previous = std::mem::take(&mut self.decisions);
        self.last.clear();
        self.last_had_duplicates = false;
        self.kept = 0;
        for object in objects {
            let k = key(object);
            let decision = decide(object, previous.remove(&k), problems);
            let admitted = Admitted::of(object, &decision);
            self.kept += usize::from(!admitted.kept.is_empty());
            self.last.push(admitted);
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
            let unseen = Arc::new(Kept::whole(Arc::new(Sourced {
                origin: String::new(),
                object: Service::default(),
            })));
            for decision in self.services.decisions.values_mut() {
                decision.seen = Arc::clone(&unseen);
            }
            let unseen = Arc::new(Kept::whole(Arc::new(Sourced {
                origin: String::new(),
                object: EndpointSlice::default(),
            })));
            for decision in self.slices.decisions.values_mut() {
                decision.seen = Arc::clone(&unseen);
            }
            // Every object is decided again.
            self.services.last.clear();
            self.slices.last.clear();
            self.options = Some(options.clone());
        }
        let Objects { services, slices, mut errors } = objects;
        // Validated decoded, only when they changed.
        let services =
            self.services.admit(services, |s| model::service_problems(&s.sourced(), options), &mut errors);
        let slices = self.slices.admit(slices, |s| model::slice_problems(&s.sourced(), options), &mut errors);
        Objects { services, slices, errors }
    }

    /// [`LastGood::admit`] for objects replaced in place at their positions of the last call's lists
    /// (see [`Changes::take_replaced`](crate::k8s::api_watch::Changes::take_replaced)): what to
    /// program at each position, and every error about a kept version. `None` when that does not
    /// follow from the last call (other options, other positions): then admit the objects whole.
    pub fn admit_replaced(&mut self, replaced: Replaced, options: &ModelOptions) -> Option<Replaced> {
        if self.options.as_ref() != Some(options) {
            return None;
        }
        let Replaced { services, slices, mut errors } = replaced;
        let services = self.services.admit_replaced(
            services,
            |s| model::service_problems(&s.sourced(), options),
            &mut errors,
        )?;
        let slices = self.slices.admit_replaced(
            slices,
            |s| model::slice_problems(&s.sourced(), options),
            &mut errors,
        )?;
        Some(Replaced { services, slices, errors })
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
            services: parsed
                .services
                .into_iter()
                .map(|s| Arc::new(Kept::compact(s.origin, s.object)))
                .collect(),
            slices: parsed.slices.into_iter().map(|s| Arc::new(Kept::compact(s.origin, s.object))).collect(),
            errors: Vec::new(),
        }
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  clusterIP: 10.96.0.100\n  ports:\n  - name: http\n    port: PORT\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abc\n  namespace: default\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nendpoints:\n- addresses: [ADDR]\nports:\n- name: http\n  port: 80\n";

    fn web(port: &str, addr: &str) -> String {
        format!("{}---\n{}", WEB.replace("PORT", port), SLICE.replace("ADDR", addr))
    }

    fn port_of(objects: &Objects) -> i32 {
        objects.services[0].sourced().object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port
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
        assert_eq!(admitted.slices[0].sourced().object.endpoints[0].addresses, ["10.244.0.11"]);
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
        assert_eq!(admitted.slices[0].sourced().object.endpoints[0].addresses, ["10.244.0.12"]);
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

        // From manifests each snapshot wraps the objects anew: the object inside is what counts.
        let parsed = manifest::parse_str(&web("80", "10.244.0.11"), "test.yaml");
        let inner = Arc::new(parsed.services.into_iter().next().unwrap());
        let wrapped = || Objects {
            services: vec![Arc::new(Kept::whole(Arc::clone(&inner)))],
            slices: vec![],
            errors: vec![],
        };
        let first = last_good.admit(wrapped(), &options);
        let again = last_good.admit(wrapped(), &options);
        assert!(Arc::ptr_eq(&again.services[0], &first.services[0]), "decided once");
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
        assert_eq!(again.slices[0].sourced().object.endpoints[0].addresses, ["10.244.0.12"]);
    }

    /// Objects replaced at their positions are decided as a whole admit decides them: the last good
    /// version stays, with its error; other options or positions are not for that path.
    #[test]
    fn objects_replaced_at_their_positions_are_decided_as_a_whole_admit_decides() {
        let options = ModelOptions::default();
        let mut last_good = LastGood::default();
        let _ = last_good.admit(objects(&web("80", "10.244.0.11")), &options);
        let bad = objects(&web("70000", "10.244.0.300"));
        let at_zero = |objects: &Objects| Replaced {
            services: vec![(0, Arc::clone(&objects.services[0]))],
            slices: vec![(0, Arc::clone(&objects.slices[0]))],
            errors: Vec::new(),
        };
        let admitted = last_good.admit_replaced(at_zero(&bad), &options).expect("the same positions");
        let port = |service: &Arc<Kept<Service>>| {
            service.sourced().object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port
        };
        assert_eq!((admitted.services[0].0, port(&admitted.services[0].1)), (0, 80), "the last good version");
        assert_eq!(admitted.slices[0].1.sourced().object.endpoints[0].addresses, ["10.244.0.11"]);
        assert_eq!(admitted.errors.len(), 2, "{:?}", admitted.errors);
        let whole = last_good.admit(
            Objects { services: bad.services.clone(), slices: bad.slices.clone(), errors: Vec::new() },
            &options,
        );
        assert!(Arc::ptr_eq(&whole.services[0], &admitted.services[0].1));
        assert_eq!(whole.errors, admitted.errors);
        // Still reported while the bad version stays, with nothing replaced.
        let nothing = Replaced { services: vec![], slices: vec![], errors: vec![] };
        assert_eq!(last_good.admit_replaced(nothing, &options).unwrap().errors.len(), 2);

        let fixed = objects(&web("81", "10.244.0.12"));
        let admitted = last_good.admit_replaced(at_zero(&fixed), &options).unwrap();
        assert_eq!(port(&admitted.services[0].1), 81);
        assert!(admitted.errors.is_empty());
        let elsewhere =
            Replaced { services: vec![(3, Arc::clone(&fixed.services[0]))], slices: vec![], errors: vec![] };
        assert!(last_good.admit_replaced(elsewhere, &options).is_none(), "a position the last call had not");
        let other = ModelOptions { node_name: Some("worker-1".into()), ..Default::default() };
        assert!(last_good.admit_replaced(at_zero(&fixed), &other).is_none(), "other options");
    }

    fn bad_services(last_good: &LastGood) -> Vec<Arc<Kept<Service>>> {
        last_good.services.last.iter().map(|a| Arc::clone(&a.given)).collect()
    }
}
