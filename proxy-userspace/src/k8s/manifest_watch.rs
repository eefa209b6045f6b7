//! The manifests source: a file or directory of YAML, re-read when it
//! changes, delivered to the sync loop as a whole [`Snapshot`], keeping the
//! last good state of whatever cannot be read as it is now.
//!
//! - A file is read once `stat` has said the same of it (size, times, inode)
//!   at two polls in a row, so a file being written is not read half-way.
//! - A file that reads cleanly is authoritative: what it no longer holds is
//!   removed. A file with errors replaces what its readable documents hold and
//!   removes nothing: every object it held that is not in them (a Service whose
//!   document no longer parses, a slice with a type error) keeps its last good
//!   version, and the error names the file, the document and that object. A
//!   file that cannot be read at all (a FIFO, too large, not UTF-8, gone from
//!   an unreadable directory) keeps all it held.
//! - A file that is now a strict prefix of what was last applied (emptied, cut
//!   short) or stops in the middle of a line it did not before looks like a
//!   rewrite in progress: it is applied only once it has stayed so for
//!   [`SETTLE`].
//! - The manifests path itself vanishing or becoming unreadable changes
//!   nothing; a file removed from a directory that can be listed is removed
//!   (once it has been missing at two polls).
//! - Objects are numbered in the order they first appear (newcomers of one
//!   poll by namespace, name and position, as before), and the model sees
//!   Services in that order, so an address stays with the Service that held
//!   it until that Service goes.
//!
//! Reading and parsing happen on a thread of their own: `/healthz`,
//! `/metrics` and the sync loop never wait for them, and a read in progress
//! never holds up the exit on SIGTERM (a `spawn_blocking` task would: the
//! runtime waits for those when it shuts down).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::{
    k8s::api_watch::{Changes, Snapshot},
    k8s::manifest::{self, ManifestError, Sourced},
};

/// What the manifests source last reported; rendered once it has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManifestState {
    pub objects_kept: u64,
    pub errors: u64,
}

/// The manifests source reads on a thread of its own, apart from the sync loop and started without a
/// metrics handle, so it publishes here, process-wide (the agent's `/metrics` reads [`last_state`]).
static MANIFESTS: Mutex<Option<ManifestState>> = Mutex::new(None);

/// Publishes the manifests source's current state.
pub fn set_manifest_state(state: ManifestState) {
    *MANIFESTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(state);
}

