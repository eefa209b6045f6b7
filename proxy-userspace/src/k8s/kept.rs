//! Objects as the agent keeps them between syncs. A Service or EndpointSlice decoded from the API
//! server is held as the JSON of what the model reads of it — about a tenth of the decoded object
//! (an EndpointSlice `Endpoint` alone is some 340 bytes before its strings, a labels map 540) and one
//! allocation instead of dozens — and decoded again only when the model looks at it: a sync decodes
//! the objects that changed (all of them only on a full rebuild). Objects from manifests stay whole
//! and shared: the manifests source keeps them anyway, for its per-file last good versions.
//!
//! What is left out never reaches the model: `managedFields` and the rest of `metadata` but the name,
//! namespace, the labels ([`KEPT_LABELS`]) and the annotation ([`KEPT_ANNOTATIONS`]) it reads; a
//! Service's `spec.selector` and `status.conditions`; an endpoint's `targetRef`, `hostname` and
//! `deprecatedTopology`. The `resourceVersion` stays in the origin, which error messages name.

use std::{collections::BTreeMap, marker::PhantomData, sync::Arc};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Serialize, de::DeserializeOwned};

use crate::k8s::{
    ANNOTATION_LAST_CHANGE_TRIGGER_TIME, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
    manifest::Sourced,
};

/// The labels the model reads (the selectors of the watches read the others on the server).
pub const KEPT_LABELS: [&str; 3] = [LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, LABEL_HEADLESS];
/// The annotations the model reads.
pub const KEPT_ANNOTATIONS: [&str; 1] = [ANNOTATION_LAST_CHANGE_TRIGGER_TIME];

/// A Service or EndpointSlice as kept between syncs, with the identity the sync loop groups and
/// matches objects by (namespace, name, the Service a slice names) read without decoding.
pub struct Kept<T> {
    form: Form<T>,
}

enum Form<T> {
    /// Shared with the source that read it (manifests): its identity is read from the object.
    Whole(Arc<Sourced<T>>),
    /// The object's JSON, as written from its decoded form by [`Kept::compact`].
    Encoded(Encoded<T>),
}

/// The JSON, then the namespace, the name, the `kubernetes.io/service-name` label and the origin, in
/// one allocation: six of their own were 3 MiB of the agent's 64 at 10k Services (20k objects).
struct Encoded<T> {
    text: Box<str>,
    /// Where each of the five ends in `text`.
    ends: [u32; 5],
    /// Which of namespace, name and label (bits 0, 1, 2) the object has.
    present: u8,
    kind: PhantomData<fn() -> T>,
}

impl<T> Encoded<T> {
    const JSON: usize = 0;
    const NAMESPACE: usize = 1;
    const NAME: usize = 2;
    const SERVICE_NAME: usize = 3;
    const ORIGIN: usize = 4;

    /// `None` for an object too large to index with `u32`s (the API server's limit is some MiB).
    fn new(
        json: &str,
        namespace: Option<&str>,
        name: Option<&str>,
        service_name: Option<&str>,
        origin: &str,
    ) -> Option<Self> {
        let parts = [Some(json), namespace, name, service_name, Some(origin)];
        let mut text = String::with_capacity(parts.iter().flatten().map(|p| p.len()).sum());
        let mut ends = [0; 5];
        let mut present = 0;
        for (i, part) in parts.iter().enumerate() {
            if let Some(part) = part {
                text.push_str(part);
                if (Self::NAMESPACE..=Self::SERVICE_NAME).contains(&i) {
                    present |= 1 << (i - Self::NAMESPACE);
                }
            }
            ends[i] = u32::try_from(text.len()).ok()?;
        }
        Some(Self { text: text.into_boxed_str(), ends, present, kind: PhantomData })
    }

    fn part(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.text[start..self.ends[i] as usize]
    }

    fn optional(&self, i: usize) -> Option<&str> {
        (self.present & (1 << (i - Self::NAMESPACE)) != 0).then(|| self.part(i))
    }
}

/// What the model never reads of an object: removed before it is kept.
pub trait Slim {
    fn slim(&mut self);
    fn metadata(&self) -> &ObjectMeta;
}

fn slim_metadata(meta: &mut ObjectMeta) {
    let keep = |map: Option<BTreeMap<String, String>>, keys: &[&str]| {
        let kept: BTreeMap<String, String> =
            map.into_iter().flatten().filter(|(key, _)| keys.contains(&key.as_str())).collect();
        (!kept.is_empty()).then_some(kept)
    };
    *meta = ObjectMeta {
        name: meta.name.take(),
        namespace: meta.namespace.take(),
        labels: keep(meta.labels.take(), &KEPT_LABELS),
        annotations: keep(meta.annotations.take(), &KEPT_ANNOTATIONS),
        ..Default::default()
    };
}

