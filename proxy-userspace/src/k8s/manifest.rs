//! Reading Service, EndpointSlice and ServiceCIDR objects from manifest files.
//!
//! Accepted input is what people keep in a repository or get from `kubectl get -o yaml|json`:
//! multi-document YAML (`---`), JSON, and list objects (`kind: List`, `ServiceList`, `EndpointSliceList`),
//! whose items are flattened. Other kinds are ignored. Every problem becomes a [`ManifestError`] that names
//! the file (and document), the object and the field; a broken document never stops the others from loading.

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use serde_yaml::Value;
use tracing::debug;

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

/// File name endings that are read when walking a directory.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// Lists nested deeper than this are reported instead of followed.
const MAX_LIST_DEPTH: usize = 8;

/// A larger file is reported, not read: Services and EndpointSlices for a large cluster fit many times over.
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// Collections nested deeper than this are reported before the YAML parser sees them: a real manifest nests about
/// ten levels, and the parser spends time quadratic in the depth of flow collections (`{a: {a: ...` 50,000 deep took
/// 43 s) before its own recursion limit (128) applies.
pub const MAX_NESTING: usize = 100;

/// The files a manifests path names: the path itself when it is not a directory, else every `*.yaml`, `*.yml` and
/// `*.json` below it, sorted by path, each with what `stat` (following links) said of it.
#[derive(Debug, Default)]
pub struct Listing {
    pub files: Vec<(PathBuf, fs::Metadata)>,
    /// Directories and entries below the path that could not be read: what they hold is unknown.
    pub unreadable: Vec<(PathBuf, ManifestError)>,
}

/// Reads a file, or every `*.yaml`, `*.yml` and `*.json` below a directory (recursively, sorted by path).
///
/// An explicitly named file is read whatever its name. Entries whose name starts with `.` are skipped while
/// walking, which also keeps the `..data` / `..2025_01_01...` directories of a mounted ConfigMap from being
/// read a second time. An unreadable path becomes an error in [`Objects::errors`].
pub fn load_path(path: &Path) -> Objects {
    let mut out = Objects::default();
    let listing = match list_path(path) {
        Ok(listing) => listing,
        Err(err) => {
            out.errors.push(err);
            return out;
        }
    };
    out.errors.extend(listing.unreadable.into_iter().map(|(_, err)| err));
    for (file, _) in listing.files {
        out.append(load_file(&file));
    }
    out
}

/// What [`load_path`] reads, without reading it. An error when the path itself cannot be read.
pub fn list_path(path: &Path) -> Result<Listing, ManifestError> {
    let meta =
        fs::metadata(path).map_err(|err| ManifestError::new(path.display().to_string(), err.to_string()))?;
    let mut listing = Listing::default();
    if !meta.is_dir() {
        listing.files.push((path.to_path_buf(), meta));
        return Ok(listing);
    }
    // The path itself must be listable: a directory that cannot be read says nothing about what it holds.
    fs::read_dir(path).map_err(|err| ManifestError::new(path.display().to_string(), err.to_string()))?;
    let mut visited = HashSet::new();
    collect_files(path, &mut listing, &mut visited);
    listing.files.sort_by(|a, b| a.0.cmp(&b.0));
    listing.files.dedup_by(|a, b| a.0 == b.0);
    Ok(listing)
}

/// Reads and parses one file (see [`read_file`] and [`parse_str`]).
pub fn load_file(path: &Path) -> Objects {
    match read_file(path) {
        Ok(text) => parse_str(&text, &path.display().to_string()),
        Err(err) => Objects { errors: vec![err], ..Default::default() },
    }
}

/// A file's text, read without ever blocking: only a regular file is opened (a FIFO, socket or device named
/// `*.yaml` is an error naming it), with `O_NONBLOCK` so that one swapped in after the check cannot hold `open()`,
/// and checked again on the open descriptor; at most [`MAX_FILE_BYTES`]; UTF-8.
pub fn read_file(path: &Path) -> Result<String, ManifestError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;

    let error = |message: String| ManifestError::new(path.display().to_string(), message);
    let check = |meta: &fs::Metadata| -> Result<(), ManifestError> {
        if let Some(kind) = not_regular(meta) {
            return Err(error(format!("not a regular file ({kind}); it is not read")));
        }
        if meta.len() > MAX_FILE_BYTES {
            let message =
                format!("{} bytes, over the limit of {MAX_FILE_BYTES} bytes; it is not read", meta.len());
            return Err(error(message));
        }
        Ok(())
    };
    check(&fs::metadata(path).map_err(|err| error(err.to_string()))?)?;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|err| error(err.to_string()))?;
    let meta = file.metadata().map_err(|err| error(err.to_string()))?;
    check(&meta)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|err| error(err.to_string()))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(error(format!(
            "grew over the limit of {MAX_FILE_BYTES} bytes while being read; it is not read"
        )));
    }
    String::from_utf8(bytes).map_err(|err| error(format!("not UTF-8 text: {err}")))
}

