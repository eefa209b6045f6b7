//! One parsed document (or list item) filed as a Service, an EndpointSlice, a ServiceCIDR or a list to flatten,
//! or ignored; a typed object that does not deserialize is an error naming the object and the field.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::de::DeserializeOwned;
use serde_yaml::Value;
use tracing::debug;

use super::documents::Document;
use super::{ManifestError, Objects, Sourced};

/// Lists nested deeper than this are reported instead of followed.
const MAX_LIST_DEPTH: usize = 8;

/// Looks at one parsed document (or list item) and files it as a Service, an EndpointSlice, a ServiceCIDR, a list to
/// flatten, or something to ignore. `source` is the document's own text when `value` is the whole document.
pub(super) fn add_document(value: Value, source: Option<&Document>, origin: &str, out: &mut Objects) {
    add_value(value, source, origin, 0, out);
}

fn add_value(value: Value, source: Option<&Document>, origin: &str, depth: usize, out: &mut Objects) {
    match value {
        Value::Null => return,
        Value::Mapping(_) => {}
        _ => {
            debug!(origin, "ignoring a document that is not an object");
            return;
        }
    }
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
    let api_version = value.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
    let groups = Groups::of(&api_version);
    match kind.as_str() {
        "Service" if groups.core => {
            if let Some(service) = typed::<Service>(value, source, origin, &kind, &mut out.errors) {
                out.services.push(Sourced { origin: origin.to_string(), object: service });
            }
        }
        "EndpointSlice" if groups.discovery => {
            if let Some(slice) = typed::<EndpointSlice>(value, source, origin, &kind, &mut out.errors) {
                out.slices.push(Sourced { origin: origin.to_string(), object: slice });
            }
        }
        "ServiceCIDR" if groups.networking => {
            if let Some(cidr) = typed::<ServiceCIDR>(value, source, origin, &kind, &mut out.errors) {
                out.service_cidrs.push(Sourced { origin: origin.to_string(), object: cidr });
            }
        }
        _ if list_item_type(&kind, &api_version).is_some() => add_list(value, origin, &kind, depth, out),
        "" => debug!(origin, "ignoring an object without kind"),
        _ => debug!(origin, kind, api_version, "ignoring an object of another kind"),
    }
}

/// Whether `kind` (of `api_version`) is a list kproxy reads, and the kind and apiVersion its items
/// have when they carry none (typed lists as the API server returns them): `Some(None)` for `List`.
pub(super) fn list_item_type(kind: &str, api_version: &str) -> Option<Option<(&'static str, &'static str)>> {
    let groups = Groups::of(api_version);
    match kind {
        "List" if groups.core => Some(None),
        "ServiceList" if groups.core => Some(Some(("Service", "v1"))),
        "EndpointSliceList" if groups.discovery => Some(Some(("EndpointSlice", "discovery.k8s.io/v1"))),
        "ServiceCIDRList" if groups.networking => Some(Some(("ServiceCIDR", "networking.k8s.io/v1"))),
        _ => None,
    }
}

/// The API groups of the kinds kproxy reads that an `apiVersion` may name; an absent one may name any.
struct Groups {
    core: bool,
    discovery: bool,
    networking: bool,
}

impl Groups {
    fn of(api_version: &str) -> Groups {
        let any = api_version.is_empty();
        Groups {
            core: any || api_version == "v1",
            discovery: any || api_version.starts_with("discovery.k8s.io/"),
            networking: any || api_version.starts_with("networking.k8s.io/"),
        }
    }
}

fn add_list(value: Value, origin: &str, kind: &str, depth: usize, out: &mut Objects) {
    // Taken out of the list, not copied: a list can be most of a large file.
    let items = match value {
        Value::Mapping(mut list) => list.remove("items"),
        _ => None,
    };
    let items = match items {
        None | Some(Value::Null) => return,
        Some(Value::Sequence(items)) => items,
        Some(_) => {
            let err = ManifestError::new(origin, "expected a sequence of objects");
            out.errors.push(err.with_object(kind).with_field("items"));
            return;
        }
    };
    add_items(items.into_iter().map(Ok), origin, kind, depth, out);
}