impl Slim for Service {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
        if let Some(spec) = self.spec.as_mut() {
            spec.selector = None;
        }
        if let Some(status) = self.status.as_mut() {
            status.conditions = None;
        }
    }

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
}

impl Slim for EndpointSlice {
    fn slim(&mut self) {
        slim_metadata(&mut self.metadata);
        for endpoint in &mut self.endpoints {
            endpoint.target_ref = None;
            endpoint.hostname = None;
            endpoint.deprecated_topology = None;
        }
    }

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
}

impl<T: Slim + Serialize + DeserializeOwned> Kept<T> {
    /// `object` without what the model never reads, encoded; kept whole should it not encode.
    pub fn compact(origin: String, mut object: T) -> Self {
        object.slim();
        let encoded = serde_json::to_string(&object).ok().and_then(|json| {
            let meta = object.metadata();
            Encoded::new(
                &json,
                meta.namespace.as_deref(),
                meta.name.as_deref(),
                label(meta, LABEL_SERVICE_NAME),
                &origin,
            )
        });
        let form = match encoded {
            Some(encoded) => Form::Encoded(encoded),
            None => Form::Whole(Arc::new(Sourced { origin, object })),
        };
        Self { form }
    }

    /// The object as the model reads it (decoded afresh when kept encoded).
    pub fn sourced(&self) -> Arc<Sourced<T>> {
        match &self.form {
            Form::Whole(object) => Arc::clone(object),
            Form::Encoded(encoded) => {
                let object = serde_json::from_str(encoded.part(Encoded::<T>::JSON))
                    .expect("the JSON of a decoded object decodes again (it was written from one)");
                Arc::new(Sourced { origin: encoded.part(Encoded::<T>::ORIGIN).to_owned(), object })
            }
        }
    }
}

fn label<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.labels.as_ref().and_then(|labels| labels.get(key)).map(String::as_str)
}

impl<T: Slim> Kept<T> {
    /// An object kept whole, shared with its source.
    pub fn whole(object: Arc<Sourced<T>>) -> Self {
        Self { form: Form::Whole(object) }
    }