/// What the manifests source last published, if it has.
pub fn last_state() -> Option<ManifestState> {
    *MANIFESTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long a file that looks cut short (see [`looks_unfinished`]) must stay
/// so before it is applied: longer than a writer pauses between two writes.
pub const SETTLE: Duration = Duration::from_secs(5);

/// A poll (listing, reading and parsing what changed) taking longer than this
/// is reported, naming the file; the last good state stays programmed.
const READ_BUDGET: Duration = Duration::from_secs(2);

/// Appended to an error whose object keeps its last good version.
const KEPT: &str = "the last good version stays programmed";

/// Re-reads the manifests whenever a file changes (checked every `poll`).
pub async fn watch_files(path: PathBuf, poll: Duration, changes: Arc<Changes>) -> Result<()> {
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    // The thread stops at its next poll once this future is dropped.
    let _stop = StopOnDrop(Arc::clone(&stop));
    {
        let progress = Arc::clone(&progress);
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("kproxy-manifests".to_string())
            .spawn(move || {
                let mut watcher = Watcher::new(path);
                while !stop.load(Ordering::Relaxed) {
                    if let Some(snapshot) = watcher.poll(Instant::now(), &progress) {
                        changes.replace_all(snapshot);
                    }
                    set_manifest_state(watcher.state);
                    progress.idle();
                    std::thread::sleep(poll);
                }
            })
            .context("starting the manifests reader thread")?;
    }
    // A read cannot be interrupted; one that outlasts the budget is reported.
    let mut reported = None;
    loop {
        tokio::time::sleep(poll.clamp(Duration::from_millis(100), READ_BUDGET)).await;
        if let Some((since, file)) = progress.busy()
            && since.elapsed() > READ_BUDGET
            && reported != Some(since)
        {
            tracing::warn!(
                file = %file.display(),
                seconds = since.elapsed().as_secs(),
                "reading the manifests takes longer than {READ_BUDGET:?}; {KEPT} until it finishes"
            );
            reported = Some(since);
        }
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What the reader thread is doing: since when, and which file.
#[derive(Default)]
struct Progress(Mutex<Option<(Instant, PathBuf)>>);

impl Progress {
    fn reading(&self, since: Instant, file: &Path) {
        *self.0.lock().expect("poisoned") = Some((since, file.to_path_buf()));
    }

    fn idle(&self) {
        *self.0.lock().expect("poisoned") = None;
    }

    fn busy(&self) -> Option<(Instant, PathBuf)> {
        self.0.lock().expect("poisoned").clone()
    }
}

/// What `stat` says of a file that any write, rename or replacement changes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    mode: u32,
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

impl Stamp {
    fn of(meta: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt as _;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            mode: meta.mode(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Service,
    EndpointSlice,
    ServiceCidr,
}

/// An object of a file: kind, namespace (`default` when absent, as the model
/// names it), name, and how many of the same came before it in the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Ident {
    kind: Kind,
    namespace: String,
    name: String,
    repeat: u32,
}

impl Ident {
    /// As the model's and the parser's errors name objects: `Service default/web`.
    fn label(&self) -> String {
        let kind = match self.kind {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::ServiceCidr => "ServiceCIDR",
        };
        format!("{kind} {}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug)]
enum Object {
    Service(Arc<Sourced<Service>>),
    Slice(Arc<Sourced<EndpointSlice>>),
    ServiceCidr(Arc<Sourced<k8s_openapi::api::networking::v1::ServiceCIDR>>),
}

impl Object {
    fn origin(&self) -> &str {
        match self {
            Object::Service(s) => &s.origin,
            Object::Slice(s) => &s.origin,
            Object::ServiceCidr(s) => &s.origin,
        }
    }

    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Service(s) => &s.object.metadata,
            Object::Slice(s) => &s.object.metadata,
            Object::ServiceCidr(s) => &s.object.metadata,
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    ident: Ident,
    object: Object,
    /// From an earlier read: its file or document cannot be read now.
    kept: bool,
}

/// One read of a file: its text and what it holds, or why it cannot be read.
type FileRead = Result<(Arc<str>, manifest::Objects), ManifestError>;

fn read(path: &Path) -> FileRead {
    let text = manifest::read_file(path)?;
    let objects = manifest::parse_str(&text, &path.display().to_string());
    Ok((Arc::from(text), objects))
}

/// The entries of what a file holds, in the parser's order.
fn entries(objects: manifest::Objects) -> (Vec<Entry>, Vec<ManifestError>) {
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
fn document_of(origin: &str, file: &str) -> Option<usize> {
    let rest = origin.strip_prefix(file)?;
    if rest.is_empty() || rest.starts_with(" (items[") {
        return Some(1);
    }
    let number = rest.strip_prefix(" (document ")?;
    let end = number.find([',', ')'])?;
    number[..end].parse().ok()
}

fn labels<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> String {
    entries.into_iter().map(|e| e.ident.label()).collect::<Vec<_>>().join(", ")
}

/// Applies a read of `file` to the entries it held. Returns the file's entries
/// and errors now, and the text read (when it could be).
fn merge(file: &str, held: &[Entry], read: FileRead) -> (Vec<Entry>, Vec<ManifestError>, Option<Arc<str>>) {
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
fn looks_unfinished(before: Option<&str>, read: &FileRead) -> Option<&'static str> {
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

#[derive(Default)]
struct FileState {
    /// The stamp of the read applied last (or given up on).
    read: Option<Stamp>,
    entries: Vec<Entry>,
    errors: Vec<ManifestError>,
    /// The text applied last, to tell a rewrite in progress from an edit.
    text: Option<Arc<str>>,
    /// A read that looks unfinished, applied if its file stays so.
    held: Option<Held>,
}

struct Held {
    stamp: Stamp,
    since: Instant,
    read: FileRead,
}

impl FileState {
    fn apply(&mut self, file: &Path, stamp: Stamp, read: FileRead) {
        let (entries, errors, text) = merge(&file.display().to_string(), &self.entries, read);
        self.entries = entries;
        self.errors = errors;
        if text.is_some() {
            self.text = text;
        }
        self.read = Some(stamp);
    }
}

/// The manifests path as last read, file by file.
struct Watcher {
    root: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// What the previous poll listed.
    seen: Option<BTreeMap<PathBuf, Stamp>>,
    /// Why the path itself cannot be read now (reported once).
    root_error: Option<ManifestError>,
    /// The order objects first appeared in (see [`Snapshot::services`]).
    ranks: HashMap<(PathBuf, Ident), u32>,
    next_rank: u32,
    /// The errors of the snapshot last published; `None` before the first.
    published: Option<Vec<ManifestError>>,
    state: ManifestState,
}

impl Watcher {
    fn new(root: PathBuf) -> Self {
        Watcher {
            root,
            files: BTreeMap::new(),
            seen: None,
            root_error: None,
            ranks: HashMap::new(),
            next_rank: 0,
            published: None,
            state: ManifestState::default(),
        }
    }

    /// One look at the path; the snapshot to publish when anything changed.
    fn poll(&mut self, now: Instant, progress: &Progress) -> Option<Snapshot> {
        progress.reading(now, &self.root);
        let listing = match manifest::list_path(&self.root) {
            Ok(listing) => listing,
            Err(error) => {
                self.root_unreadable(error);
                return None;
            }
        };
        if self.root_error.take().is_some() {
            tracing::info!(path = %self.root.display(), "the manifests can be read again");
        }
        let stamps: BTreeMap<PathBuf, Stamp> =
            listing.files.iter().map(|(path, meta)| (path.clone(), Stamp::of(meta))).collect();
        let unreadable: Vec<&Path> = listing.unreadable.iter().map(|(path, _)| path.as_path()).collect();
        // Nothing is read at the first sight.
        let previous = self.seen.replace(stamps.clone())?;

        let mut changed = self.published.is_none();
        changed |= self.forget_gone(&stamps, &previous, &unreadable);
        changed |= self.read_changed(now, progress, &stamps, &previous);

        let errors = self.current_errors(&listing.unreadable);
        if !changed && self.published.as_ref() == Some(&errors) {
            return None;
        }
        self.published = Some(errors.clone());
        Some(self.snapshot(errors))
    }

    /// The path itself cannot be listed: everything stays as last read, and the error is counted.
    fn root_unreadable(&mut self, error: ManifestError) {
        if self.root_error.as_ref() != Some(&error) {
            tracing::warn!(%error, "the manifests cannot be read; everything stays programmed as last read");
            self.root_error = Some(error);
        }
        // Once it is back, files are read when they have been seen unchanged twice again.
        self.seen = None;
        self.state.objects_kept = self.files.values().map(|f| f.entries.len() as u64).sum();
        self.state.errors = self.published.as_ref().map_or(0, |e| e.len() as u64) + 1;
    }

    /// Drops the files missing from two listings in a row (a file under an unreadable directory
    /// is not gone, only unseen); true when one of them held anything.
    fn forget_gone(
        &mut self,
        stamps: &BTreeMap<PathBuf, Stamp>,
        previous: &BTreeMap<PathBuf, Stamp>,
        unreadable: &[&Path],
    ) -> bool {
        let mut changed = false;
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !stamps.contains_key(*p) && !previous.contains_key(*p))
            .filter(|p| !unreadable.iter().any(|u| p.starts_with(u)))
            .cloned()
            .collect();
        for path in gone {
            changed |= !self.files.remove(&path).is_some_and(|f| f.entries.is_empty() && f.errors.is_empty());
        }
        changed
    }

    /// Reads each file whose stamp is new and the same in two listings in a row, holding a read
    /// that looks unfinished until it has stayed so for [`SETTLE`]; true when any read was applied.
    fn read_changed(
        &mut self,
        now: Instant,
        progress: &Progress,
        stamps: &BTreeMap<PathBuf, Stamp>,
        previous: &BTreeMap<PathBuf, Stamp>,
    ) -> bool {
        let mut changed = false;
        for (path, stamp) in stamps {
            let state = self.files.entry(path.clone()).or_default();
            if let Some(held) = &state.held {
                if held.stamp != *stamp {
                    state.held = None;
                } else if now.saturating_duration_since(held.since) >= SETTLE {
                    let held = state.held.take().expect("checked");
                    state.apply(path, held.stamp, held.read);
                    changed = true;
                    continue;
                } else {
                    continue;
                }
            }
            if state.read.as_ref() == Some(stamp) || previous.get(path) != Some(stamp) {
                continue;
            }
            progress.reading(Instant::now(), path);
            let read = read(path);
            if let Some(why) = looks_unfinished(state.text.as_deref(), &read) {
                tracing::info!(
                    file = %path.display(),
                    "{why} (a write in progress?): it is applied if it stays so for {SETTLE:?}"
                );
                state.held = Some(Held { stamp: stamp.clone(), since: now, read });
                continue;
            }
            state.apply(path, stamp.clone(), read);
            changed = true;
        }
        changed
    }

    /// The errors to publish (the files', then the unreadable entries'), counting in `state` the
    /// objects kept from an earlier read.
    fn current_errors(&mut self, unreadable: &[(PathBuf, ManifestError)]) -> Vec<ManifestError> {
        let mut errors: Vec<ManifestError> =
            self.files.values().flat_map(|f| f.errors.iter().cloned()).collect();
        let mut kept = 0;
        for (path, error) in unreadable {
            let under: usize =
                self.files.iter().filter(|(p, _)| p.starts_with(path)).map(|(_, f)| f.entries.len()).sum();
            kept += under;
            let mut error = error.clone();
            if under > 0 {
                error.message = format!(
                    "{}; the last good version of the {under} objects read from it stays programmed",
                    error.message
                );
            }
            errors.push(error);
        }
        kept += self
            .files
            .iter()
            .filter(|(p, _)| !unreadable.iter().any(|(u, _)| p.starts_with(u)))
            .map(|(_, f)| f.entries.iter().filter(|e| e.kept).count())
            .sum::<usize>();
        self.state = ManifestState { objects_kept: kept as u64, errors: errors.len() as u64 };
        errors
    }

    /// Everything the files hold now, numbered for the model's order.
    fn snapshot(&mut self, errors: Vec<ManifestError>) -> Snapshot {
        let present: Vec<(&PathBuf, usize, &Entry)> = self
            .files
            .iter()
            .flat_map(|(path, file)| file.entries.iter().enumerate().map(move |(i, e)| (path, i, e)))
            .collect();
        let keys: HashSet<(PathBuf, Ident)> =
            present.iter().map(|(p, _, e)| ((*p).clone(), e.ident.clone())).collect();
        self.ranks.retain(|key, _| keys.contains(key));
        let mut newcomers: Vec<&(&PathBuf, usize, &Entry)> = present
            .iter()
            .filter(|(p, _, e)| !self.ranks.contains_key(&((*p).clone(), e.ident.clone())))
            .collect();
        // Among themselves, as the source always ordered them: namespace, name, then where they were read.
        newcomers.sort_by(|(pa, ia, ea), (pb, ib, eb)| {
            (&ea.ident.namespace, &ea.ident.name, pa, ia).cmp(&(&eb.ident.namespace, &eb.ident.name, pb, ib))
        });
        if u32::MAX - self.next_rank < newcomers.len() as u32 {
            let mut old: Vec<((PathBuf, Ident), u32)> = self.ranks.drain().collect();
            old.sort_by_key(|(_, rank)| *rank);
            self.next_rank = 0;
            for (key, _) in old {
                self.ranks.insert(key, self.next_rank);
                self.next_rank += 1;
            }
        }
        for (path, _, entry) in newcomers {
            self.ranks.insert(((*path).clone(), entry.ident.clone()), self.next_rank);
            self.next_rank += 1;
        }
        let mut snapshot = Snapshot { errors, ..Default::default() };
        for (path, _, entry) in present {
            let rank = self.ranks[&(path.clone(), entry.ident.clone())];
            let meta = entry.object.metadata();
            let key =
                (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default(), rank);
            match &entry.object {
                Object::Service(s) => {
                    snapshot.services.insert(key, Arc::clone(s));
                }
                Object::Slice(s) => {
                    snapshot.slices.insert(key, Arc::clone(s));
                }
                Object::ServiceCidr(s) => {
                    snapshot.service_cidrs.insert(key, Arc::clone(s));
                }
            }
        }
        snapshot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEB: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.100
  ports: [{name: http, port: 80, protocol: TCP}]
";

    const WEB_SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.244.0.11]}]
ports: [{name: http, port: 80, protocol: TCP}]
";

    const DNS: &str = "apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: dns, port: 53, protocol: UDP}]
";

    fn parsed(text: &str) -> FileRead {
        Ok((Arc::from(text), manifest::parse_str(text, "f.yaml")))
    }

    fn merged(held: &[Entry], text: &str) -> (Vec<Entry>, Vec<ManifestError>) {
        let (entries, errors, _) = merge("f.yaml", held, parsed(text));
        (entries, errors)
    }

    fn described(entries: &[Entry]) -> Vec<String> {
        entries
            .iter()
            .map(|e| {
                format!(
                    "{} from {}{}",
                    e.ident.label(),
                    e.object.origin(),
                    if e.kept { " (kept)" } else { "" }
                )
            })
            .collect()
    }

    fn ports(entries: &[Entry]) -> Vec<i32> {
        entries
            .iter()
            .filter_map(|e| match &e.object {
                Object::Service(s) => Some(s.object.spec.as_ref()?.ports.as_ref()?[0].port),
                Object::Slice(_) | Object::ServiceCidr(_) => None,
            })
            .collect()
    }

    #[test]
    fn a_clean_file_is_authoritative() {
        let (held, errors) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(held.len(), 3);
        // The slice and the DNS Service are gone from the file: they go.
        let (now, errors) = merged(&held, WEB);
        assert!(errors.is_empty());
        assert_eq!(described(&now), ["Service default/web from f.yaml"]);
    }

    #[test]
    fn a_document_that_does_not_parse_keeps_what_its_position_held() {
        let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
        let broken = WEB.replace("name: web,", "name: [web,").replace("port: 80", "port: 8080");
        let (now, errors) =
            merged(&held, &format!("{broken}---\n{WEB_SLICE}---\n{}", DNS.replace("53", "54")));
        assert_eq!(
            described(&now),
            [
                "Service kube-system/dns from f.yaml (document 3)",
                "EndpointSlice default/web-1 from f.yaml (document 2)",
                "Service default/web from f.yaml (document 1) (kept)",
            ]
        );
        // The kept Service is the last good version; the DNS Service's change applies.
        assert_eq!(ports(&now), [54, 80]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let error = errors[0].to_string();
        assert!(error.starts_with("f.yaml (document 1): Service default/web: invalid YAML: "), "{error}");
        assert!(error.ends_with("; the last good version stays programmed"), "{error}");
    }

    #[test]
    fn a_type_error_keeps_the_named_object() {
        let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}"));
        let slice = WEB_SLICE.replace("port: 80", "port: eighty");
        let (now, errors) = merged(&held, &format!("{WEB}---\n{slice}"));
        assert_eq!(
            described(&now),
            [
                "Service default/web from f.yaml (document 1)",
                "EndpointSlice default/web-1 from f.yaml (document 2) (kept)"
            ]
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        let error = errors[0].to_string();
        assert!(
            error
                .starts_with("f.yaml (document 2): EndpointSlice default/web-1: ports[0].port: invalid type"),
            "{error}"
        );
        assert!(error.ends_with(KEPT), "{error}");
    }

    /// Documents moved, one broken and one removed in the same edit: nothing
    /// the file held goes while it has errors, and the error says which
    /// objects are kept; a clean read then removes what it no longer holds.
    #[test]
    fn a_file_with_errors_removes_nothing_and_a_clean_one_does() {
        let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}---\n{DNS}"));
        let (now, errors) = merged(&held, &format!("{DNS}---\nkind: Service\napiVersion: v1\nmetadata: [\n"));
        assert_eq!(
            described(&now),
            [
                "Service kube-system/dns from f.yaml (document 1)",
                "Service default/web from f.yaml (document 1) (kept)",
                "EndpointSlice default/web-1 from f.yaml (document 2) (kept)",
            ]
        );
        let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].starts_with("f.yaml (document 2): EndpointSlice default/web-1: invalid YAML"),
            "{errors:?}"
        );
        assert_eq!(
            errors[1],
            "f.yaml: Service default/web: not in the documents that can be read now; the last good version stays \
             programmed until the file reads without errors"
        );
        let (now, errors) = merged(&now, DNS);
        assert!(errors.is_empty());
        assert_eq!(described(&now), ["Service kube-system/dns from f.yaml"]);
        // What a clean read removed never comes back from a later broken one.
        let (now, _) = merged(&now, "kind: Service\napiVersion: v1\nmetadata: [\n");
        assert_eq!(described(&now), ["Service kube-system/dns from f.yaml (kept)"]);
    }

    #[test]
    fn a_file_that_cannot_be_read_keeps_everything() {
        let (held, _) = merged(&[], &format!("{WEB}---\n{WEB_SLICE}"));
        let error = ManifestError::new("f.yaml", "not a regular file (a FIFO); it is not read");
        let (now, errors, text) = merge("f.yaml", &held, Err(error));
        assert!(text.is_none());
        assert_eq!(now.len(), 2);
        assert!(now.iter().all(|e| e.kept));
        assert_eq!(
            errors[0].to_string(),
            "f.yaml: Service default/web, EndpointSlice default/web-1: not a regular file (a FIFO); it is not read; \
             the last good version stays programmed"
        );
        // A new file that cannot be read names nothing it does not have.
        let (now, errors, _) = merge("f.yaml", &[], Err(ManifestError::new("f.yaml", "boom")));
        assert!(now.is_empty());
        assert_eq!(errors[0].to_string(), "f.yaml: boom");
    }

    #[test]
    fn rewrites_caught_half_way_look_unfinished() {
        let before = format!("{WEB}---\n{WEB_SLICE}");
        let at = |text: &str| looks_unfinished(Some(&before), &parsed(text));
        assert_eq!(at(""), Some("the file is empty now"));
        assert_eq!(at(&format!("{WEB}---\n")), Some("the file is now the start of what it held"));
        assert_eq!(at(&before[..before.len() - 10]), Some("the file is now the start of what it held"));
        assert_eq!(
            at(&WEB.replace("80", "8080")[..WEB.len()]),
            Some("the file ends in the middle of a line")
        );
        assert_eq!(at(&before), None);
        assert_eq!(at(&format!("{before}---\n{DNS}")), None);
        assert_eq!(at(DNS), None);
        assert_eq!(looks_unfinished(None, &parsed("")), None);
        assert_eq!(looks_unfinished(Some("a: 1"), &parsed("a: 2")), None);
    }

    #[test]
    fn documents_named_by_origins() {
        assert_eq!(document_of("f.yaml", "f.yaml"), Some(1));
        assert_eq!(document_of("f.yaml (items[2])", "f.yaml"), Some(1));
        assert_eq!(document_of("f.yaml (document 12)", "f.yaml"), Some(12));
        assert_eq!(document_of("f.yaml (document 3, items[0])", "f.yaml"), Some(3));
        assert_eq!(document_of("g.yaml (document 3)", "f.yaml"), None);
    }

    use crate::testutil::TempDir;

    /// Polls with a clock the test moves.
    struct Clock {
        watcher: Watcher,
        now: Instant,
        progress: Progress,
    }

    impl Clock {
        fn new(root: &Path) -> Self {
            Clock {
                watcher: Watcher::new(root.to_path_buf()),
                now: Instant::now(),
                progress: Progress::default(),
            }
        }

        fn poll(&mut self) -> Option<Snapshot> {
            self.now += Duration::from_millis(250);
            self.watcher.poll(self.now, &self.progress)
        }

        /// Polls until a snapshot comes (at most `polls` times).
        fn next(&mut self, polls: usize) -> Option<Snapshot> {
            (0..polls).find_map(|_| self.poll())
        }
    }

    fn names(snapshot: &Snapshot) -> Vec<String> {
        let services = snapshot
            .services()
            .into_iter()
            .map(|s| format!("Service {}", s.object.metadata.name.as_deref().unwrap()));
        let slices = snapshot
            .slices()
            .into_iter()
            .map(|s| format!("EndpointSlice {}", s.object.metadata.name.as_deref().unwrap()));
        services.chain(slices).collect()
    }

    #[test]
    fn files_are_read_once_they_look_the_same_twice() {
        let tmp = TempDir::new("debounce");
        fs::write(tmp.0.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let mut clock = Clock::new(&tmp.0);
        assert!(clock.poll().is_none(), "read at the first sight");
        let snapshot = clock.poll().expect("read at the second");
        assert_eq!(names(&snapshot), ["Service web", "EndpointSlice web-1"]);
        assert!(clock.poll().is_none(), "nothing changed");
        fs::write(tmp.0.join("dns.yaml"), DNS).unwrap();
        assert!(clock.poll().is_none(), "a new file waits a poll");
        assert_eq!(names(&clock.poll().unwrap()), ["Service web", "Service dns", "EndpointSlice web-1"]);
        // A removed file goes once it has been missing twice.
        fs::remove_file(tmp.0.join("dns.yaml")).unwrap();
        assert!(clock.poll().is_none());
        assert_eq!(names(&clock.poll().unwrap()), ["Service web", "EndpointSlice web-1"]);
    }

    #[test]
    fn an_empty_directory_is_ready_after_a_poll() {
        let tmp = TempDir::new("empty");
        let mut clock = Clock::new(&tmp.0);
        assert!(clock.poll().is_none());
        assert!(names(&clock.poll().expect("an empty snapshot, so the agent is ready")).is_empty());
    }

    #[test]
    fn a_vanished_directory_changes_nothing() {
        let tmp = TempDir::new("vanish");
        let dir = tmp.0.join("manifests");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let mut clock = Clock::new(&dir);
        assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
        fs::rename(&dir, tmp.0.join("moved")).unwrap();
        for _ in 0..4 {
            assert!(clock.poll().is_none());
        }
        assert_eq!(clock.watcher.state, ManifestState { objects_kept: 2, errors: 1 });
        // Back with a change: applied once seen twice.
        fs::rename(tmp.0.join("moved"), &dir).unwrap();
        fs::write(dir.join("web.yaml"), DNS).unwrap();
        assert!(clock.poll().is_none());
        assert_eq!(names(&clock.poll().unwrap()), ["Service dns"]);
        assert_eq!(clock.watcher.state, ManifestState::default());
    }

    #[test]
    fn a_file_cut_short_is_held_until_it_settles() {
        let tmp = TempDir::new("settle");
        let file = tmp.0.join("web.yaml");
        fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let mut clock = Clock::new(&tmp.0);
        assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
        // The first of two writes: the Service alone.
        fs::write(&file, format!("{WEB}---\n")).unwrap();
        for _ in 0..8 {
            assert!(clock.poll().is_none(), "applied before it settled");
        }
        // The second write comes: nothing changes for the model.
        fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let snapshot = clock.next(30);
        assert!(snapshot.is_none_or(|s| names(&s).len() == 2));
        // Cut short for good: applied after SETTLE.
        fs::write(&file, format!("{WEB}---\n")).unwrap();
        let started = clock.now;
        let snapshot = clock.next(40).expect("applied once settled");
        assert!(clock.now - started >= SETTLE);
        assert_eq!(names(&snapshot), ["Service web"]);
    }

    #[test]
    fn errors_name_special_files_and_keep_what_they_held() {
        let tmp = TempDir::new("fifo");
        let file = tmp.0.join("web.yaml");
        fs::write(&file, format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let mut clock = Clock::new(&tmp.0);
        assert_eq!(names(&clock.next(2).unwrap()).len(), 2);
        fs::remove_file(&file).unwrap();
        let c_path = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
        let snapshot = clock.next(3).unwrap();
        assert_eq!(names(&snapshot), ["Service web", "EndpointSlice web-1"]);
        assert_eq!(
            snapshot.errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [format!(
                "{}: Service default/web, EndpointSlice default/web-1: not a regular file (a FIFO); it is not read; {KEPT}",
                file.display()
            )]
        );
        assert_eq!(clock.watcher.state, ManifestState { objects_kept: 2, errors: 1 });
    }

    /// A newcomer that claims a running Service's ClusterIP (in a file that
    /// sorts first, with a name that sorts first, or as a second copy of the
    /// Service) comes after it; once the holder goes, the newcomer has it.
    #[test]
    fn an_address_stays_with_the_service_that_held_it() {
        let tmp = TempDir::new("claims");
        fs::write(tmp.0.join("web.yaml"), format!("{WEB}---\n{WEB_SLICE}")).unwrap();
        let mut clock = Clock::new(&tmp.0);
        clock.next(2).unwrap();
        let thief = WEB.replace("name: web,", "name: aaa,");
        let copy = WEB.replace("port: 80", "port: 80, targetPort: 8080");
        fs::write(tmp.0.join("00-new.yaml"), format!("{thief}---\n{copy}")).unwrap();
        let snapshot = clock.next(2).unwrap();
        let holder = |snapshot: &Snapshot| {
            let options = crate::model::ModelOptions::default();
            let (desired, errors) =
                crate::model::build_with(&snapshot.services(), &snapshot.slices(), &options);
            let frontend = desired.frontends.iter().find(|f| f.port == 80).unwrap();
            (frontend.service.to_string(), errors.iter().map(ToString::to_string).collect::<Vec<_>>())
        };
        let (service, errors) = holder(&snapshot);
        assert_eq!(service, "default/web");
        let web_file = tmp.0.join("web.yaml").display().to_string();
        assert!(
            errors
                .iter()
                .any(|e| e.contains("Service default/aaa")
                    && e.contains("already used by Service default/web")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|e| e.contains(&format!("defined again (first in {web_file} (document 1))"))),
            "{errors:?}"
        );
        fs::remove_file(tmp.0.join("web.yaml")).unwrap();
        let snapshot = clock.next(2).unwrap();
        assert_eq!(holder(&snapshot).0, "default/aaa");
    }
}
