//! A file's text cut into documents: JSON (one or more values) or multi-document YAML, split by hand so that a
//! broken document never stops the others, each checked against the nesting limit before it is parsed.

use serde_json::value::RawValue;
use serde_yaml::Value;

use super::nesting::{MAX_NESTING, nesting_exceeds, too_deep};
use super::objects::{add_document, add_items, list_item_type};
use super::{ManifestError, Objects};

/// Parses one file's content; `origin` (usually the file's path) is used to name where objects came from.
///
/// JSON (content starting with `{` or `[`) is read as JSON; anything else, and JSON that serde_json
/// rejects in a file not named `*.json`, is read as (multi-document) YAML.
pub fn parse_str(text: &str, origin: &str) -> Objects {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut out = Objects::default();
    let trimmed = text.trim_start();
    if (trimmed.starts_with('{') || trimmed.starts_with('[')) && read_json(text, origin, &mut out) {
        return out;
    }
    let documents = split_yaml_documents(text);
    let numbered = documents.len() > 1;
    for (index, document) in documents.iter().enumerate() {
        read_yaml_document(document, &document_origin(origin, numbered, index + 1), &mut out);
    }
    out
}

/// Reads text that looks like JSON; false when it is to be read as YAML instead (flow-style YAML such as
/// `{kind: Service, ...}` is not JSON), which only a file not named `*.json` may be.
fn read_json(text: &str, origin: &str, out: &mut Objects) -> bool {
    let is_json_file = origin.to_ascii_lowercase().ends_with(".json");
    if let Some(line) = nesting_exceeds(text, MAX_NESTING) {
        if is_json_file {
            out.errors.push(ManifestError::new(origin, too_deep(line)));
        }
        // Too deep, it is left to the YAML reading, which reports the document.
        return is_json_file;
    }
    match parse_json_documents(text) {
        Ok(documents) => {
            let numbered = documents.len() > 1;
            for (index, document) in documents.into_iter().enumerate() {
                let doc_origin = document_origin(origin, numbered, index + 1);
                add_json_document(document, &doc_origin, out);
            }
            true
        }
        Err(err) if is_json_file => {
            out.errors.push(ManifestError::new(origin, format!("invalid JSON: {err}")));
            true
        }
        Err(_) => false,
    }
}

/// One YAML document: refused when too deep, else parsed (merge keys applied) and filed.
fn read_yaml_document(document: &Document, doc_origin: &str, out: &mut Objects) {
    if let Some(line) = nesting_exceeds(&document.text, MAX_NESTING) {
        out.errors.push(ManifestError::new(doc_origin, too_deep(document.first_line + line)));
        return;
    }
    match serde_yaml::from_str::<Value>(&document.text) {
        Ok(mut value) => {
            if let Err(err) = value.apply_merge() {
                out.errors.push(ManifestError::new(doc_origin, format!("invalid YAML: {err}")));
                return;
            }
            add_document(value, Some(document), doc_origin, out);
        }
        Err(_) => {
            // Parse again with the line numbers of the file, for the message.
            let err = match serde_yaml::from_str::<Value>(&document.padded()) {
                Err(err) => err.to_string(),
                Ok(_) => "the document cannot be parsed".to_string(),
            };
            out.errors.push(ManifestError::new(doc_origin, format!("invalid YAML: {err}")));
        }
    }
}

/// One YAML document's text and the (0-based) line of the file it starts on.
pub(super) struct Document {
    pub(super) first_line: usize,
    pub(super) text: String,
}

impl Document {
    /// The text preceded by as many empty lines as came before it, so that parser errors carry the line
    /// numbers of the file. Only built when there is an error to report.
    pub(super) fn padded(&self) -> String {
        "\n".repeat(self.first_line) + &self.text
    }
}

/// The JSON documents of a file, unparsed (syntax checked): a large List is then taken apart item by
/// item, never held as a whole tree.
fn parse_json_documents(text: &str) -> Result<Vec<&RawValue>, serde_json::Error> {
    serde_json::Deserializer::from_str(text).into_iter::<&RawValue>().collect()
}

/// What a JSON document's outside says: a list's items stay unparsed.
#[derive(serde::Deserialize)]
struct JsonOutline<'a> {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default, rename = "apiVersion")]
    api_version: Option<String>,
    #[serde(default, borrow)]
    items: Option<Vec<&'a RawValue>>,
}

fn add_json_document(document: &RawValue, origin: &str, out: &mut Objects) {
    let outline = serde_json::from_str::<JsonOutline>(document.get()).ok();
    if let Some(JsonOutline { kind: Some(kind), api_version, items: Some(items) }) = outline
        && list_item_type(&kind, api_version.as_deref().unwrap_or("")).is_some()
    {
        let items = items
            .into_iter()
            .map(|item| serde_json::from_str::<Value>(item.get()).map_err(|e| e.to_string()));
        add_items(items, origin, &kind, 0, out);
        return;
    }
    match serde_json::from_str::<Value>(document.get()) {
        Ok(value) => add_document(value, None, origin, out),
        Err(err) => out.errors.push(ManifestError::new(origin, err.to_string())),
    }
}

