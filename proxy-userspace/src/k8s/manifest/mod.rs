//! Reading Service, EndpointSlice and ServiceCIDR objects from manifest files.
//!
//! Accepted input is what people keep in a repository or get from `kubectl get -o yaml|json`:
//! multi-document YAML (`---`), JSON, and list objects (`kind: List`, `ServiceList`, `EndpointSliceList`),
//! whose items are flattened. Other kinds are ignored. Every problem becomes a [`ManifestError`] that names
//! the file (and document), the object and the field; a broken document never stops the others from loading.
//!
//! [`files`] finds and reads the files (never blocking, within a size limit), [`documents`] cuts a file's text
//! into YAML or JSON documents, [`nesting`] refuses a document nested too deep before the YAML parser sees it,
//! and [`objects`] files each document as a Service, an EndpointSlice, a ServiceCIDR or a list to flatten.

mod documents;
mod files;
mod nesting;
mod objects;

use std::fmt;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

pub use documents::parse_str;
pub use files::{Listing, MAX_FILE_BYTES, list_path, load_file, load_path, read_file};
pub use nesting::MAX_NESTING;

/// An object together with where it was read from, e.g. `examples/web.yaml (document 2)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sourced<T> {
    pub origin: String,
    pub object: T,
}

/// Everything read from one or more files: the objects kproxy cares about, and what went wrong.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Objects {
    pub services: Vec<Sourced<Service>>,
    pub slices: Vec<Sourced<EndpointSlice>>,
    /// `networking.k8s.io/v1` ServiceCIDRs: the ranges whose unallocated addresses are dropped.
    pub service_cidrs: Vec<Sourced<ServiceCIDR>>,
    pub errors: Vec<ManifestError>,
}

impl Objects {
    /// Moves everything from `other` to the end of `self`.
    pub fn append(&mut self, mut other: Objects) {
        self.services.append(&mut other.services);
        self.slices.append(&mut other.slices);
        self.service_cidrs.append(&mut other.service_cidrs);
        self.errors.append(&mut other.errors);
    }
}

/// A problem in a manifest (unreadable file, broken YAML, an object that is not a valid Service...).
///
/// Displayed as `{origin}: {object}: {field}: {message}`, leaving out the parts that are absent.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub struct ManifestError {
    /// File, document and list item, e.g. `examples/web.yaml (document 2)`.
    pub origin: String,
    /// The object, e.g. `Service default/web`.
    pub object: Option<String>,
    /// The field path inside the object, e.g. `spec.ports[0].port`.
    pub field: Option<String>,
    pub message: String,
}

impl ManifestError {
    pub fn new(origin: impl Into<String>, message: impl Into<String>) -> Self {
        ManifestError { origin: origin.into(), object: None, field: None, message: message.into() }
    }

    pub fn with_object(mut self, object: impl Into<String>) -> Self {
        self.object = Some(object.into());
        self
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some(object) = &self.object {
            write!(f, ": {object}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The fixtures and helpers the tests of every part share.
#[cfg(test)]
mod test_support {
    use super::Objects;

    pub const KUBE_DNS: &str = include_str!("../../../testdata/kube-dns-service.yaml");
    pub const KUBE_DNS_SLICE: &str = include_str!("../../../testdata/kube-dns-endpointslice.yaml");

    pub fn names(objects: &Objects) -> Vec<String> {
        let services = objects.services.iter().map(|s| {
            let meta = &s.object.metadata;
            format!(
                "Service {}/{}",
                meta.namespace.as_deref().unwrap_or(""),
                meta.name.as_deref().unwrap_or("")
            )
        });
        let slices = objects.slices.iter().map(|s| {
            let meta = &s.object.metadata;
            format!(
                "Slice {}/{}",
                meta.namespace.as_deref().unwrap_or(""),
                meta.name.as_deref().unwrap_or("")
            )
        });
        services.chain(slices).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_display_leaves_out_absent_parts() {
        let err = ManifestError::new("a.yaml", "boom");
        assert_eq!(err.to_string(), "a.yaml: boom");
        assert_eq!(
            err.clone().with_object("Service default/web").to_string(),
            "a.yaml: Service default/web: boom"
        );
        assert_eq!(err.clone().with_field("spec.clusterIP").to_string(), "a.yaml: spec.clusterIP: boom");
        assert_eq!(
            err.with_object("Service default/web").with_field("spec.ports[0].port").to_string(),
            "a.yaml: Service default/web: spec.ports[0].port: boom"
        );
    }
}