/// What a file that is not a regular file is, for messages.
fn not_regular(meta: &fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt as _;
    let kind = meta.file_type();
    match () {
        _ if kind.is_file() => None,
        _ if kind.is_dir() => Some("a directory"),
        _ if kind.is_fifo() => Some("a FIFO"),
        _ if kind.is_socket() => Some("a socket"),
        _ if kind.is_char_device() => Some("a character device"),
        _ if kind.is_block_device() => Some("a block device"),
        _ => Some("not a file"),
    }
}

fn collect_files(dir: &Path, listing: &mut Listing, visited: &mut HashSet<PathBuf>) {
    // Symbolic links are followed; remembering canonical directories stops link loops.
    let canonical = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    if !visited.insert(canonical) {
        return;
    }
    let unreadable = |path: &Path, err: std::io::Error| {
        (path.to_path_buf(), ManifestError::new(path.display().to_string(), err.to_string()))
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) => {
            listing.unreadable.push(unreadable(dir, err));
            return;
        }
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(err) => {
                listing.unreadable.push(unreadable(dir, err));
                continue;
            }
        };
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(err) => {
                // A dangling link may stand for a directory or a manifest; a stray file is not worth a word.
                if has_manifest_extension(&path)
                    || entry.file_type().is_ok_and(|t| t.is_dir() || t.is_symlink())
                {
                    listing.unreadable.push(unreadable(&path, err));
                }
                continue;
            }
        };
        if meta.is_dir() {
            collect_files(&path, listing, visited);
        } else if has_manifest_extension(&path) {
            listing.files.push((path, meta));
        }
    }
}

fn has_manifest_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|ext| ext.to_str())
        .is_some_and(|ext| EXTENSIONS.iter().any(|known| ext.eq_ignore_ascii_case(known)))
}