/// The items of a list of `kind`, each an object or why it could not be read.
pub(super) fn add_items(
    items: impl IntoIterator<Item = Result<Value, String>>,
    origin: &str,
    kind: &str,
    depth: usize,
    out: &mut Objects,
) {
    if depth >= MAX_LIST_DEPTH {
        out.errors.push(ManifestError::new(origin, "lists nested too deeply").with_object(kind));
        return;
    }
    // Items of a typed list as the API server returns them carry no kind or apiVersion of their own.
    let item_type = list_item_type(kind, "").flatten();
    for (index, item) in items.into_iter().enumerate() {
        let item_origin = match origin.strip_suffix(')') {
            // `file (document 2)` or `file (items[1])`: add to the parenthesis we made.
            Some(open) if open.rsplit_once(" (").is_some_and(|(_, last)| is_our_suffix(last)) => {
                format!("{open}, items[{index}])")
            }
            _ => format!("{origin} (items[{index}])"),
        };
        let mut item = match item {
            Ok(item) => item,
            Err(err) => {
                out.errors.push(ManifestError::new(item_origin, err));
                continue;
            }
        };
        if let (Some((item_kind, item_api_version)), Value::Mapping(map)) = (item_type, &mut item) {
            if !map.contains_key("kind") {
                map.insert(Value::from("kind"), Value::from(item_kind));
            }
            if !map.contains_key("apiVersion") {
                map.insert(Value::from("apiVersion"), Value::from(item_api_version));
            }
        }
        add_value(item, None, &item_origin, depth + 1, out);
    }
}

/// Whether the text in an origin's last parenthesis is one that `document_origin` or [`add_list`] wrote.
fn is_our_suffix(text: &str) -> bool {
    text.starts_with("document ") || text.starts_with("items[")
}

/// Deserializes `value` into a k8s-openapi type; on failure records an error naming the object and field.
fn typed<T: DeserializeOwned + k8s_openapi::Resource>(
    value: Value,
    source: Option<&Document>,
    origin: &str,
    kind: &str,
    errors: &mut Vec<ManifestError>,
) -> Option<T> {
    let object = object_label(&value, kind);
    if let Some(api_version) = value.get("apiVersion").and_then(Value::as_str)
        && api_version != T::API_VERSION
    {
        let message = format!("apiVersion {api_version} is not supported (expected {})", T::API_VERSION);
        errors.push(ManifestError::new(origin, message).with_object(object).with_field("apiVersion"));
        return None;
    }
    match T::deserialize(&value) {
        Ok(typed) => Some(typed),
        Err(value_err) => {
            // Errors from a Value carry no field path; the text deserializer tracks it. Use the document's
            // own text when we have it (its line numbers are the file's), or the value written back out.
            let (result, keep_location) = match source {
                Some(source) => (serde_yaml::from_str::<T>(&source.padded()), true),
                None => match serde_yaml::to_string(&value) {
                    Ok(text) => (serde_yaml::from_str::<T>(&text), false),
                    Err(_) => (Err(value_err), false),
                },
            };
            match result {
                Ok(typed) => Some(typed),
                Err(err) => {
                    let (field, message) = split_yaml_error(&err, keep_location);
                    let mut error = ManifestError::new(origin, message).with_object(object);
                    error.field = field;
                    errors.push(error);
                    None
                }
            }
        }
    }
}

/// `Kind namespace/name` when metadata is readable (namespace defaulting to `default`), else the kind.
fn object_label(value: &Value, kind: &str) -> String {
    let metadata = value.get("metadata");
    let name = metadata.and_then(|m| m.get("name")).and_then(Value::as_str);
    let namespace = metadata.and_then(|m| m.get("namespace")).and_then(Value::as_str).unwrap_or("default");
    match name {
        Some(name) => format!("{kind} {namespace}/{name}"),
        None => kind.to_string(),
    }
}