fn document_origin(origin: &str, numbered: bool, number: usize) -> String {
    if numbered { format!("{origin} (document {number})") } else { origin.to_string() }
}

/// Splits a YAML stream into its non-empty documents.
///
/// Each piece is a valid single-document stream. Splitting ourselves (rather than letting the YAML parser
/// iterate) lets documents after a broken one still load. A line starting with `---` followed by
/// whitespace or its end is always a document marker in YAML, even inside a block scalar.
fn split_yaml_documents(text: &str) -> Vec<Document> {
    struct Piece {
        first_line: usize,
        text: String,
        has_start_marker: bool,
        has_content: bool,
    }
    let new_piece =
        |first_line| Piece { first_line, text: String::new(), has_start_marker: false, has_content: false };
    let mut pieces = Vec::new();
    let mut current = new_piece(0);
    for (number, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches(['\n', '\r']);
        if let Some(rest) = marker_rest(bare, "---") {
            if current.has_start_marker || current.has_content {
                pieces.push(std::mem::replace(&mut current, new_piece(number)));
            }
            current.has_start_marker = true;
            current.has_content |= !is_blank(rest);
            current.text.push_str(line);
        } else if marker_rest(bare, "...").is_some_and(is_blank) {
            current.text.push_str(line);
            pieces.push(std::mem::replace(&mut current, new_piece(number + 1)));
        } else {
            if current.text.is_empty() {
                current.first_line = number;
            }
            // `%YAML` / `%TAG` directives only appear before a document's `---`.
            let directive = bare.starts_with('%') && !current.has_start_marker && !current.has_content;
            current.has_content |= !directive && !is_blank(bare);
            current.text.push_str(line);
        }
    }
    pieces.push(current);
    pieces
        .into_iter()
        .filter(|piece| piece.has_content)
        .map(|piece| Document { first_line: piece.first_line, text: piece.text })
        .collect()
}

/// For a line that is the marker (`---` or `...`) followed by nothing or whitespace, what follows it.
fn marker_rest<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(marker)?;
    (rest.is_empty() || rest.starts_with([' ', '\t'])).then_some(rest)
}