    /// `metadata.namespace`.
    pub fn namespace(&self) -> Option<&str> {
        match &self.form {
            Form::Whole(object) => object.object.metadata().namespace.as_deref(),
            Form::Encoded(encoded) => encoded.optional(Encoded::<T>::NAMESPACE),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> Option<&str> {
        match &self.form {
            Form::Whole(object) => object.object.metadata().name.as_deref(),
            Form::Encoded(encoded) => encoded.optional(Encoded::<T>::NAME),
        }
    }

    /// The `kubernetes.io/service-name` label (an EndpointSlice's Service).
    pub fn service_name(&self) -> Option<&str> {
        match &self.form {
            Form::Whole(object) => label(object.object.metadata(), LABEL_SERVICE_NAME),
            Form::Encoded(encoded) => encoded.optional(Encoded::<T>::SERVICE_NAME),
        }
    }

    /// Where the object was read, as error messages name it.
    pub fn origin(&self) -> &str {
        match &self.form {
            Form::Whole(object) => &object.origin,
            Form::Encoded(encoded) => encoded.part(Encoded::<T>::ORIGIN),
        }
    }
}

impl<T> Kept<T> {
    /// Whether `a` and `b` are the same version of an object: the same handle, or kept whole from
    /// the same one (the manifests source shares an unchanged object from one snapshot to the next,
    /// each in a wrapper of its own).
    pub fn same(a: &Arc<Self>, b: &Arc<Self>) -> bool {
        match (&a.form, &b.form) {
            (Form::Whole(a), Form::Whole(b)) => Arc::ptr_eq(a, b),
            _ => Arc::ptr_eq(a, b),
        }
    }
}

/// Objects a kind's map takes: kept ones, or whole ones (shared with their source).
pub trait IntoKept<T> {
    fn into_kept(self) -> Arc<Kept<T>>;
}

impl<T> IntoKept<T> for Arc<Kept<T>> {
    fn into_kept(self) -> Arc<Kept<T>> {
        self
    }
}

impl<T: Slim> IntoKept<T> for Arc<Sourced<T>> {
    fn into_kept(self) -> Arc<Kept<T>> {
        Arc::new(Kept::whole(self))
    }
}

/// Every object decoded, in the same order (for a whole build of the model).
pub fn decoded<T: Slim + Serialize + DeserializeOwned>(objects: &[Arc<Kept<T>>]) -> Vec<Arc<Sourced<T>>> {
    objects.iter().map(|object| object.sourced()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLICE: &str = r#"{"metadata":{"name":"web-abc","namespace":"default","uid":"1e4c","resourceVersion":"17",
        "generateName":"web-","ownerReferences":[{"apiVersion":"v1","kind":"Service","name":"web","uid":"9f2"}],
        "labels":{"kubernetes.io/service-name":"web","endpointslice.kubernetes.io/managed-by":"endpointslice-controller.k8s.io"},
        "annotations":{"endpoints.kubernetes.io/last-change-trigger-time":"2026-12-02T03:00:00Z","other":"x"},
        "managedFields":[{"manager":"kube-controller-manager","operation":"Update"}]},
        "addressType":"IPv4",
        "endpoints":[{"addresses":["10.244.0.11"],"conditions":{"ready":true,"serving":true,"terminating":false},
          "nodeName":"worker-1","zone":"a","hostname":"web-0","hints":{"forZones":[{"name":"a"}]},
          "targetRef":{"kind":"Pod","name":"web-0","namespace":"default","uid":"77"}}],
        "ports":[{"name":"http","port":8080,"protocol":"TCP"}]}"#;

    /// What the model reads comes back as it was; the rest is gone.
    #[test]
    fn a_kept_slice_decodes_to_what_the_model_reads() {
        let object: EndpointSlice = serde_json::from_str(SLICE).unwrap();
        let kept = Kept::compact("api-server EndpointSlice (resourceVersion 17)".to_owned(), object.clone());
        assert_eq!(
            (kept.namespace(), kept.name(), kept.service_name()),
            (Some("default"), Some("web-abc"), Some("web"))
        );
        let back = kept.sourced();
        assert_eq!(back.origin, "api-server EndpointSlice (resourceVersion 17)");
        let mut expected = object;
        expected.metadata = ObjectMeta {
            name: expected.metadata.name,
            namespace: expected.metadata.namespace,
            labels: Some([("kubernetes.io/service-name".to_owned(), "web".to_owned())].into()),
            annotations: Some(
                [(ANNOTATION_LAST_CHANGE_TRIGGER_TIME.to_owned(), "2026-12-02T03:00:00Z".to_owned())].into(),
            ),
            ..Default::default()
        };
        let endpoint = &mut expected.endpoints[0];
        (endpoint.target_ref, endpoint.hostname) = (None, None);
        assert_eq!(back.object, expected);
        assert!(back.object.endpoints[0].hints.is_some() && back.object.endpoints[0].zone.is_some());
    }

    /// An object without a namespace or the label reads as one: `None`, not an empty string.
    #[test]
    fn a_kept_object_without_a_namespace_or_label_has_none() {
        let object: EndpointSlice =
            serde_json::from_str(r#"{"metadata":{"name":"orphan"},"addressType":"IPv4","endpoints":[]}"#)
                .unwrap();
        let kept = Kept::compact("api-server EndpointSlice (resourceVersion 3)".to_owned(), object);
        assert_eq!((kept.namespace(), kept.name(), kept.service_name()), (None, Some("orphan"), None));
        assert_eq!(kept.origin(), "api-server EndpointSlice (resourceVersion 3)");
        assert_eq!(kept.sourced().object.metadata.name.as_deref(), Some("orphan"));
        let object: EndpointSlice = serde_json::from_str(
            r#"{"metadata":{"namespace":"","labels":{"kubernetes.io/service-name":""}},"addressType":"IPv4","endpoints":[]}"#,
        )
        .unwrap();
        let kept = Kept::compact(String::new(), object);
        assert_eq!((kept.namespace(), kept.name(), kept.service_name()), (Some(""), None, Some("")));
        assert_eq!(kept.origin(), "");
    }

    #[test]
    fn a_kept_service_keeps_its_spec_and_load_balancer_status() {
        let text = r#"{"metadata":{"name":"shop","namespace":"default","labels":{"app":"shop","service.kubernetes.io/service-proxy-name":"kproxy"},
            "annotations":{"kubectl.kubernetes.io/last-applied-configuration":"{}"}},
            "spec":{"type":"LoadBalancer","clusterIP":"10.96.0.200","clusterIPs":["10.96.0.200"],"selector":{"app":"shop"},
              "externalTrafficPolicy":"Local","healthCheckNodePort":32000,"sessionAffinity":"ClientIP",
              "sessionAffinityConfig":{"clientIP":{"timeoutSeconds":60}},"loadBalancerSourceRanges":["10.0.0.0/8"],
              "ports":[{"name":"http","port":80,"protocol":"TCP","targetPort":"web","nodePort":30080}]},
            "status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.10","ipMode":"VIP"}]},"conditions":[]}}"#;
        let object: Service = serde_json::from_str(text).unwrap();
        let back = Kept::compact("test".to_owned(), object.clone()).sourced();
        let mut expected = object;
        expected.metadata.annotations = None;
        expected.metadata.labels = Some([(LABEL_SERVICE_PROXY_NAME.to_owned(), "kproxy".to_owned())].into());
        expected.spec.as_mut().unwrap().selector = None;
        expected.status.as_mut().unwrap().conditions = None;
        assert_eq!(back.object, expected);
    }
}
