//! What the cluster says: Services and EndpointSlices read from manifest files ([`manifest`],
//! [`manifest_watch`]) or watched on the API server ([`api_watch`]), with the labels and annotations
//! kproxy reads, and where the API server is ([`api_endpoint`]). It knows nothing of the agent: health
//! follows the watchers from outside.

pub mod api_endpoint;
pub mod api_watch;
pub mod kept;
pub mod manifest;
pub mod manifest_watch;
pub mod time;

/// EndpointSlice label naming the Service the slice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Objects with this label (any value) are headless; no proxy programs them.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Objects with this label belong to the service proxy it names; see [`ModelOptions::service_proxy_name`].
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// EndpointSlice annotation: when the change that led to this version of the slice happened (RFC 3339).
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