/// Whitespace, or a comment.
fn is_blank(text: &str) -> bool {
    let text = text.trim();
    text.is_empty() || text.starts_with('#')
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{KUBE_DNS, KUBE_DNS_SLICE, names};
    use super::*;

    #[test]
    fn single_service_document() {
        let objects = parse_str(KUBE_DNS, "kube-dns.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(objects.services.len(), 1);
        let svc = &objects.services[0];
        assert_eq!(svc.origin, "kube-dns.yaml");
        let spec = svc.object.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.ports.as_ref().unwrap().len(), 3);
    }

    #[test]
    fn multi_document_yaml_numbers_documents_and_skips_empty_ones() {
        let text = format!(
            "# CoreDNS\n---\n{KUBE_DNS}---\n# only a comment\n---\n\n---\n{KUBE_DNS_SLICE}...\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: coredns\n"
        );
        let objects = parse_str(&text, "dns.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(names(&objects), ["Service kube-system/kube-dns", "Slice kube-system/kube-dns-abc12"]);
        assert_eq!(objects.services[0].origin, "dns.yaml (document 1)");
        assert_eq!(objects.slices[0].origin, "dns.yaml (document 2)");
    }

    #[test]
    fn document_split_handles_directives_markers_with_content_and_crlf() {
        let text = "%YAML 1.1\n--- # the service\nkind: Service\napiVersion: v1\nmetadata: {name: a}\n--- {kind: Service, apiVersion: v1, metadata: {name: b}}\n";
        let objects = parse_str(text, "x.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(names(&objects), ["Service /a", "Service /b"]);
        assert_eq!(objects.services[1].origin, "x.yaml (document 2)");

        let crlf = format!("\u{feff}{}---\r\n{}", KUBE_DNS, KUBE_DNS_SLICE).replace('\n', "\r\n");
        let objects = parse_str(&crlf, "crlf.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(objects.services.len(), 1);
        assert_eq!(objects.slices.len(), 1);
    }

    #[test]
    fn broken_document_is_reported_and_others_still_load() {
        let text = format!(
            "{KUBE_DNS}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: [broken\n---\n{KUBE_DNS_SLICE}"
        );
        let objects = parse_str(&text, "examples/dns.yaml");
        assert_eq!(objects.services.len(), 1);
        assert_eq!(objects.slices.len(), 1);
        assert_eq!(objects.slices[0].origin, "examples/dns.yaml (document 3)");
        assert_eq!(objects.errors.len(), 1, "{:?}", objects.errors);
        let err = &objects.errors[0];
        assert_eq!(err.origin, "examples/dns.yaml (document 2)");
        assert_eq!(err.object, None);
        assert!(err.message.starts_with("invalid YAML: "), "{}", err.message);
        // Line numbers are the file's.
        let broken_line = text.lines().position(|l| l.contains("[broken")).unwrap() + 1;
        assert!(err.message.contains(&format!("line {broken_line} ")), "{} / {broken_line}", err.message);
        assert!(err.to_string().starts_with("examples/dns.yaml (document 2): invalid YAML: "));
    }

    #[test]
    fn json_object_and_json_list() {
        let json = r#"{
	"apiVersion": "v1",
	"kind": "List",
	"items": [
		{"apiVersion": "v1", "kind": "Service",
		 "metadata": {"name": "web", "namespace": "shop"},
		 "spec": {"clusterIP": "10.96.12.7", "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
		{"apiVersion": "v1", "kind": "Service",
		 "metadata": {"name": "bad", "namespace": "shop"},
		 "spec": {"ports": [{"name": "http", "port": "eighty"}]}}
	]
}"#;
        let objects = parse_str(json, "get.json");
        assert_eq!(names(&objects), ["Service shop/web"]);
        assert_eq!(objects.services[0].origin, "get.json (items[0])");
        assert_eq!(objects.errors.len(), 1);
        let err = &objects.errors[0];
        assert_eq!(err.object.as_deref(), Some("Service shop/bad"));
        assert_eq!(err.field.as_deref(), Some("spec.ports[0].port"));

        let slice = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-1","namespace":"shop","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4","endpoints":[{"addresses":["10.244.1.5"]}],"ports":[{"name":"http","port":8080}]}"#;
        let objects = parse_str(slice, "slice.json");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        assert_eq!(names(&objects), ["Slice shop/web-1"]);
        assert_eq!(objects.slices[0].origin, "slice.json");
    }

    #[test]
    fn broken_json_file_is_an_error() {
        let objects = parse_str("{\"kind\": \"Service\",", "svc.json");
        assert_eq!(objects.services.len(), 0);
        assert_eq!(objects.errors.len(), 1);
        assert_eq!(objects.errors[0].origin, "svc.json");
        assert!(objects.errors[0].message.starts_with("invalid JSON: "), "{}", objects.errors[0].message);
    }

    #[test]
    fn odd_input_never_panics() {
        for text in [
            "{",
            "[1, 2]",
            ":::",
            "---\n- [\n",
            "kind: [Service]",
            "kind: Service\nmetadata: 3\n",
            "kind: Service\napiVersion: 1\n",
            "kind: List\nitems: [1, null, {kind: 7}]\n",
            "\t\u{0}",
            "kind: Service\nmetadata: {name: [a], namespace: {}}\nspec: []\n",
            "...\n...\n---",
            "%YAML 1.2\n",
            "a: &x [*x]\n",
            "- &a [*a, *a]\n",
        ] {
            let objects = parse_str(text, "odd.yaml");
            assert!(objects.services.is_empty() && objects.slices.is_empty(), "{text:?}");
            assert!(parse_str(text, "odd.json").services.is_empty());
        }
    }

    #[test]
    fn many_documents_load_quickly() {
        let doc = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web-N\nspec:\n  clusterIP: 10.96.1.1\n  ports:\n  - port: 80\n";
        let text: String = (0..3000).map(|i| format!("---\n{}", doc.replace('N', &i.to_string()))).collect();
        let started = std::time::Instant::now();
        let objects = parse_str(&text, "many.yaml");
        assert_eq!(objects.services.len(), 3000);
        assert_eq!(objects.services[2999].origin, "many.yaml (document 3000)");
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
    }

    #[test]
    fn empty_input_yields_nothing() {
        assert_eq!(parse_str("", "empty.yaml"), Objects::default());
        assert_eq!(parse_str("---\n---\n# nothing\n", "empty.yaml"), Objects::default());
        assert_eq!(parse_str("null\n", "null.yaml"), Objects::default());
    }

    #[test]
    fn yaml_anchors_and_merge_keys() {
        let text = r#"apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  clusterIP: 10.96.12.7
  ports:
  - &http {name: http, port: 80, protocol: TCP}
  - <<: *http
    name: alt
    port: 8080
"#;
        let objects = parse_str(text, "a.yaml");
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        let ports = objects.services[0].object.spec.as_ref().unwrap().ports.as_ref().unwrap();
        assert_eq!(ports[1].port, 8080);
        assert_eq!(ports[1].protocol.as_deref(), Some("TCP"));
    }
}
