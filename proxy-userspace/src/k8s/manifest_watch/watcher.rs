//! The manifests path as last read, file by file: which files changed, when a read is applied, and
//! the snapshot of everything they hold, in the order objects first appeared.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use super::{
    ManifestState, Progress, SETTLE,
    merge::{Entry, FileRead, Ident, Object, looks_unfinished, merge, read},
};
use crate::{
    k8s::api_watch::Snapshot,
    k8s::manifest::{self, ManifestError},
};

/// What `stat` says of a file that any write, rename or replacement changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) mode: u32,
    pub(super) len: u64,
    pub(super) modified: (i64, i64),
    pub(super) changed: (i64, i64),
}

impl Stamp {
    pub(super) fn of(meta: &fs::Metadata) -> Self {
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

#[derive(Default)]
pub(super) struct FileState {
    /// The stamp of the read applied last (or given up on).
    pub(super) read: Option<Stamp>,
    pub(super) entries: Vec<Entry>,
    pub(super) errors: Vec<ManifestError>,
    /// The text applied last, to tell a rewrite in progress from an edit.
    pub(super) text: Option<Arc<str>>,
    /// A read that looks unfinished, applied if its file stays so.
    pub(super) held: Option<Held>,
}

pub(super) struct Held {
    pub(super) stamp: Stamp,
    pub(super) since: Instant,
    pub(super) read: FileRead,
}

impl FileState {
    pub(super) fn apply(&mut self, file: &Path, stamp: Stamp, read: FileRead) {
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
pub(super) struct Watcher {
    pub(super) root: PathBuf,
    pub(super) files: BTreeMap<PathBuf, FileState>,
    /// What the previous poll listed.
    pub(super) seen: Option<BTreeMap<PathBuf, Stamp>>,
    /// Why the path itself cannot be read now (reported once).
    pub(super) root_error: Option<ManifestError>,
    /// The order objects first appeared in (see [`Snapshot::services`]).
    pub(super) ranks: HashMap<(PathBuf, Ident), u32>,
    pub(super) next_rank: u32,
    /// The errors of the snapshot last published; `None` before the first.
    pub(super) published: Option<Vec<ManifestError>>,
    pub(super) state: ManifestState,
}

impl Watcher {
    pub(super) fn new(root: PathBuf) -> Self {
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
    pub(super) fn poll(&mut self, now: Instant, progress: &Progress) -> Option<Snapshot> {
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
    pub(super) fn root_unreadable(&mut self, error: ManifestError) {
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
    pub(super) fn forget_gone(
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
    pub(super) fn read_changed(
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
    pub(super) fn current_errors(&mut self, unreadable: &[(PathBuf, ManifestError)]) -> Vec<ManifestError> {
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
    pub(super) fn snapshot(&mut self, errors: Vec<ManifestError>) -> Snapshot {
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