/// Parses one file's content; `origin` (usually the file's path) is used to name where objects came from.
///
/// JSON (content starting with `{` or `[`) is read as JSON; anything else, and JSON that serde_json
/// rejects in a file not named `*.json`, is read as (multi-document) YAML.
pub fn parse_str(text: &str, origin: &str) -> Objects {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut out = Objects::default();
    let trimmed = text.trim_start();
    let is_json_file = origin.to_ascii_lowercase().ends_with(".json");
    let too_deep_json = (trimmed.starts_with('{') || trimmed.starts_with('['))
        .then(|| nesting_exceeds(text, MAX_NESTING))
        .flatten();
    if let Some(line) = too_deep_json
        && is_json_file
    {
        out.errors.push(ManifestError::new(origin, too_deep(line)));
        return out;
    }
    // Too deep, it is left to the YAML reading, which reports the document.
    if (trimmed.starts_with('{') || trimmed.starts_with('[')) && too_deep_json.is_none() {
        match parse_json_documents(text) {
            Ok(documents) => {
                let numbered = documents.len() > 1;
                for (index, document) in documents.into_iter().enumerate() {
                    let doc_origin = document_origin(origin, numbered, index + 1);
                    add_json_document(document, &doc_origin, &mut out);
                }
                return out;
            }
            Err(err) if is_json_file => {
                out.errors.push(ManifestError::new(origin, format!("invalid JSON: {err}")));
                return out;
            }
            // Flow-style YAML such as `{kind: Service, ...}` is not JSON; let the YAML parser try.
            Err(_) => {}
        }
    }
    let documents = split_yaml_documents(text);
    let numbered = documents.len() > 1;
    for (index, document) in documents.iter().enumerate() {
        let doc_origin = document_origin(origin, numbered, index + 1);
        if let Some(line) = nesting_exceeds(&document.text, MAX_NESTING) {
            out.errors.push(ManifestError::new(doc_origin, too_deep(document.first_line + line)));
            continue;
        }
        match serde_yaml::from_str::<Value>(&document.text) {
            Ok(mut value) => {
                if let Err(err) = value.apply_merge() {
                    out.errors.push(ManifestError::new(doc_origin, format!("invalid YAML: {err}")));
                    continue;
                }
                add_document(value, Some(document), &doc_origin, &mut out);
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
    out
}

fn too_deep(line: usize) -> String {
    format!(
        "collections nested more than {MAX_NESTING} levels deep (at line {line}); the document is not parsed"
    )
}

/// The first line (1-based, of `text`) at which collections nest more than `limit` levels deep, found in one pass:
/// block levels (indentation, `- ` entries) plus flow levels (`[`, `{`), outside quoted scalars, comments and block
/// scalars, which it finds where YAML's rules let them begin (a quote opens a quoted scalar only where a node may
/// start, not inside or on the continuation line of a plain scalar). Where it is unsure it counts a level (a bracket
/// in a plain scalar does), so a document it passes does not nest deeper than `limit` for the parser.
fn nesting_exceeds(text: &str, limit: usize) -> Option<usize> {
    let is_space = |b: Option<&u8>| b.is_none_or(|b| *b == b' ' || *b == b'\t');
    // Block levels, by indentation column.
    let mut indents: Vec<usize> = Vec::new();
    let mut block_depth = 0;
    let mut flow = 0usize;
    let mut quote: Option<u8> = None;
    // Lines more indented than this column (and blank ones) are a block scalar's content.
    let mut block_scalar: Option<usize> = None;
    // A plain scalar ran to the end of a line of this indentation: a more indented line continues it.
    let mut plain_from: Option<usize> = None;
    for (number, line) in text.lines().enumerate() {
        let bytes = line.as_bytes();
        let indent = bytes.iter().take_while(|&&b| b == b' ').count();
        let blank = bytes[indent..].iter().all(u8::is_ascii_whitespace);
        if let Some(parent) = block_scalar {
            if blank || indent > parent {
                continue;
            }
            block_scalar = None;
        }
        let mut at = 0;
        // Where a node may begin: a quote there opens a quoted scalar, `|` or `>` a block scalar.
        let mut node_start = true;
        let mut in_plain = false;
        // The column of the collection a block scalar begun on this line would belong to.
        let mut scalar_parent = indent;
        let mut line_plain_from = indent;
        if quote.is_none() && flow == 0 {
            if blank {
                continue;
            }
            if bytes[indent] == b'#' {
                plain_from = None;
                continue;
            }
            match plain_from {
                Some(from) if indent > from => {
                    node_start = false;
                    in_plain = true;
                    line_plain_from = from;
                }
                _ => {
                    while indents.last().is_some_and(|&top| top >= indent) {
                        indents.pop();
                    }
                    // The collections this line is inside of; its own (a sequence entry, a mapping key) count below.
                    block_depth = indents.len();
                    indents.push(indent);
                    at = indent;
                    // `- - - x`: each entry indicator opens a level on the same line.
                    while matches!(bytes.get(at), Some(b'-' | b'?')) && is_space(bytes.get(at + 1)) {
                        block_depth += 1;
                        scalar_parent = at;
                        at += 1;
                        while matches!(bytes.get(at), Some(b' ' | b'\t')) {
                            at += 1;
                        }
                    }
                    if block_depth > limit {
                        return Some(number + 1);
                    }
                }
            }
        }
        // The column the current block node starts at (a key, for `key: |`).
        let mut node_column = at;
        let mut key_counted = false;
        while at < bytes.len() {
            let b = bytes[at];
            match quote {
                Some(b'\'') => {
                    if b == b'\'' {
                        if bytes.get(at + 1) == Some(&b'\'') {
                            at += 1;
                        } else {
                            quote = None;
                            node_start = false;
                        }
                    }
                }
                Some(_) => {
                    if b == b'\\' {
                        at += 1;
                    } else if b == b'"' {
                        quote = None;
                        node_start = false;
                    }
                }
                None => match b {
                    b' ' | b'\t' => {}
                    b'#' if at == 0 || matches!(bytes[at - 1], b' ' | b'\t') => {
                        in_plain = false;
                        break;
                    }
                    b'\'' | b'"' if node_start => {
                        quote = Some(b);
                        in_plain = false;
                    }
                    // An anchor or a tag comes before the node it names.
                    b'&' | b'!' if node_start => {
                        while at + 1 < bytes.len()
                            && !matches!(bytes[at + 1], b' ' | b'\t' | b',' | b'[' | b']' | b'{' | b'}')
                        {
                            at += 1;
                        }
                    }
                    b'*' if node_start => {
                        node_start = false;
                        in_plain = false;
                        while at + 1 < bytes.len()
                            && !matches!(bytes[at + 1], b' ' | b'\t' | b',' | b'[' | b']' | b'{' | b'}')
                        {
                            at += 1;
                        }
                    }
                    b'[' | b'{' => {
                        flow += 1;
                        if block_depth + flow > limit {
                            return Some(number + 1);
                        }
                        node_start = true;
                        in_plain = false;
                    }
                    b']' | b'}' => {
                        flow = flow.saturating_sub(1);
                        node_start = false;
                        in_plain = false;
                    }
                    b',' if flow > 0 => {
                        node_start = true;
                        in_plain = false;
                    }
                    b':' | b'-' | b'?' if is_space(bytes.get(at + 1)) => {
                        if b == b':' && flow == 0 {
                            scalar_parent = node_column;
                            if !key_counted {
                                key_counted = true;
                                block_depth += 1;
                                if block_depth > limit {
                                    return Some(number + 1);
                                }
                            }
                        }
                        node_start = true;
                        in_plain = false;
                    }
                    b'|' | b'>' if node_start && flow == 0 => {
                        let header = &line[at + 1..];
                        let header = header.split_once(" #").map_or(header, |(h, _)| h).trim_end();
                        if header.bytes().all(|b| b == b'+' || b == b'-' || b.is_ascii_digit()) {
                            block_scalar = Some(scalar_parent);
                            in_plain = false;
                            break;
                        }
                        node_start = false;
                        in_plain = true;
                    }
                    _ => {
                        if node_start && !in_plain {
                            node_column = at;
                        }
                        node_start = false;
                        in_plain = true;
                    }
                },
            }
            at += 1;
        }
        plain_from = (in_plain && quote.is_none() && flow == 0).then_some(line_plain_from);
    }
    None
}

/// One YAML document's text and the (0-based) line of the file it starts on.
struct Document {
    first_line: usize,
    text: String,
}

impl Document {
    /// The text preceded by as many empty lines as came before it, so that parser errors carry the line
    /// numbers of the file. Only built when there is an error to report.
    fn padded(&self) -> String {
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

/// Looks at one parsed document (or list item) and files it as a Service, an EndpointSlice, a list to
/// flatten, or something to ignore. `source` is the document's own text when `value` is the whole document.
fn add_document(value: Value, source: Option<&Document>, origin: &str, out: &mut Objects) {
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
    let core = api_version.is_empty() || api_version == "v1";
    let discovery = api_version.is_empty() || api_version.starts_with("discovery.k8s.io/");
    let networking = api_version.is_empty() || api_version.starts_with("networking.k8s.io/");
    match kind.as_str() {
        "Service" if core => {
            if let Some(service) = typed::<Service>(value, source, origin, &kind, &mut out.errors) {
                out.services.push(Sourced { origin: origin.to_string(), object: service });
            }
        }
        "EndpointSlice" if discovery => {
            if let Some(slice) = typed::<EndpointSlice>(value, source, origin, &kind, &mut out.errors) {
                out.slices.push(Sourced { origin: origin.to_string(), object: slice });
            }
        }
        "ServiceCIDR" if networking => {
            if let Some(cidr) = typed::<ServiceCIDR>(value, source, origin, &kind, &mut out.errors) {
                out.service_cidrs.push(Sourced { origin: origin.to_string(), object: cidr });
            }
        }
        "List" | "ServiceList" if core => add_list(value, origin, &kind, depth, out),
        "EndpointSliceList" if discovery => add_list(value, origin, &kind, depth, out),
        "ServiceCIDRList" if networking => add_list(value, origin, &kind, depth, out),
        "" => debug!(origin, "ignoring an object without kind"),
        _ => debug!(origin, kind, api_version, "ignoring an object of another kind"),
    }
}

/// Whether `kind` (of `api_version`) is a list kproxy reads, and the kind and apiVersion its items
/// have when they carry none (typed lists as the API server returns them): `Some(None)` for `List`.
fn list_item_type(kind: &str, api_version: &str) -> Option<Option<(&'static str, &'static str)>> {
    let core = api_version.is_empty() || api_version == "v1";
    let discovery = api_version.is_empty() || api_version.starts_with("discovery.k8s.io/");
    match kind {
        "List" if core => Some(None),
        "ServiceList" if core => Some(Some(("Service", "v1"))),
        "EndpointSliceList" if discovery => Some(Some(("EndpointSlice", "discovery.k8s.io/v1"))),
        "ServiceCIDRList" if api_version.is_empty() || api_version.starts_with("networking.k8s.io/") => {
            Some(Some(("ServiceCIDR", "networking.k8s.io/v1")))
        }
        _ => None,
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
fn add_items(
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

/// Whether the text in an origin's last parenthesis is one that [`document_origin`] or [`add_list`] wrote.
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
    use super::*;

    const KUBE_DNS: &str = r#"apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels:
    k8s-app: kube-dns
    kubernetes.io/name: CoreDNS
spec:
  clusterIP: 10.96.0.10
  clusterIPs:
  - 10.96.0.10
  ipFamilies:
  - IPv4
  ports:
  - name: dns
    port: 53
    protocol: UDP
    targetPort: 53
  - name: dns-tcp
    port: 53
    protocol: TCP
    targetPort: 53
  - name: metrics
    port: 9153
    protocol: TCP
    targetPort: 9153
  selector:
    k8s-app: kube-dns
  type: ClusterIP
"#;

    const KUBE_DNS_SLICE: &str = r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-abc12
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
addressType: IPv4
endpoints:
- addresses:
  - 10.244.0.12
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: kind-control-plane
- addresses:
  - 10.244.0.13
  conditions:
    ready: true
ports:
- name: dns-tcp
  port: 53
  protocol: TCP
- name: dns
  port: 53
  protocol: UDP
- name: metrics
  port: 9153
  protocol: TCP
"#;

    fn names(objects: &Objects) -> Vec<String> {
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
        let text = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
---
apiVersion: v1
kind: Pod
metadata:
  name: web-0
---
apiVersion: serving.knative.dev/v1
kind: Service
metadata:
  name: hello
---
apiVersion: v1
kind: Endpoints
metadata:
  name: kube-dns
---
just a string
---
- a
- list
---
replicas: 3
"#;
        let objects = parse_str(text, "misc.yaml");
        assert_eq!(objects, Objects::default());
    }

    #[test]
    fn kubectl_list_is_flattened() {
        let text = r#"apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    name: kube-dns
    namespace: kube-system
  spec:
    clusterIP: 10.96.0.10
    ports:
    - name: dns
      port: 53
      protocol: UDP
- apiVersion: v1
  kind: Pod
  metadata:
    name: coredns-1
- apiVersion: v1
  kind: Service
  metadata:
    name: broken
    namespace: default
  spec:
    ports:
    - port: {}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: kube-dns-abc12
    namespace: kube-system
    labels:
      kubernetes.io/service-name: kube-dns
  addressType: IPv4
  endpoints:
  - addresses: ["10.244.0.12"]
kind: List
metadata:
  resourceVersion: ""
"#;
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

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("kproxy-manifest-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn load_directory_recursively_sorted_by_path() {
        let tmp = TempDir::new("dir");
        let root = &tmp.0;
        fs::create_dir_all(root.join("b/nested")).unwrap();
        fs::create_dir_all(root.join("..data")).unwrap();
        fs::write(root.join("b/nested/z.yml"), KUBE_DNS_SLICE).unwrap();
        fs::write(root.join("a.yaml"), KUBE_DNS.replace("kube-dns\n  namespace", "a\n  namespace")).unwrap();
        fs::write(root.join("b/c.json"), r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"}}"#)
            .unwrap();
        fs::write(root.join("b/readme.md"), "kind: Service\n").unwrap();
        fs::write(root.join("..data/a.yaml"), KUBE_DNS).unwrap();
        fs::write(root.join(".hidden.yaml"), KUBE_DNS).unwrap();
        fs::write(root.join("bad.YAML"), "kind: Service\napiVersion: v1\nmetadata: {name: [x\n").unwrap();

        let objects = load_path(root);
        assert_eq!(
            names(&objects),
            ["Service kube-system/a", "Service /c", "Slice kube-system/kube-dns-abc12"]
        );
        assert_eq!(objects.services[0].origin, root.join("a.yaml").display().to_string());
        assert_eq!(objects.services[1].origin, root.join("b/c.json").display().to_string());
        assert_eq!(objects.slices[0].origin, root.join("b/nested/z.yml").display().to_string());
        assert_eq!(objects.errors.len(), 1, "{:?}", objects.errors);
        assert_eq!(objects.errors[0].origin, root.join("bad.YAML").display().to_string());

        // A file named explicitly is read whatever its extension.
        let objects = load_path(&root.join("b/readme.md"));
        assert_eq!(objects.services.len(), 1);
        assert!(objects.errors.is_empty());
        let objects = load_path(&root.join("b/nested/z.yml"));
        assert_eq!(objects.slices.len(), 1);
    }

    #[test]
    fn unreadable_paths_are_errors() {
        let tmp = TempDir::new("missing");
        let missing = tmp.0.join("does-not-exist.yaml");
        let objects = load_path(&missing);
        assert_eq!(objects.errors.len(), 1);
        assert_eq!(objects.errors[0].origin, missing.display().to_string());
        assert!(objects.services.is_empty());

        let binary = tmp.0.join("binary.yaml");
        fs::write(&binary, [0xff, 0xfe, 0x00, 0x41]).unwrap();
        let objects = load_path(&binary);
        assert_eq!(objects.errors.len(), 1);
        assert!(objects.errors[0].message.starts_with("not UTF-8"), "{}", objects.errors[0].message);
    }

    #[cfg(unix)]
    #[test]
    fn symlink_loops_terminate() {
        let tmp = TempDir::new("loop");
        fs::create_dir_all(tmp.0.join("sub")).unwrap();
        std::os::unix::fs::symlink(&tmp.0, tmp.0.join("sub/back")).unwrap();
        fs::write(tmp.0.join("sub/svc.yaml"), KUBE_DNS).unwrap();
        let objects = load_path(&tmp.0);
        assert_eq!(objects.services.len(), 1);
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
    }

    /// `kproxy agent` must never block on what a directory holds: a FIFO named `*.yaml` (which blocks `open()`
    /// for reading until a writer comes) and a socket are errors naming them, found without opening them for
    /// good.
    #[test]
    fn special_files_are_errors_and_never_block() {
        let tmp = TempDir::new("special");
        let fifo = tmp.0.join("fifo.yaml");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
        let socket = tmp.0.join("socket.yaml");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        fs::write(tmp.0.join("web.yaml"), KUBE_DNS).unwrap();

        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let root = tmp.0.clone();
        std::thread::spawn(move || done_tx.send(load_path(&root)).unwrap());
        let objects = done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("load_path blocked");
        assert_eq!(names(&objects), ["Service kube-system/kube-dns"]);
        let errors: Vec<String> = objects.errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            errors,
            [
                format!("{}: not a regular file (a FIFO); it is not read", fifo.display()),
                format!("{}: not a regular file (a socket); it is not read", socket.display()),
            ]
        );
        // Named explicitly, the same.
        assert_eq!(load_path(&fifo).errors.len(), 1);
    }

    #[test]
    fn files_over_the_size_limit_are_errors() {
        let tmp = TempDir::new("large");
        let large = tmp.0.join("large.yaml");
        fs::File::create(&large).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        let err = read_file(&large).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: 4194305 bytes, over the limit of 4194304 bytes; it is not read", large.display())
        );
        fs::File::create(&large).unwrap().set_len(MAX_FILE_BYTES).unwrap();
        // At the limit it is read (and, being NUL bytes, is not a manifest).
        assert!(read_file(&large).is_ok());
    }

    /// A 200 KB document nested 100,000 levels (and a mapping nested 50,000 levels, whose parse alone takes
    /// the YAML parser 43 s) is rejected before the parser sees it, naming the document and line; the other
    /// documents of the file still load.
    #[test]
    fn deep_nesting_is_rejected_before_parsing() {
        let seq = "[".repeat(100_000) + &"]".repeat(100_000);
        let map = "{a: ".repeat(50_000) + "1" + &"}".repeat(50_000);
        let text = format!("{KUBE_DNS}---\n{seq}\n---\nkind: List\napiVersion: v1\nitems:\n- {map}\n");
        let started = std::time::Instant::now();
        let objects = parse_str(&text, "deep.yaml");
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(names(&objects), ["Service kube-system/kube-dns"]);
        let errors: Vec<String> = objects.errors.iter().map(ToString::to_string).collect();
        let seq_line = KUBE_DNS.lines().count() + 2;
        assert_eq!(
            errors,
            [
                format!(
                    "deep.yaml (document 2): collections nested more than 100 levels deep (at line {seq_line}); the document is not parsed"
                ),
                format!(
                    "deep.yaml (document 3): collections nested more than 100 levels deep (at line {}); the document is not parsed",
                    seq_line + 5
                ),
            ]
        );
        // JSON the same (serde_json has its own limit, but YAML would be tried next).
        let objects = parse_str(&seq, "deep.json");
        assert_eq!(objects.errors.len(), 1);
        assert!(
            objects.errors[0].message.starts_with("collections nested more than 100"),
            "{:?}",
            objects.errors
        );
        let objects = parse_str(&seq, "deep.txt");
        assert!(
            objects.errors[0].message.starts_with("collections nested more than 100"),
            "{:?}",
            objects.errors
        );
    }

    #[test]
    fn the_nesting_scan_counts_what_the_parser_would_see() {
        let deep = |open: &str, close: &str, n: usize| open.repeat(n) + &close.repeat(n);
        // At the limit, every way of nesting passes; one more level is found.
        for (text, depth) in [
            (deep("[", "]", 100), 100),
            (deep("{a: ", "}", 99) + "", 99),
            (format!("a:\n{}", (1..100).map(|i| format!("{}b:\n", " ".repeat(i))).collect::<String>()), 100),
            (format!("{}x\n", "- ".repeat(100)), 100),
            (format!("a:\n  b: {}", deep("[", "]", 98)), 100),
        ] {
            assert_eq!(nesting_exceeds(&text, depth), None, "{text:.80}");
            assert!(nesting_exceeds(&text, depth - 1).is_some(), "{text:.80}");
        }
        // Brackets that are text are not levels; quotes that are text hide nothing.
        let deep_flow = deep("[", "]", 200);
        for (text, counted) in [
            (format!("a: '{deep_flow}'\n"), false),
            (format!("a: \"{}\"\n", deep_flow.replace('[', "[\\\"")), false),
            (format!("a: 'it''s {deep_flow}'\n"), false),
            (format!("a: x # {deep_flow}\n"), false),
            (format!("a: |\n  {deep_flow}\n  'unclosed\nb: 1\n"), false),
            (format!("- key: >-\n   {deep_flow}\n"), false),
            // A quote inside a plain scalar, or on its continuation line, opens nothing.
            (format!("a: don 't\nb: {deep_flow}\n"), true),
            (format!("a: some text\n  'continued\nb: {deep_flow}\n"), true),
            (format!("a: &anchor x 'y\nb: {deep_flow}\n"), true),
            // ... but one where a node begins does, even an unclosed one (the parser reads to its end, too).
            (format!("a: &anchor 'x\nb: {deep_flow}\n"), false),
            // Closing brackets inside quoted scalars do not close levels.
            (format!("a: {}", "[ ']' ".repeat(150)), true),
            // A block scalar ends at a line no more indented than its key.
            (format!("- key: |\n  {deep_flow}\n"), true),
            (format!("a: b[\n{deep_flow}\n"), true),
        ] {
            assert_eq!(nesting_exceeds(&text, MAX_NESTING).is_some(), counted, "{text:.120}");
        }
        // Real manifests are nowhere near.
        let annotated = KUBE_DNS.replace(
            "  labels:\n",
            "  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: |\n      {\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{\"annotations\":{},\"name\":\"kube-dns\"},\"spec\":{\"ports\":[{\"port\":53}]}}\n  labels:\n",
        );
        for text in [KUBE_DNS, KUBE_DNS_SLICE, &annotated] {
            assert_eq!(nesting_exceeds(text, 12), None, "{text}");
        }
        for entry in
            fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")).unwrap().flatten()
        {
            let objects = load_path(&entry.path());
            assert!(objects.errors.is_empty(), "{}: {:?}", entry.path().display(), objects.errors);
        }
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
