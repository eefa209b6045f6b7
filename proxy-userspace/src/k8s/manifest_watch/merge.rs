//! A file's objects, named so that a later read can tell which of them it still holds, and a read
//! applied to what the file held: a clean read is authoritative, one with errors keeps the last good
//! version of what it cannot read now.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    path::Path,
    sync::Arc,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::KEPT;
use crate::k8s::manifest::{self, ManifestError, Sourced};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Kind {
    Service,
    EndpointSlice,
    ServiceCidr,
}

/// An object of a file: kind, namespace (`default` when absent, as the model
/// names it), name, and how many of the same came before it in the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Ident {
    pub(super) kind: Kind,
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) repeat: u32,
}

impl Ident {
    /// As the model's and the parser's errors name objects: `Service default/web`.
    pub(super) fn label(&self) -> String {
        let kind = match self.kind {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::ServiceCidr => "ServiceCIDR",
        };
        format!("{kind} {}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug)]
pub(super) enum Object {
    Service(Arc<Sourced<Service>>),
    Slice(Arc<Sourced<EndpointSlice>>),
    ServiceCidr(Arc<Sourced<k8s_openapi::api::networking::v1::ServiceCIDR>>),
}

impl Object {
    pub(super) fn origin(&self) -> &str {
        match self {
            Object::Service(s) => &s.origin,
            Object::Slice(s) => &s.origin,
            Object::ServiceCidr(s) => &s.origin,
        }
    }

    pub(super) fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Service(s) => &s.object.metadata,
            Object::Slice(s) => &s.object.metadata,
            Object::ServiceCidr(s) => &s.object.metadata,
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) ident: Ident,
    pub(super) object: Object,
    /// From an earlier read: its file or document cannot be read now.
    pub(super) kept: bool,
}

/// One read of a file: its text and what it holds, or why it cannot be read.
pub(super) type FileRead = Result<(Arc<str>, manifest::Objects), ManifestError>;

pub(super) fn read(path: &Path) -> FileRead {
    let text = manifest::read_file(path)?;
    let objects = manifest::parse_str(&text, &path.display().to_string());
    Ok((Arc::from(text), objects))
}

/// The entries of what a file holds, in the parser's order.
pub(super) fn entries(objects: manifest::Objects) -> (Vec<Entry>, Vec<ManifestError>) {
    let mut repeats: HashMap<(Kind, String, String), u32> = HashMap::new();
    let mut ident = |kind: Kind, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        let namespace =
            meta.namespace.clone().filter(|ns| !ns.is_empty()).unwrap_or_else(|| "default".into());
        let name = meta.name.clone().unwrap_or_default();
        let repeat = repeats.entry((kind, namespace.clone(), name.clone())).or_default();
        let ident = Ident { kind, namespace, name, repeat: *repeat };
        *repeat += 1;
        ident
    };
    let mut out = Vec::with_capacity(objects.services.len() + objects.slices.len());
    for service in objects.services {
        let ident = ident(Kind::Service, &service.object.metadata);
        out.push(Entry { ident, object: Object::Service(Arc::new(service)), kept: false });
    }
    for slice in objects.slices {
        let ident = ident(Kind::EndpointSlice, &slice.object.metadata);
        out.push(Entry { ident, object: Object::Slice(Arc::new(slice)), kept: false });
    }
    for cidr in objects.service_cidrs {
        let ident = ident(Kind::ServiceCidr, &cidr.object.metadata);
        out.push(Entry { ident, object: Object::ServiceCidr(Arc::new(cidr)), kept: false });
    }
    (out, objects.errors)
}

/// The document of `file` an origin names: `file` and `file (items[3])` are
/// document 1, `file (document 2, items[0])` document 2.
pub(super) fn document_of(origin: &str, file: &str) -> Option<usize> {
    let rest = origin.strip_prefix(file)?;
    if rest.is_empty() || rest.starts_with(" (items[") {
        return Some(1);
    }
    let number = rest.strip_prefix(" (document ")?;
    let end = number.find([',', ')'])?;
    number[..end].parse().ok()
}

pub(super) fn labels<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> String {
    entries.into_iter().map(|e| e.ident.label()).collect::<Vec<_>>().join(", ")
}

/// Applies a read of `file` to the entries it held. Returns the file's entries
/// and errors now, and the text read (when it could be).
pub(super) fn merge(
    file: &str,
    held: &[Entry],
    read: FileRead,
) -> (Vec<Entry>, Vec<ManifestError>, Option<Arc<str>>) {
    let (text, objects) = match read {
        Ok(read) => read,
        Err(mut error) => {
            let kept: Vec<Entry> = held.iter().cloned().map(|e| Entry { kept: true, ..e }).collect();
            if !kept.is_empty() {
                error.object = Some(labels(&kept));
                error.message = format!("{}; {KEPT}", error.message);
            }
            return (kept, vec![error], None);
        }
    };
    let (fresh, mut errors) = entries(objects);
    if errors.is_empty() {
        return (fresh, errors, Some(text));
    }
    let readable: HashSet<&Ident> = fresh.iter().map(|e| &e.ident).collect();
    let kept: Vec<Entry> = held
        .iter()
        .filter(|e| !readable.contains(&e.ident))
        .cloned()
        .map(|e| Entry { kept: true, ..e })
        .collect();
    let mut unexplained: BTreeSet<usize> = (0..kept.len()).collect();
    for error in &mut errors {
        let by_name: Vec<usize> = match &error.object {
            Some(object) => (0..kept.len()).filter(|&i| kept[i].ident.label() == *object).collect(),
            None => Vec::new(),
        };
        // A document that does not parse names no object: it held what its position held.
        let named = if by_name.is_empty() {
            let document = document_of(&error.origin, file);
            (0..kept.len())
                .filter(|&i| document.is_some() && document_of(kept[i].object.origin(), file) == document)
                .collect()
        } else {
            by_name
        };
        if named.is_empty() {
            continue;
        }
        if error.object.is_none() {
            error.object = Some(labels(named.iter().map(|&i| &kept[i])));
        }
        error.message = format!("{}; {KEPT}", error.message);
        for i in named {
            unexplained.remove(&i);
        }
    }
    if !unexplained.is_empty() {
        let message =
            format!("not in the documents that can be read now; {KEPT} until the file reads without errors");
        errors.push(
            ManifestError::new(file, message).with_object(labels(unexplained.iter().map(|&i| &kept[i]))),
        );
    }
    let mut all = fresh;
    all.extend(kept);
    (all, errors, Some(text))
}

/// Why a read looks like a rewrite caught half-way, if it does, against the
/// text last applied.
pub(super) fn looks_unfinished(before: Option<&str>, read: &FileRead) -> Option<&'static str> {
    let (Some(before), Ok((text, _))) = (before, read) else { return None };
    if text.is_empty() && !before.is_empty() {
        return Some("the file is empty now");
    }
    if text.len() < before.len() && before.starts_with(&**text) {
        return Some("the file is now the start of what it held");
    }
    if !text.is_empty() && !text.ends_with('\n') && before.ends_with('\n') {
        return Some("the file ends in the middle of a line");
    }
    None
}