/// Splits serde_yaml's `spec.ports[0].port: invalid type: ... at line 5 column 7` into the field path
/// and the message, dropping the location unless it points into the original file.
fn split_yaml_error(err: &serde_yaml::Error, keep_location: bool) -> (Option<String>, String) {
    let mut text = err.to_string();
    if !keep_location
        && err.location().is_some()
        && let Some(at) = text.rfind(" at line ")
    {
        text.truncate(at);
    }
    if let Some((path, message)) = text.split_once(": ") {
        let looks_like_path = !path.is_empty()
            && !path.contains(char::is_whitespace)
            && (path.contains(['.', '[']) || path.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        if looks_like_path {
            return (Some(path.to_string()), message.to_string());
        }
    }
    (None, text)
}

#[cfg(test)]
mod tests {
    use super::super::parse_str;
    use super::super::test_support::{KUBE_DNS, KUBE_DNS_SLICE, names};
    use super::*;

    #[test]
    fn typed_error_names_object_and_field() {
        let text = KUBE_DNS.replace("port: 9153", "port: nine-one-five-three");
        let objects = parse_str(&text, "dns.yaml");
        assert!(objects.services.is_empty());
        assert_eq!(objects.errors.len(), 1);
        let err = &objects.errors[0];
        assert_eq!(err.origin, "dns.yaml");
        assert_eq!(err.object.as_deref(), Some("Service kube-system/kube-dns"));
        assert_eq!(err.field.as_deref(), Some("spec.ports[2].port"));
        assert!(err.message.contains("invalid type: string \"nine-one-five-three\""), "{}", err.message);
        // The location points into the file.
        let line = text.lines().position(|l| l.contains("nine-one")).unwrap() + 1;
        assert!(err.message.ends_with(&format!("at line {line} column 11")), "{}", err.message);
        assert!(
            err.to_string().starts_with(
                "dns.yaml: Service kube-system/kube-dns: spec.ports[2].port: invalid type: string"
            ),
            "{err}"
        );
    }

    #[test]
    fn typed_error_without_namespace_defaults_to_default() {
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  ports: \"80\"\n";
        let objects = parse_str(text, "web.yaml");
        assert_eq!(objects.errors.len(), 1);
        let err = &objects.errors[0];
        assert_eq!(err.object.as_deref(), Some("Service default/web"));
        assert_eq!(err.field.as_deref(), Some("spec.ports"));
        assert!(err.message.starts_with("invalid type: string \"80\""), "{}", err.message);
    }

    #[test]
    fn missing_required_fields_default_to_zero_for_the_model_to_check() {
        // k8s-openapi fills absent required fields with their default; the model rejects port 0.
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\nspec:\n  ports:\n  - name: http\n";
        let objects = parse_str(text, "web.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(objects.services[0].object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port, 0);
    }

    #[test]
    fn wrong_api_version_of_endpoint_slice_is_an_error() {
        let text = KUBE_DNS_SLICE.replace("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1");
        let objects = parse_str(&text, "old.yaml");
        assert!(objects.slices.is_empty());
        assert_eq!(objects.errors.len(), 1);
        let err = &objects.errors[0];
        assert_eq!(err.object.as_deref(), Some("EndpointSlice kube-system/kube-dns-abc12"));
        assert_eq!(err.field.as_deref(), Some("apiVersion"));
        assert_eq!(
            err.message,
            "apiVersion discovery.k8s.io/v1beta1 is not supported (expected discovery.k8s.io/v1)"
        );
    }

    #[test]
    fn other_kinds_and_other_api_groups_are_ignored() {
        let text = include_str!("../../../testdata/other-kinds.yaml");
        let objects = parse_str(text, "misc.yaml");
        assert_eq!(objects, Objects::default());
    }

    #[test]
    fn kubectl_list_is_flattened() {
        let text = include_str!("../../../testdata/kubectl-get-list.yaml");
        let objects = parse_str(text, "get.yaml");
        assert_eq!(names(&objects), ["Service kube-system/kube-dns", "Slice kube-system/kube-dns-abc12"]);
        assert_eq!(objects.services[0].origin, "get.yaml (items[0])");
        assert_eq!(objects.slices[0].origin, "get.yaml (items[3])");
        assert_eq!(objects.errors.len(), 1);
        let err = &objects.errors[0];
        assert_eq!(err.origin, "get.yaml (items[2])");
        assert_eq!(err.object.as_deref(), Some("Service default/broken"));
        assert_eq!(err.field.as_deref(), Some("spec.ports[0].port"));
        assert!(!err.message.contains(" at line "), "{}", err.message);
    }

    #[test]
    fn typed_lists_supply_kind_to_their_items() {
        let text = r#"---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: a, namespace: default}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 443}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
- metadata: {name: a-xyz, namespace: default, labels: {kubernetes.io/service-name: a}}
  addressType: IPv4
  endpoints: []
"#;
        let objects = parse_str(text, "lists.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(names(&objects), ["Service default/a", "Slice default/a-xyz"]);
        assert_eq!(objects.services[0].origin, "lists.yaml (document 1, items[0])");
        assert_eq!(objects.slices[0].origin, "lists.yaml (document 2, items[0])");
    }

    #[test]
    fn nested_lists_and_origins_ending_in_a_parenthesis() {
        let text = "kind: List\napiVersion: v1\nitems:\n- kind: List\n  apiVersion: v1\n  items:\n  - {kind: Service, apiVersion: v1, metadata: {name: a}}\n";
        let objects = parse_str(text, "svc (copy)");
        assert_eq!(objects.services[0].origin, "svc (copy) (items[0], items[0])");
        let objects = parse_str(&format!("---\n{text}---\n{text}"), "lists.yaml");
        assert_eq!(objects.services[1].origin, "lists.yaml (document 2, items[0], items[0])");
    }

    #[test]
    fn list_with_bad_items_field() {
        let objects = parse_str("apiVersion: v1\nkind: List\nitems: 3\n", "l.yaml");
        assert_eq!(objects.errors.len(), 1);
        assert_eq!(objects.errors[0].to_string(), "l.yaml: List: items: expected a sequence of objects");
        let objects = parse_str("apiVersion: v1\nkind: List\nitems: []\n", "l.yaml");
        assert_eq!(objects, Objects::default());
    }

    /// JSON lists are read item by item (never held whole); typed lists still give their items a
    /// kind, and a list whose items are not a sequence is reported as in YAML.
    #[test]
    fn json_typed_lists_several_documents_and_bad_items() {
        let json = r#"{"apiVersion": "v1", "kind": "ServiceList", "items": [
            {"metadata": {"name": "a", "namespace": "default"}, "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 443}]}}]}
{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "items": [
            {"metadata": {"name": "a-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "a"}},
             "addressType": "IPv4", "endpoints": []}]}
{"apiVersion": "v1", "kind": "List", "items": {"not": "a sequence"}}"#;
        let objects = parse_str(json, "lists.json");
        assert_eq!(names(&objects), ["Service default/a", "Slice default/a-1"]);
        assert_eq!(objects.services[0].origin, "lists.json (document 1, items[0])");
        assert_eq!(objects.slices[0].origin, "lists.json (document 2, items[0])");
        assert_eq!(objects.errors.len(), 1);
        assert_eq!(
            objects.errors[0].to_string(),
            "lists.json (document 3): List: items: expected a sequence of objects"
        );
    }

    #[test]
    fn split_error_paths() {
        let err = serde_yaml::from_str::<Service>("kind: Service\nspec:\n  clusterIP: [1]\n").unwrap_err();
        let (field, message) = split_yaml_error(&err, false);
        assert_eq!(field.as_deref(), Some("spec.clusterIP"));
        assert!(message.starts_with("invalid type: sequence"), "{message}");
        assert!(!message.contains("line"), "{message}");
        let err = serde_yaml::from_str::<Service>("kind: Pod\n").unwrap_err();
        let (field, message) = split_yaml_error(&err, false);
        assert_eq!(field, None);
        assert!(message.starts_with("invalid value: string \"Pod\""), "{message}");
    }
}
